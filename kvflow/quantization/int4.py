"""Weight-only INT4, group-wise: W ~= (q - 8) * scale + zero per group of ``group_size``
input channels (``schemes.quantize_int4``, round-to-nearest). Its AWQ variant (the same
storage after activation-aware rescaling) is ``awq.AWQConfig``.

Buffers: qweight uint8 [N, K / 2] (two 4-bit values per byte, low nibble first), scale and
zero float32 [N, K / group_size]. On the CPU, up to ``INT4_PACKED_MAX_ROWS`` rows, a copy in
PyTorch's packed layout (same size, made on first use) feeds
``aten._weight_int4pack_mm_for_cpu``; above it, and on CUDA, the weight is dequantized to
bfloat16 for the call. Measured with ``python -m benchmarks.micro_linear`` on an 8960 x 1536
weight: packed 2.9 / 11.5 / 46.0 ms at 16 / 64 / 256 rows vs ~60 ms dequantized.
"""

from __future__ import annotations

import torch

from kvflow.quantization.base import (
    FusedMoEMethodBase,
    COMPUTE_DTYPE,
    LinearMethodBase,
    QuantizationConfig,
    create_bias,
    create_float_weights,
    dense_matmul,
    finish,
    kernel_input,
    replace_float_weight,
)
from kvflow.quantization.schemes import quantize_int4

INT4_PACKED_MAX_ROWS = 256
# Shape limits of PyTorch's packed INT4 CPU kernels (aten/src/ATen/native/cpu/int4mm_kernel.cpp):
# _convert_weight_to_int4pack_for_cpu needs N % 16 == 0 and _weight_int4pack_mm_for_cpu a
# group size of 32, 64, 128 or 256 (``group_size_for`` can pick 16 or 8). Outside: dense path.
_INT4_PACK_N_MULTIPLE = 16
_INT4_PACK_GROUP_SIZES = (32, 64, 128, 256)


def group_size_for(in_features: int, group_size: int) -> int:
    """The largest of group_size, group_size / 2, ... (>= 8) dividing in_features.

    Raises:
        ValueError: when none does.
    """
    g = group_size
    while g >= 8:
        if in_features % g == 0:
            return g
        g //= 2
    raise ValueError(f"no INT4 group size <= {group_size} divides in_features={in_features}")


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] values in [0, 15] -> [N, K / 2], low nibble first."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)


def unpack_nibbles(qweight: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K / 2] -> q uint8 [N, K] in [0, 15]."""
    q = torch.empty(qweight.shape[0], qweight.shape[1] * 2, dtype=torch.uint8, device=qweight.device)
    q[:, 0::2] = qweight & 0x0F
    q[:, 1::2] = qweight >> 4
    return q


def set_int4_weights(layer, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> None:
    """Store q uint8 [N, K] in [0, 15] with group scale / zero float32 [N, K / group_size] on
    ``layer`` (replacing a float weight)."""
    replace_float_weight(layer, qweight=pack_nibbles(q), scale=scale.float().contiguous(), zero=zero.float().contiguous())
    layer.__dict__.pop("_int4_packed", None)


class Int4LinearMethod(LinearMethodBase):
    """y = x W^T + b with W ~= (q - 8) * scale + zero per group (see the module docstring).

    Args:
        group_size: the requested group size; a layer whose in_features it does not divide
            uses the largest halving that does (``group_size_for``), stored as
            ``layer.group_size``.
        serialized: create the INT4 buffers (a saved checkpoint) instead of a float weight.

    Raises:
        ValueError: (when the weights are created or quantized) when no group size divides
            in_features.
    """

    quantized = True

    def __init__(self, group_size: int, serialized: bool = False) -> None:
        self.group_size, self.serialized = group_size, serialized

    def create_weights(self, layer, input_size, output_size, bias, dtype) -> None:
        if not self.serialized:
            create_float_weights(layer, input_size, output_size, bias, dtype)
            return
        layer.group_size = group_size_for(input_size, self.group_size)
        groups = input_size // layer.group_size
        layer.register_buffer("qweight", torch.zeros(output_size, input_size // 2, dtype=torch.uint8))
        layer.register_buffer("scale", torch.ones(output_size, groups))
        layer.register_buffer("zero", torch.zeros(output_size, groups))
        create_bias(layer, output_size, bias, dtype)

    def process_weights_after_loading(self, layer) -> None:
        if "weight" in layer._parameters:
            layer.group_size = group_size_for(layer.in_features, self.group_size)
            set_int4_weights(layer, *quantize_int4(layer.weight.data, layer.group_size))

    def dequantized(self, layer, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        g = unpack_nibbles(layer.qweight).view(layer.out_features, -1, layer.group_size).to(dtype)
        w = (g - 8) * layer.scale.to(dtype)[..., None] + layer.zero.to(dtype)[..., None]
        return w.view(layer.out_features, layer.in_features)

    def dense_weight(self, layer) -> torch.Tensor:
        return self.dequantized(layer, torch.float32)

    @staticmethod
    def _cpu_kernel_inputs(layer) -> tuple[torch.Tensor, torch.Tensor]:
        cached = layer.__dict__.get("_int4_packed")
        if cached is None or cached[0] is not layer.qweight:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_nibbles(layer.qweight).to(torch.int32), 1)
            scales_and_zeros = torch.stack([layer.scale.t(), layer.zero.t()], dim=-1).contiguous().to(COMPUTE_DTYPE)
            cached = (layer.qweight, packed, scales_and_zeros)
            layer.__dict__["_int4_packed"] = cached
        return cached[1], cached[2]

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if (
            x.device.type == "cpu"
            and x.shape[0] <= INT4_PACKED_MAX_ROWS
            and layer.out_features % _INT4_PACK_N_MULTIPLE == 0
            and layer.group_size in _INT4_PACK_GROUP_SIZES
            and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
        ):
            packed, scales_and_zeros = self._cpu_kernel_inputs(layer)
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(kernel_input(x), packed, layer.group_size, scales_and_zeros)
            return finish(layer, out, x.dtype)
        return dense_matmul(layer, x, self.dequantized(layer, COMPUTE_DTYPE))


class Int4Config(QuantizationConfig):
    """Weight-only INT4 round-to-nearest for every decoder linear."""

    name = "int4"

    def get_linear_method(self, layer, prefix) -> LinearMethodBase:
        return Int4LinearMethod(self.group_size, self.serialized)

    def get_moe_method(self, layer, prefix) -> FusedMoEMethodBase:
        """Experts quantized as this scheme's linears (``kvflow.quantization.moe``)."""
        from kvflow.quantization.moe import ExpertLinearsMoEMethod

        return ExpertLinearsMoEMethod(self)
