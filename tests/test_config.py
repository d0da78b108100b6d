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
