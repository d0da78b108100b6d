"""RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization", eq. 4)."""

from __future__ import annotations

import torch
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
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
