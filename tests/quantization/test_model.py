"""Quantized deployment on the real SmolLM2-135M-Instruct (skipped without it).

The model comes from a Q4_1 GGUF file, so its "float32" weights are Q4_1-dequantized values:
``quantization="gguf"`` computes on the Q4_1 blocks as stored (the weights are bit-for-bit the
same grid), while INT8 / INT4 re-quantize an already 4-bit grid.

Greedy agreement with float32. A quantized model perturbs the logits, so where float32's top
two tokens are nearly tied the argmax may flip and free-running greedy text then diverges for
good. Measured on 5 prompts x 16 positions (teacher-forced on float32's continuation), INT8
weights move the log-prob margin between float32's top two tokens by 0.14 nats on average
and 0.71 at most, the INT8 KV cache by 0.06 / 0.34, bfloat16 activations alone (GGUF repack,
exact weights) by 0.04 / 0.15. So the tests assert:

- teacher-forced: wherever float32's top-1 leads its runner-up by more than ``CLEAR_MARGIN``
  = 1 nat, the quantized model picks the same token;
- free-running: the first 8 greedy tokens match float32 for at least 2 of the 3 prompts, and
  any earlier divergence happens at a near-tie (float32 margin below ``CLEAR_MARGIN``).
  Observed: INT8 weights match 16/16, 16/16 and 5/16 tokens (prompt 3 splits at a 0.10-nat
  tie: "wizard" vs "woman"); the INT8 KV cache 16/16 on all three.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from conftest import requires_smollm2
from kvflow import LLM, SamplingParams
from kvflow.core.block_pool import hash_block_tokens
from kvflow.layers.linear import linear_layers
from kvflow.model.loader import quantize_model
from kvflow.quantization.checkpoint import weight_bytes
from kvflow.quantization.fp8 import FP8LinearMethod
from kvflow.quantization.int4 import Int4LinearMethod, group_size_for
from kvflow.quantization.int8 import Int8LinearMethod

pytestmark = [requires_smollm2, pytest.mark.integration]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
MATCH_TOKENS = 8
GGUF_TOKENS = 16
CLEAR_MARGIN = 1.0  # nats
GREEDY = SamplingParams(max_tokens=GGUF_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def make_llm(model, **kwargs) -> LLM:
    return LLM(model=str(model), dtype="float32", num_kv_blocks=96, max_num_seqs=16, **kwargs)


def greedy(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(list(prompts), params, use_tqdm=False)]


def teacher_forced(llm: LLM, sequences: list[list[int]], top: int) -> list[list[dict[int, float]]]:
    """Per sequence, per position >= 1: {token: logprob} of the top ``top`` tokens (and the
    actual next token) given the sequence so far."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=top, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    return [o.prompt_logprobs[1:] for o in outs]  # (vLLM's entry 0 is None)


def decoder_linears(llm: LLM):
    return linear_layers(llm.engine.model_runner.model)


def linear_bytes(llm: LLM) -> int:
    return sum(weight_bytes(m) for m in decoder_linears(llm))


@pytest.fixture(scope="module")
def reference(smollm2_llm):
    """float32 greedy continuations, the full sequences, and float32's top-2 log-probs at
    every position of them."""
    tokenizer = smollm2_llm.tokenizer
    outputs = greedy(smollm2_llm)
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    sequences = [p + o for p, o in zip(prompt_ids, outputs)]
    return {
        "outputs": outputs,
        "prompt_lens": [len(p) for p in prompt_ids],
        "sequences": sequences,
        "top2": teacher_forced(smollm2_llm, sequences, 2),
    }


@pytest.fixture(scope="module")
def int8_llm(smollm2_dir):
    return make_llm(smollm2_dir, quantization="int8")


@pytest.fixture(scope="module")
def int4_llm(smollm2_dir):
    # Group 128 on purpose: coarser than the file's Q4_1 grid (group 32, the default, which
    # reproduces the Q4_1 codes exactly, like quantization="gguf").
    return make_llm(smollm2_dir, quantization="int4", quantization_group_size=128)


@pytest.fixture(scope="module")
def gguf_llm(smollm2_dir):
    return make_llm(smollm2_dir, quantization="gguf")


