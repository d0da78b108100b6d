"""Offline throughput of kvflow against Hugging Face transformers with static batching.

What it measures
----------------
* **Throughput.** N requests (default 64) whose prompts are windows of real text (the GPL-3
  and Apache-2.0 license files, tokenized with the model's tokenizer), prompt lengths
  uniform in 16-512 tokens, output lengths uniform in 16-256 tokens, fixed seed. Decoding
  is greedy with EOS ignored, so every request produces exactly its output length (checked).
  - ``kvflow``: one ``LLM.generate`` call over all requests (continuous batching, chunked
    prefill, paged KV cache). Only that call is timed; the model is loaded and warmed up
    first.
  - ``hf-static``: transformers ``model.generate`` on the same requests in input order, in
    static left-padded batches of ``--hf-batch-size`` (pad = EOS, with attention mask). Each
    batch runs until its longest output is done (``min_new_tokens = max_new_tokens``), but
    only each request's own output length counts as output tokens: the tokens generated for
    requests that were already done are the work that static batching wastes.
* **Single-stream decode.** One ~32-token prompt, 128 new tokens, batch 1. Decode rate =
  127 / (time from first to last token), so the prefill (time to first token) is excluded.
  kvflow timestamps the tokens of ``LLM.generate_stream``; transformers runs a manual greedy
  loop over its KV cache (``cache``, ``past_key_values`` before transformers 5).

The machine may be shared: each timed phase records how many cores other processes kept
busy meanwhile (``other_load_cores``, from /proc/stat minus this process's CPU time) and
this process's CPU seconds; the run warns when other jobs took more than 0.2 cores.
``--wait-idle 600`` waits for a quiet machine first. ``--profile-batch 32`` instead breaks
one kvflow decode step at batch 32 down into scheduler, model forward by operator kind,
LM head, sampling and engine bookkeeping.

* **Contention** (``--contention``). The same kvflow workload on a quiet machine and under a
  fixed background load that the benchmark starts and stops itself (``--load-procs`` busy-
  looping processes, 1 by default: "one core of other load", optionally pinned with
  ``--load-pin``), for kvflow's default threading and the alternatives (``--variants``: OpenMP
  wait policy, thread count), each in a fresh process because libgomp reads its settings when
  torch is imported. Quiet and loaded runs alternate back to back (``--contention-repeats``
  pairs); the table gives the median output tok/s of each and the loaded/quiet ratio.

kvflow is imported before torch, so the process (both engines) runs with kvflow's default
OpenMP wait policy (``kvflow.cpu_threads``) unless the environment sets one.

Both engines run the same float32 weights: kvflow converts the packaged GGUF once into a
Hugging Face folder (``kvflow.model.resolve.resolve_model``) and transformers loads that folder.

How to run
----------
    python -m benchmarks.throughput                      # defaults: 64 prompts, seed 0
    python -m benchmarks.throughput --num-prompts 16     # a quicker run
    python -m benchmarks.throughput --skip-hf            # kvflow only
    python -m benchmarks.throughput --contention --dtype bfloat16 --num-prompts 16 --max-prompt-len 128 \
        --max-output-len 64                              # quiet vs one busy core, per threading variant

It prints one table (rows kvflow and hf-static) and the kvflow/hf ratios, and writes the
configuration, machine facts and every number to ``--out`` (default
``benchmarks/results/throughput.json``; that folder's JSON files are not tracked by git).
On the 2-core CPU of the development machine, shared with other jobs, the default workload
with ``--threads 1`` took 17 minutes (kvflow 230 s, transformers 430 s, the rest loading and
single-stream runs); alone on the machine it should take well under 10. ``--num-prompts 16``
takes about a quarter of that.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import kvflow  # noqa: F401 - before torch: kvflow's OpenMP wait policy applies (kvflow.cpu_threads)
import torch

from benchmarks.common import (
    BenchRequest,
    OtherLoad,
    cpu_busy_fraction,
    format_table,
    machine_info,
    make_workload,
    request_dicts,
    tokenize_corpus,
    wait_for_idle,
    workload_summary,
)

STREAM_PROMPT_LEN = 32
STREAM_NEW_TOKENS = 128


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.throughput", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="kvflow model name or path (default: %(default)s)")
    p.add_argument("--num-prompts", type=int, default=64, help="number of requests (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default: %(default)s)")
    p.add_argument("--min-prompt-len", type=int, default=16)
    p.add_argument("--max-prompt-len", type=int, default=512)
    p.add_argument("--min-output-len", type=int, default=16)
    p.add_argument("--max-output-len", type=int, default=256)
    p.add_argument("--hf-batch-size", type=int, default=8, help="static batch size of the baseline (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="kvflow max_num_seqs (default: %(default)s)")
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=512, help="kvflow per-step token budget (default: %(default)s)"
    )
    p.add_argument("--block-size", type=int, default=16, help="kvflow tokens per KV block (default: %(default)s)")
    p.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="kvflow KV blocks (default: enough for max_num_seqs requests of the longest prompt + output, "
        "so the run never preempts)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="kvflow weight / activation dtype (default: %(default)s; transformers stays float32)")
    p.add_argument("--stream-repeats", type=int, default=3, help="single-stream runs per engine; the median is kept")
    p.add_argument("--skip-hf", action="store_true", help="run kvflow only")
    p.add_argument("--skip-stream", action="store_true", help="skip the single-stream decode measurement")
    p.add_argument("--out", default="benchmarks/results/throughput.json", help="JSON output path (default: %(default)s)")
    p.add_argument(
        "--profile-batch",
        type=int,
        default=None,
        metavar="B",
        help="instead of the benchmark, profile kvflow decode steps with B running requests and print "
        "where a step's time goes (scheduler, input preparation, model forward by op kind, LM head, "
        "sampling, engine bookkeeping)",
    )
    p.add_argument("--profile-steps", type=int, default=10, help="decode steps timed by --profile-batch")
    p.add_argument(
        "--wait-idle",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="on a shared machine, wait up to this long for the CPUs to be under 10%% busy before starting",
    )
    p.add_argument("--contention", action="store_true",
                   help="instead of the benchmark, compare kvflow quiet vs under a background load that this "
                   "benchmark starts, for each threading variant (see --variants)")
    p.add_argument("--variants", default=",".join(CONTENTION_VARIANTS),
                   help="comma-separated variants for --contention, of: " + ", ".join(
                       f"{k} ({v['what']})" for k, v in CONTENTION_VARIANTS.items()) + " (default: all)")
    p.add_argument("--load-procs", type=int, default=1, help="busy-looping processes of the --contention load (default: 1)")
    p.add_argument("--load-pin", default=None, metavar="CPUS",
                   help="pin the load processes to these CPUs (e.g. 1 or 0,1; default: not pinned)")
    p.add_argument("--contention-repeats", type=int, default=1, help="quiet/loaded pairs per variant (default: 1)")
    args = p.parse_args(argv)
    for name in ("num_prompts", "hf_batch_size", "max_num_seqs", "max_num_batched_tokens", "block_size", "stream_repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 1 <= args.min_prompt_len <= args.max_prompt_len or not 1 <= args.min_output_len <= args.max_output_len:
        p.error("length ranges must satisfy 1 <= min <= max")
    return args


# Threading variants of the contention mode: environment of the child process, torch threads.
# GOMP_SPINCOUNT=300000 is libgomp's own default spin count (OMP_WAIT_POLICY unset), so the
# "gomp-default" variant is what torch does when nothing sets the policy.
CONTENTION_VARIANTS: dict[str, dict[str, Any]] = {
    "kvflow-default": {"env": {}, "threads": None,
                       "what": "whatever kvflow picks with nothing set (short spin + thread governor)"},
    "governor-off": {"env": {"KVFLOW_CPU_ADAPTIVE_THREADS": "0"}, "threads": None,
                     "what": "kvflow without its thread governor (sleeping workers, all cores)"},
    "gomp-default": {"env": {"GOMP_SPINCOUNT": "300000"}, "threads": None,
                     "what": "libgomp's default spin-then-sleep, all cores"},
    "active": {"env": {"OMP_WAIT_POLICY": "ACTIVE"}, "threads": None, "what": "OpenMP threads spin, all cores"},
    "passive": {"env": {"OMP_WAIT_POLICY": "PASSIVE"}, "threads": None, "what": "OpenMP threads sleep, all cores"},
    "spin-10k": {"env": {"GOMP_SPINCOUNT": "10000"}, "threads": None, "what": "spin 10k rounds, then sleep"},
    "spin-1k": {"env": {"GOMP_SPINCOUNT": "1000"}, "threads": None, "what": "spin 1k rounds, then sleep"},
    "passive-bound": {"env": {"OMP_WAIT_POLICY": "PASSIVE", "OMP_PROC_BIND": "true", "OMP_PLACES": "cores"},
                      "threads": None, "what": "sleeping threads bound one per core"},
    "threads-1": {"env": {"GOMP_SPINCOUNT": "300000"}, "threads": 1, "what": "one thread, libgomp's default spin"},
    "passive-threads-1": {"env": {"OMP_WAIT_POLICY": "PASSIVE"}, "threads": 1, "what": "one thread, sleeping"},
}
# Every variant but the first two fixes its thread count (no governor).
for _name, _spec in CONTENTION_VARIANTS.items():
    if _name not in ("kvflow-default", "governor-off"):
        _spec["env"] = {"KVFLOW_CPU_ADAPTIVE_THREADS": "0", **_spec["env"]}
# Variables of the parent that would leak into a variant's child.
_THREAD_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS", "OMP_PROC_BIND", "OMP_PLACES",
               "GOMP_CPU_AFFINITY", "KVFLOW_CPU_ADAPTIVE_THREADS")


def _start_load(n: int, cpus: set[int] | None) -> list[Any]:
    """n busy-looping Python processes (one core each), pinned to ``cpus`` if given."""
    import subprocess

    return [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                             preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
            for _ in range(n)]


def _child_run(args: argparse.Namespace, variant: str, out: Path) -> dict[str, Any]:
    """One kvflow-only throughput run of a variant in a fresh process; its JSON record."""
    import subprocess

    spec = CONTENTION_VARIANTS[variant]
    env = {k: v for k, v in os.environ.items() if k not in _THREAD_ENV}
    env.update(spec["env"])
    command = [sys.executable, "-m", "benchmarks.throughput", "--skip-hf", "--skip-stream", "--out", str(out),
               "--model", args.model, "--num-prompts", str(args.num_prompts), "--seed", str(args.seed),
               "--min-prompt-len", str(args.min_prompt_len), "--max-prompt-len", str(args.max_prompt_len),
               "--min-output-len", str(args.min_output_len), "--max-output-len", str(args.max_output_len),
               "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
               "--block-size", str(args.block_size), "--dtype", args.dtype]
    threads = spec["threads"] if spec["threads"] is not None else args.threads
    if threads is not None:
        command += ["--threads", str(threads)]
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def run_contention(args: argparse.Namespace) -> int:
    """Quiet vs loaded kvflow throughput per threading variant (see the module docstring)."""
    import tempfile

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in CONTENTION_VARIANTS]
    if unknown:
        raise SystemExit(f"unknown --variants {unknown}; known: {list(CONTENTION_VARIANTS)}")
    pin = {int(c) for c in args.load_pin.split(",")} if args.load_pin else None
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {v: {"quiet": [], "loaded": []} for v in variants}
    loadavg_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.contention_repeats):
            for variant in variants:
                for state in ("quiet", "loaded"):
                    procs = _start_load(args.load_procs if state == "loaded" else 0, pin)
                    try:
                        record = _child_run(args, variant, Path(tmp) / f"{variant}-{state}-{rep}.json")
                    finally:
                        for proc in procs:
                            proc.terminate()
                            proc.wait()
                    kv = record["results"]["kvflow"]
                    # other_load_cores of the child counts the busy loops too; keep the rest apart
                    background = None if kv["other_load_cores"] is None else kv["other_load_cores"] - len(procs)
                    runs[variant][state].append({
                        "output_tokens_per_s": kv["output_tokens_per_s"], "wall_s": kv["wall_s"],
                        "other_load_cores": kv["other_load_cores"], "background_cores": background,
                        "threads": record["machine"].get("torch_num_threads"), "loadavg_end": record["machine"]["loadavg_end"],
                    })
                    print(f"[contention] {variant:18s} {state:6s} {kv['output_tokens_per_s']:8.1f} output tok/s "
                          f"({kv['wall_s']:.1f} s; other load {_fmt_load(kv['other_load_cores'])}, "
                          f"{len(procs)} of them ours)", file=sys.stderr)

    def med(variant: str, state: str, key: str) -> float | None:
        values = [r[key] for r in runs[variant][state] if r[key] is not None]
        return statistics.median(values) if values else None

    headers = ["variant", "threads", "quiet tok/s", "loaded tok/s", "loaded/quiet", "background cores q/l"]
    rows = []
    for v in variants:
        q, l = med(v, "quiet", "output_tokens_per_s"), med(v, "loaded", "output_tokens_per_s")
        bq, bl = med(v, "quiet", "background_cores"), med(v, "loaded", "background_cores")
        rows.append([v, runs[v]["quiet"][0]["threads"], q, l, l / q if q and l else None, f"{_fmt_load(bq)}/{_fmt_load(bl)}"])
    print()
    print(f"kvflow {args.model} {args.dtype}, {args.num_prompts} requests (prompts {args.min_prompt_len}-"
          f"{args.max_prompt_len}, outputs {args.min_output_len}-{args.max_output_len} tokens); load: "
          f"{args.load_procs} busy process(es){' pinned to ' + args.load_pin if pin else ''}; "
          f"{os.cpu_count()} CPUs; median of {args.contention_repeats}")
    print(format_table(headers, rows))
    print("background cores: other jobs on the machine besides this benchmark's load (quiet/loaded runs); "
          "numbers from a machine where they are above ~0.1 are noisy")
    record = {
        "benchmark": "throughput-contention",
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "variants": {v: CONTENTION_VARIANTS[v] for v in variants},
        "machine": {**machine_info(), "loadavg_start": loadavg_start, "loadavg_end": os.getloadavg()},
        "runs": runs,
    }
    out = Path(args.out if args.out != "benchmarks/results/throughput.json" else "benchmarks/results/contention.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------------- kvflow
def kvflow_engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ``LLM`` options of the run (the KV pool holds max_num_seqs worst-case requests)."""
    num_blocks = args.num_kv_blocks
    if num_blocks is None:
        per_request = _cdiv(args.max_prompt_len + args.max_output_len, args.block_size)
        num_blocks = min(args.max_num_seqs, max(args.num_prompts, args.profile_batch or 0)) * per_request
    kwargs = {
        "dtype": getattr(args, "dtype", "float32"),
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "block_size": args.block_size,
        "num_kv_blocks": num_blocks,
        "seed": 0,
    }
    if args.threads is not None:
        kwargs["num_threads"] = args.threads
    return kwargs


