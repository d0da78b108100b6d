"""GGUF quantized linears computed as stored (``kvflow.layers.gguf_kernels``) on this CPU.

What it measures
----------------
y = x W^T for W [N, K] stored as GGUF blocks (default Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K; also
Q5_1, Q5_K) and x float32 with M rows (1: decode; 4, 16, 64: speculative verification and
batches; 512: prefill), per call in microseconds, and the effective bandwidth of the weight read
(stored weight bytes / time, GB/s), for each path **in the same run**:

* ``packed``: ``gguf_linear`` as a model runs it (rows interleaved 8 at a time at load,
  ``GGUFWeight.pack``);
* ``stored``: the kernel on the stored row-major blocks (``gguf_linear`` before the packed
  layout: the baseline);
* ``dense-bf16`` / ``dense-f32``: ``F.linear`` on a dense bfloat16 / float32 weight of the shape;
* ``packed-baseline`` (with ``--baseline-repo PATH``): the packed kernel of another checkout
  (say main's, before a kernel change): its ``kvflow/ops/csrc/gguf_matmul.cpp`` built as a
  second extension (its own name, the same compiler flags) and loaded into this process, its
  weights packed by its own ``gguf_pack_fast``, called as ``gguf_linear`` calls the packed
  kernel. Its cells and ``packed``'s are timed interleaved, sweep by sweep, so the load of a
  shared machine falls on both alike; the table then gives ``packed``'s speedup over it.

Shapes: SmolLM2-135M (K=576: N=576, 192, 1536; K=1536: N=576), Qwen2.5-0.5B (K=896: N=896,
128, 4864; K=4864: N=896) and Qwen2.5-1.5B (K=1536: N=8960; K=8960: N=1536); a format whose
block does not divide K is skipped (GGUF files store such tensors in another type).

Enough distinct copies of each weight (at least ``--cycle-mb`` MB together) are cycled that
a call does not find its weight in the caches, as in a model where each layer's weight is
read once per step. A cell is the fastest of ``--repeats`` sweeps of the copies.

The ISA of the kernel's integer products is printed (``kernel_isa()``); without the kernel
the GGUF paths are PyTorch's dequantize + ``F.linear``.

``--profile-matrices MODEL`` replays the GGUF matrices of one single-stream decode step of a
GGUF model (its decoder linears' stored segments in layer order, then the LM head in its
stored format) with M = 1: per matrix (role, format, N x K) the median time of one call and
its weight bytes per second, the step's total, the machine's read bandwidth (a float32
sum of 512 MB, 1 thread and all) in the same run, and the rate of one of its weights called
again and again (the fastest of 21 calls in a row, from the caches where it fits them: the
kernel's compute ceiling; far above the step's rate, the kernel waits on memory). The step
outside these matrices (norms, rotary, attention, sampling, Python) is the fused step's time
less this total.

How to run
----------
    python -m benchmarks.gguf_kernels                          # everything (a few minutes)
    python -m benchmarks.gguf_kernels --formats Q4_0 Q6_K --m 1 --shapes qwen1.5b
    python -m benchmarks.gguf_kernels --profile-matrices qwen2.5-coder-1.5b --out /tmp/m.json
    # the prefill GEMM against main's kernel, same run (GOPS = 2 M N K / time):
    python -m benchmarks.gguf_kernels --baseline-repo ../main --paths packed --dense \
        --formats Q4_1 Q4_K Q6_K Q5_0 Q8_0 --m 1 4 16 64 256 512 2048

``--prefill MODEL`` (with ``--baseline-repo``) instead times the end-to-end prefill of one
``--prefill-tokens``-token prompt (``LLM(model=MODEL)``, one output token) with this
checkout's kernel and the baseline's, alternated request by request in one process (the
linears' module swapped between requests), and the share of ``gguf_linear`` in it.

Prints a table and writes ``--out`` (default ``benchmarks/results/gguf_kernels.json``).

``--profile-decode MODEL`` instead profiles single-stream decode steps of a GGUF model served
as stored (``LLM(model=MODEL)``, the default ``quantization="gguf"``) with ``torch.profiler``:
two greedy generations of one prompt, 2 and 2 + ``--profile-steps`` new tokens, whose
difference is that many decode steps; per step, the wall time split into the GGUF kernel's C++
calls (the LM head, and the decoder's linears where the fused step does not apply), the fused
decode step's one C++ call (``kvflow.layers.fused_decode``: the whole decoder, its GGUF
matrices included: ``--profile-matrices`` splits those out), the other operators (self CPU
time of every profiled op) and the rest (Python and the other C++ kernels, which the profiler
does not see), and the top-level calls per step and per decoder layer. Then, unprofiled, the
wall time of each engine step (``ModelRunner.execute``) of one ``--profile-steps``-token
generation: median, p90, p99 and the slowest steps with their positions (stalls).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.common import format_table, machine_info
from kvflow import huge_pages
from kvflow.layers import fused_decode
from kvflow.layers import gguf_kernels as gk

Q = gguf.GGMLQuantizationType
SHAPES = {
    "smollm2": [(576, 576), (192, 576), (1536, 576), (576, 1536)],
    "qwen0.5b": [(896, 896), (128, 896), (4864, 896), (896, 4864)],
    "qwen1.5b": [(8960, 1536), (1536, 8960)],
    # The LM heads (vocabulary x hidden): SmolLM2's, Qwen2.5's.
    "heads": [(49152, 576), (151936, 896)],
}
DEFAULT_FORMATS = ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"]


def _random_raw(qt, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """Valid blocks of random quant bits with fp16 scales in a sane range (the speed does not
    depend on the values)."""
    size, bpb = gguf.GGML_QUANT_SIZES[qt]
    nb = n * k // size
    b = rng.integers(0, 256, (nb, bpb), dtype=np.uint8)
    offsets = {Q.Q6_K: [208], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q4_1: [0, 2], Q.Q5_1: [0, 2]}.get(qt, [0])
    for off in offsets:
        b[:, off:off + 2] = rng.uniform(1e-4, 1e-2, nb).astype(np.float16).view(np.uint8).reshape(nb, 2)
    return torch.from_numpy(b.reshape(n, -1))


def _time_interleaved(cases: list[list], x: torch.Tensor, repeats: int) -> list[float]:
    """Seconds per call of each case (a list of callables): like :func:`_time`, but the cases'
    sweeps alternate (case 0, case 1, ..., case 0, ...), so a change in the machine's load
    falls on all of them alike."""
    for fns in cases:
        for f in fns:
            f(x)
    best = [float("inf")] * len(cases)
    for _ in range(repeats):
        for i, fns in enumerate(cases):
            t = time.perf_counter()
            for f in fns:
                f(x)
            best[i] = min(best[i], (time.perf_counter() - t) / len(fns))
    return best


def load_baseline(repo: Path):
    """The GGUF kernel of another checkout ``repo`` (its ``kvflow/ops/csrc/gguf_matmul.cpp``),
    built as a separate extension with this checkout's compiler flags and loaded here.

    Raises:
        ValueError: when repo has no such source, or the build fails.
    """
    from kvflow.ops.build import CppKernel

    source = Path(repo).resolve() / "kvflow" / "ops" / "csrc" / "gguf_matmul.cpp"
    if not source.is_file():
        raise ValueError(f"--baseline-repo: {source} does not exist")
    module = CppKernel("kvflow_cpu_gguf_matmul_baseline", source, "KVFLOW_CPU_GGUF", "baseline GGUF kernel").load()
    if module is None:
        raise ValueError(f"--baseline-repo: the kernel {source} could not be built (see the log)")
    return module


def _packed_call(module, qt, n: int, k: int):
    """gguf_linear's packed-kernel call on ``module``: f(x, packed) -> y [M, n]."""
    def call(x, packed):
        y = torch.empty(x.shape[0], n, dtype=x.dtype)
        module.gguf_linear_packed(x, packed, int(qt), n, k, None, y)
        return y
    return call


