"""Scheduler: token budget, sequence cap, chunked prefill, continuous batching, preemption.

The unit tests drive a real ``Scheduler`` + ``KVCacheManager`` with fake requests and feed
arbitrary "sampled" tokens to ``update`` (no model). The hypothesis tests run random add /
step / abort sequences on small pools, both on the bare scheduler and through the real
``LLMEngine`` (which exercises the model runner with the block tables), checking block
conservation after every operation.
"""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from conftest import run_to_completion, tiny_engine
from kvflow.config import SchedulerConfig
from kvflow.core.block_pool import hash_block_tokens
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.scheduler import Scheduler, SchedulerOutput, StopHit
from kvflow.request import Request, RequestStatus
from kvflow.sampling_params import SamplingParams


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The tiny model is too small to gain from intra-op threads; on a shared 2-core machine
    extra OpenMP threads only spin and make each engine step ~30x slower."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def table(request) -> list[int]:
    """The request's block table (one KV cache group: ``block_ids[0]``; empty when it holds none)."""
    return request.block_ids[0] if request.block_ids else []


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    max_model_len: int = 256,
    enable_prefix_caching: bool = False,
) -> Scheduler:
    """Prefix caching is off by default here: the unit tests count tokens and blocks exactly."""
    config = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs, max_model_len=max_model_len
    )
    return Scheduler(config, KVCacheManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching))


BASE_TOKENS = [(7 * i + 3) % 100 for i in range(64)]


def make_request(
    request_id: str,
    prompt_len: int,
    max_tokens: int = 16,
    eos_token_id: int | None = None,
    prompt: list[int] | None = None,
) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return Request(request_id, prompt if prompt is not None else BASE_TOKENS[:prompt_len], params, eos_token_id)


def step(sched: Scheduler, token: int = 1) -> tuple[SchedulerOutput, list[Request]]:
    """One engine step without a model: every request whose chunk reaches its end 'samples' ``token``."""
    out = sched.schedule()
    sampled = {
        r.request_id: [token]
        for r in map(sched.requests.get, out.scheduled_req_ids)
        if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] == r.num_tokens
    }
    finished = sched.update(out, sampled)
    return out, finished


def ids(requests) -> list[str]:
    return [r.request_id for r in requests]


# ---------------------------------------------------------------------------- budget and caps
def test_token_budget_splits_prompts_across_steps():
    sched = make_scheduler(max_num_batched_tokens=8)
    a, b, c = make_request("a", 10), make_request("b", 10), make_request("c", 10)
    for r in (a, b, c):
        sched.add_request(r)

    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 8}
    assert out.total_num_scheduled_tokens == 8
    assert a.num_computed_tokens == 8 and a.num_output_tokens == 0  # partial chunk samples nothing
    assert ids(sched.running) == ["a"] and ids(sched.waiting) == ["b", "c"]

    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 2, "b": 6}
    assert a.num_output_tokens == 1 and b.num_output_tokens == 0

    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 4, "c": 3}
    assert out.total_num_scheduled_tokens == 8


def test_budget_never_exceeded_until_done():
    sched = make_scheduler(max_num_batched_tokens=5)
    reqs = [make_request(f"r{i}", n, max_tokens=4) for i, n in enumerate([1, 9, 4, 13, 2])]
    for r in reqs:
        sched.add_request(r)
    steps = 0
    while sched.has_unfinished_requests():
        out, _ = step(sched)
        assert 0 < out.total_num_scheduled_tokens <= 5
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        assert all(n >= 1 for n in out.num_scheduled_tokens.values())
        steps += 1
        assert steps < 100
    assert all(r.num_output_tokens == 4 and r.status == RequestStatus.FINISHED_LENGTH for r in reqs)
    assert sched.kv_cache_manager.num_free_blocks == 64


def test_max_num_seqs_caps_running_requests():
    sched = make_scheduler(max_num_seqs=2)
    reqs = [make_request(f"r{i}", 3, max_tokens=3) for i in range(5)]
    for r in reqs:
        sched.add_request(r)
    out, _ = step(sched)
    assert out.scheduled_req_ids == ["r0", "r1"]
    assert sched.num_running == 2 and sched.num_waiting == 3
    while sched.has_unfinished_requests():
        out, _ = step(sched)
        assert len(out.scheduled_req_ids) <= 2
        assert sched.num_running <= 2


# ---------------------------------------------------------------------------- chunked prefill
def test_chunked_prefill_mixes_with_decodes():
    sched = make_scheduler(max_num_batched_tokens=8)
    a, b = make_request("a", 3, max_tokens=10), make_request("b", 20)
    sched.add_request(a)
    sched.add_request(b)

    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 3, "b": 5}
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 7}  # a decode and a prefill chunk in one batch
    assert out.scheduled_req_ids == ["a", "b"]
    assert b.num_computed_tokens == 12 and b.num_output_tokens == 0
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 7}
    assert b.num_computed_tokens == 19 and b.num_output_tokens == 0
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}  # last prompt token; b samples now
    assert b.num_computed_tokens == 20 and b.num_output_tokens == 1
    assert a.num_output_tokens == 4
    # Each chunk got exactly the blocks it needed.
    assert len(table(b)) == 5 and len(table(a)) == 2


