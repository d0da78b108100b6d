"""The engine's host work per step: a model so small that its forward is nearly free.

What it measures
----------------
A random-weight Llama of 2 layers, hidden size 64 (4 query heads, 2 KV heads, head_dim 16),
with SmolLM2's tokenizer and vocabulary (49152 tokens, so that the LM head and the sampler
see real row widths), loaded through ``LLM(model=<folder>)`` in float32. For each batch size
(default 1, 64, 128, 256 concurrent sequences, ``--prompt-len`` random prompt tokens each,
greedy, ``ignore_eos``) the engine prefills every request, runs ``--warmup`` decode steps,
then times ``--steps`` decode steps of ``engine.step()``. Per size: steps/s, the step's wall
time, steps per second of the process's CPU time (``CPU steps/s``, all its threads: on a
shared machine the time other processes held the core is not in it; with ``--threads 1`` it
is the step's own work), the model forward's time (a forward pre/post hook on the runner's
model), the LM head's (``compute_logits``), and the share of the step outside the model forward (the
engine's host work with the sampler: scheduling, input preparation, sampling, outputs),
"host ms", the step less the forward and the LM head, and "GC ms", the garbage collector's
part of it (``gc.callbacks``; "longest GC ms": its longest collection, a full one's stall).
Then a cProfile pass
of ``--profile-steps`` steps splits the host work by function (ms per step, cumulative),
for the functions named in ``PROFILE_FUNCTIONS`` and the top functions by own time.

Each size of each checkout runs in a fresh process (``--child``), so that no size inherits
the heap an earlier one left behind. The garbage collector is left as the offline ``LLM``
leaves it: since 2026-12-06 an engine freezes the heap while it has requests in flight
(``KVFLOW_GC_FREEZE``), so its full collections skip the startup heap; an older checkout's
full collection (~160 ms of this model's process) lands in one size's timed window or
another: ``--steps`` larger than the default spreads it as a long run does.

With ``--baseline-repo PATH`` (a checkout of an older commit, e.g. ``git worktree add
../kvflow-base 8311660``) the same measurement runs first in a subprocess with
``PYTHONPATH=PATH`` (that checkout's ``kvflow``), then on this checkout, in the same
invocation; the table gives each size's steps/s of both and their ratio. ``--compare-repo
LABEL=PATH`` (repeatable) measures further checkouts in the same rounds (e.g. ``main=`` a
checkout of the branch point, to see that a change slows no size down). ``--rounds R``
alternates the checkouts R times and keeps each size's best round (a shared machine's load
hits them alike).

How to run
----------
    python -m benchmarks.host_overhead                                     # this checkout only
    python -m benchmarks.host_overhead --baseline-repo ../kvflow-base      # against a baseline
    python -m benchmarks.host_overhead --sizes 128 --steps 8 --attention-backend cpu

Prints a table, the CPU model and its vector ISA, and writes every number to ``--out``
(default ``benchmarks/results/host_overhead.json``; not tracked by git).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: Functions whose cumulative time per step the profile reports (matched on the function's
#: name, with its file's last two path parts).
PROFILE_FUNCTIONS = (
    "step", "schedule", "update", "execute", "update_states", "prepare_inputs", "build_metadata", "decode_groups",
    "split_by_context", "_run", "_sample", "apply_logits_processors", "from_requests", "compute_logits", "forward",
    "_make_output", "_append_output", "_text_stop", "record", "_propose",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.host_overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1,64,128,256", help="concurrent sequences, comma-separated (default: %(default)s)")
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per size (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="untimed decode steps per size (default: %(default)s)")
    p.add_argument("--profile-steps", type=int, default=4,
                   help="decode steps under cProfile per size, after the timed ones; 0: no profile (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request (default: %(default)s)")
    p.add_argument("--vocab-size", type=int, default=49152, help="model vocabulary (default: SmolLM2's, %(default)s)")
    p.add_argument("--attention-backend", default="torch", help="EngineArgs.attention_backend (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=1, help="alternations baseline/current; best kept (default: %(default)s)")
    p.add_argument("--baseline-repo", default=None, help="a checkout of the baseline commit (its kvflow is measured too)")
    p.add_argument("--compare-repo", action="append", default=[], metavar="LABEL=PATH",
                   help="another checkout measured in the same rounds, in rows labelled LABEL (repeatable), "
                        "e.g. main=../kvflow-main")
    p.add_argument("--out", default="benchmarks/results/host_overhead.json")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: model folder; run and print JSON
    args = p.parse_args(argv)
    try:
        args.size_list = [int(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        p.error(f"--sizes must be comma-separated integers, got {args.sizes!r}")
    if not args.size_list or min(args.size_list) < 1:
        p.error("--sizes must list integers >= 1")
    for name in ("steps", "threads", "rounds", "prompt_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0 or args.profile_steps < 0:
        p.error("--warmup and --profile-steps must be >= 0")
    if args.baseline_repo is not None and not (Path(args.baseline_repo) / "kvflow" / "__init__.py").is_file():
        p.error(f"--baseline-repo {args.baseline_repo!r} holds no kvflow package")
    args.compare = {}
    for entry in args.compare_repo:
        label, sep, path = entry.partition("=")
        if not sep or not label or label in ("baseline", "current") or label in args.compare:
            p.error(f"--compare-repo takes LABEL=PATH with a new label other than baseline/current, got {entry!r}")
        if not (Path(path) / "kvflow" / "__init__.py").is_file():
            p.error(f"--compare-repo {entry!r}: {path!r} holds no kvflow package")
        args.compare[label] = Path(path).resolve()
    return args


def cpu_facts() -> dict:
    """CPU model, logical CPUs and the vector ISA extensions the CPU reports (/proc/cpuinfo)."""
    model, flags = None, set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model is None:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16") if f in flags]
    return {"cpu_model": model, "cpu_count": os.cpu_count(), "isa": isa}


def make_model_dir(path: Path, vocab_size: int) -> Path:
    """A random 2-layer, hidden-64 Llama with SmolLM2's tokenizer files, saved in ``path``."""
    import torch
    import transformers

    from kvflow.model.resolve import resolve_model

    tokenizer_dir = Path(resolve_model("smollm2-135m"))
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, path / name)
    return path


