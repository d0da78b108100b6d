"""KVCacheManager: blocks are allocated on demand, never for the max length up front."""

from __future__ import annotations

import pytest

from kvflow.core.kv_cache_manager import KVCacheManager, cdiv
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams


def table(request) -> list[int]:
    """The request's block table (one KV cache group: ``block_ids[0]``; empty when it holds none)."""
    return request.block_ids[0] if request.block_ids else []


def make_request(request_id: str, prompt_len: int, max_tokens: int = 100) -> Request:
    return Request(request_id, list(range(prompt_len)), SamplingParams(temperature=0, max_tokens=max_tokens), None)


def ref_counts(kv: KVCacheManager) -> list[int]:
    return [b.ref_cnt for b in kv.block_pool.blocks]


@pytest.mark.parametrize(("a", "b", "expected"), [(0, 4, 0), (1, 4, 1), (4, 4, 1), (5, 4, 2), (8, 4, 2), (9, 4, 3), (7, 1, 7)])
def test_cdiv(a, b, expected):
    assert cdiv(a, b) == expected


def test_num_blocks_for():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    assert [kv.num_blocks_for(n) for n in [0, 1, 3, 4, 5, 8, 9, 16, 17]] == [0, 1, 1, 1, 2, 2, 3, 4, 5]
    assert kv.num_total_blocks == 10
    assert kv.num_free_blocks == 10


def test_allocation_covers_only_the_tokens_asked_for():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    req = make_request("a", prompt_len=5, max_tokens=100)  # could grow to 105 tokens = 27 blocks
    assert kv.allocate_slots(req, 5)
    assert len(table(req)) == 2
    assert kv.num_free_blocks == 62
    assert table(req) == [0, 1]


def test_blocks_grow_one_at_a_time_as_tokens_arrive():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    req = make_request("a", prompt_len=5)
    assert kv.allocate_slots(req, 5)
    req.num_computed_tokens = 5
    held = []
    for _ in range(8):  # decode tokens 6..13
        assert kv.allocate_slots(req, 1)
        req.num_computed_tokens += 1
        held.append(len(table(req)))
    # tokens: 6 7 8 -> 2 blocks; 9..12 -> 3 blocks; 13 -> 4 blocks
    assert held == [2, 2, 2, 3, 3, 3, 3, 4]
    assert kv.num_free_blocks == 60
    assert len(set(table(req))) == 4


def test_chunked_prefill_allocates_per_chunk():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    req = make_request("a", prompt_len=20)
    assert kv.allocate_slots(req, 3)
    assert len(table(req)) == 1
    req.num_computed_tokens = 3
    assert kv.allocate_slots(req, 3)
    assert len(table(req)) == 2
    req.num_computed_tokens = 6
    assert kv.allocate_slots(req, 10)
    assert len(table(req)) == 4
    assert kv.num_free_blocks == 60


def test_zero_new_tokens_or_already_covered_is_a_no_op():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    req = make_request("a", prompt_len=3)
    assert kv.allocate_slots(req, 0)
    assert table(req) == []
    assert kv.allocate_slots(req, 3)
    assert kv.allocate_slots(req, 4)  # still within the first block
    assert table(req) == [0]
    assert kv.num_free_blocks == 3


def test_allocate_slots_returns_false_and_changes_nothing_when_short():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a, b = make_request("a", 8), make_request("b", 9)
    assert kv.allocate_slots(a, 8)
    assert table(a) == [0, 1]
    refs = ref_counts(kv)
    assert not kv.allocate_slots(b, 9)  # needs 3, 1 free
    assert table(b) == []
    assert table(a) == [0, 1]
    assert kv.num_free_blocks == 1
    assert ref_counts(kv) == refs
    # A request already holding blocks that needs more than are free: also all-or-nothing.
    assert kv.allocate_slots(b, 4)
    assert table(b) == [2]
    b.num_computed_tokens = 4
    assert not kv.allocate_slots(b, 5)
    assert table(b) == [2]
    assert kv.num_free_blocks == 0
    assert ref_counts(kv) == [1, 1, 1]


def test_free_returns_every_block():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a, b = make_request("a", 10), make_request("b", 7)
    assert kv.allocate_slots(a, 10)
    assert kv.allocate_slots(b, 7)
    assert kv.num_free_blocks == 3
    assert kv.usage() == pytest.approx(5 / 8)
    kv.free(a)
    assert table(a) == []
    assert kv.num_free_blocks == 6
    assert [c for c in ref_counts(kv) if c] == [1, 1]
    kv.free(b)
    assert kv.num_free_blocks == 8
    assert ref_counts(kv) == [0] * 8
    assert kv.usage() == 0.0
    kv.free(b)  # an empty table frees nothing (no double free)
    assert kv.num_free_blocks == 8


