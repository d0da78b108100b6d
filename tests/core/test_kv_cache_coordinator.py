"""The KV cache coordinator (``KVCacheManager`` over several groups) and the group layout:
per-group tables over one pool, sliding groups freeing behind the window, the windowed
prefix-cache rule, fork, swap, trim."""

from __future__ import annotations

import pytest

from kvflow.core.kv_cache_groups import build_kv_cache_groups
from kvflow.core.kv_cache_manager import NULL_BLOCK, KVCacheManager
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams

W, BS = 8, 4
# 3 layers: full, local, local -> group_size 1: group 0 full, groups 1 and 2 local (window 8)
GROUPS = build_kv_cache_groups([None, W, W])


def make_request(request_id: str, num_tokens: int) -> Request:
    return Request(request_id, list(range(num_tokens)), SamplingParams(temperature=0, max_tokens=100), None)


def table(req: Request, g: int) -> list[int]:
    return req.block_ids[g]


def hybrid(**kwargs) -> KVCacheManager:
    return KVCacheManager(group_windows=GROUPS.group_windows, **kwargs)


def run(kv: KVCacheManager, req: Request, chunk: int = 1) -> None:
    """Compute the request's tokens ``chunk`` at a time, publishing after each step."""
    while req.num_computed_tokens < req.num_tokens:
        n = min(chunk, req.num_tokens - req.num_computed_tokens)
        assert kv.allocate_slots(req, n)
        req.num_computed_tokens += n
        kv.cache_full_blocks(req)


def test_groups_of_gemma3_shapes():
    """Gemma-3-270M (18 layers, 5 local per global): groups of 3, 1 full + 5 local; a
    Gemma 3 1B shape (26 layers: 22 local, 4 global): groups of 4, 1 full + 6 local with 2
    padding positions; one attention kind: no groups."""
    g270 = build_kv_cache_groups([None if (i + 1) % 6 == 0 else 512 for i in range(18)])
    assert g270.group_size == 3 and g270.group_windows == (None, 512, 512, 512, 512, 512)
    assert [g270.layer_group[i] for i in (5, 11, 17)] == [0, 0, 0]
    assert [g270.layer_position[i] for i in (5, 11, 17)] == [0, 1, 2]
    assert sorted(zip(g270.layer_group, g270.layer_position)) == [(g, p) for g in range(6) for p in range(3)]
    g1b = build_kv_cache_groups([None if (i + 1) % 6 == 0 else 512 for i in range(26)])
    assert g1b.group_size == 4 and g1b.group_windows == (None, *[512] * 6) and g1b.num_padding_positions == 2
    assert build_kv_cache_groups([512] * 4) is None and build_kv_cache_groups([None] * 4) is None


def test_sliding_groups_free_behind_the_window_full_group_keeps_all():
    kv = hybrid(num_blocks=64, block_size=BS, enable_prefix_caching=False)
    req = make_request("a", 40)
    run(kv, req)
    assert NULL_BLOCK not in table(req, 0) and len(table(req, 0)) == 10
    for g in (1, 2):  # the last step (position 39) read keys from 32 on: blocks [0, 8) freed
        assert table(req, g)[:8] == [NULL_BLOCK] * 8 and NULL_BLOCK not in table(req, g)[8:]
    held = kv.num_held_blocks(req)
    assert held == 10 + 2 * 2
    assert kv.num_free_blocks == kv.num_total_blocks - held
    assert kv.num_window_freed_blocks == 2 * 8
    kv.free(req)
    assert kv.num_free_blocks == kv.num_total_blocks


def test_capacity_check_counts_the_pages_of_every_group():
    """16 tokens are 4 logical blocks = 12 pages (3 groups); 9 usable blocks are too few,
    and nothing changes (a one-table check would see 4 blocks and say yes)."""
    kv = hybrid(num_blocks=10, block_size=BS)
    req = make_request("a", 16)
    assert not kv.allocate_slots(req, 16)
    assert req.block_ids == ([], [], []) and kv.num_free_blocks == 9
    assert kv.allocate_slots(req, 12) and kv.num_held_blocks(req) == 9


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_max_blocks_held_bounds_every_step(chunk):
    kv = hybrid(num_blocks=256, block_size=BS, enable_prefix_caching=False)
    req = make_request("a", 61)
    most = 0
    while req.num_computed_tokens < req.num_tokens:
        n = min(chunk, req.num_tokens - req.num_computed_tokens)
        assert kv.allocate_slots(req, n)
        most = max(most, kv.num_held_blocks(req))
        req.num_computed_tokens += n
    assert most <= kv.max_blocks_held(61, chunk) < kv.num_pages_for(61)