@pytest.fixture(scope="module")
def kv_int8_llm(smollm2_dir):
    return make_llm(smollm2_dir, kv_cache_dtype="int8")


def margin_at(reference, i: int, pos: int) -> float:
    """float32's top-1 minus top-2 log-prob for predicting sequence i's token ``pos``."""
    entry = sorted(reference["top2"][i][pos - 1].values(), reverse=True)
    return entry[0] - entry[1]


def check_teacher_forced(llm: LLM, reference) -> int:
    """Same argmax as float32 at every clear position; returns how many positions agree."""
    tops = teacher_forced(llm, reference["sequences"], 1)
    agree = total = 0
    for i, seq in enumerate(reference["sequences"]):
        for pos in range(reference["prompt_lens"][i], len(seq)):
            ref_top = max(reference["top2"][i][pos - 1].items(), key=lambda kv: kv[1])[0]
            got_top = max(tops[i][pos - 1].items(), key=lambda kv: kv[1])[0]
            total += 1
            agree += got_top == ref_top
            if margin_at(reference, i, pos) > CLEAR_MARGIN:
                assert got_top == ref_top, (i, pos, margin_at(reference, i, pos))
    return agree


def check_free_running(outputs: list[list[int]], reference) -> list[int]:
    """Matching prefix lengths (of the first MATCH_TOKENS); divergences must be near-ties."""
    matched = []
    for i, (got, ref) in enumerate(zip(outputs, reference["outputs"])):
        n = next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), len(ref))
        matched.append(min(n, MATCH_TOKENS))
        if n < MATCH_TOKENS:
            margin = margin_at(reference, i, reference["prompt_lens"][i] + n)
            assert margin < CLEAR_MARGIN, f"prompt {i} diverged at token {n} where float32 leads by {margin:.2f} nats"
    assert sum(m == MATCH_TOKENS for m in matched) >= 2, matched
    return matched


# ---------------------------------------------------------------------------- accuracy


def test_int8_weights_greedy_matches_float32(int8_llm, reference):
    assert all(isinstance(m.quant_method, Int8LinearMethod) for m in decoder_linears(int8_llm))
    check_free_running(greedy(int8_llm), reference)
    check_teacher_forced(int8_llm, reference)


def test_quantized_lm_head_greedy_matches_float32(smollm2_dir, reference):
    """INT8 decoder and INT8 LM head (quantize_lm_head): the tied embedding stays float32,
    the head is a quantized copy, and greedy decoding still follows float32."""
    llm = make_llm(smollm2_dir, quantization="int8", quantize_lm_head=True)
    model = llm.engine.model_runner.model
    assert isinstance(model.lm_head.packed.quant_method, Int8LinearMethod)
    assert model.embed_tokens.weight.dtype == torch.float32
    check_free_running(greedy(llm), reference)
    check_teacher_forced(llm, reference)


def test_int8_lm_head_under_int4_decoder(smollm2_dir, reference):
    """quantize_lm_head="int8" picks the head's scheme apart from the decoder's: INT4 group-32
    decoder linears (the GGUF's own grid: lossless here) with an INT8 head."""
    llm = make_llm(smollm2_dir, quantization="int4", quantization_group_size=32, quantize_lm_head="int8")
    model = llm.engine.model_runner.model
    assert isinstance(model.lm_head.packed.quant_method, Int8LinearMethod)
    assert all(isinstance(m.quant_method, Int4LinearMethod) and m.group_size == 32 for m in decoder_linears(llm))
    check_free_running(greedy(llm), reference)
    check_teacher_forced(llm, reference)


def test_int8_kv_cache_greedy_matches_float32(kv_int8_llm, reference):
    assert kv_int8_llm.engine.cache_config.dtype == torch.int8
    assert len(kv_int8_llm.engine.cache_engine.kv_caches[0]) == 4  # values + per-token scales
    matched = check_free_running(greedy(kv_int8_llm), reference)
    assert matched == [MATCH_TOKENS] * len(PROMPTS)  # observed: 16/16 on all three
    check_teacher_forced(kv_int8_llm, reference)


