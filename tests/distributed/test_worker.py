"""Tensor parallelism with real processes (gloo, 2 ranks on this CPU)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from types import SimpleNamespace

import pytest
import torch
import transformers
from safetensors.torch import save_file

from conftest import requires_smollm2, tiny_model, tiny_model_config
from kvflow import LLM, SamplingParams
from model.test_llama import to_hf_state_dict

PROMPTS = [[5, 17, 99, 3, 42, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [77, 66, 55]]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny Llama checkpoint folder (config.json + safetensors), 4 query / 2 KV heads."""
    cfg = tiny_model_config(vocab_size=131)
    model = tiny_model(cfg)
    path = tmp_path_factory.mktemp("tiny")
    hf = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=False,
    )
    hf.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in to_hf_state_dict(model).items()}, str(path / "model.safetensors"))
    return path


def _run(model: str, tp: int, logprobs: int | None = None, **kwargs):
    """Greedy tokens and prompt log-probs of PROMPTS (plus the output tokens' log-probs,
    top ``logprobs``, when asked)."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=5, logprobs=logprobs)
    with LLM(model=model, dtype="float32", tensor_parallel_size=tp, num_threads=1, num_kv_blocks=64, **kwargs) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        stats = llm.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    result = [o.outputs[0].token_ids for o in outs], [o.prompt_logprobs[1:] for o in outs]  # (entry 0 is None)
    return result if logprobs is None else (*result, [o.outputs[0].logprobs for o in outs])


def _assert_logprobs_close(a, b, tol, same_top_k=True):
    for pa, pb in zip(a, b):
        for ea, eb in zip(pa, pb):
            if same_top_k:
                assert ea.keys() == eb.keys()
            common = ea.keys() & eb.keys()  # always holds the actual next prompt token
            assert common
            for k in common:
                assert abs(ea[k] - eb[k]) <= tol


def _max_logprob_diff(a, b) -> float:
    """Largest |difference| over the tokens both prompt-logprob entries hold."""
    return max(abs(ea[k] - eb[k]) for pa, pb in zip(a, b) for ea, eb in zip(pa, pb) for k in ea.keys() & eb.keys())


def _no_children() -> bool:
    deadline = time.time() + 10
    while multiprocessing.active_children() and time.time() < deadline:
        time.sleep(0.2)
    return not multiprocessing.active_children()


def test_tp2_embeddings_equal_tp1(tiny_dir):
    """Embedding requests under tensor parallelism: the workers leave them out of the
    logits rows as the driver does (a worker's LM-head all-gather would otherwise wait for
    a driver that never joins), and the vectors equal one process's."""
    from kvflow.pooling_params import PoolingParams

    def run(tp):
        with LLM(model=str(tiny_dir), dtype="float32", tensor_parallel_size=tp, num_threads=1, num_kv_blocks=64,
                 max_num_batched_tokens=8) as llm:
            prompts = [{"prompt_token_ids": p} for p in PROMPTS]
            vectors = [[o.outputs.embedding for o in llm.embed(prompts, PoolingParams(pooling_type=p), use_tqdm=False)]
                       for p in ("last", "mean")]
            tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4))]
        return torch.tensor(vectors), tokens

    (v1, t1), (v2, t2) = run(1), run(2)
    assert t2 == t1
    torch.testing.assert_close(v2, v1, atol=1e-5, rtol=0)
    assert _no_children()


def test_tp2_equals_tp1_on_a_tiny_model(tiny_dir):
    tokens1, logprobs1 = _run(str(tiny_dir), 1)
    tokens2, logprobs2 = _run(str(tiny_dir), 2)
    assert tokens2 == tokens1
    _assert_logprobs_close(logprobs2, logprobs1, 1e-4)
    assert _no_children()


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_tp2_workers_follow_the_diff_through_preemption_forks_and_chunks(tiny_dir, preemption_mode):
    """The workers keep their per-request state from the broadcast diffs only: a KV pool
    too small for the batch (preemptions, by recompute or swap), chunked prefill, parallel
    samples sharing blocks (fork, copy-on-write) and a prefix-cache hit give the same tokens
    on two ranks as on one."""
    prompts = [*PROMPTS, PROMPTS[1][:8] + [21, 22, 23, 24, 25]]  # the last one hits the cache
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, n=2)

    def run(tp: int):
        with LLM(model=str(tiny_dir), dtype="float32", tensor_parallel_size=tp, num_threads=1, block_size=4,
                 num_kv_blocks=14, max_num_batched_tokens=8, preemption_mode=preemption_mode,
                 swap_space_bytes=1 << 20) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            stats = llm.get_stats()
        assert stats["num_preemptions"] > 0 and stats["num_free_blocks"] == stats["num_total_blocks"]
        assert (stats["num_swapped_out"] > 0) == (preemption_mode == "swap")
        return [[c.token_ids for c in o.outputs] for o in outs]

    assert run(2) == run(1)
    assert _no_children()