def test_prefix_hit_needs_the_full_groups_prefix_and_the_sliding_groups_window():
    kv = hybrid(num_blocks=128, block_size=BS)
    a = make_request("a", 32)
    run(kv, a)
    kv.free(a)  # every block stays cached (freed blocks keep their hashes until evicted)
    b = make_request("b", 33)
    hits = kv.get_computed_blocks(b)
    assert kv.num_hit_tokens(hits) == 32
    dead = (32 - W + 1) // BS  # 6: the sliding groups need blocks 6 and 7 only
    for g in (1, 2):
        assert hits[g][:dead] == [NULL_BLOCK] * dead and NULL_BLOCK not in hits[g][dead:]
    assert NULL_BLOCK not in hits[0]
    # A sliding group's block 6 missing: n = 8 and 7 need it; n = 6 needs blocks 4, 5 (cached).
    pool = kv.block_pool
    pool._forget(pool.blocks[hits[1][6]])
    assert kv.num_hit_tokens(kv.get_computed_blocks(b)) == 24
    # The full group's block 2 missing: nothing past 2 blocks can hit.
    full_2 = kv.get_computed_blocks(b)[0][2]
    pool._forget(pool.blocks[full_2])
    assert kv.num_hit_tokens(kv.get_computed_blocks(b)) == 8
    # The hit is admitted with NULL entries where allowed, and computation continues from it.
    hits = kv.get_computed_blocks(b)
    assert kv.allocate_slots(b, 33 - 8, hits)
    assert kv.prefix_cache_hits == 8 and [len(t) for t in b.block_ids] == [9] * 3


def test_fork_copies_each_groups_shared_partial_block():
    kv = hybrid(num_blocks=64, block_size=BS, enable_prefix_caching=False)
    parent = make_request("p", 6)
    run(kv, parent, chunk=6)
    child = make_request("c", 6)
    child.num_computed_tokens = 6
    kv.fork(parent, child)
    before = kv.num_free_blocks
    parent.append_output_token(1)
    assert kv.allocate_slots(parent, 1)  # writes at position 6: block 1 of each group is shared
    copies = kv.take_pending_copies()
    assert len(copies) == 3 and kv.num_free_blocks == before - 3
    assert [src for src, _ in copies] == [t[1] for t in child.block_ids] and [dst for _, dst in copies] == [t[1] for t in parent.block_ids]
    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks == kv.num_total_blocks


def test_swap_round_trip_restores_the_null_entries():
    kv = hybrid(num_blocks=64, block_size=BS, enable_prefix_caching=False, num_cpu_blocks=32)
    req = make_request("a", 30)
    run(kv, req)
    held = kv.num_held_blocks(req)
    layout = [[b == NULL_BLOCK for b in t] for t in req.block_ids]
    out = kv.swap_out(req)
    assert len(out) == kv.cpu_pool.num_blocks - kv.cpu_pool.num_free_blocks <= held
    assert kv.num_free_blocks == kv.num_total_blocks
    back = kv.swap_in(req, 1)
    assert [h for h, _ in back] == [h for _, h in out]
    assert [[b == NULL_BLOCK for b in t][: len(layout[g])] for g, t in enumerate(req.block_ids)] == [
        [x or (i < (30 - W + 1) // BS and g != 0) for i, x in enumerate(layout[g])] for g in range(3)]
    assert [len(t) for t in req.block_ids] == [8] * 3  # 31 tokens
    kv.free(req)
    assert kv.num_free_blocks == kv.num_total_blocks and kv.cpu_pool.num_free_blocks == 32


def test_trim_drops_every_groups_blocks_past_the_computed_tokens():
    kv = hybrid(num_blocks=64, block_size=BS, enable_prefix_caching=False)
    req = make_request("a", 10)
    run(kv, req, chunk=10)
    assert kv.allocate_slots(req, 5)  # drafts up to position 14: 4 logical blocks
    assert [len(t) for t in req.block_ids] == [4] * 3
    kv.trim(req)  # all drafts rejected: back to 10 tokens = 3 logical blocks
    assert [len(t) for t in req.block_ids] == [3] * 3 and kv.num_free_blocks == kv.num_total_blocks - 9
