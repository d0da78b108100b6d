"""Per-request block tables on top of the block pool: on-demand allocation, prefix-cache
hits, publishing of full blocks, copy-on-write of shared partial blocks, speculative roll-back
and swapping, for every KV cache group of the model at once.

Blocks are allocated on demand: before each step the scheduler asks for room for the tokens
it is about to compute, and only the blocks those tokens spill into are taken
(Kwon et al. 2023, PagedAttention, section 4.3). Requests forked from one parent (parallel
samples, beam search) share blocks by reference count; the first write into a shared,
partially filled block copies it first (copy-on-write, PagedAttention section 4.4).

One manager for every model (vLLM v1's ``KVCacheManager`` over a ``KVCacheCoordinator``):
the attention kind of each KV cache group (full, or a sliding window that frees the blocks
behind it) is the coordinator's business (``kvflow/core/kv_cache_coordinator.py``); a
request's tables are ``request.block_ids``, one list per group (a 1-tuple for a model with
one group: every layer full, or every layer windowed as Mistral).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvflow.core.block_pool import BlockPool, hash_block_tokens
from kvflow.core.kv_cache_coordinator import NULL_BLOCK, KVCacheCoordinator, cdiv
from kvflow.request import Request

__all__ = ["KVCacheManager", "NULL_BLOCK", "cdiv"]


class KVCacheManager:
    """Maps requests to physical KV blocks, one block table per KV cache group.

    Args:
        num_blocks: physical blocks in the pool (with several groups a block is a page of
            ``group_size`` layers' slices, ``kvflow/core/kv_cache_groups.py``).
        block_size: tokens per block.
        enable_prefix_caching: reuse published full blocks across requests.
        hash_extra: bytes mixed into every block hash (whatever else changes K/V, such as the
            KV cache dtype), so blocks of different caches never match.
        num_cpu_blocks: host blocks for swap preemption (0: none).
        sliding_window: shorthand for one group windowed with this many tokens (a model whose
            every layer has the window); None: see ``group_windows``.
        group_windows: per KV cache group, its sliding window in tokens or None (full
            attention), in group order (``KVCacheGroups.group_windows``); default one full
            group. A windowed group reserves physical block 0 as ``NULL_BLOCK``.

    Raises:
        ValueError: both ``sliding_window`` and ``group_windows``, a window below 1, or a
            windowed group with fewer than 2 blocks.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        hash_extra: bytes = b"",
        num_cpu_blocks: int = 0,
        sliding_window: int | None = None,
        group_windows: Sequence[int | None] | None = None,
    ) -> None:
        if sliding_window is not None and group_windows is not None:
            raise ValueError("give sliding_window (one group) or group_windows, not both")
        windows = tuple(group_windows) if group_windows is not None else (sliding_window,)
        if any(w is not None for w in windows) and (any(w is not None and w < 1 for w in windows) or num_blocks < 2):
            raise ValueError(f"a sliding window must be >= 1 with at least 2 blocks, got windows {windows} "
                             f"with num_blocks={num_blocks}")
        self.block_size = block_size
        self.cpu_pool = BlockPool(num_cpu_blocks) if num_cpu_blocks > 0 else None
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_extra = hash_extra
        self.block_pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.coordinator = KVCacheCoordinator(self.block_pool, block_size, windows)
        self.num_groups = self.coordinator.num_groups
        self.group_windows = windows
        # the one group's window (None with several groups: see group_windows)
        self.sliding_window = windows[0] if len(windows) == 1 else None
        self.pending_copies: list[tuple[int, int]] = []
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_window_freed_blocks = 0  # blocks returned behind a sliding window, in all
        self._null = self.coordinator.null_block
        self._reserved = 0
        if self._null is not None:
            self.block_pool.touch([NULL_BLOCK])  # held forever: never allocated
            self._reserved = 1

    @classmethod
    def from_cache_config(cls, cache_config, sliding_window: int | None = None) -> "KVCacheManager":
        """The manager of an engine's ``CacheConfig``: its groups' windows when it has
        ``kv_cache_groups``, else one group with ``sliding_window`` (the model's
        ``kv_free_window``). Block hashes include the cache dtype."""
        groups = cache_config.kv_cache_groups
        return cls(
            cache_config.num_blocks, cache_config.block_size,
            enable_prefix_caching=cache_config.enable_prefix_caching,
            hash_extra=str(cache_config.dtype).encode(), num_cpu_blocks=cache_config.num_cpu_blocks,
            sliding_window=sliding_window if groups is None else None,
            group_windows=groups.group_windows if groups is not None else None,
        )

    # ------------------------------------------------------------------ geometry
    @property
    def num_total_blocks(self) -> int:
        """Blocks requests can hold (the pool less the reserved ``NULL_BLOCK``)."""
        return self.block_pool.num_blocks - self._reserved

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def max_blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        """The most pool blocks one request of ``num_tokens`` tokens ever holds when each step
        computes at most ``max_chunk`` of its tokens: per full group all its blocks, per
        windowed group at most ``cdiv(W + max_chunk + block_size - 2, block_size)``."""
        return self.coordinator.max_blocks_held(num_tokens, max_chunk)

    def num_dead_blocks(self, position: int) -> int:
        """Leading blocks that every group has freed at ``position`` (0 with a full group;
        ``max(0, (position - W + 1) // block_size)`` for one group of window W)."""
        return min(m.num_skipped_blocks(position) for m in self.coordinator.managers)

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks of one group's table holding ``num_tokens`` tokens."""
        return cdiv(num_tokens, self.block_size)

    def num_pages_for(self, num_tokens: int) -> int:
        """Pool blocks that ``num_tokens`` tokens take in every group before any is freed."""
        return cdiv(num_tokens, self.block_size) * self.num_groups

    def num_hit_tokens(self, hits: Sequence[list[int]]) -> int:
        """Tokens covered by a ``get_computed_blocks`` result."""
        return len(hits[0]) * self.block_size if hits else 0

    def reset_prefix_cache(self) -> bool:
        """See ``BlockPool.reset_prefix_cache``."""
        return self.block_pool.reset_prefix_cache()

    def _tables(self, request: Request) -> tuple[list[int], ...]:
        """The request's per-group tables, created empty for a request holding none."""
        if len(request.block_ids) != self.num_groups:
            request.block_ids = self.coordinator.empty_tables()
        return request.block_ids

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

    def get_computed_blocks(self, request: Request) -> tuple[list[int], ...]:
        """Longest cached prefix of the request's tokens, as per-group tables of one length.

        The last token is always left to compute (its logits are needed), so at most
        ``(num_tokens - 1) // block_size`` blocks are returned. Call it when the request is
        about to be admitted: the cache may have changed while it waited. A windowed group
        needs only the blocks inside the window of the prefix's end (the rule is
        ``KVCacheCoordinator.find_longest_cache_hit``'s); its entries before are
        ``NULL_BLOCK``. Empty (``()``) without prefix caching or for a request that reads
        every prompt position (prompt_logprobs, mean pooling).
        """
        if not self.enable_prefix_caching or request.needs_every_position:
            return ()
        hashes = self._block_hashes(request, (request.num_tokens - 1) // self.block_size)
        return self.coordinator.find_longest_cache_hit(hashes)

    def cache_full_blocks(self, request: Request) -> None:
        """Publish the request's blocks that are full of computed (final) tokens (with
        several groups each group's block under the hash plus its group key)."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        if num_full <= request.num_published_blocks:
            return
        hashes = self._block_hashes(request, num_full)
        tables = request.block_ids
        for i in range(request.num_published_blocks, num_full):
            self.coordinator.cache_block(tables, i, hashes[i])
        request.num_published_blocks = num_full

    # ------------------------------------------------------------------ allocation
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[list[int]] | None = None) -> bool:
        """Make room for the next ``num_new_tokens`` tokens of ``request`` in every group.

        Args:
            request: the request; its block tables grow in place.
            num_new_tokens: tokens to compute after ``num_computed_tokens`` and after the
                cache hits.
            new_computed_blocks: for a request being admitted (holding no block yet), its
                prefix-cache hits from ``get_computed_blocks``, possibly empty; they are put
                at the start of its tables and counted in ``prefix_cache_queries`` /
                ``prefix_cache_hits`` (tokens). None for a running request.

        The blocks behind each windowed group's window of the next position are freed first
        (whatever the outcome: no query reads them again).

        Returns:
            False, changing nothing else, when the pool has too few free blocks. On success the
            tables cover the computed, hit and new tokens (a new block is one block per
            group); a shared partial block that the new tokens would write into has been
            replaced by a private copy per group (queued in ``pending_copies`` as (src, dst)
            for the model runner).
        """
        bs, G, null = self.block_size, self.num_groups, self._null
        if new_computed_blocks is None and G == 1 and null is None and request.block_ids:
            # The common decode step: the new tokens fit in the blocks held, none of which is
            # shared (no copy-on-write) — nothing to allocate, free or copy.
            table = request.block_ids[0]
            start = request.num_computed_tokens
            if start + num_new_tokens <= len(table) * bs and (
                    start % bs == 0 or self.block_pool.blocks[table[start // bs]].ref_cnt == 1):
                return True
        tables = self._tables(request)
        hits = new_computed_blocks or ()
        num_hit = len(hits[0]) if hits else 0
        start = request.num_computed_tokens + num_hit * bs
        if null is not None:
            self.num_window_freed_blocks += self.coordinator.remove_skipped_blocks(tables, start)
            held_hits = [b for table in hits for b in table if b != null]
        else:
            held_hits = [b for table in hits for b in table]
        new_blocks = max(0, self.num_blocks_for(start + num_new_tokens) - len(tables[0]) - num_hit)
        cow: list[int] = []  # groups whose partial block at start is shared
        cow_index = start // bs
        if start % bs != 0 and cow_index < len(tables[0]):
            blocks = self.block_pool.blocks
            cow = [g for g, table in enumerate(tables)
                   if table[cow_index] != null and blocks[table[cow_index]].ref_cnt > 1]
        if new_blocks * G + len(cow) > self.block_pool.num_free_after_touch(held_hits):
            return False
        if new_computed_blocks is not None:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit * bs
            self.block_pool.touch(held_hits)
            for table, group_hits in zip(tables, hits):
                table.extend(group_hits)
            request.num_published_blocks = num_hit
        for g in cow:
            src = tables[g][cow_index]
            (dst,) = self.block_pool.allocate(1)
            self.pending_copies.append((src, dst))  # a page: every layer position of the group
            tables[g][cow_index] = dst
            self.block_pool.free([src])
        if new_blocks:
            if G == 1:
                tables[0].extend(self.block_pool.allocate(new_blocks))
            else:
                taken = self.block_pool.allocate(new_blocks * G)
                for g, table in enumerate(tables):
                    table.extend(taken[g::G])
        return True

    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` the parent's tables, sharing every block by reference."""
        self.block_pool.touch(self.coordinator.held(parent.block_ids))
        child.block_ids = tuple(list(table) for table in parent.block_ids)
        child.num_published_blocks = parent.num_published_blocks

    def trim(self, request: Request) -> None:
        """Free every group's blocks past the request's computed tokens (rejected draft
        tokens: speculative roll-back)."""
        keep = self.num_blocks_for(request.num_computed_tokens)
        tables = request.block_ids
        if tables and len(tables[0]) > keep:
            self.block_pool.free(self.coordinator.held(tables, keep))
            for table in tables:
                del table[keep:]

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) block copies queued since the last call."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def free(self, request: Request) -> None:
        """Release every block of ``request``, device and host (device blocks from the tail,
        so its tail blocks are evicted from the prefix cache before its head blocks)."""
        if request.block_ids:
            self.block_pool.free(self.coordinator.held(request.block_ids))
        request.block_ids = ()
        request.num_published_blocks = 0
        if request.cpu_block_ids:
            self.cpu_pool.free(request.cpu_block_ids)
            request.cpu_block_ids = []

    # ------------------------------------------------------------------ swapping
    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's blocks to host memory (PagedAttention section 4.5).

        Each device block gets a private host copy (a shared device block just loses one
        reference); ``cpu_block_ids`` lists them group after group. Only the blocks each
        group still reads at ``num_computed_tokens`` move (those behind a window are freed
        first; ``swap_in`` puts their ``NULL_BLOCK`` entries back). Returns the (device block,
        host block) copies to make before the device blocks are reused, or None, changing
        nothing, when the host pool is too small.
        """
        if self.cpu_pool is None:
            return None
        tables, position = self._tables(request), request.num_computed_tokens
        n = len(tables[0])
        keep = sum(n - min(m.num_skipped_blocks(position), n) for m in self.coordinator.managers)
        if self.cpu_pool.num_free_blocks < keep:
            return None
        self.num_window_freed_blocks += self.coordinator.remove_skipped_blocks(tables, position)
        null = self._null
        held = [b for table in tables for b in table if b != null]
        request.cpu_block_ids = self.cpu_pool.allocate(len(held))
        # A block copied on write in this step (a pending copy, which the runner makes after
        # the swap-outs) holds nothing yet: its source's K/V goes to the host, and the copy
        # into the freed block is dropped.
        if self.pending_copies:
            copied = {dst: src for src, dst in self.pending_copies}
            moved = {b for b in held if b in copied}
            if moved:
                self.pending_copies = [(s, d) for s, d in self.pending_copies if d not in moved]
                held = [copied.get(b, b) for b in held]
        mapping = list(zip(held, request.cpu_block_ids))
        self.block_pool.free(self.coordinator.held(tables))
        request.block_ids = ()
        request.num_published_blocks = 0
        return mapping

    def swap_in(self, request: Request, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Bring a swapped-out request back with room for ``num_new_tokens`` more tokens; the
        entries ``swap_out`` freed behind a window (same position) are ``NULL_BLOCK`` again.

        Returns:
            The (host block, device block) copies to make, or None, changing nothing, when
            the device pool is too small.
        """
        num_swapped, position, G = len(request.cpu_block_ids), request.num_computed_tokens, self.num_groups
        skipped = [m.num_skipped_blocks(position) for m in self.coordinator.managers]
        n = (num_swapped + sum(skipped)) // G  # entries per table at swap_out (skipped[g] <= n)
        new_blocks = max(0, self.num_blocks_for(position + num_new_tokens) - n)
        if num_swapped + new_blocks * G > self.block_pool.num_free_blocks:
            return None
        device_blocks = self.block_pool.allocate(num_swapped)
        tables, k = [], 0
        for dead in skipped:
            tables.append([NULL_BLOCK] * dead + device_blocks[k : k + n - dead])
            k += n - dead
        request.block_ids = tuple(tables)
        mapping = list(zip(request.cpu_block_ids, device_blocks))
        self.cpu_pool.free(request.cpu_block_ids)
        request.cpu_block_ids = []
        if new_blocks:
            taken = self.block_pool.allocate(new_blocks * G)
            for g, table in enumerate(request.block_ids):
                table.extend(taken[g::G])
        return mapping

    # ------------------------------------------------------------------ accounting
    def usage(self) -> float:
        """Fraction of blocks referenced by requests, 0 to 1."""
        return 1.0 - self.num_free_blocks / self.num_total_blocks

    def num_held_blocks(self, request: Request) -> int:
        """Physical blocks in the request's tables (``NULL_BLOCK`` entries not counted)."""
        null = self._null
        return sum(1 for table in request.block_ids for b in table if b != null)

    def fragmentation(self, requests: list[Request]) -> float:
        """Allocated slots not holding a token / allocated slots, over referenced blocks of
        every group. A block shared by several requests is counted once, with its fullest use.
        """
        filled: dict[int, int] = {}
        bs, null = self.block_size, self._null
        for r in requests:
            for table in r.block_ids:
                for i, block_id in enumerate(table):
                    if block_id == null:
                        continue
                    n = min(bs, max(0, r.num_computed_tokens - i * bs))
                    filled[block_id] = max(filled.get(block_id, 0), n)
        if not filled:
            return 0.0
        slots = len(filled) * bs
        return (slots - sum(filled.values())) / slots