def test_a_long_prompt_leaves_budget_for_the_decodes_after_it():
    """A prompt chunk reserves a token for every decode later in the running list (admitted
    in the same step as its first chunk): the decodes are not stalled for its whole prefill."""
    sched = make_scheduler(max_num_batched_tokens=8, num_blocks=128)
    long, short = make_request("long", 0, prompt=list(range(60))), make_request("short", 2, max_tokens=20)
    sched.add_request(long)
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"long": 8}
    sched.add_request(short)
    out, _ = step(sched)  # the waiting short prompt gets half the budget
    assert out.num_scheduled_tokens == {"long": 4, "short": 2}
    for _ in range(5):  # short decodes (after long in the running list) every step
        out, _ = step(sched)
        assert out.num_scheduled_tokens == {"long": 7, "short": 1}
    assert short.num_output_tokens == 6


def test_a_long_prompt_shares_the_budget_with_waiting_prompts():
    """Without the share, a new prompt waited for the whole prefill of a long one ahead of it
    (163 s for a 6,000-token prompt on a loaded CPU, where the step-time bound kept the budget
    near 32 tokens)."""
    sched = make_scheduler(max_num_batched_tokens=32, num_blocks=256)
    long = make_request("long", 0, prompt=[(3 * i) % 97 for i in range(600)])
    sched.add_request(long)
    step(sched)
    arrivals = [make_request(f"s{i}", 0, max_tokens=4, prompt=[i + 1] * 10) for i in range(3)]
    for r in arrivals:
        sched.add_request(r)
    first_token_step = {}
    for n in range(1, 6):
        out, _ = step(sched)
        assert out.num_scheduled_tokens["long"] >= 8  # the long prompt keeps moving
        for r in arrivals:
            if r.num_output_tokens and r.request_id not in first_token_step:
                first_token_step[r.request_id] = n
    assert first_token_step == {"s0": 1, "s1": 2, "s2": 2}
    # nothing waiting: the long prompt takes the whole budget again
    while any(r.request_id in sched.requests for r in arrivals):
        step(sched)
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"long": 32}
    # a waiting request of a lower priority (a larger value) gets no share
    psched = Scheduler(SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=16, max_model_len=1024,
                                       policy="priority"), KVCacheManager(256, 4, enable_prefix_caching=False))
    plong = make_request("long", 0, prompt=[(3 * i) % 97 for i in range(600)])
    psched.add_request(plong)
    step(psched)
    low = make_request("low", 0, max_tokens=4, prompt=[5] * 10)
    low.priority = 1
    psched.add_request(low)
    out, _ = step(psched)
    assert out.num_scheduled_tokens == {"long": 32}


def test_chunk_size_one():
    sched = make_scheduler(max_num_batched_tokens=1)
    a = make_request("a", 3, max_tokens=2)
    sched.add_request(a)
    seen = []
    while sched.has_unfinished_requests():
        out, _ = step(sched)
        seen.append(out.num_scheduled_tokens["a"])
    assert seen == [1, 1, 1, 1]
    assert a.all_token_ids[3:] == [1, 1]


# ---------------------------------------------------------------------------- continuous batching
def test_finished_request_leaves_and_waiting_joins_next_step():
    sched = make_scheduler(max_num_seqs=1)
    a, b = make_request("a", 4, max_tokens=2), make_request("b", 4, max_tokens=1)
    sched.add_request(a)
    sched.add_request(b)

    out, finished = step(sched, token=5)
    assert out.scheduled_req_ids == ["a"] and finished == []
    out, finished = step(sched, token=6)
    assert out.scheduled_req_ids == ["a"]
    assert finished == [a]
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert a.output_token_ids == [5, 6]
    assert table(a) == []
    assert sched.num_running == 0 and ids(sched.waiting) == ["b"]
    assert "a" not in sched.requests
    assert sched.kv_cache_manager.num_free_blocks == 64

    out, finished = step(sched, token=7)
    assert out.scheduled_req_ids == ["b"]
    assert out.num_scheduled_tokens == {"b": 4}
    assert finished == [b] and b.output_token_ids == [7]
    assert not sched.has_unfinished_requests()
    assert sched.schedule().is_empty


def test_stop_token_and_eos_finish_with_stop():
    sched = make_scheduler()
    a = Request("a", [1, 2], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[9]), eos_token_id=3)
    b = make_request("b", 2, max_tokens=10, eos_token_id=3)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, token=4)
    _, finished = step(sched, token=9)
    assert finished == [a] and a.status.finish_reason == "stop"
    _, finished = step(sched, token=3)
    assert finished == [b] and b.status.finish_reason == "stop"
    assert b.output_token_ids == [4, 9, 3]
    assert sched.kv_cache_manager.num_free_blocks == 64