def test_free_releases_tail_blocks_first():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    req = make_request("a", 12)
    assert kv.allocate_slots(req, 12)
    assert table(req) == [0, 1, 2]
    kv.free(req)
    assert list(kv.block_pool._free) == [2, 1, 0]


def test_freed_blocks_are_reused():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    a, b = make_request("a", 8), make_request("b", 8)
    assert kv.allocate_slots(a, 8)
    assert not kv.allocate_slots(b, 8)
    kv.free(a)
    assert kv.allocate_slots(b, 8)
    assert sorted(table(b)) == [0, 1]
    assert kv.num_free_blocks == 0


def test_short_admission_with_cache_hits_changes_nothing():
    kv = KVCacheManager(num_blocks=5, block_size=4, enable_prefix_caching=True)
    a = make_request("a", 8)
    assert kv.allocate_slots(a, 8, [])
    a.num_computed_tokens = 8
    kv.cache_full_blocks(a)
    kv.free(a)  # both full blocks stay cached on the free list
    b = make_request("b", 20)  # same first 8 tokens
    hits = kv.get_computed_blocks(b)
    assert hits[0] == [0, 1]
    filler = make_request("c", 8)
    assert kv.allocate_slots(filler, 4)  # takes a never-used block first
    assert table(filler) == [2]
    refs, free, queries = ref_counts(kv), list(kv.block_pool._free), kv.prefix_cache_queries
    # b needs its 2 hit blocks (both on the free list) + 3 new blocks = 5 > 4 free.
    assert not kv.allocate_slots(b, 12, hits)
    assert table(b) == []
    assert ref_counts(kv) == refs and list(kv.block_pool._free) == free
    assert kv.prefix_cache_queries == queries
    kv.free(filler)
    assert kv.allocate_slots(b, 12, hits)
    assert table(b)[:2] == hits[0] and len(table(b)) == 5
    assert kv.num_free_blocks == 0


# ---------------------------------------------------------------------------- prefix caching
def computed(kv: KVCacheManager, req: Request, n: int) -> None:
    """Pretend the model computed the next n tokens of req and publish its full blocks."""
    assert kv.allocate_slots(req, n, [] if not table(req) else None)
    req.num_computed_tokens += n
    kv.cache_full_blocks(req)


def test_only_full_computed_blocks_are_published_and_hit():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = make_request("a", prompt_len=10)
    computed(kv, a, 6)  # block 0 full, block 1 half
    assert kv.block_pool.num_cached_blocks == 1
    computed(kv, a, 4)  # tokens 0..9: blocks 0, 1 full
    assert kv.block_pool.num_cached_blocks == 2
    b = make_request("b", prompt_len=10)  # same tokens
    hits = kv.get_computed_blocks(b)
    assert hits[0] == table(a)[:2]
    assert kv.allocate_slots(b, 10 - 8, hits)
    assert table(b)[:2] == table(a)[:2] and table(b)[2] != table(a)[2]
    assert [kv.block_pool.blocks[i].ref_cnt for i in table(a)[:2]] == [2, 2]
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (20, 8)  # two admissions of 10 tokens


def test_last_token_is_always_computed_on_a_full_hit():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = make_request("a", prompt_len=8)
    computed(kv, a, 8)
    b = make_request("b", prompt_len=8)
    assert kv.get_computed_blocks(b)[0] == table(a)[:1]  # (8 - 1) // 4 = 1 block, not 2


def test_hash_chain_depends_on_parent_and_extra():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = Request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], SamplingParams(), None)
    computed(kv, a, 9)
    other_parent = Request("b", [9, 9, 9, 9, 5, 6, 7, 8, 9], SamplingParams(), None)
    assert kv.get_computed_blocks(other_parent)[0] == []  # block 1 has equal tokens but a different parent
    other_cache = KVCacheManager(num_blocks=16, block_size=4, hash_extra=b"int8")
    assert other_cache._block_hashes(Request("c", a.all_token_ids, SamplingParams(), None), 2) != a.block_hashes[:2]


