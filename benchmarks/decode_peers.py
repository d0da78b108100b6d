"""Single-stream decode and a 512-token prefill: kvflow offline against llama.cpp's ``llama-bench``.

What it measures
----------------
For each GGUF model, on the same file and the same number of threads, alternated round by
round in one run (so both meet the machine in the same state):

* llama.cpp: ``llama-bench -m FILE -t THREADS -p 0 -n TOKENS -r 1`` (``tg``: tokens generated
  one at a time from an empty context) and ``-p PREFILL -n 0`` (``pp``: one prompt of
  ``--prefill`` tokens), its reported tokens per second;
* kvflow: ``LLM(model=FILE)`` at its defaults (the GGUF weights computed as stored), greedy,
  EOS ignored: decode = (time of a ``TOKENS``-token request - time of a 1-token request) /
  (``TOKENS`` - 1) after an 8-token prompt, both in the same round; prefill = the time of one
  request of ``--prefill`` random prompt tokens and 1 output token (prefix caching off, so
  every round prefills).

The table gives the medians over ``--rounds`` (after a warm-up round of each), tokens per
second, and kvflow / llama.cpp. Offline only: the served comparison (HTTP, the same load
generator for both) is ``benchmarks/serve_peers.py``.

How to run
----------
    python -m benchmarks.decode_peers --llama-bench /path/to/llama.cpp/build/bin/llama-bench \\
        --models smollm2-135m qwen2.5-coder-0.5b qwen2.5-coder-1.5b

Prints one table and writes ``--out`` (JSON) with every round.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import time
from pathlib import Path

import torch

from benchmarks.common import format_table, machine_info


def llama_bench(binary: str, gguf: str, threads: int, prompt: int, gen: int) -> float:
    """llama-bench's tokens per second of one test (``-p prompt -n gen``, one repetition)."""
    cmd = [binary, "-m", gguf, "-t", str(threads), "-p", str(prompt), "-n", str(gen), "-r", "1", "-o", "json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1800).stdout
    return float(json.loads(out)[0]["avg_ts"])


def gguf_path(model: str) -> str:
    """The GGUF file kvflow serves for ``model`` (a path, or a packaged short name)."""
    from kvflow.model.resolve import gguf_file

    path = gguf_file(model)
    if path is None:
        raise SystemExit(f"{model}: not a GGUF file or a packaged GGUF model")
    return str(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.decode_peers", description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-bench", required=True, help="llama.cpp's llama-bench binary")
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128, help="tokens a decode request generates")
    ap.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill test")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/decode_peers.json"))
    args = ap.parse_args(argv)

    from kvflow import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()[0]
    rows, record = [], {}
    for model in args.models:
        path = gguf_path(model)
        llm = LLM(model=path, max_model_len=2048, enable_prefix_caching=False)
        vocab = llm.engine.config.model.vocab_size
        rng = random.Random(0)
        prompt = [rng.randrange(100, vocab - 100) for _ in range(8)]

        def timed(ids: list[int], n: int) -> float:
            params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            t = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
            assert len(out[0].outputs[0].token_ids) == n
            return time.perf_counter() - t

        runs: dict[str, list[float]] = {"kvflow_tg": [], "llama_tg": [], "kvflow_pp": [], "llama_pp": []}
        for r in range(args.rounds + 1):
            tg = llama_bench(args.llama_bench, path, args.threads, 0, args.tokens)
            pp = llama_bench(args.llama_bench, path, args.threads, args.prefill, 0)
            k_tg = (args.tokens - 1) / (timed(prompt, args.tokens) - timed(prompt, 1))
            long_prompt = [rng.randrange(100, vocab - 100) for _ in range(args.prefill)]
            k_pp = args.prefill / timed(long_prompt, 1)
            if r:  # the first round warms up
                for key, v in (("llama_tg", tg), ("llama_pp", pp), ("kvflow_tg", k_tg), ("kvflow_pp", k_pp)):
                    runs[key].append(v)
        med = {k: statistics.median(v) for k, v in runs.items()}
        rows.append([model, f"{med['kvflow_tg']:.1f}", f"{med['llama_tg']:.1f}", f"{med['kvflow_tg'] / med['llama_tg']:.2f}x",
                     f"{med['kvflow_pp']:.0f}", f"{med['llama_pp']:.0f}", f"{med['kvflow_pp'] / med['llama_pp']:.2f}x"])
        record[model] = {"gguf": path, "rounds": runs, "medians": med}
        del llm
        gc.collect()
    from kvflow.layers.gguf_kernels import kernel_isa

    info = machine_info()
    print(f"# single stream, offline, {args.threads} threads; decode: {args.tokens} tokens a request; prefill: one "
          f"{args.prefill}-token prompt; medians of {args.rounds} alternated rounds (after a warm-up); CPU "
          f"{info['cpu_model']} ({' '.join(info['cpu_isa'])}); kvflow's GGUF kernel: {kernel_isa()}, ISA caps "
          f"{info['isa_caps'] or 'none'}; llama-bench {args.llama_bench}; 1-minute load average {load_start:.2f} at the "
          f"start, {os.getloadavg()[0]:.2f} at the end (this run's threads included)")
    print(format_table(["model", "kvflow decode tok/s", "llama.cpp tg tok/s", "ratio",
                        f"kvflow pp{args.prefill} tok/s", f"llama.cpp pp{args.prefill} tok/s", "ratio"], rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": info, "kvflow_gguf_kernel_isa": kernel_isa(), "args": {k: str(v) for k, v in vars(args).items()},
                                    "load_average_1min": [load_start, os.getloadavg()[0]],
                                    "results": record}, indent=1))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
