"""benchmarks/peers: the per-step scheduler trace (step_trace, step_report) and the schedule
replay, on kvflow's real scheduler with fake requests (no model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.peers import schedule_replay, step_report

REPO = Path(__file__).resolve().parents[2]

# Two requests through a real Scheduler: "a" (6 prompt tokens) prefills alone, then decodes
# while "b" (10 tokens) prefills in a chunk of 7 and then 3 (budget 8).
_DRIVE = """
from kvflow.config import SchedulerConfig
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.scheduler import Scheduler
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams
s = Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4, max_model_len=64), KVCacheManager(32, 4))
p = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
s.add_request(Request("a", list(range(1, 7)), p, None))
for step in range(8):
    if step == 1:
        s.add_request(Request("b", list(range(20, 30)), p, None))
    if not s.has_unfinished_requests():
        break
    out = s.schedule()
    s.update(out, {r: [5] for r, n in out.num_scheduled_tokens.items()
                   if s.requests[r].num_computed_tokens + n >= s.requests[r].num_tokens})
"""


def test_step_trace_records_each_step_of_kvflows_scheduler(tmp_path: Path) -> None:
    env = dict(os.environ, STEP_TRACE=str(tmp_path / "kv"),
               PYTHONPATH=os.pathsep.join([str(REPO / "benchmarks" / "peers" / "step_trace"), str(REPO)]))  # fmt: skip
    subprocess.run([sys.executable, "-c", _DRIVE], env=env, check=True, cwd=REPO, timeout=120)
    steps = step_report.load(str(tmp_path / "kv"))
    got = [(s["tokens"], s["prefill_tokens"], s["decode_reqs"], s["order"], s["first_chunks"], s["partial"]) for s in steps]
    assert got[:3] == [(6, 6, 0, "p", 1, 0), (8, 7, 1, "dp", 1, 1), (4, 3, 1, "dp", 0, 0)]
    assert all(s["step_s"] >= s["sched_s"] >= 0 for s in steps)
    summary = step_report.summarize(steps)
    assert summary["max_step_tokens"] == 8 and summary["partial_chunks"] == 1
    assert summary["mixed_steps"] == summary["mixed_decodes_first"] == 2


def test_step_report_refuses_a_missing_trace(tmp_path: Path) -> None:
    try:
        step_report.load(str(tmp_path / "none"))
    except ValueError as exc:
        assert "no step trace" in str(exc)
    else:
        raise AssertionError("no ValueError")


def test_schedule_replay_sees_the_prefix_cache_on_a_repeated_pass() -> None:
    reqs = schedule_replay.workload(12, 64, 16, 0.5, seed=0)
    kw = dict(concurrency=4, passes=2, max_num_batched_tokens=256, max_step_seconds=0.0, step_fixed_ms=10.0,
              prefill_ms=1.0, decode_ms=1.0)  # fmt: skip
    tokens = sum(len(p) + n for p, n in reqs)
    small = schedule_replay.replay(reqs, kv_bytes=schedule_replay.KV_BYTES_PER_TOKEN * tokens // 2, **kw)
    big = schedule_replay.replay(reqs, kv_bytes=schedule_replay.KV_BYTES_PER_TOKEN * tokens * 2, **kw)
    assert small[0]["prefix_hit_rate"] == big[0]["prefix_hit_rate"] == 0  # fresh prompts: nothing cached
    assert big[1]["prefix_hit_rate"] > 0.9 > small[1]["prefix_hit_rate"]
    assert big[1]["ttft_mean_ms"] < 0.5 * small[1]["ttft_mean_ms"]
    json.dumps(big)  # the numbers go to --json
