"""The PyTorch attention backend (``kvflow/attention/torch_backend.py``): grouping decodes by context
length, and attention over several groups equal to one group."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from conftest import attend, store_kv
from kvflow.attention.torch_backend import AttentionGroup, GroupedMetadata, split_by_context
from kvflow.attention.cpu_attention import cpu_kernel_available

CPU_BACKEND = pytest.param(  # the kernels may be off (KVFLOW_CPU_KERNELS=0) or unbuildable here
    "cpu", marks=pytest.mark.skipif(not cpu_kernel_available(), reason="the C++ kernel is off or could not be built"))


def _cost(groups: list[list[int]], blocks: list[int], block_size: int, overhead: int) -> int:
    return sum(len(g) * max(blocks[i] for i in g) * block_size + overhead for g in groups)


def _brute_force_best(blocks: list[int], block_size: int, overhead: int) -> int:
    """Cheapest partition of the sorted list into contiguous runs (every cut subset)."""
    order = sorted(range(len(blocks)), key=blocks.__getitem__)
    best = None
    for mask in range(2 ** (len(order) - 1)):
        groups, current = [], [order[0]]
        for pos, idx in enumerate(order[1:]):
            if mask >> pos & 1:
                groups.append(current)
                current = []
            current.append(idx)
        groups.append(current)
        cost = _cost(groups, blocks, block_size, overhead)
        best = cost if best is None else min(best, cost)
    return best


@pytest.mark.parametrize("seed", range(30))
def test_split_is_a_partition_and_optimal(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    blocks = [rng.randint(1, 60) for _ in range(n)]
    overhead = rng.choice([0, 16, 512, 5000])
    groups = split_by_context(blocks, 16, overhead)
    assert sorted(itertools.chain.from_iterable(groups)) == list(range(n))
    assert all(groups), "no empty group"
    assert _cost(groups, blocks, 16, overhead) == _brute_force_best(blocks, 16, overhead)


def test_split_extremes():
    assert split_by_context([], 16) == []
    # Zero overhead: no padding at all (each group holds one context length).
    blocks = [3, 1, 3, 2]
    groups = split_by_context(blocks, 16, overhead_tokens=0)
    assert _cost(groups, blocks, 16, 0) == sum(blocks) * 16
    assert all(len({blocks[i] for i in g}) == 1 for g in groups)
    # A huge overhead: one group.
    assert len(split_by_context([1, 50, 7, 30], 16, overhead_tokens=10**9)) == 1
    # Two clusters far apart and a moderate overhead: two groups.
    groups = split_by_context([2, 2, 2, 2, 100, 100, 100, 100], 16, overhead_tokens=512)
    assert [sorted(g) for g in groups] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_attention_over_several_groups_equals_one_group():
    """The same decode tokens attended as one padded group and as one group per request."""
    torch.manual_seed(0)
    bs, kv_heads, heads, d = 4, 2, 4, 8
    num_blocks = 16
    k_cache = torch.randn(num_blocks, bs, kv_heads, d)
    v_cache = torch.randn(num_blocks, bs, kv_heads, d)
    tables = [[0, 1, 2], [3], [4, 5, 6, 7, 8]]
    ctx = [10, 3, 17]
    q = torch.randn(len(ctx), heads, d)
    one = GroupedMetadata(torch.zeros(3, dtype=torch.int64),
                            [AttentionGroup.build(0, [1, 1, 1], ctx, tables, bs, torch.device("cpu"))])
    several = GroupedMetadata(torch.zeros(3, dtype=torch.int64), [
        AttentionGroup.build(i, [1], [ctx[i]], [tables[i]], bs, torch.device("cpu")) for i in range(3)
    ])
    out_one = attend(q, (k_cache, v_cache), one, d**-0.5)
    out_several = attend(q, (k_cache, v_cache), several, d**-0.5)
    torch.testing.assert_close(out_one, out_several, rtol=1e-5, atol=1e-6)
    # And against the explicit computation for request 2 (GQA: head h reads KV head h // 2).
    keys = k_cache[tables[2]].reshape(-1, kv_heads, d)[: ctx[2]]
    values = v_cache[tables[2]].reshape(-1, kv_heads, d)[: ctx[2]]
    for h in range(heads):
        w = torch.softmax(keys[:, h // 2] @ q[2, h] * d**-0.5, dim=0)
        torch.testing.assert_close(out_several[2, h], w @ values[:, h // 2], rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ key offset (quantized caches)


def _int8_cache(num_blocks, bs, kv_heads, d):
    return (torch.zeros(num_blocks, bs, kv_heads, d, dtype=torch.int8),
            torch.zeros(num_blocks, bs, kv_heads, d, dtype=torch.int8),
            torch.zeros(num_blocks, bs, kv_heads, dtype=torch.float16),
            torch.zeros(num_blocks, bs, kv_heads, dtype=torch.float16))


def test_key_offset_keeps_attention_and_saves_int8_precision():
    """Keys = a large common vector (norm ~280, as Qwen2's k_proj bias makes them) + a small
    token-dependent part. Stored minus that vector (``key_offset``), an int8 cache gives
    attention close to the float one; stored as they are, the common vector sets every
    token's scale and the token-dependent part is lost in the rounding."""
    from kvflow.attention.kv_cache import write_kv_cache

    g = torch.Generator().manual_seed(0)
    bs, kv_heads, heads, d, ctx = 16, 2, 6, 64, [40, 75]
    offset = torch.randn(kv_heads, d, generator=g) * 35.0
    k = offset + torch.randn(sum(ctx), kv_heads, d, generator=g)
    v = torch.randn(sum(ctx), kv_heads, d, generator=g)
    q = torch.randn(len(ctx), heads, d, generator=g)
    tables = [[0, 1, 2], [3, 4, 5, 6, 7]]
    slots = torch.cat([torch.tensor(t).repeat_interleave(bs)[:n] * bs + torch.arange(n) % bs for t, n in zip(tables, ctx)])
    decode = GroupedMetadata(torch.zeros(2, dtype=torch.int64), [AttentionGroup.build(0, [1, 1], ctx, tables, bs, torch.device("cpu"))])

    float_cache = (torch.zeros(8, bs, kv_heads, d), torch.zeros(8, bs, kv_heads, d))
    store_kv(k, v, float_cache, slots, key_offset=offset)  # ignored: float cache
    written = float_cache[0].view(-1, kv_heads, d)[slots]
    assert torch.equal(written, k)
    want = attend(q, float_cache, decode, d**-0.5)

    def through_int8(key_offset):
        cache = _int8_cache(8, bs, kv_heads, d)
        store_kv(k, v, cache, slots, key_offset=key_offset)
        return attend(q, cache, decode, d**-0.5)

    err_offset = float((through_int8(offset) - want).abs().max())
    err_plain = float((through_int8(None) - want).abs().max())
    assert err_offset < 0.02
    assert err_offset < 0.1 * err_plain
    # The shift is exact in float arithmetic: the same keys minus the offset, unquantized.
    shifted = (torch.zeros(8, bs, kv_heads, d), torch.zeros(8, bs, kv_heads, d))
    write_kv_cache(k - offset, v, shifted, slots)
    torch.testing.assert_close(attend(q, shifted, decode, d**-0.5), want, rtol=1e-4, atol=1e-5)


def _reference_window_attention(q, k, v, positions, window, scale):
    """Dense attention of one request: q [Tq, H, D] at ``positions``, over k/v [S, KV, D] of
    positions 0..S-1; key j visible from query i when i - window < j <= i."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) * scale
    j = torch.arange(k.shape[0])
    visible = (j.view(1, -1) <= positions.view(-1, 1)) & (j.view(1, -1) > positions.view(-1, 1) - window)
    scores = scores.masked_fill(~visible.unsqueeze(0), float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v)


@pytest.mark.parametrize("backend_name", ["torch", CPU_BACKEND])
def test_sliding_window_attention_matches_dense_reference(backend_name):
    """Two requests in one step, a decode (context 23) and a prefill chunk (positions 9..17 of
    a context of 18), window 5, over scrambled block tables: every query sees exactly the
    keys i - 5 < j <= i (the torch path's mask; the CPU backend routes windowed layers past
    its C++ decode kernel, which has no window)."""
    from kvflow.attention.cpu_backend import CpuAttentionBackend
    from kvflow.attention.backend import BatchLayout
    from kvflow.attention.torch_backend import TORCH_BACKEND

    backend = TORCH_BACKEND if backend_name == "torch" else CpuAttentionBackend()
    torch.manual_seed(0)
    bs, h, kv, d, window = 4, 4, 2, 16, 5
    k_cache, v_cache = torch.randn(16, bs, kv, d), torch.randn(16, bs, kv, d)
    tables = [[7, 2, 9, 0, 11, 4], [3, 14, 5, 8, 1]]
    ctx, q_lens = [23, 18], [1, 9]
    q = torch.randn(sum(q_lens), h, d)
    slots = torch.zeros(sum(q_lens), dtype=torch.int64)  # nothing written (k is None below)
    groups = [[0], [1]]  # the decode, then the prefill chunk
    layout = BatchLayout(slots, q_lens, ctx, tables, [len(g) for g in groups], bs, torch.device("cpu"))
    metadata = backend.build_metadata(layout)
    out = backend.forward(q, None, None, (k_cache, v_cache), metadata, d**-0.5, sliding_window=window)
    start = 0
    for table, c, n in zip(tables, ctx, q_lens):
        idx = torch.tensor(table).repeat_interleave(bs) * bs + torch.arange(len(table) * bs) % bs
        k = k_cache.view(-1, kv, d)[idx[:c]]
        v = v_cache.view(-1, kv, d)[idx[:c]]
        want = _reference_window_attention(q[start : start + n], k, v, torch.arange(c - n, c), window, d**-0.5)
        torch.testing.assert_close(out[start : start + n], want, atol=1e-5, rtol=1e-5)
        start += n
    full = backend.forward(q, None, None, (k_cache, v_cache), metadata, d**-0.5)
    assert (full - out).abs().max() > 1e-2  # the window acts


def test_backend_without_window_refuses_one():
    from kvflow.attention.cpu_backend import CpuQuantizedAttentionBackend

    with pytest.raises(ValueError, match="sliding-window"):
        CpuQuantizedAttentionBackend().forward(torch.zeros(1, 1, 4), None, None, (), None, 1.0, sliding_window=4)
