"""Integration tests of the offline API on the real SmolLM2-135M-Instruct model (float32, CPU)."""

from __future__ import annotations

import pytest
import torch

from conftest import engine_like, prefill_logits, requires_smollm2
from kvflow import PoolingParams, SamplingParams
from kvflow.engine.llm_engine import LLMEngine

pytestmark = [requires_smollm2, pytest.mark.integration]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "PagedAttention stores the KV cache in fixed-size blocks so that",
    "Once upon a time, in a small village by the sea,",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_reference(smollm2_dir):
    """transformers' LlamaForCausalLM on the same dequantized float32 weights."""
    from transformers import AutoModelForCausalLM

    from kvflow.model.resolve import hf_checkpoint_dir

    return AutoModelForCausalLM.from_pretrained(hf_checkpoint_dir(str(smollm2_dir)), dtype=torch.float32).eval()


def _greedy_tokens(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert engine.get_stats()["num_free_blocks"] == engine.get_stats()["num_total_blocks"]
    return [done[str(i)] for i in range(len(prompts))]


def test_prompt_logits_match_transformers(smollm2_llm, hf_reference):
    ids = smollm2_llm.tokenizer.encode(PROMPTS[2])
    with torch.inference_mode():
        ref = hf_reference(torch.tensor([ids])).logits[0]
    ours = prefill_logits(smollm2_llm.engine.model_runner.model, ids, chunk=len(ids), block_size=16)
    assert (ours - ref).abs().max().item() <= 1e-3


def test_greedy_tokens_match_transformers(smollm2_llm, hf_reference):
    """Identical greedy tokens, or the first divergence is at a near-tie in the reference.

    A near-tie is a top-2 logit gap below 1e-4 at the diverging step of the reference: there,
    float32 summation order alone can flip the argmax.
    """
    outputs = smollm2_llm.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, outputs):
        ref_tokens, ref_logits = _hf_greedy(hf_reference, out.prompt_token_ids, 32)
        ours = out.outputs[0].token_ids
        assert len(ours) == 32
        if ours != ref_tokens:
            step = next(i for i, (a, b) in enumerate(zip(ours, ref_tokens)) if a != b)
            top2 = ref_logits[step].topk(2).values
            assert (top2[0] - top2[1]).item() < 1e-4, f"{prompt!r} diverges at step {step} without a near-tie"


def _hf_greedy(model, prompt_ids: list[int], num_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding with transformers' KV cache, EOS not special (like ignore_eos)."""
    tokens, logits_per_step = [], []
    past, inputs = None, torch.tensor([prompt_ids])
    with torch.inference_mode():
        for _ in range(num_tokens):
            out = model(input_ids=inputs, past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[0, -1]
            tokens.append(int(logits.argmax()))
            logits_per_step.append(logits)
            inputs = torch.tensor([[tokens[-1]]])
    return tokens, logits_per_step


def test_batch_and_chunk_size_do_not_change_greedy_tokens(smollm2_llm):
    tok = smollm2_llm.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)  # chunk 1 = one token per step
    alone = [_greedy_tokens(engine_like(smollm2_llm, 256, 2048), [p], params)[0] for p in prompts]
    for chunk in (1, 7, 16, 64, 4096):
        batched = _greedy_tokens(engine_like(smollm2_llm, 256, chunk), prompts, params)
        assert batched == alone, f"max_num_batched_tokens={chunk}"


def test_triton_attention_backend_keeps_greedy_tokens(smollm2_llm):
    """The Triton kernels on the real model (in Triton's CPU interpreter without CUDA: slow,
    so two short prompts), prefill in two chunks then decodes, against the PyTorch backend."""
    pytest.importorskip("triton")
    tok = smollm2_llm.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS[:2]]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    reference = _greedy_tokens(engine_like(smollm2_llm, 64, 4), prompts, params)
    assert _greedy_tokens(engine_like(smollm2_llm, 64, 4, attention_backend="triton"), prompts, params) == reference


def test_preemption_keeps_outputs(smollm2_llm):
    tok = smollm2_llm.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    reference = _greedy_tokens(engine_like(smollm2_llm, 256, 2048), prompts)
    small = engine_like(smollm2_llm, num_blocks=8, max_num_batched_tokens=64)  # 128 slots for 4 requests
    assert _greedy_tokens(small, prompts) == reference
    assert small.get_stats()["num_preemptions"] > 0