# --- the measurement, run in a child process per checkout ------------------------------------


def _find_runner(engine, depth: int = 3):
    """The engine's model runner (``engine.model_runner`` or one nested a few attributes deep)."""
    seen, frontier = set(), [engine]
    for _ in range(depth + 1):
        nxt = []
        for obj in frontier:
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            runner = getattr(obj, "model_runner", None)
            if runner is not None:
                return runner
            for name in ("engine_core", "core", "worker", "executor", "driver_worker", "engine"):
                child = getattr(obj, name, None)
                if child is not None:
                    nxt.append(child)
        frontier = nxt
    raise RuntimeError("no model_runner found under the engine")


class ForwardTimer:
    """Times the runner's model forward (pre/post hooks) and its LM head (``compute_logits``)."""

    def __init__(self, model) -> None:
        self.forward_s = 0.0
        self.lm_head_s = 0.0
        self._t0 = 0.0
        model.register_forward_pre_hook(self._pre)
        model.register_forward_hook(self._post)
        inner = model.compute_logits

        def compute_logits(*a, **k):
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                self.lm_head_s += time.perf_counter() - t0

        model.compute_logits = compute_logits

    def _pre(self, module, args) -> None:
        self._t0 = time.perf_counter()

    def _post(self, module, args, output) -> None:
        self.forward_s += time.perf_counter() - self._t0

    def reset(self) -> None:
        self.forward_s = self.lm_head_s = 0.0


class CollectorTimer:
    """A ``gc.callbacks`` entry: the seconds spent in the garbage collector's collections,
    the longest one, and how many of each generation ran."""

    def __init__(self) -> None:
        self.seconds = self.longest = 0.0
        self.counts = {0: 0, 1: 0, 2: 0}
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        took = time.perf_counter() - self._t0
        self.seconds += took
        self.longest = max(self.longest, took)
        self.counts[info["generation"]] += 1


def _profile(engine, steps: int) -> dict:
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, callers)
    named, own = {}, []
    for (file, _line, name), (_cc, nc, tottime, cumtime, _callers) in stats.items():
        where = "/".join(Path(file).parts[-2:])
        key = f"{where}:{name}"
        if name in PROFILE_FUNCTIONS and "kvflow" in file:
            named[key] = {"cum_ms_per_step": 1000 * cumtime / steps, "calls_per_step": nc / steps}
        own.append((tottime, key, nc))
    own.sort(reverse=True)
    return {
        "steps": steps,
        "named": dict(sorted(named.items(), key=lambda kv: -kv[1]["cum_ms_per_step"])),
        "top_own": [{"function": k, "own_ms_per_step": 1000 * t / steps, "calls_per_step": nc / steps}
                    for t, k, nc in own[:15]],
    }


