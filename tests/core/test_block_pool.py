"""BlockPool: allocation, reference counts, double free, over-allocation, LRU free list.

(The prefix index of the pool, ``publish`` / ``lookup``, is not covered here.)
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.core.block_pool import BlockPool


def ref_counts(pool: BlockPool) -> list[int]:
    return [b.ref_cnt for b in pool.blocks]


def free_order(pool: BlockPool) -> list[int]:
    return list(pool._free)


def test_new_pool_is_all_free_in_id_order():
    pool = BlockPool(5)
    assert pool.num_blocks == 5
    assert pool.num_free_blocks == 5
    assert ref_counts(pool) == [0] * 5
    assert [b.block_id for b in pool.blocks] == [0, 1, 2, 3, 4]
    assert free_order(pool) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("n", [0, -1])
def test_pool_needs_at_least_one_block(n):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(n)


def test_allocate_takes_blocks_with_ref_cnt_one():
    pool = BlockPool(5)
    ids = pool.allocate(3)
    assert ids == [0, 1, 2]
    assert pool.num_free_blocks == 2
    assert ref_counts(pool) == [1, 1, 1, 0, 0]
    assert pool.allocate(0) == []
    assert pool.num_free_blocks == 2
    assert pool.allocate(2) == [3, 4]
    assert pool.num_free_blocks == 0


def test_over_allocation_raises_and_changes_nothing():
    pool = BlockPool(4)
    pool.allocate(3)
    before_refs, before_free = ref_counts(pool), free_order(pool)
    with pytest.raises(RuntimeError):
        pool.allocate(2)
    assert ref_counts(pool) == before_refs
    assert free_order(pool) == before_free
    assert pool.num_free_blocks == 1
    with pytest.raises(RuntimeError):
        BlockPool(2).allocate(3)


def test_free_returns_blocks():
    pool = BlockPool(4)
    ids = pool.allocate(4)
    pool.free(ids)
    assert pool.num_free_blocks == 4
    assert ref_counts(pool) == [0, 0, 0, 0]


def test_double_free_raises_and_ref_cnt_stays_zero():
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    pool.free([a])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([a])
    assert pool.blocks[a].ref_cnt == 0
    assert pool.num_free_blocks == 3
    # A never-allocated block is also a double free.
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([2])
    assert ref_counts(pool) == [0, 0, 0]
    assert pool.num_free_blocks == 3


def test_touch_keeps_block_until_last_reference_dropped():
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    pool.touch([a])
    pool.touch([a])
    assert pool.blocks[a].ref_cnt == 3
    pool.free([a])
    pool.free([a])
    assert pool.blocks[a].ref_cnt == 1
    assert pool.num_free_blocks == 2
    assert a not in free_order(pool)
    pool.free([a])
    assert pool.blocks[a].ref_cnt == 0
    assert pool.num_free_blocks == 3
    with pytest.raises(RuntimeError):
        pool.free([a])
    assert pool.blocks[a].ref_cnt == 0


def test_free_list_is_lru_least_recently_freed_first():
    pool = BlockPool(4)
    assert pool.allocate(4) == [0, 1, 2, 3]
    pool.free([2])
    pool.free([0])
    pool.free([3, 1])
    assert free_order(pool) == [2, 0, 3, 1]
    assert pool.allocate(4) == [2, 0, 3, 1]


def test_freed_blocks_go_behind_never_used_ones():
    pool = BlockPool(5)
    assert pool.allocate(2) == [0, 1]
    pool.free([1])
    pool.free([0])
    # Untouched blocks 2..4 were "freed" earliest (at construction), so they come first.
    assert pool.allocate(3) == [2, 3, 4]
    assert pool.allocate(2) == [1, 0]


def test_touch_of_free_block_takes_it_off_the_free_list():
    pool = BlockPool(3)
    pool.touch([1])
    assert pool.blocks[1].ref_cnt == 1
    assert free_order(pool) == [0, 2]
    assert pool.allocate(2) == [0, 2]
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    pool.free([1])
    assert free_order(pool) == [1]


def test_shared_block_rejoins_free_list_when_last_ref_dropped():
    pool = BlockPool(3)
    a, b, _ = pool.allocate(3)
    pool.touch([a])
    pool.free([a])  # still held once
    pool.free([b])
    pool.free([a])  # now free, after b
    assert free_order(pool) == [b, a]


@settings(max_examples=60, deadline=None)
@given(
    num_blocks=st.integers(1, 8),
    ops=st.lists(st.tuples(st.sampled_from(["alloc", "touch", "touch_any", "free"]), st.integers(0, 9)), max_size=40),
)
def test_random_ops_match_reference_counts(num_blocks, ops):
    """Random allocate / touch / free against a plain dict of reference counts."""
    pool = BlockPool(num_blocks)
    model = {i: 0 for i in range(num_blocks)}
    for op, arg in ops:
        held = [i for i, c in model.items() if c > 0]
        if op == "alloc":
            n = arg % (num_blocks + 2)
            free_before = pool.num_free_blocks
            if n > free_before:
                with pytest.raises(RuntimeError):
                    pool.allocate(n)
            else:
                ids = pool.allocate(n)
                assert len(ids) == n == len(set(ids))
                for i in ids:
                    assert model[i] == 0
                    model[i] = 1
        elif op == "touch" and held:
            i = held[arg % len(held)]
            pool.touch([i])
            model[i] += 1
        elif op == "touch_any":  # a free block too (a prefix-cache hit takes it back)
            i = arg % num_blocks
            pool.touch([i])
            model[i] += 1
        elif op == "free":
            i = arg % num_blocks
            if model[i] == 0:
                with pytest.raises(RuntimeError):
                    pool.free([i])
            else:
                pool.free([i])
                model[i] -= 1
        assert ref_counts(pool) == [model[i] for i in range(num_blocks)]
        assert all(c >= 0 for c in ref_counts(pool))
        assert sorted(free_order(pool)) == sorted(i for i, c in model.items() if c == 0)
        assert pool.num_free_blocks == sum(1 for c in model.values() if c == 0)
