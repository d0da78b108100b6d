"""Cost of one linear layer against its number of rows, per weight format, on this CPU.

What it measures
----------------
y = x W^T for a weight W [N, K] (default 8960 x 1536, Qwen2.5-Coder-1.5B's MLP) and x with
M rows (M = 1, 2, 5, 16, 64: decode, speculative verification of k = 4, batches), for:

* ``aten-f32``    float32 ``F.linear`` (MKL);
* ``aten-bf16``   bfloat16 ``F.linear``;
* ``onednn-bf16`` bfloat16 with the weight prepacked for oneDNN (``kvflow.layers.linear``);
* ``int8-pack``   the INT8 method (``int8-kvflow`` where it runs, else ``int8-aten``, up to
                  64 rows);
* ``int8-aten``   PyTorch's ``_weight_int8pack_mm`` called directly;
* ``int8-kvflow`` kvflow's C++ kernel (``kvflow.layers.cpu_linear``) called directly;
* ``int4-pack``   the INT4 method, group 32 (``_weight_int4pack_mm_for_cpu`` up to 4 rows).

``--copies`` distinct weights (default 8) are cycled so that the weights do not stay in the
cache between calls, as in a model where each layer's weight is read once per step. The
median over ``--repeats`` sweeps is reported per call, in milliseconds, with the ratio to
one row ("x1") showing how the cost grows with the rows.

How to run
----------
    python -m benchmarks.micro_linear                    # defaults
    python -m benchmarks.micro_linear --n 3072 --k 576   # SmolLM2's fused gate/up

Prints a table and writes ``--out`` (default ``benchmarks/results/micro_linear.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.common import format_table, machine_info


def _formats(weight: torch.Tensor):
    """name -> callable(x) for every available format of ``weight`` (float32 [N, K])."""
    from kvflow.layers import cpu_linear
    from kvflow.layers.linear import LinearBase, PackedLinear, onednn_available
    from kvflow.quantization.registry import get_quantization_config

    k = weight.shape[1]
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight.data.copy_(weight)
    bf16 = weight.to(torch.bfloat16)
    formats = {
        "aten-f32": (torch.float32, lambda x, w=weight: F.linear(x, w)),
        "aten-bf16": (torch.bfloat16, lambda x, w=bf16: F.linear(x, w)),
    }
    if onednn_available():
        formats["onednn-bf16"] = (torch.bfloat16, PackedLinear(bf16))
    int8 = LinearBase.from_weights(linear.weight.data, None, get_quantization_config("int8"))
    formats["int8-pack"] = (torch.bfloat16, int8)
    if hasattr(torch.ops.aten, "_weight_int8pack_mm") and k % 16 == 0:
        scale = int8.scale.to(torch.bfloat16)
        formats["int8-aten"] = (torch.bfloat16, lambda x, w=int8.weight, s=scale: torch.ops.aten._weight_int8pack_mm(x, w, s))
    if cpu_linear.int8_available() and k % 16 == 0:
        formats["int8-kvflow"] = (torch.bfloat16, lambda x, w=int8.weight, s=int8.scale: cpu_linear.int8_linear(x, w, s))
    formats["int4-pack"] = (torch.bfloat16, LinearBase.from_weights(linear.weight.data, None, get_quantization_config("int4", 32)))
    return formats


def measure(n: int, k: int, rows: list[int], copies: int, repeats: int) -> dict[str, dict[int, float]]:
    """Median milliseconds per call, by format and row count."""
    torch.manual_seed(0)
    weights = [torch.randn(n, k) * 0.02 for _ in range(copies)]
    per_copy = [_formats(w) for w in weights]
    result: dict[str, dict[int, float]] = {}
    with torch.inference_mode():
        for name in per_copy[0]:
            dtype = per_copy[0][name][0]
            result[name] = {}
            for m in rows:
                x = torch.randn(m, k).to(dtype)
                fns = [f[name][1] for f in per_copy]
                for fn in fns:  # warm-up (and the int4 layer's one-time repacking)
                    fn(x)
                sweeps = []
                for _ in range(repeats):
                    t = time.perf_counter()
                    for fn in fns:
                        fn(x)
                    sweeps.append((time.perf_counter() - t) / len(fns))
                result[name][m] = statistics.median(sweeps) * 1e3
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.micro_linear", description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=8960, help="output features (default: %(default)s)")
    p.add_argument("--k", type=int, default=1536, help="input features (default: %(default)s)")
    p.add_argument("--rows", default="1,2,5,16,64", help="comma-separated row counts (default: %(default)s)")
    p.add_argument("--copies", type=int, default=8, help="distinct weights cycled (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=15, help="timed sweeps (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--out", default="benchmarks/results/micro_linear.json")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    result = measure(args.n, args.k, rows, args.copies, args.repeats)
    headers = ["format"] + [f"{m} rows ms" for m in rows] + [f"x1 at {rows[-1]}"]
    table = [[name] + [times[m] for m in rows] + [times[rows[-1]] / times[rows[0]]] for name, times in result.items()]
    print(f"linear {args.n} x {args.k}, {args.copies} weights cycled, median of {args.repeats}, "
          f"{torch.get_num_threads()} threads")
    print(format_table(headers, table))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "machine": machine_info(), "ms_per_call": result}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