def prefill(model: str, tokens: int, rounds: int, baseline, out: Path) -> dict:
    """End-to-end prefill of one ``tokens``-token prompt (one output token) with this
    checkout's GGUF kernel and ``baseline``'s, alternated per request (see the docstring)."""
    import random

    from kvflow import LLM, SamplingParams

    llm = LLM(model=model, enable_prefix_caching=False)  # (every request a fresh prompt besides)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    ours = gk._EXTENSION.load()
    if ours is None:
        raise ValueError("the GGUF kernel is not available here (KVFLOW_CPU_KERNELS=0?)")
    real = gk._EXTENSION

    class Swap:  # gk._EXTENSION's stand-in: load() returns the module under test
        module = ours

        def load(self):
            return self.module

        def require(self):
            return self.module

    swap = Swap()
    linear_s = [0.0]
    inner = gk.gguf_linear

    def timed_linear(*a, **kw):
        t = time.perf_counter()
        try:
            return inner(*a, **kw)
        finally:
            linear_s[0] += time.perf_counter() - t

    rng = random.Random(0)
    prompts = [[rng.randrange(100, 20000) for _ in range(tokens)] for _ in range(2 * (rounds + 1))]
    times: dict[str, list[float]] = {"packed": [], "packed-baseline": []}
    linear: dict[str, list[float]] = {"packed": [], "packed-baseline": []}
    gk._EXTENSION, gk.gguf_linear = swap, timed_linear
    import kvflow.layers.embed_head as embed_head
    import kvflow.quantization.gguf as gguf_method
    patched = [m for m in (gguf_method, embed_head) if getattr(m, "gguf_linear", None) is inner]
    for m in patched:
        m.gguf_linear = timed_linear
    try:
        for r in range(rounds + 1):
            for i, (name, module) in enumerate((("packed", ours), ("packed-baseline", baseline)) if r % 2 else
                                               (("packed-baseline", baseline), ("packed", ours))):
                ids = prompts[2 * r + i]
                swap.module = module
                linear_s[0] = 0.0
                t = time.perf_counter()
                llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
                if r:  # the first round warms up
                    times[name].append(time.perf_counter() - t)
                    linear[name].append(linear_s[0])
    finally:
        gk._EXTENSION, gk.gguf_linear = real, inner
        for m in patched:
            m.gguf_linear = inner
    rec = {"model": model, "tokens": tokens, "rounds": rounds, "isa": gk.kernel_isa()}
    rows = []
    for name in times:
        med, lin = statistics.median(times[name]), statistics.median(linear[name])
        rec[name] = {"prefill_ms": med * 1e3, "gguf_linear_ms": lin * 1e3, "all_ms": [t * 1e3 for t in times[name]]}
        rows.append([name, med * 1e3, lin * 1e3, 100 * lin / med])
    rec["speedup"] = rec["packed-baseline"]["prefill_ms"] / rec["packed"]["prefill_ms"]
    print(f"# {model}: prefill of one {tokens}-token prompt, medians of {rounds} alternated requests each; "
          f"kernel ISA {gk.kernel_isa()}")
    print(format_table(["kernel", "prefill ms", "gguf_linear ms", "gguf_linear %"], rows))
    print(f"speedup (baseline / this): {rec['speedup']:.2f}x")
    record = {"machine": {**machine_info(), "isa": gk.kernel_isa()}, "prefill": rec}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    print(f"\nwrote {out}")
    return record