def test_a_stop_hit_cuts_accepted_drafts_and_keeps_nothing_past_it():
    """A stop string completed by an accepted draft (the output processor's ``StopHit``)
    ends the request after that token: later tokens are dropped from the request's tokens
    and computed count, its blocks are freed, and no block holding them is published."""
    sched = make_scheduler(block_size=2, enable_prefix_caching=True)
    a = make_request("a", 4, max_tokens=10)
    sched.add_request(a)
    step(sched, token=50)  # prefill; samples 50
    a.spec_token_ids = [51, 52, 53]
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 4} and out.scheduled_spec_tokens == {"a": [51, 52, 53]}
    sampled = {"a": [51, 52, 53, 60]}  # all drafts accepted, plus a bonus token
    assert sched.update(out, sampled) == []
    assert a.output_token_ids == [50, 51, 52, 53, 60]
    # the stop string ends with 52: the request keeps 3 output tokens
    assert sched.finish_requests({"a": StopHit(3, "STOP")}) == ["a"]
    assert a.output_token_ids == [50, 51, 52] and a.status == RequestStatus.FINISHED_STOPPED
    assert a.stop_reason == "STOP"
    assert a.num_computed_tokens == a.num_tokens == 7
    # published: [p0 p1] [p2 p3] [50 51]; the block [52 53] held a token past the stop
    assert sched.kv_cache_manager.block_pool.num_cached_blocks == 3
    assert sched.kv_cache_manager.num_free_blocks == 64 and not sched.has_unfinished_requests()
    out = sched.schedule()
    assert out.finished_req_ids == ["a"]  # the runner drops its state


def test_a_stop_hit_leaves_a_finished_request_alone_and_refuses_a_bad_count():
    """A stop hit on a request that finished by a token-level stop in the same step (the
    output processor reports the stop string with the final token) changes nothing in the
    core; a count outside the output is a ValueError naming the request."""
    sched = make_scheduler()
    a = make_request("a", 3, max_tokens=2)
    b = make_request("b", 3, max_tokens=5)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, token=5)
    _, finished = step(sched, token=6)
    assert finished == [a] and a.status == RequestStatus.FINISHED_LENGTH
    assert sched.finish_requests({"a": StopHit(2, "x")}) == []
    with pytest.raises(ValueError, match="'b'"):
        sched.finish_requests({"b": StopHit(3, "x")})
    assert b.status == RequestStatus.RUNNING


def test_max_model_len_finishes_with_length():
    sched = make_scheduler(max_model_len=6)
    a = make_request("a", 4, max_tokens=10)
    sched.add_request(a)
    step(sched)
    _, finished = step(sched)
    assert finished == [a]
    assert a.num_tokens == 6 and a.status == RequestStatus.FINISHED_LENGTH


# ---------------------------------------------------------------------------- preemption
def test_preemption_evicts_most_recently_admitted():
    # 4 blocks of 4 tokens; three 4-token prompts fill 3 blocks, a fourth request waits.
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=3)
    reqs = [make_request(f"r{i}", 4, max_tokens=10) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    r0, r1, r2, r3 = reqs

    out, _ = step(sched, token=11)
    assert out.scheduled_req_ids == ["r0", "r1", "r2"]
    assert sched.kv_cache_manager.num_free_blocks == 1
    assert ids(sched.waiting) == ["r3"]
    r2_blocks = list(table(r2))

    # Each running request now holds 5 tokens and needs a second block: only one is free.
    out, _ = step(sched, token=12)
    assert out.scheduled_req_ids == ["r0", "r1"]
    assert out.preempted_req_ids == ["r2"]
    assert r2.status == RequestStatus.PREEMPTED
    assert r2.num_computed_tokens == 0
    assert table(r2) == []
    assert r2.num_preemptions == 1 and r0.num_preemptions == 0 and r1.num_preemptions == 0
    assert sched.num_preemptions == 1
    assert r2.all_token_ids[4:] == [11]  # tokens so far are kept for recompute
    assert ids(sched.waiting) == ["r2", "r3"]  # head of the queue, ahead of r3
    assert ids(sched.running) == ["r0", "r1"]
    assert set(r2_blocks) <= set(table(r0)) | set(table(r1))  # its blocks were reused
    assert sched.kv_cache_manager.num_free_blocks == 0

    # Nothing is admitted in a step that preempted; r2 comes back first later on.
    finished_all = []
    while sched.has_unfinished_requests():
        out, finished = step(sched, token=13)
        finished_all += finished
        assert sched.num_running <= 3
    assert sched.kv_cache_manager.num_free_blocks == 4
    for r in reqs:
        assert r.num_output_tokens == 10
    assert r2.output_token_ids[:2] == [11, 13]


def test_preemption_victim_can_be_the_request_itself():
    sched = make_scheduler(num_blocks=3, block_size=4)
    a, b = make_request("a", 5), make_request("b", 4)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)  # a: 2 blocks (6 tokens now), b: 1 block (5 tokens now); pool empty
    assert sched.kv_cache_manager.num_free_blocks == 0
    out, _ = step(sched)
    # a still fits in its 2 blocks; b needs a new block and is itself the last admitted.
    assert out.scheduled_req_ids == ["a"]
    assert out.preempted_req_ids == ["b"]
    assert b.status == RequestStatus.PREEMPTED and table(b) == [] and b.num_computed_tokens == 0
    assert ids(sched.waiting) == ["b"] and ids(sched.running) == ["a"]
    assert sched.kv_cache_manager.num_free_blocks == 1


