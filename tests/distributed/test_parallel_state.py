"""How dimensions split over tensor-parallel ranks, and the layers' weight loaders that take
each rank's slice (no processes needed)."""

from __future__ import annotations

import pytest
import torch

from kvflow.distributed.parallel_state import TensorParallel, even_partition, head_partition
from kvflow.layers.embed_head import VocabParallelEmbedding
from kvflow.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear


@pytest.mark.parametrize(
    ("heads", "kv_heads", "world", "expected_q", "expected_kv"),
    [
        (4, 2, 2, [(0, 2), (2, 4)], [(0, 1), (1, 2)]),
        (9, 3, 2, [(0, 6), (6, 9)], [(0, 2), (2, 3)]),  # SmolLM2: uneven, whole GQA groups
        (8, 1, 2, [(0, 4), (4, 8)], [(0, 1), (0, 1)]),  # MQA: the KV head is replicated
        (8, 2, 4, [(0, 2), (2, 4), (4, 6), (6, 8)], [(0, 1), (0, 1), (1, 2), (1, 2)]),
    ],
)
def test_heads_split_by_kv_groups(heads, kv_heads, world, expected_q, expected_kv):
    parts = [head_partition(heads, kv_heads, world, r) for r in range(world)]
    assert [q for q, _ in parts] == expected_q
    assert [kv for _, kv in parts] == expected_kv
    group = heads // kv_heads
    for q, kv in parts:  # every query head's KV head is on the same rank
        assert all(kv[0] <= h // group < kv[1] for h in range(*q))


def test_impossible_splits_raise():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        head_partition(4, 1, 3, 0)
    with pytest.raises(ValueError, match="intermediate_size.*tensor_parallel_size"):
        even_partition(130, 4, 0, what="intermediate_size")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        MergedColumnParallelLinear(64, [130, 130], bias=False, tp=TensorParallel(0, 4))


def _load(layer, name, tensor, shard_id=None):
    param = getattr(layer, name)
    layer.weight_loader(param, tensor, shard_id)
    return param.detach().clone()


def test_weight_loaders_take_slices_that_reassemble_the_full_tensors():
    hidden, hd, heads, kv_heads, inter, vocab = 64, 16, 4, 2, 128, 131  # 131: the last rank's rows are padded
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n * hd, hidden, generator=g) for n in (heads, kv_heads, kv_heads))
    gate, up = torch.randn(inter, hidden, generator=g), torch.randn(inter, hidden, generator=g)
    o, emb = torch.randn(hidden, heads * hd, generator=g), torch.randn(vocab, hidden, generator=g)
    o_bias = torch.randn(hidden, generator=g)
    qkv_parts, gu_parts, o_parts, ob_parts, e_parts = [], [], [], [], []
    for rank in range(2):
        tp = TensorParallel(rank, 2)
        qkv = QKVParallelLinear(hidden, hd, heads, kv_heads, bias=False, tp=tp)
        for sid, t in zip("qkv", (q, k, v)):
            _load(qkv, "weight", t, sid)
        qkv_parts.append(qkv.weight.detach().split([qkv.q_size, qkv.kv_size, qkv.kv_size]))
        gu = MergedColumnParallelLinear(hidden, [inter, inter], bias=False, tp=tp)
        _load(gu, "weight", gate, 0)
        gu_parts.append(_load(gu, "weight", up, 1).split(inter // 2))
        row = RowParallelLinear(heads * hd, hidden, bias=True, tp=tp, input_range=qkv.q_range)
        o_parts.append(_load(row, "weight", o))
        ob_parts.append(_load(row, "bias", o_bias))
        e_parts.append(_load(VocabParallelEmbedding(vocab, hidden, tp), "weight", emb))
    assert torch.equal(torch.cat([p[0] for p in qkv_parts]), q)
    assert torch.equal(torch.cat([p[1] for p in qkv_parts]), k) and torch.equal(torch.cat([p[2] for p in qkv_parts]), v)
    assert torch.equal(torch.cat([p[0] for p in gu_parts]), gate) and torch.equal(torch.cat([p[1] for p in gu_parts]), up)
    assert torch.equal(torch.cat(o_parts, dim=1), o)
    assert torch.equal(ob_parts[0], o_bias) and not ob_parts[1].any()  # added once, by rank 0's partial sum
    assert torch.equal(torch.cat(e_parts)[:vocab], emb) and e_parts[1].shape[0] == 66 and not e_parts[1][-1].any()
