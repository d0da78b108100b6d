"""Rotary position embedding (Su et al. 2021, "RoFormer", section 3.4).

Uses the "rotate half" (GPT-NeoX) layout of Hugging Face Llama checkpoints, optionally on the
first ``rotary_dim`` dimensions of each head only (partial rotary, ``partial_rotary_factor``:
Phi-3 / Phi-4-mini). Frequency schedules, as transformers' ``rope_parameters`` name them and
exactly as ``transformers.modeling_rope_utils`` computes them (``rope_frequencies``):

- "default"; "linear" (Chen et al. 2023, position interpolation); "llama3" (Llama 3.1
  frequency-dependent interpolation);
- "yarn" (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language
  Models", section 3.2 NTK-by-parts ramp between ``beta_fast`` and ``beta_slow`` rotations,
  and the 0.1 ln(s) + 1 attention temperature of section 3.4, ``mscale`` /
  ``mscale_all_dim`` / ``attention_factor`` as in ``_compute_yarn_parameters``);
- "dynamic" (dynamic NTK, bloc97 / emozilla 2023): fixed at one length, see below;
- "longrope" / "su" (Ding et al. 2024, "LongRoPE", the Phi-3 scaling): per-frequency
  ``short_factor`` / ``long_factor`` and the sqrt(1 + ln(s) / ln(L_orig)) attention factor.

The attention factor multiplies the cos and sin tables, as transformers does (it scales q
and k, so attention scores by its square).

A paged cache stores keys already rotated, so the rotation of a position must never change
while a request runs. Both length-dependent schedules are therefore fixed once per engine:

- "longrope": transformers picks the long factors for a whole forward when its sequence is
  longer than ``original_max_position_embeddings`` and the short ones otherwise (so a cached
  generation that crosses the threshold mixes short-rotated keys with long-rotated ones).
  kvflow, like vLLM (``Phi3LongRoPEScaledRotaryEmbedding.use_long_rope``), uses the long
  factors for every position when the engine's ``max_model_len`` exceeds
  ``original_max_position_embeddings``, the short ones otherwise. Identical to transformers
  for every sequence when ``max_model_len <= original_max_position_embeddings``; with a
  larger ``max_model_len``, identical for sequences longer than the threshold and different
  (long instead of short factors) for shorter ones.
- "dynamic": transformers recomputes the base for the current length L when L exceeds
  ``max_position_embeddings`` (original inv_freq below). kvflow, like vLLM
  (``DynamicNTKScalingRotaryEmbedding``), computes it once for L = max_position_embeddings x
  factor (the scaled context, which is the model's context in kvflow); the two agree for a
  sequence of exactly that length and differ for every other.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kvflow import ops
from kvflow.ops.build import takes_kernel_input

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope", "su")


def _default_inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _yarn(dim: int, theta: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """transformers ``_compute_yarn_parameters``, operation for operation."""
    factor = float(scaling["factor"])
    original = scaling["original_max_position_embeddings"]
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        # the dimension whose wavelength makes `rotations` turns over the original context
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: keep the original frequency (fast dims), 0: interpolate (slow dims)
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def rope_frequencies(
    rotary_dim: int, theta: float, scaling: dict[str, Any] | None, max_model_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention factor of a RoPE schedule (see the module docstring).

    Args:
        rotary_dim: the rotated dimensions of a head (even).
        theta: ``rope_theta``.
        scaling: a transformers ``rope_parameters`` dict with ``rope_type`` (None: default).
            "yarn" and "longrope" read ``original_max_position_embeddings``; "longrope" and
            "yarn" need ``factor`` (``ModelConfig.from_hf_config`` fills it from the context
            ratio where the config leaves it out, as transformers does); "dynamic" reads
            ``original_max_position_embeddings`` as its unscaled context.
        max_model_len: the engine's context limit in tokens ("longrope" picks its factors by
            it; None: the short factors).

    Returns:
        (inv_freq float32 [rotary_dim // 2], attention factor multiplying cos and sin).

    Raises:
        ValueError: for an unknown ``rope_type`` or LongRoPE factors of the wrong length.
    """
    if scaling is None:
        return _default_inv_freq(rotary_dim, theta), 1.0
    rope_type = scaling["rope_type"]
    if rope_type == "default":
        return _default_inv_freq(rotary_dim, theta), 1.0
    if rope_type == "linear":
        return _default_inv_freq(rotary_dim, theta) / float(scaling["factor"]), 1.0
    if rope_type == "llama3":
        inv_freq = _default_inv_freq(rotary_dim, theta)
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
        return torch.where(medium, smoothed, scaled), 1.0
    if rope_type == "yarn":
        return _yarn(rotary_dim, theta, scaling)
    if rope_type == "dynamic":
        # transformers _compute_dynamic_ntk_parameters at seq_len = original x factor (vLLM's length)
        factor = float(scaling["factor"])
        original = scaling["original_max_position_embeddings"]
        seq_len = original * factor
        base = theta * ((factor * seq_len / original) - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
        return _default_inv_freq(rotary_dim, base), 1.0
    if rope_type in ("longrope", "su"):
        original = scaling["original_max_position_embeddings"]
        factor = float(scaling["factor"])
        attention_factor = scaling.get("attention_factor")
        if attention_factor is None:
            attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        use_long = max_model_len is not None and max_model_len > original
        name = "long_factor" if use_long else "short_factor"
        ext = torch.tensor(scaling[name], dtype=torch.float32)
        if ext.shape != (rotary_dim // 2,):
            raise ValueError(f"rope_parameters.{name} has {ext.numel()} entries, expected rotary_dim / 2 = {rotary_dim // 2}")
        shape = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        return 1.0 / (ext * theta**shape), float(attention_factor)
    raise ValueError(f"rope scaling type {rope_type!r} is not supported ({', '.join(ROPE_TYPES)} are)")


class RotaryEmbedding(nn.Module):
    """Precomputed RoPE tables; ``apply_rotary`` rotates query and key heads with them.

    Args:
        head_dim: the head dimension.
        max_position: positions 0 .. max_position - 1 are precomputed, in tokens.
        theta: base of the frequency schedule (``rope_theta``).
        scaling: transformers-style ``rope_parameters`` for non-default schedules, or None.
        rotary_dim: the rotated leading dimensions of each head (even; default head_dim);
            the others pass through unrotated.
        max_model_len: the engine's context limit, which fixes LongRoPE's factor set (see
            the module docstring); None: ``max_position``.

    Attributes:
        attention_factor: the schedule's cos / sin multiplier (1.0 for most).

    Raises:
        ValueError: for an unsupported schedule or an odd / oversized ``rotary_dim``.
    """

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None,
                 rotary_dim: int | None = None, max_model_len: int | None = None) -> None:
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError(f"rotary_dim must be even and in (0, head_dim={head_dim}], got {rotary_dim}")
        self.rotary_dim = rotary_dim
        inv_freq, self.attention_factor = rope_frequencies(
            rotary_dim, theta, scaling, max_position if max_model_len is None else max_model_len
        )
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        # sin with the sign of "rotate half" folded in: [-sin(f), +sin(f)], so that
        # rotate_half(x) * sin == roll(x, rotary_dim / 2) * signed_sin.
        sin = freqs.sin()
        cos, signed_sin = emb.cos(), torch.cat([-sin, sin], dim=-1)
        if self.attention_factor != 1.0:
            cos, signed_sin = cos * self.attention_factor, signed_sin * self.attention_factor
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", signed_sin, persistent=False)
        # 1.0 on the dimensions of the rotary pairs that turn by at most 60 degrees over all
        # max_position positions (the low frequencies) and on unrotated dimensions, 0.0
        # elsewhere [head_dim]: a vector there stays within its own length of where it
        # started, at every position.
        slow = (inv_freq * (max_position - 1) <= math.pi / 3).float()
        self.register_buffer("slow_mask", torch.cat([slow, slow, torch.ones(head_dim - rotary_dim, dtype=torch.float32)]), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed-sin tables [T, 1, rotary_dim] in ``dtype`` for int64 positions [T]
        (the arguments of ``apply_rotary``)."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


_EXTENSION = ops.ROTARY


def _kernel_applies(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> bool:
    return (
        takes_kernel_input(x, 3)
        and cos.dtype == x.dtype
        and signed_sin.dtype == x.dtype
        and cos.shape == (x.shape[0], 1, x.shape[2])  # as cos_sin makes them (others broadcast)
        and signed_sin.shape == cos.shape
        and cos.is_contiguous()
        and signed_sin.is_contiguous()
        and _EXTENSION.load() is not None
    )


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate heads x [T, num_heads, head_dim] by tables from ``RotaryEmbedding.cos_sin``:
    x * cos + rotate_half(x) * sin, with rotate_half(x) = [-x2, x1] computed as
    roll(x, head_dim / 2) times the sign folded into ``signed_sin``. Tables narrower than
    the head (partial rotary, [T, 1, rotary_dim]) rotate its first rotary_dim dimensions
    and pass the rest through.

    On the CPU (float32 / bfloat16) a small C++ kernel (``kvflow/ops/csrc/rotary.cpp``) does
    it in one pass with the same arithmetic (x * cos rounded to x's dtype, then the
    multiply-add rounded once, as ``addcmul``): ~1 us per decode call against ~5.4 us for the
    three ops, 30 calls per SmolLM2 step.
    ``KVFLOW_CPU_ROTARY=0`` keeps the three PyTorch ops.
    """
    rotary_dim = cos.shape[-1]
    if rotary_dim != x.shape[-1]:
        return torch.cat([apply_rotary(x[..., :rotary_dim], cos, signed_sin), x[..., rotary_dim:]], dim=-1)
    if _kernel_applies(x, cos, signed_sin):
        return _EXTENSION.require().apply_rotary(x, cos, signed_sin)
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)
