"""Quantized linear layers (``kvflow.quantization`` methods on ``kvflow.layers.linear.LinearBase``) against the float product
with their own dequantized weight.

Each layer computes y = x W_hat^T + b where W_hat is its dequantized weight; the kernels
round the activations to bfloat16 (and the dense path the weight too) and produce bfloat16
before the cast back, so the reference is x W_hat^T + b in float64 and the bound is

    |y - y_ref| <= TOL * (|y_ref| + sqrt(sum_k x_k^2 W_hat_nk^2)),   TOL = 2^-5,

elementwise: the first term covers the output / scale rounding (relative 2^-9 each), the
second the independent per-product rounding of inputs and weights (2^-9 relative each,
which adds up like a random walk). Accumulating the K products in float32 keeps the error
inside that bound whatever K; accumulating in bfloat16 does not (its error grows like K, not
sqrt(K)): ``test_bound_would_catch_bf16_accumulation`` checks that a bfloat16 accumulator
breaks it at K = 4096, so the bound is not vacuous.

Packed kernels (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``) run for at most
``INT8_PACKED_MAX_ROWS`` / ``INT4_PACKED_MAX_ROWS`` rows on the CPU; above it the weight is
dequantized to bfloat16 for a dense matmul. Both paths are checked, and against each other.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvflow.layers import cpu_linear
from kvflow.layers.linear import LinearBase
from kvflow.quantization.fp8 import FP8LinearMethod
from kvflow.quantization.int4 import INT4_PACKED_MAX_ROWS, set_int4_weights, unpack_nibbles
from kvflow.quantization.int8 import INT8_PACKED_MAX_ROWS, Int8LinearMethod
from kvflow.quantization.registry import get_quantization_config
from kvflow.quantization.schemes import dequantize_fp8, dequantize_int8, quantize_int4

TOL = 2.0**-5
KINDS = ["int8", "int4-g32", "int4-g64", "int4-g128", "fp8"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def make_layer(kind: str, k: int, n: int, bias: bool, seed: int = 0) -> tuple[nn.Module, nn.Linear]:
    torch.manual_seed(seed)
    linear = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        linear.weight.normal_(0.0, k**-0.5)
        if bias:
            linear.bias.normal_(0.0, 1.0)
    return from_float(linear, kind), linear


def from_float(linear: nn.Linear, kind: str) -> LinearBase:
    """A quantized layer of scheme ``kind`` ("int8", "fp8", "int4-g<group>") over linear's weights."""
    method, _, group = kind.partition("-g")
    config = get_quantization_config(method, int(group) if group else 32)
    return LinearBase.from_weights(linear.weight.data, None if linear.bias is None else linear.bias.data, config)


def dequantized(layer: nn.Module) -> torch.Tensor:
    if isinstance(layer.quant_method, Int8LinearMethod):
        return dequantize_int8(layer.weight, layer.scale)
    if isinstance(layer.quant_method, FP8LinearMethod):
        return dequantize_fp8(layer.weight, layer.scale)
    return layer.quant_method.dequantized(layer, torch.float32)


