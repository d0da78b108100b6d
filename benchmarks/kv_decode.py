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

``--kernel`` times the attention kernel alone instead, on a noisy machine the steadier number:
``paged_attention_quantized`` (int8 and fp8 codes) over ``--streams`` one-token decodes of
``--prompt-len`` keys each, SmolLM2's shape (9 query heads, 3 KV heads, head dim 64) and a
Qwen2.5-0.5B-like one (14 / 2 / 64), blocks of 16 scattered over the pool; next to it the
bfloat16 cache's ``paged_decode_attention`` on the same shape; with ``--baseline-repo`` the
baseline checkout's ``paged_attention.cpp`` built as a separate extension and called on the
same tensors, alternated with this one's in one process (median of ``--rounds`` x 7 batches
of 20 calls), its outputs checked equal to this one's bit for bit.

How to run
----------
    python -m benchmarks.kv_decode                                        # SmolLM2, 32 streams
    python -m benchmarks.kv_decode --baseline-repo ../kvflow-main --rounds 3
    python -m benchmarks.kv_decode --kernel --baseline-repo ../kvflow-main

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
    p.add_argument("--kernel", action="store_true", help="time the attention kernel alone (see the docstring)")
    p.add_argument("--threads", type=int, default=2, help="torch threads with --kernel (default: %(default)s)")
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


KERNEL_SHAPES = [("smollm2", 9, 3, 64), ("qwen2.5-0.5b", 14, 2, 64)]  # (name, query heads, KV heads, head dim)


def load_attention_kernel(repo: Path | None):
    """The paged-attention extension of this checkout (None) or of ``repo`` (its
    ``kvflow/ops/csrc/paged_attention.cpp``, built as a separate extension).

    Raises:
        ValueError: when repo has no such source, or a build fails.
    """
    from kvflow.ops import PAGED_ATTENTION
    from kvflow.ops.build import CppKernel

    if repo is None:
        module = PAGED_ATTENTION.require()
    else:
        source = Path(repo).resolve() / "kvflow" / "ops" / "csrc" / "paged_attention.cpp"
        if not source.is_file():
            raise ValueError(f"--baseline-repo: {source} does not exist")
        module = CppKernel("kvflow_cpu_paged_attention_baseline", source, "KVFLOW_CPU_ATTENTION",
                           "baseline paged-attention kernel", includes=("vec_exp.h",)).load()
    if module is None:
        raise ValueError(f"the paged-attention kernel of {repo or REPO} could not be built (see the log)")
    return module


def kernel_bench(args: argparse.Namespace) -> None:
    """``--kernel``: the quantized-cache attention kernel alone (see the module docstring)."""
    import torch

    from kvflow.attention.cpu_attention import _CODE_FORMATS, _code_table

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    ours = load_attention_kernel(None)
    base = load_attention_kernel(Path(args.baseline_repo)) if args.baseline_repo else None
    gen = torch.Generator().manual_seed(0)
    bs, B, ctx = 16, args.streams, args.prompt_len
    rows, records = [], []

    def timed(fns: dict) -> dict[str, float]:
        times = {name: [] for name in fns}
        for r in range(args.rounds * 7):
            for name in (list(fns) if r % 2 == 0 else list(reversed(fns))):
                t = time.perf_counter()
                for _ in range(20):
                    fns[name]()
                times[name].append((time.perf_counter() - t) / 20 * 1e3)
        return {name: statistics.median(v) for name, v in times.items()}

    for shape, H, KV, D in KERNEL_SHAPES:
        per_req = (ctx + bs - 1) // bs
        pool = B * per_req + 8
        tables = torch.randperm(pool, generator=gen)[: B * per_req].view(B, per_req).contiguous()
        starts = torch.arange(B + 1, dtype=torch.int32)
        ctxs = torch.full((B,), ctx, dtype=torch.int32)
        q = torch.randn(B, H, D, generator=gen)
        k16, v16 = (torch.randn(pool, bs, KV, D, generator=gen).bfloat16() for _ in range(2))
        q16 = q.bfloat16()
        ref = timed({"bf16": lambda: ours.paged_decode_attention(q16, k16, v16, tables, ctxs, D**-0.5)})["bf16"]
        rows.append([shape, "bfloat16 (paged_decode_attention)", f"{ref:.3f}", "1.00x", "-"])
        records.append({"shape": shape, "kv": "bfloat16", "ms": ref})
        for dtype in (torch.int8, torch.float8_e4m3fn):
            codes = [torch.randint(0, 256, (pool, bs, KV, D), dtype=torch.uint8, generator=gen) for _ in range(2)]
            if dtype == torch.float8_e4m3fn:
                for c in codes:
                    c[(c & 0x7F) == 0x7F] = 0  # (no NaN codes: quantize_kv never writes them)
            scales = [(torch.rand(pool, bs, KV, generator=gen) * 0.02 + 1e-3).half() for _ in range(2)]
            call = (q, codes[0], codes[1], scales[0], scales[1], _code_table(dtype), tables, starts, ctxs, D**-0.5,
                    _CODE_FORMATS[dtype])
            fns = {"current": lambda: ours.paged_attention_quantized(*call)}
            if base is not None:
                if not torch.equal(ours.paged_attention_quantized(*call), base.paged_attention_quantized(*call)):
                    raise RuntimeError(f"{shape} {dtype}: this checkout's output differs from the baseline's")
                fns["baseline"] = lambda: base.paged_attention_quantized(*call)
            ms = timed(fns)
            name = "int8" if dtype == torch.int8 else "fp8"
            speedup = ms["baseline"] / ms["current"] if base is not None else None
            rows.append([shape, name, f"{ms['current']:.3f}", f"{ms['current'] / ref:.2f}x",
                         "-" if speedup is None else f"{speedup:.2f}x ({ms['baseline']:.3f} ms)"])
            records.append({"shape": shape, "kv": name, "ms": ms, "vs_bf16": ms["current"] / ref,
                            "speedup_vs_baseline": speedup, "bit_identical_to_baseline": base is not None})
    info = machine_info()
    print(f"\nattention kernel, {B} one-token decodes x {ctx} keys, {args.threads} threads, median of "
          f"{args.rounds * 7} x 20 calls; CPU: {info.get('cpu_model')} ISA: {' '.join(info.get('cpu_isa') or [])}; "
          f"load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after (the run's own threads included)")
    print(format_table(["shape", "KV cache", "ms a call", "x bfloat16", "speedup x baseline (its ms)"], rows))
    if base is not None:
        print("outputs equal to the baseline's bit for bit")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": info, "args": vars(args), "load_average": [load_before, os.getloadavg()[0]],
                               "kernel": records}, indent=2))
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child is not None:
        return child(args)
    if args.kernel:
        return kernel_bench(args)
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
