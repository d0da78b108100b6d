"""Cost of one mixture-of-experts layer's experts against the token count, per implementation.

What it measures
----------------
The routed SwiGLU experts of one MoE layer (``kvflow.layers.moe``: x [T, hidden], stacked
w13 [E, 2 I, hidden] and w2 [E, hidden, I], top-k routing from random router logits) for
T = 1, 2, 8, 16, 32 tokens (decode batches up to a short prefill chunk), by:

* ``loop``        one matmul pair per expert with tokens (index_select / index_add_);
* ``grouped_mm``  ``torch._grouped_mm`` over the rows sorted by expert (one call per projection);
* ``gather_bmm``  ``torch.bmm`` over the gathered weights of every (token, expert) pair;
* ``dense``       all experts on all tokens (two batched matmuls), routed weights applied after;
* ``int8``/``int4``/``fp8`` the quantized expert methods (``kvflow.quantization.moe``), bfloat16
  activations, where ``--quantized``;
* ``gguf-q8_0``/``gguf-q4_0`` experts kept as a GGUF file's blocks (``GGUFMoEMethod``: the
  int8-dot kernels of ``kvflow/ops/csrc/gguf_matmul.cpp``), bfloat16 activations, where ``--gguf``.

Shapes (``--shapes``): "mixtral-small" E=8, k=2, hidden 1024, I 768; "qwen3moe-small" E=64,
k=8, hidden 512, I 256; "qwen3moe-mid" E=64, k=8, hidden 1024, I 768 (not by default: 600 MB
of float32 weights per copy). ``--copies`` distinct layers are cycled so that weights do not
stay in the cache between calls, as in a model. Each call is timed alone, ``--repeats`` times
per copy; the minimum (the least disturbed by other processes on a shared machine) and the
median are reported in milliseconds.

How to run
----------
    python -m benchmarks.micro_moe --threads 1              # the measurement in kvflow/layers/moe.py
    python -m benchmarks.micro_moe --threads 1 --quantized  # plus the int8 / int4 / fp8 experts
    python -m benchmarks.micro_moe --threads 1 --gguf --dtypes bfloat16   # GGUF experts as stored

Prints a table and writes ``--out`` (default ``benchmarks/results/micro_moe.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import format_table, machine_info

SHAPES = {
    "mixtral-small": dict(num_experts=8, top_k=2, hidden=1024, inter=768),
    "qwen3moe-small": dict(num_experts=64, top_k=8, hidden=512, inter=256),
    "qwen3moe-mid": dict(num_experts=64, top_k=8, hidden=1024, inter=768),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _layers(shape: dict, dtype: torch.dtype, copies: int, quantized: list[str]):
    """name -> list of callables(x, topk_weights, topk_ids), one per copy."""
    from kvflow.layers.moe import EXPERT_IMPLS, FusedMoE
    from kvflow.quantization.registry import get_quantization_config

    e, h, i = shape["num_experts"], shape["hidden"], shape["inter"]
    out: dict[str, list] = {name: [] for name in EXPERT_IMPLS}
    out.update({f"{q}": [] for q in quantized})
    for _ in range(copies):
        w13 = (torch.randn(e, 2 * i, h) * 0.02).to(dtype)
        w2 = (torch.randn(e, h, i) * 0.02).to(dtype)
        for name, fn in EXPERT_IMPLS.items():
            out[name].append(lambda x, tw, ti, fn=fn, w13=w13, w2=w2: fn(x, w13, w2, tw, ti))
        for q in quantized:
            if q.startswith("gguf-"):
                out[q].append(_gguf_layer(shape, w13, w2, q.removeprefix("gguf-").upper()))
                continue
            layer = FusedMoE(e, shape["top_k"], h, i, True, get_quantization_config(q, 32), prefix="bench.experts")
            layer.w13_weight.data.copy_(w13.float())
            layer.w2_weight.data.copy_(w2.float())
            layer.quant_method.process_weights_after_loading(layer)
            out[q].append(lambda x, tw, ti, layer=layer: layer.quant_method.apply(layer, x, tw, ti))
        del w13, w2
    return out


def _gguf_layer(shape: dict, w13: torch.Tensor, w2: torch.Tensor, qtype_name: str):
    """A ``GGUFMoEMethod`` layer over ``w13`` / ``w2`` quantized per expert to ``qtype_name``."""
    import gguf
    import numpy as np

    from kvflow.layers.gguf_kernels import GGUFWeight
    from kvflow.layers.moe import FusedMoE
    from kvflow.quantization.gguf import GGUFConfig

    qtype = gguf.GGMLQuantizationType[qtype_name]
    e, h, i = shape["num_experts"], shape["hidden"], shape["inter"]
    layer = FusedMoE(e, shape["top_k"], h, i, True, GGUFConfig(), prefix="bench.experts")
    for x in range(e):
        for part, t, param in (("w1", w13[x, :i], layer.w13_weight), ("w3", w13[x, i:], layer.w13_weight),
                               ("w2", w2[x], layer.w2_weight)):
            raw = np.ascontiguousarray(gguf.quants.quantize(t.float().numpy(), qtype))
            layer.weight_loader(param, GGUFWeight(torch.from_numpy(raw), qtype, t.shape[0], t.shape[1]), (x, part))
    layer.quant_method.process_weights_after_loading(layer)
    return lambda x, tw, ti: layer.quant_method.apply(layer, x, tw, ti)


def measure(shape: dict, dtype: torch.dtype, tokens: list[int], copies: int, repeats: int,
            quantized: list[str]) -> dict[str, dict[int, float]]:
    """{"min", "median"} milliseconds per call, by implementation and token count."""
    torch.manual_seed(0)
    impls = _layers(shape, dtype, copies, quantized)
    result: dict[str, dict[int, float]] = {name: {} for name in impls}
    with torch.inference_mode():
        for t in tokens:
            x = torch.randn(t, shape["hidden"]).to(dtype)
            logits = torch.randn(t, shape["num_experts"])
            probs = torch.softmax(logits, -1)
            tw, ti = torch.topk(probs, shape["top_k"], -1)
            for name, calls in impls.items():
                xin = x if name in ("loop", "grouped_mm", "gather_bmm", "dense") else x.to(torch.bfloat16)
                for call in calls:  # warm-up (int4 packs on first use)
                    call(xin, tw, ti)
                samples = []
                for _ in range(repeats):
                    for call in calls:
                        start = time.perf_counter()
                        call(xin, tw, ti)
                        samples.append((time.perf_counter() - start) * 1e3)
                result[name][t] = {"min": min(samples), "median": statistics.median(samples)}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["mixtral-small", "qwen3moe-small"], choices=list(SHAPES))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPES))
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 8, 16, 32])
    parser.add_argument("--copies", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--quantized", action="store_true", help="also the int8 / int4 / fp8 expert methods")
    parser.add_argument("--gguf", action="store_true", help="also GGUF experts kept as Q8_0 / Q4_0 blocks")
    parser.add_argument("--out", default="benchmarks/results/micro_moe.json")
    args = parser.parse_args(argv)
    quantized = (["int8", "int4", "fp8"] if args.quantized else []) + (["gguf-q8_0", "gguf-q4_0"] if args.gguf else [])
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    runs = []
    for shape_name in args.shapes:
        for dtype_name in args.dtypes:
            shape = SHAPES[shape_name]
            # Quantized methods take float32 weights and bfloat16 activations: measured once per shape.
            quant = quantized if dtype_name == args.dtypes[-1] else []
            result = measure(shape, DTYPES[dtype_name], args.tokens, args.copies, args.repeats, quant)
            runs.append({"shape": shape_name, **shape, "dtype": dtype_name, "ms": result})
            rows = [[name, *(f"{ms[t]['min']:.3f} / {ms[t]['median']:.3f}" for t in args.tokens)]
                    for name, ms in result.items()]
            print(f"\n{shape_name} {shape} {dtype_name}: ms per call, min / median", flush=True)
            print(format_table(["impl", *(f"T={t}" for t in args.tokens)], rows), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"machine": machine_info(), "tokens": args.tokens, "copies": args.copies, "repeats": args.repeats,
              "threads": torch.get_num_threads(), "runs": runs}
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
