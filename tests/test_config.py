"""EngineArgs option checks and the EngineConfig made from them."""

from __future__ import annotations

import pytest
import torch

from kvflow.engine.arg_utils import EngineArgs


def test_unknown_attention_backend_names_the_field():
    with pytest.raises(ValueError, match="attention_backend"):
        EngineArgs(attention_backend="flashinfer").verify()


def test_collective_timeout_field_then_environment_then_default(monkeypatch):
    from kvflow.config import DEFAULT_COLLECTIVE_TIMEOUT_S

    monkeypatch.delenv("KVFLOW_COLLECTIVE_TIMEOUT_S", raising=False)
    assert EngineArgs().resolved_collective_timeout_s() == DEFAULT_COLLECTIVE_TIMEOUT_S
    monkeypatch.setenv("KVFLOW_COLLECTIVE_TIMEOUT_S", "900")
    assert EngineArgs().resolved_collective_timeout_s() == 900.0
    assert EngineArgs(collective_timeout_s=30).resolved_collective_timeout_s() == 30.0
    for bad in ("soon", "0", "-5", "inf"):
        monkeypatch.setenv("KVFLOW_COLLECTIVE_TIMEOUT_S", bad)
        with pytest.raises(ValueError, match="KVFLOW_COLLECTIVE_TIMEOUT_S"):
            EngineArgs().resolved_collective_timeout_s()
    for bad in (0, -1, float("inf"), float("nan"), True, "60"):
        with pytest.raises(ValueError, match="collective_timeout_s"):
            EngineArgs(collective_timeout_s=bad).verify()


def test_byte_sizes_are_accepted_as_users_write_them():
    args = EngineArgs(kv_cache_memory_bytes="1GiB", swap_space_bytes="512MiB")
    assert (args.kv_cache_memory_bytes, args.swap_space_bytes) == (2**30, 512 * 2**20)
    assert EngineArgs(kv_cache_memory_bytes=4096).kv_cache_memory_bytes == 4096
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        EngineArgs(kv_cache_memory_bytes="lots")
    with pytest.raises(ValueError, match="swap_space_bytes"):
        EngineArgs(swap_space_bytes="-1GiB")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_cuda_device_without_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match="device='cuda', but (this PyTorch build has no CUDA support|no CUDA device)"):
        EngineArgs(device="cuda").verify()


def test_every_field_is_documented_once():
    """The fields' help metadata is the one source of their documentation."""
    from dataclasses import fields

    for f in fields(EngineArgs):
        assert f.metadata.get("help"), f.name
        assert f"        {f.name}: " in EngineArgs.__doc__
    assert EngineArgs.help_text("block_size") == "tokens per KV cache block"


def test_model_help_names_every_packaged_model():
    # --model's help listed three of the four packaged short names (gemma3-270m was missing)
    from kvflow.model.packages import REGISTRY

    for name in REGISTRY:
        assert name in EngineArgs.help_text("model"), name


def test_create_config_builds_the_whole_engine_config(tmp_path):
    """One EngineConfig from EngineArgs: the model's architecture with max_model_len, the
    block pool sized from the budget by the one KV-bytes formula, and every group of options."""
    from conftest import tiny_hf_model_dir

    folder = tiny_hf_model_dir(tmp_path / "m")
    args = EngineArgs(model=str(folder), device="cpu", dtype="float32", kv_cache_memory_bytes="1MiB", block_size=8,
                      max_model_len=128, max_num_seqs=5, tensor_parallel_size=1, attention_backend="torch", seed=7)
    config = args.create_config()
    assert config.model.max_model_len == 128 and config.scheduler.max_model_len == 128
    assert config.scheduler.max_num_seqs == 5 and config.seed == 7
    per_block = config.model.kv_cache_spec().bytes_per_token(torch.float32) * 8
    assert config.cache.num_blocks == 2**20 // per_block and config.cache.block_size == 8
    assert config.device.dtype == torch.float32 and config.kernels.attention_backend == "torch"
    assert config.load.model_dir == str(folder.resolve()) and config.speculative is None
    with pytest.raises(ValueError, match="max_model_len"):
        EngineArgs(model=str(folder), device="cpu", max_model_len=10**6).create_config()


