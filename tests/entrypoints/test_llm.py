"""Integration tests of the offline API on the real SmolLM2-135M-Instruct model (float32, CPU)."""

from __future__ import annotations

import pytest
import torch

from conftest import prefill_logits, requires_smollm2
from kvflow import SamplingParams
from kvflow.config import CacheConfig, SchedulerConfig
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

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


def _engine_like(llm, num_blocks: int, max_num_batched_tokens: int, max_num_seqs: int = 16) -> LLMEngine:
    """A fresh engine over the already loaded model (own cache and scheduler)."""
    src = llm.engine
    return LLMEngine(
        model=src.model_runner.model,
        model_config=src.model_config,
        cache_config=CacheConfig(src.cache_config.block_size, num_blocks, torch.float32),
        scheduler_config=SchedulerConfig(max_num_batched_tokens, max_num_seqs, src.scheduler_config.max_model_len),
        tokenizer=src.tokenizer,
        device=src.device,
    )


def _greedy_tokens(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, GREEDY)
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
    alone = [_greedy_tokens(_engine_like(smollm2_llm, 256, 2048), [p])[0] for p in prompts]
    for chunk in (1, 7, 16, 64, 4096):
        batched = _greedy_tokens(_engine_like(smollm2_llm, 256, chunk), prompts)
        assert batched == alone, f"max_num_batched_tokens={chunk}"


def test_preemption_keeps_outputs(smollm2_llm):
    tok = smollm2_llm.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    reference = _greedy_tokens(_engine_like(smollm2_llm, 256, 2048), prompts)
    small = _engine_like(smollm2_llm, num_blocks=8, max_num_batched_tokens=64)  # 128 slots for 4 requests
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
    (out,) = smollm2_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                              SamplingParams(temperature=0.0, max_tokens=64))
    assert "Paris" in out.outputs[0].text
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
    ],
)
def test_bad_input_raises_and_engine_keeps_serving(smollm2_llm, prompt, params, field):
    with pytest.raises(ValueError, match=field):
        smollm2_llm.generate([PROMPTS[0], prompt], params)
    assert not smollm2_llm.engine.has_unfinished_requests()  # nothing was queued
    (out,) = smollm2_llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4))
    assert len(out.outputs[0].token_ids) == 4


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -2}, "top_k"), ({"max_tokens": 0}, "max_tokens")],
)
def test_invalid_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