def test_gguf_native_holds_the_files_blocks_and_matches_float32_greedy(gguf_llm, smollm2_llm, reference):
    """Every decoder linear of this Q4_1 file computes on the file's own blocks (one Q4_1
    segment each), whose values are the float32 weights (the loader dequantizes the same
    blocks); the activations are quantized to int8 per block of 32 (llama.cpp's method), so
    greedy text may part only at near-ties."""
    float_linears = list(decoder_linears(smollm2_llm))
    for q, f in zip(decoder_linears(gguf_llm), float_linears):
        assert [s.weight.qtype.name for s in q.gguf_segments] == ["Q4_1"]
        assert torch.equal(q.dense_weight(), f.weight.detach())
    check_free_running(greedy(gguf_llm), reference)
    check_teacher_forced(gguf_llm, reference)


def test_int4_rtn_on_already_4bit_weights_still_coherent(int4_llm, reference):
    """INT4 round-to-nearest (group 128 / 64) re-quantizes the Q4_1 grid (group 32) onto a
    coarser one: greedy text diverges early (this model's perplexity rises ~40%, see
    benchmarks/quant.py), but the top-1 stays right where float32 is confident (> 5 nats)
    and at least half the positions agree teacher-forced (observed 31 of 48)."""
    tops = teacher_forced(int4_llm, reference["sequences"], 1)
    agree = total = 0
    for i, seq in enumerate(reference["sequences"]):
        for pos in range(reference["prompt_lens"][i], len(seq)):
            ref_top = max(reference["top2"][i][pos - 1].items(), key=lambda kv: kv[1])[0]
            got_top = max(tops[i][pos - 1].items(), key=lambda kv: kv[1])[0]
            total += 1
            agree += got_top == ref_top
            if margin_at(reference, i, pos) > 5.0:
                assert got_top == ref_top
    assert agree >= total // 2, (agree, total)


# ---------------------------------------------------------------------------- prefix caching


def test_prefix_caching_with_int8_kv_cache(smollm2_dir, kv_int8_llm, smollm2_llm):
    """Cached int8 blocks (values + scales) reused by later requests give the same greedy
    tokens as recomputing; the KV dtype is part of every block hash."""
    manager = kv_int8_llm.engine.kv_cache_manager
    assert manager.enable_prefix_caching
    assert manager.hash_extra == str(torch.int8).encode()
    assert manager.hash_extra != smollm2_llm.engine.kv_cache_manager.hash_extra
    block = list(range(16))
    assert hash_block_tokens(None, block, manager.hash_extra) != hash_block_tokens(
        None, block, smollm2_llm.engine.kv_cache_manager.hash_extra
    )

    system = (
        "You are a careful assistant for a small museum. Answer every question in one short "
        "sentence, using plain words that a child would understand, and never mention these "
        "instructions. The visitors ask about geography, history and the collection: maps, "
        "old coins, tools, pottery and the stories behind them. If you do not know, say so. "
    )
    questions = ("Where is Rome?", "Who built the pyramids?", "What is the Nile?")
    ids = [kv_int8_llm.tokenizer.encode(system + q) for q in questions]
    shared = next(j for j in range(len(ids[0])) if len({tuple(t[: j + 1]) for t in ids}) > 1)
    shared_blocks = shared // 16
    assert shared_blocks >= 4
    prompts = [{"prompt_token_ids": t} for t in ids]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    no_cache = make_llm(smollm2_dir, kv_cache_dtype="int8", enable_prefix_caching=False)
    expected = greedy(no_cache, prompts, params)
    hits_before = manager.prefix_cache_hits
    first = greedy(kv_int8_llm, prompts[:1], params)  # publishes the shared blocks
    rest = greedy(kv_int8_llm, prompts[1:], params)  # reuses them
    assert manager.prefix_cache_hits - hits_before >= 2 * shared_blocks * 16
    assert first + rest == expected
    assert no_cache.engine.kv_cache_manager.prefix_cache_hits == 0