def test_the_engine_builds_from_the_resolved_config_without_resolving_again(tmp_path, monkeypatch):
    """Resolution (folder -> transformers config -> ModelConfig) happens in create_config
    only: the engine, its worker, the loader and the draft proposer take the resolved
    EngineConfig and read no model config again."""
    from conftest import tiny_hf_model_dir
    from kvflow import SamplingParams
    from kvflow.engine.llm_engine import LLMEngine
    from kvflow.model import registry, resolve

    folder = tiny_hf_model_dir(tmp_path / "m")
    config = EngineArgs(model=str(folder), device="cpu", dtype="float32", num_kv_blocks=32, block_size=4,
                        attention_backend="torch", max_model_len=64,
                        speculative_config={"method": "draft_model", "model": str(folder),
                                            "num_speculative_tokens": 2}).create_config()

    def resolved_again(*args, **kwargs):
        raise AssertionError("the model config was resolved again after create_config")

    for module, name in ((resolve, "load_config"), (resolve, "resolve_model"), (registry, "model_config")):
        monkeypatch.setattr(module, name, resolved_again)
    engine = LLMEngine(config)
    engine.add_request("r", [1, 2, 3, 4, 5], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        outputs = engine.step()
    assert len(outputs[0].outputs[0].token_ids) == 4


def test_resolve_dtype_maps_names_and_leaves_auto_to_the_platform():
    from kvflow.config import resolve_dtype, resolve_kv_cache_dtype

    assert resolve_dtype("float32") == torch.float32 and resolve_dtype("bf16") == torch.bfloat16
    assert resolve_dtype(torch.float16) == torch.float16
    with pytest.raises(ValueError, match="platform"):
        resolve_dtype("auto")
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("float64")
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("int8", torch.bfloat16) == torch.int8


@pytest.mark.parametrize("packs, avx512_bf16, amx, cap, native", [
    (True, True, False, None, True),                  # e.g. AMD Zen 4: AVX512-BF16
    (True, False, True, None, True),                  # AMX tiles (Intel Sapphire Rapids)
    (True, False, False, None, False),                # AVX-512 without BF16: emulated
    (False, True, False, None, False),                # oneDNN does not pack bfloat16 at all
    (True, True, False, "AVX2", False),               # the README's AVX2 pass
    (True, True, False, "avx512_core", False),        # capped below AVX512_CORE_BF16
    (True, True, False, "AVX512_CORE_BF16", True),
])
def test_onednn_bf16_native(monkeypatch, packs, avx512_bf16, amx, cap, native):
    import kvflow.layers.linear as linear

    monkeypatch.setattr(linear, "onednn_packs", lambda dtype: packs and dtype == torch.bfloat16)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    if cap is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    assert linear.onednn_bf16_native() is native


def test_a_kv_cache_larger_than_the_memory_is_refused_by_name(tmp_path, monkeypatch):
    """On the CPU the pool is resident from the start: one that cannot fit the available
    memory is a ValueError naming the field that sized it, not the OOM killer."""
    import collections

    import psutil
    from conftest import tiny_hf_model_dir

    folder = tiny_hf_model_dir(tmp_path / "m")
    mem = collections.namedtuple("mem", "available")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: mem(available=2**20))  # 1 MiB left
    kw = dict(model=str(folder), device="cpu", dtype="float32", block_size=8, attention_backend="torch")
    with pytest.raises(ValueError, match=r"num_kv_blocks=200000: the KV cache needs .* GiB \(200000 blocks\)"):
        EngineArgs(num_kv_blocks=200000, **kw).create_config()
    with pytest.raises(ValueError, match="kv_cache_memory_bytes=2097152: .* available on this machine"):
        EngineArgs(kv_cache_memory_bytes="2MiB", **kw).create_config()
    with pytest.raises(ValueError, match="swap space"):
        EngineArgs(num_kv_blocks=2, preemption_mode="swap", swap_space_bytes="4MiB", **kw).create_config()
    config = EngineArgs(num_kv_blocks=2, **kw).create_config()  # a pool that fits is built as before
    assert config.cache.num_blocks == 2


