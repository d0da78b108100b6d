"""The paged KV cache of one rank: the per-layer K/V tensors of the whole block pool (device
and host swap space), and the block copies and swaps the scheduler asks for.

It stands beside what it builds on, ``kvflow/attention/kv_cache.py`` (one layer's tensors:
``allocate_kv_cache``; their writes and reads). It reads the engine's config by its fields
(a ``kvflow.config.KVCacheSpec`` and ``CacheConfig``, duck-typed: ``config.py`` stands above
this package), so that the runner's builder hands it what it needs and it imports nothing
above the attention layer.
"""

from __future__ import annotations

from typing import Any

import torch

from kvflow.attention.kv_cache import KVCache, allocate_kv_cache


class CacheEngine:
    """Owns one ``KVCache`` per KV layer (``KVCacheSpec.num_layers``): K and V, plus
    per-token per-head float16 scales for an int8 / fp8 cache.

    Each tensor has shape ``[num_blocks, block_size, num_kv_heads, head_dim]`` and the cache
    dtype. Memory is allocated once, up front, for the whole block pool; requests take blocks
    from it on demand (``KVCacheManager``).

    Hybrid cache (``cache_config.kv_cache_groups`` set, ``kvflow/core/kv_cache_groups.py``):
    ``kv_caches`` holds one ``KVCache`` per layer *position* of a group (``group_size`` of
    them; a block is a page of those slices) and layer l uses ``kv_caches[layer_position[l]]``
    (``layer_kv_caches``) through its group's block table. Copies, swaps and ``num_bytes``
    act on the pages, so they need no change.

    Args:
        spec: this rank's KV layer count, KV heads and head size (the model's
            ``kv_cache_spec``, a ``kvflow.config.KVCacheSpec``: ``num_layers``,
            ``num_kv_heads``, ``head_dim``).
        cache_config: the pool (a ``kvflow.config.CacheConfig``: ``num_blocks``,
            ``num_cpu_blocks``, ``block_size``, ``dtype``, ``kv_cache_groups``).
        device: where the tensors live.
    """

    def __init__(self, spec: Any, cache_config: Any, device: torch.device) -> None:
        def layer(num_blocks: int, device: torch.device, pin: bool = False) -> KVCache:
            # on huge pages where they are host tensors, not pinned (allocate_kv_cache decides):
            # as long-lived as the engine
            return allocate_kv_cache(num_blocks, cache_config.block_size, spec.num_kv_heads, spec.head_dim,
                                     cache_config.dtype, device, pin, huge_pages=True)

        self.groups = cache_config.kv_cache_groups
        num_tensors = self.groups.group_size if self.groups is not None else spec.num_layers
        self.kv_caches: list[KVCache] = [layer(cache_config.num_blocks, device) for _ in range(num_tensors)]
        # what the model's forward takes: one cache per decoder (KV) layer
        self.layer_kv_caches: list[KVCache] = self.kv_caches if self.groups is None else \
            [self.kv_caches[p] for p in self.groups.layer_position]
        cpu = torch.device("cpu")
        pin = device.type == "cuda"
        self.cpu_kv_caches: list[KVCache] = [
            layer(cache_config.num_cpu_blocks, cpu, pin)
            for _ in range(num_tensors if cache_config.num_cpu_blocks else 0)
        ]

    @property
    def num_bytes(self) -> int:
        """Total bytes held by the K and V tensors of all layers."""
        return sum(t.numel() * t.element_size() for layer in self.kv_caches for t in layer)

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
    def _copy(src_caches: list[KVCache], dst_caches: list[KVCache], pairs: list[tuple[int, int]]) -> None:
        src = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=src_caches[0][0].device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=dst_caches[0][0].device)
        for src_layer, dst_layer in zip(src_caches, dst_caches):
            for src_t, dst_t in zip(src_layer, dst_layer):
                if src_t.dtype == torch.float8_e4m3fn:  # no CPU index ops for float8: move bytes
                    src_t, dst_t = src_t.view(torch.uint8), dst_t.view(torch.uint8)
                dst_t.index_copy_(0, dst, src_t.index_select(0, src).to(dst_t.device))