def test_tp2_int8_linears_shard_correctly(tiny_dir):
    # Column-parallel layers quantize per output channel, so rank 0's INT8 rows are exactly
    # the matching rows of the unsharded INT8 weight.
    with LLM(model=str(tiny_dir), dtype="float32", num_threads=1, num_kv_blocks=64, quantization="int8") as one:
        full = one.engine.model_runner.model.layers[0].self_attn.qkv_proj
        with LLM(model=str(tiny_dir), dtype="float32", tensor_parallel_size=2, num_threads=1, num_kv_blocks=64,
                 quantization="int8") as two:
            shard = two.engine.model_runner.model.layers[0].self_attn.qkv_proj
            hd, cfg = 16, one.engine.model_config
            q_rows, kv_rows = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
            expected = torch.cat([
                full.weight[: q_rows // 2],  # rank 0: query heads 0-1
                full.weight[q_rows : q_rows + kv_rows // 2],  # its K head
                full.weight[q_rows + kv_rows : q_rows + kv_rows + kv_rows // 2],  # its V head
            ])
            assert torch.equal(shard.weight, expected)
    tokens1, logprobs1, sampled1 = _run(str(tiny_dir), 1, quantization="int8", logprobs=2)
    tokens2, logprobs2, _ = _run(str(tiny_dir), 2, quantization="int8", logprobs=2)
    _, logprobs_float = _run(str(tiny_dir), 1)
    # Row-parallel shards (o_proj, down_proj) get their own per-channel scales, so TP=2 is a
    # different INT8 model: each is within INT8 error of float32, hence within twice the
    # unsharded model's error of each other (a shard with wrong scales would not be).
    int8_error = _max_logprob_diff(logprobs1, logprobs_float)
    assert 0 < int8_error < 0.5
    _assert_logprobs_close(logprobs2, logprobs1, 2 * int8_error, same_top_k=False)  # near-ties may reorder the top 5
    # Greedy outputs may part only where the unsharded model's top two tokens are that close.
    for x, y, entries in zip(tokens1, tokens2, sampled1):
        first = next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
        if first is not None:
            top2 = sorted(entries[first].values(), reverse=True)[:2]
            assert top2[0] - top2[1] <= 2 * int8_error, (first, top2)
    assert _no_children()


def test_tp2_equals_tp1_on_a_tiny_moe_model(tmp_path):
    """Qwen3-MoE (q/k-norm attention, a dense layer between two MoE layers) sharded over two
    processes: every rank holds all experts' halves of the intermediate features; tokens
    and prompt log-probs equal the unsharded model's. (Mixtral's MoE block is the same
    layer: tests/layers/test_moe.py checks its shards' sum.)"""
    from model.hf_parity import save_random_hf

    config = transformers.Qwen3MoeConfig(
        vocab_size=131, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=256, num_experts_per_tok=2, intermediate_size=96, moe_intermediate_size=32,
        num_experts=8, num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True)
    save_random_hf(transformers.Qwen3MoeForCausalLM, config, tmp_path)
    tokens1, logprobs1 = _run(str(tmp_path), 1)
    tokens2, logprobs2 = _run(str(tmp_path), 2)
    assert tokens2 == tokens1
    _assert_logprobs_close(logprobs2, logprobs1, 1e-4)
    assert _no_children()


@requires_smollm2
@pytest.mark.integration
def test_tp2_equals_tp1_on_the_real_model(smollm2_dir):
    tokens1, logprobs1 = _run(str(smollm2_dir), 1)
    tokens2, logprobs2 = _run(str(smollm2_dir), 2)
    assert tokens2 == tokens1
    _assert_logprobs_close(logprobs2, logprobs1, 1e-3)
    assert _no_children()


def test_dead_worker_fails_loudly_and_cleans_up(tiny_dir):
    llm = LLM(model=str(tiny_dir), dtype="float32", tensor_parallel_size=2, num_threads=1, num_kv_blocks=64)
    (worker,) = llm.engine.tp_workers.procs
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(timeout=10)
    start = time.time()
    with pytest.raises(RuntimeError, match="worker rank 1 died"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=4), use_tqdm=False)
    assert time.time() - start < 30
    llm.shutdown()
    assert _no_children()
    assert not torch.distributed.is_initialized()


def test_rendezvous_timeout_is_configurable_and_says_what_to_do(monkeypatch, tiny_dir):
    """A rank that never comes (here: torchrun-style, rank 1 never started) fails the
    driver after collective_timeout_s, with what to do, instead of a bare store error after
    a fixed 120 s (which a loaded machine missed while the other ranks loaded); and the
    process can start a tensor-parallel engine afterwards (the failed start-up left torch's
    group naming where its fresh peers expect it)."""
    from kvflow.config import DeviceConfig, ParallelConfig
    from kvflow.distributed.worker import TPWorkers, free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="collective_timeout_s / --collective-timeout-s / KVFLOW_COLLECTIVE_TIMEOUT_S"):
        config = SimpleNamespace(parallel=ParallelConfig(2, collective_timeout_s=1.0),
                                 device=DeviceConfig(torch.device("cpu"), torch.float32))  # the parts TPWorkers reads
        TPWorkers(config, spawn=False)
    assert time.monotonic() - start < 60  # the 1 s limit was used (a generous bound: a shared machine)
    monkeypatch.delenv("MASTER_ADDR")
    monkeypatch.delenv("MASTER_PORT")
    llm = LLM(model=str(tiny_dir), dtype="float32", tensor_parallel_size=2, num_threads=1, num_kv_blocks=64,
              collective_timeout_s=120)
    try:
        (out,) = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=4), use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 4
    finally:
        llm.shutdown()
    assert _no_children()