def _time(fns: list, x: torch.Tensor, repeats: int) -> float:
    """Seconds per call: the fastest of ``repeats`` sweeps of the callables (one warm-up sweep;
    the fastest, since on a shared machine the slower sweeps measure the other load)."""
    for f in fns:
        f(x)
    sweeps = []
    for _ in range(repeats):
        t = time.perf_counter()
        for f in fns:
            f(x)
        sweeps.append((time.perf_counter() - t) / len(fns))
    return min(sweeps)


def profile_decode(model: str, steps: int, out: Path) -> dict:
    """Profile ``steps`` single-stream decode steps of ``model`` (see the module docstring)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from kvflow import LLM, SamplingParams

    llm = LLM(model=model)
    module = gk._EXTENSION.load()
    if module is not None:  # time the kernel's C++ calls as profiler ranges
        for name in ("gguf_linear_packed", "gguf_linear", "gguf_dequantize"):
            fn = getattr(module, name)

            def timed(*args, fn=fn, name=name):
                with record_function(f"gguf::{name}"):
                    return fn(*args)

            setattr(module, name, timed)
    prompt = "The history of the printing press begins"
    llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))  # warm-up
    net = llm.engine.model_runner.model
    step = net.__dict__.get("fused_decode")
    fused = isinstance(step, fused_decode.FusedDecodeStep)
    if fused:  # time the fused step's C++ call as a profiler range
        step.decoder = _TimedDecoder(step.decoder, record_function)

    def run(new_tokens: int) -> tuple[float, dict]:
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t = time.perf_counter()
            llm.generate([prompt], params)
            wall = time.perf_counter() - t
        events = prof.events()
        kernel = sum(e.cpu_time_total for e in events if e.name.startswith("gguf::")) / 1e6
        fused_call = sum(e.cpu_time_total for e in events if e.name == _TimedDecoder.NAME) / 1e6
        ops_self = sum(e.self_cpu_time_total for e in events if e.name != _TimedDecoder.NAME) / 1e6
        top = [e for e in events if e.cpu_parent is None]
        calls: dict[str, int] = {}
        for e in top:
            calls[e.name] = calls.get(e.name, 0) + 1
        return wall, {"kernel": kernel, "fused": fused_call, "ops": ops_self - kernel, "top_calls": len(top),
                      "calls": calls}

    short_wall, short = run(2)
    long_wall, long = run(2 + steps)
    layers = getattr(llm.engine.model_config, "num_hidden_layers", None)
    step = (long_wall - short_wall) / steps
    kernel = (long["kernel"] - short["kernel"]) / steps
    fused_ms = (long["fused"] - short["fused"]) / steps
    ops = (long["ops"] - short["ops"]) / steps
    dispatches = (long["top_calls"] - short["top_calls"]) / steps
    per_op = {k: (long["calls"].get(k, 0) - short["calls"].get(k, 0)) / steps for k in long["calls"]}
    per_op = dict(sorted(((k, v) for k, v in per_op.items() if v >= 1), key=lambda kv: -kv[1]))
    rec = {"model": model, "isa": gk.kernel_isa(), "fused_decode": fused, "steps": steps, "step_ms": step * 1e3,
           "gguf_kernel_ms": kernel * 1e3, "fused_call_ms": fused_ms * 1e3, "other_ops_ms": ops * 1e3,
           "python_and_rest_ms": (step - kernel - fused_ms - ops) * 1e3,
           "dispatches_per_step": dispatches, "layers": layers,
           "dispatches_per_layer": dispatches / layers if layers else None, "calls_per_step": per_op}
    print(f"# {model}: one decode step {rec['step_ms']:.2f} ms = GGUF kernel {rec['gguf_kernel_ms']:.2f} ms + fused "
          f"decode call {rec['fused_call_ms']:.2f} ms + other operators {rec['other_ops_ms']:.2f} ms + the rest "
          f"{rec['python_and_rest_ms']:.2f} ms (Python, and the other C++ kernels: attention, RMSNorm, rotary; under "
          f"the profiler); {dispatches:.0f} top-level calls per step"
          + (f", {rec['dispatches_per_layer']:.1f} per layer" if layers else ""))
    print(format_table(["top-level call", "per step"], [[k, v] for k, v in list(per_op.items())[:25]]))
    rec["step_times"] = _step_times(llm, prompt, steps)
    st = rec["step_times"]
    print(f"\n# engine step wall times over one {steps}-token generation, unprofiled (ms): "
          f"median {st['median_ms']:.2f}, p90 {st['p90_ms']:.2f}, p99 {st['p99_ms']:.2f}, max {st['max_ms']:.2f}; "
          "slowest (step, ms): "
          + ", ".join(f"({i}, {ms:.1f})" for i, ms in st["slowest"]))
    record = {"machine": {**machine_info(), "isa": gk.kernel_isa()}, "profile": rec}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    print(f"\nwrote {out}")
    return record


class _TimedDecoder:
    """The fused step's C++ ``FusedDecoder`` with each ``forward`` call a profiler range
    (``NAME``); every other attribute is the decoder's own."""

    NAME = "fused::FusedDecoder.forward"

    def __init__(self, decoder, record_function) -> None:
        self._decoder, self._record = decoder, record_function

    def forward(self, *args):
        with self._record(self.NAME):
            return self._decoder.forward(*args)

    def __getattr__(self, name):
        return getattr(self._decoder, name)