def run_kvflow(llm: Any, requests: list[BenchRequest]) -> dict[str, Any]:
    """Time one ``LLM.generate`` call over all requests; check the output lengths."""
    from kvflow import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    engine = llm.engine
    stats_before = llm.get_stats()

    # Count engine steps without changing them (an instance attribute shadows the method).
    num_steps = 0
    step = engine.step

    def counting_step():
        nonlocal num_steps
        num_steps += 1
        return step()

    engine.step = counting_step
    try:
        t0 = time.perf_counter()
        start_mono = time.monotonic()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
    finally:
        del engine.step

    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    for r, toks in zip(requests, tokens):
        if len(toks) != r.output_len:
            raise RuntimeError(f"kvflow produced {len(toks)} tokens for a request that asked {r.output_len}")
    metrics = [getattr(o, "metrics", None) or {} for o in outputs]
    ttft = [m["first_token_time"] - start_mono for m in metrics if m.get("first_token_time") is not None]
    latency = [m["finished_time"] - start_mono for m in metrics if m.get("finished_time") is not None]
    n_out = sum(len(t) for t in tokens)
    return {
        "num_requests": len(requests),
        "output_tokens": n_out,
        "prompt_tokens": sum(r.prompt_len for r in requests),
        "wall_s": wall,
        "requests_per_s": len(requests) / wall,
        "output_tokens_per_s": n_out / wall,
        "total_tokens_per_s": (n_out + sum(r.prompt_len for r in requests)) / wall,
        "num_engine_steps": num_steps,
        "num_preemptions": llm.get_stats()["num_preemptions"] - stats_before["num_preemptions"],
        "prefix_cache_hit_tokens": llm.get_stats().get("prefix_cache_hits", 0) - stats_before.get("prefix_cache_hits", 0),
        "mean_ttft_s": statistics.fmean(ttft) if ttft else None,
        "mean_latency_s": statistics.fmean(latency) if latency else None,
        "_tokens": tokens,
    }


