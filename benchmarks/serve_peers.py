"""kvflow's OpenAI server against vLLM's CPU build and llama.cpp's ``llama-server``, each driven
by the same external load generator (``vllm bench serve``), one engine at a time.

What it measures
----------------
Each engine's own server is started as a subprocess on 127.0.0.1 with ``--threads`` CPU
threads, waited for (``GET /v1/models``), and driven by ``vllm bench serve`` (vLLM's load
generator: none of the three engines' code) with the random dataset, a fixed seed, greedy
sampling (``--temperature`` / ``--top-p`` send a chat client's sampling instead) and
``--ignore-eos``, so every engine gets the same prompts and generates exactly the requested
number of tokens. Scenarios (``--scenarios``):

* ``concurrent4`` / ``concurrent16`` / ``concurrent32``: 64 prompts of 128-384 tokens, outputs
  of 64-192 tokens (``--random-input-len 256 --random-output-len 128 --random-range-ratio
  0.5``), at most 4 / 16 / 32 requests in flight;
* ``single``: 4 prompts of 32 tokens, 128 output tokens each, one at a time;
* ``prefill512``: 4 prompts of 512 tokens, 4 output tokens each, one at a time: its TTFT is
  the time to prefill a 512-token prompt.

A scenario listed twice (``--scenarios concurrent16,concurrent16``) runs again on the same
server with the same prompts, reported as ``concurrent16#2``: the prefix cache's share.

Every scenario draws its own prompts (seed ``--seed`` + the scenario's number in
``SCENARIOS``): the scenarios run one after the other on the same server, and with one seed
for all of them a later scenario sent the same 64 prompts again, so that its TTFT measured
the engine's prefix cache (whether 64 prompts + outputs fit in it) instead of its prefill.

Start-up (unless ``--no-starts``): before its scenarios each engine is started twice more
and stopped, measuring the seconds from the process start to ``/v1/models`` answering
(``ready_s``) and to the first token of a 1-token completion (``first_token_s``) and the peak
RSS meanwhile: a **cold** start (kvflow: with an empty model cache, ``--model-cache-dir`` a
fresh folder, so the config and tokenizer are read from the GGUF file; llama-server: its
first start in the run) and a **warm** start (kvflow: the cache the cold start filled). Both
read the GGUF file from the page cache (the file is read once before), and the C++ kernels
are already built (``python -m kvflow.ops.build`` or a first run builds them: about 85 s for
the GGUF kernel, once per machine). After the run the cache folder is checked: the files
kvflow wrote there (``cache_files``) must be config and tokenizer files only, no weights.
kvflow's engines are given the GGUF file path (the file llama-server gets), not the packaged
short name, so that a split package's one-time assembly into the cache is not counted.

Per engine and scenario: completed / failed requests, output tokens/s, TTFT (mean, p99),
TPOT (mean, p99), ITL p99, all as ``vllm bench serve`` reports them (its ``--save-result``
JSON, kept whole in the output file), the server's peak resident memory (``peak_rss_mib``: the
largest sum of RSS over the server's process tree, sampled every 0.5 s while the load
generator runs), and the CPU that other processes took meanwhile
(``other_load_cores``: all CPUs' busy time minus the server's and the load generator's process
trees, per wall second; near 0 means the run had the machine to itself; 1 on a 2-core machine
means another job held a core and the numbers are not data).

Engines (``--engines``):

* ``kvflow``: ``kvflow serve`` with ``--dtype`` (default bfloat16) and ``--quantization none`` (the
  GGUF file dequantized to float weights);
* ``kvflow-int4``: the same with ``--quantization int4 --lm-head-quantization int8``;
* ``kvflow-default``: ``kvflow serve`` with no dtype or quantization flag (what a user gets: a
  GGUF model computed as stored, ``quantization="gguf"``);
* ``vllm``: ``vllm serve`` of the vLLM CPU build (``--vllm`` is the command, e.g. a wrapper
  script that sets ``VLLM_CPU_OMP_THREADS_BIND`` and ``VLLM_CPU_KVCACHE_SPACE``; see
  docs/benchmarks.md) on the model's Hugging Face folder (kvflow's GGUF conversion), same
  ``--dtype``;
* ``llama-server``: llama.cpp's server (``--llama-server`` is the binary) on the GGUF file as
  stored (Q4_1 for ``smollm2-135m``), ``-np`` = the largest concurrency of the scenarios, a
  unified KV cache (``-kvu``) of ``-c`` = ``--kv-tokens`` tokens (default: that concurrency
  x 1024, at least 4,096), ``-t``/``-tb`` = ``--threads``.

**The same KV capacity**: kvflow's engines get ``--num-kv-blocks`` = ``--kv-tokens`` / 16
(16-token blocks), so kvflow and llama-server hold the same number of tokens of K/V (kvflow
in the model dtype or its ``--kv-cache-dtype``, llama-server in f16); the tables print it.
vLLM's KV space is set by its wrapper (``VLLM_CPU_KVCACHE_SPACE``) and is not matched.

How to run
----------
    python -m benchmarks.serve_peers --engines kvflow,vllm,llama-server \\
        --vllm /path/to/vllm-wrapper.sh --llama-server /path/to/llama-server
    python -m benchmarks.serve_peers --engines kvflow --scenarios single   # quick

``vllm bench serve`` comes from ``--bench`` (default: the ``--vllm`` command). Prints one table
per scenario (and the ratios of each engine to the first one) and writes every number to
``--out`` (JSON, default ``benchmarks/results/serve_peers.json``) and a bar chart to
``--plot`` (PNG, needs matplotlib). Start it on an idle machine: ``--wait-idle`` seconds (default
60) are spent waiting for the CPUs to be < 10 % busy before each engine starts.

A baseline in the same run (``--baseline DIR``): every kvflow engine E also runs as
``E@base`` from the kvflow checkout DIR (its ``kvflow`` package first on ``PYTHONPATH``), just
before E, e.g. ``git worktree add ../kvflow-base main`` and ``--baseline ../kvflow-base``.
Its server starts in that checkout (``python -m`` puts the working directory first on the
path), and each checkout's C++ kernels are built before its engine is measured
(``build_kernels``: their build names hash the checkout's include paths).

Served against offline (``--offline``): before each kvflow engine's server starts, the same
engine (the server command's own engine arguments, from the same checkout) runs the
``single`` scenario's stream offline (``benchmarks/peers/offline_single.py``: 32 random prompt
tokens, 128 greedy tokens through ``LLM.generate_stream``, median of 3 after a warm-up), and a
table puts its decode rate next to the served one (1000 / mean TPOT: both leave the first
token out) with their ratio.

Contention (``--background-load N``): N processes that each keep one core busy (a pure
Python loop at normal priority) run from the moment an engine's server is ready until its
last scenario ends, so every engine meets the same fixed load; ``other_load_cores`` then
reads about N, and the tables compare the engines under it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import format_table, machine_info, wait_for_idle

REPO_ROOT = Path(__file__).resolve().parent.parent

SCENARIOS: dict[str, dict[str, Any]] = {
    "concurrent4": {"num_prompts": 64, "input_len": 256, "output_len": 128, "range_ratio": 0.5, "concurrency": 4},
    "concurrent16": {"num_prompts": 64, "input_len": 256, "output_len": 128, "range_ratio": 0.5, "concurrency": 16},
    "concurrent32": {"num_prompts": 64, "input_len": 256, "output_len": 128, "range_ratio": 0.5, "concurrency": 32},
    "single": {"num_prompts": 4, "input_len": 32, "output_len": 128, "range_ratio": 0.0, "concurrency": 1},
    "prefill512": {"num_prompts": 4, "input_len": 512, "output_len": 4, "range_ratio": 0.0, "concurrency": 1},
}
KV_BLOCK_SIZE = 16  # kvflow's default --block-size
ENGINES = ("kvflow", "kvflow-int4", "kvflow-default", "vllm", "llama-server")
# Keys of vllm bench serve's result JSON shown in the table (its names).
SHOWN = ("completed", "failed", "output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms",
         "p99_itl_ms")  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default="kvflow,vllm,llama-server", help=f"comma-separated, of {', '.join(ENGINES)}")
    p.add_argument("--scenarios", default="concurrent16,single", help=f"comma-separated, of {', '.join(SCENARIOS)}")
    p.add_argument("--model", default="smollm2-135m", help="a kvflow model (packaged short name or GGUF path)")
    p.add_argument("--dtype", default="bfloat16", help="kvflow's and vLLM's dtype")
    p.add_argument("--threads", type=int, default=2, help="CPU threads of every engine")
    p.add_argument("--vllm", default="vllm", help="the vllm command (a wrapper script may set its CPU env)")
    p.add_argument("--bench", default=None, help="the command whose `bench serve` is the load generator "
                                                 "(default: --vllm)")  # fmt: skip
    p.add_argument("--llama-server", default="llama-server", help="llama.cpp's llama-server binary")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for a server (vLLM compiles)")
    p.add_argument("--wait-idle", type=float, default=60.0, help="max seconds to wait for an idle CPU before each engine")
    p.add_argument("--background-load", type=int, default=0, metavar="N",
                   help="cores kept busy by N spinning processes while each engine is measured (contention)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=ENGINE:ARGS",
                   help="an engine under another name with extra server arguments, e.g. "
                        "'kvflow-nostep=kvflow-default:--max-step-seconds 0'; NAME then goes in --engines")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="every request's temperature (default: 0, greedy); with --top-p, what a chat client sends")
    p.add_argument("--top-p", type=float, default=None, help="every request's top_p (default: not sent)")
    p.add_argument("--kv-tokens", type=int, default=None, metavar="N",
                   help="KV cache capacity in tokens of every kvflow engine and llama-server (default: the largest "
                        "concurrency x 1024, at least 4096)")
    p.add_argument("--baseline", type=Path, default=None, metavar="DIR",
                   help="a kvflow checkout: each kvflow engine E also runs from it, as E@base (before E)")
    p.add_argument("--offline", action="store_true",
                   help="before each kvflow engine's server starts, time the same engine offline on the single "
                        "scenario's stream (benchmarks/peers/offline_single.py) and print served against offline")
    p.add_argument("--no-starts", dest="starts", action="store_false",
                   help="skip the cold and warm start measurements")
    p.add_argument("--step-trace", type=Path, default=None, metavar="DIR",
                   help="trace every engine step of kvflow and vLLM (benchmarks/peers/step_trace) into "
                        "DIR/<engine>.<pid>.jsonl and keep each server's /metrics after each scenario in "
                        "DIR/<engine>-<scenario>.metrics; summarize with python -m benchmarks.peers.step_report")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "serve_peers.json")
    p.add_argument("--plot", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "serve_peers.png")
    args = p.parse_args(argv)
    args.engines = [e for e in args.engines.split(",") if e]
    args.variants = {}
    for v in args.variant:
        name, sep, rest = v.partition("=")
        base, sep2, extra = rest.partition(":")
        if not (sep and sep2 and name) or base not in ENGINES or name in ENGINES:
            p.error(f"--variant: expected NAME=ENGINE:ARGS with ENGINE one of {', '.join(ENGINES)}, got {v!r}")
        args.variants[name] = (base, shlex.split(extra))
    if args.baseline is not None:
        if not (args.baseline / "kvflow" / "__init__.py").is_file():
            p.error(f"--baseline: {args.baseline} is not a kvflow checkout (no kvflow/__init__.py)")
        args.baseline = args.baseline.resolve()
        args.engines = [name for e in args.engines
                        for name in ([f"{e}@base", e] if _is_kvflow(e, args.variants) else [e])]
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    if not (0.0 <= args.temperature <= 100.0):
        p.error(f"--temperature: expected 0-100, got {args.temperature}")
    if args.top_p is not None and not (0.0 < args.top_p <= 1.0):
        p.error(f"--top-p: expected (0, 1], got {args.top_p}")
    if args.kv_tokens is not None and args.kv_tokens < KV_BLOCK_SIZE:
        p.error(f"--kv-tokens: at least {KV_BLOCK_SIZE}, got {args.kv_tokens}")
    for e in args.engines:
        e = e.removesuffix("@base")
        if e not in ENGINES and e not in args.variants:
            p.error(f"--engines: unknown engine {e!r} (known: {', '.join(ENGINES)})")
    for s in args.scenarios:
        if s not in SCENARIOS:
            p.error(f"--scenarios: unknown scenario {s!r} (known: {', '.join(SCENARIOS)})")
    return args


def _is_kvflow(engine: str, variants: dict[str, tuple[str, list[str]]]) -> bool:
    return (variants[engine][0] if engine in variants else engine).startswith("kvflow")


def server_root(engine: str, args: argparse.Namespace) -> Path:
    """The kvflow checkout ``engine`` runs from: ``--baseline`` for an ``@base`` engine, else this one."""
    return args.baseline if engine.endswith("@base") else REPO_ROOT


def server_cwd(engine: str, args: argparse.Namespace) -> Path | None:
    """The working directory of ``engine``'s processes: ``--baseline`` for an ``@base`` engine,
    else the caller's (None)."""
    return args.baseline if engine.endswith("@base") else None