def _step_times(llm, prompt: str, steps: int) -> dict:
    """Wall time of each engine step (``ModelRunner.execute``) of one greedy generation of
    ``steps`` tokens: median / p90 / p99 / max in ms and the 5 slowest (step index, ms)."""
    from kvflow import SamplingParams

    runner = llm.engine.model_runner
    execute, times = runner.execute, []

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return execute(*args, **kwargs)
        finally:
            times.append(time.perf_counter() - t)

    runner.execute = timed
    try:
        llm.generate([prompt], SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True), use_tqdm=False)
    finally:
        del runner.execute
    ms = sorted(t * 1e3 for t in times)

    def pct(q: float) -> float:
        return ms[min(len(ms) - 1, int(q * len(ms)))]

    slowest = sorted(enumerate(t * 1e3 for t in times), key=lambda it: -it[1])[:5]
    return {"steps": len(ms), "median_ms": statistics.median(ms), "p90_ms": pct(0.9), "p99_ms": pct(0.99),
            "max_ms": ms[-1], "slowest": slowest, "all_ms": [t * 1e3 for t in times]}


def read_bandwidth(mb: int = 512, repeats: int = 5) -> dict[int, float]:
    """This machine's read bandwidth, GB/s: the fastest of ``repeats`` float32 sums of an
    ``mb`` MB tensor (far past the caches), with 1 thread and with torch's thread count."""
    x = torch.ones(mb * 2**20 // 4)
    threads = torch.get_num_threads()
    out = {}
    for t in sorted({1, threads}):
        torch.set_num_threads(t)
        best = min(_timed(lambda: x.sum()) for _ in range(repeats))
        out[t] = x.numel() * 4 / best / 1e9
    torch.set_num_threads(threads)
    return out


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def profile_matrices(model: str, steps: int, out: Path) -> dict:
    """Replay one single-stream decode step's GGUF matrices of ``model`` (see the module
    docstring): per matrix (role, format, N x K) the median time of one M = 1 call and its
    weight GB/s; against the machine's read bandwidth measured in the same run."""
    from kvflow import LLM

    llm = LLM(model=model)
    net = llm.engine.model_runner.model
    calls = []  # (role, weight) in the order a step computes them
    for i, layer in enumerate(net.layers):
        for role, lin in (("qkv", layer.self_attn.qkv_proj), ("o", layer.self_attn.o_proj),
                          ("gate_up", layer.mlp.gate_up_proj), ("down", layer.mlp.down_proj)):
            for seg in getattr(lin, "gguf_segments", []):
                if isinstance(seg.weight, gk.GGUFWeight):
                    calls.append((role, seg.weight))
    head = net.lm_head.stored_gguf
    if head is not None:
        calls.append(("lm_head", head))
    dtype = net.norm.weight.dtype
    times = [[] for _ in calls]
    for _ in range(steps + 1):  # the first step warms up (packs at first use)
        for j, (_role, w) in enumerate(calls):
            x = torch.randn(1, w.k).to(dtype)
            times[j].append(_timed(lambda: gk.gguf_linear(x, w)))
    groups: dict[tuple, dict] = {}
    for (role, w), ts in zip(calls, times):
        key = (role, w.qtype.name, w.n, w.k)
        g = groups.setdefault(key, {"role": role, "format": w.qtype.name, "n": w.n, "k": w.k, "per_step": 0,
                                    "us": [], "bytes": w.n * gk.row_bytes(w.qtype, w.k)})
        g["per_step"] += 1
        g["us"].append(statistics.median(ts[1:]) * 1e6)
        if "hot_us" not in g:  # one weight called again and again: from the caches where it fits them
            x = torch.randn(1, w.k).to(dtype)
            g["hot_us"] = min(_timed(lambda: gk.gguf_linear(x, w)) for _ in range(21)) * 1e6  # fastest: a ceiling
    bw = read_bandwidth()
    rows, recs = [], []
    total_ms = total_bytes = 0.0
    for g in groups.values():
        us = statistics.median(g["us"])
        ms = us * g["per_step"] / 1e3
        total_ms += ms
        total_bytes += g["bytes"] * g["per_step"]
        rec = {k: v for k, v in g.items() if k != "us"} | {"us_per_call": us, "ms_per_step": ms,
                                                          "gb_per_s": g["bytes"] / us / 1e3,
                                                          "hot_gb_per_s": g["bytes"] / g["hot_us"] / 1e3}
        recs.append(rec)
        rows.append([g["role"], g["format"], f"{g['n']}x{g['k']}", g["per_step"], us, ms, rec["gb_per_s"],
                     g["bytes"] / 2**20, rec["hot_gb_per_s"]])
    rows.append(["all", "", "", len(calls), "", total_ms, total_bytes / total_ms / 1e6, total_bytes / 2**20, ""])
    threads = torch.get_num_threads()
    print(f"# {model}: the GGUF matrices of one decode step, M = 1, {threads} threads, kernel ISA {gk.kernel_isa()}; "
          f"read bandwidth (float32 sum of 512 MB): " + ", ".join(f"{t} thread(s) {v:.1f} GB/s" for t, v in bw.items()))
    print(format_table(["matrix", "format", "N x K", "per step", "us/call", "ms/step", "weight GB/s", "MiB",
                        "same weight again: GB/s"], rows))
    print("(same weight again: the fastest of 21 calls of one matrix in a row, read from the caches where it fits "
          "them (L3): the kernel's compute ceiling; against the step's rate, which streams every weight from memory)")
    record = {"machine": {**machine_info(), "isa": gk.kernel_isa()}, "model": model,
              "read_bandwidth_gb_s": {str(t): v for t, v in bw.items()}, "matrices": recs,
              "total_ms": total_ms, "total_bytes": total_bytes}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    print(f"\nwrote {out}")
    return record


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", nargs="+", default=DEFAULT_FORMATS,
                    choices=[t.name for t in sorted(gk.SUPPORTED_QTYPES)])
    ap.add_argument("--m", nargs="+", type=int, default=[1, 4, 16, 64])
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["smollm2", "qwen0.5b"])
    ap.add_argument("--paths", nargs="+", default=["packed", "stored"], choices=["packed", "stored"])
    ap.add_argument("--dense", nargs="*", default=["bf16"], choices=["bf16", "f32"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cycle-mb", type=float, default=48.0, help="MB of distinct weight copies cycled")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's); 1 with a small --cycle-mb times the kernel's "
                    "arithmetic from the caches")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/gguf_kernels.json"))
    ap.add_argument("--profile-decode", metavar="MODEL", default=None,
                    help="profile single-stream decode steps of this GGUF model instead (see above)")
    ap.add_argument("--profile-steps", type=int, default=32)
    ap.add_argument("--profile-matrices", metavar="MODEL", default=None,
                    help="time each GGUF matrix of one decode step of this model instead (see above)")
    ap.add_argument("--baseline-repo", type=Path, default=None,
                    help="also time the packed kernel of this checkout (e.g. main's), interleaved (see above)")
    ap.add_argument("--prefill", metavar="MODEL", default=None,
                    help="with --baseline-repo: time the end-to-end prefill of this model instead (see above)")
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--prefill-rounds", type=int, default=5)
    args = ap.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            ap.error("--threads must be at least 1")
        torch.set_num_threads(args.threads)
    baseline = load_baseline(args.baseline_repo) if args.baseline_repo else None
    if args.prefill:
        if baseline is None:
            ap.error("--prefill needs --baseline-repo")
        return prefill(args.prefill, args.prefill_tokens, args.prefill_rounds, baseline, args.out)
    if args.profile_decode:
        return profile_decode(args.profile_decode, args.profile_steps, args.out)
    if args.profile_matrices:
        return profile_matrices(args.profile_matrices, min(args.profile_steps, 10), args.out)

    info = machine_info()
    info["isa"] = gk.kernel_isa()
    module = gk._EXTENSION.load()
    print(f"# CPU: {info['cpu_model']}, {info['torch_num_threads']} threads; GGUF kernel ISA: "
          f"{info['isa'] or 'none (PyTorch fallback)'}; torch {info['torch']}")
    rng = np.random.default_rng(0)
    results, rows = [], []
    for n, k in [s for name in args.shapes for s in SHAPES[name]]:
        cases = []
        for name in args.formats:
            qt = Q[name]
            if k % gk.block_layout(qt)[0]:
                print(f"# {name}: K={k} is not a multiple of its block; skipped (GGUF files store such tensors "
                      f"in another type)")
                continue
            nbytes = gk.row_bytes(qt, k) * n
            copies = max(2, min(64, int(args.cycle_mb * 2**20 // nbytes) + 1))
            ws = [gk.GGUFWeight(_random_raw(qt, n, k, rng), qt, n, k) for _ in range(copies)]
            for path in args.paths:
                if path == "packed":
                    if module is not None:
                        for w in ws:
                            w.pack(release_raw=True)  # as a model's linears hold it
                    fns = [lambda x, w=w: gk.gguf_linear(x, w) for w in ws]
                    if baseline is not None and module is not None:
                        # both kernels called alike (the module's call, no Python wrapper), their
                        # weights packed alike (huge-page memory, as GGUFWeight.pack places them):
                        # the baseline's on ordinary pages read 1.1-1.6x slower at M = 1 from that alone
                        ours_call = _packed_call(module, qt, n, k)
                        fns = [lambda x, p=w.packed, f=ours_call: f(x, p) for w in ws]
                        call = _packed_call(baseline, qt, n, k)
                        base = [baseline.gguf_pack_fast(w.raw, int(qt), n, k,
                                                        huge_pages.empty(gk.packed_shape(qt, n, k))) for w in ws]
                        cases.append((f"{name} packed-baseline", nbytes,
                                      [lambda x, p=p, f=call: f(x, p) for p in base]))
                elif module is None:
                    continue
                else:  # the kernel on the stored row-major blocks (the baseline)
                    raws = [w.raw for w in ws]

                    def stored(x, raw, qt=qt, n=n, k=k):
                        y = torch.empty(x.shape[0], n, dtype=x.dtype)
                        module.gguf_linear(x, raw, int(qt), n, k, None, y)
                        return y

                    fns = [lambda x, raw=raw, f=stored: f(x, raw) for raw in raws]
                cases.append((f"{name} {path}", nbytes, fns))
        for dense in args.dense:  # the dense weight of the same shape, in F.linear
            dtype = torch.bfloat16 if dense == "bf16" else torch.float32
            nbytes = n * k * dtype.itemsize
            copies = max(2, min(64, int(args.cycle_mb * 2**20 // nbytes) + 1))
            ws = [torch.randn(n, k).to(dtype) for _ in range(copies)]
            cases.append((f"dense-{dense}", nbytes, [lambda x, w=w: F.linear(x.to(w.dtype), w) for w in ws]))
        for m in args.m:
            x = torch.randn(m, k)
            big = m * n * k >= 2e9  # a prefill-sized product: compute-bound, two copies and two sweeps do
            reps = 2 if big else args.repeats
            if big and baseline is not None:
                reps = 3
            # (with a baseline all cases alternate sweep by sweep; else each case's sweeps run together)
            secs = (_time_interleaved([fns[:2] if big else fns for _, _, fns in cases], x, reps) if baseline is not None
                    else [_time(fns[:2] if big else fns, x, reps) for _, _, fns in cases])
            by_case = {}
            for (name, nbytes, fns), s in zip(cases, secs):
                rec = {"n": n, "k": k, "m": m, "case": name, "us": s * 1e6, "weight_bytes": nbytes,
                       "gb_per_s": nbytes / s / 1e9, "gflop_per_s": 2 * m * n * k / s / 1e9}
                by_case[name] = rec
                results.append(rec)
            for name, rec in by_case.items():  # packed's speedup over the baseline in this cell
                if name.endswith(" packed-baseline") and name[:-len("-baseline")] in by_case:
                    ours = by_case[name[:-len("-baseline")]]
                    ours["speedup_vs_baseline"] = rec["us"] / ours["us"]
            for name, rec in by_case.items():
                speedup = rec.get("speedup_vs_baseline")
                rows.append([f"{n}x{k}", m, name, rec["us"], rec["gb_per_s"], rec["gflop_per_s"],
                             "" if speedup is None else f"{speedup:.2f}x"])
                print(f"{n}x{k} M={m:<4d} {name:<22s} {rec['us']:10.1f} us  {rec['gb_per_s']:7.1f} GB/s  "
                      f"{rec['gflop_per_s']:7.1f} GFLOP/s" + ("" if speedup is None else f"  {speedup:.2f}x"), flush=True)
    print()
    print(format_table(["N x K", "M", "case", "us/call", "weight GB/s", "GFLOP/s (GOPS)", "vs baseline"], rows))
    record = {"machine": info, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "baseline_repo": str(args.baseline_repo.resolve()) if args.baseline_repo else None,
              "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print(f"\nwrote {args.out}")
    return record


if __name__ == "__main__":
    main()