def test_preempted_request_readmitted_recomputes_all_its_tokens():
    sched = make_scheduler(num_blocks=2, block_size=4, max_num_batched_tokens=64)
    a, b = make_request("a", 4, max_tokens=3), make_request("b", 4, max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, token=21)
    out, _ = step(sched, token=22)
    assert out.preempted_req_ids == ["b"]
    # a: 6 tokens in 2 blocks; its third token finishes it.
    out, finished = step(sched, token=23)
    assert finished == [a]
    out, _ = step(sched, token=24)
    assert out.scheduled_req_ids == ["b"]
    assert out.num_scheduled_tokens == {"b": 5}  # prompt + the kept output token, recomputed
    assert b.output_token_ids == [21, 24]
    assert b.status == RequestStatus.RUNNING


# ---------------------------------------------------------------------------- abort / ids
def test_abort_running_and_waiting_frees_blocks_at_once():
    sched = make_scheduler(num_blocks=8, max_num_seqs=1)
    a, b = make_request("a", 9), make_request("b", 3)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    assert sched.kv_cache_manager.num_free_blocks == 5
    assert sched.abort_request("a") is a
    assert a.status == RequestStatus.FINISHED_ABORTED and a.status.finish_reason == "abort"
    assert table(a) == [] and sched.kv_cache_manager.num_free_blocks == 8
    assert sched.abort_request("a") is None
    assert sched.abort_request("nope") is None
    assert sched.abort_request("b") is b
    assert sched.num_running == 0 and sched.num_waiting == 0
    assert not sched.has_unfinished_requests()
    assert sched.schedule().is_empty


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_long_waiting_queue_costs_log_n_keys_per_add_and_abort(policy, monkeypatch):
    """Adding or aborting one of n waiting requests looks at O(log n) queue keys, not all n
    (a server body of 20,000 prompts held the engine thread for a minute while each add
    rebuilt every key); the queue stays in (priority, arrival) order through adds, aborts
    from its middle and admissions, and requests are admitted in that order."""
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=2, max_model_len=256, policy=policy)
    sched = Scheduler(config, KVCacheManager(64, 4))
    key = sched._queue_key
    calls = Counter()

    def counted(request):
        calls["keys"] += 1
        return key(request)

    monkeypatch.setattr(sched, "_queue_key", counted)
    n = 2000
    order = {}  # request id -> (priority, arrival)
    for i in range(n):
        request = make_request(f"r{i}", 3, max_tokens=1)
        request.priority = (i * 7919) % 13 if policy == "priority" else 0
        sched.add_request(request)
        order[request.request_id] = (request.priority, i)
    for i in range(0, n, 3):
        assert sched.abort_request(f"r{i}") is not None
        del order[f"r{i}"]
    assert calls["keys"] < 40 * n  # ~14 a request here; the O(n) version made ~n * n / 2
    keys = [key(r) for r in sched.waiting]
    assert keys == sorted(keys) and {r.request_id for r in sched.waiting} == set(order)
    admitted = []
    while sched.has_unfinished_requests():
        out, _ = step(sched)
        admitted += [d.request_id for d in out.scheduled_new_reqs]
    assert admitted == sorted(order, key=order.get)


def test_duplicate_request_id_raises():
    sched = make_scheduler()
    sched.add_request(make_request("a", 3))
    with pytest.raises(ValueError, match="request_id"):
        sched.add_request(make_request("a", 5))
    assert sched.num_waiting == 1 and sched.requests["a"].num_prompt_tokens == 3


# ---------------------------------------------------------------------------- invariants
def chain_hashes(kv: KVCacheManager, tokens: list[int], num_blocks: int) -> list[bytes]:
    hashes: list[bytes] = []
    bs = kv.block_size
    for i in range(num_blocks):
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None, tokens[i * bs : (i + 1) * bs], kv.hash_extra))
    return hashes


