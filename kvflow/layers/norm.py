"""RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization", eq. 4)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in float32.

    Shapes: x [..., hidden_size] of any float dtype -> same shape and dtype.
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One dispatch (PyTorch's composite computes in float32 and casts back).
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
