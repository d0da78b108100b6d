"""The GGUF matrices of one decode step from 4 KiB pages and from transparent huge pages.

What it measures
----------------
A GGUF model served as stored (``LLM(model=MODEL)``) packs its weights into huge-page memory
(``kvflow.huge_pages``). This benchmark copies every packed matrix of one single-stream decode
step (the decoder linears' stored segments in layer order, then the LM head) into ordinary
memory as well (``torch.empty``: 4 KiB pages unless the system's transparent huge pages are
``always``), then times the step's matrices (M = 1, the C++ kernel's ``gguf_linear``) from
each copy, alternating copy by copy in one process, ``--rounds`` times (the first dropped). So
the two share the machine's state; the table gives each copy's median and best step time, the
weight bytes streamed per second, and the speedup of the huge pages. The huge-page share of
each copy is read from ``/proc/self/smaps`` (``AnonHugePages`` of the mappings that hold it).

``--engine`` instead builds two engines of the model in one process, one with
``KVFLOW_HUGE_PAGES=0`` (ordinary memory) and one with huge pages, and alternates them
request by request: each round generates ``--tokens`` greedy tokens after a short prompt with
each engine; a token's decode time is (time of the whole request - time of a one-token request)
/ (tokens - 1), both measured in the same round. The table gives the median ms per token and
tok/s of each, and the speedup.

``--kv-cache`` instead times the paged decode attention of one decode step (every layer's
``paged_decode_attention`` for ``--batch`` sequences of ``--context`` tokens, the model's head
shape, the bfloat16 cache) over two KV pools of the same blocks, one from ordinary memory and
one as the engine allocates it (``allocate_kv_cache(..., huge_pages=True)``), alternated step by
step. The block tables are a random permutation of the pool, as in a pool after requests of
different lengths came and went. The table gives each pool's median ms per step and the K/V
bytes read per second.

How to run
----------
    python -m benchmarks.huge_pages --model qwen2.5-coder-1.5b
    python -m benchmarks.huge_pages --model smollm2 --rounds 41 --out /tmp/hp.json
    python -m benchmarks.huge_pages --model qwen2.5-coder-1.5b --engine --rounds 5 --tokens 65
    python -m benchmarks.huge_pages --kv-cache --model smollm2 --batch 32 --context 1024

Prints one table and writes ``--out`` (JSON) with every step time.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import cpu_model, format_table, machine_info


def _transparent_huge_pages() -> str | None:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")] if "[" in text else text.strip()


def _load(start: float) -> str:
    """The 1-minute load average at the start and now (this run's own threads count in it)."""
    return f"CPU {cpu_model()}; load average {start:.2f} at the start, {os.getloadavg()[0]:.2f} at the end (this run's threads included)"


def huge_page_bytes(tensors: list[torch.Tensor]) -> tuple[int, int]:
    """(bytes of the mappings holding ``tensors`` that are huge pages, resident bytes of those
    mappings), from ``/proc/self/smaps`` (0, 0 where it cannot be read)."""
    spans = sorted({(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors})
    huge = rss = 0
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return 0, 0
    hit = False
    for line in lines:
        head = line.split()[0] if line else ""
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            hit = any(a < hi and b > lo for a, b in spans)
        elif hit and line.startswith("AnonHugePages:"):
            huge += int(line.split()[1]) * 1024
        elif hit and line.startswith("Rss:"):
            rss += int(line.split()[1]) * 1024
    return huge, rss


def engine_ab(args: argparse.Namespace) -> int:
    """``--engine``: two engines of one model, ordinary memory and huge pages, alternated."""
    from kvflow import LLM, SamplingParams
    import kvflow.layers.gguf_kernels as gk

    load_start = os.getloadavg()[0]
    engines = {}
    for name, switch in (("4 KiB pages", "0"), ("huge pages", "1")):
        os.environ["KVFLOW_HUGE_PAGES"] = switch  # read at each allocation, so while this engine loads
        engines[name] = LLM(model=args.model, max_model_len=1024, num_kv_blocks=64)
    os.environ.pop("KVFLOW_HUGE_PAGES")
    prompt = "Write a short story about a lighthouse keeper."

    def timed(llm, n: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == n
        return time.perf_counter() - t

    per_token: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(args.rounds + 1):
        for name, llm in engines.items():
            ms = (timed(llm, args.tokens) - timed(llm, 1)) / (args.tokens - 1) * 1e3
            if r:  # the first round warms up
                per_token[name].append(ms)
    base = statistics.median(per_token["4 KiB pages"])
    rows, record = [], {}
    for name, ts in per_token.items():
        med = statistics.median(ts)
        rows.append([name, f"{med:.2f}", f"{min(ts):.2f}", f"{1e3 / med:.1f}", f"{base / med:.2f}x"])
        record[name] = {"ms_per_token": ts, "median_ms": med, "tok_per_s": 1e3 / med}
    print(f"# {args.model}: decode, one sequence, {args.tokens} greedy tokens a request, {args.rounds} rounds, "
          f"the two engines alternated; {torch.get_num_threads()} threads, kernel ISA {gk.kernel_isa()}, "
          f"transparent huge pages: {_transparent_huge_pages()}; {_load(load_start)}")
    print(format_table(["weights in", "median ms/token", "best ms/token", "tok/s", "vs 4 KiB"], rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": {**machine_info(), "isa": gk.kernel_isa()}, "model": args.model,
                                    "mode": "engine", "tokens": args.tokens,
                                    "load_average_1min": [load_start, os.getloadavg()[0]],
                                    "transparent_hugepage": _transparent_huge_pages(), "results": record}, indent=1))
    print(f"\nwrote {args.out}")
    return 0


def kv_cache_ab(args: argparse.Namespace) -> int:
    """``--kv-cache``: one decode step's attention over a pool from 4 KiB pages and one from huge
    pages (the engine's), alternated."""
    from transformers import AutoConfig

    from kvflow.attention.cpu_attention import cpu_kernel_available, paged_decode_attention
    from kvflow.attention.kv_cache import allocate_kv_cache
    from kvflow.model.resolve import resolve_model

    if not cpu_kernel_available():
        raise SystemExit("the C++ paged attention kernel is not built (KVFLOW_CPU_KERNELS=0?)")
    cfg = AutoConfig.from_pretrained(resolve_model(args.model))
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    layers, block_size, dtype = cfg.num_hidden_layers, 16, torch.bfloat16
    per_seq = -(-args.context // block_size)
    num_blocks = 2 * args.batch * per_seq  # the sequences hold half the pool
    g = torch.Generator().manual_seed(0)
    tables = torch.randperm(num_blocks, generator=g)[:args.batch * per_seq].view(args.batch, per_seq).to(torch.int64)
    ctx = torch.full((args.batch,), args.context, dtype=torch.int32)
    q = torch.randn(args.batch, heads, head_dim, generator=g).to(dtype)
    load_start = os.getloadavg()[0]
    pools = {}
    for name, huge in (("4 KiB pages", False), ("huge pages", True)):
        os.environ["KVFLOW_HUGE_PAGES"] = "1"
        pools[name] = [allocate_kv_cache(num_blocks, block_size, kv_heads, head_dim, dtype, torch.device("cpu"),
                                         huge_pages=huge) for _ in range(layers)]
    os.environ.pop("KVFLOW_HUGE_PAGES")
    for a, b in zip(*pools.values()):  # the same bytes in both
        for x, y in zip(a, b):
            x.normal_(generator=g)
            y.copy_(x)
    scale = head_dim ** -0.5

    def step(pool) -> float:
        t = time.perf_counter()
        for k, v in pool:
            paged_decode_attention(q, k, v, tables, ctx, scale)
        return (time.perf_counter() - t) * 1e3

    times: dict[str, list[float]] = {name: [] for name in pools}
    for _ in range(args.rounds + 1):
        for name, pool in pools.items():
            times[name].append(step(pool))
    nbytes = 2 * layers * args.batch * args.context * kv_heads * head_dim * dtype.itemsize
    base = statistics.median(times["4 KiB pages"][1:])
    rows, record = [], {}
    for name, pool in pools.items():
        ts = times[name][1:]
        med = statistics.median(ts)
        huge, rss = huge_page_bytes([t for layer in pool for t in layer])
        rows.append([name, f"{med:.2f}", f"{min(ts):.2f}", f"{nbytes / med / 1e6:.1f}", f"{base / med:.2f}x",
                     f"{huge / 2**20:.0f} / {rss / 2**20:.0f}"])
        record[name] = {"step_ms": ts, "median_ms": med, "best_ms": min(ts), "gb_per_s": nbytes / med / 1e6,
                        "anon_huge_bytes": huge, "rss_bytes": rss}
    print(f"# {args.model} shape ({layers} layers, {heads}/{kv_heads} heads of {head_dim}): decode attention of "
          f"{args.batch} sequences x {args.context} tokens, bfloat16 cache of {num_blocks} blocks, random block "
          f"tables; {torch.get_num_threads()} threads, transparent huge pages: {_transparent_huge_pages()}; "
          f"{args.rounds} steps per pool, alternated; {_load(load_start)}")
    print(format_table(["KV cache in", "median ms", "best ms", "K/V GB/s", "vs 4 KiB", "huge / resident MiB"], rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine_info(), "model": args.model, "mode": "kv_cache",
                                    "batch": args.batch, "context": args.context, "kv_bytes_per_step": nbytes,
                                    "threads": torch.get_num_threads(),
                                    "load_average_1min": [load_start, os.getloadavg()[0]],
                                    "transparent_hugepage": _transparent_huge_pages(), "results": record}, indent=1))
    print(f"\nwrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.huge_pages", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="a GGUF model (path or packaged short name)")
    ap.add_argument("--rounds", type=int, default=15, help="timed steps per copy (the first is dropped)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/huge_pages.json"))
    ap.add_argument("--engine", action="store_true", help="alternate two engines (see above) instead")
    ap.add_argument("--tokens", type=int, default=65, help="--engine: tokens generated per request")
    ap.add_argument("--kv-cache", action="store_true", help="time the decode attention's KV pool instead (see above)")
    ap.add_argument("--batch", type=int, default=32, help="--kv-cache: sequences in the step")
    ap.add_argument("--context", type=int, default=1024, help="--kv-cache: tokens of each sequence")
    args = ap.parse_args(argv)
    if args.engine:
        return engine_ab(args)
    if args.kv_cache:
        return kv_cache_ab(args)

    from kvflow import LLM
    import kvflow.layers.gguf_kernels as gk

    load_start = os.getloadavg()[0]
    llm = LLM(model=args.model)
    net = llm.engine.model_runner.model
    weights = [seg.weight for layer in net.layers
               for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
               for seg in getattr(lin, "gguf_segments", []) if isinstance(seg.weight, gk.GGUFWeight)]
    if net.lm_head.stored_gguf is not None:
        weights.append(net.lm_head.stored_gguf)
    if not weights or not gk.kernel_available():
        raise SystemExit(f"{args.model}: no packed GGUF matrices (not a GGUF model, or the GGUF kernel is off)")
    dtype = net.norm.weight.dtype
    for w in weights:
        w.pack()
    ordinary = []
    for w in weights:  # the same bytes in torch.empty's memory
        c = copy.copy(w)
        c.packed = torch.empty(w.packed.shape, dtype=torch.uint8)
        c.packed.copy_(w.packed)
        ordinary.append(c)
    copies = {"4 KiB pages": ordinary, "huge pages": weights}
    xs = {w.k: torch.randn(1, w.k).to(dtype) for w in weights}

    def step(ws) -> float:
        t = time.perf_counter()
        for w in ws:
            gk.gguf_linear(xs[w.k], w)
        return (time.perf_counter() - t) * 1e3

    times: dict[str, list[float]] = {name: [] for name in copies}
    for _ in range(args.rounds + 1):
        for name, ws in copies.items():
            times[name].append(step(ws))
    nbytes = sum(w.packed.numel() for w in weights)
    rows, record = [], {}
    base = statistics.median(times["4 KiB pages"][1:])
    for name, ws in copies.items():
        ts = times[name][1:]
        med = statistics.median(ts)
        huge, rss = huge_page_bytes([w.packed for w in ws])
        rows.append([name, f"{med:.2f}", f"{min(ts):.2f}", f"{nbytes / med / 1e6:.1f}", f"{base / med:.2f}x",
                     f"{huge / 2**20:.0f} / {rss / 2**20:.0f}"])
        record[name] = {"step_ms": ts, "median_ms": med, "best_ms": min(ts), "gb_per_s": nbytes / med / 1e6,
                        "anon_huge_bytes": huge, "rss_bytes": rss}
    threads = torch.get_num_threads()
    print(f"# {args.model}: {len(weights)} packed matrices of one decode step ({nbytes / 2**20:.1f} MiB), M = 1, "
          f"{threads} threads, kernel ISA {gk.kernel_isa()}, transparent huge pages: {_transparent_huge_pages()}; "
          f"{args.rounds} steps per copy, alternated; {_load(load_start)}")
    print(format_table(["weights in", "median ms", "best ms", "GB/s", "vs 4 KiB", "huge / resident MiB"], rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": {**machine_info(), "isa": gk.kernel_isa()}, "model": args.model,
                                    "weight_bytes": nbytes, "threads": threads,
                                    "load_average_1min": [load_start, os.getloadavg()[0]],
                                    "transparent_hugepage": _transparent_huge_pages(), "results": record}, indent=1))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
