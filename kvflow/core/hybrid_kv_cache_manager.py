"""Block tables of a hybrid model's KV cache groups (``kvflow/core/kv_cache_groups.py``)
over one shared block pool: sliding groups free the blocks behind their window as a request
advances, full groups keep every block (vLLM's ``HybridKVCacheCoordinator`` with its
``SlidingWindowManager`` / ``FullAttentionManager``, ``vllm/v1/core/``; our own code).

Table layout: a request's ``block_ids`` holds all its groups' tables interleaved, entry
``i * G + g`` being logical block i (tokens ``[i * block_size, (i + 1) * block_size)``) of
group g, ``G = num_groups``; a freed entry is ``NULL_BLOCK``. One list keeps the scheduler's
diffs to the runner, swap, fork and the engine's snapshot unchanged (a table grows by G
entries per logical block); the runner reads group g's table as ``block_ids[g::G]``.

Prefix caching rule: the block of group g holding logical block i is published under the
block's chained token hash with g appended (each group's K/V of the same tokens lives in its
own page). A cached prefix of n blocks is a hit when every full group's blocks ``[0, n)`` are
cached and every sliding group's blocks ``[dead_g(n * block_size), n)`` are (``dead_g(p) =
max(0, (p - W_g + 1) // block_size)``, the blocks no query at position p or later reads);
the sliding groups' entries before ``dead_g`` are ``NULL_BLOCK``. The longest such n is used.
"""

from __future__ import annotations

from kvflow.core.kv_cache_groups import KVCacheGroups
from kvflow.core.kv_cache_manager import NULL_BLOCK, KVCacheManager, cdiv
from kvflow.request import Request