def server_env(engine: str, args: argparse.Namespace) -> dict[str, str]:
    """The server's environment: this checkout (an ``@base`` engine: ``--baseline``'s) first
    on ``PYTHONPATH``. An ``@base`` server also starts in that checkout (``server_cwd``): ``python -m``
    puts the working directory before ``PYTHONPATH``, so started from this checkout an
    ``@base`` server would import this checkout's ``kvflow``."""
    root = server_root(engine, args)
    return dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_files(model: str, with_weights: bool = True) -> tuple[Path, Path | None]:
    """(Hugging Face folder, GGUF file or None) of a kvflow model name or path. The folder
    holds weights (a float32 conversion of a GGUF file, for vLLM) only ``with_weights``;
    else it is kvflow's config + tokenizer folder (the load generator's tokenizer)."""
    from kvflow.model.resolve import gguf_file, hf_checkpoint_dir, resolve_model

    return (hf_checkpoint_dir(model) if with_weights else resolve_model(model)), gguf_file(model)


def kv_tokens(args: argparse.Namespace, max_concurrency: int) -> int:
    """The KV capacity in tokens every kvflow engine and llama-server get (``--kv-tokens``)."""
    return args.kv_tokens or max(4096, max_concurrency * 1024)


def server_command(engine: str, args: argparse.Namespace, hf_dir: Path, gguf: Path | None, port: int,
                   max_concurrency: int) -> list[str]:  # fmt: skip
    """The command line that starts ``engine``'s OpenAI-compatible server on ``port`` (an
    ``@base`` engine: the same command, run from ``--baseline``, ``server_env``)."""
    engine = engine.removesuffix("@base")
    if engine in getattr(args, "variants", {}):
        base, extra = args.variants[engine]
        return [*server_command(base, args, hf_dir, gguf, port, max_concurrency), *extra]
    host = ["--host", "127.0.0.1", "--port", str(port)]
    if engine.startswith("kvflow"):
        dtype = [] if engine == "kvflow-default" else ["--dtype", args.dtype]
        model = str(gguf) if gguf is not None else args.model  # the file llama-server gets
        blocks = -(-kv_tokens(args, max_concurrency) // KV_BLOCK_SIZE)
        cmd = [sys.executable, "-m", "kvflow.entrypoints.cli", "serve", "--model", model, *dtype,
               "--num-threads", str(args.threads), "--served-model-name", "model", "--log-level", "warning",
               "--num-kv-blocks", str(blocks), *host]  # fmt: skip
        if getattr(args, "model_cache_dir", None) is not None:
            cmd += ["--model-cache-dir", str(args.model_cache_dir)]
        if engine == "kvflow-int4":
            cmd += ["--quantization", "int4", "--lm-head-quantization", "int8"]
        elif engine == "kvflow":  # the file dequantized to --dtype weights (kvflow-default computes it as stored)
            cmd += ["--quantization", "none"]
        return cmd
    if engine == "vllm":
        return [*shlex.split(args.vllm), "serve", str(hf_dir), "--served-model-name", "model", "--dtype", args.dtype,
                "--max-model-len", "8192", *host]  # fmt: skip
    if gguf is None:
        raise ValueError(f"llama-server needs a GGUF file; {args.model!r} has none")
    return [args.llama_server, "-m", str(gguf), "-np", str(max_concurrency), "-kvu", "-c",
            str(kv_tokens(args, max_concurrency)), "-t", str(args.threads), "-tb", str(args.threads), *host]  # fmt: skip


def wait_ready(proc: subprocess.Popen, url: str, timeout_s: float, log_path: Path) -> float:
    """Seconds until ``GET /v1/models`` answers 200.

    Raises:
        RuntimeError: the server exited or did not answer within ``timeout_s`` seconds.
    """
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}); see {log_path}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"server not ready after {timeout_s:.0f} s; see {log_path}")


