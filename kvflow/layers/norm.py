"""RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization", eq. 4).

On the CPU a small C++ kernel (``kvflow/ops/csrc/rms_norm.cpp``, built on first use like
``cpu_attention``) computes it in one pass per row. ``F.rms_norm`` costs ~10.5 us for one
576-wide bfloat16 row here (dispatch and its casts), the kernel ~1.4 us, and a decode step
runs it 2 x layers + 1 times (61 for SmolLM2, ~0.6 ms of an ~11 ms single-stream INT4 step). Arithmetic: float32 throughout,
x * rsqrt(mean(x^2) + eps) * weight rounded once to the input dtype, like PyTorch's fused
CPU kernel; the sum of squares is added in a different order, so float32 results differ by
a few ulp and bfloat16 ones, rarely, by one rounding step.
``KVFLOW_CPU_NORM=0`` (or a failed build) keeps ``F.rms_norm``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvflow import ops
from kvflow.ops.build import takes_kernel_input

_EXTENSION = ops.RMS_NORM


def cpu_rms_norm_available() -> bool:
    """True when the C++ RMSNorm kernel is built (building it now if needed)."""
    return _EXTENSION.load() is not None


def cpu_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the rows of x [rows, hidden] (float32 or bfloat16, rows contiguous) with
    weight [hidden] of x's dtype; float32 arithmetic. Returns [rows, hidden] in x's dtype.

    Raises:
        RuntimeError: if the kernel is unavailable or the inputs break the layout above.
    """
    return _EXTENSION.require().rms_norm(x, weight, eps)


def cpu_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add before a norm, fused into the norm's pass (vLLM's
    ``fused_add_rms_norm``, out of place): s = x + residual rounded to x's dtype (as the
    separate add rounds it), then RMSNorm(s) as ``cpu_rms_norm`` computes it.

    Shapes: x and residual [rows, hidden] (float32 or bfloat16, same dtype, rows contiguous),
    weight [hidden] of that dtype. Returns (s, RMSNorm(s)), both new [rows, hidden] tensors.

    Raises:
        RuntimeError: if the kernel is unavailable or the inputs break the layout above.
    """
    return _EXTENSION.require().add_rms_norm(x, residual, weight, eps)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in float32.

    Shapes: x [..., hidden_size] of any float dtype -> same shape and dtype.
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (
            takes_kernel_input(x, 2)
            and w.dtype == x.dtype
            and not (torch.is_grad_enabled() and w.requires_grad)
            and cpu_rms_norm_available()
        ):
            return cpu_rms_norm(x, w, self.eps)
        # One dispatch (PyTorch's composite computes in float32 and casts back).
        return F.rms_norm(x, w.shape, w, self.eps)

    def forward_with_residual(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(s, RMSNorm(s)) with s = residual + x: a pre-norm block's residual add and the next
        norm in one pass where the C++ kernel applies (``cpu_add_rms_norm``), else the add
        and ``forward``. Same values either way (s rounded to x's dtype, then normed).

        Shapes: x and residual [..., hidden_size], same dtype -> two tensors of that shape.
        """
        w = self.weight
        if (
            takes_kernel_input(x, 2)
            and takes_kernel_input(residual, 2)
            and residual.dtype == x.dtype == w.dtype
            and residual.shape == x.shape
            and not (torch.is_grad_enabled() and w.requires_grad)
            and cpu_rms_norm_available()
        ):
            return cpu_add_rms_norm(x, residual, w, self.eps)
        s = residual + x
        return s, self(s)
