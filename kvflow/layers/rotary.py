"""Rotary position embedding (Su et al. 2021, "RoFormer", section 3.4).

Uses the "rotate half" (GPT-NeoX) layout of Hugging Face Llama checkpoints. Supports the
default schedule and the "linear" (Chen et al. 2023, position interpolation) and "llama3"
(Llama 3.1 frequency-dependent) scalings, as transformers' ``rope_parameters`` name them.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope scaling type {rope_type!r} is not supported (default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Precomputed RoPE tables; ``apply_rotary`` rotates query and key heads with them.

    Args:
        head_dim: rotary dimension (the full head dimension).
        max_position: positions 0 .. max_position - 1 are precomputed, in tokens.
        theta: base of the frequency schedule (``rope_theta``).
        scaling: transformers-style ``rope_parameters`` for non-default schedules, or None.
    """

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        inv_freq = _inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        # sin with the sign of "rotate half" folded in: [-sin(f), +sin(f)], so that
        # rotate_half(x) * sin == roll(x, head_dim / 2) * signed_sin.
        sin = freqs.sin()
        self.register_buffer("sin", torch.cat([-sin, sin], dim=-1), persistent=False)
        # 1.0 on the dimensions of the rotary pairs that turn by at most 60 degrees over all
        # max_position positions (the low frequencies), 0.0 elsewhere [head_dim]: a vector
        # there stays within its own length of where it started, at every position.
        slow = inv_freq * (max_position - 1) <= math.pi / 3
        self.register_buffer("slow_mask", torch.cat([slow, slow]).float(), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed-sin tables [T, 1, head_dim] in ``dtype`` for int64 positions [T]
        (the arguments of ``apply_rotary``)."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate heads x [T, num_heads, head_dim] by tables from ``RotaryEmbedding.cos_sin``:
    x * cos + rotate_half(x) * sin, with rotate_half(x) = [-x2, x1] computed as
    roll(x, head_dim / 2) times the sign folded into ``signed_sin`` (three ops)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)