def first_token(url: str, timeout_s: float) -> float:
    """Seconds a 1-token completion takes to return (streamed: to its first chunk).

    Raises:
        RuntimeError: the server answered an error.
    """
    t0 = time.monotonic()
    body = {"model": "model", "prompt": "Hello, my name is", "max_tokens": 1, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout_s) as r:
        if r.status_code != 200:
            raise RuntimeError(f"first completion: HTTP {r.status_code}: {r.read()[:500]!r}")
        for line in r.iter_lines():
            if line.startswith("data:") and line.strip() != "data: [DONE]":
                return time.monotonic() - t0
    raise RuntimeError("first completion: no token streamed")


def measure_start(engine: str, args: argparse.Namespace, hf_dir: Path, gguf: Path | None, workdir: Path,
                  label: str) -> dict[str, Any]:  # fmt: skip
    """Start ``engine``'s server, time it to ready and to its first token (sampling the peak
    RSS of its process tree meanwhile), stop it. ``label`` (cold / warm) names its log.

    Returns:
        ``ready_s``, ``first_token_s`` (both from the process start), ``peak_rss_mib``, or
        ``error`` with the log's tail.
    """
    port = _free_port()
    max_concurrency = max(SCENARIOS[s]["concurrency"] for s in args.scenarios)
    cmd = server_command(engine, args, hf_dir, gguf, port, max_concurrency)
    log_path = workdir / f"{engine}-{label}-start.log"
    url = f"http://127.0.0.1:{port}"
    env = server_env(engine, args)
    result: dict[str, Any] = {"server_command": shlex.join(cmd)}
    peak = [0.0]
    with open(log_path, "wb") as log:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                cwd=server_cwd(engine, args))
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _tree_rss_mib(proc.pid))
            done.wait(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited ({proc.returncode}); see {log_path}")
            if time.monotonic() - t0 > args.startup_timeout:
                raise RuntimeError(f"server not ready after {args.startup_timeout:.0f} s; see {log_path}")
            try:
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        result["ready_s"] = time.monotonic() - t0
        first_token(url, args.startup_timeout)
        result["first_token_s"] = time.monotonic() - t0
    except (RuntimeError, httpx.HTTPError) as exc:
        result["error"] = str(exc)
        result["server_log_tail"] = log_path.read_text(errors="replace")[-3000:] if log_path.is_file() else None
    finally:
        done.set()
        sampler.join()
        stop(proc)
    result["peak_rss_mib"] = peak[0]
    return result


def measure_starts(engine: str, args: argparse.Namespace, hf_dir: Path, gguf: Path | None,
                   workdir: Path) -> dict[str, Any]:  # fmt: skip
    """A cold start then a warm one (module docstring); for kvflow the files its cold start
    wrote to the model cache (``cache_files``: name -> bytes)."""
    starts: dict[str, Any] = {}
    if _is_kvflow(engine.removesuffix("@base"), getattr(args, "variants", {})):
        args.model_cache_dir = Path(tempfile.mkdtemp(prefix=f"cold-{engine}-", dir=workdir))
    wait_for_idle(args.wait_idle)
    starts["cold"] = measure_start(engine, args, hf_dir, gguf, workdir, "cold")
    wait_for_idle(args.wait_idle)
    starts["warm"] = measure_start(engine, args, hf_dir, gguf, workdir, "warm")
    if getattr(args, "model_cache_dir", None) is not None:
        starts["cache_files"] = cache_files(args.model_cache_dir)
    return starts


def cache_files(cache_dir: Path) -> dict[str, int]:
    """Relative path -> bytes of every file under kvflow's model cache folder ``cache_dir``."""
    return {str(p.relative_to(cache_dir)): p.stat().st_size for p in sorted(cache_dir.rglob("*")) if p.is_file()}


def weights_in_cache(files: dict[str, int]) -> list[str]:
    """The files of ``cache_files`` that hold weights (safetensors, .bin, .pt, .gguf)."""
    return [name for name in files if name.endswith((".safetensors", ".bin", ".pt", ".pth", ".gguf"))]


def stop(proc: subprocess.Popen) -> None:
    """SIGINT (all three servers shut down cleanly on it), then SIGKILL after 60 s."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def _tree(pid: int) -> list:
    """psutil processes of ``pid`` and its live children ([] if it is gone)."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _tree_sum(pid: int, read) -> float:
    """Sum of ``read(process)`` over ``pid``'s tree, skipping processes that vanish meanwhile."""
    import psutil

    total = 0.0
    for p in _tree(pid):
        try:
            total += read(p)
        except psutil.Error:
            pass
    return total


def _tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its live children (psutil), 0 if gone."""

    def cpu(p) -> float:
        t = p.cpu_times()
        return t.user + t.system + t.children_user + t.children_system

    return _tree_sum(pid, cpu)


def _tree_rss_mib(pid: int) -> float:
    """Resident memory of a process and its live children, summed (MiB; psutil), 0 if gone."""
    return _tree_sum(pid, lambda p: p.memory_info().rss) / 2**20


class BackgroundLoad:
    """``n`` subprocesses that each spin one core (``while True: pass``) until ``stop``."""

    def __init__(self, n: int) -> None:
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]

    def stop(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


def _all_busy_seconds() -> float:
    import psutil

    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq + getattr(t, "steal", 0.0)


def scenario_seed(seed: int, scenario: str) -> int:
    """The load generator's seed for ``scenario``: distinct per scenario, so that no scenario
    repeats another's prompts (which would be prefix-cache hits on the same server)."""
    return seed + list(SCENARIOS).index(scenario)


def bench_command(args: argparse.Namespace, url: str, hf_dir: Path, scenario: str, workdir: Path, name: str) -> list[str]:
    """``vllm bench serve``'s command line for ``scenario`` against ``url``, its result JSON to ``workdir/name``."""
    s = SCENARIOS[scenario]
    return [*shlex.split(args.bench or args.vllm), "bench", "serve", "--backend", "openai", "--base-url", url,
           "--endpoint", "/v1/completions", "--model", "model", "--tokenizer", str(hf_dir),
           "--dataset-name", "random", "--random-input-len", str(s["input_len"]),
           "--random-output-len", str(s["output_len"]), "--random-range-ratio", str(s["range_ratio"]),
           "--num-prompts", str(s["num_prompts"]), "--max-concurrency", str(s["concurrency"]),
           "--ignore-eos", "--seed", str(scenario_seed(args.seed, scenario)), "--temperature", str(args.temperature),
           *(["--top-p", str(args.top_p)] if args.top_p is not None else []),
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--save-result", "--result-dir", str(workdir), "--result-filename", name]  # fmt: skip


def run_bench(args: argparse.Namespace, url: str, hf_dir: Path, scenario: str, server_pid: int, workdir: Path) -> dict[str, Any]:
    """One ``vllm bench serve`` run; its result JSON plus ``other_load_cores`` and the command."""
    name = f"{scenario}.json"
    cmd = bench_command(args, url, hf_dir, scenario, workdir, name)
    server_cpu0, busy0, t0 = _tree_cpu_seconds(server_pid), _all_busy_seconds(), time.monotonic()
    bench = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    bench_cpu = peak_rss = 0.0
    while bench.poll() is None:  # sample the client's tree while it lives (children vanish at exit)
        bench_cpu = max(bench_cpu, _tree_cpu_seconds(bench.pid))
        peak_rss = max(peak_rss, _tree_rss_mib(server_pid))
        time.sleep(0.5)
    log = bench.stdout.read() if bench.stdout else ""
    wall = time.monotonic() - t0
    server_cpu = _tree_cpu_seconds(server_pid) - server_cpu0
    other = max(0.0, (_all_busy_seconds() - busy0 - server_cpu - bench_cpu) / wall) if wall > 0 else None
    result_path = workdir / name
    if bench.returncode != 0 or not result_path.is_file():
        raise RuntimeError(f"vllm bench serve failed ({bench.returncode}):\n{log[-3000:]}")
    result = json.loads(result_path.read_text())
    for big in ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors", "latencies", "queue_times"):
        result.pop(big, None)
    result.update(other_load_cores=other, server_cpu_cores=server_cpu / wall, bench_cpu_cores=bench_cpu / wall,
                  peak_rss_mib=peak_rss, bench_command=shlex.join(cmd))  # fmt: skip
    return result


def _save_metrics(url: str, path: Path) -> None:
    """The server's Prometheus ``/metrics`` text into ``path`` (nothing if it has none)."""
    try:
        r = httpx.get(url + "/metrics", timeout=10)
    except httpx.HTTPError:
        return
    if r.status_code == 200:
        path.write_text(r.text)


def _thread_changes(url: str) -> float | None:
    """kvflow's ``kvflow:cpu_thread_changes_total`` (its thread governor's changes of the
    intra-op thread count) from the server's ``/metrics``; None for other servers."""
    try:
        r = httpx.get(url + "/metrics", timeout=10)
    except httpx.HTTPError:
        return None
    for line in r.text.splitlines() if r.status_code == 200 else ():
        if line.startswith("kvflow:cpu_thread_changes_total"):
            return float(line.rsplit(" ", 1)[1])
    return None


def build_kernels(engine: str, args: argparse.Namespace) -> None:
    """Build (or find cached) the C++ kernels of the checkout ``engine`` runs from
    (``python -m kvflow.ops`` there), so that its server does not compile them in the
    background while it is measured: a kernel's build name hashes its include paths, so a
    ``--baseline`` checkout has builds of its own (a first run of main's server spent its
    whole ``concurrent16`` scenario on its PyTorch paths next to a compiler)."""
    print(f"[{engine}] C++ kernels ...", flush=True)
    subprocess.run([sys.executable, "-m", "kvflow.ops"], env=server_env(engine, args),
                   cwd=server_cwd(engine, args) or REPO_ROOT, capture_output=True, check=False)  # fmt: skip


def offline_single(engine: str, args: argparse.Namespace, cmd: list[str], workdir: Path) -> dict[str, Any]:
    """The ``single`` scenario's stream (its prompt length and output tokens) run offline
    (``benchmarks/peers/offline_single.py``: ``LLM.generate_stream``, no server) with the
    engine arguments of ``engine``'s server command ``cmd``, from the same checkout.

    Returns:
        ``ttft_ms``, ``decode_tok_per_s`` (median of 3 runs), ``runs``, ``other_load_cores``;
        or ``error`` with the output's tail.
    """
    s = SCENARIOS["single"]
    out = workdir / f"{engine}-offline.json"
    # Run as a file, not ``-m``: its folder, not the working directory, goes first on sys.path,
    # so ``kvflow`` is the engine's checkout's (``server_env``).
    helper = [sys.executable, str(REPO_ROOT / "benchmarks" / "peers" / "offline_single.py"), "--out", str(out),
              "--prompt-len", str(s["input_len"]), "--new-tokens", str(s["output_len"]),
              "--", *cmd[cmd.index("serve") + 1:]]  # fmt: skip
    print(f"[{engine}] offline single stream ...", flush=True)
    import resource

    def children_cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime

    busy0, child0, wall0 = _all_busy_seconds(), children_cpu(), time.monotonic()
    proc = subprocess.run(helper, env=server_env(engine, args), cwd=server_cwd(engine, args), capture_output=True,
                          text=True, timeout=args.startup_timeout + 600)  # fmt: skip
    wall = time.monotonic() - wall0
    if proc.returncode != 0:
        return {"error": (proc.stdout + proc.stderr)[-3000:]}
    result = json.loads(out.read_text())
    # every CPU's busy time less the helper's own (a waited-for child: in RUSAGE_CHILDREN)
    result["other_load_cores"] = max(0.0, (_all_busy_seconds() - busy0 - (children_cpu() - child0)) / wall)
    return result


def run_engine(engine: str, args: argparse.Namespace, hf_dir: Path, gguf: Path | None, workdir: Path) -> dict[str, Any]:
    """Measure ``engine``'s cold and warm starts (unless ``--no-starts``), then start its server,
    run every scenario against it, stop it."""
    args.model_cache_dir = None
    if _is_kvflow(engine.removesuffix("@base"), args.variants):
        build_kernels(engine, args)
    starts = measure_starts(engine, args, hf_dir, gguf, workdir) if args.starts else None
    idle = wait_for_idle(args.wait_idle)
    port = _free_port()
    max_concurrency = max(SCENARIOS[s]["concurrency"] for s in args.scenarios)
    cmd = server_command(engine, args, hf_dir, gguf, port, max_concurrency)
    offline = None
    if args.offline and _is_kvflow(engine.removesuffix("@base"), args.variants):
        offline = offline_single(engine, args, cmd, workdir)
    log_path = workdir / f"{engine}.log"
    env = server_env(engine, args)
    if args.step_trace is not None:  # the tracer's sitecustomize first on the path (kvflow and vLLM)
        args.step_trace.mkdir(parents=True, exist_ok=True)
        env.update(STEP_TRACE=str(args.step_trace.resolve() / engine),
                   PYTHONPATH=str(REPO_ROOT / "benchmarks" / "peers" / "step_trace") + os.pathsep + env["PYTHONPATH"])
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                cwd=server_cwd(engine, args))
    record: dict[str, Any] = {"engine": engine, "server_command": shlex.join(cmd), "cpu_busy_before": idle,
                              "background_load": args.background_load,
                              "kv_tokens": kv_tokens(args, max_concurrency)}  # fmt: skip
    if starts is not None:
        record["starts"] = starts
    if offline is not None:
        record["offline_single"] = offline
    load = None
    try:
        record["startup_s"] = wait_ready(proc, f"http://127.0.0.1:{port}", args.startup_timeout, log_path)
        load = BackgroundLoad(args.background_load)
        record["scenarios"] = {}
        for key in run_keys(args.scenarios):
            scenario = key.partition("#")[0]
            print(f"[{engine}] {key} ...", flush=True)
            changes = _thread_changes(f"http://127.0.0.1:{port}")
            record["scenarios"][key] = run_bench(args, f"http://127.0.0.1:{port}", hf_dir, scenario, proc.pid, workdir)
            after = _thread_changes(f"http://127.0.0.1:{port}")
            # (a thread count changed mid-run, by the client's or another process's CPU use)
            record["scenarios"][key]["cpu_thread_changes"] = None if after is None else after - (changes or 0.0)
            if args.step_trace is not None:
                _save_metrics(f"http://127.0.0.1:{port}", args.step_trace / f"{engine}-{key}.metrics")
        record["peak_rss_mib"] = max(r["peak_rss_mib"] for r in record["scenarios"].values())
        if starts is not None:
            record["peak_rss_mib"] = max([record["peak_rss_mib"], *(starts[k].get("peak_rss_mib", 0.0)
                                                                    for k in ("cold", "warm"))])
    except RuntimeError as exc:
        record["error"] = str(exc)
        print(f"[{engine}] failed: {exc}", file=sys.stderr)
    finally:
        if load is not None:
            load.stop()
        stop(proc)
    return record


def run_keys(scenarios: list[str]) -> list[str]:
    """Result keys of the scenarios in run order: a scenario listed again is run again on the same
    server with the same prompts (its seed), as ``<scenario>#2``, ``#3``...: the engine then
    serves them from its prefix cache as far as the cache still holds them."""
    seen: dict[str, int] = {}
    keys = []
    for s in scenarios:
        seen[s] = seen.get(s, 0) + 1
        keys.append(s if seen[s] == 1 else f"{s}#{seen[s]}")
    return keys


def tables(records: list[dict[str, Any]], scenarios: list[str]) -> str:
    """One table per scenario, with each engine's throughput and TTFT relative to the first engine."""
    out = []
    for scenario in scenarios:
        rows, base = [], None
        for rec in records:
            r = rec.get("scenarios", {}).get(scenario)
            if r is None:
                rows.append([rec["engine"], *([None] * (len(SHOWN) + 6))])
                continue
            base = base or r
            ratio = r["output_throughput"] / base["output_throughput"] if base["output_throughput"] else None
            ttft_ratio = r["mean_ttft_ms"] / base["mean_ttft_ms"] if base["mean_ttft_ms"] else None
            rows.append([rec["engine"], *(r.get(k) for k in SHOWN), ratio, ttft_ratio, r.get("peak_rss_mib"),
                         r["other_load_cores"], r.get("bench_cpu_cores"), r.get("cpu_thread_changes")])  # fmt: skip
        headers = ["engine", "ok", "failed", "out tok/s", "TTFT ms", "TTFT p99", "TPOT ms", "TPOT p99", "ITL p99",
                   "tok/s vs 1st", "TTFT vs 1st", "peak RSS MiB", "other load", "client cores",
                   "thread changes"]  # fmt: skip
        out.append(f"{scenario} ({SCENARIOS[scenario.partition('#')[0]]})\n" + format_table(headers, rows))
    return "\n\n".join(out)


def offline_table(records: list[dict[str, Any]]) -> str | None:
    """Served single stream against the same engine offline (``--offline``): decode tokens/s
    both ways (served: 1000 / mean TPOT of the ``single`` scenario, which like the offline
    rate leaves the first token out), their ratio, and each side's TTFT. None without
    ``--offline`` numbers."""
    rows = []
    for rec in records:
        off, served = rec.get("offline_single"), rec.get("scenarios", {}).get("single")
        if off is None or served is None:
            continue
        if "error" in off:
            rows.append([rec["engine"], None, None, None, None, None, None, None])
            continue
        served_rate = 1000.0 / served["mean_tpot_ms"] if served.get("mean_tpot_ms") else None
        ratio = served_rate / off["decode_tok_per_s"] if served_rate else None
        rows.append([rec["engine"], off["decode_tok_per_s"], served_rate, ratio, off["ttft_ms"], served["mean_ttft_ms"],
                     served["output_throughput"], off.get("other_load_cores")])  # fmt: skip
    if not rows:
        return None
    headers = ["engine", "offline decode tok/s", "served decode tok/s", "served / offline", "offline TTFT ms",
               "served TTFT ms", "served out tok/s", "other load (offline)"]  # fmt: skip
    return "single stream, served against offline (decode rate: first to last token)\n" + format_table(headers, rows)


def summary(records: list[dict[str, Any]]) -> str:
    """One row per engine, #26's table: KV capacity, cold / warm start to the first token, peak
    RSS (over its starts and scenarios), output tok/s single / 4 / 16 in flight, the TTFT of a
    512-token prompt, and weight files kvflow wrote to its model cache; ratios to the last
    engine (put llama-server last)."""

    def row(rec: dict[str, Any]) -> list[Any]:
        starts, sc = rec.get("starts") or {}, rec.get("scenarios", {})
        tput = [sc.get(k, {}).get("output_throughput") for k in ("single", "concurrent4", "concurrent16")]
        files = starts.get("cache_files")
        return [rec["engine"], rec.get("kv_tokens"), starts.get("cold", {}).get("ready_s"),
                starts.get("cold", {}).get("first_token_s"), starts.get("warm", {}).get("first_token_s"),
                rec.get("peak_rss_mib"), *tput, sc.get("prefill512", {}).get("mean_ttft_ms"),
                None if files is None else len(weights_in_cache(files))]  # fmt: skip

    rows = [row(r) for r in records]
    ref = rows[-1] if rows else None
    for r in rows:
        ratios = [r[i] / ref[i] if r[i] is not None and ref[i] else None for i in (3, 5, 6, 9)]
        r += ratios
    headers = ["engine", "KV tokens", "cold ready s", "cold 1st tok s", "warm 1st tok s", "peak RSS MiB",
               "single tok/s", "4 tok/s", "16 tok/s", "prefill512 TTFT ms", "weight files cached",
               "cold vs last", "RSS vs last", "single vs last", "prefill vs last"]  # fmt: skip
    return "summary (#26)\n" + format_table(headers, rows)


def plot(records: list[dict[str, Any]], scenarios: list[str], path: Path) -> None:
    """Bars of output tokens/s and mean TTFT per engine, one panel pair per scenario."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(scenarios), figsize=(4.5 * len(scenarios), 6), squeeze=False)
    for col, scenario in enumerate(scenarios):
        names = [r["engine"] for r in records if scenario in r.get("scenarios", {})]
        res = [r["scenarios"][scenario] for r in records if scenario in r.get("scenarios", {})]
        axes[0][col].bar(names, [x["output_throughput"] for x in res])
        axes[0][col].set_title(f"{scenario}: output tok/s")
        axes[1][col].bar(names, [x["mean_ttft_ms"] for x in res], color="tab:orange")
        axes[1][col].set_title(f"{scenario}: mean TTFT (ms)")
        for ax in (axes[0][col], axes[1][col]):
            ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def _cpu_model() -> dict[str, Any]:
    """The CPU's model name and its vector ISA flags (from /proc/cpuinfo)."""
    info: dict[str, Any] = {"model": None, "isa": []}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and info["model"] is None:
            info["model"] = value.strip()
        if key.strip() == "flags":
            flags = set(value.split())
            info["isa"] = sorted(f for f in flags if f in {"avx2", "fma", "avx512f", "avx512bw", "avx512_vnni",
                                                           "avx_vnni", "avx512_bf16", "amx_bf16"})
            break
    return info


def _git_head(root: Path) -> str | None:
    try:
        return subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    hf_dir, gguf = model_files(args.model, with_weights="vllm" in [args.variants.get(e, (e,))[0] for e in args.engines])
    if args.baseline is not None:
        print(f"baseline: {args.baseline} at {_git_head(args.baseline)}; this checkout at {_git_head(REPO_ROOT)}")
    records = []
    with tempfile.TemporaryDirectory(prefix="serve_peers-") as tmp:
        for engine in args.engines:
            records.append(run_engine(engine, args, hf_dir, gguf, Path(tmp)))
            if "error" in records[-1]:
                log = Path(tmp) / f"{engine}.log"
                records[-1]["server_log_tail"] = log.read_text(errors="replace")[-3000:] if log.is_file() else None
    keys = run_keys(args.scenarios)
    print(tables(records, keys))
    print()
    served_offline = offline_table(records)
    if served_offline is not None:
        print(served_offline)
        print()
    print(summary(records))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"machine": machine_info(), "model": args.model, "dtype": args.dtype, "threads": args.threads,
               "baseline": None if args.baseline is None else {"root": str(args.baseline),
                                                              "head": _git_head(args.baseline)},
               "head": _git_head(REPO_ROOT), "cpu": _cpu_model(),
               "background_load": args.background_load,
               "scenarios": {k: SCENARIOS[k.partition("#")[0]] for k in keys}, "engines": records}  # fmt: skip
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    try:
        plot(records, keys, args.plot)
        print(f"wrote {args.plot}")
    except ImportError:
        print("matplotlib not installed: no plot (pip install -e '.[bench]')")
    return 0 if all("error" not in r for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
