"""Weight quantization schemes: quantize, dequantize, and the error each introduces.

- INT8: symmetric, one float scale per output channel: w ~= q * s, q in [-127, 127].
- INT4: asymmetric group-wise (groups of ``group_size`` input channels per output channel):
  w ~= (q - 8) * s + z with q in [0, 15] — the layout PyTorch's int4 weight-packed matmul
  uses (``_weight_int4pack_mm``: scales_and_zeros [K / group, N, 2]). Round-to-nearest over the
  group's [min, max] range; ``awq.py`` adds the activation-aware scaling.
- FP8: E4M3 (Micikevicius et al. 2022, "FP8 Formats for Deep Learning") with one float scale
  per output channel mapping the channel's max magnitude to 448.

All functions take float weights [N, K] (out_features, in_features).
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel INT8.

    Args:
        w: float [N, K].

    Returns:
        q int8 [N, K] and scale float32 [N] with w ~= q * scale[:, None]; the error of each
        element is at most scale / 2.
    """
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] from ``quantize_int8``'s output."""
    return q.float() * scale[:, None]


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise INT4 by round-to-nearest.

    Args:
        w: float [N, K]; K must be divisible by ``group_size`` (32, 64 or 128).
        group_size: input channels per group.

    Returns:
        q uint8 [N, K] in [0, 15], scale and zero float32 [N, K / group_size] with
        w ~= (q - 8) * scale + zero per group; the error is at most scale / 2.

    Raises:
        ValueError: if K is not divisible by group_size.
    """
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"in_features {k} is not divisible by group_size {group_size}")
    g = w.float().view(n, k // group_size, group_size)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / 15.0).clamp(min=1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8)
    zero = lo + 8.0 * scale
    return q.view(n, k), scale, zero


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] from ``quantize_int4``'s output."""
    n, k = q.shape
    groups = scale.shape[1]
    g = q.view(n, groups, k // groups).float()
    return ((g - 8.0) * scale[..., None] + zero[..., None]).view(n, k)


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 E4M3 with a per-output-channel scale.

    Returns:
        q float8_e4m3fn [N, K] and scale float32 [N] with w ~= q.float() * scale[:, None];
        the relative error of each element is at most 2^-4 (3 mantissa bits), plus the
        subnormal range near zero.
    """
    w = w.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    q = (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] from ``quantize_fp8``'s output."""
    return q.float() * scale[:, None]
