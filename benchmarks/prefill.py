"""Prefill on the CPU: the flash-attention kernel over the paged cache against gather + SDPA.

What it measures (every comparison in the same process, the two paths alternating)
-----------------------------------------------------------------------------------
* ``attention``: one layer's prefill attention (``CpuAttentionBackend.attend``) for one prompt of
  128 / 512 / 2,048 tokens with random K/V in a paged cache, the kernel
  (``KVFLOW_CPU_PREFILL_ATTENTION=1``) against gather + ``scaled_dot_product_attention`` (``=0``),
  for SmolLM2-135M's shape (9 query heads, 3 KV heads, head_dim 64) and Qwen2.5-0.5B's
  (14 / 2 / 64: GQA 7:1), in bfloat16 and float32; milliseconds per call (median).
* ``ttft``: the time to first token of the real SmolLM2-135M (``LLM.generate`` with
  ``max_tokens=1``, prefix caching off, the whole prompt in one step) for the same prompt
  lengths, kernel against gather + SDPA, for ``--configs`` (``bf16``: bfloat16 weights,
  ``fp32``: float32, ``gguf``: the default, the GGUF file computed as stored).
* ``--profile``: where one 512- and one 2,048-token prefill spends its time, per config and
  path: ``torch.profiler`` with labels put around the model's linears, norms, rotary
  embeddings, the attention backend (and inside it the K/V gather, SDPA, the kernel), the
  KV-cache write and the model forward; "rest of forward" is the forward's time outside them
  (embedding, SiLU x mul, residual adds, views, Python), "engine" the step outside the forward
  (scheduling, inputs, sampling).
* ``--decode-head-dims 16 256``: the decode kernel (``paged_decode_attention``) at those head
  dims against the same kernel built from ``--decode-baseline`` (a git revision's
  ``paged_attention.cpp``, built under another name and loaded into the same process; the two
  alternate), for ``--decode-seqs`` sequences of 64-300 tokens of context (block size 16):
  head dim 16 as kvflow's host-overhead tiny model (4 query heads, 2 KV heads, float32), 256 as
  Gemma 3 270M (4 / 1, bfloat16 and float32), any other as 8 / 2 in float32 and bfloat16;
  milliseconds per call (median), at ``--decode-threads`` torch threads.
* ``--prefill-baseline REV``: the prefill kernel (``paged_prefill_attention``) against the same
  kernel built from ``REV`` (as ``--decode-baseline``), both shapes, bfloat16 and float32 (and
  ``paged_attention_quantized`` over int8 and fp8 caches: the quantized cache's prefill), at
  each of ``--lengths``: ~4,096 query tokens a call (``--prefill-call-tokens``; whole prompts of
  that length: ``--prefill-call-tokens 512 --lengths 512`` is one prompt); then
  SmolLM2's end-to-end prefill of 4,096 prompt tokens a batch (for each length up to 512 and
  each of ``--configs``) with the two builds swapped in between batches of one process.
* ``--gemm``: ``torch.mm`` at the prefill shapes of SmolLM2's linears (M = prompt tokens), float32
  and bfloat16, in GFLOP/s against a large square product of the same dtype (the measured peak).

How to run
----------
    python -m benchmarks.prefill                     # attention + ttft, all configs
    python -m benchmarks.prefill --profile --gemm    # plus the profile and the GEMM table
    python -m benchmarks.prefill --skip-ttft --lengths 512
    python -m benchmarks.prefill --skip-attention --skip-ttft --decode-head-dims 16 256 --decode-baseline main
    python -m benchmarks.prefill --skip-attention --skip-ttft --prefill-baseline main --lengths 256 512 2048 \
        --configs gguf bf16

Prints tables and writes ``--out`` (default ``benchmarks/results/prefill.json``) with the CPU,
its ISA flags and torch's threads. On a machine other processes load, prefer the ratios (the
two paths of one row ran interleaved) to the absolute times.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("KVFLOW_CPU_KERNEL_BUILD", "wait")

from benchmarks.common import format_table, machine_info, tokenize_corpus  # noqa: E402  (kvflow before torch)

import torch  # noqa: E402

SWITCH = "KVFLOW_CPU_PREFILL_ATTENTION"
SHAPES = {"smollm2-135m": (9, 3, 64), "qwen2.5-0.5b": (14, 2, 64)}
CONFIGS = {
    "bf16": {"dtype": "bfloat16", "quantization": "none"},
    "fp32": {"dtype": "float32"},
    "gguf": {},
}


@contextmanager
def prefill_kernel(on: bool):
    old = os.environ.get(SWITCH)
    os.environ[SWITCH] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(SWITCH, None)
        else:
            os.environ[SWITCH] = old


def isa() -> str:
    """The vector ISA the kernels are built for here (from the host's flags)."""
    from kvflow.ops.build import host_cpu_flags

    flags = set(host_cpu_flags().split(":", 1)[-1].split())
    march = os.environ.get("KVFLOW_CPU_MARCH", "native")
    if march != "native":
        return f"-march={march}"
    if "avx512f" in flags:
        return "AVX-512" + (" + AVX512-BF16" if "avx512_bf16" in flags else "")
    return "AVX2" if "avx2" in flags else "portable"


# --- attention only -------------------------------------------------------------------------

def attention_case(heads: tuple[int, int, int], tokens: int, dtype: torch.dtype, repeats: int,
                   block_size: int = 16) -> dict[str, Any]:
    from kvflow.attention.backend import BatchLayout
    from kvflow.attention.cpu_backend import CpuAttentionBackend

    num_heads, num_kv_heads, head_dim = heads
    blocks = (tokens + block_size - 1) // block_size
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(blocks + 8, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(blocks + 8, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    table = torch.randperm(blocks + 8, generator=gen)[:blocks].tolist()
    q = torch.randn(tokens, num_heads, head_dim, generator=gen).to(dtype)
    backend = CpuAttentionBackend()
    layout = BatchLayout(torch.zeros(tokens, dtype=torch.int64), [tokens], [tokens], [table], [1], block_size,
                         torch.device("cpu"))
    metadata = backend.build_metadata(layout)
    scale = head_dim ** -0.5
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(repeats + 1):
        for on in (True, False):
            with prefill_kernel(on):
                start = time.perf_counter()
                backend.attend(q, (k_cache, v_cache), metadata, scale)
                if i:  # the first round warms up
                    times[on].append((time.perf_counter() - start) * 1e3)
    with prefill_kernel(True):
        new = backend.attend(q, (k_cache, v_cache), metadata, scale).float()
    with prefill_kernel(False):
        old = backend.attend(q, (k_cache, v_cache), metadata, scale).float()
    kernel_ms, sdpa_ms = statistics.median(times[True]), statistics.median(times[False])
    return {"kernel_ms": kernel_ms, "gather_sdpa_ms": sdpa_ms, "speedup": sdpa_ms / kernel_ms,
            "max_abs_diff": (new - old).abs().max().item()}


def run_attention(lengths: list[int], repeats: int) -> list[dict[str, Any]]:
    rows = []
    for name, heads in SHAPES.items():
        for dtype in (torch.bfloat16, torch.float32):
            for tokens in lengths:
                r = attention_case(heads, tokens, dtype, repeats if tokens < 2048 else max(2, repeats // 2))
                rows.append({"shape": name, "heads": list(heads), "dtype": str(dtype).removeprefix("torch."),
                             "tokens": tokens, **r})
    return rows


# --- decode attention, against a baseline build of the kernel --------------------------------

DECODE_SHAPES = {16: [((4, 2), torch.float32)], 256: [((4, 1), torch.bfloat16), ((4, 1), torch.float32)]}


def alternate(calls: dict[str, Any], repeats: int) -> dict[str, list[float]]:
    """Milliseconds of each call, the calls alternating, ``repeats`` rounds after one untimed."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for i in range(repeats + 1):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            if i:
                times[name].append((time.perf_counter() - start) * 1e3)
    return times


def baseline_attention_kernel(rev: str):
    """The paged-attention kernel built from ``rev``'s source (git show), as another module."""
    import subprocess
    import tempfile

    from kvflow.ops.build import CSRC, CppKernel

    src = subprocess.run(["git", "show", f"{rev}:kvflow/ops/csrc/paged_attention.cpp"], capture_output=True,
                         text=True, check=True, cwd=CSRC).stdout
    folder = Path(tempfile.gettempdir()) / "kvflow_decode_baseline"
    folder.mkdir(exist_ok=True)
    folder = folder / rev.replace("/", "_")  # the source beside its local headers (#include "...") at rev
    folder.mkdir(exist_ok=True)
    for header in re.findall(r'^#include "([^"]+)"', src, flags=re.M):
        text = subprocess.run(["git", "show", f"{rev}:kvflow/ops/csrc/{header}"], capture_output=True, text=True,
                              check=True, cwd=CSRC).stdout
        if not (folder / header).exists() or (folder / header).read_text() != text:
            (folder / header).write_text(text)
    path = folder / "paged_attention.cpp"
    if not path.exists() or path.read_text() != src:
        path.write_text(src)
    return CppKernel("kvflow_cpu_paged_attention_baseline", path, "KVFLOW_CPU_ATTENTION",
                     f"paged attention at {rev}").require()


def run_decode(head_dims: list[int], seqs: int, repeats: int, baseline: str | None, threads: int,
               block_size: int = 16) -> list[dict[str, Any]]:
    from kvflow.ops import PAGED_ATTENTION

    new = PAGED_ATTENTION.require()
    old = baseline_attention_kernel(baseline) if baseline else None
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    rows = []
    try:
        for hd in head_dims:
            for (nh, nkv), dtype in DECODE_SHAPES.get(hd, [((8, 2), torch.float32), ((8, 2), torch.bfloat16)]):
                gen = torch.Generator().manual_seed(0)
                ctx = torch.randint(64, 301, (seqs,), generator=gen)
                blocks = [-(-int(c) // block_size) for c in ctx]
                total = sum(blocks) + 8
                k = torch.randn(total, block_size, nkv, hd, generator=gen).to(dtype)
                v = torch.randn(total, block_size, nkv, hd, generator=gen).to(dtype)
                perm = torch.randperm(total, generator=gen)
                tables = torch.zeros(seqs, max(blocks), dtype=torch.int64)
                at = 0
                for i, b in enumerate(blocks):
                    tables[i, :b] = perm[at:at + b]
                    at += b
                q = torch.randn(seqs, nh, hd, generator=gen).to(dtype)
                lens = ctx.to(torch.int32)
                args = (q, k, v, tables, lens, hd ** -0.5)
                kernels = {"new": new, **({"baseline": old} if old else {})}
                times = alternate({name: (lambda mod=mod: mod.paged_decode_attention(*args))
                                   for name, mod in kernels.items()}, repeats)
                row: dict[str, Any] = {"head_dim": hd, "heads": [nh, nkv], "dtype": str(dtype).removeprefix("torch."),
                                       "seqs": seqs, "tokens": int(ctx.sum()),
                                       "new_ms": statistics.median(times["new"])}
                if old:
                    row["baseline_ms"] = statistics.median(times["baseline"])
                    row["speedup"] = row["baseline_ms"] / row["new_ms"]
                    row["max_abs_diff"] = (new.paged_decode_attention(*args).float()
                                           - old.paged_decode_attention(*args).float()).abs().max().item()
                rows.append(row)
    finally:
        torch.set_num_threads(saved)
    return rows


# --- prefill attention, against a baseline build of the kernel -------------------------------

def run_prefill_kernel(lengths: list[int], repeats: int, baseline: str, block_size: int = 16,
                       call_tokens: int = 4096) -> list[dict[str, Any]]:
    """``paged_prefill_attention`` (float caches) and ``paged_attention_quantized`` (int8 / fp8)
    of this checkout against ``baseline``'s build, alternating: for each shape, cache dtype and
    prompt length, ~``call_tokens`` query tokens a call (call_tokens // length prompts of that
    length, at least one, each its whole context, blocks scattered over the cache)."""
    from kvflow.ops import PAGED_ATTENTION

    from kvflow.attention.cpu_attention import code_table
    from kvflow.attention.kv_cache import quantize_kv

    kernels = {"new": PAGED_ATTENTION.require(), "baseline": baseline_attention_kernel(baseline)}
    rows = []
    for shape, (nh, nkv, hd) in SHAPES.items():
        for dtype in (torch.bfloat16, torch.float32, torch.int8, torch.float8_e4m3fn):
            for n in lengths:
                gen = torch.Generator().manual_seed(0)
                reqs = max(1, call_tokens // n)
                per = -(-n // block_size)
                total = reqs * per + 8
                tables = torch.randperm(total, generator=gen)[: reqs * per].view(reqs, per)
                starts = torch.arange(0, reqs * n + 1, n, dtype=torch.int32)
                lens = torch.full((reqs,), n, dtype=torch.int32)
                k = torch.randn(total, block_size, nkv, hd, generator=gen)
                v = torch.randn(total, block_size, nkv, hd, generator=gen)
                if dtype.is_floating_point and dtype.itemsize >= 2:  # a float cache: the tiled kernel
                    q = torch.randn(reqs * n, nh, hd, generator=gen).to(dtype)
                    args = (q, k.to(dtype), v.to(dtype), tables, starts, lens, hd ** -0.5, 0, torch.empty_like(q))
                    op = "paged_prefill_attention"
                else:  # an int8 / fp8 cache: every token as its own decode (paged_attention_quantized)
                    q = torch.randn(reqs * n, nh, hd, generator=gen)
                    (kq, ks), (vq, vs) = (quantize_kv(x.view(-1, nkv, hd), dtype) for x in (k, v))
                    lut, code_format = code_table(dtype)
                    args = (q, kq.view(torch.uint8).view(k.shape), vq.view(torch.uint8).view(v.shape),
                            ks.view(k.shape[:3]), vs.view(k.shape[:3]), lut, tables, starts, lens, hd ** -0.5,
                            code_format)
                    op = "paged_attention_quantized"
                times = alternate({name: (lambda mod=mod: getattr(mod, op)(*args))
                                   for name, mod in kernels.items()}, repeats)
                new_ms, base_ms = statistics.median(times["new"]), statistics.median(times["baseline"])
                diff = (getattr(kernels["new"], op)(*args).float()
                        - getattr(kernels["baseline"], op)(*args).float()).abs().max().item()
                rows.append({"shape": shape, "dtype": str(dtype).removeprefix("torch."), "tokens": n, "prompts": reqs,
                             "new_ms": new_ms, "baseline_ms": base_ms, "speedup": base_ms / new_ms,
                             "max_abs_diff": diff})
    return rows


def run_prefill_e2e(configs: list[str], prompts: int, tokens: int, rounds: int, baseline: str) -> list[dict[str, Any]]:
    """SmolLM2's end-to-end prefill (``LLM.generate`` of ``prompts`` random prompts of ``tokens``
    tokens, one output token, prefix caching off) with this checkout's prefill kernel and
    ``baseline``'s build swapped in between batches of one process (the order alternating per
    round): prompt tokens per second, median of ``rounds``."""
    import random

    from kvflow import LLM, SamplingParams
    from kvflow.attention import cpu_attention

    ext = cpu_attention._EXTENSION
    kernels = {"new": ext.require(), "baseline": baseline_attention_kernel(baseline)}
    rng = random.Random(0)
    rows = []
    for config in configs:
        llm = LLM(model="smollm2-135m", enable_prefix_caching=False, max_num_batched_tokens=4096, max_num_seqs=64,
                  max_step_seconds=0, num_threads=torch.get_num_threads(), **CONFIGS[config])
        params = SamplingParams(temperature=0.0, max_tokens=1)
        batch = lambda: [{"prompt_token_ids": [rng.randrange(100, 20000) for _ in range(tokens)]}  # noqa: E731
                         for _ in range(prompts)]
        rates: dict[str, list[float]] = {name: [] for name in kernels}
        try:
            llm.generate(batch()[:2], params, use_tqdm=False)  # warm-up
            for r in range(rounds):
                for name in (list(kernels) if r % 2 == 0 else list(kernels)[::-1]):
                    ext.require = lambda mod=kernels[name]: mod  # the instance's require, for this batch
                    work = batch()
                    start = time.perf_counter()
                    llm.generate(work, params, use_tqdm=False)
                    rates[name].append(prompts * tokens / (time.perf_counter() - start))
        finally:
            del ext.require  # the class's method again
        new, old = statistics.median(rates["new"]), statistics.median(rates["baseline"])
        rows.append({"config": config, "prompts": prompts, "tokens": tokens, "new_tok_s": new, "baseline_tok_s": old,
                     "speedup": new / old, "rounds": {k: [round(x) for x in v] for k, v in rates.items()}})
        del llm
    return rows


# --- end to end -----------------------------------------------------------------------------

def make_llm(config: str, max_len: int):
    from kvflow import LLM

    return LLM(model="smollm2-135m", enable_prefix_caching=False, max_num_batched_tokens=max(2048, max_len),
               max_step_seconds=0, max_model_len=max(2048, max_len) + 16, **CONFIGS[config])


def prompts_of(lengths: list[int], tokenizer) -> dict[int, list[int]]:
    ids = next(iter(tokenize_corpus(tokenizer).values()))
    return {n: ids[:n] for n in lengths}


def ttft(llm, prompt: list[int]) -> float:
    from kvflow import SamplingParams

    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    return (time.perf_counter() - start) * 1e3


def run_ttft(configs: list[str], lengths: list[int], repeats: int) -> list[dict[str, Any]]:
    rows = []
    for config in configs:
        llm = make_llm(config, max(lengths))
        prompts = prompts_of(lengths, llm.get_tokenizer())
        for n, prompt in prompts.items():
            times: dict[bool, list[float]] = {True: [], False: []}
            reps = repeats if n < 2048 else max(1, repeats // 2)
            for i in range(reps + 1):
                for on in (True, False):
                    with prefill_kernel(on):
                        t = ttft(llm, prompt)
                    if i:
                        times[on].append(t)
            new, old = statistics.median(times[True]), statistics.median(times[False])
            rows.append({"config": config, "tokens": n, "kernel_ms": new, "gather_sdpa_ms": old,
                         "speedup": old / new})
            print(f"  ttft {config} {n}: kernel {new:.0f} ms, gather+SDPA {old:.0f} ms", file=sys.stderr)
        del llm
    return rows


# --- profile --------------------------------------------------------------------------------

CATEGORIES = ["linears", "attention: gather K/V", "attention: SDPA", "attention: prefill kernel",
              "attention: rest", "KV write", "norms", "rotary", "rest of forward", "engine"]


def instrument(llm) -> None:
    """Put ``record_function`` labels around what the profile splits the time into."""
    from torch.autograd.profiler import record_function

    import torch.nn.functional as F
    from kvflow.attention import cpu_backend, torch_backend
    from kvflow.layers.embed_head import ParallelLMHead
    from kvflow.layers.linear import LinearBase
    from kvflow.layers.norm import RMSNorm
    from kvflow.layers.rotary import RotaryEmbedding

    def labelled(fn, label):
        if getattr(fn, "_prefill_bench_label", None):
            return fn

        def wrapper(*args, **kwargs):
            with record_function(label):
                return fn(*args, **kwargs)

        wrapper._prefill_bench_label = label
        return wrapper

    torch_backend.gather_kv = labelled(torch_backend.gather_kv, "attention: gather K/V")
    F.scaled_dot_product_attention = labelled(F.scaled_dot_product_attention, "attention: SDPA")
    cpu_backend.paged_prefill_attention = labelled(cpu_backend.paged_prefill_attention, "attention: prefill kernel")
    cls = cpu_backend.CpuAttentionBackend
    cls.attend = labelled(cls.attend, "attention")
    cls.write_kv = labelled(cls.write_kv, "KV write")

    model = llm.engine.model_runner.model
    stack: list[Any] = []

    def hooks(module, label):
        def pre(*_):
            rf = record_function(label)
            rf.__enter__()
            stack.append(rf)

        def post(*_):
            stack.pop().__exit__(None, None, None)

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)

    for m in model.modules():
        if isinstance(m, (LinearBase, ParallelLMHead)):
            hooks(m, "linears")
        elif isinstance(m, RMSNorm):
            hooks(m, "norms")
        elif isinstance(m, RotaryEmbedding):
            hooks(m, "rotary")
    hooks(model, "model forward")


def profile_one(llm, prompt: list[int], on: bool) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    with prefill_kernel(on):
        ttft(llm, prompt)  # warm
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            wall = ttft(llm, prompt)
    totals = {e.key: e.cpu_time_total / 1e3 for e in prof.key_averages()}
    t = {c: totals.get(c, 0.0) for c in CATEGORIES}
    t["attention: rest"] = totals.get("attention", 0.0) - sum(
        t[c] for c in ("attention: gather K/V", "attention: SDPA", "attention: prefill kernel"))
    forward = totals.get("model forward", 0.0)
    t["rest of forward"] = forward - sum(t[c] for c in CATEGORIES if c not in ("rest of forward", "engine"))
    t["engine"] = wall - forward
    t["total"] = wall
    return t


def run_profile(configs: list[str], lengths: list[int]) -> list[dict[str, Any]]:
    rows = []
    for config in configs:
        llm = make_llm(config, max(lengths))
        instrument(llm)
        prompts = prompts_of(lengths, llm.get_tokenizer())
        for n, prompt in prompts.items():
            for on in (False, True):
                t = profile_one(llm, prompt, on)
                rows.append({"config": config, "tokens": n, "path": "kernel" if on else "gather+SDPA", **t})
                print(f"  profile {config} {n} {'kernel' if on else 'gather+SDPA'}: {t['total']:.0f} ms", file=sys.stderr)
        del llm
    return rows


# --- GEMMs ----------------------------------------------------------------------------------

GEMM_SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def _gflops(m: int, n: int, k: int, dtype: torch.dtype, min_s: float = 0.3) -> float:
    a = torch.randn(m, k).to(dtype)
    w = torch.randn(k, n).to(dtype)
    torch.mm(a, w)
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_s:
        torch.mm(a, w)
        calls += 1
    return 2 * m * n * k * calls / (time.perf_counter() - start) / 1e9


def run_gemm(lengths: list[int]) -> list[dict[str, Any]]:
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        peak = _gflops(2048, 2048, 2048, dtype, 1.0)
        rows.append({"dtype": str(dtype).removeprefix("torch."), "op": "peak 2048^3", "m": 2048, "n": 2048,
                     "k": 2048, "gflops": peak, "of_peak": 1.0})
        for m in lengths:
            for op, (n, k) in GEMM_SHAPES.items():
                g = _gflops(m, n, k, dtype)
                rows.append({"dtype": str(dtype).removeprefix("torch."), "op": op, "m": m, "n": n, "k": k,
                             "gflops": g, "of_peak": g / peak})
    return rows


# --- main -----------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048], help="prompt lengths (tokens)")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per case (half at 2,048 tokens)")
    parser.add_argument("--skip-attention", action="store_true")
    parser.add_argument("--skip-ttft", action="store_true")
    parser.add_argument("--profile", action="store_true", help="also profile 512- and 2,048-token prefills")
    parser.add_argument("--gemm", action="store_true", help="also measure torch.mm at the prefill shapes")
    parser.add_argument("--decode-head-dims", type=int, nargs="+", default=[],
                        help="also time the decode kernel at these head dims (16 and 256 have fixed shapes)")
    parser.add_argument("--decode-baseline", default=None,
                        help="git revision whose paged_attention.cpp the decode timing compares against")
    parser.add_argument("--prefill-baseline", default=None,
                        help="a git revision: time the prefill kernel (paged_prefill_attention) against its build")
    parser.add_argument("--prefill-call-tokens", type=int, default=4096,
                        help="query tokens per --prefill-baseline kernel call (prompts = this // length, at least 1)")
    parser.add_argument("--skip-prefill-e2e", action="store_true",
                        help="with --prefill-baseline: only the kernels, not SmolLM2's end-to-end prefill")
    parser.add_argument("--decode-seqs", type=int, default=256, help="sequences per decode call")
    parser.add_argument("--decode-threads", type=int, default=1, help="torch threads for the decode timing")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/prefill.json"))
    args = parser.parse_args(argv)
    if args.prefill_call_tokens < 1:
        parser.error(f"--prefill-call-tokens must be >= 1, got {args.prefill_call_tokens}")

    from kvflow.attention.cpu_attention import cpu_kernel_available

    if not cpu_kernel_available():
        parser.error("the C++ paged-attention kernel is not available here (KVFLOW_CPU_KERNELS / KVFLOW_CPU_ATTENTION "
                     "off, or no compiler): nothing to compare")
    result: dict[str, Any] = {"machine": machine_info(), "isa": isa(), "args": {k: str(v) for k, v in vars(args).items()}}
    print(f"CPU: {result['machine']['cpu_model']}, {isa()}, {torch.get_num_threads()} threads\n")
    if not args.skip_attention:
        rows = result["attention"] = run_attention(args.lengths, args.repeats)
        print("One layer's prefill attention (ms per call; median)")
        print(format_table(["shape", "dtype", "tokens", "kernel", "gather+SDPA", "speedup", "max |diff|"],
                           [[r["shape"], r["dtype"], r["tokens"], r["kernel_ms"], r["gather_sdpa_ms"], r["speedup"],
                             f"{r['max_abs_diff']:.1e}"] for r in rows]) + "\n")
    if not args.skip_ttft:
        rows = result["ttft"] = run_ttft(args.configs, args.lengths, max(1, args.repeats // 2))
        print("SmolLM2-135M time to first token (ms; median; prefix caching off, one step)")
        print(format_table(["config", "tokens", "kernel", "gather+SDPA", "speedup"],
                           [[r["config"], r["tokens"], r["kernel_ms"], r["gather_sdpa_ms"], r["speedup"]]
                            for r in rows]) + "\n")
    if args.profile:
        lengths = [n for n in args.lengths if n in (512, 2048)] or args.lengths
        rows = result["profile"] = run_profile(args.configs, lengths)
        print("Where a prefill's time goes (ms, torch.profiler; the profiler's overhead included)")
        print(format_table(["config", "tokens", "path", "total", *CATEGORIES],
                           [[r["config"], r["tokens"], r["path"], r["total"], *[r[c] for c in CATEGORIES]]
                            for r in rows]) + "\n")
    if args.decode_head_dims:
        rows = result["decode"] = run_decode(args.decode_head_dims, args.decode_seqs, 4 * args.repeats,
                                             args.decode_baseline, args.decode_threads)
        print(f"Decode attention, {args.decode_seqs} sequences of 64-300 tokens (ms per call; median; "
              f"{args.decode_threads} thread(s)); baseline: {args.decode_baseline}")
        print(format_table(["head_dim", "heads", "dtype", "new", "baseline", "speedup", "max |diff|"],
                           [[r["head_dim"], f"{r['heads'][0]}/{r['heads'][1]}", r["dtype"], r["new_ms"],
                             r.get("baseline_ms", "-"), r.get("speedup", "-"),
                             f"{r['max_abs_diff']:.1e}" if "max_abs_diff" in r else "-"] for r in rows]) + "\n")
    if args.prefill_baseline:
        rows = result["prefill_kernel"] = run_prefill_kernel(args.lengths, args.repeats, args.prefill_baseline,
                                                             call_tokens=args.prefill_call_tokens)
        print(f"The prefill kernels, ~{args.prefill_call_tokens} query tokens a call (ms per call; median); "
              f"baseline: {args.prefill_baseline}")
        print(format_table(["shape", "dtype", "tokens x prompts", "new", "baseline", "speedup", "max |diff|"],
                           [[r["shape"], r["dtype"], f"{r['tokens']} x {r['prompts']}", r["new_ms"], r["baseline_ms"],
                             r["speedup"], f"{r['max_abs_diff']:.1e}"] for r in rows]) + "\n")
        rows = result["prefill_e2e"] = [] if args.skip_prefill_e2e else [
            row for n in args.lengths if n <= 512
            for row in run_prefill_e2e(args.configs, 4096 // n, n, 2 * args.repeats, args.prefill_baseline)]
        if rows:
            print(f"SmolLM2-135M end-to-end prefill, {4096} prompt tokens a batch, kernels swapped between batches "
                  f"(prompt tok/s; median); baseline: {args.prefill_baseline}")
            print(format_table(["config", "prompts x tokens", "new", "baseline", "speedup"],
                               [[r["config"], f"{r['prompts']} x {r['tokens']}", r["new_tok_s"], r["baseline_tok_s"],
                                 r["speedup"]] for r in rows]) + "\n")
    if args.gemm:
        rows = result["gemm"] = run_gemm(args.lengths)
        print("torch.mm at SmolLM2's prefill shapes (GFLOP/s; peak = a 2048^3 product of the same dtype)")
        print(format_table(["dtype", "op", "M", "N", "K", "GFLOP/s", "of peak"],
                           [[r["dtype"], r["op"], r["m"], r["n"], r["k"], r["gflops"], r["of_peak"]] for r in rows])
              + "\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
