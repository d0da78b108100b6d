"""Per-request block tables on top of the block pool: on-demand allocation, prefix-cache
hits, publishing of full blocks and copy-on-write of shared partial blocks.

Blocks are allocated on demand: before each step the scheduler asks for room for the tokens
it is about to compute, and only the blocks those tokens spill into are taken
(Kwon et al. 2023, PagedAttention, section 4.3). Requests forked from one parent (parallel
samples, beam search) share blocks by reference count; the first write into a shared,
partially filled block copies it first (copy-on-write, PagedAttention section 4.4).

Sliding window (a model whose every layer attends within ``sliding_window`` W tokens,
Mistral; vLLM's ``SlidingWindowManager``): once a request's next token to compute is at
position p, no query of it will read a key at a position ``j <= p - W`` again, so the leading
``max(0, (p - W + 1) // block_size)`` blocks are returned to the pool as the request advances
(``allocate_slots``) and their table entries point at ``NULL_BLOCK``, physical block 0,
reserved for it (never allocated; attention masks those keys out). A prefix-cache hit then
needs only the blocks inside the window of its first computed position: the longest prefix of
n blocks whose blocks ``[dead(n), n)`` are all cached counts, the blocks before ``dead(n)``
need not be (they become ``NULL_BLOCK`` entries). Hybrid models (some full-attention layers)
use ``HybridKVCacheManager`` (kvflow/core/hybrid_kv_cache_manager.py: one table per group).
"""

from __future__ import annotations

from kvflow.core.block_pool import BlockPool, hash_block_tokens
from kvflow.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


NULL_BLOCK = 0
"""Table entry of a block freed behind the sliding window (physical block 0, reserved)."""


