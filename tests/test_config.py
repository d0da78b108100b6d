"""EngineArgs option checks (the attention backend choice)."""

from __future__ import annotations

import pytest
import torch

from kvflow.config import EngineArgs
from kvflow.layers.triton_attention import triton_available


def test_unknown_attention_backend_names_the_field():
    with pytest.raises(ValueError, match="attention_backend"):
        EngineArgs(attention_backend="flashinfer").verify()


@pytest.mark.skipif(not triton_available(), reason="triton not installed")
def test_triton_on_the_cpu_needs_the_interpreter(monkeypatch):
    import kvflow.layers.triton_attention as ta

    # tests/conftest.py set TRITON_INTERPRET=1 before the kernels were first imported
    assert ta.interpreter_enabled() == (not torch.cuda.is_available())
    monkeypatch.setattr(ta, "interpreter_enabled", lambda: False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        EngineArgs(device="cpu", attention_backend="triton").verify()
    monkeypatch.setattr(ta, "interpreter_enabled", lambda: True)
    assert EngineArgs(device="cpu", attention_backend="triton").resolved_attention_backend() == "triton"
    with pytest.raises(ValueError, match="bfloat16"):
        EngineArgs(device="cpu", attention_backend="triton", dtype="bfloat16").verify()


@pytest.mark.skipif(not torch.cuda.is_available() or not triton_available(), reason="needs CUDA and triton")
def test_auto_backend_is_triton_on_cuda():
    assert EngineArgs(device="cuda").resolved_attention_backend() == "triton"


def test_auto_backend_on_the_cpu_follows_the_kernel(monkeypatch):
    import kvflow.layers.cpu_attention as ca

    monkeypatch.setattr(ca, "cpu_kernel_available", lambda: True)
    assert EngineArgs(device="cpu").resolved_attention_backend() == "cpu"
    monkeypatch.setattr(ca, "cpu_kernel_available", lambda: False)
    assert EngineArgs(device="cpu").resolved_attention_backend() == "torch"
    with pytest.raises(ValueError, match="attention_backend='cpu'"):
        EngineArgs(device="cpu", attention_backend="cpu").verify()


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
