"""Single-stream decode of GGUF models with the fused C++ decode step on and off, in one run.

What it measures
----------------
For each model (default: SmolLM2-135M Q4_1 and Qwen2.5-Coder-0.5B as packaged, served as
stored: ``LLM(model=...)``), greedy single-stream generation of ``--new-tokens`` tokens after a
short prompt, decode tokens per second (the new tokens past the first / the time past the
first token), with the fused decode step (``kvflow.layers.fused_decode``: the whole decoder in
one C++ call per step) and without it (the PyTorch path: one GGUF kernel call per linear and
~30 other calls per layer), alternating ``--repeats`` times in the same process so that a
changing background load hits both alike; a cell is the median. The same fused layers called
once per layer (``FusedDecodeStep.per_layer``) show what one call for all layers saves. The two paths' greedy tokens
are compared too (they agree up to a flipped int8 rounding, which can change a near-tie).

llama.cpp's single stream on the same file in the same run: ``python -m benchmarks.compare
--engines kvflow-gguf,llamacpp`` (its ``stream`` columns).

How to run
----------
    python -m benchmarks.fused_decode                                 # both models
    python -m benchmarks.fused_decode --models smollm2-135m --repeats 5
    python -m benchmarks.fused_decode --models smollm2-135m --batch-sizes 2 4 8 16   # where it stops paying

Prints a table and writes ``--out`` (default ``benchmarks/results/fused_decode.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from benchmarks.common import format_table, machine_info
from kvflow.layers import fused_decode
from kvflow.layers import gguf_kernels as gk

PROMPT = "The history of the printing press begins"


def measure(model_name: str, new_tokens: int, repeats: int, batch_sizes: list[int]) -> dict:
    """Decode tok/s with the fused step and without, alternating ``repeats`` times, single
    stream; then for each batch size B > 1 (B requests at once: decode steps of B tokens)."""
    from kvflow import LLM, SamplingParams

    llm = LLM(model=model_name)
    rec = _measure_single(llm, model_name, new_tokens, repeats)
    rec["batched"] = [_measure_batch(llm, b, new_tokens, repeats) for b in batch_sizes if b > 1]
    return rec


def _measure_batch(llm, batch: int, new_tokens: int, repeats: int) -> dict:
    """Output tok/s of ``batch`` greedy requests at once, fused (past ``MAX_DECODE_TOKENS`` rows in
    slices, as the engine runs it) against the PyTorch path."""
    from kvflow import SamplingParams

    model = llm.engine.model_runner.model
    step = model.__dict__["fused_decode"]
    prompts = [f"{PROMPT} (part {i})" for i in range(batch)]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rates: dict[bool, list[float]] = {True: [], False: []}
    try:
        for _ in range(repeats):
            for fused in (True, False):
                model.__dict__["fused_decode"] = step if fused else None
                t0 = time.perf_counter()
                llm.generate(prompts, first, use_tqdm=False)
                t1 = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                t2 = time.perf_counter()
                rates[fused].append(batch * (new_tokens - 1) / max((t2 - t1) - (t1 - t0), 1e-9))
    finally:
        model.__dict__["fused_decode"] = step
    on, off = statistics.median(rates[True]), statistics.median(rates[False])
    return {"batch": batch, "fused_tok_s": on, "pytorch_tok_s": off, "ratio": on / off}


def _measure_single(llm, model_name: str, new_tokens: int, repeats: int) -> dict:
    from kvflow import SamplingParams

    model = llm.engine.model_runner.model
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)  # warm-up, binds
    step = model.__dict__.get("fused_decode")
    if not isinstance(step, fused_decode.FusedDecodeStep):
        raise SystemExit(f"{model_name}: no fused decode step ({fused_decode.refusal(model) or 'kernel unavailable'})")

    def run(fused: bool) -> tuple[float, list[int]]:
        model.__dict__["fused_decode"] = step if fused else None
        t0 = time.perf_counter()
        llm.generate([PROMPT], first, use_tqdm=False)
        t1 = time.perf_counter()
        out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
        t2 = time.perf_counter()
        # decode time: the whole generation minus a one-token one (prefill + first token)
        return (new_tokens - 1) / max((t2 - t1) - (t1 - t0), 1e-9), list(out)

    rates: dict[bool, list[float]] = {True: [], False: []}
    per_layer: list[float] = []
    tokens: dict[bool, list[int]] = {}
    for _ in range(repeats):
        for fused in (True, False):
            rate, toks = run(fused)
            rates[fused].append(rate)
            tokens[fused] = toks
        step.per_layer = True  # the same fused layers, one C++ call each
        per_layer.append(run(True)[0])
        step.per_layer = False
    model.__dict__["fused_decode"] = step
    on, off = statistics.median(rates[True]), statistics.median(rates[False])
    same = next((i for i, (a, b) in enumerate(zip(tokens[True], tokens[False])) if a != b), len(tokens[True]))
    return {"model": model_name, "fused_tok_s": on, "pytorch_tok_s": off, "ratio": on / off,
            "fused_per_layer_tok_s": statistics.median(per_layer),
            "fused_ms_per_token": 1e3 / on, "pytorch_ms_per_token": 1e3 / off,
            "greedy_tokens_equal": same, "new_tokens": new_tokens,
            "runs": {"fused": rates[True], "pytorch": rates[False], "fused_per_layer": per_layer}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.fused_decode", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-0.5b"])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-sizes", nargs="*", type=int, default=[],
                    help="also B requests at once (decode steps of B tokens), e.g. 2 4 8 16: where the fused step stops paying")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/fused_decode.json"))
    args = ap.parse_args(argv)
    rows, records = [], []
    for name in args.models:
        rec = measure(name, args.new_tokens, args.repeats, args.batch_sizes)
        records.append(rec)
        rows.append([name, 1, rec["pytorch_tok_s"], rec["fused_tok_s"], rec["ratio"], rec["fused_per_layer_tok_s"],
                     rec["pytorch_ms_per_token"], rec["fused_ms_per_token"],
                     f"{rec['greedy_tokens_equal']}/{rec['new_tokens']}"])
        for b in rec["batched"]:
            rows.append([name, b["batch"], b["pytorch_tok_s"], b["fused_tok_s"], b["ratio"], "", "", "", ""])
    print(f"# single-stream decode, GGUF as stored, kernel ISA {gk.kernel_isa()} (median of {args.repeats}, alternating)")
    print(format_table(["model", "streams", "PyTorch path tok/s", "fused tok/s", "ratio", "fused, a call per layer",
                        "ms/token", "fused ms/token", "greedy equal"], rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": {**machine_info(), "isa": gk.kernel_isa()}, "results": records}, indent=1))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
