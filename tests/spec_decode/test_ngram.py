"""N-gram (prompt lookup) speculation: the lookup itself, draft caps, and greedy outputs that
are identical with speculation on and off (tiny random models and the real SmolLM2)."""

from __future__ import annotations

import pytest
import torch

from conftest import make_engine as conftest_make_engine, engine_like, requires_smollm2, tiny_model, tiny_model_config, tiny_word_tokenizer
from kvflow.config import CacheConfig, SchedulerConfig
from kvflow.engine.llm_engine import LLMEngine
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams
from kvflow.spec_decode.ngram import NgramProposer, max_drafts

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models gain nothing from intra-op threads on a shared 2-core machine."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


# ------------------------------------------------------------------------------ lookup
def test_lookup_continues_latest_earlier_match():
    prop = NgramProposer(3, 1, 3, 1000)
    # suffix [7, 8] occurs at 0 (followed by 1 2 3) and at 5 (followed by 4 5 6): latest wins
    tokens = [7, 8, 1, 2, 3, 7, 8, 4, 5, 6, 9, 7, 8]
    assert prop.lookup(tokens, 3) == [4, 5, 6]
    assert prop.lookup(tokens, 2) == [4, 5]
    assert prop.lookup(tokens, 5) == [4, 5, 6, 9, 7]  # the continuation may run into the suffix


def test_lookup_prefers_the_longest_ngram():
    # 3-gram [1, 2, 3] matches only at 0 (-> 40); the 1-gram [3] matches later at 5 (-> 50)
    tokens = [1, 2, 3, 40, 9, 3, 50, 1, 2, 3]
    assert NgramProposer(1, 1, 3, 1000).lookup(tokens, 1) == [40]
    assert NgramProposer(1, 1, 1, 1000).lookup(tokens, 1) == [50]
    assert NgramProposer(1, 2, 2, 1000).lookup(tokens, 1) == [40]  # [2, 3] only at 1


def test_lookup_respects_min_and_max():
    tokens = [5, 6, 1, 2, 3, 4, 9, 9, 6]  # of the suffixes, only the 1-gram [6] recurs
    assert NgramProposer(2, 1, 4, 1000).lookup(tokens, 2) == [1, 2]
    assert NgramProposer(2, 2, 4, 1000).lookup(tokens, 2) == []  # min 2: no match
    tokens = [1, 2, 3, 4, 70, 0, 2, 3, 4, 80, 1, 2, 3, 4]
    # max 3: [2, 3, 4] latest earlier match at 6 (-> 80); max 4: [1, 2, 3, 4] at 0 (-> 70)
    assert NgramProposer(1, 1, 3, 1000).lookup(tokens, 1) == [80]
    assert NgramProposer(1, 1, 4, 1000).lookup(tokens, 1) == [70]


def test_lookup_no_match_and_short_inputs():
    prop = NgramProposer(4, 1, 5, 1000)
    assert prop.lookup([1, 2, 3, 4], 4) == []
    assert prop.lookup([1], 4) == []
    assert prop.lookup([], 4) == []
    assert prop.lookup([3, 3], 4) == [3]  # the only earlier match is the first token
    assert prop.lookup([3, 3, 3], 4) == [3]  # latest earlier match of [3, 3] is at 0
    assert NgramProposer(4, 3, 5, 1000).lookup([3, 3, 3], 4) == []  # n=3 needs an earlier match


def test_invalid_lookup_sizes():
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(2, 3, 2, 100)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(2, 0, 2, 100)


def _request(prompt, output, max_tokens):
    r = Request("r", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens), None)
    for t in output:
        r.append_output_token(t)
    return r


