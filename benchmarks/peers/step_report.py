"""Summarize per-step scheduler traces (``benchmarks/peers/step_trace``) of one or more engines.

    python -m benchmarks.peers.step_report kvflow=/tmp/kvflow-trace vllm=/tmp/vllm-trace \\
        --json benchmarks/results/step_report.json

Each ``NAME=PREFIX`` reads every ``PREFIX.*.jsonl`` (one file per traced process) and prints
one row: steps, the largest step (tokens: the budget as used), prefill steps (steps holding
any prompt tokens) and decode-only steps with their durations (p50 / p90 / max, ms), the
prefill chunk sizes (tokens of one request's prompt in one step: median and max; partial
chunks leave prompt tokens for later), how many new prompts a step starts, the batch order
(``d..p``: a step's decodes come before its prefills), and the share of the traced wall time
spent in prefill steps. All times are the engine's own step times (schedule entry to update
exit), so they include whatever load the machine carried.
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
import sys
from pathlib import Path

from benchmarks.common import format_table


def load(prefix: str) -> list[dict]:
    """The steps of every ``prefix.*.jsonl`` file, in time order (``ValueError`` if none)."""
    rows = []
    for path in sorted(glob.glob(f"{prefix}.*.jsonl")):
        rows += [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"no step trace at {prefix}.*.jsonl")
    return sorted(rows, key=lambda r: r["t0"])


def _q(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarize(steps: list[dict]) -> dict:
    """Numbers of one engine's trace (durations in ms)."""
    prefill = [s for s in steps if s["prefill_tokens"]]
    decode = [s for s in steps if not s["prefill_tokens"]]
    mixed = [s for s in prefill if s["decode_reqs"]]
    wall = steps[-1]["t0"] + steps[-1]["step_s"] - steps[0]["t0"]
    ms = lambda xs, q: None if not xs else 1000 * _q(xs, q)  # noqa: E731
    per_req = [s["prefill_tokens"] / s["prefill_reqs"] for s in prefill]
    return {
        "steps": len(steps),
        "wall_s": wall,
        "max_step_tokens": max(s["tokens"] for s in steps),
        "prefill_steps": len(prefill),
        "prefill_step_tokens_p50": _q([s["tokens"] for s in prefill], 0.5),
        "prefill_step_ms_p50": ms([s["step_s"] for s in prefill], 0.5),
        "prefill_step_ms_p90": ms([s["step_s"] for s in prefill], 0.9),
        "prefill_step_ms_max": ms([s["step_s"] for s in prefill], 1.0),
        "prefill_tokens_per_s": sum(s["tokens"] for s in prefill) / max(1e-9, sum(s["step_s"] for s in prefill)),
        "chunk_tokens_per_req_p50": _q(per_req, 0.5),
        "partial_chunks": sum(s["partial"] for s in steps),
        "first_chunks_per_prefill_step": statistics.mean(s["first_chunks"] for s in prefill) if prefill else None,
        "max_first_chunks_in_step": max((s["first_chunks"] for s in prefill), default=0),
        "mixed_steps": len(mixed),
        "mixed_decodes_first": sum(1 for s in mixed if s["order"].rstrip("p").find("p") < 0),
        "decode_steps": len(decode),
        "decode_batch_mean": statistics.mean(s["decode_reqs"] for s in decode) if decode else None,
        "decode_step_ms_p50": ms([s["step_s"] for s in decode], 0.5),
        "decode_step_ms_p90": ms([s["step_s"] for s in decode], 0.9),
        "prefill_time_share": sum(s["step_s"] for s in prefill) / wall if wall > 0 else None,
        "sched_ms_mean": 1000 * statistics.mean(s["sched_s"] for s in steps),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", metavar="NAME=PREFIX")
    p.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = p.parse_args(argv)
    out = {}
    for item in args.traces:
        name, sep, prefix = item.partition("=")
        if not sep:
            p.error(f"expected NAME=PREFIX, got {item!r}")
        out[name] = summarize(load(prefix))
    keys = list(next(iter(out.values())))
    print(format_table(["metric", *out], [[k, *(out[n][k] for n in out)] for k in keys]))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