def test_generate_api_shapes_and_order(smollm2_llm):
    outs = smollm2_llm.generate(PROMPTS[:2] + [[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=8))
    assert [o.prompt for o in outs] == [PROMPTS[0], PROMPTS[1], None]
    assert outs[2].prompt_token_ids == [1, 2, 3]
    for o in outs:
        c = o.outputs[0]
        assert o.finished and c.finish_reason in ("stop", "length")
        assert 1 <= len(c.token_ids) <= 8
        assert c.text == smollm2_llm.tokenizer.decode(c.token_ids, skip_special_tokens=True)
    stats = smollm2_llm.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"] and stats["num_running"] == 0


def test_chat_stops_at_eos(smollm2_llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    (out,) = smollm2_llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=64))
    assert "Paris" in out.outputs[0].text
    # the rendered prompt, as vLLM's LLM.chat gives it (was None), and its ids
    rendered = smollm2_llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out.prompt == rendered and "What is the capital of France?" in out.prompt
    assert out.prompt_token_ids == smollm2_llm.apply_chat_template(messages)
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].token_ids[-1] == smollm2_llm.tokenizer.eos_token_id


def test_stream_yields_growing_text_and_abort_frees_blocks(smollm2_llm):
    stream = smollm2_llm.generate_stream(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    texts = [next(stream).outputs[0].text for _ in range(5)]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    stream.close()  # aborts the request
    stats = smollm2_llm.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ("", SamplingParams(), "prompt"),
        ("hello " * 9000, SamplingParams(), "max_model_len"),
        ([10**6], SamplingParams(), "prompt_token_ids"),
        # a lone surrogate was a TypeError of the tokenizer ("TextEncodeInput must be ...")
        ("a\ud800b", SamplingParams(), "prompt holds a lone surrogate"),
    ],
)
def test_bad_input_raises_and_engine_keeps_serving(smollm2_llm, prompt, params, field):
    with pytest.raises(ValueError, match=field):
        smollm2_llm.generate([PROMPTS[0], prompt], params)
    assert not smollm2_llm.engine.has_unfinished_requests()  # nothing was queued
    (out,) = smollm2_llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4))
    assert len(out.outputs[0].token_ids) == 4


@pytest.mark.parametrize(("field", "value"), [("temperature", -5.0), ("top_p", float("nan")), ("max_tokens", 0)])
def test_sampling_params_changed_after_construction_are_checked(smollm2_llm, field, value):
    """A field set after construction ran unchecked (max_tokens=0 gave 1 token, top_p=NaN
    sampled noise); it is a ValueError naming the field, and nothing is queued."""
    params = SamplingParams(max_tokens=3)
    setattr(params, field, value)
    with pytest.raises(ValueError, match=f"^{field}"):
        smollm2_llm.generate(PROMPTS[0], params)
    assert not smollm2_llm.engine.has_unfinished_requests()


def test_prompt_token_ids_as_numpy_or_a_tensor(smollm2_llm):
    """``prompt_token_ids`` given as a numpy array or a 1-D integer tensor (what a tokenizer's
    ``return_tensors`` gives) are the same prompt as the list; they were refused as "must be
    integers in [0, vocab)" with every id in range. Floats and bools are still refused."""
    import numpy as np

    ids = smollm2_llm.tokenizer.encode(PROMPTS[0])
    params = SamplingParams(temperature=0.0, max_tokens=4)
    (want,) = smollm2_llm.generate({"prompt_token_ids": ids}, params)
    for given in (np.array(ids), np.array(ids, dtype=np.int32), torch.tensor(ids)):
        (out,) = smollm2_llm.generate({"prompt_token_ids": given}, params)
        assert out.prompt_token_ids == ids and all(type(t) is int for t in out.prompt_token_ids)
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
    for bad in (np.array(ids, dtype=np.float32), torch.tensor(ids, dtype=torch.float32), torch.ones(3, dtype=torch.bool)):
        with pytest.raises(ValueError, match="prompt_token_ids must be integers"):
            smollm2_llm.generate({"prompt_token_ids": bad}, params)
    assert not smollm2_llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("prompts", [5, None, 1.5])
