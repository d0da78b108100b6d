"""EngineArgs option checks (the attention backend choice)."""

from __future__ import annotations

import pytest
import torch

from kvflow.config import EngineArgs
from kvflow.layers.triton_attention import triton_available


def test_unknown_attention_backend_names_the_field():
    with pytest.raises(ValueError, match="attention_backend"):
        EngineArgs(attention_backend="flashinfer").verify()


def test_auto_backend_is_torch_on_the_cpu():
    assert EngineArgs(device="cpu").resolved_attention_backend() == "torch"


@pytest.mark.skipif(not triton_available(), reason="triton not installed")
def test_triton_on_the_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        EngineArgs(device="cpu", attention_backend="triton").verify()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert EngineArgs(device="cpu", attention_backend="triton").resolved_attention_backend() == "triton"


@pytest.mark.skipif(not torch.cuda.is_available() or not triton_available(), reason="needs CUDA and triton")
def test_auto_backend_is_triton_on_cuda():
    assert EngineArgs(device="cuda").resolved_attention_backend() == "triton"
