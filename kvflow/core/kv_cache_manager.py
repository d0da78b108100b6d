"""Per-request block tables on top of the block pool.

Blocks are allocated on demand: before each step the scheduler asks for room for the tokens
it is about to compute, and only the blocks those tokens spill into are taken
(Kwon et al. 2023, PagedAttention, section 4.3).
"""

from __future__ import annotations

from kvflow.core.block_pool import BlockPool
from kvflow.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Maps requests to physical KV blocks.

    Args:
        num_blocks: physical blocks in the pool.
        block_size: tokens per block.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)

    @property
    def num_total_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return cdiv(num_tokens, self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for the next ``num_new_tokens`` tokens of ``request``.

        After success the request's block table covers
        ``request.num_computed_tokens + num_new_tokens`` tokens.

        Returns:
            False, changing nothing, when the pool has too few free blocks.
        """
        total = request.num_computed_tokens + num_new_tokens
        needed = self.num_blocks_for(total) - len(request.block_ids)
        if needed <= 0:
            return True
        if needed > self.block_pool.num_free_blocks:
            return False
        request.block_ids.extend(self.block_pool.allocate(needed))
        return True

    def free(self, request: Request) -> None:
        """Release every block of ``request`` (in reverse, so tail blocks are reused first)."""
        self.block_pool.free(list(reversed(request.block_ids)))
        request.block_ids = []

    def usage(self) -> float:
        """Fraction of blocks in use, 0 to 1."""
        return 1.0 - self.num_free_blocks / self.num_total_blocks