def test_max_drafts_caps_by_max_tokens_and_context():
    r = _request([1, 2, 3], [4], max_tokens=10)  # 9 outputs left: up to 8 drafts + 1
    assert max_drafts(r, 4, 1000) == 4
    assert max_drafts(r, 16, 1000) == 8
    r = _request([1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11], max_tokens=10)  # 2 outputs left
    assert max_drafts(r, 4, 1000) == 1
    r = _request([1, 2, 3], [4] * 9, max_tokens=10)  # 1 output left: no draft
    assert max_drafts(r, 4, 1000) == 0
    r = _request([1, 2, 3], [4], max_tokens=100)  # 4 tokens, context 7: positions 4..6 left
    assert max_drafts(r, 4, 7) == 2
    assert max_drafts(r, 4, 5) == 0


def test_propose_sets_capped_one_hot_drafts():
    prop = NgramProposer(4, 1, 3, 1000)
    repeating = _request([1, 2, 3, 1, 2, 3, 1, 2, 3], [1], max_tokens=3)  # 2 left: 1 draft
    fresh = _request([1, 2, 3], [9], max_tokens=50)
    repeating.spec_draft_probs = torch.ones(1, 4)
    prop.propose([repeating, fresh])
    assert repeating.spec_token_ids == [2] and repeating.spec_draft_probs is None
    assert fresh.spec_token_ids == []
    long = _request([1, 2, 3, 1, 2, 3, 1, 2, 3], [1], max_tokens=50)
    prop.propose([long])
    assert long.spec_token_ids == [2, 3, 1]  # the continuation ends at the last token


# ---------------------------------------------------------------- greedy equality (tiny)
def make_engine(proposer=None, num_blocks=128, block_size=4, max_num_batched_tokens=64, max_num_seqs=16,
                max_model_len=256, enable_prefix_caching=True, seed=0, vocab_size=32, tokenizer=None) -> LLMEngine:
    config = tiny_model_config(vocab_size=vocab_size)
    return conftest_make_engine(
        model=tiny_model(config),
        model_config=config,
        cache_config=CacheConfig(block_size, num_blocks, torch.float32, enable_prefix_caching=enable_prefix_caching),
        scheduler_config=SchedulerConfig(max_num_batched_tokens, max_num_seqs, max_model_len),
        tokenizer=tokenizer,
        device=CPU,
        seed=seed,
        proposer=proposer,
    )


def run_schedule(engine: LLMEngine, arrivals: list[tuple[int, list[int], SamplingParams]]) -> dict[str, list[int]]:
    """Add request i at step arrivals[i][0]; run to the end; request id -> output tokens."""
    done: dict[str, list[int]] = {}
    step = 0
    pending = sorted(enumerate(arrivals), key=lambda x: x[1][0])
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, params) = pending.pop(0)
            engine.add_request(str(i), prompt, params)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        step += 1
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    return done


# Prompts over a 32-token vocabulary with repeats, so prompt lookup finds matches; greedy
# random tiny models also fall into loops, which the lookup then predicts.
PROMPTS = [
    [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2],
    [7, 8, 9, 7, 8, 9, 7],
    [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 10, 11, 12],
    [30, 31],
    [3] * 9,
    [5, 9, 14, 2, 5, 9, 14],
]
ARRIVALS = [0, 0, 1, 3, 3, 6]  # later requests prefill while others verify drafts


@pytest.mark.parametrize("k", [1, 2, 4, 7])
@pytest.mark.parametrize("budget", [5, 64])
def test_greedy_identical_with_ngram(k, budget):
    arrivals = [(t, p, GREEDY) for t, p in zip(ARRIVALS, PROMPTS)]
    reference = run_schedule(make_engine(max_num_batched_tokens=budget), arrivals)
    spec = make_engine(NgramProposer(k, 1, 4, 256), max_num_batched_tokens=budget)
    assert run_schedule(spec, arrivals) == reference
    stats = spec.get_stats()
    assert stats["spec_num_accepted_tokens"] > 0
    assert stats["spec_num_draft_tokens"] > stats["spec_num_accepted_tokens"]  # some rejected too