def test_prompts_of_a_wrong_type_are_a_value_error(smollm2_llm, prompts):
    """generate(5) / generate(None) was a TypeError ("'int' object is not iterable")."""
    with pytest.raises(ValueError, match="prompts must be"):
        smollm2_llm.generate(prompts, SamplingParams(max_tokens=2))
    assert not smollm2_llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"temperature": 0}, "^sampling_params must be a SamplingParams or a list of them .*got dict"),
        ("greedy", "^sampling_params must be a SamplingParams .*got str"),
        ([SamplingParams(max_tokens=2), PoolingParams()], "^sampling_params entries must be SamplingParams, got PoolingParams"),
        (PoolingParams(), "^sampling_params must be a SamplingParams .*got PoolingParams"),
    ],
)
def test_generate_takes_sampling_params_only(smollm2_llm, params, match):
    """A dict was iterated as a list of params ("got str" for its first key), and a
    PoolingParams ran an embedding among generate's results (vLLM's generate takes
    SamplingParams)."""
    prompts = ["a", "b"] if isinstance(params, list) else ["a"]
    with pytest.raises(ValueError, match=match):
        smollm2_llm.generate(prompts, params)
    assert not smollm2_llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -2}, "top_k"), ({"max_tokens": 0}, "max_tokens")],
)
def test_invalid_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


# ---------------------------------------------------------------------------- KV sharing
SYSTEM = (
    "You are a careful assistant. Answer questions about the GNU General Public License "
    "accurately and briefly, quoting the license where it helps. "
)
QUESTIONS = ["What is copyleft?", "Can I sell GPL software?", "What is the source code?", "Who is the licensor?"]


def _run(engine: LLMEngine, prompts: list[list[int]], params=GREEDY, sequential: bool = False) -> list[list[int]]:
    if not sequential:
        return _greedy_tokens_with(engine, prompts, params)
    return [_greedy_tokens_with(engine, [p], params, offset=i)[0] for i, p in enumerate(prompts)]


