"""Weight-only FP8 (E4M3, Micikevicius et al. 2022, "FP8 Formats for Deep Learning"): a
float8_e4m3fn weight [N, K] with a float32 scale per output channel (``schemes.quantize_fp8``).

No FP8 matmul exists on the CPU: the weight is dequantized per call (a memory saving only).
"""

from __future__ import annotations

import torch

from kvflow.quantization.base import FusedMoEMethodBase, LinearMethodBase, QuantizationConfig, dense_matmul
from kvflow.quantization.int8 import PerChannelLinearMethod
from kvflow.quantization.schemes import dequantize_fp8, quantize_fp8


class FP8LinearMethod(PerChannelLinearMethod):
    """y = x W^T + b with W ~= weight (float8_e4m3fn [N, K]) * scale (float32 [N])."""

    weight_dtype = torch.float8_e4m3fn
    quantize = staticmethod(quantize_fp8)

    def dense_weight(self, layer) -> torch.Tensor:
        return dequantize_fp8(layer.weight, layer.scale)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        return dense_matmul(layer, x, dequantize_fp8(layer.weight, layer.scale))


class FP8Config(QuantizationConfig):
    """Weight-only FP8 for every decoder linear."""

    name = "fp8"

    def get_linear_method(self, layer, prefix) -> LinearMethodBase:
        return FP8LinearMethod(self.serialized)

    def get_moe_method(self, layer, prefix) -> FusedMoEMethodBase:
        """Experts quantized as this scheme's linears (``kvflow.quantization.moe``)."""
        from kvflow.quantization.moe import ExpertLinearsMoEMethod

        return ExpertLinearsMoEMethod(self)
