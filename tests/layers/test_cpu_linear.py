"""kvflow's C++ weight-only INT8 kernel against a float64 reference of the same weights."""

from __future__ import annotations

import pytest
import torch

from kvflow.layers.cpu_linear import MAX_ROWS, int8_available, int8_linear
from kvflow.quantization.schemes import quantize_int8

pytestmark = pytest.mark.skipif(not int8_available(), reason="kvflow's INT8 kernel is not built / not supported here")


def _case(n, k, rows, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    weight, scale = quantize_int8(torch.randn(n, k, generator=g))
    x = torch.randn(rows, k, generator=g).to(dtype)
    ref = x.double() @ (weight.double() * scale.double()[:, None]).t()
    return x, weight, scale, ref


@pytest.mark.parametrize("n, k", [(960, 576), (576, 1536), (17, 64), (5, 16), (33, 4096)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 13, MAX_ROWS])  # tiles of 16 / rows channels; groups of four rows
def test_float32_matches_reference(n, k, rows):
    """float32 in, float32 out, float32 accumulation: within float32 rounding of a K-long sum
    (channel counts that leave a partial last tile included)."""
    x, weight, scale, ref = _case(n, k, rows, torch.float32)
    y = int8_linear(x, weight, scale)
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    bound = 1e-6 * (x.double().abs() @ (weight.double().abs() * scale.double()[:, None]).t())
    assert bool(((y.double() - ref).abs() <= bound + 1e-12).all())


@pytest.mark.parametrize("rows", [1, 4, 7])
def test_bfloat16_in_bfloat16_out(rows):
    """bfloat16 activations are widened (exactly) and the float32 result rounded once."""
    x, weight, scale, _ = _case(576, 1536, rows, torch.bfloat16, seed=1)
    y = int8_linear(x, weight, scale)
    assert y.dtype == torch.bfloat16
    want = (x.double() @ (weight.double() * scale.double()[:, None]).t()).to(torch.bfloat16)
    torch.testing.assert_close(y, want, rtol=2.0**-7, atol=1e-3)


def test_strided_rows_are_read_in_place():
    """Rows with a stride (a slice of a wider activation) give the same result as a copy."""
    x, weight, scale, _ = _case(64, 128, 3, torch.float32)
    wide = torch.randn(3, 256)
    wide[:, 64:192] = x
    torch.testing.assert_close(int8_linear(wide[:, 64:192], weight, scale), int8_linear(x, weight, scale))


def test_bad_inputs_raise():
    x, weight, scale, _ = _case(32, 64, 2, torch.float32)
    with pytest.raises(RuntimeError, match="K % 16"):
        int8_linear(torch.randn(2, 40), torch.zeros(32, 40, dtype=torch.int8), scale)
    with pytest.raises(RuntimeError, match="K > 0"):
        int8_linear(torch.randn(2, 0), torch.zeros(32, 0, dtype=torch.int8), scale)
    with pytest.raises(RuntimeError, match="weight"):
        int8_linear(x, weight.float(), scale)
    with pytest.raises(RuntimeError, match="scale"):
        int8_linear(x, weight, scale[:5])
    with pytest.raises(RuntimeError, match="rows"):
        int8_linear(torch.randn(MAX_ROWS + 1, 64), weight, scale)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        int8_linear(x.half(), weight, scale)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        int8_linear(x.t().contiguous().t(), weight, scale)
