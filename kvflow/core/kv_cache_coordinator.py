"""One KV cache coordinator over per-group managers sharing one block pool.

After vLLM v1 (``vllm/v1/core/kv_cache_coordinator.py``, ``single_type_kv_cache_manager.py``,
``kv_cache_interface.py``; our own code at our size). A model's attention layers are split into
KV cache groups by their declared attention kind (``kvflow/core/kv_cache_groups.py``: full
attention, or a sliding window of W tokens). Each group has its own block table per request;
all groups take their blocks from ONE ``BlockPool``. A request's tables are
``request.block_ids: tuple[list[int], ...]``, one list per group in group order, all of the
same length (entry i of every group covers the tokens ``[i * block_size, (i + 1) *
block_size)``); a model with one group (G = 1) has a 1-tuple and pays nothing else.

The per-group manager decides what attention kind changes:

- ``FullAttentionManager``: keeps every block; a prefix of n blocks is a cache hit when its
  blocks ``[0, n)`` are all cached.
- ``SlidingWindowManager`` (window W): once a request's next position to compute is p, no
  query reads a key at ``j <= p - W`` again, so its leading ``max(0, (p - W + 1) //
  block_size)`` blocks (``num_skipped_blocks``) go back to the pool and their entries become
  ``NULL_BLOCK`` (physical block 0, reserved, never allocated; attention masks those keys
  out). A prefix of n blocks is a hit when its blocks ``[skipped(n * block_size), n)`` are
  cached: the blocks before are never read again and need not be.

``KVCacheCoordinator.find_longest_cache_hit`` takes the longest n that is a hit in every
group (vLLM's ``HybridKVCacheCoordinator`` iterates a fixed point over the groups; with our
per-n test over all groups it is a single pass). With more than one group a block of group g
is published under the chained token hash with g appended, since each group's K/V of the same
tokens lives in its own block.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvflow.core.block_pool import BlockPool


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


NULL_BLOCK = 0
"""Table entry of a block freed behind a sliding window (physical block 0, reserved)."""


class SingleTypeKVCacheManager:
    """The block-table rules of one KV cache group (full attention here; subclasses change them).

    Args:
        block_size: tokens per block.
        group_id: the group's index.
    """

    sliding_window: int | None = None

    def __init__(self, block_size: int, group_id: int) -> None:
        self.block_size = block_size
        self.group_id = group_id

    def num_skipped_blocks(self, position: int) -> int:
        """Leading blocks no query at ``position`` or later reads (0: full attention)."""
        return 0

    def remove_skipped_blocks(self, table: list[int], position: int) -> list[int]:
        """Set the entries of the blocks skipped at ``position`` to ``NULL_BLOCK``; returns
        the blocks taken out (newest first), for the caller to free. Full attention: none."""
        return []

    def is_cache_hit(self, run: int, n: int) -> bool:
        """Whether a prefix of ``n`` blocks whose last ``run`` blocks are cached is a hit."""
        return run >= n

    def max_blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks one request of ``num_tokens`` tokens holds in this group."""
        return cdiv(num_tokens, self.block_size)


class FullAttentionManager(SingleTypeKVCacheManager):
    """A full-attention group (vLLM's ``FullAttentionManager``): every block is kept."""


