"""The dashboard's snapshot producer (kvflow/engine/snapshot.py) on tiny random-weight engines:
what it reports equals the block pool's and the scheduler's state (checked against the
requests' block tables and the prefix index, not against the producer's own rules), it
throttles, and it does no work without a subscriber."""

from __future__ import annotations

import asyncio

import pytest
import torch

from conftest import make_engine, tiny_engine, tiny_model, tiny_model_config
from kvflow.config import CacheConfig, SchedulerConfig
from kvflow.engine.async_engine import AsyncLLMEngine
from kvflow.engine.llm_engine import LLMEngine
from kvflow.engine.snapshot import SnapshotProducer
from kvflow.sampling_params import SamplingParams
from kvflow.spec_decode.ngram import NgramProposer

PREFIX = list(range(10, 26))  # 16 tokens: 4 full blocks of 4


def table(request) -> list[int]:
    """The request's block table (one KV cache group: ``block_ids[0]``; empty when it holds none)."""
    return request.block_ids[0] if request.block_ids else []


def params(max_tokens=8, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


class Subscriber:
    """A subscriber on its own event loop; ``drain()`` runs the callbacks posted to it."""

    def __init__(self, producer: SnapshotProducer) -> None:
        self.loop = asyncio.new_event_loop()
        self.snaps = []

        async def subscribe():
            return producer.subscribe(self.snaps.append)

        self.token = self.loop.run_until_complete(subscribe())

    def drain(self):
        self.loop.run_until_complete(asyncio.sleep(0))
        return self.snaps

    def close(self):
        self.loop.close()


def step(engine: LLMEngine, producer: SnapshotProducer):
    """One step driven as AsyncLLMEngine drives it."""
    outputs = engine.step(on_scheduled=lambda started: producer.on_scheduled(engine.last_scheduler_output))
    producer.after_step()
    return outputs


def assert_matches_engine(data: dict, engine: LLMEngine) -> None:
    """The snapshot's blocks, queues and progress equal the engine's state."""
    kv = engine.kv_cache_manager
    pool = kv.block_pool
    scheduler = engine.scheduler
    live = list(scheduler.requests.values())
    holders = {b: 0 for b in range(pool.num_blocks)}
    for r in live:
        for b in table(r):
            holders[b] += 1
    states = data["blocks"]["states"]
    assert len(states) == pool.num_blocks == data["blocks"]["num_blocks"]
    for b in range(pool.num_blocks):
        block = pool.blocks[b]
        assert block.ref_cnt == holders[b], "the pool's ref counts are the block tables'"
        indexed = block.block_hash is not None and pool.lookup(block.block_hash) == b
        expected = {0: "c" if indexed else "f", 1: "u"}.get(holders[b], "s")
        assert states[b] == expected, (b, states[b], holders[b], indexed)
    assert data["blocks"]["shared"] == {b: n for b, n in holders.items() if n > 1}
    assert states.count("f") + states.count("c") == pool.num_free_blocks
    for name, queue in (("running", scheduler.running), ("waiting", scheduler.waiting)):
        infos = data[name]
        assert [i["id"] for i in infos] == [r.request_id for r in queue]
        for info, r in zip(infos, queue):
            assert info["status"] == r.status.value
            assert info["num_computed_tokens"] == r.num_computed_tokens
            assert info["num_tokens"] == r.num_tokens
            assert info["num_prompt_tokens"] == r.num_prompt_tokens
            assert info["block_ids"] == table(r)
            assert info["cpu_block_ids"] == r.cpu_block_ids
            assert info["num_preemptions"] == r.num_preemptions
    if kv.cpu_pool is not None:
        host_holders = {b: 0 for b in range(kv.cpu_pool.num_blocks)}
        for r in live:
            for b in r.cpu_block_ids:
                host_holders[b] += 1
        assert data["cpu_blocks"]["states"] == "".join("f" if host_holders[b] == 0 else "u" for b in host_holders)
    else:
        assert data["cpu_blocks"] is None
    stats = engine.get_stats()
    assert data["stats"]["num_free_blocks"] == stats["num_free_blocks"]
    assert data["stats"]["kv_cache_usage"] == stats["kv_cache_usage"]


def test_shared_prefix_blocks_are_shared_then_cached():
    engine = tiny_engine(num_blocks=64, block_size=4)
    producer = SnapshotProducer(engine)
    engine.add_request("a", PREFIX + [1], params(max_tokens=12))
    for _ in range(2):  # a's prompt computed: its 4 prefix blocks are in the prefix index
        step(engine, producer)
    engine.add_request("b", PREFIX + [2, 3], params(max_tokens=12))
    engine.add_request("c", PREFIX + [4], params(max_tokens=12))
    step(engine, producer)
    data = producer.capture().data
    assert_matches_engine(data, engine)
    a = engine.scheduler.requests["a"]
    assert [data["blocks"]["states"][b] for b in table(a)[:4]] == ["s"] * 4
    assert all(data["blocks"]["shared"][b] == 3 for b in table(a)[:4])
    while engine.has_unfinished_requests():
        step(engine, producer)
        assert_matches_engine(producer.capture().data, engine)
    data = producer.capture().data
    assert "u" not in data["blocks"]["states"] and "s" not in data["blocks"]["states"]
    assert data["blocks"]["states"].count("c") >= 4  # the shared prefix stays cached
    assert data["running"] == data["waiting"] == []


def test_parallel_samples_share_their_prompt_blocks():
    engine = tiny_engine(num_blocks=64, block_size=4)
    producer = SnapshotProducer(engine)
    engine.add_request("p", list(range(30, 40)), params(max_tokens=6, n=3))
    seen_shared = False
    while engine.has_unfinished_requests():
        step(engine, producer)
        data = producer.capture().data
        assert_matches_engine(data, engine)
        seen_shared |= 3 in data["blocks"]["shared"].values()
    assert seen_shared


def test_waiting_queue_shows_recompute_preemptions():
    # 10 blocks of 4 tokens: three requests that grow to 30 tokens each cannot all fit.
    engine = tiny_engine(num_blocks=10, block_size=4, max_num_batched_tokens=64)
    producer = SnapshotProducer(engine)
    for i in range(3):
        engine.add_request(f"r{i}", list(range(40 + i, 50 + i)), params(max_tokens=20))
    statuses = set()
    while engine.has_unfinished_requests():
        step(engine, producer)
        data = producer.capture().data
        assert_matches_engine(data, engine)
        statuses |= {i["status"] for i in data["waiting"]}
    assert "preempted" in statuses
    assert engine.scheduler.num_preemptions > 0


def test_swapped_requests_hold_host_blocks():
    config = tiny_model_config()
    engine = make_engine(
        tiny_model(config), config,
        CacheConfig(4, 10, torch.float32, enable_prefix_caching=False, num_cpu_blocks=32),
        SchedulerConfig(64, 16, 256, preemption_mode="swap"),
    )  # fmt: skip
    producer = SnapshotProducer(engine)
    for i in range(3):
        engine.add_request(f"r{i}", list(range(40 + i, 50 + i)), params(max_tokens=20))
    swapped_seen = False
    while engine.has_unfinished_requests():
        step(engine, producer)
        data = producer.capture().data
        assert_matches_engine(data, engine)
        swapped = [i for i in data["waiting"] if i["status"] == "swapped"]
        if swapped:
            swapped_seen = True
            assert all(i["cpu_block_ids"] and not i["block_ids"] for i in swapped)
            assert data["cpu_blocks"]["states"].count("u") == sum(len(i["cpu_block_ids"]) for i in swapped)
    assert swapped_seen


def test_batch_entries_tell_prefill_chunks_decodes_and_verifies():
    engine = tiny_engine(num_blocks=64, block_size=4, max_num_batched_tokens=8)
    producer = SnapshotProducer(engine, max_rate_hz=1e9)  # a batch description every step
    sub = Subscriber(producer)
    try:
        engine.add_request("long", list(range(20)), params(max_tokens=3))  # 20 tokens in chunks of <= 8
        kinds = []
        while engine.has_unfinished_requests():
            before = engine.scheduler.requests["long"].num_computed_tokens
            step(engine, producer)
            batch = sub.drain()[-1].data["batch"]
            (entry,) = batch["requests"]
            assert entry["num_computed_tokens"] == before
            assert batch["num_scheduled_tokens"] == entry["num_tokens"] <= batch["max_num_batched_tokens"] == 8
            kinds.append((entry["kind"], entry["num_tokens"], entry["last_chunk"]))
        assert kinds == [("prefill", 8, False), ("prefill", 8, False), ("prefill", 4, True), ("decode", 1, True),
                         ("decode", 1, True)]
    finally:
        sub.close()

    config = tiny_model_config(vocab_size=32)
    spec = make_engine(
        tiny_model(config), config, CacheConfig(4, 64, torch.float32), SchedulerConfig(64, 16, 256),
        proposer=NgramProposer(3, 1, 3, 256),
    )  # fmt: skip
    producer = SnapshotProducer(spec, max_rate_hz=1e9)
    sub = Subscriber(producer)
    try:
        spec.add_request("rep", [1, 2, 3] * 6, params(max_tokens=12))
        verified = []
        while spec.has_unfinished_requests():
            drafts = list(spec.scheduler.requests["rep"].spec_token_ids)
            step(spec, producer)
            (entry,) = sub.drain()[-1].data["batch"]["requests"]
            if entry["kind"] == "verify":
                assert entry["num_spec"] == len(drafts) > 0 and entry["num_tokens"] == 1 + len(drafts)
                verified.append(entry)
            else:
                assert not drafts
        assert verified
    finally:
        sub.close()


def test_preempted_requests_are_in_the_batch_that_preempted_them():
    engine = tiny_engine(num_blocks=10, block_size=4, max_num_batched_tokens=64)
    producer = SnapshotProducer(engine, max_rate_hz=1e9)
    sub = Subscriber(producer)
    try:
        for i in range(3):
            engine.add_request(f"r{i}", list(range(40 + i, 50 + i)), params(max_tokens=20))
        preempted = []
        while engine.has_unfinished_requests():
            before = engine.scheduler.num_preemptions
            step(engine, producer)
            snap = sub.drain()[-1].data
            assert len(snap["batch"]["preempted"]) == engine.scheduler.num_preemptions - before
            assert snap["steps"][-1]["num_preempted"] == len(snap["batch"]["preempted"])
            preempted += snap["batch"]["preempted"]
        assert preempted
    finally:
        sub.close()


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_nothing_is_captured_without_a_subscriber():
    engine = tiny_engine()
    producer = SnapshotProducer(engine)
    engine.add_request("a", list(range(12)), params(max_tokens=5))
    while engine.has_unfinished_requests():
        step(engine, producer)
    producer.on_idle()
    assert producer.num_steps == 5  # the prompt and 4 decodes: counted, nothing else
    assert producer.latest is None and producer.num_snapshots == 0
    assert producer.capture_seconds == 0.0


def test_snapshots_are_throttled_but_every_step_is_summarised():
    engine = tiny_engine(num_blocks=64)
    clock = FakeClock()
    producer = SnapshotProducer(engine, max_rate_hz=10, clock=clock)
    sub = Subscriber(producer)
    try:
        engine.add_request("a", list(range(12)), params(max_tokens=40))
        num_steps = 0
        while engine.has_unfinished_requests():
            clock.now += 0.025  # 40 steps a second
            step(engine, producer)
            num_steps += 1
        snaps = sub.drain()
        # the first at once (a new subscriber), then one per 0.1 s: every 4th step
        assert len(snaps) == 1 + (num_steps - 1) // 4
        assert [s.data["seq"] for s in snaps] == list(range(len(snaps)))
        summarised = [st["step"] for s in snaps for st in s.data["steps"]]
        assert summarised == list(range(1, len(summarised) + 1))  # no step lost, none twice
        assert all(st["duration_s"] is not None for s in snaps for st in s.data["steps"])
        assert producer.capture_seconds > 0
        count = len(snaps)
        # idle: the end of the run as soon as the rate allows, then one a second
        clock.now += 0.2
        producer.on_idle()
        assert len(sub.drain()) == count + 1 and snaps[-1].data["running"] == []
        producer.on_idle()
        clock.now += 0.5
        producer.on_idle()
        assert len(sub.drain()) == count + 1  # nothing changed
        clock.now += 0.6
        producer.on_idle()
        assert len(sub.drain()) == count + 2
        producer.unsubscribe(sub.token)
        clock.now += 5
        producer.on_idle()
        assert len(sub.drain()) == count + 2
    finally:
        sub.close()


def test_reconnecting_subscribers_get_no_snapshots_past_the_rate():
    """A client that reconnects after every event forced a snapshot per reconnect (60-109 a
    second against max_rate_hz 10, measured served): a new subscriber's first snapshot now
    waits for the rate too, and an idle engine is told when it is due."""
    engine = tiny_engine(num_blocks=64)
    clock = FakeClock()
    producer = SnapshotProducer(engine, max_rate_hz=10, clock=clock)
    loop = asyncio.new_event_loop()
    got = []

    async def resubscribe(token):
        if token is not None:
            producer.unsubscribe(token)
        return producer.subscribe(got.append)

    try:
        token = loop.run_until_complete(resubscribe(None))
        engine.add_request("a", list(range(12)), params(max_tokens=40))
        num_steps = 0
        while engine.has_unfinished_requests():
            clock.now += 0.025  # 40 steps a second, a new subscriber before each
            token = loop.run_until_complete(resubscribe(token))
            step(engine, producer)
            num_steps += 1
        assert producer.num_snapshots == 1 + (num_steps - 1) // 4  # as for one steady subscriber
        # idle: a new subscriber 0.05 s after a snapshot gets one when the rate allows
        clock.now += 0.2
        assert producer.on_idle() is None  # the end of the run, published
        count = producer.num_snapshots
        clock.now += 0.05
        token = loop.run_until_complete(resubscribe(token))
        assert producer.on_idle() == pytest.approx(0.05)  # due in 0.05 s: not yet
        assert producer.num_snapshots == count
        clock.now += 0.05
        assert producer.on_idle() is None and producer.num_snapshots == count + 1
        assert producer.on_idle() is None and producer.num_snapshots == count + 1  # nothing pending
    finally:
        loop.close()


def test_fresh_takes_a_snapshot_for_a_one_off_reader():
    """The block route's lookup with no dashboard open: ``fresh`` subscribes until the engine
    thread publishes, then lets go; a recent snapshot is returned as it is."""
    engine = tiny_engine(num_blocks=64)
    clock = FakeClock()
    producer = SnapshotProducer(engine, max_rate_hz=10, clock=clock)
    loop = asyncio.new_event_loop()
    try:
        assert loop.run_until_complete(producer.fresh(timeout_s=0.01)) is None  # nothing published
        assert producer.num_subscribers == 0

        async def lookup():
            task = asyncio.ensure_future(producer.fresh(timeout_s=5))
            await asyncio.sleep(0)
            assert producer.num_subscribers == 1
            producer.on_idle()  # the engine thread, between steps
            return await task

        snap = loop.run_until_complete(lookup())
        assert snap is producer.latest and snap.data["blocks"]["num_blocks"] == 64
        assert producer.num_subscribers == 0
        clock.now += 0.5
        assert loop.run_until_complete(producer.fresh(timeout_s=0.01)) is snap  # recent enough
        clock.now += 1.0
        assert loop.run_until_complete(producer.fresh(timeout_s=0.01)) is snap  # stale, none came: as it is
        assert producer.num_snapshots == 1
    finally:
        loop.close()


def test_steps_longer_than_the_interval_are_each_shown():
    """The throttle counts from the last snapshot to the end of a step: with 0.2 s steps
    and at most 10 snapshots a second, every step's batch is shown (not every other one)."""
    engine = tiny_engine(num_blocks=64)
    clock = FakeClock()
    producer = SnapshotProducer(engine, max_rate_hz=10, clock=clock)
    sub = Subscriber(producer)

    def scheduled(started):
        producer.on_scheduled(engine.last_scheduler_output)
        clock.now += 0.2  # the forward

    try:
        engine.add_request("a", list(range(12)), params(max_tokens=6))
        num_steps = 0
        while engine.has_unfinished_requests():
            engine.step(on_scheduled=scheduled)
            producer.after_step()
            num_steps += 1
        snaps = sub.drain()
        assert [s.data["batch"]["step"] for s in snaps] == list(range(1, num_steps + 1))
        assert all(s.data["batch"]["duration_s"] == pytest.approx(0.2) for s in snaps)
    finally:
        sub.close()


def test_describe_block_gives_owners_and_tokens():
    engine = tiny_engine(num_blocks=64, block_size=4)
    producer = SnapshotProducer(engine)
    with pytest.raises(ValueError, match="no snapshot"):
        producer.describe_block(0)
    engine.add_request("a", PREFIX + [1], params(max_tokens=6))
    step(engine, producer)
    engine.add_request("b", PREFIX + [2], params(max_tokens=6))
    step(engine, producer)
    producer.latest = producer.capture()
    a, b = engine.scheduler.requests["a"], engine.scheduler.requests["b"]
    shared = table(a)[1]
    info = producer.describe_block(shared)
    assert info["state"] == "s" and info["ref_cnt"] == 2
    assert sorted(o["id"] for o in info["owners"]) == ["a", "b"] and {o["index"] for o in info["owners"]} == {1}
    assert info["token_ids"] == PREFIX[4:8]
    last = table(a)[-1]  # a's last block, partly filled
    info = producer.describe_block(last)
    assert info["owners"] == [{"id": "a", "index": len(table(a)) - 1}]
    computed_in_last = a.num_computed_tokens - (len(table(a)) - 1) * 4
    assert info["token_ids"] == a.all_token_ids[(len(table(a)) - 1) * 4 : a.num_computed_tokens]
    assert len(info["token_ids"]) == computed_in_last
    free = next(i for i, ch in enumerate(producer.latest.data["blocks"]["states"]) if ch == "f")
    assert producer.describe_block(free)["token_ids"] == [] and producer.describe_block(free)["owners"] == []
    with pytest.raises(ValueError, match="block_id"):
        producer.describe_block(64)
    # once both finish, their prefix blocks are cached: the text is still known
    while engine.has_unfinished_requests():
        step(engine, producer)
    producer.latest = producer.capture()
    info = producer.describe_block(shared)
    assert info["state"] == "c" and info["owners"] == [] and info["source"] == "cache"
    assert info["token_ids"] == PREFIX[4:8]


def test_async_engine_publishes_snapshots_to_its_loop():
    async def main():
        engine = AsyncLLMEngine(tiny_engine(num_blocks=64), "tiny")
        engine.snapshots.min_interval_s = 0.0  # a snapshot after every step (the tiny model's take ms)
        engine.start()
        try:
            snaps = []
            got = asyncio.Event()

            def on_snapshot(snap):
                snaps.append(snap)
                got.set()

            token = engine.snapshots.subscribe(on_snapshot)
            await asyncio.wait_for(got.wait(), 10)  # the first one at once, while idle
            assert snaps[0].data["running"] == [] and snaps[0].data["batch"] is None
            it = await engine.add_request("a", list(range(12)), params(max_tokens=30))
            async for _ in it:
                pass
            await asyncio.sleep(0.7)  # the idle snapshot after the request finished
            engine.snapshots.unsubscribe(token)
            batches = [s.data["batch"] for s in snaps if s.data["batch"] is not None]
            assert batches and batches[0]["requests"][0]["id"] == "a"
            assert snaps[-1].data["running"] == [] and "u" not in snaps[-1].data["blocks"]["states"]
            assert sum(len(s.data["steps"]) for s in snaps) == engine.snapshots.num_steps
            import json

            assert json.loads(snaps[-1].json()) == snaps[-1].data
            count = len(snaps)
            await asyncio.sleep(1.2)
            assert len(snaps) == count  # unsubscribed
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_max_rate_is_checked():
    with pytest.raises(ValueError, match="max_rate_hz"):
        SnapshotProducer(tiny_engine(), max_rate_hz=0)
