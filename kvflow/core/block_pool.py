"""Pool of physical KV cache blocks with reference counts, a free list and a prefix index.

PagedAttention (Kwon et al. 2023, "Efficient Memory Management for Large Language Model
Serving with PagedAttention", section 4.2) stores a request's K/V in fixed-size blocks that
need not be contiguous; a per-request block table maps logical block i to a physical block.
This pool owns the physical blocks. A block may be referenced by several requests (shared
prefixes, parallel samples), so it carries a reference count and returns to the free list
only when the count drops to zero.

Automatic prefix caching (vLLM's design; Zheng et al. 2024, "SGLang", section 3, for the
radix-tree variant): a full block whose tokens are final is published in an index under a
hash chained over its parent's hash and its own token ids. A freed block keeps its hash and
its K/V, so a later request with the same prefix can take it back from the free list. The
free list is ordered least-recently-freed first; a block is evicted from the index only when
``allocate`` hands it out for new content (LRU eviction).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np


def hash_block_tokens(parent_hash: bytes | None, token_ids: list[int], extra: bytes = b"") -> bytes:
    """Chained content hash of one full block (SHA-256, 32 bytes).

    Args:
        parent_hash: hash of the previous block of the sequence, None for the first block.
        token_ids: the block's token ids (exactly ``block_size`` of them).
        extra: anything else that changes the block's K/V (e.g. the KV cache dtype).
    """
    h = hashlib.sha256()
    h.update(parent_hash or b"\0")
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    h.update(extra)
    return h.digest()


@dataclass
class KVCacheBlock:
    """Metadata of one physical block.

    Attributes:
        block_id: index into the first dimension of every layer's K/V tensors.
        ref_cnt: number of requests whose block table holds this block.
        block_hash: the published content hash, or None while unpublished.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


class BlockPool:
    """Allocates, frees, shares and caches physical blocks; O(1) per block.

    Args:
        num_blocks: number of physical blocks (>= 1).
        enable_caching: keep freed full blocks findable by hash until evicted.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no reference (including cached ones that may be evicted)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks from the head of the free list, each with ref_cnt 1.

        A taken block that was in the prefix index is evicted from it.

        Raises:
            RuntimeError: if fewer than ``num_blocks`` blocks are free (callers check
                ``num_free_blocks`` first).
        """
        if num_blocks > len(self._free):
            raise RuntimeError(f"asked for {num_blocks} blocks, only {len(self._free)} free")
        ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            assert block.ref_cnt == 0, f"free block {block_id} has ref_cnt {block.ref_cnt}"
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.block_hash = None
                self.num_evictions += 1
            block.ref_cnt = 1
            ids.append(block_id)
        return ids

    def touch(self, block_ids: list[int]) -> None:
        """Add one reference to each block, taking free (cached) ones off the free list."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
            block.ref_cnt += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; blocks reaching zero go to the free list's tail.

        Raises:
            RuntimeError: on a double free (ref_cnt already zero).
        """
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None or not self.enable_caching:
                    self._forget(block)
                self._free[block_id] = None

    def _forget(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            block.block_hash = None

    def num_free_after_touch(self, block_ids: list[int]) -> int:
        """Free blocks left once ``block_ids`` (cache hits about to be touched) are taken."""
        return len(self._free) - sum(1 for b in block_ids if self.blocks[b].ref_cnt == 0)

    # ------------------------------------------------------------------ prefix index
    def reset_prefix_cache(self) -> bool:
        """Drop every free block from the prefix index (its K/V is then never reused; the
        block stays free). Blocks in use keep their hashes.

        Returns:
            True when the index is now empty, False when blocks in use are still indexed
            (vLLM's ``reset_prefix_cache`` returns False while blocks are in use).
        """
        for block_id in self._free:
            self._forget(self.blocks[block_id])
        return not self._cached

    def lookup(self, block_hash: bytes) -> int | None:
        """The block holding content ``block_hash``, or None."""
        return self._cached.get(block_hash)

    def publish(self, block_id: int, block_hash: bytes) -> None:
        """Enter a full, final block into the prefix index.

        If the same content is already indexed under another block, the index keeps the
        first one and this block stays unpublished.
        """
        if not self.enable_caching:
            return
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block_id
