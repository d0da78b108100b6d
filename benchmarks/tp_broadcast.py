"""Bytes a tensor-parallel driver broadcasts per step: the scheduler's diff against the
former full snapshot.

What it measures
----------------
A batch of ``--num-requests`` requests (default 16) with prompts of ``--context - 1`` tokens
(default 511) runs through the real ``Scheduler`` (no model: every request "samples" one
token per step). For the prefill step and ``--decode-steps`` decode steps (the first at a
context of ``--context`` tokens) it pickles, as ``torch.distributed.broadcast_object_list``
does (``pickle``, default protocol):

* ``diff``: what the driver sends now, ``SchedulerOutput.for_workers()`` (new requests' data
  once, then per request its new token, block-table change and computed count);
* ``full``: what it sent before the data contract (kvflow <= h16-joints ``StepSnapshot``):
  for every scheduled request its whole token list, block table, counts and a minimal
  ``SamplingParams``, plus the step's scheduled counts, copies and swaps. It is rebuilt here
  from the same step with the same fields (``_FormerRequestSnapshot``/``_FormerStep``).

No timing: the numbers depend only on the workload. Run:
``python -m benchmarks.tp_broadcast [--num-requests 16 --context 512 --json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import pickle
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import format_table
from kvflow.config import SchedulerConfig
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.scheduler import Scheduler, SchedulerOutput
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams


@dataclass
class _FormerRequestSnapshot:
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int
    num_tokens: int
    num_prompt_tokens: int
    block_ids: list[int]
    sampling_params: SamplingParams


@dataclass
class _FormerStep:
    scheduled_requests: list[_FormerRequestSnapshot]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    preempted_requests: list = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    forked: list = field(default_factory=list)
    scheduled_spec_tokens: dict[str, list[int]] = field(default_factory=dict)


def former_snapshot(out: SchedulerOutput, requests: dict[str, Request]) -> _FormerStep:
    """The step as the former ``StepSnapshot.of`` copied it (the requests before ``update``)."""
    snaps = []
    for request_id in out.num_scheduled_tokens:
        r = requests[request_id]
        params = SamplingParams(prompt_logprobs=r.sampling_params.prompt_logprobs, max_tokens=1)
        snaps.append(_FormerRequestSnapshot(r.request_id, list(r.all_token_ids), r.num_computed_tokens, r.num_tokens,
                                            r.num_prompt_tokens, [b for t in r.block_ids for b in t], params))
    return _FormerStep(snaps, dict(out.num_scheduled_tokens), out.total_num_scheduled_tokens, [],
                       list(out.blocks_to_copy), list(out.blocks_to_swap_out), list(out.blocks_to_swap_in), [],
                       {k: list(v) for k, v in out.scheduled_spec_tokens.items()})


def measure(num_requests: int, context: int, decode_steps: int, block_size: int = 16) -> list[dict]:
    """Per step: its kind, the context of its decodes, and both formats' pickled bytes."""
    num_blocks = num_requests * (-(-(context + decode_steps) // block_size) + 1)
    config = SchedulerConfig(max_num_batched_tokens=num_requests * context, max_num_seqs=num_requests,
                             max_model_len=context + decode_steps + 8)
    sched = Scheduler(config, KVCacheManager(num_blocks, block_size, enable_prefix_caching=False))
    for i in range(num_requests):
        prompt = [(31 * i + 7 * j) % 32000 for j in range(context - 1)]
        sched.add_request(Request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=decode_steps + 1), None))
    rows = []
    for step in range(decode_steps + 1):
        out = sched.schedule()
        full = len(pickle.dumps(former_snapshot(out, sched.requests)))
        diff = len(pickle.dumps(out.for_workers()))
        kind = "prefill" if step == 0 else "decode"
        rows.append({"step": step, "kind": kind, "context": context - 1 + step,
                     "full_bytes": full, "diff_bytes": diff})
        sched.update(out, {request_id: [1 + step] for request_id in out.num_scheduled_tokens})
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tp_broadcast", description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--context", type=int, default=512, help="context of the first decode step, in tokens")
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--json", type=Path, default=None, help="write the rows here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = measure(args.num_requests, args.context, args.decode_steps)
    table = [[r["step"], r["kind"], r["context"], r["full_bytes"], r["diff_bytes"],
              f"{r['full_bytes'] / r['diff_bytes']:.1f}x"] for r in rows]
    decodes = rows[1:]
    mean_full = sum(r["full_bytes"] for r in decodes) / len(decodes)
    mean_diff = sum(r["diff_bytes"] for r in decodes) / len(decodes)
    table.append(["decode mean", "", "", f"{mean_full:.0f}", f"{mean_diff:.0f}", f"{mean_full / mean_diff:.1f}x"])
    print(f"pickled bytes per step, {args.num_requests} requests, first decode at {args.context} tokens of context")
    print(format_table(["step", "kind", "context (tokens)", "full snapshot (before)", "diff (now)", "ratio"],
                       table))
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2)
                             + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
