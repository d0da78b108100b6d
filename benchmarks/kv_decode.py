"""Decode steps over a quantized (int8 / fp8) KV cache against the model-dtype cache.

What it measures
----------------
One engine per KV cache dtype (``--kv-dtypes``, ``auto`` = the model's dtype) of ``--model``,
each in its own subprocess: ``--streams`` requests of ``--prompt-len`` random prompt tokens
decode together (greedy, ``ignore_eos``). A decode step's time is (the time of a request batch
with ``--tokens`` output tokens - the time of the same batch with one output token) /
(``--tokens`` - 1): the prefill cancels out. Each round runs every (checkout, dtype) once, in
turn; the table keeps each one's median over ``--rounds`` rounds, and its ratio to the
model-dtype cache of the same checkout. With ``--baseline-repo PATH`` (an older checkout)
the same runs go through that checkout's ``kvflow`` too (``PYTHONPATH=PATH``), alternated
with this one's in every round, and the table adds this checkout's speedup over it.

How to run
----------
    python -m benchmarks.kv_decode                                        # SmolLM2, 32 streams
    python -m benchmarks.kv_decode --baseline-repo ../kvflow-main --rounds 3

Prints a table, the CPU and its vector ISA, and writes every number to ``--out`` (default
``benchmarks/results/kv_decode.json``; not tracked by git).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import format_table, machine_info

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kv_decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--kv-dtypes", default="auto,int8,fp8", help="comma-separated kv_cache_dtype values")
    p.add_argument("--streams", type=int, default=32, help="requests decoding together (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=384, help="random prompt tokens each (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=65, help="output tokens of the timed batch (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="(default: %(default)s)")
    p.add_argument("--baseline-repo", default=None, help="an older checkout, measured alternately")
    p.add_argument("--out", default="benchmarks/results/kv_decode.json")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: the kv dtype to measure
    return p.parse_args(argv)


def child(args: argparse.Namespace) -> None:
    """One engine, one measurement: prints {"step_ms": ...} as JSON."""
    import random

    from kvflow import LLM, SamplingParams

    llm = LLM(model=args.model, max_num_seqs=args.streams, enable_prefix_caching=False,
              kv_cache_dtype=args.child)
    import kvflow

    print(f"# kvflow from {Path(kvflow.__file__).parent}", file=sys.stderr)
    rng = random.Random(0)
    hi = min(20000, len(llm.get_tokenizer()))  # ordinary tokens of any vocabulary
    lo = min(100, hi // 2)

    def batch():
        return [{"prompt_token_ids": [rng.randrange(lo, hi) for _ in range(args.prompt_len)]}
                for _ in range(args.streams)]

    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    many = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    llm.generate(batch(), many, use_tqdm=False)  # warm-up
    t = time.perf_counter()
    llm.generate(batch(), one, use_tqdm=False)
    t1 = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate(batch(), many, use_tqdm=False)
    t2 = time.perf_counter() - t
    print(json.dumps({"step_ms": (t2 - t1) / (args.tokens - 1) * 1e3}), flush=True)


def measure(repo: Path, kv_dtype: str, args: argparse.Namespace) -> float:
    # (the script by its path from a neutral directory: `-m` from REPO would put REPO's kvflow
    # first on sys.path, ahead of PYTHONPATH's checkout)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", kv_dtype, "--model", args.model,
           "--streams", str(args.streams), "--prompt-len", str(args.prompt_len), "--tokens", str(args.tokens)]
    # (kernels built before the engine starts: a checkout's first build can outlast the warm-up)
    env = dict(os.environ, PYTHONPATH=f"{repo}{os.pathsep}{REPO}", KVFLOW_CPU_KERNEL_BUILD="wait")
    with tempfile.TemporaryDirectory() as cwd:
        done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{repo} kv_cache_dtype={kv_dtype} failed:\n{done.stderr[-2000:]}")
    where = [line for line in done.stderr.splitlines() if line.startswith("# kvflow from ")]
    if not where or not where[-1].endswith(str(repo / "kvflow")):
        raise RuntimeError(f"the child imported kvflow from {where[-1] if where else '?'}, not {repo}")
    return json.loads(lines[-1])["step_ms"]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child is not None:
        return child(args)
    dtypes = [d.strip() for d in args.kv_dtypes.split(",") if d.strip()]
    if args.tokens < 2 or args.streams < 1 or args.rounds < 1 or not dtypes:
        raise ValueError("--tokens >= 2, --streams >= 1, --rounds >= 1 and at least one --kv-dtypes entry")
    checkouts = {"current": REPO}
    if args.baseline_repo:
        checkouts["baseline"] = Path(args.baseline_repo).resolve()
    times: dict[tuple[str, str], list[float]] = {(c, d): [] for c in checkouts for d in dtypes}
    load_before = os.getloadavg()[0]
    for r in range(args.rounds):
        order = list(checkouts) if r % 2 == 0 else list(reversed(checkouts))
        for c in order:
            for d in dtypes:
                times[(c, d)].append(measure(checkouts[c], d, args))
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    load_after = os.getloadavg()[0]  # (1-minute load averages; the runs' own threads count)
    med = {k: statistics.median(v) for k, v in times.items()}
    rows, records = [], []
    for c in checkouts:
        for d in dtypes:
            ref = med.get((c, dtypes[0]))
            vs_base = med[("baseline", d)] / med[(c, d)] if c == "current" and "baseline" in checkouts else None
            rows.append([c, d, f"{med[(c, d)]:.1f}", f"{args.streams * 1e3 / med[(c, d)]:.0f}",
                         f"{med[(c, d)] / ref:.2f}x", "-" if vs_base is None else f"{vs_base:.2f}x"])
            records.append({"checkout": c, "kv_cache_dtype": d, "step_ms": times[(c, d)], "median_ms": med[(c, d)],
                            "vs_first_dtype": med[(c, d)] / ref, "speedup_vs_baseline": vs_base})
    info = machine_info()
    print(f"\n{args.model}, {args.streams} streams x {args.prompt_len}-token prompts, "
          f"median of {args.rounds} rounds; CPU: {info.get('cpu_model')} ISA: {' '.join(info.get('cpu_isa') or [])}; "
          f"load average {load_before:.2f} before, {load_after:.2f} after (the runs' own threads included)")
    print(format_table(["checkout", "kv cache", "step ms", "tok/s", f"step x {dtypes[0]}", "speedup x baseline"], rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": info, "args": vars(args), "load_average": [load_before, load_after],
                                "results": records}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