def kvflow_stream_decode(llm: Any, prompt_ids: list[int], new_tokens: int) -> dict[str, float]:
    """Single-request greedy decode through ``generate_stream``; timestamps every token."""
    from kvflow import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    stamps = []
    t0 = time.perf_counter()
    last = None
    for out in llm.generate_stream({"prompt_token_ids": prompt_ids}, params):
        stamps.append(time.perf_counter())
        last = out
    n = len(last.outputs[0].token_ids)
    if n != new_tokens or len(stamps) != new_tokens:
        raise RuntimeError(f"kvflow stream produced {n} tokens in {len(stamps)} updates, expected {new_tokens}")
    return _stream_result(t0, stamps[0], stamps[-1], new_tokens)


def _stream_result(t0: float, t_first: float, t_last: float, n: int) -> dict[str, float]:
    return {
        "ttft_s": t_first - t0,
        "total_s": t_last - t0,
        "decode_tok_per_s": (n - 1) / (t_last - t_first),
    }


# ---------------------------------------------------------------------------------- transformers
def load_hf(model_dir: Path) -> tuple[Any, Any]:
    """transformers' float32 model and tokenizer of a kvflow model folder (a GGUF model's
    folder holds no weights: its float32 conversion, ``hf_checkpoint_dir``, is loaded)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from kvflow.model.resolve import hf_checkpoint_dir

    model_dir = hf_checkpoint_dir(str(model_dir))

    hf_logging.disable_progress_bar()

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return model, tokenizer


def _left_pad(batch: list[BenchRequest], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(r.prompt_len for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, r in enumerate(batch):
        ids[i, width - r.prompt_len :] = torch.tensor(r.prompt_token_ids, dtype=torch.long)
        mask[i, width - r.prompt_len :] = 1
    return ids, mask


def hf_generate_batch(model: Any, batch: list[BenchRequest], pad_id: int) -> list[list[int]]:
    """Greedy ``generate`` on one static batch run to its longest output; returns each
    request's own output tokens (its first ``output_len``)."""
    ids, mask = _left_pad(batch, pad_id)
    steps = max(r.output_len for r in batch)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=steps,
            min_new_tokens=steps,
            pad_token_id=pad_id,
        )
    gen = out[:, ids.shape[1] :]
    if gen.shape[1] != steps:
        raise RuntimeError(f"transformers generated {gen.shape[1]} tokens per row, expected {steps}")
    return [gen[i, : r.output_len].tolist() for i, r in enumerate(batch)]