def test_freed_blocks_stay_cached_until_evicted_lru():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", prompt_len=9)
    computed(kv, a, 9)
    a_blocks = list(table(a))
    kv.free(a)
    assert kv.num_free_blocks == 4 and kv.block_pool.num_cached_blocks == 2
    b = make_request("b", prompt_len=9)
    assert len(kv.get_computed_blocks(b)[0]) == 2  # still there after the free
    c = Request("c", [50 + i for i in range(9)], SamplingParams(), None)
    computed(kv, c, 9)  # free list (LRU first): never-used 3, then a's blocks tail first: 2, 1, 0
    assert kv.block_pool.num_evictions == 1  # block 1 (block 2 held a partial, unpublished block)
    assert kv.get_computed_blocks(b)[0] == a_blocks[:1]  # the chain breaks at the evicted block


def test_allocation_counts_cached_free_blocks_touched_by_hits():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", prompt_len=9)
    computed(kv, a, 9)
    kv.free(a)  # 4 free blocks, 2 of them cached
    b = make_request("b", prompt_len=13)
    hits = kv.get_computed_blocks(b)
    assert len(hits[0]) == 2
    assert not kv.allocate_slots(b, 13 - 8 + 4, hits)  # 2 hits + 3 new > 4 blocks: nothing changes
    assert kv.num_free_blocks == 4 and table(b) == []
    assert kv.allocate_slots(b, 13 - 8, hits)
    assert kv.num_free_blocks == 0


def test_copy_on_write_of_a_shared_partial_block():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    parent = make_request("p", prompt_len=6)
    computed(kv, parent, 6)
    child = make_request("c", prompt_len=6)
    kv.fork(parent, child)
    child.num_computed_tokens = 6
    assert kv.num_free_blocks == 6
    parent.append_output_token(1)
    assert kv.allocate_slots(parent, 1)  # writes slot 6 of the shared block 1: copy first
    assert kv.take_pending_copies() == [(table(child)[1], table(parent)[1])]
    assert table(parent)[0] == table(child)[0] and table(parent)[1] != table(child)[1]
    child.append_output_token(2)
    assert kv.allocate_slots(child, 1)  # now the only owner: no copy
    assert kv.take_pending_copies() == []
    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks == 8


def test_swap_out_and_in_round_trip():
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=False, num_cpu_blocks=4)
    a = make_request("a", prompt_len=10)
    computed(kv, a, 10)
    device_blocks = list(table(a))
    out_map = kv.swap_out(a)
    assert out_map == list(zip(device_blocks, a.cpu_block_ids))
    assert kv.num_free_blocks == 6 and kv.cpu_pool.num_free_blocks == 1 and table(a) == []
    in_map = kv.swap_in(a, 1)
    assert [c for c, _ in in_map] == [c for _, c in out_map]
    assert len(table(a)) == 3 and a.cpu_block_ids == []
    assert kv.num_free_blocks == 3


def test_swap_out_refuses_when_host_pool_is_full():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False, num_cpu_blocks=2)
    a = make_request("a", prompt_len=10)
    computed(kv, a, 10)
    assert kv.swap_out(a) is None and len(table(a)) == 3 and kv.cpu_pool.num_free_blocks == 2
    assert KVCacheManager(num_blocks=8, block_size=4).swap_out(a) is None  # no swap space at all


# ---------------------------------------------------------------------------- sliding window
from kvflow.core.kv_cache_manager import NULL_BLOCK  # noqa: E402


