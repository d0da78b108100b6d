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

The packed weight is an opaque oneDNN tensor: it is not a parameter or buffer, so
``Module.to`` does not touch it; ``state_dict`` still yields the dense ``weight`` (and
``bias``) under the usual names.
"""

from __future__ import annotations

import torch
from torch import nn

PACKED_DTYPES = (torch.bfloat16, torch.float16)


def onednn_available() -> bool:
    """True when this PyTorch build has the oneDNN linear ops used by ``PackedLinear``."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class PackedLinear(nn.Module):
    """y = x W^T + b with W [out_features, in_features] in oneDNN's blocked layout (CPU).

    Args:
        weight: [out_features, in_features], bfloat16 or float16, on the CPU.
        bias: [out_features] or None.

    Shapes: x [M, in_features] in the weight's dtype -> [M, out_features], same dtype.

    Raises:
        ValueError: for a weight that is not a 2-D bfloat16 / float16 CPU tensor.
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
    float16 CPU tensor by a ``PackedLinear``; other modules (float32, quantized, CUDA) stay.

    Returns:
        The number of layers replaced (0 when oneDNN is not available).
    """
    if not onednn_available():
        return 0
    replaced = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if (
                type(child) is nn.Linear
                and child.weight.dtype in PACKED_DTYPES
                and child.weight.device.type == "cpu"
            ):
                setattr(module, name, PackedLinear.from_linear(child))
                replaced += 1
    return replaced
