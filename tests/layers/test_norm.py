"""RMSNorm: the C++ kernel against PyTorch's composite, and the module's dispatch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvflow.layers import norm
from kvflow.layers.norm import RMSNorm, cpu_rms_norm, cpu_rms_norm_available

needs_kernel = pytest.mark.skipif(not cpu_rms_norm_available(), reason="the C++ RMSNorm kernel could not be built here")


@needs_kernel
@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("hidden", [576, 33])
def test_float32_matches_composite(rows, hidden):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, hidden, generator=g) * 5
    w = torch.rand(hidden, generator=g) + 0.5
    torch.testing.assert_close(cpu_rms_norm(x, w, 1e-6), F.rms_norm(x, (hidden,), w, 1e-6), rtol=2e-6, atol=1e-6)


@needs_kernel
def test_bfloat16_within_one_rounding_of_composite():
    """The same float32 arithmetic and the single rounding of PyTorch's fused kernel; the
    sum of squares may differ in its last bits, which can move a result by one step."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 576, generator=g) * 3).bfloat16()
    w = (torch.rand(576, generator=g) + 0.5).bfloat16()
    got, want = cpu_rms_norm(x, w, 1e-5), F.rms_norm(x, (576,), w, 1e-5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2.0**-7, atol=1e-6)
    assert (got != want).float().mean() < 0.01  # observed: none


@needs_kernel
def test_strided_rows_and_bad_inputs():
    x = torch.randn(4, 128)
    w = torch.rand(64) + 0.5
    torch.testing.assert_close(cpu_rms_norm(x[:, 32:96], w, 1e-6), F.rms_norm(x[:, 32:96].contiguous(), (64,), w, 1e-6))
    with pytest.raises(RuntimeError, match="share a dtype"):
        cpu_rms_norm(x[:, :64], w.double(), 1e-6)
    with pytest.raises(RuntimeError, match="weight"):
        cpu_rms_norm(x, w, 1e-6)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        cpu_rms_norm(x.t(), torch.rand(4), 1e-6)


@pytest.mark.filterwarnings("ignore:Mismatch dtype")  # the float16 case, by design
def test_module_uses_the_kernel_only_where_it_applies(monkeypatch):
    calls = []
    monkeypatch.setattr(norm, "cpu_rms_norm_available", lambda: True)
    monkeypatch.setattr(norm, "cpu_rms_norm", lambda x, w, eps: calls.append(x.shape) or F.rms_norm(x, w.shape, w, eps))
    layer = RMSNorm(16, 1e-6)
    with torch.no_grad():
        layer(torch.randn(3, 16))  # 2-D float32 inference: kernel
        layer(torch.randn(2, 3, 16))  # 3-D: composite
        layer(torch.randn(3, 16).half())  # float16: composite
    layer(torch.randn(3, 16, requires_grad=True))  # autograd: composite
    assert calls == [(3, 16)]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [576, 40, 33])
def test_add_rms_norm_is_the_add_then_the_norm(dtype, hidden):
    """The fused residual add writes x + residual rounded to the dtype (the separate add's
    value, bit for bit) and norms that rounded sum exactly as rms_norm does."""
    g = torch.Generator().manual_seed(hidden)
    x = (torch.randn(300, hidden, generator=g) * 4).to(dtype)
    r = (torch.randn(300, hidden, generator=g) * 4).to(dtype)
    w = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    s, y = norm.cpu_add_rms_norm(x, r, w, 1e-6)
    assert s.dtype == y.dtype == dtype
    assert torch.equal(s, x + r)
    assert torch.equal(y, cpu_rms_norm(x + r, w, 1e-6))
    want = F.rms_norm((x + r).float(), (hidden,), w.float(), 1e-6)
    torch.testing.assert_close(y.float(), want, rtol=2.0**-7 if dtype == torch.bfloat16 else 2e-6, atol=1e-5)


@needs_kernel
def test_add_rms_norm_strided_rows_and_bad_inputs():
    x, r = torch.randn(4, 128), torch.randn(4, 96)
    w = torch.rand(64) + 0.5
    s, y = norm.cpu_add_rms_norm(x[:, 32:96], r[:, :64], w, 1e-6)
    assert torch.equal(s, x[:, 32:96] + r[:, :64])
    assert torch.equal(y, cpu_rms_norm(s, w, 1e-6))
    with pytest.raises(RuntimeError, match="residual"):
        norm.cpu_add_rms_norm(x[:, :64], r[:3, :64], w, 1e-6)
    with pytest.raises(RuntimeError, match="share a dtype"):
        norm.cpu_add_rms_norm(x[:, :64], r[:, :64].bfloat16(), w, 1e-6)


def test_forward_with_residual_uses_the_fused_kernel_only_where_it_applies(monkeypatch):
    calls = []
    monkeypatch.setattr(norm, "cpu_rms_norm_available", lambda: True)
    monkeypatch.setattr(norm, "cpu_add_rms_norm",
                        lambda x, r, w, eps: calls.append(x.shape) or (r + x, F.rms_norm(r + x, w.shape, w, eps)))
    monkeypatch.setattr(norm, "cpu_rms_norm", lambda x, w, eps: F.rms_norm(x, w.shape, w, eps))
    layer = RMSNorm(16, 1e-6)
    with torch.no_grad():
        x, r = torch.randn(3, 16), torch.randn(3, 16)
        s, y = layer.forward_with_residual(x, r)  # 2-D float32 inference: the fused kernel
        assert torch.equal(s, r + x) and torch.equal(y, F.rms_norm(r + x, (16,), layer.weight, 1e-6))
        layer.forward_with_residual(torch.randn(2, 3, 16), torch.randn(2, 3, 16))  # 3-D: add, then forward
        layer.forward_with_residual(x, r.bfloat16())  # mixed dtypes: add, then forward
    assert calls == [(3, 16)]