def run_child(args: argparse.Namespace) -> dict:
    import kvflow  # noqa: F401 - before torch: kvflow's OpenMP wait policy applies
    import torch

    from kvflow import LLM
    from kvflow.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    block_size = 16
    results = {"kvflow": str(Path(kvflow.__file__).resolve().parents[1]), "sizes": {}}
    for n in args.size_list:
        max_tokens = args.warmup + args.steps + args.profile_steps + 4
        blocks_per_seq = -(-(args.prompt_len + max_tokens) // block_size)
        llm = LLM(model=args.child, dtype="float32", block_size=block_size, num_kv_blocks=n * blocks_per_seq + 8,
                  max_num_seqs=n, max_num_batched_tokens=max(2048, args.prompt_len), max_step_seconds=0,
                  max_model_len=args.prompt_len + max_tokens + block_size, seed=0,
                  attention_backend=args.attention_backend, enforce_eager=True)  # fmt: skip
        engine = llm.engine
        runner = _find_runner(engine)
        timer = ForwardTimer(runner.model)
        gen = torch.Generator().manual_seed(n)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for i in range(n):
            prompt = torch.randint(3, args.vocab_size, (args.prompt_len,), generator=gen).tolist()
            engine.add_request(f"r{i}", prompt, params)
        # Prefill: until every request has its first token (all decode from then on).
        started: set[str] = set()
        for _ in range(10 * n + 10):
            for out in engine.step():
                started.add(out.request_id)
            if len(started) == n:
                break
        for _ in range(args.warmup):
            engine.step()
        timer.reset()
        collector = CollectorTimer()
        gc.callbacks.append(collector)
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(args.steps):
            engine.step()
        wall = time.perf_counter() - t0
        cpu = time.process_time() - c0
        gc.callbacks.remove(collector)
        step_ms = 1000 * wall / args.steps
        forward_ms = 1000 * timer.forward_s / args.steps
        lm_head_ms = 1000 * timer.lm_head_s / args.steps
        entry = {
            "steps": args.steps,
            "steps_per_s": args.steps / wall,
            # the process's CPU time (all its threads): on a shared machine, the time others
            # took the core away is not in it (with --threads 1 it is the step's own work)
            "cpu_steps_per_s": args.steps / cpu if cpu > 0 else None,
            "cpu_step_ms": 1000 * cpu / args.steps,
            "step_ms": step_ms,
            "forward_ms": forward_ms,
            "lm_head_ms": lm_head_ms,
            "outside_forward_ms": step_ms - forward_ms,
            "outside_forward_share": (step_ms - forward_ms) / step_ms,
            # the engine's host work: neither the decoder forward nor the LM head
            "host_ms": step_ms - forward_ms - lm_head_ms,
            # the garbage collector's own time in the timed steps (part of the host work)
            "gc_ms": 1000 * collector.seconds / args.steps,
            "gc_longest_ms": 1000 * collector.longest,
            "gc_collections": collector.counts,
            "attention_backend": getattr(runner, "attention_backend", None).name
            if getattr(runner, "attention_backend", None) is not None else None,
        }
        if args.profile_steps:
            entry["profile"] = _profile(engine, args.profile_steps)
        results["sizes"][str(n)] = entry
        engine.shutdown() if hasattr(engine, "shutdown") else None
        del llm, engine, runner, timer
        # The timer's wrapper and hooks hold the model in reference cycles: collect them now.
        # Left to the collector, the previous size's engine slowed the next size's steps
        # (256 sequences after 128 in one process: 33 ms of CPU a step instead of 15-20).
        gc.collect()
    return results


# --- the parent: one child per checkout, the table and the JSON ------------------------------


def _run_checkout(repo: Path, model_dir: Path, argv: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=str(repo), KVFLOW_CPU_KERNEL_BUILD="wait", KVFLOW_CPU_ADAPTIVE_THREADS="0")
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--child", str(model_dir)]
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the measurement of {repo} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _measure_checkout(repo: Path, model_dir: Path, args: argparse.Namespace) -> dict:
    """Every size of one checkout, each in a process of its own: measured one after the other
    in one process, a size paid for what the previous ones left (on a quiet machine the
    baseline's first size ran 53 steps/s at 128 sequences measured first and 97 measured
    after 256; the cyclic garbage collector's full collections, 160-170 ms each, land in
    one 16-step window or another)."""
    merged: dict = {}
    for n in args.size_list:
        result = _run_checkout(repo, model_dir, _child_argv(args, str(n)))
        merged = {**result, "sizes": {**merged.get("sizes", {}), **result["sizes"]}}
    return merged


def _child_argv(args: argparse.Namespace, sizes: str) -> list[str]:
    return ["--sizes", sizes, "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--profile-steps", str(args.profile_steps), "--prompt-len", str(args.prompt_len),
            "--vocab-size", str(args.vocab_size), "--attention-backend", args.attention_backend,
            "--threads", str(args.threads)]  # fmt: skip


def _best(rounds: list[dict]) -> dict:
    best = dict(rounds[0])
    best["sizes"] = {}
    for size in rounds[0]["sizes"]:
        best["sizes"][size] = max((r["sizes"][size] for r in rounds), key=lambda e: e["steps_per_s"])
    return best


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        print(json.dumps(run_child(args)))
        return 0
    from benchmarks.common import format_table, machine_info

    facts = cpu_facts()
    print(f"CPU: {facts['cpu_model']} ({facts['cpu_count']} logical CPUs); ISA: {' '.join(facts['isa']) or 'none'}; "
          f"torch threads per run: {args.threads}", flush=True)
    checkouts = {**args.compare, "current": REPO}
    if args.baseline_repo is not None:
        checkouts = {"baseline": Path(args.baseline_repo).resolve(), **checkouts}
    runs: dict[str, list[dict]] = {name: [] for name in checkouts}
    with tempfile.TemporaryDirectory(prefix="kvflow-host-overhead-") as tmp:
        model_dir = make_model_dir(Path(tmp), args.vocab_size)
        for r in range(args.rounds):
            for name, repo in checkouts.items():
                t0 = time.perf_counter()
                runs[name].append(_measure_checkout(repo, model_dir, args))
                print(f"round {r + 1}/{args.rounds}: {name} ({repo}) measured in {time.perf_counter() - t0:.0f} s",
                      flush=True)
    best = {name: _best(rs) for name, rs in runs.items()}
    # each size's best CPU-time rate over the rounds (its own best round, not the wall-time one's)
    best_cpu = {name: {size: max((r["sizes"][size].get("cpu_steps_per_s") or 0.0 for r in rs), default=0.0) or None
                       for size in rs[0]["sizes"]} for name, rs in runs.items()}
    headers = ["checkout", "seqs", "steps/s", "step ms", "forward ms", "LM head ms", "outside fwd ms",
               "outside share", "host ms", "GC ms", "longest GC ms", "x baseline", "host x", "CPU steps/s", "CPU x"]
    rows = []
    for size in (str(n) for n in args.size_list):
        for name in checkouts:
            e = best[name]["sizes"][size]
            ratio = host_ratio = cpu_ratio = None
            cpu_rate = best_cpu[name][size]
            if "baseline" in best and name != "baseline":
                base = best["baseline"]["sizes"][size]
                ratio = e["steps_per_s"] / base["steps_per_s"]
                host_ratio = base["host_ms"] / e["host_ms"] if e["host_ms"] > 0 else None
                base_cpu = best_cpu["baseline"][size]
                cpu_ratio = cpu_rate / base_cpu if cpu_rate and base_cpu else None
            rows.append([name, int(size), e["steps_per_s"], e["step_ms"], e["forward_ms"], e["lm_head_ms"],
                         e["outside_forward_ms"], f"{100 * e['outside_forward_share']:.0f} %", e["host_ms"],
                         e.get("gc_ms"), e.get("gc_longest_ms"),
                         f"{ratio:.2f}x" if ratio is not None else None,
                         f"{host_ratio:.2f}x" if host_ratio is not None else None,
                         cpu_rate, f"{cpu_ratio:.2f}x" if cpu_ratio is not None else None])
    print()
    print(format_table(headers, rows))
    if args.profile_steps:
        for name in checkouts:
            size = str(max(args.size_list))
            prof = best[name]["sizes"][size].get("profile")
            if not prof:
                continue
            print(f"\n{name}, {size} sequences: cumulative ms per step (cProfile, {prof['steps']} steps)")
            print(format_table(["function", "ms/step", "calls/step"],
                               [[k, v["cum_ms_per_step"], v["calls_per_step"]] for k, v in prof["named"].items()]))
    record = {"args": {k: v for k, v in vars(args).items() if k not in ("child", "size_list", "compare")},
              "machine": {**machine_info(), **facts}, "best": best, "best_cpu_steps_per_s": best_cpu, "rounds": runs}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
