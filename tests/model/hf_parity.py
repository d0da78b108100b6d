"""Helpers of the architecture parity tests: a tiny random transformers model saved as a
Hugging Face folder, kvflow loading it, and greedy decoding on both sides."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from kvflow import SamplingParams
from kvflow.engine.arg_utils import EngineArgs
from kvflow.engine.llm_engine import LLMEngine


def save_random_hf(model_cls, config: transformers.PretrainedConfig, path: Path, seed: int = 0, std: float = 0.2):
    """Build ``model_cls(config)`` with N(0, std) weights (norm weights 1 + N(0, 0.1)), save
    it to ``path`` (safetensors, per-expert tensors for MoE models) and return it in eval mode."""
    torch.manual_seed(seed)
    hf = model_cls(config)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, std)
    hf.save_pretrained(str(path))
    return hf.eval()


def hf_greedy(hf, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens of the transformers model (full forward per step, no cache) and, per
    step, the margin between its two best logits."""
    ids, margins = list(prompt), []
    with torch.inference_mode():
        for _ in range(max_tokens):
            logits = hf(torch.tensor([ids])).logits[0, -1]
            top = logits.topk(2).values
            margins.append(float(top[0] - top[1]))
            ids.append(int(logits.argmax()))
    return ids[len(prompt):], margins


def assert_greedy_matches(ours: list[int], ref: list[int], margins: list[float], near_tie: float = 1e-4) -> None:
    """Identical tokens, or a divergence only where transformers' top-2 logits are within
    ``near_tie`` of each other (a near-tie: float rounding may pick either)."""
    assert len(ours) == len(ref)
    for j, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            assert margins[j] < near_tie, f"diverged at token {j} with margin {margins[j]}: {ours} vs {ref}"
            return


def kvflow_engine(path: Path, **overrides) -> LLMEngine:
    """A float32 CPU engine over the folder: block size 4, chunked prefill of 16 tokens per
    step, prefix caching (overridable)."""
    args = dict(model=str(path), device="cpu", dtype="float32", block_size=4, num_kv_blocks=128,
                max_num_batched_tokens=16, max_num_seqs=8, enable_prefix_caching=True, seed=0)
    return LLMEngine.from_engine_args(EngineArgs(**{**args, **overrides}))


def run_greedy(engine: LLMEngine, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    """Submit all prompts at once (a mixed batch: prefill chunks next to decodes) and decode
    greedily to ``max_tokens`` each; request id -> tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return done


def assert_quantized_greedy_close(hf, path: Path, method: str, prompt: list[int], max_tokens: int = 16) -> float:
    """Greedy decoding of the ``method``-quantized kvflow model follows transformers' float
    greedy tokens up to, at most, a step where the float top-2 margin is below twice the
    quantization's typical logit error (the median over the prompt's tokens of the largest
    absolute logit difference, measured here): a divergence only at a near-tie at the
    scheme's precision. Returns that error."""
    from conftest import prefill_logits
    from kvflow.model.loader import load_model

    quant, _ = load_model(path, torch.float32, torch.device("cpu"), quantization=method)
    with torch.inference_mode():
        want = hf(torch.tensor([prompt])).logits[0]
    error = float((prefill_logits(quant, prompt, 8) - want).abs().amax(-1).median())
    ref, margins = hf_greedy(hf, prompt, max_tokens)
    ours = run_greedy(kvflow_engine(path, quantization=method), {"q": prompt}, max_tokens)["q"]
    assert_greedy_matches(ours, ref, margins, near_tie=2 * error)
    return error
