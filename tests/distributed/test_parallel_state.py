"""Sharding plan and weight slicing for tensor parallelism (no processes needed)."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model_config
from kvflow.distributed.parallel_state import make_shard_plan, shard_hf_weight


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
    cfg = tiny_model_config(num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=8, hidden_size=64)
    plans = [make_shard_plan(cfg, world, r) for r in range(world)]
    assert [p.q_heads for p in plans] == expected_q
    assert [p.kv_heads for p in plans] == expected_kv
    group = heads // kv_heads
    for p in plans:  # every query head's KV head is on the same rank
        assert all(p.kv_heads[0] <= q // group < p.kv_heads[1] for q in range(*p.q_heads))


def test_impossible_splits_raise():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        make_shard_plan(tiny_model_config(num_attention_heads=4, num_key_value_heads=1, head_dim=16), 3, 0)
    with pytest.raises(ValueError, match="intermediate_size"):
        make_shard_plan(tiny_model_config(intermediate_size=130), 4, 0)


def test_weight_slices_reassemble_the_full_tensors():
    cfg = tiny_model_config(vocab_size=131)  # not divisible by 2: the last rank's rows are padded
    plans = [make_shard_plan(cfg, 2, r) for r in range(2)]
    hd = cfg.head_dim
    q = torch.randn(cfg.num_attention_heads * hd, cfg.hidden_size)
    o = torch.randn(cfg.hidden_size, cfg.num_attention_heads * hd)
    emb = torch.randn(cfg.vocab_size, cfg.hidden_size)
    q_parts = [shard_hf_weight("model.layers.0.self_attn.q_proj.weight", q, cfg, p) for p in plans]
    o_parts = [shard_hf_weight("model.layers.0.self_attn.o_proj.weight", o, cfg, p) for p in plans]
    e_parts = [shard_hf_weight("model.embed_tokens.weight", emb, cfg, p) for p in plans]
    assert torch.equal(torch.cat(q_parts), q) and torch.equal(torch.cat(o_parts, dim=1), o)
    assert torch.equal(torch.cat(e_parts)[: cfg.vocab_size], emb) and e_parts[1].shape[0] == 66
    norm = torch.randn(cfg.hidden_size)
    assert shard_hf_weight("model.layers.0.input_layernorm.weight", norm, cfg, plans[1]) is norm