class SlidingWindowManager(SingleTypeKVCacheManager):
    """A sliding-window group of ``sliding_window`` W tokens (vLLM's ``SlidingWindowManager``;
    key j is visible from the query at position i when ``i - W < j <= i``).

    Raises:
        ValueError: a window below 1.
    """

    def __init__(self, block_size: int, group_id: int, sliding_window: int) -> None:
        if sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        super().__init__(block_size, group_id)
        self.sliding_window = sliding_window

    def num_skipped_blocks(self, position: int) -> int:
        """``max(0, (position - W + 1) // block_size)``."""
        return max(0, (position - self.sliding_window + 1) // self.block_size)

    def remove_skipped_blocks(self, table: list[int], position: int) -> list[int]:
        i = min(self.num_skipped_blocks(position), len(table)) - 1
        freed = []
        while i >= 0 and table[i] != NULL_BLOCK:  # the entries before the first null were freed before
            freed.append(table[i])
            table[i] = NULL_BLOCK
            i -= 1
        return freed

    def is_cache_hit(self, run: int, n: int) -> bool:
        return run >= n - self.num_skipped_blocks(n * self.block_size)

    def max_blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        """At most ``cdiv(W + chunk + block_size - 2, block_size)``: a step at position p
        holds the blocks of positions ``p - W + 1 .. p + chunk - 1``, the first partly behind
        the window."""
        chunk = max(1, min(max_chunk, num_tokens))
        return min(cdiv(num_tokens, self.block_size), cdiv(self.sliding_window + chunk + self.block_size - 2,
                                                           self.block_size))


def get_manager(block_size: int, group_id: int, sliding_window: int | None) -> SingleTypeKVCacheManager:
    """The per-group manager of an attention kind."""
    if sliding_window is None:
        return FullAttentionManager(block_size, group_id)
    return SlidingWindowManager(block_size, group_id, sliding_window)


class KVCacheCoordinator:
    """The per-group managers of a model's KV cache groups over one block pool.

    Args:
        block_pool: the shared pool.
        block_size: tokens per block.
        group_windows: per group, its sliding window in tokens or None (full attention).

    Attributes:
        managers: per group, its ``SingleTypeKVCacheManager``.
        null_block: ``NULL_BLOCK`` when a group is windowed (the pool reserves it), else None
            (block 0 is an ordinary block).
    """

    def __init__(self, block_pool: BlockPool, block_size: int, group_windows: Sequence[int | None]) -> None:
        if not group_windows:
            raise ValueError("group_windows must name at least one group")
        self.block_pool = block_pool
        self.block_size = block_size
        self.managers = [get_manager(block_size, g, w) for g, w in enumerate(group_windows)]
        self.num_groups = len(self.managers)
        self.has_sliding = any(w is not None for w in group_windows)
        self.null_block = NULL_BLOCK if self.has_sliding else None
        # one group: its blocks are published under the plain chained hash
        self.hash_keys = [b""] if self.num_groups == 1 else [g.to_bytes(2, "little") for g in range(self.num_groups)]

    def empty_tables(self) -> tuple[list[int], ...]:
        return tuple([] for _ in range(self.num_groups))

    def held(self, tables: Sequence[list[int]], start: int = 0) -> list[int]:
        """The physical blocks of entries ``start`` on (``NULL_BLOCK`` entries dropped), in
        release order: last entry first, and within an entry the last group first (a
        request's tail is then evicted from the prefix cache before its head)."""
        null = self.null_block
        if self.num_groups == 1:
            return [b for b in reversed(tables[0][start:]) if b != null]
        n = len(tables[0])
        return [t[i] for i in range(n - 1, start - 1, -1) for t in reversed(tables) if t[i] != null]

    def remove_skipped_blocks(self, tables: Sequence[list[int]], position: int) -> int:
        """Free every windowed group's blocks behind its window of ``position``; returns how
        many were freed."""
        if not self.has_sliding:
            return 0
        freed: list[int] = []
        for manager, table in zip(self.managers, tables):
            freed.extend(manager.remove_skipped_blocks(table, position))
        if freed:
            self.block_pool.free(freed)  # the newest first: the oldest ends last in the LRU list
        return len(freed)

    def find_longest_cache_hit(self, block_hashes: list[bytes]) -> tuple[list[int], ...]:
        """The longest prefix of ``block_hashes`` that is a hit in every group, as per-group
        tables of equal length (``NULL_BLOCK`` where a windowed group need not hold the block)."""
        pool, G = self.block_pool, self.num_groups
        if not self.has_sliding:  # full attention only: stop at the first miss
            hits: list[list[int]] = [[] for _ in range(G)]
            for h in block_hashes:
                ids = [pool.lookup(h + key) for key in self.hash_keys]
                if None in ids:
                    break
                for table, block_id in zip(hits, ids):
                    table.append(block_id)
            return tuple(hits)
        found = [[pool.lookup(h + key) for h in block_hashes] for key in self.hash_keys]
        best = 0
        runs = [0] * G  # per group: cached blocks ending at block n - 1
        for n in range(1, len(block_hashes) + 1):
            for g in range(G):
                runs[g] = runs[g] + 1 if found[g][n - 1] is not None else 0
            if any(m.sliding_window is None and runs[g] < n for g, m in enumerate(self.managers)):
                break  # a full group misses a block: no longer prefix can hit
            if all(m.is_cache_hit(runs[g], n) for g, m in enumerate(self.managers)):
                best = n
        out = []
        for g, manager in enumerate(self.managers):
            skipped = manager.num_skipped_blocks(best * self.block_size)
            out.append([NULL_BLOCK] * skipped + found[g][skipped:best])
        return tuple(out)

    def cache_block(self, tables: Sequence[list[int]], i: int, block_hash: bytes) -> None:
        """Publish every group's block of entry ``i`` (a freed one is skipped)."""
        null = self.null_block
        for table, key in zip(tables, self.hash_keys):
            if table[i] != null:
                self.block_pool.publish(table[i], block_hash + key)

    def max_blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        """Pool blocks one request of ``num_tokens`` tokens ever holds, over all groups."""
        return sum(m.max_blocks_held(num_tokens, max_chunk) for m in self.managers)
