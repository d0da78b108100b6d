"""The scheduler -> runner data contract: new-request data once, then per-step diffs."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import torch

from kvflow.config import SchedulerConfig
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.sched_output import NewRequestData, RunnerStateTracker, SchedulerOutput
from kvflow.core.scheduler import Scheduler
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams


def _decode_step(context: int, num_requests: int = 16) -> SchedulerOutput:
    """The first decode step of ``num_requests`` requests with prompts of ``context - 1`` tokens."""
    config = SchedulerConfig(max_num_batched_tokens=num_requests * context, max_num_seqs=num_requests,
                             max_model_len=context + 8)
    sched = Scheduler(config, KVCacheManager(num_requests * (context // 16 + 2), 16, enable_prefix_caching=False))
    for i in range(num_requests):
        sched.add_request(Request(f"r{i}", [(i + j) % 1000 for j in range(context - 1)],
                                  SamplingParams(temperature=0, max_tokens=4), None))
    out = sched.schedule()
    assert len(out.scheduled_new_reqs) == num_requests  # the prefill step sends every prompt once
    sched.update(out, {request_id: [7] for request_id in out.num_scheduled_tokens})
    return sched.schedule()


def test_decode_step_sends_one_token_per_request_whatever_the_context():
    short, long = _decode_step(64), _decode_step(512)
    for out in (short, long):
        assert out.scheduled_new_reqs == []
        assert out.scheduled_cached_reqs.new_token_ids == [[7]] * 16
        assert out.scheduled_cached_reqs.replace_block_ids == [False] * 16
    assert long.scheduled_cached_reqs.num_computed_tokens == [511] * 16
    # No token list travels: 8x the context, about the same bytes (the former snapshot,
    # every request's whole token list, was ~29 KB at 512 tokens: benchmarks/tp_broadcast.py).
    short_bytes, long_bytes = len(pickle.dumps(short.for_workers())), len(pickle.dumps(long.for_workers()))
    assert long_bytes < short_bytes + 16 * 8 and long_bytes < 2000


def test_for_workers_drops_the_driver_only_handles():
    generator = torch.Generator()
    params = SamplingParams(temperature=0.7, logit_bias={3: 1.0}, prompt_logprobs=2, seed=1)
    data = NewRequestData("a", [1, 2], [3], params, 0, [[4, 5]], ([9],), 2, generator, grammar=object())
    out = SchedulerOutput(scheduled_new_reqs=[data], spec_draft_probs={"a": torch.ones(2, 8)})
    out._add("a", 1)
    sent = pickle.loads(pickle.dumps(out.for_workers()))
    (worker_data,) = sent.scheduled_new_reqs
    assert worker_data.generator is None and worker_data.grammar is None and sent.spec_draft_probs == {}
    assert worker_data.sampling_params.prompt_logprobs == 2 and worker_data.sampling_params.logit_bias is None
    assert (worker_data.prompt_token_ids, worker_data.output_token_ids, worker_data.block_ids) == ([1, 2], [3], ([9],))
    assert sent.num_scheduled_tokens == {"a": 1}
    assert out.scheduled_new_reqs[0].generator is generator  # the driver's copy keeps them


def test_tracker_appends_blocks_or_replaces_a_changed_table():
    request = SimpleNamespace(request_id="a", prompt_token_ids=[1, 2], all_token_ids=[1, 2], block_ids=([4],),
                              num_computed_tokens=0, sampling_params=SamplingParams(), eos_token_id=None,
                              bad_words_token_ids=[], generator=None, grammar=None)
    tracker = RunnerStateTracker()
    first = SchedulerOutput()
    tracker.record(first, request)
    assert [d.request_id for d in first.scheduled_new_reqs] == ["a"] and "a" in tracker

    request.all_token_ids, request.block_ids, request.num_computed_tokens = [1, 2, 3], ([4, 6],), 2
    grown = SchedulerOutput()
    tracker.record(grown, request)
    cached = grown.scheduled_cached_reqs
    assert (cached.new_token_ids, cached.new_block_ids, cached.replace_block_ids, cached.num_computed_tokens) == (
        [[3]], [([6],)], [False], [2])

    request.block_ids = ([4, 8],)  # copy-on-write replaced a held block
    changed = SchedulerOutput()
    tracker.record(changed, request)
    cached = changed.scheduled_cached_reqs
    assert (cached.new_token_ids, cached.new_block_ids, cached.replace_block_ids) == ([[]], [([4, 8],)], [True])

    request.block_ids = ([4],)  # a speculative roll-back freed the tail
    trimmed = SchedulerOutput()
    tracker.record(trimmed, request)
    assert trimmed.scheduled_cached_reqs.new_block_ids == [([4],)] and trimmed.scheduled_cached_reqs.replace_block_ids == [True]

    assert tracker.forget("a") and not tracker.forget("a")
    again = SchedulerOutput()
    tracker.record(again, request)  # forgotten (preempted, finished): sent whole again
    assert again.scheduled_new_reqs[0].block_ids == ([4],) and len(again.scheduled_cached_reqs) == 0


def test_scheduler_reports_finished_and_aborted_ids_once():
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64)
    sched = Scheduler(config, KVCacheManager(4, 4, enable_prefix_caching=False))
    for rid, n in (("a", 3), ("b", 3), ("c", 3)):
        sched.add_request(Request(rid, list(range(1, n + 1)), SamplingParams(temperature=0, max_tokens=1 if rid == "a"
                                                                             else 8), None))
    out = sched.schedule()
    assert [d.request_id for d in out.scheduled_new_reqs] == ["a", "b", "c"]
    sched.update(out, {rid: [5] for rid in out.num_scheduled_tokens})  # "a" finishes (max_tokens=1)
    sched.abort_request("b")
    out = sched.schedule()
    assert sorted(out.finished_req_ids) == ["a", "b"]
    assert sched.schedule().finished_req_ids == []  # once


def test_a_preempted_request_is_dropped_then_sent_whole_with_its_outputs():
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64)
    sched = Scheduler(config, KVCacheManager(3, 2, enable_prefix_caching=False))
    for rid in ("a", "b"):
        sched.add_request(Request(rid, [1, 2], SamplingParams(temperature=0, max_tokens=4), None))
    preempted, resumed = [], []
    for step in range(12):
        out = sched.schedule()
        preempted += out.preempted_req_ids
        resumed += [d for d in out.scheduled_new_reqs if d.request_id in preempted]
        assert not set(out.preempted_req_ids) & {*out.num_scheduled_tokens, *out.scheduled_cached_reqs.request_ids}
        sched.update(out, {rid: [10 + step] for rid, n in out.num_scheduled_tokens.items()
                           if sched.requests[rid].num_computed_tokens + n == sched.requests[rid].num_tokens})
    assert preempted == ["b"] and not sched.has_unfinished_requests()
    (data,) = resumed
    assert data.num_computed_tokens == 0 and data.prompt_token_ids == [1, 2] and len(data.output_token_ids) >= 1


def test_tracker_sends_one_block_id_list_per_kv_cache_group():
    """Two groups (full, sliding): the runner gets each group's appended ids, in group order;
    a block freed behind the window (a NULL_BLOCK entry) replaces every group's table."""
    request = SimpleNamespace(request_id="a", prompt_token_ids=[1, 2], all_token_ids=[1, 2], block_ids=([4], [5]),
                              num_computed_tokens=0, sampling_params=SamplingParams(), eos_token_id=None,
                              bad_words_token_ids=[], generator=None, grammar=None)
    tracker = RunnerStateTracker()
    first = SchedulerOutput()
    tracker.record(first, request)
    assert first.scheduled_new_reqs[0].block_ids == ([4], [5])
    request.block_ids = ([4, 6], [5, 7])
    grown = SchedulerOutput()
    tracker.record(grown, request)
    assert grown.scheduled_cached_reqs.new_block_ids == [([6], [7])]
    assert grown.scheduled_cached_reqs.replace_block_ids == [False]
    request.block_ids = ([4, 6, 8], [0, 7, 9])  # the sliding group freed block 5
    freed = SchedulerOutput()
    tracker.record(freed, request)
    assert freed.scheduled_cached_reqs.new_block_ids == [([4, 6, 8], [0, 7, 9])]
    assert freed.scheduled_cached_reqs.replace_block_ids == [True]
