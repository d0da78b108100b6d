"""What the dashboard's snapshot producer costs the engine (kvflow/engine/snapshot.py).

What it measures
----------------
One engine on the real model, ``--batch`` requests (prompts cut from the license texts,
``--prompt-len`` tokens, greedy, ``ignore_eos``) all decoding at once. After their prefills,
decode steps are timed in rounds of ``--steps-per-round`` steps; the rounds cycle through
three modes in the same run, on the same requests, so that a change of the machine's load
hits every mode alike:

* ``off``: nobody subscribed (the server's normal state): the producer's hooks run and only
  count the step;
* ``10/s``: one subscriber at the server's default rate (at most 10 snapshots a second; the
  other steps get a few-number summary);
* ``every step``: one subscriber and a snapshot after every step (the worst case: no throttle).

Each step is driven as ``AsyncLLMEngine``'s engine thread drives it (``engine.step`` with the
``on_scheduled`` hook, ``get_stats``, ``after_step``); the subscriber lives on an event loop
in another thread and JSON-encodes each snapshot as the SSE route does. Per mode: steps,
mean and median step time, snapshots taken, the producer's own engine-thread time per step
(``SnapshotProducer.capture_seconds``, timed inside the hooks) and its share of the step
time (the overhead; target < 2 %; it includes waiting for the GIL while the subscriber's
thread runs), and the median step time against ``off`` (the same overhead measured from
outside, noisy on a shared machine). Then one snapshot's cost in isolation: the engine
thread's capture and the subscriber's JSON encoding, median of 100.

How to run
----------
    python -m benchmarks.snapshot_overhead                      # batch 32, 6 rounds of 8 steps per mode
    python -m benchmarks.snapshot_overhead --rounds 3           # a quicker run

Prints a table and writes every number to ``--out`` (default
``benchmarks/results/snapshot_overhead.json``; not tracked by git).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import kvflow  # noqa: F401 - before torch: kvflow's OpenMP wait policy applies (kvflow.cpu_threads)
import torch

from benchmarks.common import format_table, machine_info, make_workload
from kvflow import LLM
from kvflow.engine.snapshot import SnapshotProducer
from kvflow.sampling_params import SamplingParams

MODES = ("off", "10/s", "every step")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.snapshot_overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch", type=int, default=32, help="requests decoding together (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per request (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=6, help="rounds per mode (default: %(default)s)")
    p.add_argument("--steps-per-round", type=int, default=8, help="decode steps per round (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks (default: enough for the batch)")
    p.add_argument("--out", default="benchmarks/results/snapshot_overhead.json")
    args = p.parse_args(argv)
    for name in ("batch", "prompt_len", "rounds", "steps_per_round"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


class LoopSubscriber:
    """A subscriber on an event loop of its own thread that encodes every snapshot to JSON,
    as the SSE route does (``/dashboard/api/stream``)."""

    def __init__(self, producer: SnapshotProducer) -> None:
        self.loop = asyncio.new_event_loop()
        self.num_received = 0
        self.num_bytes = 0
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.producer = producer
        self.token = asyncio.run_coroutine_threadsafe(self._subscribe(), self.loop).result(30)

    async def _subscribe(self) -> int:
        return self.producer.subscribe(self._receive)

    def _receive(self, snap) -> None:
        self.num_received += 1
        self.num_bytes += len(snap.json())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.producer.unsubscribe, self.token)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


def timed_step(engine, producer: SnapshotProducer) -> float:
    """One step as AsyncLLMEngine's engine thread runs it; its wall time in seconds."""
    start = time.perf_counter()
    engine.step(on_scheduled=lambda started: (engine.get_stats(), producer.on_scheduled(engine.last_scheduler_output)))
    producer.after_step(engine.get_stats())
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    steps_needed = len(MODES) * args.rounds * args.steps_per_round
    max_tokens = steps_needed + 4
    block_size = 16
    num_blocks = args.num_kv_blocks or args.batch * -(-(args.prompt_len + max_tokens) // block_size) + 8
    llm = LLM(model=args.model, dtype="float32", num_kv_blocks=num_blocks, block_size=block_size,
              max_num_seqs=args.batch, max_num_batched_tokens=max(2048, args.prompt_len), seed=0)  # fmt: skip
    engine = llm.engine
    producer = SnapshotProducer(engine)
    requests = make_workload(llm.tokenizer, args.batch, seed=0, prompt_len_range=(args.prompt_len, args.prompt_len),
                             output_len_range=(max_tokens, max_tokens))  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, r in enumerate(requests):
        engine.add_request(f"r{i}", r.prompt_token_ids, params)
    # prefills (and a few decode steps to warm up)
    while len(engine.scheduler.running) < args.batch or any(
        q.num_computed_tokens < q.num_prompt_tokens for q in engine.scheduler.running
    ):
        timed_step(engine, producer)
    for _ in range(3):
        timed_step(engine, producer)
    # The cost of one snapshot in isolation (the batch running, no other thread waking up):
    # the engine thread's capture, and the JSON encoding that the subscriber's loop does.
    stats = engine.get_stats()
    capture_s, json_s = [], []
    for _ in range(100):
        t0 = time.perf_counter()
        snap = producer.capture(None, stats)
        t1 = time.perf_counter()
        snap.json()
        capture_s.append(t1 - t0)
        json_s.append(time.perf_counter() - t1)
    isolated = {"capture_us_median": 1e6 * statistics.median(capture_s), "json_us_median": 1e6 * statistics.median(json_s),
                "json_bytes": len(snap.json())}  # fmt: skip

    times: dict[str, list[float]] = {m: [] for m in MODES}
    capture: dict[str, float] = dict.fromkeys(MODES, 0.0)
    snapshots: dict[str, int] = dict.fromkeys(MODES, 0)
    sizes: dict[str, int] = dict.fromkeys(MODES, 0)
    wall_start = time.perf_counter()
    for _ in range(args.rounds):
        for mode in MODES:
            sub = None
            if mode != "off":
                producer.min_interval_s = 0.0 if mode == "every step" else 0.1
                sub = LoopSubscriber(producer)
            before_capture, before_snaps = producer.capture_seconds, producer.num_snapshots
            for _ in range(args.steps_per_round):
                batch = len(engine.scheduler.running)
                if batch != args.batch:
                    raise RuntimeError(f"the batch fell to {batch} requests (max_tokens {max_tokens} too small?)")
                times[mode].append(timed_step(engine, producer))
            capture[mode] += producer.capture_seconds - before_capture
            snapshots[mode] += producer.num_snapshots - before_snaps
            if sub is not None:
                sub.close()
                sizes[mode] += sub.num_bytes
    wall_s = time.perf_counter() - wall_start

    rows, results = [], {}
    off_median = statistics.median(times["off"])
    for mode in MODES:
        t = times[mode]
        total = sum(t)
        result = {
            "steps": len(t),
            "step_ms_mean": 1e3 * total / len(t),
            "step_ms_median": 1e3 * statistics.median(t),
            "snapshots": snapshots[mode],
            "snapshot_json_bytes_mean": sizes[mode] / snapshots[mode] if snapshots[mode] else None,
            "producer_ms_per_step": 1e3 * capture[mode] / len(t),
            "producer_share_pct": 100 * capture[mode] / total,
            "median_vs_off_pct": 100 * (statistics.median(t) / off_median - 1),
        }
        results[mode] = result
        rows.append([mode, result["steps"], result["step_ms_mean"], result["step_ms_median"], result["snapshots"],
                     result["producer_ms_per_step"], result["producer_share_pct"], result["median_vs_off_pct"]])  # fmt: skip
    print(f"batch {args.batch} decoding, {args.prompt_len}-token prompts, {num_blocks} KV blocks of {block_size}; "
          f"torch threads {torch.get_num_threads()}; {wall_s:.1f} s of timed steps", file=sys.stderr)  # fmt: skip
    print(f"one snapshot in isolation: capture {isolated['capture_us_median']:.0f} us on the engine thread, JSON "
          f"{isolated['json_us_median']:.0f} us on the subscriber's loop ({isolated['json_bytes']} bytes)", file=sys.stderr)  # fmt: skip
    print(format_table(["mode", "steps", "step ms (mean)", "step ms (median)", "snapshots", "producer ms/step",
                        "producer % of step", "median vs off %"], rows))  # fmt: skip
    record = {"args": vars(args), "machine": machine_info(), "num_kv_blocks": num_blocks, "block_size": block_size,
              "max_tokens": max_tokens, "modes": results, "isolated_snapshot": isolated, "step_seconds": times, "target_pct": 2.0}  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
