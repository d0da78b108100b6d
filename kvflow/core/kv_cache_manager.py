"""Per-request block tables on top of the block pool: on-demand allocation, prefix-cache
hits, publishing of full blocks and copy-on-write of shared partial blocks.

Blocks are allocated on demand: before each step the scheduler asks for room for the tokens
it is about to compute, and only the blocks those tokens spill into are taken
(Kwon et al. 2023, PagedAttention, section 4.3). Requests forked from one parent (parallel
samples, beam search) share blocks by reference count; the first write into a shared,
partially filled block copies it first (copy-on-write, PagedAttention section 4.4).
"""

from __future__ import annotations

from kvflow.core.block_pool import BlockPool, hash_block_tokens
from kvflow.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Maps requests to physical KV blocks.

    Args:
        num_blocks: physical blocks in the pool.
        block_size: tokens per block.
        enable_prefix_caching: reuse published full blocks across requests.
        hash_extra: bytes mixed into every block hash (whatever else changes K/V, such as the
            KV cache dtype), so blocks of different caches never match.
        num_cpu_blocks: host blocks for swap preemption (0: none).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        hash_extra: bytes = b"",
        num_cpu_blocks: int = 0,
    ) -> None:
        self.block_size = block_size
        self.cpu_pool = BlockPool(num_cpu_blocks) if num_cpu_blocks > 0 else None
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_extra = hash_extra
        self.block_pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.pending_copies: list[tuple[int, int]] = []
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_total_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def reset_prefix_cache(self) -> bool:
        """See ``BlockPool.reset_prefix_cache``."""
        return self.block_pool.reset_prefix_cache()

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return cdiv(num_tokens, self.block_size)

    # ------------------------------------------------------------------ prefix caching
    def _block_hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """Chained hashes of the request's first ``num_blocks`` full blocks (memoized)."""
        hashes = request.block_hashes
        bs = self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, request.all_token_ids[i * bs : (i + 1) * bs], self.hash_extra))
        return hashes[:num_blocks]

    def get_computed_blocks(self, request: Request) -> list[int]:
        """Longest chain of cached full blocks that prefixes the request's tokens.

        The last token is always left to compute (its logits are needed), so at most
        ``(num_tokens - 1) // block_size`` blocks are returned. Call it when the request is
        about to be admitted: the cache may have changed while it waited.
        """
        if not self.enable_prefix_caching or request.needs_every_position:
            return []  # prompt_logprobs and mean pooling read every prompt position
        hits: list[int] = []
        for block_hash in self._block_hashes(request, (request.num_tokens - 1) // self.block_size):
            block_id = self.block_pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def cache_full_blocks(self, request: Request) -> None:
        """Publish the request's blocks that are full of computed (final) tokens."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        if num_full <= request.num_published_blocks:
            return
        hashes = self._block_hashes(request, num_full)
        for i in range(request.num_published_blocks, num_full):
            self.block_pool.publish(request.block_ids[i], hashes[i])
        request.num_published_blocks = num_full

    # ------------------------------------------------------------------ allocation
    def allocate_slots(self, request: Request, num_new_tokens: int, new_computed_blocks: list[int] | None = None) -> bool:
        """Make room for the next ``num_new_tokens`` tokens of ``request``.

        Args:
            request: the request; its block table grows in place.
            num_new_tokens: tokens to compute after ``num_computed_tokens`` and after the
                cache hits.
            new_computed_blocks: for a request being admitted (holding no block yet), its
                prefix-cache hits from ``get_computed_blocks``, possibly empty; they are put
                at the start of its block table and counted in ``prefix_cache_queries`` /
                ``prefix_cache_hits`` (tokens). None for a running request.

        Returns:
            False, changing nothing, when the pool has too few free blocks. On success the
            block table covers the computed, hit and new tokens; a shared partial block that
            the new tokens would write into has been replaced by a private copy (the copy is
            queued in ``pending_copies`` as (src, dst) for the model runner).
        """
        hits = new_computed_blocks or []
        bs = self.block_size
        start = request.num_computed_tokens + len(hits) * bs
        needed = self.num_blocks_for(start + num_new_tokens) - len(request.block_ids) - len(hits)
        cow_index = start // bs
        needs_cow = (
            start % bs != 0
            and cow_index < len(request.block_ids)
            and self.block_pool.blocks[request.block_ids[cow_index]].ref_cnt > 1
        )
        if max(needed, 0) + int(needs_cow) > self.block_pool.num_free_after_touch(hits):
            return False
        if new_computed_blocks is not None:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += len(hits) * bs
            self.block_pool.touch(hits)
            request.block_ids.extend(hits)
            request.num_published_blocks = len(hits)
        if needs_cow:
            src = request.block_ids[cow_index]
            (dst,) = self.block_pool.allocate(1)
            self.pending_copies.append((src, dst))
            request.block_ids[cow_index] = dst
            self.block_pool.free([src])
        if needed > 0:
            request.block_ids.extend(self.block_pool.allocate(needed))
        return True

    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` the parent's block table, sharing every block by reference."""
        self.block_pool.touch(parent.block_ids)
        child.block_ids = list(parent.block_ids)
        child.num_published_blocks = parent.num_published_blocks

    def trim(self, request: Request) -> None:
        """Free the blocks past the request's computed tokens (rejected draft tokens)."""
        keep = self.num_blocks_for(request.num_computed_tokens)
        if len(request.block_ids) > keep:
            self.block_pool.free(list(reversed(request.block_ids[keep:])))
            del request.block_ids[keep:]

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) block copies queued since the last call."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def free(self, request: Request) -> None:
        """Release every block of ``request``, device and host (device blocks in reverse, so
        its tail blocks are evicted from the prefix cache before its head blocks)."""
        self.block_pool.free(list(reversed(request.block_ids)))
        request.block_ids = []
        request.num_published_blocks = 0
        if request.cpu_block_ids:
            self.cpu_pool.free(request.cpu_block_ids)
            request.cpu_block_ids = []

    # ------------------------------------------------------------------ swapping
    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's blocks to host memory (PagedAttention section 4.5).

        Each device block gets a private host copy (a shared device block just loses one
        reference). Returns the (device block, host block) copies to make before the device
        blocks are reused, or None, changing nothing, when the host pool is too small.
        """
        if self.cpu_pool is None or self.cpu_pool.num_free_blocks < len(request.block_ids):
            return None
        request.cpu_block_ids = self.cpu_pool.allocate(len(request.block_ids))
        mapping = list(zip(request.block_ids, request.cpu_block_ids))
        self.block_pool.free(list(reversed(request.block_ids)))
        request.block_ids = []
        request.num_published_blocks = 0
        return mapping

    def swap_in(self, request: Request, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Bring a swapped-out request back with room for ``num_new_tokens`` more tokens.

        Returns:
            The (host block, device block) copies to make, or None, changing nothing, when
            the device pool is too small.
        """
        num_swapped = len(request.cpu_block_ids)
        needed = self.num_blocks_for(request.num_computed_tokens + num_new_tokens)
        if max(needed, num_swapped) > self.block_pool.num_free_blocks:
            return None
        request.block_ids = self.block_pool.allocate(num_swapped)
        mapping = list(zip(request.cpu_block_ids, request.block_ids))
        self.cpu_pool.free(request.cpu_block_ids)
        request.cpu_block_ids = []
        if needed > num_swapped:
            request.block_ids.extend(self.block_pool.allocate(needed - num_swapped))
        return mapping

    # ------------------------------------------------------------------ accounting
    def usage(self) -> float:
        """Fraction of blocks referenced by requests, 0 to 1."""
        return 1.0 - self.num_free_blocks / self.num_total_blocks

    def fragmentation(self, requests: list[Request]) -> float:
        """Allocated slots not holding a token / allocated slots, over referenced blocks.

        A block shared by several requests is counted once, with its fullest use.
        """
        filled: dict[int, int] = {}
        bs = self.block_size
        for r in requests:
            for i, block_id in enumerate(r.block_ids):
                n = min(bs, max(0, r.num_computed_tokens - i * bs))
                filled[block_id] = max(filled.get(block_id, 0), n)
        if not filled:
            return 0.0
        slots = len(filled) * bs
        return (slots - sum(filled.values())) / slots
