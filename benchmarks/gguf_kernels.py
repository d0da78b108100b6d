"""GGUF quantized linears computed as stored (``kvflow.layers.gguf_kernels``) on this CPU.

What it measures
----------------
y = x W^T for W [N, K] stored as GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)
and x float32 with M rows (1: decode; 4, 16, 64: speculative verification and batches; 512:
prefill), per call in milliseconds, and the effective bandwidth of the weight read (stored
weight bytes / time, GB/s), against ``F.linear`` with the same weight dense in bfloat16 and
in float32 **in the same run**. Shapes: SmolLM2-135M (K=576: N=576, 192, 1536; K=1536:
N=576) and Qwen2.5-1.5B (K=1536: N=8960; K=8960: N=1536).

Enough distinct copies of each weight (at least ``--cycle-mb`` MB together) are cycled that
a call does not find its weight in the caches, as in a model where each layer's weight is
read once per step. A cell is the median over ``--repeats`` sweeps of the copies.

``gguf`` is the integer kernel where it is built (the ISA is printed), else the PyTorch
fallback; ``--path dequant`` measures dequantize-to-float32 + ``F.linear`` instead (the
large-M alternative).

How to run
----------
    python -m benchmarks.gguf_kernels                          # everything (a few minutes)
    python -m benchmarks.gguf_kernels --formats Q4_0 Q6_K --m 1 --shapes qwen

Prints a table and writes ``--out`` (default ``benchmarks/results/gguf_kernels.json``).
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
from kvflow.layers import gguf_kernels as gk

Q = gguf.GGMLQuantizationType
SHAPES = {
    "smollm2": [(576, 576), (192, 576), (1536, 576), (576, 1536)],
    "qwen": [(8960, 1536), (1536, 8960)],
}


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


def _time(fns: list, x: torch.Tensor, repeats: int) -> float:
    """Median seconds per call over ``repeats`` sweeps of the callables (one warm-up sweep)."""
    for f in fns:
        f(x)
    sweeps = []
    for _ in range(repeats):
        t = time.perf_counter()
        for f in fns:
            f(x)
        sweeps.append((time.perf_counter() - t) / len(fns))
    return statistics.median(sweeps)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", nargs="+", default=[t.name for t in sorted(gk.SUPPORTED_QTYPES)])
    ap.add_argument("--m", nargs="+", type=int, default=[1, 4, 16, 64, 512])
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    ap.add_argument("--dense", nargs="*", default=["bf16", "f32"], choices=["bf16", "f32"])
    ap.add_argument("--path", choices=["kernel", "dequant"], default="kernel")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cycle-mb", type=float, default=48.0, help="MB of distinct weight copies cycled")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/gguf_kernels.json"))
    args = ap.parse_args(argv)

    info = machine_info()
    info["isa"] = gk.kernel_isa()
    info["path"] = args.path
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
            if args.path == "kernel":
                fns = [lambda x, w=w: gk.gguf_linear(x, w) for w in ws]
            else:
                fns = [lambda x, w=w: F.linear(x, w.dequantize(torch.float32)) for w in ws]
            cases.append((name, nbytes, fns))
        for dense in args.dense:
            dtype = torch.bfloat16 if dense == "bf16" else torch.float32
            nbytes = n * k * dtype.itemsize
            copies = max(2, min(64, int(args.cycle_mb * 2**20 // nbytes) + 1))
            ws = [torch.randn(n, k).to(dtype) for _ in range(copies)]
            cases.append((f"dense-{dense}", nbytes, [lambda x, w=w: F.linear(x.to(w.dtype), w) for w in ws]))
        for m in args.m:
            x = torch.randn(m, k)
            big = m * n * k >= 2e9  # a prefill-sized product: compute-bound, two copies and two sweeps do
            reps = 2 if big else args.repeats
            for name, nbytes, fns in cases:
                fns_m = fns[:2] if big else fns
                s = _time(fns_m, x, reps)
                rec = {"n": n, "k": k, "m": m, "format": name, "ms": s * 1e3, "weight_bytes": nbytes,
                       "gb_per_s": nbytes / s / 1e9, "gflop_per_s": 2 * m * n * k / s / 1e9}
                results.append(rec)
                rows.append([f"{n}x{k}", m, name, rec["ms"], rec["gb_per_s"], rec["gflop_per_s"]])
                print(f"{n}x{k} M={m:<4d} {name:<10s} {rec['ms']:9.3f} ms  {rec['gb_per_s']:7.1f} GB/s  "
                      f"{rec['gflop_per_s']:7.1f} GFLOP/s", flush=True)
    print()
    print(format_table(["N x K", "M", "format", "ms/call", "weight GB/s", "GFLOP/s"], rows))
    record = {"machine": info, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print(f"\nwrote {args.out}")
    return record


if __name__ == "__main__":
    main()