class HybridKVCacheManager(KVCacheManager):
    """``KVCacheManager`` for several KV cache groups (see the module docstring).

    Args:
        groups: the layout (``build_kv_cache_groups``); its ``group_windows`` decide which
            groups free behind a window.
        num_blocks, block_size, enable_prefix_caching, hash_extra, num_cpu_blocks: as
            ``KVCacheManager``; a block is one page (``groups.group_size`` layers' slices).
            Physical block 0 is reserved as ``NULL_BLOCK``.

    Raises:
        ValueError: fewer than 2 blocks.
    """

    def __init__(self, groups: KVCacheGroups, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_extra: bytes = b"", num_cpu_blocks: int = 0) -> None:
        if num_blocks < 2:
            raise ValueError(f"a hybrid KV cache needs at least 2 blocks (one is NULL_BLOCK), got num_blocks={num_blocks}")
        super().__init__(num_blocks, block_size, enable_prefix_caching, hash_extra, num_cpu_blocks)
        self.groups = groups
        self.num_groups = groups.num_groups
        self.windows = groups.group_windows
        self.block_pool.touch([NULL_BLOCK])  # held forever: never allocated
        self._reserved = 1
        self._group_keys = [g.to_bytes(2, "little") for g in range(self.num_groups)]

    # ------------------------------------------------------------------ geometry
    def _dead(self, position: int, g: int) -> int:
        """Leading logical blocks group g no longer reads from ``position`` on."""
        window = self.windows[g]
        return 0 if window is None else max(0, (position - window + 1) // self.block_size)

    def num_dead_blocks(self, position: int) -> int:
        """Leading logical blocks that every group has freed at ``position`` (0 with a full group)."""
        return min(self._dead(position, g) for g in range(self.num_groups))

    def num_hit_tokens(self, hits: list[int]) -> int:
        """Tokens covered by a ``get_computed_blocks`` result (G entries per logical block)."""
        return len(hits) // self.num_groups * self.block_size

    def max_blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        """The most pages one request of ``num_tokens`` tokens ever holds with steps of at most
        ``max_chunk`` tokens: per full group all its blocks, per sliding group at most
        ``cdiv(W + chunk + block_size - 2, block_size)`` (see ``KVCacheManager``)."""
        blocks = self.num_blocks_for(num_tokens)
        chunk = max(1, min(max_chunk, num_tokens))
        return sum(blocks if w is None else min(blocks, cdiv(w + chunk + self.block_size - 2, self.block_size))
                   for w in self.windows)

    def num_pages_for(self, num_tokens: int) -> int:
        """Pages holding ``num_tokens`` tokens in every group (nothing freed yet)."""
        return self.num_blocks_for(num_tokens) * self.num_groups

    def _free_dead_blocks(self, request: Request, position: int) -> None:
        ids, G = request.block_ids, self.num_groups
        n = len(ids) // G
        freed = []
        for g, window in enumerate(self.windows):
            if window is None:
                continue
            i = min(self._dead(position, g), n) - 1
            while i >= 0 and ids[i * G + g] != NULL_BLOCK:
                freed.append(ids[i * G + g])
                ids[i * G + g] = NULL_BLOCK
                i -= 1
        if freed:
            self.block_pool.free(freed)
            self.num_window_freed_blocks += len(freed)

    def _layout(self, num_logical: int, position: int) -> list[bool]:
        """Per interleaved entry of ``num_logical`` logical blocks, whether it is held at
        ``position`` (False: freed behind its group's window)."""
        dead = [self._dead(position, g) for g in range(self.num_groups)]
        return [i >= dead[g] for i in range(num_logical) for g in range(self.num_groups)]

    # ------------------------------------------------------------------ prefix caching
    def get_computed_blocks(self, request: Request) -> list[int]:
        """Longest cached prefix under the module docstring's rule, as interleaved entries
        (``n * G`` of them, ``NULL_BLOCK`` where a sliding group need not hold the block).
        At most ``(num_tokens - 1) // block_size`` logical blocks (the last token is computed)."""
        if not self.enable_prefix_caching or request.needs_every_position:
            return []
        hashes = self._block_hashes(request, (request.num_tokens - 1) // self.block_size)
        G = self.num_groups
        found = [[self.block_pool.lookup(h + key) for h in hashes] for key in self._group_keys]
        best = 0
        runs = [0] * G  # per group: cached blocks ending at block n - 1
        for n in range(1, len(hashes) + 1):
            for g in range(G):
                runs[g] = runs[g] + 1 if found[g][n - 1] is not None else 0
            if any(self.windows[g] is None and runs[g] < n for g in range(G)):
                break  # a full group misses a block: no longer prefix can hit
            if all(runs[g] >= n - self._dead(n * self.block_size, g) for g in range(G)):
                best = n
        keep = self._layout(best, best * self.block_size)
        return [found[k % G][k // G] if keep[k] else NULL_BLOCK for k in range(best * G)]

    def _publish_block(self, request: Request, i: int, block_hash: bytes) -> None:
        """Publish logical block ``i``'s page of each group under the block's hash plus the
        group's key (``KVCacheManager.cache_full_blocks`` calls it; freed pages skipped)."""
        G = self.num_groups
        for g in range(G):
            block_id = request.block_ids[i * G + g]
            if block_id != NULL_BLOCK:
                self.block_pool.publish(block_id, block_hash + self._group_keys[g])

    # ------------------------------------------------------------------ allocation
    def allocate_slots(self, request: Request, num_new_tokens: int, new_computed_blocks: list[int] | None = None) -> bool:
        """As ``KVCacheManager.allocate_slots``, for every group: the blocks behind each
        sliding group's window of the next position are freed first; each new logical block
        takes one page per group; a shared partial block is copied per group (copy-on-write).
        Returns False, changing nothing else, when the pool lacks the pages of all groups."""
        hits = new_computed_blocks or []
        bs, G = self.block_size, self.num_groups
        start = request.num_computed_tokens + len(hits) // G * bs
        self._free_dead_blocks(request, start)
        held_hits = self._held(hits)
        have = (len(request.block_ids) + len(hits)) // G
        new_logical = max(0, self.num_blocks_for(start + num_new_tokens) - have)
        cow = []
        cow_index = start // bs
        if start % bs != 0 and cow_index < len(request.block_ids) // G:
            for g in range(G):
                k = cow_index * G + g
                block_id = request.block_ids[k]
                if block_id != NULL_BLOCK and self.block_pool.blocks[block_id].ref_cnt > 1:
                    cow.append(k)
        if new_logical * G + len(cow) > self.block_pool.num_free_after_touch(held_hits):
            return False
        if new_computed_blocks is not None:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += len(hits) // G * bs
            self.block_pool.touch(held_hits)
            request.block_ids.extend(hits)
            request.num_published_blocks = len(hits) // G
        for k in cow:
            src = request.block_ids[k]
            (dst,) = self.block_pool.allocate(1)
            self.pending_copies.append((src, dst))  # a page: every position of the group
            request.block_ids[k] = dst
            self.block_pool.free([src])
        if new_logical:
            request.block_ids.extend(self.block_pool.allocate(new_logical * G))
        return True

    def trim(self, request: Request) -> None:
        """Free every group's blocks past the computed tokens (rejected draft tokens)."""
        keep = self.num_blocks_for(request.num_computed_tokens) * self.num_groups
        if len(request.block_ids) > keep:
            self.block_pool.free(list(reversed(self._held(request.block_ids[keep:]))))
            del request.block_ids[keep:]

    # ------------------------------------------------------------------ swapping
    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """As ``KVCacheManager.swap_out``: only the pages each group still reads at
        ``num_computed_tokens`` move to host (those behind a window are freed first)."""
        if self.cpu_pool is None:
            return None
        G = self.num_groups
        keep = self._layout(len(request.block_ids) // G, request.num_computed_tokens)
        if self.cpu_pool.num_free_blocks < sum(keep):
            return None
        self._free_dead_blocks(request, request.num_computed_tokens)
        held = self._held(request.block_ids)
        request.cpu_block_ids = self.cpu_pool.allocate(len(held))
        mapping = list(zip(held, request.cpu_block_ids))
        self.block_pool.free(list(reversed(held)))
        request.block_ids = []
        request.num_published_blocks = 0
        return mapping

    def swap_in(self, request: Request, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """As ``KVCacheManager.swap_in``: the table's ``NULL_BLOCK`` entries are put back
        where ``swap_out`` freed them (the same position), then room for the new tokens."""
        num_swapped = len(request.cpu_block_ids)
        position, G = request.num_computed_tokens, self.num_groups
        n, layout = 0, []
        while sum(layout) < num_swapped:  # the logical blocks swap_out held
            n += 1
            layout = self._layout(n, position)
        new_logical = max(0, self.num_blocks_for(position + num_new_tokens) - n)
        if num_swapped + new_logical * G > self.block_pool.num_free_blocks:
            return None
        device_blocks = iter(self.block_pool.allocate(num_swapped))
        request.block_ids = [next(device_blocks) if held else NULL_BLOCK for held in layout]
        mapping = list(zip(request.cpu_block_ids, [b for b in request.block_ids if b != NULL_BLOCK]))
        self.cpu_pool.free(request.cpu_block_ids)
        request.cpu_block_ids = []
        if new_logical:
            request.block_ids.extend(self.block_pool.allocate(new_logical * G))
        return mapping

    # ------------------------------------------------------------------ accounting
    def fragmentation(self, requests: list[Request]) -> float:
        """As ``KVCacheManager.fragmentation``, over every group's pages."""
        filled: dict[int, int] = {}
        bs, G = self.block_size, self.num_groups
        for r in requests:
            for k, block_id in enumerate(r.block_ids):
                if block_id != NULL_BLOCK:
                    n = min(bs, max(0, r.num_computed_tokens - k // G * bs))
                    filled[block_id] = max(filled.get(block_id, 0), n)
        if not filled:
            return 0.0
        slots = len(filled) * bs
        return (slots - sum(filled.values())) / slots