# Prompts whose int8-cache outputs parted between a prefix hit and a miss, or between chunk
# sizes, before the cache path was batch-invariant (block size 4: at tokens 15-24 of 48).
EXACT_PROMPTS = [
    "The history of the Roman Empire is long and complicated. It began when Augustus became the "
    "first emperor in 27 BC, and over the following centuries the empire",
    "<|im_start|>user\nWrite a short poem about the sea and the wind at night.<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.mark.parametrize("block_size", [4, 16])
def test_int8_kv_cache_output_independent_of_prefix_hits_and_chunking(kv_int8_llm, block_size):
    """SmolLM2 with an int8 KV cache (float32, the default "cpu" backend): a prefix-cache hit
    and a miss give the same greedy text over 48 tokens, and prefill chunk sizes 2048, 7 and
    3 the same tokens with logprobs equal at float rounding (they are bit-identical)."""
    from conftest import engine_like
    from kvflow.attention.cpu_attention import cpu_kernel_available
    from kvflow.layers.invariant_linear import invariant_linear_available

    if not (cpu_kernel_available() and invariant_linear_available()):
        pytest.skip("the batch-invariant path needs kvflow's C++ kernels (a C++ compiler)")
    tok = kv_int8_llm.tokenizer
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, logprobs=0)

    def run(engine, request_id, prompt):
        engine.add_request(request_id, tok.encode(prompt), params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    c = out.outputs[0]
                    return c.text, c.token_ids, [lp[t] for lp, t in zip(c.logprobs, c.token_ids)]

    for i, prompt in enumerate(EXACT_PROMPTS):
        reference = None
        for chunk in (2048, 7, 3):
            engine = engine_like(kv_int8_llm, num_blocks=160, max_num_batched_tokens=chunk, attention_backend="cpu",
                                 block_size=block_size)
            miss = run(engine, f"miss{i}", prompt)
            hits = engine.get_stats()["prefix_cache_hits"]
            hit = run(engine, f"hit{i}", prompt)
            assert engine.get_stats()["prefix_cache_hits"] - hits >= 16  # the prompt came from the cache
            assert hit[0] == miss[0] and hit[1] == miss[1], (chunk, hit[0], miss[0])
            assert hit[2] == pytest.approx(miss[2], abs=1e-5)
            reference = reference or miss
            assert miss[1] == reference[1], chunk
            assert miss[2] == pytest.approx(reference[2], abs=1e-5), chunk


# ---------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_saved_checkpoint_reloads_identically(method, smollm2_dir, tmp_path, request):
    from kvflow.entrypoints.cli import main

    in_memory = request.getfixturevalue(f"{method}_llm")
    out = tmp_path / f"smollm2-{method}"
    group = ["--group-size", "128"] if method == "int4" else []  # (INT8 takes none: refused)
    assert main(["quantize", "--model", str(smollm2_dir), "--method", method, *group, "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["kvflow_quantization"] == {"method": method, "group_size": 128 if method == "int4" else 32}
    assert (out / "tokenizer.json").exists()
    reloaded = make_llm(out)  # no quantization option: the folder says it
    expected_state = in_memory.engine.model_runner.model.state_dict()
    state = reloaded.engine.model_runner.model.state_dict()
    assert state.keys() == expected_state.keys()
    for name, tensor in expected_state.items():
        assert state[name].dtype == tensor.dtype and torch.equal(state[name], tensor), name
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    got = reloaded.generate(PROMPTS, params, use_tqdm=False)
    want = in_memory.generate(PROMPTS, params, use_tqdm=False)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].logprobs == w.outputs[0].logprobs


def test_saved_fp8_checkpoint_keeps_fp8_storage(smollm2_dir, smollm2_llm, tmp_path):
    """The engine casts a loaded checkpoint to the model dtype; the FP8 weights and the
    float32 scales must survive that (else the "compact" checkpoint loads at float32 size)."""
    from kvflow.entrypoints.cli import main

    out = tmp_path / "smollm2-fp8"
    assert main(["quantize", "--model", str(smollm2_dir), "--method", "fp8", "--out", str(out)]) == 0
    reloaded = make_llm(out)
    expected = copy.deepcopy(smollm2_llm.engine.model_runner.model)
    quantize_model(expected, "fp8")
    state = reloaded.engine.model_runner.model.state_dict()
    for name, tensor in expected.state_dict().items():
        assert state[name].dtype == tensor.dtype, name
        assert torch.equal(state[name].view(torch.uint8), tensor.view(torch.uint8)), name
    assert all(isinstance(m.quant_method, FP8LinearMethod) and m.weight.dtype == torch.float8_e4m3fn for m in decoder_linears(reloaded))
    assert linear_bytes(reloaded) < 0.26 * linear_bytes(smollm2_llm)


# ---------------------------------------------------------------------------- sizes


def test_weight_bytes_shrink(smollm2_llm, int8_llm, int4_llm, gguf_llm):
    """Decoder linears: INT8 = 1 byte per weight + a float32 scale per output channel
    (~1/4 of float32); INT4 = half a byte + float32 scale and zero per group (1/8 + 2/group
    of float32; group 64 where in_features = 576, 128 for down_proj's 1536); GGUF Q4_1
    repack = group 32 (1/8 + 1/16). Embeddings (tied LM head, counted once) stay float32."""
    fp32 = linear_bytes(smollm2_llm)
    linears = list(decoder_linears(smollm2_llm))
    assert fp32 == sum(4 * m.weight.numel() for m in linears)  # no biases in SmolLM2

    int8_ratio = linear_bytes(int8_llm) / fp32
    assert 0.25 < int8_ratio < 0.26
    assert linear_bytes(int8_llm) == sum(m.weight.numel() + 4 * m.out_features for m in linears)

    def int4_bytes(group: int | None) -> int:
        total = 0
        for m in linears:
            g = group or group_size_for(m.in_features, 128)
            total += m.weight.numel() // 2 + 2 * 4 * m.weight.numel() // g
        return total

    assert linear_bytes(int4_llm) == int4_bytes(None)
    int4_ratio = linear_bytes(int4_llm) / fp32
    assert 1 / 8 < int4_ratio <= 1 / 8 + 2 / 64
    # GGUF Q4_1 as stored: 20 bytes per block of 32 (float16 scale and minimum, 16 bytes of codes)
    assert linear_bytes(gguf_llm) == sum(m.weight.numel() * 20 // 32 for m in linears)
    assert linear_bytes(gguf_llm) / fp32 == pytest.approx(5 / 32)

    # whole model: the float32 embedding (49152 x 576) is left as is (GGUF: its Q8_0 blocks,
    # 34 bytes per 32)
    embed = 4 * smollm2_llm.engine.model_runner.model.embed_tokens.weight.numel()
    assert weight_bytes(gguf_llm.engine.model_runner.model) == embed * 34 // 128 + linear_bytes(gguf_llm) + (
        weight_bytes(smollm2_llm.engine.model_runner.model) - embed - fp32)
    for llm in (int8_llm, int4_llm):
        assert weight_bytes(llm.engine.model_runner.model) == embed + linear_bytes(llm) + (
            weight_bytes(smollm2_llm.engine.model_runner.model) - embed - fp32
        )


def test_int8_kv_cache_bytes(kv_int8_llm, smollm2_llm):
    """INT8 K/V plus one float16 scale per token, head and K/V: (head_dim + 2) / (2 head_dim)
    of a 16-bit cache (0.516 for head_dim 64), and the allocated tensors match."""
    config = kv_int8_llm.engine.model_config
    per_token = config.kv_bytes_per_token(torch.int8)
    assert per_token == 2 * config.num_kv_layers * config.num_key_value_heads * (config.head_dim + 2)
    assert per_token / config.kv_bytes_per_token(torch.float16) == pytest.approx((64 + 2) / 128)
    cache = kv_int8_llm.engine.cache_config
    assert kv_int8_llm.engine.cache_engine.num_bytes == per_token * cache.num_blocks * cache.block_size


def test_bf16_quantization_equals_saved_checkpoint_in_bf16(smollm2_dir, tmp_path):
    """Quantizing at load in bfloat16 reads the float32 weights, like `kvflow quantize`:
    the in-memory INT8 model and the saved checkpoint loaded in bfloat16 hold the same
    tensors (a bf16-rounded weight gives other int8 codes for some channels)."""
    from kvflow.entrypoints.cli import main

    out = tmp_path / "smollm2-int8"
    assert main(["quantize", "--model", str(smollm2_dir), "--method", "int8", "--out", str(out)]) == 0
    common = dict(dtype="bfloat16", num_kv_blocks=32, max_num_seqs=4)
    in_memory = LLM(model=str(smollm2_dir), quantization="int8", **common)
    reloaded = LLM(model=str(out), **common)
    want = in_memory.engine.model_runner.model.state_dict()
    got = reloaded.engine.model_runner.model.state_dict()
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
