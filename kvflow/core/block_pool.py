"""Pool of physical KV cache blocks with reference counts and a free list.

PagedAttention (Kwon et al. 2023, "Efficient Memory Management for Large Language Model
Serving with PagedAttention", section 4.2) stores a request's K/V in fixed-size blocks that
need not be contiguous; a per-request block table maps logical block i to a physical block.
This pool owns the physical blocks. A block may be referenced by several requests (shared
prefixes, parallel samples), so it carries a reference count and returns to the free list
only when the count drops to zero.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class KVCacheBlock:
    """Metadata of one physical block.

    Attributes:
        block_id: index into the first dimension of every layer's K/V tensors.
        ref_cnt: number of requests whose block table holds this block.
    """

    block_id: int
    ref_cnt: int = 0


class BlockPool:
    """Allocates and frees physical blocks; O(1) per block.

    The free list is ordered least-recently-freed first, so a later eviction policy
    (prefix caching) can take blocks in LRU order.

    Args:
        num_blocks: number of physical blocks (>= 1).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` free blocks, each with ref_cnt 1.

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
            block.ref_cnt = 1
            ids.append(block_id)
        return ids

    def incref(self, block_ids: list[int]) -> None:
        """Add one reference to each (already allocated) block."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_cnt > 0, f"incref of free block {block_id}"
            block.ref_cnt += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; blocks reaching zero go back to the free list.

        Raises:
            RuntimeError: on a double free (ref_cnt already zero).
        """
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None
