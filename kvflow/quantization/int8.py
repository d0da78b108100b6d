"""Weight-only INT8: one int8 weight [N, K] with a float32 scale per output channel [N]
(``schemes.quantize_int8``), and the per-channel base that FP8 shares.

Kernels on the CPU, up to ``INT8_PACKED_MAX_ROWS`` rows: kvflow's own C++ kernel
(``kvflow.layers.cpu_linear``: AVX-512, float32 activations and scale, about 2.4x faster
at one row than PyTorch's on SmolLM2's linears here) where it builds and the CPU runs it,
else ``aten._weight_int8pack_mm`` (activations in bfloat16). Above that row count (long
prefill chunks), and on CUDA, the weight is dequantized to bfloat16 for the call and a dense
matmul runs: the packed kernels' cost grows with the rows, the dequantization does not.
Measured with ``python -m benchmarks.micro_linear`` on an 8960 x 1536 weight: INT8 packed
5.6 ms at 16 rows, 14.6 at 64, 48.9 at 256 vs ~24 ms dequantized.
"""

from __future__ import annotations

import torch

from kvflow.layers import cpu_linear
from kvflow.quantization.base import (
    FusedMoEMethodBase,
    COMPUTE_DTYPE,
    LinearMethodBase,
    QuantizationConfig,
    compute_copy,
    create_bias,
    create_float_weights,
    dense_matmul,
    finish,
    kernel_input,
    replace_float_weight,
)
from kvflow.quantization.schemes import dequantize_int8, quantize_int8

INT8_PACKED_MAX_ROWS = 64
# ``_weight_int8pack_mm`` reads K in chunks of 16 and crashes the process (segfault)
# otherwise (PyTorch 2.x, aten/src/ATen/native/cpu/int8mm_kernel.cpp): outside, dense path.
_INT8_PACK_K_MULTIPLE = 16


class PerChannelLinearMethod(LinearMethodBase):
    """A weight of ``weight_dtype`` [N, K] and a float32 ``scale`` [N]; quantized from the
    float weight after loading unless the checkpoint is serialized."""

    quantized = True
    weight_dtype: torch.dtype

    def __init__(self, serialized: bool = False) -> None:
        self.serialized = serialized

    @staticmethod
    def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def create_weights(self, layer, input_size, output_size, bias, dtype) -> None:
        if not self.serialized:
            create_float_weights(layer, input_size, output_size, bias, dtype)
            return
        layer.register_buffer("weight", torch.zeros(output_size, input_size, dtype=self.weight_dtype))
        layer.register_buffer("scale", torch.ones(output_size))
        create_bias(layer, output_size, bias, dtype)

    def process_weights_after_loading(self, layer) -> None:
        if "weight" in layer._parameters:
            q, scale = self.quantize(layer.weight.data)
            replace_float_weight(layer, weight=q, scale=scale)


class Int8LinearMethod(PerChannelLinearMethod):
    """y = x W^T + b with W ~= weight (int8 [N, K]) * scale (float32 [N])."""

    weight_dtype = torch.int8
    quantize = staticmethod(quantize_int8)

    def dense_weight(self, layer) -> torch.Tensor:
        return dequantize_int8(layer.weight, layer.scale.float())

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and x.shape[0] <= INT8_PACKED_MAX_ROWS and layer.in_features % _INT8_PACK_K_MULTIPLE == 0:
            if x.dim() == 2 and x.shape[0] >= 1 and x.dtype in (torch.float32, torch.bfloat16) and cpu_linear.int8_available():
                if x.stride(-1) != 1:
                    x = x.contiguous()
                return finish(layer, cpu_linear.int8_linear(x, layer.weight, _float_scale(layer)), x.dtype)
            if hasattr(torch.ops.aten, "_weight_int8pack_mm"):
                # The kernel refuses inputs that are not contiguous (e.g. a column slice).
                out = torch.ops.aten._weight_int8pack_mm(kernel_input(x), layer.weight, compute_copy(layer, "scale"))
                return finish(layer, out, x.dtype)
        return dense_matmul(layer, x, layer.weight.to(COMPUTE_DTYPE) * layer.scale.to(COMPUTE_DTYPE)[:, None])


def _float_scale(layer) -> torch.Tensor:
    s = layer.scale
    return s if s.dtype == torch.float32 and s.is_contiguous() else s.float().contiguous()


class Int8Config(QuantizationConfig):
    """Weight-only INT8 for every decoder linear (round-to-nearest, per output channel)."""

    name = "int8"

    def get_linear_method(self, layer, prefix) -> LinearMethodBase:
        return Int8LinearMethod(self.serialized)

    def get_moe_method(self, layer, prefix) -> FusedMoEMethodBase:
        """Experts quantized as this scheme's linears (``kvflow.quantization.moe``)."""
        from kvflow.quantization.moe import ExpertLinearsMoEMethod

        return ExpertLinearsMoEMethod(self)