def run_hf(model: Any, requests: list[BenchRequest], batch_size: int, pad_id: int) -> dict[str, Any]:
    """Static batches in input order; only each request's own output length counts."""
    tokens: list[list[int]] = []
    latency = []
    computed_out = 0
    computed_prompt = 0
    t0 = time.perf_counter()
    for start in range(0, len(requests), batch_size):
        batch = requests[start : start + batch_size]
        tokens.extend(hf_generate_batch(model, batch, pad_id))
        done = time.perf_counter() - t0
        latency.extend([done] * len(batch))
        computed_out += len(batch) * max(r.output_len for r in batch)
        computed_prompt += len(batch) * max(r.prompt_len for r in batch)
    wall = time.perf_counter() - t0
    for r, toks in zip(requests, tokens):
        if len(toks) != r.output_len:
            raise RuntimeError(f"transformers kept {len(toks)} tokens for a request that asked {r.output_len}")
    n_out = sum(len(t) for t in tokens)
    n_prompt = sum(r.prompt_len for r in requests)
    return {
        "num_requests": len(requests),
        "output_tokens": n_out,
        "prompt_tokens": n_prompt,
        "wall_s": wall,
        "requests_per_s": len(requests) / wall,
        "output_tokens_per_s": n_out / wall,
        "total_tokens_per_s": (n_out + n_prompt) / wall,
        "num_batches": _cdiv(len(requests), batch_size),
        "generated_tokens_incl_waste": computed_out,
        "wasted_output_fraction": 1 - n_out / computed_out,
        "padded_prompt_tokens": computed_prompt,
        "mean_latency_s": statistics.fmean(latency),
        "_tokens": tokens,
    }