def check_block_invariants(kv: KVCacheManager, live: list[Request], forks: bool = False) -> None:
    """Conservation: every block is either free or referenced, ref_cnt counts the references.

    Without prefix caching (and without parallel samples) no block is shared, so
    ``sum(len(block_ids)) + num_free_blocks == num_total_blocks``. With it, a block held by
    several requests must be a published full block whose tokens are each holder's tokens.
    """
    pool = kv.block_pool
    counts = Counter(b for r in live for b in table(r))
    for r in live:
        assert len(set(table(r))) == len(table(r)), f"{r} holds a block twice"
    assert all(b.ref_cnt >= 0 for b in pool.blocks)
    for b in pool.blocks:
        assert b.ref_cnt == counts.get(b.block_id, 0), (b, counts.get(b.block_id, 0))
    assert set(pool._free) == {b for b in range(kv.num_total_blocks) if counts.get(b, 0) == 0}
    assert len(counts) + kv.num_free_blocks == kv.num_total_blocks
    if not kv.enable_prefix_caching and not forks:
        assert max(counts.values(), default=0) <= 1, "a block appears in two requests"
        assert sum(len(table(r)) for r in live) + kv.num_free_blocks == kv.num_total_blocks
    # Published blocks hold full, computed blocks of exactly their holder's tokens.
    for r in live:
        published = [i for i, b in enumerate(table(r)) if pool.blocks[b].block_hash is not None]
        if not published:
            continue
        assert kv.enable_prefix_caching
        hashes = chain_hashes(kv, r.all_token_ids, max(published) + 1)
        for i in published:
            assert (i + 1) * kv.block_size <= r.num_computed_tokens
            assert pool.blocks[table(r)[i]].block_hash == hashes[i]
            assert pool.lookup(hashes[i]) == table(r)[i]
    if not forks:
        for block_id, n in counts.items():
            if n > 1:
                assert pool.blocks[block_id].block_hash is not None, f"shared block {block_id} is unpublished"


def check_scheduler_invariants(sched: Scheduler, forks: bool = False) -> None:
    kv = sched.kv_cache_manager
    live = list(sched.requests.values())
    check_block_invariants(kv, live, forks)
    pending = [c for r in sched.waiting for c in r.pending_forks] + [c for r in sched.running for c in r.pending_forks]
    assert sorted(ids(live)) == sorted(ids(sched.running) + ids(sched.waiting) + ids(pending))
    assert sched.num_running <= sched.config.max_num_seqs
    for r in sched.running:
        assert r.status == RequestStatus.RUNNING
        # On-demand allocation: exactly the blocks the computed tokens need.
        assert len(table(r)) == kv.num_blocks_for(r.num_computed_tokens)
        assert r.num_computed_tokens < r.num_tokens
    for r in [*sched.waiting, *pending]:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert table(r) == [] and r.num_computed_tokens == 0


class SchedulerMachine(RuleBasedStateMachine):
    """Random add / step / abort on a tiny pool, so that preemption happens."""

    @initialize(
        num_blocks=st.integers(2, 8),
        block_size=st.sampled_from([1, 2, 4]),
        budget=st.integers(1, 12),
        max_num_seqs=st.integers(1, 4),
        prefix_caching=st.booleans(),
    )
    def setup(self, num_blocks, block_size, budget, max_num_seqs, prefix_caching):
        self.sched = make_scheduler(num_blocks, block_size, budget, max_num_seqs, 24, prefix_caching)
        self.counter = 0
        self.done: list[Request] = []

    @rule(
        requests=st.lists(
            # (shared prefix length, own tail length, tail variant, max_tokens)
            st.tuples(st.integers(0, 12), st.integers(0, 4), st.integers(0, 2), st.integers(1, 12)),
            min_size=1,
            max_size=3,
        )
    )
    def add(self, requests):
        kv = self.sched.kv_cache_manager
        for prefix_len, tail_len, variant, max_tokens in requests:
            prompt = BASE_TOKENS[:prefix_len] + [(13 * j + 31 * variant + 1) % 100 for j in range(tail_len)]
            # Only what LLMEngine.validate_prompt accepts: the request fits in the whole cache.
            if not prompt or kv.num_blocks_for(min(len(prompt) + max_tokens, 24)) > kv.num_total_blocks:
                continue
            self.counter += 1
            self.sched.add_request(make_request(f"r{self.counter}", 0, max_tokens, eos_token_id=0, prompt=prompt))

    @rule(token=st.integers(0, 9))
    def step(self, token):
        before = {r.request_id: (r.num_tokens, r.num_computed_tokens) for r in self.sched.requests.values()}
        out, finished = step(self.sched, token)
        assert out.total_num_scheduled_tokens <= self.sched.config.max_num_batched_tokens
        assert all(n >= 1 for n in out.num_scheduled_tokens.values())
        assert not set(out.scheduled_req_ids) & set(out.preempted_req_ids)
        for r in map(self.sched.requests.get, out.preempted_req_ids):
            assert r.num_computed_tokens == 0 and table(r) == [] and r.request_id in before
        for r in finished:
            assert r.is_finished and table(r) == [] and r.request_id not in self.sched.requests
        if before:
            assert not out.is_empty, "no progress with requests pending"
        if out.preempted_req_ids:
            event("preemption")
        self.done += finished

    @rule(index=st.integers(0, 50))
    def abort(self, index):
        if not self.sched.requests:
            assert self.sched.abort_request("r0") is None
            return
        request_id = sorted(self.sched.requests)[index % len(self.sched.requests)]
        request = self.sched.abort_request(request_id)
        assert request is not None and table(request) == []
        assert request.status == RequestStatus.FINISHED_ABORTED

    @invariant()
    def blocks_conserved(self):
        check_scheduler_invariants(self.sched)

    def teardown(self):
        sched = self.sched
        live = sorted(sched.requests)
        for request_id in live[: len(live) // 2]:
            sched.abort_request(request_id)
            check_scheduler_invariants(sched)
        for _ in range(2000):
            if not sched.has_unfinished_requests():
                break
            step(sched, token=1)
            check_scheduler_invariants(sched)
        assert not sched.has_unfinished_requests()
        if sched.num_preemptions:
            event("preemption (any phase)")
        if sched.kv_cache_manager.prefix_cache_hits:
            event("prefix-cache hit")
        kv = sched.kv_cache_manager
        assert kv.num_free_blocks == kv.num_total_blocks
        assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)


SchedulerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestSchedulerRandomOps = SchedulerMachine.TestCase


# ---------------------------------------------------------------------------- through the engine
_SHARED = [(5 * i + 2) % 128 for i in range(9)]
ENGINE_PROMPTS = [
    [5],
    [17, 3, 99],
    [(11 * i + 1) % 128 for i in range(6)],
    _SHARED,
    _SHARED + [(3 * i + 40) % 128 for i in range(4)],  # shares 9 tokens with the previous one
    [(3 * i + 40) % 128 for i in range(13)],
]
ENGINE_MAX_TOKENS = 8
ENGINE_MAX_LEN = 64
ENGINE_BLOCK_SIZE = 2


@functools.lru_cache(maxsize=None)
def engine_reference() -> tuple[tuple[int, ...], ...]:
    """Greedy outputs of each prompt run alone on a roomy engine."""
    refs = []
    for prompt in ENGINE_PROMPTS:
        engine = tiny_engine(max_model_len=ENGINE_MAX_LEN)
        engine.add_request("x", prompt, SamplingParams(temperature=0, max_tokens=ENGINE_MAX_TOKENS))
        refs.append(tuple(run_to_completion(engine)["x"]))
    return tuple(refs)


# ("add", prompt index, max_tokens, n) / ("step", ...) / ("abort", which, ...)
engine_add = st.tuples(
    st.just("add"),
    st.integers(0, len(ENGINE_PROMPTS) - 1),
    st.integers(1, ENGINE_MAX_TOKENS),
    st.sampled_from([1, 1, 2, 3]),
)
engine_ops = st.lists(
    st.one_of(
        engine_add,
        engine_add,
        st.tuples(st.just("step"), st.just(0), st.just(0), st.just(0)),
        st.tuples(st.just("abort"), st.integers(0, 50), st.just(0), st.just(0)),
    ),
    max_size=25,
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_blocks=st.integers(4, 10),
    budget=st.sampled_from([3, 8, 64]),
    max_num_seqs=st.integers(2, 4),
    first_adds=st.lists(engine_add, min_size=2, max_size=4),
    ops=engine_ops,
)
def test_engine_random_ops_conserve_blocks_and_stay_exact(num_blocks, budget, max_num_seqs, first_adds, ops):
    """Random add / step / abort through LLMEngine (prefix caching on, parallel samples).

    After every operation: ref counts equal the block-table references, none negative,
    referenced + free blocks == total, the sequence cap holds. At the end every block is
    free again, and every non-aborted request produced exactly its greedy output alone.
    """
    refs = engine_reference()
    engine = tiny_engine(
        num_blocks=num_blocks, block_size=ENGINE_BLOCK_SIZE, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
        max_model_len=ENGINE_MAX_LEN,
    )
    sched, kv = engine.scheduler, engine.kv_cache_manager
    expected: dict[str, list[list[int]]] = {}
    outputs: dict[str, list[list[int]]] = {}
    unfinished: set[str] = set()
    aborted: set[str] = set()

    def record(step_outputs):
        for o in step_outputs:
            assert o.request_id not in aborted
            outputs[o.request_id] = [c.token_ids for c in o.outputs]
            assert o.finished == all(c.finish_reason == "length" for c in o.outputs)
            if o.finished:
                unfinished.discard(o.request_id)

    for step_no, (op, a, b, n) in enumerate(first_adds + ops):
        if op == "add":
            request_id = f"q{step_no}"
            prompt = ENGINE_PROMPTS[a]
            params = SamplingParams(temperature=0, max_tokens=b, n=n)
            fits = kv.num_blocks_for(min(len(prompt) + b, ENGINE_MAX_LEN)) <= kv.num_total_blocks
            if fits and n <= max_num_seqs:
                engine.add_request(request_id, prompt, params)
                expected[request_id] = [list(refs[a][:b])] * n
                unfinished.add(request_id)
            else:
                with pytest.raises(ValueError, match="KV blocks|max_num_seqs"):
                    engine.add_request(request_id, prompt, params)
                assert not any(k.split("#")[0] == request_id for k in sched.requests)
        elif op == "step":
            record(engine.step())
        elif unfinished:
            request_id = sorted(unfinished)[a % len(unfinished)]
            assert engine.abort_request(request_id)
            assert not engine.abort_request(request_id)
            unfinished.discard(request_id)
            aborted.add(request_id)
            expected.pop(request_id)
        check_scheduler_invariants(sched, forks=True)

    for _ in range(3000):
        if not engine.has_unfinished_requests():
            break
        record(engine.step())
        check_scheduler_invariants(sched, forks=True)
    assert not engine.has_unfinished_requests()
    if sched.num_preemptions:
        event("engine preemption")
    if kv.prefix_cache_hits:
        event("engine prefix-cache hit")
    if any(len(v) > 1 for v in expected.values()):
        event("engine parallel samples")
    assert kv.num_free_blocks == kv.num_total_blocks
    assert all(blk.ref_cnt == 0 for blk in kv.block_pool.blocks)
    assert engine.get_stats()["num_free_blocks"] == num_blocks
    # Exactness under chunking, batching, prefix caching and preemption (greedy, float32).
    assert {k: v for k, v in outputs.items() if k in expected} == expected
    assert set(expected) <= set(outputs)


