"""The C++ prefill (flash-attention) pass over the paged cache against torch SDPA.

Kernel level: float32 against a float64 SDPA reference on random inputs (odd lengths, chunk
offsets, block sizes, GQA ratios, MQA, sliding windows, several requests of different lengths
in one call), bfloat16 within one bfloat16 rounding. Backend level: ``CpuAttentionBackend``
with the kernel against its gather + SDPA path (``KVFLOW_CPU_PREFILL_ATTENTION=0``) on a step
mixing decodes and prefill chunks. Model level: a tiny model's chunked-prefill logits and the
real SmolLM2's prompt logprobs and greedy tokens, kernel against gather + SDPA.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import random_paged_step, requires_smollm2, tiny_model, tiny_model_config
from kvflow.attention import cpu_backend
from kvflow.attention.backend import BatchLayout
from kvflow.attention.cpu_backend import CpuAttentionBackend
from kvflow.config import CacheConfig
from kvflow.attention.cpu_attention import cpu_kernel_available, paged_prefill_attention
from kvflow.attention.cache_engine import CacheEngine

pytestmark = pytest.mark.skipif(not cpu_kernel_available(), reason="the C++ kernel could not be built here")


def _starts(q_lens):
    return torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)


def _tables(tables):
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)


def _reference(q, k_cache, v_cache, tables, q_lens, ctx_lens, scale, window=None):
    """float64 SDPA per request over its gathered context, with the causal (and window) mask."""
    num_heads, head_dim = q.shape[1:]
    block_size, num_kv_heads = k_cache.shape[1:3]
    group = num_heads // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    start = 0
    for table, q_len, ctx in zip(tables, q_lens, ctx_lens):
        k = k_cache[table].reshape(-1, num_kv_heads, head_dim)[:ctx].double().repeat_interleave(group, 1)
        v = v_cache[table].reshape(-1, num_kv_heads, head_dim)[:ctx].double().repeat_interleave(group, 1)
        pos = torch.arange(ctx - q_len, ctx).view(-1, 1)
        key = torch.arange(ctx).view(1, -1)
        mask = key <= pos
        if window:
            mask &= key > pos - window
        qq = q[start : start + q_len].double().transpose(0, 1)
        o = F.scaled_dot_product_attention(qq, k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale)
        out[start : start + q_len] = o.transpose(0, 1)
        start += q_len
    return out


CASES = [
    # num_heads, num_kv_heads, head_dim, block_size, q_lens, ctx_lens, window
    (9, 3, 64, 16, [37], [37], None),  # SmolLM2, one odd-length prompt
    (9, 3, 64, 16, [5, 200, 1, 64], [70, 200, 33, 129], None),  # chunks at offsets, a decode-like row, 4 requests
    (14, 2, 64, 32, [100, 33], [300, 33], None),  # Qwen2.5-0.5B's GQA 7:1, a chunk at offset 200
    (8, 8, 32, 4, [17, 3], [17, 90], None),  # MHA, small blocks
    (8, 1, 128, 1, [129], [129], None),  # MQA, head dim 128, one-token blocks
    (6, 2, 48, 8, [3, 9, 40], [50, 9, 41], None),  # head dim 48 (not a power of two)
    (9, 3, 64, 16, [150, 20], [150, 90], 40),  # sliding window shorter than the prompts
    (14, 2, 64, 16, [77], [300], 128),  # window, chunk at offset 223
    (4, 2, 16, 16, [33], [33], 1),  # window 1: each token sees itself
]


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size, q_lens, ctx_lens, window", CASES)
def test_float32_matches_float64_sdpa(num_heads, num_kv_heads, head_dim, block_size, q_lens, ctx_lens, window):
    q, k, v, tables = random_paged_step(num_heads, num_kv_heads, head_dim, block_size, q_lens, ctx_lens, torch.float32)
    scale = head_dim**-0.5
    out = paged_prefill_attention(q, k, v, _tables(tables), _starts(q_lens), torch.tensor(ctx_lens, dtype=torch.int32),
                                  scale, window)
    ref = _reference(q, k, v, tables, q_lens, ctx_lens, scale, window)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[6]])
def test_bfloat16_within_one_rounding(case):
    num_heads, num_kv_heads, head_dim, block_size, q_lens, ctx_lens, window = case
    q, k, v, tables = random_paged_step(num_heads, num_kv_heads, head_dim, block_size, q_lens, ctx_lens, torch.bfloat16)
    scale = head_dim**-0.5
    out = paged_prefill_attention(q, k, v, _tables(tables), _starts(q_lens), torch.tensor(ctx_lens, dtype=torch.int32),
                                  scale, window)
    assert out.dtype == torch.bfloat16
    ref = _reference(q, k, v, tables, q_lens, ctx_lens, scale, window)
    # Sums and softmax in float32 and one rounding to bfloat16 at the end (bfloat16's unit
    # roundoff u = 2^-8 of |ref|); where the CPU has AVX512-BF16 the value product also takes
    # each softmax weight rounded to bfloat16 (FlashAttention-2's P), p_j (1 + d_j) with
    # |d_j| <= u, which moves the output by at most u sum_j p_j |v_j| / l: the attention of |v|.
    # Plus float32's own error.
    ref_abs = _reference(q, k, v.abs(), tables, q_lens, ctx_lens, scale, window)
    bound = 2**-8 * (ref.abs() + ref_abs) + 1e-5
    excess = (out.double() - ref).abs() - bound
    assert excess.max() <= 0, f"{(excess > 0).sum()} outputs beyond the bound, worst by {excess.max():.2e}"


def test_writes_into_out_and_leaves_other_rows():
    q, k, v, tables = random_paged_step(4, 2, 32, 8, [10, 6], [10, 20], torch.float32)
    out = torch.full((20, 4, 32), 7.0)
    got = paged_prefill_attention(q, k, v, _tables(tables), _starts([10, 6]), torch.tensor([10, 20], dtype=torch.int32),
                                  0.2, out=out[2:18])
    assert got.data_ptr() == out[2:18].data_ptr()
    torch.testing.assert_close(out[2:18].double(), _reference(q, k, v, tables, [10, 6], [10, 20], 0.2), atol=1e-5,
                               rtol=1e-5)
    assert (out[:2] == 7).all() and (out[18:] == 7).all()


def test_rejects_bad_metadata():
    q, k, v, tables = random_paged_step(4, 2, 32, 8, [10], [10], torch.float32)
    with pytest.raises(RuntimeError, match="is not a block of the cache"):
        paged_prefill_attention(q, k, v, torch.tensor([[0, 10_000]]), _starts([10]), torch.tensor([10], dtype=torch.int32), 1.0)
    with pytest.raises(RuntimeError, match="does not fit"):
        paged_prefill_attention(q, k, v, _tables(tables), _starts([10]), torch.tensor([9], dtype=torch.int32), 1.0)
    with pytest.raises(RuntimeError, match="share a dtype"):
        paged_prefill_attention(q.double(), k, v, _tables(tables), _starts([10]), torch.tensor([10], dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_prefill_attention(q, k, v, _tables(tables), _starts([10]), torch.tensor([10], dtype=torch.int32), 1.0, -3)


@pytest.fixture
def count_kernel_calls(monkeypatch):
    calls = []
    real = cpu_backend.paged_prefill_attention

    def spy(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_backend, "paged_prefill_attention", spy)
    return calls


@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_backend_matches_gather_sdpa_on_a_mixed_step(monkeypatch, count_kernel_calls, window, dtype, tol):
    """Decodes (two groups) and prefill chunks (one group) in one step, as the runner lays
    them out: the backend's kernel path against its gather + SDPA path."""
    q_lens, ctx_lens = [1, 1, 1, 40, 7, 64], [30, 5, 200, 40, 71, 100]
    q, k, v, tables = random_paged_step(9, 3, 64, 16, q_lens, ctx_lens, dtype)
    backend = CpuAttentionBackend()
    metadata = backend.build_metadata(BatchLayout(torch.zeros(len(q), dtype=torch.int64), q_lens, ctx_lens, tables,
                                                  [2, 1, 3], 16, torch.device("cpu")))
    monkeypatch.setenv("KVFLOW_CPU_PREFILL_ATTENTION", "0")
    old = backend.attend(q, (k, v), metadata, 0.125, window)
    assert count_kernel_calls == []
    monkeypatch.setenv("KVFLOW_CPU_PREFILL_ATTENTION", "1")
    new = backend.attend(q, (k, v), metadata, 0.125, window)
    assert count_kernel_calls == [111]  # the prefill group's rows, once
    torch.testing.assert_close(new.float(), old.float(), atol=tol, rtol=tol)
    ref = _reference(q, k, v, tables, q_lens, ctx_lens, 0.125, window)
    torch.testing.assert_close(new.double(), ref, atol=tol, rtol=tol)