def hf_stream_decode(model: Any, prompt_ids: list[int], new_tokens: int) -> dict[str, float]:
    """Manual greedy loop over transformers' KV cache, batch 1; times the first token apart."""
    import inspect

    # transformers 5 renamed ``past_key_values`` to ``cache``; accept both.
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    generated = []
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1].argmax(dim=-1, keepdim=True)
        generated.append(int(token))
        t_first = time.perf_counter()
        cache = getattr(out, cache_kw)
        for _ in range(new_tokens - 1):
            out = model(input_ids=token, use_cache=True, **{cache_kw: cache})
            cache = getattr(out, cache_kw)
            token = out.logits[:, -1].argmax(dim=-1, keepdim=True)
            generated.append(int(token))
        t_last = time.perf_counter()
    return _stream_result(t0, t_first, t_last, len(generated))


# ---------------------------------------------------------------------------------- profile
_OP_KINDS = (
    ("matmul (linear layers)", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear",
                                "mkldnn::_linear_pointwise", "aten::_weight_int8pack_mm", "aten::_weight_int4pack_mm")),
    ("attention (SDPA kernel)", ("aten::_scaled_dot_product", "aten::scaled_dot_product")),
    ("KV gather / scatter / indexing", ("aten::index", "aten::index_copy", "aten::index_put", "aten::gather",
                                        "aten::embedding", "aten::index_select")),
    ("copies / layout (cat, clone, contiguous, to)", ("aten::copy_", "aten::cat", "aten::clone", "aten::contiguous",
                                                      "aten::_to_copy", "aten::empty", "aten::zeros", "aten::fill_")),
    ("argmax / sampling ops", ("aten::argmax", "aten::max", "aten::sort", "aten::topk", "aten::exponential_")),
)