# ---------------------------------------------------------------------------- policies
def test_priority_policy_admits_lower_value_first_and_preempts_lowest():
    sched = make_scheduler(num_blocks=6, max_num_batched_tokens=64)
    sched.config = SchedulerConfig(64, 16, 256, policy="priority")
    for rid, prio in [("low", 5), ("high", 0), ("mid", 2)]:
        r = make_request(rid, prompt_len=8, max_tokens=16)
        r.priority = prio
        sched.add_request(r)
    assert ids(sched.waiting) == ["high", "mid", "low"]
    out, _ = step(sched)
    assert out.scheduled_req_ids == ["high", "mid", "low"]  # 6 blocks: 2 each
    for _ in range(3):  # the 9th token of each needs a third block: someone must go
        out, _ = step(sched)
        if out.preempted_req_ids:
            break
    assert out.preempted_req_ids[0] == "low"
    assert ids(sched.waiting)[0] == "low"


def test_small_request_passes_a_large_one_a_bounded_number_of_times():
    sched = make_scheduler(num_blocks=10, max_num_batched_tokens=64)
    sched.config = SchedulerConfig(64, 16, 256, max_head_skips=2)
    sched.add_request(make_request("running", prompt_len=20, max_tokens=4))
    step(sched)  # holds 5 blocks
    sched.add_request(make_request("large", prompt_len=32, max_tokens=4))  # 8 blocks: does not fit yet
    admitted_at: dict[str, int] = {}
    for i in range(40):
        if i < 3:
            sched.add_request(make_request(f"small{i}", prompt_len=4, max_tokens=8))
        out, _ = step(sched)
        for request_id in out.scheduled_req_ids:
            admitted_at.setdefault(request_id, i)
        if not sched.has_unfinished_requests():
            break
    assert admitted_at["small0"] == 0 and admitted_at["small1"] == 1  # passed the large one
    assert sched.requests.get("large") is None  # it finished
    assert admitted_at["large"] <= admitted_at["small2"]  # after two passes the queue waited for it


def test_a_request_of_another_adapter_is_passed_a_bounded_number_of_times():
    """With max_loras 1, a steady stream of adapter-a requests kept an adapter-b request
    waiting for ever (each new a-request passed it); after max_head_skips passes admission
    waits for it: the running a-requests drain and b runs."""
    from kvflow.lora.request import LoRARequest

    a, b = LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")
    sched = Scheduler(SchedulerConfig(64, 16, 256, max_head_skips=2, max_loras=1),
                      KVCacheManager(256, 4, enable_prefix_caching=False))

    def add(request_id, lora):
        r = make_request(request_id, prompt_len=4, max_tokens=6)
        r.lora_request = lora
        sched.add_request(r)

    add("a0", a)
    step(sched)
    add("b", b)
    admitted_at: dict[str, int] = {}
    for i in range(60):
        add(f"a{i + 1}", a)  # one more a-request every step
        out, _ = step(sched)
        for request_id in out.scheduled_req_ids:
            admitted_at.setdefault(request_id, i)
        if "b" in admitted_at:
            break
    assert "b" in admitted_at, "the b request was starved"
    assert admitted_at["a1"] == 0 and admitted_at["a2"] == 1  # passed it twice
    assert set(admitted_at) == {"a0", "a1", "a2", "b"}, admitted_at  # no later a-request went before it