def test_window_frees_the_blocks_behind_it_as_the_request_advances():
    """Window 8, blocks of 4: before computing position p the leading (p - 7) // 4 blocks
    (every key <= p - 8) are back in the pool, their entries NULL_BLOCK; the request never
    holds more than the window's blocks plus the one being filled. Without the window every
    block is kept."""
    held = {}
    for window in (None, 8):
        kv = KVCacheManager(num_blocks=32, block_size=4, sliding_window=window)
        assert kv.num_total_blocks == (31 if window else 32)  # block 0 reserved as NULL_BLOCK
        req = make_request("a", prompt_len=10)
        computed(kv, req, 10)
        peak = 0
        for _ in range(50):  # decode positions 10..59
            p = req.num_computed_tokens
            assert kv.allocate_slots(req, 1)
            dead = max(0, (p - 7) // 4) if window else 0
            assert table(req)[:dead] == [NULL_BLOCK] * dead
            assert window is None or NULL_BLOCK not in table(req)[dead:]
            assert kv.num_held_blocks(req) == cdiv(p + 1, 4) - dead
            assert kv.num_free_blocks == kv.num_total_blocks - kv.num_held_blocks(req)
            peak = max(peak, kv.num_held_blocks(req))
            req.num_computed_tokens += 1
            kv.cache_full_blocks(req)
        held[window] = (peak, kv.num_window_freed_blocks)
        kv.free(req)
        assert kv.num_free_blocks == kv.num_total_blocks
        assert ref_counts(kv)[0] == (1 if window else 0)  # NULL_BLOCK stays reserved
    assert held == {None: (15, 0), 8: (3, 13)}  # 60 tokens: 15 blocks kept, or at most 3 with 13 freed


def test_window_prefix_hit_needs_only_the_blocks_inside_the_window():
    """The rule: a prefix of n blocks hits when its blocks [dead(n), n) are cached, dead(n) =
    (4n - 7) // 4 for window 8 (those before are not read again, they need not be cached and
    come back as NULL_BLOCK entries). Cached {3, 4, 5, 6} of 7: the full 7-block prefix hits
    with a window (blocks 5, 6 are its window), no block does without one. Cached {0, 1, 2, 6}:
    block 5 is missing from the 7-block prefix's window, and 3 from every longer one than 3."""
    prompt = 30  # (30 - 1) // 4 = 7 blocks may hit
    for cached, want_window, want_full in [({3, 4, 5, 6}, 7, 0), ({0, 1, 2, 6}, 3, 3)]:
        for window, want in ((8, want_window), (None, want_full)):
            kv = KVCacheManager(num_blocks=32, block_size=4, sliding_window=window)
            owner = make_request("owner", prompt_len=prompt)
            hashes = kv._block_hashes(owner, 7)
            ids = kv.block_pool.allocate(7)
            for i in cached:
                kv.block_pool.publish(ids[i], hashes[i])
            kv.block_pool.free(ids)
            b = make_request("b", prompt_len=prompt)
            hits = kv.get_computed_blocks(b)
            dead = max(0, (4 * want - 7) // 4) if window else 0
            assert hits[0] == [NULL_BLOCK] * dead + ids[dead:want], (cached, window)
            assert kv.allocate_slots(b, prompt - 4 * want, hits)
            assert table(b)[:want] == hits[0] and kv.prefix_cache_hits == 4 * want
            assert all(kv.block_pool.blocks[i].ref_cnt == 1 for i in ids[dead:want])
            kv.free(b)
            assert kv.num_free_blocks == kv.num_total_blocks


def test_window_fork_and_swap_keep_the_null_entries():
    """A forked child shares only held blocks; swap-out moves only the window's blocks and
    swap-in puts the NULL_BLOCK entries back at the same logical places."""
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=False, num_cpu_blocks=8, sliding_window=8)
    a = make_request("a", prompt_len=10)
    computed(kv, a, 10)
    for _ in range(14):
        computed(kv, a, 1)  # up to 24 tokens
    assert kv.allocate_slots(a, 1)  # position 24: (24 - 7) // 4 = 4 dead blocks
    assert table(a)[:4] == [NULL_BLOCK] * 4 and len(table(a)) == 7
    child = make_request("c", prompt_len=10)
    kv.fork(a, child)
    assert table(child) == table(a) and [kv.block_pool.blocks[b].ref_cnt for b in table(a)[4:]] == [2, 2, 2]
    kv.free(child)
    held = table(a)[4:]
    mapping = kv.swap_out(a)
    assert [d for d, _ in mapping] == held and len(a.cpu_block_ids) == 3
    assert kv.num_free_blocks == kv.num_total_blocks
    host = list(a.cpu_block_ids)
    back = kv.swap_in(a, 1)
    assert back == list(zip(host, table(a)[4:])) and table(a)[:4] == [NULL_BLOCK] * 4 and len(table(a)) == 7
    assert kv.num_held_blocks(a) == 3 and kv.cpu_pool.num_free_blocks == 8


@pytest.mark.parametrize(("window", "block_size", "chunk"), [(8, 4, 16), (5, 4, 1), (7, 3, 5), (16, 16, 64)])
def test_max_blocks_held_bounds_every_step(window, block_size, chunk):
    """``max_blocks_held`` (the engine's admission check) is the largest count any step of a
    windowed request holds, whatever chunks it is computed in (exact for full chunks)."""
    kv = KVCacheManager(num_blocks=256, block_size=block_size, sliding_window=window)
    total = 150
    worst = 0
    for first in range(1, chunk + 1):  # every chunk alignment
        req = make_request("a", prompt_len=total)
        n = first
        while req.num_computed_tokens < total:
            n = min(n, total - req.num_computed_tokens)
            assert kv.allocate_slots(req, n)
            worst = max(worst, kv.num_held_blocks(req))
            req.num_computed_tokens += n
            n = chunk
        kv.free(req)
    assert worst == kv.max_blocks_held(total, chunk) < kv.num_blocks_for(total)
    assert KVCacheManager(num_blocks=8, block_size=4).max_blocks_held(total, chunk) == cdiv(total, 4)