def test_stop_token_inside_accepted_drafts():
    """A stop token among accepted drafts ends the request there; later tokens are dropped."""
    prompt = PROMPTS[0]
    base = run_schedule(make_engine(), [(0, prompt, SamplingParams(temperature=0.0, max_tokens=40))])["0"]
    spec = make_engine(NgramProposer(6, 1, 4, 256))
    # stop at the first occurrence of a token seen late in the output (likely inside a draft)
    for stop in dict.fromkeys(reversed(base[4:])):
        params = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop])
        expected = base[: base.index(stop) + 1]
        assert run_schedule(make_engine(), [(0, prompt, params)])["0"] == expected
        assert run_schedule(spec, [(0, prompt, params)])["0"] == expected
    assert spec.get_stats()["spec_num_accepted_tokens"] > 0


def _run_steps(engine: LLMEngine, prompt: list[int], params: SamplingParams):
    """One request to the end: its final CompletionOutput and the tokens added per step."""
    engine.add_request("r", prompt, params)
    last, steps = None, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            steps.append(len(out.outputs[0].token_ids) - (len(last.outputs[0].token_ids) if last else 0))
            last = out
    return last.outputs[0], steps


@pytest.mark.parametrize("prompt", [PROMPTS[0], PROMPTS[3], PROMPTS[4]])
def test_stop_string_inside_accepted_drafts(prompt):
    """A stop string completed by an accepted draft token ends the request at that token:
    token_ids, logprobs, finish and stop reasons and text equal the run without speculation,
    and no token past the stop stays computed or reaches the prefix cache."""
    tok = tiny_word_tokenizer(32)
    free = SamplingParams(temperature=0.0, max_tokens=40, logprobs=1)
    base, _ = _run_steps(make_engine(tokenizer=tok, block_size=1), prompt, free)
    spec_free, steps = _run_steps(make_engine(NgramProposer(6, 1, 4, 256), tokenizer=tok, block_size=1), prompt, free)
    assert spec_free.token_ids == base.token_ids
    # stop strings (whole words "<a> <b> ...") whose first occurrence in the text ends at a
    # token that a step emitted together with later tokens (an accepted draft followed by
    # more accepted tokens)
    text = tok.decode(base.token_ids)
    ends = [sum(steps[: i + 1]) for i in range(len(steps))]
    stops = []
    for p in (p for e, n in zip(ends, steps) for p in range(e - n, e - 1)):
        end = len(tok.decode(base.token_ids[: p + 1]))
        for start in range(p, -1, -1):
            stop = tok.decode(base.token_ids[start : p + 1])
            if text.find(stop) + len(stop) == end:
                stops.append(stop)
                break
    stops = list(dict.fromkeys(stops))[:3]
    assert stops, steps
    for stop in stops:
        for include in (False, True):
            params = SamplingParams(temperature=0.0, max_tokens=40, logprobs=1, stop=[stop],
                                    include_stop_str_in_output=include)
            ref, _ = _run_steps(make_engine(tokenizer=tok, block_size=1), prompt, params)
            spec_engine = make_engine(NgramProposer(6, 1, 4, 256), tokenizer=tok, block_size=1)
            got, _ = _run_steps(spec_engine, prompt, params)
            assert ref.finish_reason == "stop" and ref.stop_reason == stop
            assert len(ref.token_ids) < len(base.token_ids)
            assert got.token_ids == ref.token_ids
            assert (got.text, got.finish_reason, got.stop_reason) == (ref.text, ref.finish_reason, ref.stop_reason)
            assert len(got.logprobs) == len(ref.logprobs) == len(ref.token_ids)
            for a, b in zip(got.logprobs, ref.logprobs):
                assert a.keys() == b.keys() and all(a[t] == pytest.approx(b[t], abs=1e-4) for t in a)
            assert got.cumulative_logprob == pytest.approx(ref.cumulative_logprob, abs=1e-3)
            stats = spec_engine.get_stats()
            assert stats["num_free_blocks"] == stats["num_total_blocks"]
            # block_size 1: every computed token's block is published; a follow-up prompt
            # holding the whole unstopped output hits only blocks up to the stop
            spec_engine.add_request("follow", prompt + base.token_ids, SamplingParams(temperature=0.0, max_tokens=1))
            while spec_engine.has_unfinished_requests():
                spec_engine.step()
            assert spec_engine.get_stats()["prefix_cache_hits"] <= len(prompt) + len(ref.token_ids)