class _Timer:
    """Accumulates wall time of wrapped callables, by label."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}  # of the current step
        self.active = False

    def wrap(self, label: str, fn: Any) -> Any:
        """``fn`` timed under ``label``; other attributes of ``fn`` (e.g. the sampler's
        ``generator``) read through."""
        return _Timed(self, label, fn)


class _Timed:
    """A callable that adds its wall time to a ``_Timer`` and forwards attribute reads."""

    def __init__(self, timer: _Timer, label: str, fn: Any) -> None:
        self._timer, self._label, self._fn = timer, label, fn

    def __call__(self, *a: Any, **kw: Any) -> Any:
        if not self._timer.active:
            return self._fn(*a, **kw)
        t = time.perf_counter()
        try:
            return self._fn(*a, **kw)
        finally:
            seconds = self._timer.seconds
            seconds[self._label] = seconds.get(self._label, 0.0) + time.perf_counter() - t

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fn, name)


def profile_kvflow(llm: Any, requests: list[BenchRequest], batch: int, steps: int) -> dict[str, Any]:
    """Break down kvflow decode steps with ``batch`` running requests.

    The engine's parts are wrapped per instance (nothing in kvflow is modified): the
    scheduler's ``schedule``/``update``, the runner's ``prepare_inputs``, the model forward,
    the LM head and the sampler; the rest of ``LLMEngine.step`` is engine bookkeeping
    (detokenization, outputs). A torch.profiler pass over the same kind of steps splits the
    operator time by kind.
    """
    from torch.profiler import ProfilerActivity, profile

    from kvflow import SamplingParams

    engine = llm.engine
    runner = engine.model_runner
    model = runner.model
    chosen = requests[:batch]
    budget = 2 * steps + 8
    for i, r in enumerate(chosen):
        engine.add_request(f"profile-{i}", r.prompt_token_ids, SamplingParams(temperature=0.0, max_tokens=budget, ignore_eos=True))
    started: set[str] = set()
    while len(started) < len(chosen):  # every request has its first token: all prefills are done
        started.update(o.request_id for o in engine.step())
    engine.step()
    contexts = [r.prompt_len + 2 for r in chosen]

    timer = _Timer()
    patched = [
        (engine.scheduler, "schedule", "scheduler.schedule"),
        (engine.scheduler, "update", "scheduler.update"),
        (runner, "prepare_inputs", "runner.prepare_inputs (batch metadata)"),
        (model, "forward", "model forward (30 layers)"),
        (model, "compute_logits", "LM head (logits)"),
        (runner, "sampler", "sampler"),
    ]
    originals = [(obj, name, getattr(obj, name), name in vars(obj)) for obj, name, _ in patched]
    for obj, name, label in patched:
        setattr(obj, name, timer.wrap(label, getattr(obj, name)))
    try:
        timer.active = True
        step_times = []
        per_step: list[dict[str, float]] = []
        load = OtherLoad().__enter__()
        for _ in range(steps):
            timer.seconds = {}
            t = time.perf_counter()
            engine.step()
            step_times.append(time.perf_counter() - t)
            per_step.append({**timer.seconds, "engine bookkeeping (detokenize, outputs, rest)":
                             step_times[-1] - sum(timer.seconds.values())})
        timer.active = False
        load.__exit__(None, None, None)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(min(steps, 5)):
                engine.step()
    finally:
        for obj, name, original, was_instance_attr in originals:
            if was_instance_attr:  # e.g. the runner's sampler object
                setattr(obj, name, original)
            else:  # a bound method: drop the shadowing instance attribute
                delattr(obj, name)
        for i in range(len(chosen)):
            engine.abort_request(f"profile-{i}")

    total = sum(step_times)
    # Medians per part: a shared machine adds rare multi-second stalls that a mean would absorb.
    parts = {k: statistics.median(step.get(k, 0.0) for step in per_step) for k in per_step[0]}
    op_total = 0.0
    kinds = {label: 0.0 for label, _ in _OP_KINDS}
    kinds["other ops (elementwise, norms, rotary, views)"] = 0.0
    top = []
    for evt in prof.key_averages():
        self_s = evt.self_cpu_time_total / 1e6
        op_total += self_s
        top.append((evt.key, self_s, evt.count))
        for label, prefixes in _OP_KINDS:
            if evt.key.startswith(prefixes):
                kinds[label] += self_s
                break
        else:
            kinds["other ops (elementwise, norms, rotary, views)"] += self_s
    top.sort(key=lambda x: -x[1])
    return {
        "batch": batch,
        "steps": steps,
        "mean_context_tokens": statistics.fmean(contexts),
        "step_ms_median": statistics.median(step_times) * 1e3,
        "step_ms_mean": total / steps * 1e3,
        "decode_tok_per_s": batch / statistics.median(step_times),
        "parts_ms": {k: v * 1e3 for k, v in parts.items()},
        "op_kinds_share": {k: v / op_total for k, v in kinds.items()},
        "top_ops": [{"op": k, "self_ms_per_step": v / min(steps, 5) * 1e3, "calls": c} for k, v, c in top[:12]],
        "other_load_cores": load.cores,
    }


def _fmt_load(cores: float | None) -> str:
    return "unknown" if cores is None else f"{cores:.2f} cores"


def print_profile(p: dict[str, Any]) -> None:
    print(f"kvflow decode step, batch {p['batch']} (mean context {p['mean_context_tokens']:.0f} tokens): "
          f"median {p['step_ms_median']:.1f} ms/step, {p['decode_tok_per_s']:.1f} tok/s; "
          f"other jobs' load {_fmt_load(p['other_load_cores'])}")
    print(format_table(["part of LLMEngine.step", "ms/step", "share"],
                       [[k, v, f"{v / p['step_ms_median']:.0%}"] for k, v in p["parts_ms"].items()]))
    print()
    print(format_table(["operator kind (torch.profiler self CPU)", "share"],
                       [[k, f"{v:.0%}"] for k, v in p["op_kinds_share"].items()]))
    print()
    print(format_table(["top operator", "self ms/step", "calls"],
                       [[o["op"], o["self_ms_per_step"], o["calls"]] for o in p["top_ops"]]))


# ---------------------------------------------------------------------------------- report
def _median_run(runs: list[dict[str, float]]) -> dict[str, Any]:
    keys = runs[0].keys()
    return {**{k: statistics.median(r[k] for r in runs) for k in keys}, "runs": runs}


def _prefix_match(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.contention:
        return run_contention(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    from kvflow import LLM, SamplingParams
    from kvflow.model.resolve import resolve_model

    loadavg_start = os.getloadavg()
    busy_start = wait_for_idle(args.wait_idle) if args.wait_idle > 0 else cpu_busy_fraction(1.0)
    if busy_start is not None and busy_start > 0.1:
        print(f"[throughput] warning: the CPUs are {busy_start:.0%} busy before the start (other jobs on this "
              "machine); they will slow and skew the numbers (see other_load_cores in the output)", file=sys.stderr)
    model_dir = resolve_model(args.model)
    engine_kwargs = kvflow_engine_kwargs(args)
    print(f"[throughput] loading kvflow {args.model} ({model_dir}) with {engine_kwargs}", file=sys.stderr)
    t = time.perf_counter()
    llm = LLM(model=args.model, **engine_kwargs)
    kv_load_s = time.perf_counter() - t

    requests = make_workload(
        llm.tokenizer,
        max(args.num_prompts, args.profile_batch or 0),
        args.seed,
        (args.min_prompt_len, args.max_prompt_len),
        (args.min_output_len, args.max_output_len),
    )
    if args.profile_batch is not None:
        profile_kvflow(llm, requests, args.profile_batch, 2)  # warm-up
        result = profile_kvflow(llm, requests, args.profile_batch, args.profile_steps)
        print_profile(result)
        return 0
    summary = workload_summary(requests)
    print(f"[throughput] workload: {summary}", file=sys.stderr)
    corpus = tokenize_corpus(llm.tokenizer)
    stream_prompt = corpus["GPL-3"][:STREAM_PROMPT_LEN]

    # Warm-up: a tiny batch with a prefill and a few decodes.
    llm.generate(
        [{"prompt_token_ids": stream_prompt}, {"prompt_token_ids": stream_prompt[:8]}],
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
        use_tqdm=False,
    )
    print("[throughput] kvflow generate ...", file=sys.stderr)
    with OtherLoad() as load:
        kv = run_kvflow(llm, requests)
    kv["other_load_cores"] = load.cores
    kv["process_cpu_s"] = load.own_cpu_s
    print(f"[throughput] kvflow: {kv['wall_s']:.1f} s, {kv['output_tokens_per_s']:.1f} output tok/s", file=sys.stderr)
    if not args.skip_stream:
        with OtherLoad() as load:
            kv["single_stream"] = _median_run(
                [kvflow_stream_decode(llm, stream_prompt, STREAM_NEW_TOKENS) for _ in range(args.stream_repeats)]
            )
        kv["single_stream"]["other_load_cores"] = load.cores

    hf = None
    hf_load_s = None
    if not args.skip_hf:
        print(f"[throughput] loading transformers from {model_dir}", file=sys.stderr)
        t = time.perf_counter()
        hf_model, hf_tok = load_hf(model_dir)
        hf_load_s = time.perf_counter() - t
        pad_id = hf_tok.eos_token_id
        warm = [BenchRequest(stream_prompt, 4, "GPL-3", 0), BenchRequest(stream_prompt[:8], 4, "GPL-3", 0)]
        hf_generate_batch(hf_model, warm, pad_id)  # warm-up: a padded batch, a prefill and a few decodes
        print(f"[throughput] transformers static batches of {args.hf_batch_size} ...", file=sys.stderr)
        with OtherLoad() as load:
            hf = run_hf(hf_model, requests, args.hf_batch_size, pad_id)
        hf["other_load_cores"] = load.cores
        hf["process_cpu_s"] = load.own_cpu_s
        print(f"[throughput] hf: {hf['wall_s']:.1f} s, {hf['output_tokens_per_s']:.1f} output tok/s", file=sys.stderr)
        if not args.skip_stream:
            with OtherLoad() as load:
                hf["single_stream"] = _median_run(
                    [hf_stream_decode(hf_model, stream_prompt, STREAM_NEW_TOKENS) for _ in range(args.stream_repeats)]
                )
            hf["single_stream"]["other_load_cores"] = load.cores

    # Greedy outputs of the two engines (same weights, float32) as a sanity check; they may
    # drift apart after a near-tie in the logits, so this is informative, not an assertion.
    agreement = None
    if hf is not None:
        matches = [_prefix_match(a, b) for a, b in zip(kv["_tokens"], hf["_tokens"])]
        agreement = {
            "identical_requests": sum(m == r.output_len for m, r in zip(matches, requests)),
            "mean_matching_prefix_tokens": statistics.fmean(matches),
            "mean_output_len": summary["output_len_mean"],
        }
    kv_tokens = kv.pop("_tokens")
    if hf is not None:
        hf.pop("_tokens")

    # ---- table
    headers = ["engine", "requests", "output tokens", "wall s", "requests/s", "output tok/s", "1-stream decode tok/s"]

    def row(name: str, r: dict[str, Any]) -> list[Any]:
        stream = r.get("single_stream", {}).get("decode_tok_per_s")
        return [name, r["num_requests"], r["output_tokens"], r["wall_s"], r["requests_per_s"], r["output_tokens_per_s"], stream]

    rows = [row("kvflow", kv)] + ([row("hf-static", hf)] if hf is not None else [])
    print()
    print(f"model {args.model}, {summary['num_requests']} requests, prompt {summary['prompt_tokens']} tokens, "
          f"output {summary['output_tokens']} tokens, seed {args.seed}, torch threads {torch.get_num_threads()}")
    print(f"kvflow: max_num_seqs={engine_kwargs['max_num_seqs']} max_num_batched_tokens="
          f"{engine_kwargs['max_num_batched_tokens']} block_size={engine_kwargs['block_size']} "
          f"num_kv_blocks={engine_kwargs['num_kv_blocks']} | hf-static: batch {args.hf_batch_size}, left padding")
    print(format_table(headers, rows))
    loads = {}
    for name, r in (("kvflow", kv), ("hf", hf)):
        if r is not None:
            loads[name] = r.get("other_load_cores")
            if "single_stream" in r:
                loads[f"{name} 1-stream"] = r["single_stream"].get("other_load_cores")
    print("other jobs' CPU load during the timed phases: " + ", ".join(f"{k} {_fmt_load(v)}" for k, v in loads.items()))
    cpu = [(name, r) for name, r in (("kvflow", kv), ("hf-static", hf)) if r is not None and r.get("process_cpu_s")]
    if cpu:
        print("output tokens per CPU-second of this process: "
              + ", ".join(f"{name} {r['output_tokens'] / r['process_cpu_s']:.1f}" for name, r in cpu))
    if any(v is not None and v > 0.2 for v in loads.values()):
        print("WARNING: other jobs shared the CPUs during a timed phase; rerun on a quiet machine (--wait-idle)")
    ratios = None
    if hf is not None:
        ratios = {
            "requests_per_s": kv["requests_per_s"] / hf["requests_per_s"],
            "output_tokens_per_s": kv["output_tokens_per_s"] / hf["output_tokens_per_s"],
        }
        if not args.skip_stream:
            ratios["single_stream_decode"] = (
                kv["single_stream"]["decode_tok_per_s"] / hf["single_stream"]["decode_tok_per_s"]
            )
        print("kvflow/hf: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
        print(f"hf-static wasted {hf['wasted_output_fraction']:.0%} of its generated tokens; greedy outputs "
              f"identical for {agreement['identical_requests']}/{len(requests)} requests "
              f"(mean matching prefix {agreement['mean_matching_prefix_tokens']:.0f} of "
              f"{agreement['mean_output_len']:.0f} tokens)")

    record = {
        "benchmark": "throughput",
        "config": {
            **{k: v for k, v in vars(args).items() if k != "out"},
            "model_dir": str(model_dir),
            "kvflow_engine": engine_kwargs,
            "stream_prompt_len": STREAM_PROMPT_LEN,
            "stream_new_tokens": STREAM_NEW_TOKENS,
            "decoding": "greedy (temperature 0), EOS ignored",
        },
        "machine": {
            **machine_info(),
            "loadavg_start": loadavg_start,
            "loadavg_end": os.getloadavg(),
            "cpu_busy_before_start": busy_start,
        },
        "workload": {**summary, "requests": request_dicts(requests)},
        "load_s": {"kvflow": kv_load_s, "hf": hf_load_s},
        "results": {"kvflow": kv, "hf-static": hf},
        "ratios_kvflow_over_hf": ratios,
        "greedy_agreement": agreement,
        "kvflow_output_tokens_sha256": hashlib.sha256(json.dumps(kv_tokens).encode()).hexdigest(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
