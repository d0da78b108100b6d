"""kvflow.platforms: the platform an engine resolves once (dtype "auto", kernel builds, the
thread governor, CUDA-graph eligibility, the chores between steps)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from kvflow import ops
from kvflow.platforms import CpuPlatform, CudaPlatform, platform_for, resolve_platform
from kvflow.platforms.cpu import start_kernel_builds


def _config(quantization=None, device="cpu", tp=1, num_threads=None, dtype=torch.float32, **kernels):
    return SimpleNamespace(device=SimpleNamespace(device=torch.device(device), num_threads=num_threads, dtype=dtype),
                           parallel=SimpleNamespace(tensor_parallel_size=tp),
                           load=SimpleNamespace(quantization=quantization, quantize_lm_head=False),
                           kernels=SimpleNamespace(enforce_eager=kernels.get("enforce_eager", False)),
                           cache=SimpleNamespace(kv_cache_groups=kernels.get("kv_cache_groups")))


# ---------------------------------------------------------------------------- which platform
def test_platform_for_a_device_and_resolved_from_the_config(monkeypatch):
    monkeypatch.setenv("KVFLOW_CPU_KERNEL_BUILD", "wait")
    assert platform_for("cpu") is CpuPlatform and platform_for(torch.device("cpu")) is CpuPlatform
    assert platform_for("cuda:1") is CudaPlatform
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda'"):
        platform_for("meta")
    platform = resolve_platform(_config())
    assert isinstance(platform, CpuPlatform) and platform.kernel_builds == []


# ---------------------------------------------------------------------------- dtype "auto"
@pytest.mark.parametrize("native, expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_dtype_on_the_cpu_follows_native_bfloat16(monkeypatch, caplog, native, expected):
    """dtype "auto" on the CPU: bfloat16 where oneDNN runs it natively, float32 elsewhere;
    logged once; CUDA keeps bfloat16; an explicit name is never overridden."""
    import kvflow.layers.linear as linear
    import kvflow.platforms.cpu as cpu

    monkeypatch.delenv("KVFLOW_CPU_AUTO_DTYPE", raising=False)
    monkeypatch.setattr(linear, "onednn_bf16_native", lambda: native)
    monkeypatch.setattr(cpu, "_auto_logged", set())
    with caplog.at_level(logging.INFO, logger="kvflow.platforms.cpu"):
        assert CpuPlatform.resolve_dtype("auto") == expected
        assert CpuPlatform.resolve_dtype("auto") == expected
    assert caplog.text.count("dtype auto: ") == 1 and str(expected).replace("torch.", "") in caplog.text
    assert CudaPlatform.resolve_dtype("auto") == torch.bfloat16
    assert CpuPlatform.resolve_dtype("float32") == torch.float32
    assert CpuPlatform.resolve_dtype("bfloat16") == torch.bfloat16
    assert CudaPlatform.resolve_dtype("float16") == torch.float16


@pytest.mark.parametrize("forced, expected", [("float32", torch.float32), ("bfloat16", torch.bfloat16)])
def test_kvflow_cpu_auto_dtype_fixes_the_choice(monkeypatch, forced, expected):
    import kvflow.layers.linear as linear

    monkeypatch.setenv("KVFLOW_CPU_AUTO_DTYPE", forced)
    for native in (True, False):
        monkeypatch.setattr(linear, "onednn_bf16_native", lambda native=native: native)
        assert platform_for("cpu").resolve_dtype("auto") == expected


def test_kvflow_cpu_auto_dtype_refuses_other_values(monkeypatch):
    monkeypatch.setenv("KVFLOW_CPU_AUTO_DTYPE", "float16")
    with pytest.raises(ValueError, match="KVFLOW_CPU_AUTO_DTYPE must be one of"):
        platform_for("cpu").resolve_dtype("auto")


def test_engine_args_take_auto_from_the_platform(monkeypatch, tmp_path):
    """``EngineArgs.create_config`` asks the device's platform what "auto" is; the KV cache
    follows the model dtype."""
    from conftest import tiny_hf_model_dir
    from kvflow.engine.arg_utils import EngineArgs

    monkeypatch.setattr(CpuPlatform, "auto_dtype", classmethod(lambda cls: torch.float16))
    config = EngineArgs(model=str(tiny_hf_model_dir(tmp_path)), device="cpu", num_kv_blocks=8).create_config()
    assert config.device.dtype == torch.float16 and config.cache.dtype == torch.float16


# ---------------------------------------------------------------------------- kernel builds
def test_a_gguf_model_builds_its_matmul_kernel_first_in_the_background(monkeypatch):
    started = []
    monkeypatch.setenv("KVFLOW_CPU_KERNEL_BUILD", "background")
    monkeypatch.setattr(ops, "start_background_builds", lambda kernels: started.append(list(kernels)) or kernels)
    start_kernel_builds(_config("gguf"))
    start_kernel_builds(_config(None))
    start_kernel_builds(_config("int8"))
    start_kernel_builds(_config(None, dtype=torch.bfloat16))  # a dense bfloat16 model: its fused decode step too
    common = [ops.PAGED_ATTENTION, ops.RMS_NORM, ops.ROTARY, ops.ACTIVATION]
    assert started == [[ops.GGUF_MATMUL, *common, ops.FUSED_DECODE], common, [*common, ops.INT8_LINEAR],
                       [*common, ops.FUSED_DECODE]]
    assert start_kernel_builds(_config(None, tp=2)) == [] and len(started) == 4  # ranks switch together
    monkeypatch.setenv("KVFLOW_CPU_KERNEL_BUILD", "wait")
    assert start_kernel_builds(_config("gguf")) == [] and len(started) == 4


def test_the_cpu_platform_starts_the_builds_and_publishes_them_between_steps(monkeypatch):
    """Resolving the CPU platform starts its kernels' builds; ``between_steps`` publishes the
    finished ones and keeps the pending ones, and has the thread governor leave a core to
    the compiler while any is pending; no thread governor under tensor parallelism."""
    published = []

    class Kernel:
        def __init__(self, done):
            self.done = done

        def pending(self):
            return not self.done

    done, building = Kernel(True), Kernel(False)
    monkeypatch.setenv("KVFLOW_CPU_KERNEL_BUILD", "background")
    monkeypatch.setattr(ops, "start_background_builds", lambda kernels: [done, building])
    monkeypatch.setattr(ops, "publish_background_builds", lambda kernels: published.append(list(kernels)))
    platform = resolve_platform(_config())
    assert platform.kernel_builds == [done, building]
    reserved = []
    platform.thread_governor = SimpleNamespace(update=lambda reserved=0: reserved_and(reserved))

    def reserved_and(r):
        reserved.append(r)
        return torch.get_num_threads()

    platform.between_steps()
    assert published == [[done, building]] and platform.kernel_builds == [building]
    building.done = True  # the last build ends: published, and the compiler's core given back
    platform.between_steps()
    assert platform.kernel_builds == [] and reserved == [1, 0]
    tp_platform = resolve_platform(_config(tp=2))
    assert tp_platform.kernel_builds == [] and tp_platform.thread_governor is None and tp_platform.get_stats() == {}


def test_an_engine_on_the_cpu_lets_the_heap_reuse_large_blocks_once_loaded(monkeypatch):
    """The worker tells its platform the model is loaded; the CPU platform then applies
    ``KVFLOW_CPU_MALLOC_REUSE`` (a byte size; 256 MiB by default, 0 off)."""
    import kvflow.platforms.cpu as cpu
    from conftest import tiny_engine

    applied = []
    monkeypatch.setattr(cpu, "reuse_large_allocations", applied.append)
    monkeypatch.delenv("KVFLOW_CPU_MALLOC_REUSE", raising=False)
    tiny_engine()
    monkeypatch.setenv("KVFLOW_CPU_MALLOC_REUSE", "64MiB")
    tiny_engine()
    monkeypatch.setenv("KVFLOW_CPU_MALLOC_REUSE", "0")
    tiny_engine()
    assert applied == [256 * 2**20, 64 * 2**20, 0]
    monkeypatch.setenv("KVFLOW_CPU_MALLOC_REUSE", "lots")
    with pytest.raises(ValueError, match="KVFLOW_CPU_MALLOC_REUSE"):
        tiny_engine()


# ---------------------------------------------------------------------------- CUDA graphs
def test_cuda_graph_eligibility_is_the_platforms():
    """Decode graphs: CUDA only, a backend with graph-safe metadata, not enforce_eager, no
    tensor parallelism, one KV cache group (no GPU needed: nothing is captured here)."""
    safe, unsafe = SimpleNamespace(supports_cuda_graphs=True), SimpleNamespace(supports_cuda_graphs=False)
    assert CudaPlatform(_config(device="cuda")).use_cuda_graphs(safe)
    assert not CudaPlatform(_config(device="cuda")).use_cuda_graphs(unsafe)
    assert not CudaPlatform(_config(device="cuda", enforce_eager=True)).use_cuda_graphs(safe)
    assert not CudaPlatform(_config(device="cuda", tp=2)).use_cuda_graphs(safe)
    assert not CudaPlatform(_config(device="cuda", kv_cache_groups=object())).use_cuda_graphs(safe)
    assert not CpuPlatform.use_cuda_graphs(CpuPlatform.__new__(CpuPlatform), safe)
