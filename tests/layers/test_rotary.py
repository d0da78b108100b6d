"""apply_rotary: the C++ kernel is bit-identical to the three PyTorch ops it replaces."""

from __future__ import annotations

import pytest
import torch

from kvflow.layers import rotary
from kvflow.layers.rotary import RotaryEmbedding, apply_rotary


def _reference(x, cos, sin):
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


@pytest.mark.skipif(rotary._EXTENSION.load() is None, reason="the C++ rotary kernel could not be built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_kernel_is_bit_identical_on_strided_heads(dtype, tokens, monkeypatch):
    """Query and key heads read in place from a fused QKV row (strided), as the model does."""
    emb = RotaryEmbedding(64, 4096, 10000.0, None)
    g = torch.Generator().manual_seed(tokens)
    qkv = (torch.randn(tokens, 15 * 64, generator=g) * 4).to(dtype)
    x = qkv[:, : 12 * 64].view(tokens, -1, 64)
    cos, sin = emb.cos_sin(torch.randint(0, 4096, (tokens,), generator=g), dtype)
    calls = []
    load = rotary._EXTENSION.load
    monkeypatch.setattr(rotary._EXTENSION, "load", lambda: calls.append(1) or load())
    with torch.inference_mode():
        got = apply_rotary(x, cos, sin)
    assert calls and torch.equal(got, _reference(x, cos, sin))


def test_other_inputs_take_the_pytorch_ops(monkeypatch):
    monkeypatch.setattr(rotary._EXTENSION, "load", lambda: pytest.fail("the kernel must not run"))
    emb = RotaryEmbedding(16, 64, 10000.0, None)
    cos, sin = emb.cos_sin(torch.arange(3), torch.float16)
    x = torch.randn(3, 2, 16).half()
    assert torch.equal(apply_rotary(x, cos, sin), _reference(x, cos, sin))  # float16
    cos, sin = emb.cos_sin(torch.arange(1), torch.float32)
    x = torch.randn(3, 2, 16)
    assert torch.equal(apply_rotary(x, cos, sin), _reference(x, cos, sin))  # tables broadcast over tokens
    cos, sin = emb.cos_sin(torch.arange(3), torch.float32)
    x = torch.randn(3, 2, 16, requires_grad=True)
    apply_rotary(x, cos, sin).sum().backward()  # autograd
    assert x.grad is not None
