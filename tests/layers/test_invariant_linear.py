"""InvariantLinear: y = x W^T + b whose rows do not depend on the other rows of the call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvflow.layers.invariant_linear import InvariantLinear, invariant_linear_available, pack_panels

pytestmark = pytest.mark.skipif(not invariant_linear_available(), reason="the C++ kernel could not be built here")


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("k, n, bias", [(64, 128, True), (576, 1536, False), (48, 100, True), (16, 7, True)])
def test_matches_float64_and_rows_do_not_depend_on_the_batch(dtype, tol, k, n, bias):
    torch.manual_seed(0)
    linear = nn.Linear(k, n, bias=bias).to(dtype)
    layer = InvariantLinear.from_module(linear)
    x = torch.randn(70, k).to(dtype)
    y = layer(x)
    assert y.dtype == dtype and y.shape == (70, n)
    exact = F.linear(x.double(), linear.weight.double(), None if not bias else linear.bias.double())
    torch.testing.assert_close(y.double(), exact, atol=tol, rtol=tol)
    # every row as computed in any call: alone, in short or long batches, at any offset
    for rows in (1, 2, 3, 4, 5, 7, 9, 16, 33):
        for offset in (0, 1, 6):
            assert torch.equal(layer(x[offset : offset + rows]), y[offset : offset + rows]), (rows, offset)


def test_rows_do_not_depend_on_the_thread_count():
    torch.manual_seed(1)
    layer = InvariantLinear.from_module(nn.Linear(320, 999))
    x = torch.randn(13, 320)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = layer(x)
        torch.set_num_threads(2)
        two = layer(x)
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(one, two)


def test_mkl_linear_is_not_batch_invariant_here_or_skip():
    """Why the kernel exists: F.linear's rows depend on the row count (1-3 rows take other
    kernels than 4+ in MKL's SGEMM). Skipped where the BLAS happens to be invariant."""
    torch.manual_seed(2)
    w, x = torch.randn(1536, 576), torch.randn(64, 576)
    full = F.linear(x, w)
    if all(torch.equal(F.linear(x[:m], w), full[:m]) for m in (1, 2, 3, 5, 7, 9)):
        pytest.skip("this BLAS gives the same rows at every row count")
    layer = InvariantLinear(w)
    assert all(torch.equal(layer(x[:m]), layer(x)[:m]) for m in (1, 2, 3, 5, 7, 9))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_round_trip_state_dict_and_bad_weights(dtype):
    torch.manual_seed(3)
    linear = nn.Linear(32, 40).to(dtype)
    layer = InvariantLinear.from_module(linear)
    assert torch.equal(layer.dense_weight(), linear.weight.data)
    assert pack_panels(linear.weight.data).shape == (3, 32, 16)
    assert pack_panels(linear.weight.data, pairs=True).shape == (3, 16, 16, 2)
    state = layer.state_dict()
    assert torch.equal(state["weight"], linear.weight.data) and torch.equal(state["bias"], linear.bias.data)
    assert layer.bias is not None  # LlamaAttention._key_offset reads the bias by this name
    with pytest.raises(ValueError, match="float32/bfloat16"):
        InvariantLinear(torch.zeros(4, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="2-D"):
        InvariantLinear(torch.zeros(4))
