"""Sampling cost: the ``Sampler`` on its own, and served-style offline runs that sample.

What it measures
----------------
* **The sampler** (``--skip-sampler`` to leave it out). ``Sampler(logits, tensors)`` on float32
  logits of N rows x V columns for each (rows, vocabulary) in ``--shapes`` and each setting:
  ``temp`` (temperature 0.7), ``top-p`` (0.7 and top_p 0.9), ``top-k`` (0.7 and top_k 50),
  ``qwen`` (Qwen2.5's generation defaults: 0.7, top_p 0.8, top_k 20), and two kinds of
  logits: ``lm`` (a language model's shape: logit = -1.1 ln(rank) over a random permutation
  of the vocabulary, plus N(0, 0.1) noise per row: at 0.7 the nucleus of top_p 0.9 holds ~30
  tokens) and ``flat`` (N(0, 1) logits: the nucleus holds most of the vocabulary, the
  filter's worst case). Median ms per call over ``--repeats`` calls, 2 threads.
* **End to end** (``--e2e MODEL``): ``LLM.generate`` of ``--num-prompts`` requests (windows of
  real text, prompts of 128-384 tokens, 64-192 output tokens, ``ignore_eos``) with
  ``--max-num-seqs`` in flight, sampled with the ``--e2e-settings`` (default ``greedy``,
  ``top-p`` and ``qwen``; request i seeded with i, so that runs repeat); output tok/s of the timed call (the model loaded and warmed up
  first).

Each checkout runs in its own subprocess (``PYTHONPATH=<checkout>``): with ``--baseline-repo
PATH`` (e.g. ``git worktree add ../kvflow-base <commit>``) the baseline's ``kvflow`` first, then
this one's, alternated ``--rounds`` times; the table keeps each case's best round and gives
this checkout's speedup over the baseline.

How to run
----------
    python -m benchmarks.sampling --baseline-repo ../kvflow-base
    python -m benchmarks.sampling --baseline-repo ../kvflow-base --skip-sampler \\
        --e2e smollm2-135m --max-num-seqs 32

Prints the tables, the CPU and its vector ISA, and writes every number to ``--out`` (default
``benchmarks/results/sampling.json``; not tracked by git).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: name -> (temperature, top_p, top_k); top_k 0 is off.
SETTINGS = {
    "greedy": (0.0, 1.0, 0),
    "temp": (0.7, 1.0, 0),
    "top-p": (0.7, 0.9, 0),
    "top-k": (0.7, 1.0, 50),
    "qwen": (0.7, 0.8, 20),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sampling", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["16x151936", "32x49152", "64x151936"],
                   help="rows x vocabulary of the sampler calls (default: %(default)s)")
    p.add_argument("--settings", nargs="+", default=["temp", "top-p", "top-k", "qwen"], choices=sorted(SETTINGS))
    p.add_argument("--repeats", type=int, default=5, help="calls per case, median kept (default: %(default)s)")
    p.add_argument("--skip-sampler", action="store_true", help="only the end-to-end runs")
    p.add_argument("--e2e", metavar="MODEL", help="also generate with this model (e.g. smollm2-135m)")
    p.add_argument("--e2e-settings", nargs="+", default=["greedy", "top-p", "qwen"], choices=sorted(SETTINGS))
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--baseline-repo", type=Path, help="an older checkout, measured in the same run")
    p.add_argument("--rounds", type=int, default=1, help="alternations baseline / current (default: %(default)s)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/results/sampling.json")
    p.add_argument("--child", choices=["sampler", "e2e"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for s in args.shapes:
        n, _, v = s.partition("x")
        if not (n.isdigit() and v.isdigit() and int(n) > 0 and int(v) > 0):
            raise SystemExit(f"--shapes: expected ROWSxVOCAB with positive integers, got {s!r}")
    for name in ("repeats", "num_prompts", "max_num_seqs", "rounds"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1")
    if args.skip_sampler and not args.e2e:
        raise SystemExit("--skip-sampler without --e2e measures nothing")
    return args


def lm_logits(n: int, vocab: int, seed: int) -> "torch.Tensor":
    """Logits shaped like a language model's: -1.1 ln(rank) over a random permutation, plus
    N(0, 0.1) per element."""
    import torch

    g = torch.Generator().manual_seed(seed)
    base = -1.1 * torch.log(torch.arange(1, vocab + 1, dtype=torch.float32))
    rows = [base[torch.randperm(vocab, generator=g)] for _ in range(n)]
    return torch.stack(rows) + 0.1 * torch.randn(n, vocab, generator=g)


def sampler_child(args: argparse.Namespace) -> list[dict]:
    import torch

    from kvflow.sample.sampler import Sampler, SamplingTensors

    torch.set_num_threads(2)
    sampler = Sampler(torch.Generator().manual_seed(0))
    out = []
    for shape in args.shapes:
        n, v = map(int, shape.split("x"))
        for kind in ("lm", "flat"):
            logits = lm_logits(n, v, 0) if kind == "lm" else torch.randn(n, v, generator=torch.Generator().manual_seed(1))
            for name in args.settings:
                temperature, top_p, top_k = SETTINGS[name]
                st = SamplingTensors(temperature=torch.full((n,), temperature),
                                     top_k=torch.full((n,), top_k if 0 < top_k < v else v, dtype=torch.int64),
                                     top_p=torch.full((n,), top_p), min_p=torch.zeros(n), generators=[None] * n)
                sampler(logits, st)  # warm-up
                times = []
                for _ in range(args.repeats):
                    t = time.perf_counter()
                    sampler(logits, st)
                    times.append(1e3 * (time.perf_counter() - t))
                out.append({"shape": shape, "logits": kind, "setting": name, "ms": statistics.median(times)})
    return out


def e2e_child(args: argparse.Namespace) -> list[dict]:
    from kvflow import LLM, SamplingParams

    from benchmarks.common import make_workload

    llm = LLM(model=args.e2e, max_num_seqs=args.max_num_seqs, enable_prefix_caching=False)
    requests = make_workload(llm.get_tokenizer(), args.num_prompts, 0, (128, 384), (64, 192))
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    out = []
    for name in args.e2e_settings:
        temperature, top_p, top_k = SETTINGS[name]
        params = [SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=r.output_len,
                                 ignore_eos=True, seed=i) for i, r in enumerate(requests)]
        llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
        t = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        if tokens != sum(r.output_len for r in requests):
            raise RuntimeError(f"{name}: {tokens} output tokens, expected {sum(r.output_len for r in requests)}")
        out.append({"setting": name, "seconds": dt, "output_tokens": tokens, "tok_s": tokens / dt})
    return out


def run_checkout(repo: Path, args: argparse.Namespace, child: str) -> list[dict]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", child, "--shapes", *args.shapes,
            "--settings", *args.settings, "--repeats", str(args.repeats), "--e2e-settings", *args.e2e_settings,
            "--num-prompts", str(args.num_prompts), "--max-num-seqs", str(args.max_num_seqs)]
    if args.e2e:
        argv += ["--e2e", args.e2e]
    # (the script by its path, from the checkout: that checkout's kvflow and benchmarks.common)
    env = dict(os.environ, PYTHONPATH=str(repo), KVFLOW_CPU_KERNEL_BUILD="wait")
    proc = subprocess.run(argv, cwd=repo, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{child} run of {repo} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def best(rounds: list[list[dict]], key: tuple[str, ...], value: str, lower: bool) -> dict[tuple, float]:
    """Each case's best value over the rounds."""
    out: dict[tuple, float] = {}
    for rows in rounds:
        for row in rows:
            k = tuple(row[x] for x in key)
            v = row[value]
            out[k] = v if k not in out else (min(out[k], v) if lower else max(out[k], v))
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(sampler_child(args) if args.child == "sampler" else e2e_child(args)))
        return
    from benchmarks.common import format_table, machine_info

    info = machine_info()
    print(f"CPU: {info.get('cpu_model')}; ISA: {' '.join(info.get('cpu_isa') or [])}")
    checkouts = ([("baseline", args.baseline_repo.resolve())] if args.baseline_repo else []) + [("current", REPO)]
    children = ([] if args.skip_sampler else ["sampler"]) + (["e2e"] if args.e2e else [])
    raw: dict[str, dict[str, list]] = {c: {label: [] for label, _ in checkouts} for c in children}
    for r in range(args.rounds):
        for child in children:
            for label, repo in checkouts:
                t = time.perf_counter()
                raw[child][label].append(run_checkout(repo, args, child))
                print(f"round {r + 1}/{args.rounds}: {child}, {label} ({repo}) in {time.perf_counter() - t:.0f} s",
                      flush=True)
    result = {"machine": info, "args": {k: str(v) for k, v in vars(args).items()}, "raw": raw, "tables": {}}
    if "sampler" in children:
        key = ("shape", "logits", "setting")
        cur = best(raw["sampler"]["current"], key, "ms", lower=True)
        base = best(raw["sampler"]["baseline"], key, "ms", lower=True) if args.baseline_repo else {}
        rows = [[*k, base.get(k), v, (base[k] / v) if k in base else None] for k, v in cur.items()]
        print("\nSampler(logits, tensors), ms per call (median of --repeats; best round)")
        print(format_table(["rows x vocab", "logits", "setting", "baseline ms", "ms", "speedup"], rows))
        result["tables"]["sampler"] = rows
    if "e2e" in children:
        cur = best(raw["e2e"]["current"], ("setting",), "tok_s", lower=False)
        base = best(raw["e2e"]["baseline"], ("setting",), "tok_s", lower=False) if args.baseline_repo else {}
        rows = [[k[0], base.get(k), v, (v / base[k]) if k in base else None] for k, v in cur.items()]
        print(f"\n{args.e2e}, {args.num_prompts} requests, {args.max_num_seqs} in flight: output tok/s (best round)")
        print(format_table(["setting", "baseline tok/s", "tok/s", "speedup"], rows))
        result["tables"]["e2e"] = rows
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