def test_max_tokens_and_context_limit_are_exact():
    for max_tokens in (1, 2, 3, 5, 9):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        out = run_schedule(make_engine(NgramProposer(4, 1, 4, 256)), [(0, PROMPTS[4], params)])["0"]
        assert len(out) == max_tokens
    params = SamplingParams(temperature=0.0, max_tokens=100)
    ref = run_schedule(make_engine(max_model_len=20), [(0, PROMPTS[4], params)])["0"]
    spec = make_engine(NgramProposer(4, 1, 4, 20), max_model_len=20)
    assert run_schedule(spec, [(0, PROMPTS[4], params)])["0"] == ref
    assert len(ref) == 20 - len(PROMPTS[4])


def test_logprobs_match_without_speculation():
    params = SamplingParams(temperature=0.0, max_tokens=20, logprobs=2)

    def run(engine):
        engine.add_request("a", PROMPTS[1], params)
        last = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                last = out
        return last.outputs[0]

    ref = run(make_engine())
    spec_engine = make_engine(NgramProposer(4, 1, 4, 256))
    got = run(spec_engine)
    assert got.token_ids == ref.token_ids
    assert spec_engine.get_stats()["spec_num_accepted_tokens"] > 0
    assert len(got.logprobs) == len(ref.logprobs) == 20
    for a, b in zip(got.logprobs, ref.logprobs):
        assert a.keys() == b.keys()
        for t in a:
            assert a[t] == pytest.approx(b[t], abs=1e-4)
    assert got.cumulative_logprob == pytest.approx(ref.cumulative_logprob, abs=1e-3)


# ------------------------------------------------------------------ real model (SmolLM2)
PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, "
    "polished the great lens, and wrote the weather in a leather logbook: wind from the north-east, "
    "a falling barometer, three fishing boats returning late."
)
CODE = (
    "def total_price(items, tax_rate):\n"
    "    subtotal = 0\n"
    "    for item in items:\n"
    "        subtotal = subtotal + item.price * item.quantity\n"
    "    return subtotal * (1 + tax_rate)\n"
)
REAL_PROMPTS = [
    f"Repeat the following text exactly.\n\nText: {PASSAGE}\n\nRepeated text: The lighthouse keeper",
    f"Rename the function total_price to compute_total in this code and change nothing else.\n\n{CODE}\n"
    "Edited code:\ndef compute_total(items, tax_rate):\n",
    f"Here is a passage.\n\n{PASSAGE}\n\nCopy the passage, replacing 'lighthouse keeper' with 'old sailor':\n\nThe old sailor",
]