class KVCacheManager:
    """Maps requests to physical KV blocks.

    Args:
        num_blocks: physical blocks in the pool.
        block_size: tokens per block.
        enable_prefix_caching: reuse published full blocks across requests.
        hash_extra: bytes mixed into every block hash (whatever else changes K/V, such as the
            KV cache dtype), so blocks of different caches never match.
        num_cpu_blocks: host blocks for swap preemption (0: none).
        sliding_window: free the blocks behind this window (tokens) as requests advance, or
            None to keep every block. Reserves physical block 0 as ``NULL_BLOCK``.

    Raises:
        ValueError: a ``sliding_window`` below 1, or with a single block.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        hash_extra: bytes = b"",
        num_cpu_blocks: int = 0,
        sliding_window: int | None = None,
    ) -> None:
        if sliding_window is not None and (sliding_window < 1 or num_blocks < 2):
            raise ValueError(f"sliding_window must be >= 1 with at least 2 blocks, got {sliding_window} "
                             f"with num_blocks={num_blocks}")
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.cpu_pool = BlockPool(num_cpu_blocks) if num_cpu_blocks > 0 else None
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_extra = hash_extra
        self.block_pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.pending_copies: list[tuple[int, int]] = []
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_window_freed_blocks = 0  # blocks returned behind the sliding window, in all
        self._reserved = 0
        if sliding_window is not None:
            self.block_pool.touch([NULL_BLOCK])  # held forever: never allocated
            self._reserved = 1

    @property
    def num_total_blocks(self) -> int:
        """Blocks requests can hold (the pool less the reserved ``NULL_BLOCK``)."""
        return self.block_pool.num_blocks - self._reserved

    def max_blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks one request of ``num_tokens`` tokens ever holds when each step
        computes at most ``max_chunk`` of its tokens: all its blocks, or with a sliding window
        W at most ``cdiv(W + max_chunk + block_size - 2, block_size)`` (a step at position p
        holds the blocks of positions ``p - W + 1 .. p + max_chunk - 1``, the first one
        partly behind the window)."""
        blocks = self.num_blocks_for(num_tokens)
        if self.sliding_window is None:
            return blocks
        chunk = max(1, min(max_chunk, num_tokens))
        return min(blocks, cdiv(self.sliding_window + chunk + self.block_size - 2, self.block_size))

    def num_dead_blocks(self, position: int) -> int:
        """Leading blocks that no query at ``position`` or later reads under the sliding
        window (0 without one): ``max(0, (position - W + 1) // block_size)``."""
        if self.sliding_window is None:
            return 0
        return max(0, (position - self.sliding_window + 1) // self.block_size)

    def _free_dead_blocks(self, request: Request, position: int) -> None:
        """Return the request's blocks behind the window of ``position`` to the pool (their
        entries become ``NULL_BLOCK``; the entries before the first null were freed before)."""
        ids = request.block_ids
        i = min(self.num_dead_blocks(position), len(ids)) - 1
        freed = []
        while i >= 0 and ids[i] != NULL_BLOCK:
            freed.append(ids[i])
            ids[i] = NULL_BLOCK
            i -= 1
        if freed:
            self.block_pool.free(freed)  # the newest first: the oldest ends last in the LRU list
            self.num_window_freed_blocks += len(freed)

    def _held(self, block_ids: list[int]) -> list[int]:
        """The physical blocks of a table (``NULL_BLOCK`` entries dropped)."""
        return [b for b in block_ids if b != NULL_BLOCK] if self._reserved else list(block_ids)

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def reset_prefix_cache(self) -> bool:
        """See ``BlockPool.reset_prefix_cache``."""
        return self.block_pool.reset_prefix_cache()

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return cdiv(num_tokens, self.block_size)

    def num_pages_for(self, num_tokens: int) -> int:
        """Pool blocks that ``num_tokens`` tokens take before any is freed (one table: as
        ``num_blocks_for``; ``HybridKVCacheManager``: one per group and logical block)."""
        return cdiv(num_tokens, self.block_size)

    def num_hit_tokens(self, hits: list[int]) -> int:
        """Tokens covered by a ``get_computed_blocks`` result."""
        return len(hits) * self.block_size

    # ------------------------------------------------------------------ prefix caching
    def _block_hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """Chained hashes of the request's first ``num_blocks`` full blocks (memoized)."""
        hashes = request.block_hashes
        bs = self.block_size
        lora = getattr(request, "lora_request", None)  # an adapter's K/V is its own: never shared with others
        extra = self.hash_extra if lora is None else self.hash_extra + lora.cache_key
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, request.all_token_ids[i * bs : (i + 1) * bs], extra))
        return hashes[:num_blocks]

    def get_computed_blocks(self, request: Request) -> list[int]:
        """Longest chain of cached full blocks that prefixes the request's tokens.

        The last token is always left to compute (its logits are needed), so at most
        ``(num_tokens - 1) // block_size`` blocks are returned. Call it when the request is
        about to be admitted: the cache may have changed while it waited.

        With a sliding window the prefix of n blocks is a hit when its blocks inside the
        window of position ``n * block_size`` are cached (the blocks before are not read
        again): the longest such n, its first ``num_dead_blocks(n * block_size)`` entries
        ``NULL_BLOCK``.
        """
        if not self.enable_prefix_caching or request.needs_every_position:
            return []  # prompt_logprobs and mean pooling read every prompt position
        hashes = self._block_hashes(request, (request.num_tokens - 1) // self.block_size)
        if self.sliding_window is None:
            hits: list[int] = []
            for block_hash in hashes:
                block_id = self.block_pool.lookup(block_hash)
                if block_id is None:
                    break
                hits.append(block_id)
            return hits
        ids = [self.block_pool.lookup(h) for h in hashes]
        best, run = 0, 0  # run: cached blocks ending at block n - 1
        for n in range(1, len(ids) + 1):
            run = run + 1 if ids[n - 1] is not None else 0
            if run >= n - self.num_dead_blocks(n * self.block_size):
                best = n
        dead = self.num_dead_blocks(best * self.block_size)
        return [NULL_BLOCK] * dead + ids[dead:best]

    def cache_full_blocks(self, request: Request) -> None:
        """Publish the request's blocks that are full of computed (final) tokens."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        if num_full <= request.num_published_blocks:
            return
        hashes = self._block_hashes(request, num_full)
        for i in range(request.num_published_blocks, num_full):
            self._publish_block(request, i, hashes[i])
        request.num_published_blocks = num_full

    def _publish_block(self, request: Request, i: int, block_hash: bytes) -> None:
        """Publish the request's logical block ``i`` under ``block_hash`` (one held by the
        window's freeing is skipped); the hybrid manager publishes every group's page."""
        if not (self._reserved and request.block_ids[i] == NULL_BLOCK):  # (freed behind the window)
            self.block_pool.publish(request.block_ids[i], block_hash)

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

        With a sliding window, a running request's blocks behind the window of its next
        position are freed first (whatever the outcome: no query reads them again).

        Returns:
            False, changing nothing else, when the pool has too few free blocks. On success the
            block table covers the computed, hit and new tokens; a shared partial block that
            the new tokens would write into has been replaced by a private copy (the copy is
            queued in ``pending_copies`` as (src, dst) for the model runner).
        """
        hits = new_computed_blocks or []
        bs = self.block_size
        start = request.num_computed_tokens + len(hits) * bs
        if self.sliding_window is not None:
            self._free_dead_blocks(request, start)
            held_hits = self._held(hits)
        else:
            held_hits = hits
        needed = self.num_blocks_for(start + num_new_tokens) - len(request.block_ids) - len(hits)
        cow_index = start // bs
        needs_cow = (
            start % bs != 0
            and cow_index < len(request.block_ids)
            and self.block_pool.blocks[request.block_ids[cow_index]].ref_cnt > 1
        )
        if max(needed, 0) + int(needs_cow) > self.block_pool.num_free_after_touch(held_hits):
            return False
        if new_computed_blocks is not None:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += len(hits) * bs
            self.block_pool.touch(held_hits)
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
        self.block_pool.touch(self._held(parent.block_ids))
        child.block_ids = list(parent.block_ids)
        child.num_published_blocks = parent.num_published_blocks

    def trim(self, request: Request) -> None:
        """Free the blocks past the request's computed tokens (rejected draft tokens)."""
        keep = self.num_blocks_for(request.num_computed_tokens)
        if len(request.block_ids) > keep:
            self.block_pool.free(list(reversed(self._held(request.block_ids[keep:]))))
            del request.block_ids[keep:]

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) block copies queued since the last call."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def free(self, request: Request) -> None:
        """Release every block of ``request``, device and host (device blocks in reverse, so
        its tail blocks are evicted from the prefix cache before its head blocks)."""
        self.block_pool.free(list(reversed(self._held(request.block_ids))))
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
        blocks are reused, or None, changing nothing, when the host pool is too small. With a
        sliding window only the blocks inside the window of ``num_computed_tokens`` move
        (those behind it are freed first; ``swap_in`` puts ``NULL_BLOCK`` entries back).
        """
        if self.cpu_pool is None:
            return None
        dead = self.num_dead_blocks(request.num_computed_tokens)
        if self.cpu_pool.num_free_blocks < len(request.block_ids) - min(dead, len(request.block_ids)):
            return None
        if self.sliding_window is not None:
            self._free_dead_blocks(request, request.num_computed_tokens)
        held = request.block_ids[dead:]
        request.cpu_block_ids = self.cpu_pool.allocate(len(held))
        mapping = list(zip(held, request.cpu_block_ids))
        self.block_pool.free(list(reversed(held)))
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
        dead = self.num_dead_blocks(request.num_computed_tokens)  # as at swap_out (same position)
        needed = self.num_blocks_for(request.num_computed_tokens + num_new_tokens) - dead
        if max(needed, num_swapped) > self.block_pool.num_free_blocks:
            return None
        device_blocks = self.block_pool.allocate(num_swapped)
        request.block_ids = [NULL_BLOCK] * dead + device_blocks
        mapping = list(zip(request.cpu_block_ids, device_blocks))
        self.cpu_pool.free(request.cpu_block_ids)
        request.cpu_block_ids = []
        if needed > num_swapped:
            request.block_ids.extend(self.block_pool.allocate(needed - num_swapped))
        return mapping

    # ------------------------------------------------------------------ accounting
    def usage(self) -> float:
        """Fraction of blocks referenced by requests, 0 to 1."""
        return 1.0 - self.num_free_blocks / self.num_total_blocks

    def num_held_blocks(self, request: Request) -> int:
        """Physical blocks in the request's table (``NULL_BLOCK`` entries not counted)."""
        return len(self._held(request.block_ids))

    def fragmentation(self, requests: list[Request]) -> float:
        """Allocated slots not holding a token / allocated slots, over referenced blocks.

        A block shared by several requests is counted once, with its fullest use.
        """
        filled: dict[int, int] = {}
        bs = self.block_size
        for r in requests:
            for i, block_id in enumerate(r.block_ids):
                if self._reserved and block_id == NULL_BLOCK:
                    continue
                n = min(bs, max(0, r.num_computed_tokens - i * bs))
                filled[block_id] = max(filled.get(block_id, 0), n)
        if not filled:
            return 0.0
        slots = len(filled) * bs
        return (slots - sum(filled.values())) / slots
