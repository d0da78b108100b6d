"""Allocation of the paged KV cache tensors."""

from __future__ import annotations

import torch

from kvflow.config import CacheConfig, ModelConfig


class CacheEngine:
    """Owns one (K, V) pair of tensors per KV layer (``ModelConfig.num_kv_layers``).

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
            for _ in range(model_config.num_kv_layers)
        ]
        cpu_shape = (cache_config.num_cpu_blocks, *shape[1:])
        pin = device.type == "cuda"
        self.cpu_kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = [
            (
                torch.zeros(cpu_shape, dtype=cache_config.dtype, pin_memory=pin),
                torch.zeros(cpu_shape, dtype=cache_config.dtype, pin_memory=pin),
            )
            for _ in range(model_config.num_kv_layers if cache_config.num_cpu_blocks else 0)
        ]

    @property
    def num_bytes(self) -> int:
        """Total bytes held by the K and V tensors of all layers."""
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.kv_caches)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole device blocks src -> dst in every layer (copy-on-write)."""
        self._copy(self.kv_caches, self.kv_caches, copies)

    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks, (device, host) pairs, in every layer."""
        self._copy(self.kv_caches, self.cpu_kv_caches, mapping)

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        """Copy host blocks to device blocks, (host, device) pairs, in every layer."""
        self._copy(self.cpu_kv_caches, self.kv_caches, mapping)

    @staticmethod
    def _copy(
        src_caches: list[tuple[torch.Tensor, torch.Tensor]],
        dst_caches: list[tuple[torch.Tensor, torch.Tensor]],
        pairs: list[tuple[int, int]],
    ) -> None:
        src = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=src_caches[0][0].device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=dst_caches[0][0].device)
        for (src_k, src_v), (dst_k, dst_v) in zip(src_caches, dst_caches):
            dst_k.index_copy_(0, dst, src_k.index_select(0, src).to(dst_k.device))
            dst_v.index_copy_(0, dst, src_v.index_select(0, src).to(dst_v.device))
