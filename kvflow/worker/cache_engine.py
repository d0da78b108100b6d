"""Allocation of the paged KV cache tensors."""

from __future__ import annotations

import torch

from kvflow.config import CacheConfig, ModelConfig


class CacheEngine:
    """Owns one (K, V) pair of tensors per layer.

    Each tensor has shape ``[num_blocks, block_size, num_kv_heads, head_dim]`` and the cache
    dtype. Memory is allocated once, up front, for the whole block pool; requests take blocks
    from it on demand (``KVCacheManager``).

    Args:
        model_config: layer count, KV heads and head size.
        cache_config: block count, block size, dtype.
        device: where the tensors live.
    """

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, device: torch.device) -> None:
        shape = (
            cache_config.num_blocks,
            cache_config.block_size,
            model_config.num_key_value_heads,
            model_config.head_dim,
        )
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = [
            (
                torch.zeros(shape, dtype=cache_config.dtype, device=device),
                torch.zeros(shape, dtype=cache_config.dtype, device=device),
            )
            for _ in range(model_config.num_hidden_layers)
        ]

    @property
    def num_bytes(self) -> int:
        """Total bytes held by the K and V tensors of all layers."""
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.kv_caches)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer (copy-on-write of shared blocks)."""
        src = torch.tensor([s for s, _ in copies], dtype=torch.int64, device=self.kv_caches[0][0].device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.int64, device=src.device)
        for k, v in self.kv_caches:
            k.index_copy_(0, dst, k.index_select(0, src))
            v.index_copy_(0, dst, v.index_select(0, src))
