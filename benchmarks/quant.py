"""Quantized deployment benchmark: size, speed and accuracy of each scheme against float32.

    python -m benchmarks.quant [--models smollm2-135m[,qwen2.5-coder-0.5b,...]]
        [--schemes fp32,int8,int4,int4-awq,fp8,gguf,kv-int8,kv-fp8] [--out benchmarks/results/quant.json]

For every model and scheme, in one run:

- weight bytes (the model's saved tensors; decoder linears separately) and KV cache bytes
  per token;
- decode tokens/s, single-stream and at batch 16 (greedy, ``ignore_eos``, 64 new tokens
  after a 32-token prompt of real text; time from the step that produced the first token to
  the last one, so prefill is excluded). The machine is shared, so every scheme's timing is
  paired with a float32 timing taken right before it on the same float32 engine, and the
  speedup is the ratio of the best of ``--repeats`` runs of each (``--slow-schemes``, FP8 by
  default, decode ``--slow-new-tokens`` tokens once: FP8 has no CPU matmul and dequantizes
  every weight at every step);
- perplexity on /usr/share/common-licenses/GPL-3 in ``--ppl-windows`` non-overlapping windows
  of ``--ppl-window-len`` tokens: every window is a separate prompt whose tokens are scored
  given the previous ones of the same window (``prompt_logprobs=0`` returns the actual next
  token's log-prob at each position, from one prefill through the engine's model and KV cache);
- how many of the single-stream run's 64 greedy tokens match float32's before the first
  difference.

Schemes: ``fp32`` (baseline, always run), ``bf16`` (bfloat16 weights and compute), ``int8``, ``int4`` (round-to-nearest, group
``--group-size``; ``int4-g32`` / ``int4-g64`` / ``int4-g128`` pick the group), ``int4-awq``,
``fp8``, ``gguf`` (the GGUF file's own quantized tensors, repacked), ``kv-int8`` / ``kv-fp8``
(float32 weights, quantized KV cache). A suffix ``@bf16`` runs a scheme with bfloat16
activations (``dtype="bfloat16"``: the quantized kernels take bfloat16 inputs anyway, and the
norms, attention and LM head then run in bfloat16 on oneDNN-packed weights instead of
float32), e.g. ``int8@bf16``; a suffix ``+head`` quantizes the LM head too
(``quantize_lm_head``), e.g. ``int4-g32@bf16+head``, and ``+head-int8`` (``-int4``, ``-fp8``)
quantizes it with that scheme, e.g. ``int4-g32@bf16+head-int8``. Targets checked: INT8 perplexity within 1% of float32
and >= 1.5x single-stream decode; INT4 within 5% and >= 2x; the INT8 KV cache half the bytes
of a 16-bit cache (plus its float16 scales, 2 bytes per token, head and K/V) with perplexity
within 0.5%.

Prints a table and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import common

DEFAULT_SCHEMES = "fp32,int8,int4,int4-awq,fp8,gguf,kv-int8,kv-fp8"
TEXT = Path("/usr/share/common-licenses/GPL-3")

# target: (max relative perplexity change, min single-stream decode speedup)
TARGETS = {"int8": (0.01, 1.5), "int4": (0.05, 2.0), "int4-awq": (0.05, 2.0)}
KV_INT8_PPL_TARGET = 0.005


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.quant", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="smollm2-135m", help="comma-separated short names / paths")
    p.add_argument("--schemes", default=DEFAULT_SCHEMES, help=f"comma-separated (default {DEFAULT_SCHEMES})")
    p.add_argument("--out", default="benchmarks/results/quant.json")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads, the same for every scheme")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--ppl-windows", type=int, default=8)
    p.add_argument("--ppl-window-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2, help="timed runs per measurement (best is kept)")
    p.add_argument("--group-size", type=int, default=128, help="INT4 group size for 'int4' and 'int4-awq'")
    p.add_argument("--slow-schemes", default="fp8",
                   help="schemes timed over --slow-new-tokens tokens, once (FP8 dequantizes every weight every step on the CPU)")
    p.add_argument("--slow-new-tokens", type=int, default=8)
    return p.parse_args(argv)


def scheme_options(scheme: str, group_size: int) -> dict[str, Any]:
    """EngineArgs for a scheme name.

    Raises:
        ValueError: for an unknown scheme.
    """
    if scheme.endswith("+head"):  # "<scheme>+head": the LM head quantized too (quantize_lm_head)
        return {**scheme_options(scheme[: -len("+head")], group_size), "quantize_lm_head": True}
    for method in ("int8", "int4", "fp8"):  # "<scheme>+head-int8": the LM head in INT8 whatever the scheme
        if scheme.endswith("+head-" + method):
            return {**scheme_options(scheme[: -len("+head-" + method)], group_size), "quantize_lm_head": method}
    if "@" in scheme:  # "<scheme>@bf16": the same weights with bfloat16 activations / compute
        base, compute = scheme.split("@", 1)
        if compute != "bf16":
            raise ValueError(f"unknown compute dtype {compute!r} in scheme {scheme!r} (only @bf16)")
        return {**scheme_options(base, group_size), "dtype": "bfloat16"}
    if scheme == "fp32":
        return {}
    if scheme == "bf16":
        return {"dtype": "bfloat16"}
    if scheme in ("int8", "fp8", "gguf", "int4-awq"):
        return {"quantization": scheme, "quantization_group_size": group_size}
    if scheme == "int4":
        return {"quantization": "int4", "quantization_group_size": group_size}
    if scheme.startswith("int4-g"):
        return {"quantization": "int4", "quantization_group_size": int(scheme[len("int4-g"):])}
    if scheme in ("kv-int8", "kv-fp8"):
        return {"kv_cache_dtype": scheme[3:]}
    raise ValueError(f"unknown scheme {scheme!r}")


def target_key(scheme: str) -> str | None:
    scheme = scheme.split("+head", 1)[0].split("@", 1)[0]
    if scheme.startswith("int4-g"):
        return "int4"
    return scheme if scheme in TARGETS or scheme == "kv-int8" else None


def machine_info(threads: int) -> dict[str, Any]:
    """benchmarks.common.machine_info plus the CPU's vector extensions, load and command."""
    try:
        flags = next(l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    try:
        load = Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        load = None
    return {
        **common.machine_info(),
        "cpu_isa": [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in flags],
        "torch_num_threads": threads,
        "loadavg_at_start": load,
        "command": "python -m benchmarks.quant " + " ".join(sys.argv[1:]),
    }


# ---------------------------------------------------------------------------- measurements


class Runner:
    """One engine for one scheme of one model, and its measurements."""

    def __init__(self, model: str, scheme: str, args: argparse.Namespace) -> None:
        from kvflow import LLM

        self.scheme = scheme
        window_tokens = args.ppl_windows * args.ppl_window_len
        decode_tokens = args.batch * (args.prompt_len + args.new_tokens)
        start = time.perf_counter()
        options = scheme_options(scheme, args.group_size)
        self.llm = LLM(
            model=model,
            dtype=options.pop("dtype", "float32"),
            device="cpu",
            enable_prefix_caching=False,
            num_kv_blocks=-(-max(window_tokens, decode_tokens) // 16) + 2 * args.batch + 8,
            max_num_seqs=max(args.batch, args.ppl_windows),
            max_num_batched_tokens=max(2 * args.ppl_window_len, args.batch * args.prompt_len),
            **options,
        )
        self.load_s = time.perf_counter() - start
        self.engine = self.llm.engine

    def warm_up(self, prompt: list[int]) -> None:
        from kvflow import SamplingParams

        # first calls pack INT4 weights for the CPU kernel and warm oneDNN: not timed
        self.llm.generate([{"prompt_token_ids": prompt}] * 2, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        self.llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)

    def perplexity(self, windows: list[list[int]]) -> dict[str, float]:
        from kvflow import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, ignore_eos=True)
        start = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        nll, count = 0.0, 0
        for window, out in zip(windows, outs):
            for entry, token in zip(out.prompt_logprobs, window[1:]):
                nll -= entry[token]
                count += 1
        return {"ppl": math.exp(nll / count), "nll_per_token": nll / count, "scored_tokens": count, "seconds": elapsed}

    def decode(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
        """Decode tokens/s over all requests (first token's step to the last), and the tokens."""
        from kvflow import SamplingParams

        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        start = max(o.metrics["first_token_time"] for o in outs)
        end = max(o.metrics["finished_time"] for o in outs)
        tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
        return tokens / (end - start), [o.outputs[0].token_ids for o in outs]

    def sizes(self) -> dict[str, int]:
        from kvflow.layers.linear import linear_layers
        from kvflow.quantization.checkpoint import weight_bytes

        model = self.engine.model_runner.model
        linears = sum(weight_bytes(layer) for layer in linear_layers(model))
        config = self.engine.model_config
        return {
            "weight_bytes": weight_bytes(model),
            "decoder_linear_bytes": linears,
            "kv_bytes_per_token": config.kv_bytes_per_token(self.engine.cache_config.dtype),
            "kv_bytes_per_token_16bit": config.kv_bytes_per_token(torch.float16),
            "head_dim": config.head_dim,
        }

    def close(self) -> None:
        shutdown = getattr(self.engine, "shutdown", None)
        if shutdown is not None:
            shutdown()
        self.llm = self.engine = None
        gc.collect()


def best_paired(base: Runner, other: Runner | None, prompts: list[list[int]], new_tokens: int, repeats: int):
    """Best-of-``repeats`` decode tokens/s of the float32 engine and of ``other``, the runs
    alternating so that both see the same machine load."""
    base_best, other_best, base_tokens, other_tokens = 0.0, 0.0, None, None
    for _ in range(repeats):
        tps, base_tokens = base.decode(prompts, new_tokens)
        base_best = max(base_best, tps)
        if other is not None:
            tps, other_tokens = other.decode(prompts, new_tokens)
            other_best = max(other_best, tps)
    return base_best, other_best, base_tokens, other_tokens


def matching_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run_model(model: str, schemes: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    print(f"[{model}] loading float32 ...", flush=True)
    base = Runner(model, "fp32", args)
    ids = base.llm.tokenizer.encode(TEXT.read_text(encoding="utf-8"), add_special_tokens=False)
    wl, nw, pl = args.ppl_window_len, args.ppl_windows, args.prompt_len
    if len(ids) < nw * wl + args.batch * pl:
        raise ValueError(f"{TEXT} has {len(ids)} tokens; need {nw * wl + args.batch * pl}")
    windows = [ids[i * wl : (i + 1) * wl] for i in range(nw)]
    prompts = [ids[nw * wl + j * pl : nw * wl + (j + 1) * pl] for j in range(args.batch)]
    base.warm_up(prompts[0])
    base_ppl = base.perplexity(windows)
    rows: list[dict[str, Any]] = []
    fp32_single, fp32_batch = [], []
    slow_schemes = {x.strip() for x in args.slow_schemes.split(",") if x.strip()}
    for scheme in schemes:
        print(f"[{model}] {scheme} ...", flush=True)
        other = None if scheme == "fp32" else Runner(model, scheme, args)
        runner = other or base
        try:
            if other is not None:
                other.warm_up(prompts[0])
            ppl = base_ppl if other is None else other.perplexity(windows)
            slow = scheme in slow_schemes
            new_tokens = args.slow_new_tokens if slow else args.new_tokens
            repeats = 1 if slow else args.repeats
            b1, s1, base_tok, tok = best_paired(base, other, prompts[:1], new_tokens, repeats)
            bb, sb, _, _ = best_paired(base, other, prompts, new_tokens, repeats)
            if not slow:
                fp32_single.append(b1)
                fp32_batch.append(bb)
            if other is None:
                s1, sb, tok = b1, bb, base_tok
            row = {
                "model": model,
                "scheme": scheme,
                "options": scheme_options(scheme, args.group_size),
                "load_seconds": runner.load_s,
                **runner.sizes(),
                "ppl": ppl["ppl"],
                "nll_per_token": ppl["nll_per_token"],
                "ppl_scored_tokens": ppl["scored_tokens"],
                "ppl_seconds": ppl["seconds"],
                "ppl_rel_change": ppl["ppl"] / base_ppl["ppl"] - 1.0,
                "decode_tps_single": s1,
                "decode_tps_batch": sb,
                "paired_fp32_tps_single": b1,
                "paired_fp32_tps_batch": bb,
                "speedup_single": s1 / b1,
                "speedup_batch": sb / bb,
                "greedy_match_tokens": matching_prefix(tok[0], base_tok[0]),
                "greedy_tokens": new_tokens,
                "decode_new_tokens": new_tokens,
                "decode_repeats": repeats,
            }
            row["targets"] = check_targets(row)
            rows.append(row)
            print(
                f"    ppl {row['ppl']:.3f} ({100 * row['ppl_rel_change']:+.2f}%)  "
                f"1-stream {s1:.1f} tok/s (x{row['speedup_single']:.2f})  b{args.batch} {sb:.1f} tok/s "
                f"(x{row['speedup_batch']:.2f})  weights {row['weight_bytes'] / 2**20:.1f} MiB",
                flush=True,
            )
        finally:
            if other is not None:
                other.close()
    # float32's own row: the median of its paired measurements
    for row in rows:
        if row["scheme"] == "fp32":
            row["decode_tps_single"] = sorted(fp32_single)[len(fp32_single) // 2]
            row["decode_tps_batch"] = sorted(fp32_batch)[len(fp32_batch) // 2]
            row["fp32_tps_single_range"] = [min(fp32_single), max(fp32_single)]
            row["fp32_tps_batch_range"] = [min(fp32_batch), max(fp32_batch)]
    base.close()
    return rows


def check_targets(row: dict[str, Any]) -> dict[str, Any] | None:
    key = target_key(row["scheme"])
    if key is None:
        return None
    if key == "kv-int8":
        ratio = row["kv_bytes_per_token"] / row["kv_bytes_per_token_16bit"]
        # int8 values are exactly half of 16-bit ones; the float16 scale per token, head and
        # K/V adds 2 / (2 * head_dim)
        allowed = 0.5 + 1.0 / row["head_dim"]
        return {
            "kv_bytes_vs_16bit": ratio,
            "kv_halved": ratio <= allowed + 1e-12,
            "kv_halved_criterion": f"<= 0.5 + 1/head_dim = {allowed:.4f} (half, plus the float16 scales)",
            "ppl_within": KV_INT8_PPL_TARGET,
            "ppl_ok": row["ppl_rel_change"] <= KV_INT8_PPL_TARGET,
            "met": ratio <= allowed + 1e-12 and row["ppl_rel_change"] <= KV_INT8_PPL_TARGET,
        }
    max_ppl, min_speedup = TARGETS[key]
    ppl_ok = row["ppl_rel_change"] <= max_ppl
    speed_ok = row["speedup_single"] >= min_speedup
    return {"ppl_within": max_ppl, "ppl_ok": ppl_ok, "min_speedup_single": min_speedup, "speed_ok": speed_ok,
            "met": ppl_ok and speed_ok}


def target_text(row: dict[str, Any]) -> str:
    t = row["targets"]
    if t is None:
        return "-"
    if "kv_halved" in t:
        return (f"KV x{t['kv_bytes_vs_16bit']:.3f} of 16-bit {'ok' if t['kv_halved'] else 'NO'}, "
                f"ppl<=+{100 * t['ppl_within']:.1f}% {'ok' if t['ppl_ok'] else 'NO'}")
    return (f"ppl<=+{100 * t['ppl_within']:.0f}% {'ok' if t['ppl_ok'] else 'NO'}, "
            f">={t['min_speedup_single']:.1f}x {'ok' if t['speed_ok'] else 'NO'}")


def format_table(rows: list[dict[str, Any]], batch: int) -> str:
    headers = ["model", "scheme", "weights MiB", "linears MiB", "KV B/tok", "ppl", "d ppl",
               "tok/s 1", "x fp32", f"tok/s b{batch}", "x fp32", "greedy =", "targets"]
    cells = [headers]
    for r in rows:
        cells.append([
            r["model"], r["scheme"], f"{r['weight_bytes'] / 2**20:.1f}", f"{r['decoder_linear_bytes'] / 2**20:.1f}",
            str(r["kv_bytes_per_token"]), f"{r['ppl']:.3f}", f"{100 * r['ppl_rel_change']:+.2f}%",
            f"{r['decode_tps_single']:.1f}", f"{r['speedup_single']:.2f}", f"{r['decode_tps_batch']:.1f}",
            f"{r['speedup_batch']:.2f}", f"{r['greedy_match_tokens']}/{r['greedy_tokens']}", target_text(r),
        ])
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for n, row in enumerate(cells):
        lines.append("  ".join(c.ljust(w) if i in (0, 1, len(headers) - 1) else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths))).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    for s in schemes:
        scheme_options(s, args.group_size)  # validate before loading anything
    if "fp32" in schemes:
        schemes.remove("fp32")
    schemes = ["fp32", *schemes]
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    start = time.perf_counter()
    record: dict[str, Any] = {
        "benchmark": "quant",
        "config": {k: v for k, v in vars(args).items()},
        "machine": machine_info(args.threads),
        "notes": [
            "SmolLM2-135M-Instruct is packaged as a Q4_1 GGUF: its float32 weights are Q4_1-dequantized, "
            "so INT4 RTN re-quantizes an already 4-bit grid and 'gguf' repacks the Q4_1 blocks exactly.",
            "Speedups are paired: each scheme's best-of-repeats decode rate over the float32 engine's, "
            "measured alternately in the same minute.",
        ],
        "rows": [],
    }
    for model in models:
        record["rows"] += run_model(model, schemes, args)
    record["total_seconds"] = time.perf_counter() - start
    table = format_table(record["rows"], args.batch)
    record["table"] = table
    print()
    print(table)
    print(f"\n{record['machine']['date']}, {record['machine']['cpu_model']}, {args.threads} thread(s), "
          f"total {record['total_seconds']:.0f} s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
