"""Dense linear layers with weights prepacked for oneDNN on the CPU.

A bfloat16 / float16 ``nn.Linear`` on the CPU goes through ATen's generic matmul, which on
this project's 2-core AVX2 machine reads the weight at well under the memory bandwidth and
whose cost grows with the number of rows. oneDNN's inner-product primitive on a weight
reordered once into its blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, the
same prepacking that PyTorch Inductor applies to frozen CPU graphs) costs about the same for
1 to 16 rows. Measured with ``benchmarks/micro_linear.py`` here (bfloat16, 8960 x 1536
weight, 8 distinct weights to defeat the cache, median per call):

==========  ======  ======  ======  =======
rows         1       5       16      64
==========  ======  ======  ======  =======
ATen        1.35ms  1.47ms  1.51ms  2.19ms
oneDNN      1.02ms  1.06ms  1.06ms  1.83ms
==========  ======  ======  ======  =======

Flat cost in the row count is what makes speculative verification (1 + k rows per request)
and batched decode cheap. float32 weights are left to ATen: in the model, oneDNN's float32
path was slower at one row (23.6 vs 31 tokens/s single-stream on SmolLM2-135M), and float32
is the exactness reference.

oneDNN packs a 16-bit weight only where the CPU converts that type natively (PyTorch's checks,
``torch.ops.mkldnn._is_mkldnn_bf16_supported`` / ``_is_mkldnn_fp16_supported``): bfloat16
needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, float16 needs AVX512-FP16 or AVX-NE-CONVERT
(an AMD Zen 4 has AVX-512 and bfloat16 but neither float16 feature). Elsewhere
``pack_linears`` leaves those layers to ATen's matmul (correct, slower), and
``PackedLinear`` refuses the weight naming the missing feature.

The packed weight is an opaque oneDNN tensor: it is not a parameter or buffer, so
``Module.to`` does not touch it; ``state_dict`` still yields the dense ``weight`` (and
``bias``) under the usual names.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

PACKED_DTYPES = (torch.bfloat16, torch.float16)
# What oneDNN's 16-bit paths need of an x86 CPU (the /proc/cpuinfo flag names).
CPU_FEATURES_NEEDED = {
    torch.bfloat16: "avx512bw, avx512vl and avx512dq, or avx_ne_convert",
    torch.float16: "avx512_fp16 or avx_ne_convert",
}
_warned: set[torch.dtype] = set()


def onednn_available() -> bool:
    """True when this PyTorch build has the oneDNN linear ops used by ``PackedLinear``."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def onednn_packs(dtype: torch.dtype) -> bool:
    """True when oneDNN can prepack and run a ``dtype`` weight on this CPU (bfloat16 /
    float16 only; see ``CPU_FEATURES_NEEDED``)."""
    if dtype not in PACKED_DTYPES or not onednn_available():
        return False
    check = "_is_mkldnn_bf16_supported" if dtype == torch.bfloat16 else "_is_mkldnn_fp16_supported"
    return bool(getattr(torch.ops.mkldnn, check)())


class PackedLinear(nn.Module):
    """y = x W^T + b with W [out_features, in_features] in oneDNN's blocked layout (CPU).

    Args:
        weight: [out_features, in_features], bfloat16 or float16, on the CPU.
        bias: [out_features] or None.

    Shapes: x [M, in_features] in the weight's dtype -> [M, out_features], same dtype.

    Raises:
        ValueError: for a weight that is not a 2-D bfloat16 / float16 CPU tensor.
        RuntimeError: when this CPU lacks what oneDNN needs for the weight's dtype (the
            message names the CPU features; ``onednn_packs`` tells beforehand).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if weight.dim() != 2 or weight.dtype not in PACKED_DTYPES or weight.device.type != "cpu":
            raise ValueError(
                f"PackedLinear needs a 2-D bfloat16/float16 CPU weight, got {tuple(weight.shape)} "
                f"{weight.dtype} on {weight.device}"
            )
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        if not onednn_packs(weight.dtype):
            raise RuntimeError(
                f"oneDNN cannot prepack {weight.dtype} weights on this CPU: it needs "
                f"{CPU_FEATURES_NEEDED[weight.dtype]} (see /proc/cpuinfo), or a PyTorch build with oneDNN"
            )
        # Batch-size hint 1: the decode case; measured no slower at 5-64 rows than no hint.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(weight.dtype), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "PackedLinear":
        return cls(linear.weight.data, None if linear.bias is None else linear.bias.data)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype:
            raise ValueError(f"PackedLinear holds {self.dtype} weights, got {x.dtype} input")
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")

    def dense_weight(self) -> torch.Tensor:
        """The weight back in the ordinary [out_features, in_features] layout."""
        return self.packed.to_dense()

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.dense_weight()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, {self.dtype}, oneDNN"


def pack_linears(model: nn.Module) -> int:
    """Replace, in place, every ``nn.Linear`` of ``model`` whose weight is a bfloat16 /
    float16 CPU tensor that oneDNN can pack on this CPU (``onednn_packs``) by a
    ``PackedLinear``; other modules (float32, quantized, CUDA, a 16-bit type this CPU lacks
    the instructions for: logged once) stay.

    Returns:
        The number of layers replaced (0 when oneDNN is not available).
    """
    replaced = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is not nn.Linear or child.weight.device.type != "cpu":
                continue
            dtype = child.weight.dtype
            if onednn_packs(dtype):
                setattr(module, name, PackedLinear.from_linear(child))
                replaced += 1
            else:
                warn_unpacked(dtype)
    return replaced


def warn_unpacked(dtype: torch.dtype) -> None:
    """Log once per dtype that 16-bit linears stay on ATen's (slower) matmul on this CPU."""
    if dtype in PACKED_DTYPES and dtype not in _warned and onednn_available():
        _warned.add(dtype)
        logger.warning("%s linears use PyTorch's generic matmul on this CPU (oneDNN's prepacked path needs %s); "
                       "dtype='bfloat16' is usually faster", dtype, CPU_FEATURES_NEEDED[dtype])