def _greedy_tokens_with(engine, prompts, params, offset=0):
    for i, ids in enumerate(prompts):
        engine.add_request(str(i + offset), ids, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    return [done[str(i + offset)] for i in range(len(prompts))]


@pytest.mark.parametrize("aligned", [True, False], ids=["prefix-multiple-of-block", "prefix-unaligned"])
def test_prefix_caching_keeps_greedy_outputs(smollm2_llm, aligned):
    tok = smollm2_llm.tokenizer
    system = tok.encode(SYSTEM)
    system = system[: (len(system) // 16) * 16] if aligned else system[: (len(system) // 16) * 16 + 5]
    prompts = [system + tok.encode(q) for q in QUESTIONS]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    reference = _run(engine_like(smollm2_llm, 256, 64, enable_prefix_caching=False), prompts, params)
    cached = engine_like(smollm2_llm, 256, 64)
    assert _run(cached, prompts, params, sequential=True) == reference
    stats = cached.get_stats()
    assert stats["prefix_cache_hits"] >= 3 * (len(system) // 16) * 16  # the later three reuse the system prompt
    # A full-prompt hit: the same prompt again computes only its last token.
    before = stats["prefix_cache_hits"]
    assert _run(cached, prompts[:1], params, sequential=True) == reference[:1]
    assert cached.get_stats()["prefix_cache_hits"] - before == ((len(prompts[0]) - 1) // 16) * 16


def test_prefix_caching_under_eviction_pressure(smollm2_llm):
    tok = smollm2_llm.tokenizer
    prompts = [tok.encode(SYSTEM + q) for q in QUESTIONS]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    reference = _run(engine_like(smollm2_llm, 256, 64, enable_prefix_caching=False), prompts, params)
    # 7 blocks hold one request at a time; cached blocks of earlier requests get evicted.
    small = engine_like(smollm2_llm, 7, 64)
    assert _run(small, prompts * 2, params, sequential=True) == reference * 2
    assert small.kv_cache_manager.block_pool.num_evictions > 0
    assert small.get_stats()["prefix_cache_hits"] > 0


def test_request_whose_prefix_was_evicted_while_waiting(smollm2_llm):
    tok = smollm2_llm.tokenizer
    first = tok.encode(SYSTEM + QUESTIONS[0])
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    reference = _run(engine_like(smollm2_llm, 256, 64, enable_prefix_caching=False), [first], params)
    engine = engine_like(smollm2_llm, 7, 64)
    assert _run(engine, [first], params) == reference  # its blocks are now cached (free)
    engine.add_request("late", first, params)  # waits: the filler below is admitted first
    engine.scheduler.waiting.insert(0, engine.scheduler.waiting.pop())
    filler = tok.encode("Completely different text about the sea and ships, sailing far away.")
    engine.add_request("filler", filler * 2, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    engine.scheduler.waiting.insert(0, engine.scheduler.waiting.pop())  # filler first, evicting
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert done["late"] == reference[0]
    assert engine.kv_cache_manager.block_pool.num_evictions > 0


def test_parallel_sampling_shares_prompt_blocks(smollm2_llm):
    engine = engine_like(smollm2_llm, 256, 64)
    prompt = smollm2_llm.tokenizer.encode(SYSTEM + QUESTIONS[1])
    engine.add_request("n4", prompt, SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=16, ignore_eos=True))
    prompt_blocks = -(-len(prompt) // 16)
    outputs = None
    used_after_fork = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if used_after_fork is None and out.outputs[0].token_ids:
                stats = engine.get_stats()
                used_after_fork = stats["num_total_blocks"] - stats["num_free_blocks"]
            if out.finished:
                outputs = [c.token_ids for c in out.outputs]
    assert used_after_fork == prompt_blocks  # four samples, one copy of the prompt
    assert len({tuple(o) for o in outputs}) == 4  # the samples differ
    # Sample i equals an independent request seeded with seed + i (copy-on-write is exact).
    for i, tokens in enumerate(outputs):
        single = _run(engine_like(smollm2_llm, 256, 64, enable_prefix_caching=False), [prompt],
                      SamplingParams(temperature=1.0, seed=5 + i, max_tokens=16, ignore_eos=True))
        assert single[0] == tokens


def test_seeded_parallel_sampling_is_reproducible(smollm2_llm):
    params = SamplingParams(n=3, temperature=0.9, top_p=0.9, seed=11, max_tokens=10)
    a = [c.token_ids for c in smollm2_llm.generate(PROMPTS[0], params)[0].outputs]
    b = [c.token_ids for c in smollm2_llm.generate([PROMPTS[1], PROMPTS[0]], params)[1].outputs]
    assert a == b and len(a) == 3


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_swap_preemption_keeps_outputs(smollm2_llm, policy):
    tok = smollm2_llm.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    reference = _run(engine_like(smollm2_llm, 256, 64, enable_prefix_caching=False), prompts)
    small = engine_like(smollm2_llm, 8, 64, enable_prefix_caching=False, num_cpu_blocks=64,
                         preemption_mode="swap", policy=policy)
    assert _run(small, prompts) == reference
    stats = small.get_stats()
    assert stats["num_swapped_out"] > 0
    assert small.kv_cache_manager.cpu_pool.num_free_blocks == 64


def test_beam_search_stops_at_the_context_end(smollm2_dir):
    """A prompt that leaves fewer than ``max_tokens`` in ``max_model_len``: the beams end
    there with "length", as ``generate`` does (the search failed at that step with "prompt
    is 64 tokens", the beam's length, not the prompt's); a ``beam_width`` past half the
    vocabulary is refused by its name (the error named ``logprobs``)."""
    from kvflow import LLM
    from kvflow.sampling_params import BeamSearchParams

    llm = LLM(model=str(smollm2_dir), dtype="float32", max_model_len=64, num_kv_blocks=64)
    ids = llm.get_tokenizer().encode("word " * 60)[:60]
    (result,) = llm.beam_search([{"prompt_token_ids": ids}], BeamSearchParams(beam_width=2, max_tokens=10, ignore_eos=True))
    assert len(result.sequences) == 2
    for seq in result.sequences:
        assert len(seq.tokens) == 64 and seq.tokens[:60] == ids and seq.finish_reason == "length"
    (short,) = llm.beam_search([{"prompt_token_ids": ids[:40]}], BeamSearchParams(beam_width=2, max_tokens=10, ignore_eos=True))
    assert all(len(seq.tokens) == 50 for seq in short.sequences)  # room left: max_tokens as asked
    with pytest.raises(ValueError, match="^beam_width must be at most half the vocabulary size"):
        llm.beam_search(["x"], BeamSearchParams(beam_width=10**5, max_tokens=2))
    stats = llm.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_beam_search_refuses_a_lora_request(smollm2_llm):
    from kvflow import LoRARequest

    with pytest.raises(ValueError, match=r"lora_request is not supported by kvflow \(here the base model runs"):
        smollm2_llm.beam_search(["x"], beam_width=2, max_tokens=2, lora_request=LoRARequest("a", 1, "/nowhere"))


def test_beam_search(smollm2_llm):
    (result,) = smollm2_llm.beam_search(["The capital of France is"], beam_width=3, max_tokens=6)
    seqs = result.sequences
    assert len(seqs) == 3
    assert [s.score for s in seqs] == sorted((s.score for s in seqs), reverse=True)
    assert len({tuple(s.token_ids) for s in seqs}) == 3
    # The best beam scores at least as well as greedy decoding (same length, no EOS here).
    greedy = smollm2_llm.generate("The capital of France is", SamplingParams(temperature=0.0, max_tokens=6, logprobs=0))[0]
    assert seqs[0].cumulative_logprob >= greedy.outputs[0].cumulative_logprob - 1e-4
    stats = smollm2_llm.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