# ---------------------------------------------------------------------------- step duration
def test_a_large_fixed_part_stretches_the_step_bound():
    """When the fitted fixed part of a step is more than MAX_FIXED_SHARE of
    max_step_seconds, the bound stretches to fixed / MAX_FIXED_SHARE: measured on a loaded
    2-core machine with the GGUF SmolLM2, steps holding prompt tokens took 0.47 s + 2.5 ms a
    token, so a 1 s bound held ~210 tokens (half of every step the fixed part) and 16 prompts
    arriving at once took 17 steps to prefill."""
    from kvflow.core.scheduler import MAX_FIXED_SHARE
    from kvflow.core.step_time import StepTimeModel

    config = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=8, max_model_len=8192, max_step_seconds=1.0)
    sched = Scheduler(config, KVCacheManager(1024, 4, enable_prefix_caching=False))
    sched.step_time = StepTimeModel.fixed(0.47, 0.0025)
    seconds = 0.47 / MAX_FIXED_SHARE  # 1.88 s
    assert sched.step_budget() == int((seconds - 0.47) / 0.0025 + 1e-6) == 564  # not (1.0 - 0.47) / 0.0025 = 212
    assert sched.step_time.predict(sched.step_budget()) == pytest.approx(seconds, abs=0.003)
    # a small fixed part: the bound as configured
    sched.step_time = StepTimeModel.fixed(0.1, 0.001)
    assert sched.step_budget() == 900
    # a fixed part above the bound: still a quarter of the step at most, within the token budget
    sched.step_time = StepTimeModel.fixed(2.0, 0.001)
    assert sched.step_budget() == 2048
    # the prompts of a burst then go in fewer, larger chunks
    sched.step_time = StepTimeModel.fixed(0.47, 0.0025)
    for i in range(4):
        sched.add_request(make_request(f"p{i}", i, max_tokens=2, prompt=[(7 * j + i) % 100 for j in range(256)]))
    assert sched.schedule().total_num_scheduled_tokens == 564


def test_a_step_is_bounded_in_time_by_the_measured_step_time():
    """Issue #31: a 2,209-token prefill step took 97 s on a loaded CPU and a request behind
    it timed out. With max_step_seconds the budget follows the measured step time, fitted as a
    fixed part plus a part per token, so prompt chunks are as large as the bound allows."""
    from kvflow.core.scheduler import MIN_STEP_TOKENS
    from kvflow.core.step_time import StepTimeModel

    config = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=8, max_model_len=8192, max_step_seconds=1.0)
    sched = Scheduler(config, KVCacheManager(1024, 4, enable_prefix_caching=False))
    now = [0.0]
    sched.clock = lambda: now[0]
    sched.add_request(make_request("long", 0, max_tokens=4, prompt=[(5 * i) % 100 for i in range(4000)]))
    cost = {"fixed": 0.1, "per_token": 0.001}  # the simulated machine's step time

    def timed_step() -> SchedulerOutput:
        out = sched.schedule()
        now[0] += cost["fixed"] + out.total_num_scheduled_tokens * cost["per_token"]
        sampled = {r: [1] for r in out.scheduled_req_ids
                   if sched.requests[r].num_computed_tokens + out.num_scheduled_tokens[r] == sched.requests[r].num_tokens}
        sched.update(out, sampled)
        return out

    assert timed_step().total_num_scheduled_tokens == 2048  # unmeasured: the token budget; took 2.15 s
    # one step size seen: every second charged to the tokens (2.148 s / 2048 tokens)
    assert sched.step_time.fixed_seconds == 0.0
    assert timed_step().total_num_scheduled_tokens == int(1.0 / (2.148 / 2048))  # 953
    # two sizes: the fixed 0.1 s and 1 ms a token are separated; a rate model (tokens / seconds of
    # the steps) would keep charging the fixed part to the tokens and cut the chunk to ~900 x 0.9
    assert sched.step_time.fixed_seconds == pytest.approx(0.1)
    assert sched.step_time.seconds_per_token == pytest.approx(0.001)
    out = timed_step()
    assert out.total_num_scheduled_tokens == 900  # (1.0 - 0.1) / 0.001
    assert now[0] - 2.148 - 1.053 == pytest.approx(1.0)  # the step lasted the bound
    # a newcomer waits for steps of about a second, not for the whole prefill
    sched.add_request(make_request("short", 4, max_tokens=2))
    out = timed_step()
    assert out.num_scheduled_tokens == {"long": 4000 - 2048 - 953 - 900, "short": 4}
    # decode-only steps are not timed (a GGUF model's fused decode step runs another path at
    # another cost): the next prompt still gets 900
    cost["fixed"], cost["per_token"] = 0.01, 0.0001
    for _ in range(3):
        assert set(timed_step().num_scheduled_tokens.values()) == {1}  # decodes only
    assert sched.step_time.fixed_seconds == pytest.approx(0.1)
    cost["fixed"], cost["per_token"] = 0.1, 0.001
    sched.add_request(make_request("next", 6, max_tokens=2, prompt=list(range(2000))))
    assert timed_step().num_scheduled_tokens["next"] == 900 - len(sched.running) + 1
    # a slow machine: the budget never falls below MIN_STEP_TOKENS
    sched.step_time = StepTimeModel.fixed(0.2, 0.1)
    assert sched.step_budget() == MIN_STEP_TOKENS
    # off: the token budget alone
    unbounded = make_scheduler(max_num_batched_tokens=512)
    unbounded.step_time = StepTimeModel.fixed(0.0, 1.0)
    assert unbounded.step_budget() == 512