def reference(layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 x W_hat^T + b and the per-element scale of the bound."""
    w = dequantized(layer).double()
    xd = x.double()
    y = xd @ w.t()
    if layer.bias is not None:
        y = y + layer.bias.double()
    spread = ((xd**2) @ (w**2).t()).sqrt()
    return y, y.abs() + spread


def normalized_error(y: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor) -> float:
    """max |y - ref| / scale; the bound is TOL."""
    return float(((y.double() - ref).abs() / scale).max())


def ops_called(fn) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages()}


# ---------------------------------------------------------------------------- accuracy


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 16, 64, 300])  # 300: above both packed limits (dense path)
@pytest.mark.parametrize("kind", KINDS)
def test_matches_float_reference(kind, rows, bias):
    layer, _ = make_layer(kind, 512, 96, bias)
    x = torch.randn(rows, 512)
    y = layer(x)
    assert y.shape == (rows, 96) and y.dtype == torch.float32
    ref, scale = reference(layer, x)
    err = normalized_error(y, ref, scale)
    assert err <= TOL, f"{kind} rows={rows} bias={bias}: {err / TOL:.2f} x the bound"


@pytest.mark.parametrize("rows", [1, 16, 64, 300])
@pytest.mark.parametrize("kind", KINDS)
def test_long_k_accumulates_in_fp32(kind, rows):
    """K = 4096: the error stays inside the same bound, and does not grow much from K = 256
    (float32 accumulation; a bfloat16 accumulator grows it several-fold, see below)."""
    errs = {}
    for k in (256, 4096):
        layer, _ = make_layer(kind, k, 64, bias=True, seed=k)
        x = torch.randn(rows, k)
        ref, scale = reference(layer, x)
        errs[k] = normalized_error(layer(x), ref, scale)
    assert errs[4096] <= TOL, f"{kind} rows={rows}: {errs[4096] / TOL:.2f} x the bound at K=4096"
    assert errs[4096] <= 3 * errs[256] + TOL / 4, errs


def test_bound_would_catch_bf16_accumulation():
    """The bound is discriminating: the same products summed into a bfloat16 accumulator
    (4 products at a time, in float32) break it at K = 4096 (by ~2.4x; the layers stay
    below ~0.5x of it)."""
    torch.manual_seed(0)
    layer, _ = make_layer("int8", 4096, 256, bias=False)
    x = torch.randn(1, 4096)
    w = dequantized(layer)
    xb, wb = x.bfloat16().float(), w.bfloat16().float()
    acc = torch.zeros(1, 256, dtype=torch.bfloat16)
    for c in range(0, 4096, 4):
        acc = (acc.float() + xb[:, c : c + 4] @ wb[:, c : c + 4].t()).bfloat16()
    ref, scale = reference(layer, x)
    assert normalized_error(acc.float(), ref, scale) > 1.5 * TOL


@pytest.mark.parametrize("kind", KINDS)
def test_bfloat16_input_gives_bfloat16_output(kind):
    layer, _ = make_layer(kind, 256, 32, bias=True)
    for rows in (2, 8):
        x = torch.randn(rows, 256).bfloat16()
        y = layer(x)
        assert y.dtype == torch.bfloat16
        ref, scale = reference(layer, x.float())
        assert normalized_error(y.float(), ref, scale) <= 2 * TOL


# ---------------------------------------------------------------------------- kernel paths


@pytest.mark.parametrize(
    "kind, op",
    [("int8", "aten::_weight_int8pack_mm"), ("int4-g32", "aten::_weight_int4pack_mm_for_cpu"),
     ("int4-g128", "aten::_weight_int4pack_mm_for_cpu")],
)
def test_packed_path_up_to_max_rows_then_dense(kind, op, monkeypatch):
    monkeypatch.setattr(cpu_linear, "int8_available", lambda: False)  # PyTorch's INT8 kernel
    layer, _ = make_layer(kind, 512, 96, bias=False)
    max_rows = _max_rows(kind)
    assert op in ops_called(lambda: layer(torch.randn(1, 512)))
    assert op in ops_called(lambda: layer(torch.randn(max_rows, 512)))
    assert op not in ops_called(lambda: layer(torch.randn(max_rows + 1, 512)))


@pytest.mark.skipif(not cpu_linear.int8_available(), reason="kvflow's INT8 kernel is not built / not supported here")
def test_int8_takes_kvflow_kernel_up_to_max_rows(monkeypatch):
    """Where kvflow's C++ INT8 kernel runs, the INT8 method sends it up to INT8_PACKED_MAX_ROWS
    rows (PyTorch's kernel is not called), and agrees with PyTorch's kernel."""
    calls = []
    kernel = cpu_linear.int8_linear
    monkeypatch.setattr(cpu_linear, "int8_linear", lambda *a: calls.append(a[0].shape[0]) or kernel(*a))
    layer, _ = make_layer("int8", 512, 96, bias=True)
    for rows in (1, 3, INT8_PACKED_MAX_ROWS):
        x = torch.randn(rows, 512)
        assert "aten::_weight_int8pack_mm" not in ops_called(lambda: layer(x))
        ours = layer(x)
        with monkeypatch.context() as m:
            m.setattr(cpu_linear, "int8_available", lambda: False)
            theirs = layer(x)
        # PyTorch's kernel rounds the activations and the scale to bfloat16; ours keeps float32.
        torch.testing.assert_close(ours, theirs, rtol=2e-2, atol=2e-2 * float(theirs.abs().max()))
    assert calls == [1, 1, 3, 3, INT8_PACKED_MAX_ROWS, INT8_PACKED_MAX_ROWS]
    layer(torch.randn(INT8_PACKED_MAX_ROWS + 1, 512))
    assert len(calls) == 6


def _max_rows(kind: str) -> int:
    return INT8_PACKED_MAX_ROWS if kind == "int8" else INT4_PACKED_MAX_ROWS


@pytest.mark.parametrize("kind", ["int8", "int4-g32", "int4-g64", "int4-g128"])
def test_packed_and_dense_paths_agree(kind):
    """The same rows through the packed kernel (4 rows) and through the dense bfloat16
    matmul (inside a batch one row over the packed limit) agree within bfloat16 rounding."""
    layer, _ = make_layer(kind, 1536, 576, bias=True)
    x = torch.randn(_max_rows(kind) + 1, 1536)
    dense = layer(x)[:4]
    packed = layer(x[:4])
    _, scale = reference(layer, x[:4])
    assert float(((packed - dense).double().abs() / scale).max()) <= TOL
    # and both are close to each other in plain terms: a few bfloat16 ulps of the output
    torch.testing.assert_close(packed, dense, rtol=2.0**-6, atol=2.0**-6 * float(dense.abs().max()))


def test_fp8_always_dense():
    layer, _ = make_layer("fp8", 256, 32, bias=False)
    ops = ops_called(lambda: layer(torch.randn(1, 256)))
    assert not any("pack_mm" in op for op in ops)


def test_shapes_outside_packed_kernel_limits_fall_back_to_dense():
    """_weight_int8pack_mm needs K % 16 == 0 (it crashes the process otherwise), the int4
    kernel N % 16 == 0 and a group of 32..256: other shapes take the dense path."""
    cases = [("int8", 40, 24), ("int8", 8, 3)]
    for kind, k, n in cases:
        layer, _ = make_layer(kind, k, n, bias=True)
        x = torch.randn(2, k)
        ref, scale = reference(layer, x)
        assert normalized_error(layer(x), ref, scale) <= TOL
    torch.manual_seed(0)
    for k, n, g in [(64, 24, 32), (48, 32, 16), (40, 16, 8)]:
        layer = from_float(nn.Linear(k, n), f"int4-g{g}")
        x = torch.randn(3, k)
        ref, scale = reference(layer, x)
        assert normalized_error(layer(x), ref, scale) <= TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["int8", "int4-g32"])
def test_non_contiguous_input(kind, dtype):
    """The packed kernels refuse a non-contiguous A (a bfloat16 input is not copied by the
    cast, so a column slice reached them as is)."""
    layer, _ = make_layer(kind, 256, 32, bias=False)
    wide = torch.randn(2, 512).to(dtype)
    x = wide[:, ::2]
    assert not x.is_contiguous()
    torch.testing.assert_close(layer(x), layer(x.contiguous()), rtol=0, atol=0)


# ---------------------------------------------------------------------------- storage


def test_int4_packing_round_trip():
    torch.manual_seed(0)
    w = torch.randn(32, 128)
    q, scale, zero = quantize_int4(w, 64)
    layer = from_float(nn.Linear(128, 32, bias=False), "int4-g64")
    set_int4_weights(layer, q, scale, zero)
    assert layer.qweight.shape == (32, 64) and layer.qweight.dtype == torch.uint8
    assert torch.equal(unpack_nibbles(layer.qweight), q)
    assert torch.equal(layer.qweight & 0x0F, q[:, 0::2])  # low nibble first


def test_module_dtype_casts_keep_quantized_storage():
    """model.to(dtype) (the engine's load path calls it on quantized checkpoints) must not
    widen FP8 weights to the model dtype nor round float32 scales."""
    layers = nn.ModuleList([make_layer(k, 128, 32, bias=True)[0] for k in ("int8", "int4-g64", "fp8")])
    before = {k: v.clone() for k, v in layers.state_dict().items() if not k.endswith("bias")}
    layers.to(dtype=torch.bfloat16)
    layers.half()
    layers.float()
    after = layers.state_dict()
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype, name
        assert torch.equal(after[name].view(torch.uint8), tensor.view(torch.uint8)), name
    assert layers[2].weight.dtype == torch.float8_e4m3fn
    x = torch.randn(2, 128)
    for layer in layers:
        assert layer(x).dtype == torch.float32