@requires_smollm2
@pytest.mark.integration
def test_real_model_greedy_identical_with_ngram(smollm2_llm):
    tok = smollm2_llm.tokenizer
    prompts = [tok.encode(p) for p in REAL_PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    arrivals = [(0, p, params) for p in prompts]
    reference = run_schedule(engine_like(smollm2_llm), arrivals)
    max_len = smollm2_llm.engine.scheduler_config.max_model_len
    spec = engine_like(smollm2_llm, proposer=NgramProposer(4, 2, 5, max_len))
    assert run_schedule(spec, arrivals) == reference
    stats = spec.get_stats()
    assert stats["spec_num_accepted_tokens"] > 0
    # input-grounded prompts: most drafts are right, so steps emit well over one token each
    assert stats["spec_acceptance_rate"] > 0.3, stats
    assert stats["spec_mean_accepted_length"] > 1.5, stats
    text = tok.decode(reference["0"])
    assert "spiral stairs" in text  # the model does copy the passage


@requires_smollm2
@pytest.mark.integration
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_real_gguf_model_served_as_stored_is_greedy_identical_with_ngram(smollm2_dir, dtype, monkeypatch):
    """The GGUF file computed as stored (the default): verification steps take the fused
    decode step as plain decode steps do (``kvflow.layers.fused_decode.per_token_rows``), so
    each verified token is computed as its decode step would compute it and the outputs are
    identical. (Verified on the PyTorch path instead, the two paths' float sums in other
    orders split the float32 outputs at the third prompt's 13th token.)"""
    from kvflow import LLM, ops
    from kvflow.layers import fused_decode

    monkeypatch.setenv("KVFLOW_CPU_KERNEL_BUILD", "wait")  # the kernels now, not in the background
    llm = LLM(model=str(smollm2_dir), quantization="gguf", dtype=dtype, num_kv_blocks=256, max_num_seqs=16)
    tok = llm.tokenizer
    prompts = [tok.encode(p) for p in REAL_PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    arrivals = [(0, p, params) for p in prompts]
    reference = run_schedule(engine_like(llm, attention_backend="cpu"), arrivals)
    max_len = llm.engine.scheduler_config.max_model_len
    spec = engine_like(llm, proposer=NgramProposer(4, 2, 5, max_len), attention_backend="cpu")
    assert run_schedule(spec, arrivals) == reference
    if not (ops.FUSED_DECODE.disabled() or ops.GGUF_MATMUL.disabled()):  # (the kernels' switches)
        assert isinstance(llm.engine.model_runner.model.__dict__["fused_decode"], fused_decode.FusedDecodeStep)
    stats = spec.get_stats()
    assert stats["spec_mean_accepted_length"] > 1.5, stats


@requires_smollm2
@pytest.mark.integration
def test_real_gguf_model_is_greedy_identical_when_prompts_arrive_mid_flight_or_requests_are_recomputed(
        smollm2_dir, monkeypatch):
    """Prompts arriving while other requests decode or verify, and requests preempted by
    recompute: the fused step takes every generated token (decodes, verifications, a
    recomputed output) beside the step's prompt tokens, which take the PyTorch path. So the
    outputs of n-gram speculation and of a cache too small for all requests stay identical to
    plain greedy decoding with room for all. (Such steps took the PyTorch path whole: the
    decodes met the arriving prompts at other tokens, computed by other float sums, and a
    recomputed output was re-written by the PyTorch path; the outputs parted.)"""
    from kvflow import LLM

    monkeypatch.setenv("KVFLOW_CPU_KERNEL_BUILD", "wait")
    llm = LLM(model=str(smollm2_dir), quantization="gguf", dtype="float32", num_kv_blocks=256, max_num_seqs=16)
    tok = llm.tokenizer
    base = [tok.encode(p) for p in REAL_PROMPTS]
    prompts = [base[0][:30], base[1][:16], base[2][:17], base[0][10:50], tok.encode("Hi"), base[1][5:60]]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, presence_penalty=0.8,
                            frequency_penalty=0.4)
    arrivals = [(i // 2, p, params) for i, p in enumerate(prompts)]
    reference = run_schedule(engine_like(llm, attention_backend="cpu"), arrivals)
    max_len = llm.engine.scheduler_config.max_model_len
    for k in (1, 4):
        spec = engine_like(llm, proposer=NgramProposer(k, 1, 4, max_len), attention_backend="cpu")
        assert run_schedule(spec, arrivals) == reference, k
    tight = engine_like(llm, num_blocks=14, attention_backend="cpu", enable_prefix_caching=False)
    assert run_schedule(tight, arrivals) == reference
    assert tight.get_stats()["num_preemptions"] > 0
