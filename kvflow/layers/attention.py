"""The attention layer of a model: paged attention over one layer's KV cache, run by the
step's backend (``metadata.backend``, chosen once by ``kvflow.attention.selector``).

Each step (PagedAttention, Kwon et al. 2023, section 4.1):

1. the new tokens' K/V are written to their slots (``slot_mapping``: flat index
   ``block_id * block_size + offset`` per token);
2. each request's queries attend to all its cached tokens up to their own position.

How is the backend's business (``kvflow.attention``): gather + SDPA per group of requests,
the CPU's C++ kernels, or Triton's.
"""

from __future__ import annotations

import torch
from torch import nn

from kvflow.attention.kv_cache import KVCache


class Attention(nn.Module):
    """One layer's paged attention: write the step's K/V into the layer's cache, then attend
    every query over its request's cached K/V (causal).

    Args:
        num_heads, num_kv_heads: this rank's query and KV heads.
        head_dim: elements per head.
        scale: softmax scale (usually head_dim ** -0.5).

    Shapes: q [T, num_heads, head_dim]; k, v [T, num_kv_heads, head_dim] or None (a layer
    that reads another layer's K/V, cross-layer attention) -> [T, num_heads, head_dim].
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        kv_cache: KVCache,
        metadata,
        key_offset: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``metadata``: the step's attention metadata (``kvflow.attention``), which names its
        backend. ``key_offset`` [num_kv_heads, head_dim]: subtracted from keys going into a
        quantized cache (``kvflow.attention.kv_cache.subtract_key_offset``)."""
        return metadata.backend.forward(q, k, v, kv_cache, metadata, self.scale, key_offset)