def test_a_swap_space_without_a_block_is_refused_by_name(tmp_path):
    """--preemption-mode swap with a swap space smaller than one block had 0 host blocks:
    every preemption quietly recomputed."""
    from conftest import tiny_hf_model_dir

    kw = dict(model=str(tiny_hf_model_dir(tmp_path / "m")), device="cpu", dtype="float32", block_size=8,
              num_kv_blocks=4, attention_backend="torch", preemption_mode="swap")
    with pytest.raises(ValueError, match=r"swap_space_bytes=4 \(swap_space=3.72529e-09 GiB\) holds no block of \d+ bytes"):
        EngineArgs(swap_space_bytes=4, **kw).create_config()
    # vLLM's swap_space (GiB) reaches the check in bytes: the message names it too
    with pytest.raises(ValueError, match=r"\(swap_space=0 GiB\) holds no block"):
        EngineArgs(swap_space_bytes=0, **kw).create_config()
    assert EngineArgs(swap_space_bytes="1MiB", **kw).create_config().cache.num_cpu_blocks >= 1


@pytest.mark.parametrize("seed", ["x", None, 1.5, True, 2**63, -(2**63) - 1])
def test_a_seed_that_is_not_a_64_bit_integer_names_the_field(seed):
    """LLM(seed="x") failed while loading, in torch ("manual_seed expected a long, but got
    str"); it is a ValueError naming seed."""
    with pytest.raises(ValueError, match="^seed must be an integer"):
        EngineArgs(seed=seed).verify()
    EngineArgs(seed=-1).verify()
    EngineArgs(seed=2**63 - 1).verify()


@pytest.mark.parametrize("name", ["enable_prefix_caching", "disable_hybrid_kv_cache_manager", "enforce_eager", "enable_lora"])
@pytest.mark.parametrize("value", ["no", "false", 0, None])
def test_a_switch_that_is_not_a_bool_names_the_field(name, value):
    """LLM(enable_prefix_caching="no") was accepted, and the truthy string left prefix
    caching on; a switch takes True or False only."""
    with pytest.raises(ValueError, match=f"^{name} must be True or False"):
        EngineArgs(**{name: value}).verify()
    EngineArgs(**{name: False}).verify()


@pytest.mark.parametrize("value", [5, b"dir", ["a"]])
def test_a_model_cache_dir_that_is_not_a_path_names_the_field(value, tmp_path):
    """LLM(model_cache_dir=5) raised os's TypeError ("expected str, bytes or os.PathLike
    object, not int") while resolving the model; it is a ValueError naming the field."""
    with pytest.raises(ValueError, match="^model_cache_dir must be a folder path"):
        EngineArgs(model_cache_dir=value).verify()
    EngineArgs(model_cache_dir=str(tmp_path)).verify()
    EngineArgs(model_cache_dir=tmp_path).verify()


def test_more_threads_than_the_machine_has_cpus_is_refused_by_name(monkeypatch):
    """LLM(num_threads=10**6) passed verify; torch.set_num_threads took it, OpenMP could not
    start the threads and the process crashed (segmentation fault). More threads than the
    machine's CPUs (8 a CPU: oversubscription is allowed) is a ValueError naming the field."""
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    with pytest.raises(ValueError, match="^num_threads must be at most 8 x this machine's 4 CPUs = 32, got 33"):
        EngineArgs(num_threads=33).verify()
    EngineArgs(num_threads=32).verify()
    with pytest.raises(ValueError, match="^num_threads must be at most"):
        EngineArgs(num_threads=10**6).verify()