def _chunked_logits(model, token_ids, chunk, block_size=4):
    """Logits at every position, prefilled in chunks through the CPU backend's paged cache
    (a scrambled block table)."""
    n = len(token_ids)
    num_blocks = -(-n // block_size) + 1
    cache = CacheEngine(model.kv_cache_spec, CacheConfig(block_size, num_blocks, torch.float32), torch.device("cpu"))
    table = [num_blocks - 1 - i for i in range(-(-n // block_size))]
    backend, logits = CpuAttentionBackend(), []
    with torch.inference_mode():
        for start in range(0, n, chunk):
            end = min(n, start + chunk)
            pos = torch.arange(start, end)
            slots = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
            metadata = backend.build_metadata(BatchLayout(slots, [end - start], [end], [table[: -(-end // block_size)]],
                                                          [1], block_size, torch.device("cpu")))
            logits.append(model.compute_logits(model(torch.tensor(token_ids[start:end]), pos, cache.kv_caches, metadata)))
    return torch.cat(logits)


@pytest.mark.parametrize("chunk", [7, 64])
def test_tiny_model_chunked_prefill_logits_match_gather_sdpa(monkeypatch, count_kernel_calls, chunk):
    model = tiny_model(tiny_model_config())
    tokens = torch.randint(0, 128, (61,), generator=torch.Generator().manual_seed(1)).tolist()
    monkeypatch.setenv("KVFLOW_CPU_PREFILL_ATTENTION", "0")
    old = _chunked_logits(model, tokens, chunk)
    monkeypatch.setenv("KVFLOW_CPU_PREFILL_ATTENTION", "1")
    new = _chunked_logits(model, tokens, chunk)
    assert len(count_kernel_calls) == 2 * -(-61 // chunk)  # two layers, every chunk of more than one token
    torch.testing.assert_close(new, old, atol=1e-5, rtol=1e-5)


@requires_smollm2
def test_smollm2_prompt_logprobs_and_greedy_tokens_match_gather_sdpa(monkeypatch, count_kernel_calls, smollm2_llm):
    """The real model in float32: a 300-token prompt's logprobs and 8 greedy tokens, kernel
    against gather + SDPA (the prefix cache reset between the two, so both prefill it all)."""
    from benchmarks.common import tokenize_corpus
    from kvflow import SamplingParams

    prompt = next(iter(tokenize_corpus(smollm2_llm.get_tokenizer()).values()))[1000:1300]
    params = SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=0, ignore_eos=True)
    runs = {}
    for on in ("0", "1"):
        monkeypatch.setenv("KVFLOW_CPU_PREFILL_ATTENTION", on)
        smollm2_llm.reset_prefix_cache()
        (out,) = smollm2_llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        logprobs = [entry[tok].logprob for entry, tok in zip(out.prompt_logprobs[1:], prompt[1:])]
        runs[on] = (out.outputs[0].token_ids, torch.tensor(logprobs, dtype=torch.float64))
    assert count_kernel_calls, "the prefill kernel never ran"
    assert runs["1"][0] == runs["0"][0]
    torch.testing.assert_close(runs["1"][1], runs["0"][1], atol=1e-4, rtol=0)
