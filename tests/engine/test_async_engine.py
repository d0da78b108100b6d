"""AsyncLLMEngine on a tiny random model: the event loop never waits on a model step, the
queue bound is hard and all-or-nothing, one failed request fails alone, a dead engine
fails every open request and says so, and a consumer or loop that lags gets the outputs
coalesced."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
import torch

from conftest import tiny_engine
from kvflow.engine.async_engine import (
    AsyncLLMEngine, EngineDeadError, QueueFullError, QueueTooSmallError, RequestFailedError,
)  # fmt: skip
from kvflow.model.llama import LlamaForCausalLM
from kvflow.outputs import CompletionOutput, RequestFailure, RequestOutput, RequestOutputKind
from kvflow.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6)
# Nothing in the loop may take this long; a step below is held for three times as long.
LOOP_BOUND_S = 1.0
HELD_STEP_S = 3 * LOOP_BOUND_S


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


class HeldForward:
    """Patches the model forward so that, once armed, the next forward blocks (like a long
    prefill) until ``release()`` or ``HELD_STEP_S``; ``entered`` is set when it starts."""

    def __init__(self, monkeypatch) -> None:
        self.armed = False
        self.entered = threading.Event()
        self.released = threading.Event()
        original = LlamaForCausalLM.forward

        def forward(model, *args, **kwargs):
            if self.armed:
                self.armed = False
                self.entered.set()
                self.released.wait(HELD_STEP_S)
            return original(model, *args, **kwargs)

        monkeypatch.setattr(LlamaForCausalLM, "forward", forward)

    def release(self) -> None:
        self.released.set()


async def _wait(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def _drain(iterator) -> list:
    return [out async for out in iterator]


def test_add_abort_and_stats_never_wait_for_the_step_in_progress(monkeypatch):
    held = HeldForward(monkeypatch)

    async def main():
        engine = AsyncLLMEngine(tiny_engine(), "tiny")
        engine.start()
        try:
            held.armed = True
            first = await engine.add_request("a", [1, 2, 3, 4, 5], GREEDY)
            pump = asyncio.create_task(_drain(first))
            await asyncio.get_running_loop().run_in_executor(None, held.entered.wait, 30)
            # The engine thread is inside a step now: none of these may wait for it.
            t0 = time.monotonic()
            second = await engine.add_request("b", [6, 7, 8], GREEDY)
            third = await engine.add_request("c", [9, 10], GREEDY)
            engine.abort("c")
            stats = engine.get_stats()
            elapsed = time.monotonic() - t0
            assert not held.released.is_set()
            assert elapsed < LOOP_BOUND_S, elapsed
            # The gauges were published after scheduling, before the (held) forward.
            assert stats["num_running"] == 1 and stats["kv_cache_usage"] > 0, stats
            # "b" and "c" are queued for admission (c's abort is applied with it, between steps)
            assert stats["num_waiting"] == 2, stats
            assert engine.metrics.num_requests_running._value.get() == 1
            assert engine.metrics.kv_cache_usage_perc._value.get() > 0
            held.release()
            outs = await asyncio.wait_for(pump, 60)
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 6
            outs = await asyncio.wait_for(_drain(second), 60)
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 6
            with pytest.raises(asyncio.TimeoutError):  # aborted: never gets an output
                await asyncio.wait_for(anext(third), 0.5)
            await _wait(lambda: engine.get_stats()["num_free_blocks"] == 64)
        finally:
            held.release()
            engine.shutdown()

    asyncio.run(main())


def test_queue_bound_is_hard_and_all_or_nothing():
    async def main():
        engine = AsyncLLMEngine(tiny_engine(), "tiny", max_queue_len=3)  # not started: nothing runs yet
        prepared = [await engine.prepare([1 + i, 2, 3], GREEDY) for i in range(6)]
        engine.add_requests([("a", prepared[0], None), ("b", prepared[1], None)])
        with pytest.raises(QueueFullError, match="needs 2 places"):
            engine.add_requests([("c", prepared[2], None), ("d", prepared[3], None)])
        assert set(engine._streams) == {"a", "b"} and len(engine._commands) == 2  # neither c nor d
        engine.add_requests([("c", prepared[2], None)])
        with pytest.raises(QueueFullError):
            engine.add_requests([("d", prepared[3], None)])
        engine.abort("a")  # a place frees at once
        its = engine.add_requests([("d", prepared[3], None)])
        engine.start()
        try:
            # Once the engine has scheduled them, the queue is empty again.
            await _wait(lambda: not engine._unstarted)
            more = engine.add_requests([("e", prepared[4], None), ("f", prepared[5], None)])
            for it in [*its, *more]:
                outs = await asyncio.wait_for(_drain(it), 60)
                assert outs[-1].finished
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_more_requests_than_the_queue_holds_can_never_fit():
    async def main():
        engine = AsyncLLMEngine(tiny_engine(), "tiny", max_queue_len=3)  # not started
        prepared = [await engine.prepare([1 + i, 2, 3], GREEDY) for i in range(4)]
        with pytest.raises(QueueTooSmallError, match="4 prompts but the queue holds at most 3") as info:
            engine.add_requests([(f"r{i}", p, None) for i, p in enumerate(prepared)])
        assert not isinstance(info.value, QueueFullError)  # not "full, retry later"
        assert not engine._streams and not engine._commands
        engine.add_requests([(f"r{i}", p, None) for i, p in enumerate(prepared[:3])])  # the limit fits
        engine.shutdown()

    asyncio.run(main())


def test_invalid_request_is_refused_before_it_is_queued():
    async def main():
        engine = AsyncLLMEngine(tiny_engine(), "tiny")
        for prompt, params, match in (
            ([], GREEDY, "empty"),
            ([1, 500], GREEDY, "prompt_token_ids"),
            ([1, 2], SamplingParams(logit_bias={500: 1}), "logit_bias"),
        ):
            with pytest.raises(ValueError, match=match):
                await engine.prepare(prompt, params)
        assert not engine._commands and not engine._streams

    asyncio.run(main())


def test_a_failed_request_fails_alone(monkeypatch):
    from kvflow.worker.model_runner import ModelRunner

    original = ModelRunner.prepare_inputs

    def prepare(self, out):
        if any(r.prompt_token_ids[:2] == [127, 127] for r in map(self.requests.get, out.scheduled_req_ids)):
            raise RuntimeError("injected")
        return original(self, out)

    monkeypatch.setattr(ModelRunner, "prepare_inputs", prepare)

    async def main():
        engine = AsyncLLMEngine(tiny_engine(), "tiny")
        engine.start()
        try:
            good = await engine.add_request("good", [1, 2, 3], GREEDY)
            bad = await engine.add_request("bad", [127, 127, 3], GREEDY)
            with pytest.raises(RequestFailedError) as exc:
                await asyncio.wait_for(_drain(bad), 60)
            assert "injected" in exc.value.failure.message and not exc.value.failure.is_invalid_request
            outs = await asyncio.wait_for(_drain(good), 60)
            assert outs[-1].finished and outs[-1].error is None
            assert engine.is_healthy and engine.metrics.request_failure._value.get() == 1
            later = await engine.add_request("later", [4, 5], GREEDY)
            assert (await asyncio.wait_for(_drain(later), 60))[-1].finished
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_a_dead_engine_fails_every_open_request_and_refuses_new_ones(monkeypatch):
    def forward(model, *args, **kwargs):
        raise RuntimeError("injected: the device is gone")

    monkeypatch.setattr(LlamaForCausalLM, "forward", forward)
    deaths = []

    async def main():
        engine = AsyncLLMEngine(tiny_engine(), "tiny", on_dead=deaths.append)
        engine.start()
        try:
            prepared = [await engine.prepare([1 + i, 2, 3], GREEDY) for i in range(3)]
            its = engine.add_requests([(f"r{i}", p, None) for i, p in enumerate(prepared)])
            for it in its:
                with pytest.raises(EngineDeadError, match="engine failed"):
                    await asyncio.wait_for(_drain(it), 60)
            await _wait(lambda: not engine.is_healthy)
            assert isinstance(engine.error, RuntimeError) and "unusable" in str(engine.error)
            prepared = await engine.prepare([1, 2], GREEDY)
            with pytest.raises(EngineDeadError):
                engine.add_requests([("late", prepared, None)])
        finally:
            engine.shutdown()

    asyncio.run(main())
    assert len(deaths) == 1 and "unusable" in str(deaths[0])


def _output(request_id: str, tokens: list[int], finished: bool = False) -> RequestOutput:
    text = "".join(f"<{t}>" for t in tokens)
    return RequestOutput(request_id, None, [1, 2], [CompletionOutput(0, text, list(tokens), "length" if finished else None)],
                         finished, {"arrival_time": 0.0})  # fmt: skip


def test_a_lagging_consumer_gets_the_newest_output_and_the_final_one():
    """The engine thread sends deltas; a consumer that fell behind gets the queued ones as
    one cumulative output (one SSE event for several tokens), and the same final text and
    tokens as one that kept up."""

    async def main():
        engine = AsyncLLMEngine(tiny_engine(), "tiny")
        engine.start()
        try:
            prompt, params = [1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
            kept_up = await _drain(await engine.add_request("a", prompt, params))
            assert kept_up[-1].finished and len(kept_up[-1].outputs[0].token_ids) == 6
            lagging = await engine.add_request("b", prompt, params)
            await _wait(lambda: "b" not in engine._streams)  # every output is queued, unread
            outs = await _drain(lagging)
            assert len(outs) == 1 and outs[0].finished
            assert outs[0].outputs[0].token_ids == kept_up[-1].outputs[0].token_ids
            assert outs[0].outputs[0].text == kept_up[-1].outputs[0].text
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_a_delta_stream_yields_only_the_new_tokens_and_adds_up_to_the_cumulative_one():
    async def main():
        engine = AsyncLLMEngine(tiny_engine(), "tiny")
        engine.start()
        try:
            prompt, params = [1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
            full = (await _drain(await engine.add_request("a", prompt, params)))[-1].outputs[0]
            prepared = await engine.prepare(prompt, params)
            (it,) = engine.add_requests([("b", prepared, None)], output_kind=RequestOutputKind.DELTA)
            deltas = [o.outputs[0] for o in await _drain(it)]
            assert sum(len(d.token_ids) for d in deltas) == 6 and len(full.token_ids) == 6
            assert [t for d in deltas for t in d.token_ids] == full.token_ids
            assert deltas[-1].finish_reason == "length"
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_coalescing_stops_at_an_error_and_at_the_final_output():
    async def main():
        engine = AsyncLLMEngine(tiny_engine(), "tiny")  # not started: the test feeds the stream
        prepared = await engine.prepare([1, 2], GREEDY)
        (it,) = engine.add_requests([("a", prepared, None)])
        queue = engine._streams["a"].queue
        failure = RequestFailedError(RequestFailure("injected", is_invalid_request=False))
        # the engine thread sends DELTA outputs: the queued ones are merged up to the error
        for item in (_output("a", [5]), _output("a", [6]), failure, _output("a", [7], finished=True)):
            queue.put_nowait(item)
        out = await anext(it)
        assert out.outputs[0].token_ids == [5, 6]  # everything before the error
        with pytest.raises(RequestFailedError, match="injected"):
            await anext(it)

        prepared = await engine.prepare([3, 4], GREEDY)
        (it,) = engine.add_requests([("b", prepared, None)])
        queue = engine._streams["b"].queue
        for item in (_output("b", [5]), _output("b", [6], finished=True), _output("b", [7])):
            queue.put_nowait(item)
        assert [o.outputs[0].token_ids for o in await _drain(it)] == [[5, 6]]  # ends at the final one

    asyncio.run(main())


class _RecordingLoop:
    """Stands for an event loop that is busy: records ``call_soon_threadsafe`` calls."""

    def __init__(self) -> None:
        self.calls: list = []

    def call_soon_threadsafe(self, fn, *args):
        self.calls.append((fn, args))

    def add_reader(self, fd, callback):  # as Windows' proactor loop: wake-ups by call_soon_threadsafe
        raise NotImplementedError

    def run_pending(self) -> None:
        calls, self.calls = self.calls, []
        for fn, args in calls:
            fn(*args)


def test_steps_delivered_while_the_loop_lags_share_one_wakeup(monkeypatch):
    """The engine thread posts one drain per loop until the loop runs it; the drain
    dispatches every step's batch, oldest first, each with its own step time."""
    engine = AsyncLLMEngine(tiny_engine(), "tiny")
    loop = _RecordingLoop()
    dispatched = []
    monkeypatch.setattr(engine, "_dispatch", lambda outs, now: dispatched.append(([o.outputs[0].token_ids for o in outs], now)))
    engine._register(loop)
    engine._request_loops = {"a": loop, "b": loop}
    times = iter([10.0, 11.0, 12.0, 13.0])
    monkeypatch.setattr(time, "monotonic", lambda: next(times))
    engine._deliver([_output("a", [5]), _output("b", [7])])
    engine._deliver([_output("a", [5, 6])])
    engine._deliver([_output("b", [7, 8])])
    assert len(loop.calls) == 1 and not dispatched  # one wake-up for three steps
    loop.run_pending()
    assert dispatched == [([[5], [7]], 10.0), ([[5, 6]], 11.0), ([[7, 8]], 12.0)]
    engine._deliver([_output("a", [5, 6, 9], finished=True)])  # the drain ran: a new wake-up
    assert len(loop.calls) == 1
    loop.run_pending()
    assert dispatched[-1] == ([[5, 6, 9]], 13.0) and "a" not in engine._request_loops


def test_outputs_wake_the_loop_through_a_pipe_not_call_soon_threadsafe(monkeypatch):
    """The engine thread wakes a selector loop by writing to a pipe the loop watches
    (``os.write`` releases the GIL for the system call), never with
    ``call_soon_threadsafe``; several steps before the loop runs share one wake-up, and the
    loop dispatches them all."""
    engine = AsyncLLMEngine(tiny_engine(), "tiny")
    loop = asyncio.new_event_loop()
    posted, dispatched = [], []
    real_post = loop.call_soon_threadsafe
    monkeypatch.setattr(loop, "call_soon_threadsafe", lambda fn, *args: (posted.append(fn), real_post(fn, *args)))
    monkeypatch.setattr(engine, "_dispatch", lambda outs, now: dispatched.append([o.request_id for o in outs]))
    writes = []
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: (writes.append(fd), real_write(fd, data))[1])
    try:
        engine._register(loop)
        waker_fd = engine._wakers[loop]._write_fd
        assert waker_fd is not None
        engine._request_loops = {"a": loop, "b": loop}

        def engine_thread() -> None:
            engine._deliver([_output("a", [5])])
            engine._deliver([_output("b", [7])])

        thread = threading.Thread(target=engine_thread)
        thread.start()
        thread.join()
        assert writes.count(waker_fd) == 1 and not dispatched  # one wake-up for two steps, none run yet
        loop.run_until_complete(asyncio.sleep(0.05))
        assert dispatched == [["a"], ["b"]]
        assert not posted
        engine._deliver([_output("a", [5, 6], finished=True)])  # drained: the next step wakes again
        loop.run_until_complete(asyncio.sleep(0.05))
        assert dispatched[-1] == ["a"] and writes.count(waker_fd) == 2 and not posted
    finally:
        engine.shutdown()
        loop.close()


def test_gauges_are_refreshed_at_scheduling_only_when_requests_start_or_are_preempted(monkeypatch):
    """``_on_scheduled`` runs before every forward: ``get_stats`` (which walks every running
    request's block table) is called there only when the step starts requests or preempts
    some; after the step the gauges are refreshed as always."""
    from kvflow.core.sched_output import SchedulerOutput

    engine = AsyncLLMEngine(tiny_engine(), "tiny")
    calls = []
    real = engine.engine.get_stats
    monkeypatch.setattr(engine.engine, "get_stats", lambda: (calls.append(1), real())[1])
    batch = SchedulerOutput()
    monkeypatch.setattr(type(engine.engine), "last_scheduler_output", property(lambda self: batch))
    engine._on_scheduled([])  # a step of running requests only
    assert calls == []
    engine._on_scheduled(["a"])  # a request starts: the waiting and running gauges change
    assert len(calls) == 1
    batch.preempted_req_ids.append("b")  # a preemption changes them too
    engine._on_scheduled([])
    assert len(calls) == 2


def test_prompt_logprobs_come_with_the_first_output_of_a_stream():
    """As vLLM's: a CUMULATIVE stream has the prompt logprobs on every output from the first
    on (the first token's, after the prompt's last chunk), a DELTA stream on its first
    output only, merged deltas keep them; the values of the final output before."""

    async def main():
        engine = AsyncLLMEngine(tiny_engine(max_num_batched_tokens=4), "tiny")
        engine.start()
        try:
            prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # three prefill chunks
            params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, prompt_logprobs=1)
            cumulative = await _drain(await engine.add_request("a", prompt, params))
            want = cumulative[-1].prompt_logprobs
            assert len(want) == len(prompt) and want[0] is None and all(want[1:])
            assert len(cumulative[0].outputs[0].token_ids) < 32 and not cumulative[0].finished
            assert all(o.prompt_logprobs == want for o in cumulative)
            prepared = await engine.prepare(prompt, params)
            (it,) = engine.add_requests([("b", prepared, None)], output_kind=RequestOutputKind.DELTA)
            deltas = await _drain(it)
            assert deltas[0].prompt_logprobs == want and all(o.prompt_logprobs is None for o in deltas[1:])
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_the_iterator_takes_the_params_output_kind_and_final_only_gives_one_output():
    async def main():
        engine = AsyncLLMEngine(tiny_engine(), "tiny")  # not started: the test feeds the stream
        for kind in RequestOutputKind:
            params = SamplingParams(temperature=0, max_tokens=3, output_kind=kind)
            prepared = await engine.prepare([1, 2], params)
            (it,) = engine.add_requests([(kind.name, prepared, None)])
            queue = engine._streams[kind.name].queue

            async def feed():
                for i, token in enumerate((5, 6, 7)):
                    queue.put_nowait(_output(kind.name, [token], finished=i == 2))
                    await asyncio.sleep(0)

            feeder = asyncio.ensure_future(feed())
            got = [out.outputs[0].token_ids async for out in it]
            await feeder
            want = {RequestOutputKind.DELTA: [[5], [6], [7]], RequestOutputKind.FINAL_ONLY: [[5, 6, 7]]}
            assert got[-1] == ([7] if kind is RequestOutputKind.DELTA else [5, 6, 7]), (kind, got)
            if kind in want:
                assert got == want[kind], (kind, got)
        bad = await engine.prepare([1, 2], SamplingParams(temperature=0, max_tokens=3))
        bad.params.output_kind = "delta"
        with pytest.raises(ValueError, match="output_kind"):
            engine.add_requests([("bad", bad, None)])
        assert "bad" not in engine._streams

    asyncio.run(main())


def test_a_lagging_consumer_keeps_the_prompt_logprobs_of_the_first_output():
    async def main():
        engine = AsyncLLMEngine(tiny_engine(), "tiny")  # not started: the test feeds the stream
        plp = [None, {2: -0.5}]
        for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA):
            prepared = await engine.prepare([1, 2], GREEDY)
            (it,) = engine.add_requests([(kind.name, prepared, None)], output_kind=kind)
            queue = engine._streams[kind.name].queue
            first = _output(kind.name, [5])
            first.prompt_logprobs = plp
            for item in (first, _output(kind.name, [6])):
                queue.put_nowait(item)
            out = await anext(it)  # the two, merged
            assert out.outputs[0].token_ids == [5, 6] and out.prompt_logprobs == plp
            queue.put_nowait(_output(kind.name, [7], finished=True))
            (last,) = await _drain(it)
            assert last.prompt_logprobs == (plp if kind is RequestOutputKind.CUMULATIVE else None)

    asyncio.run(main())


def test_shutdown_with_requests_in_flight_lets_go_of_the_heaps_freeze(monkeypatch):
    """KVFLOW_GC_FREEZE (off for the other tests): the engine holds the heap frozen while
    requests are in flight; a server stopped in the middle of one left that hold behind, and
    with it the heap frozen after the server's own unfreeze."""
    import gc

    import kvflow.utils

    held = HeldForward(monkeypatch)
    monkeypatch.setenv("KVFLOW_GC_FREEZE", "1")

    async def main():
        engine = AsyncLLMEngine(tiny_engine(), "tiny")
        engine.start()
        try:
            held.armed = True
            await engine.add_request("a", [1, 2, 3, 4, 5], GREEDY)
            await asyncio.get_running_loop().run_in_executor(None, held.entered.wait, 30)
            assert gc.get_freeze_count() > 0  # a request in flight
        finally:
            held.release()
            engine.begin_shutdown()
            await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)

    try:
        asyncio.run(main())
        assert kvflow.utils._freeze_holds == 0 and gc.get_freeze_count() == 0
    finally:
        while kvflow.utils._freeze_holds:
            kvflow.utils.release_gc_freeze()
        gc.unfreeze()


def test_closed_event_loops_are_forgotten_with_their_pipes():
    """A script calling the engine through ``asyncio.run`` once per request (a new event loop
    each time) keeps at most the last closed loop: before, every loop kept its waker's two
    pipe descriptors for the engine's life (200 calls: 400 descriptors; the default limit of
    1024 runs out after ~500 calls)."""
    engine = AsyncLLMEngine(tiny_engine(), "tiny")
    engine.start()

    async def one(i):
        it = await engine.add_request(f"r{i}", [1, 2, 3], SamplingParams(temperature=0, max_tokens=2))
        return [out async for out in it][-1]

    try:
        asyncio.run(one(0))
        fds = len(os.listdir("/proc/self/fd"))
        for i in range(1, 40):
            assert asyncio.run(one(i)).finished
        assert len(engine._wakers) <= 2 and len(engine._loops) <= 2 and len(engine._outbox) <= 2
        assert len(os.listdir("/proc/self/fd")) <= fds + 2
    finally:
        engine.shutdown()


def test_an_id_aborted_and_added_again_gets_none_of_the_old_requests_outputs(monkeypatch):
    """Abort "x" while a step holding it runs, then add a new "x": the step's output for the
    old "x" reaches the loop after the new stream took the id. It went to the new stream
    (its first output carried the old prompt and token, merged into the new request's
    tokens: 4 tokens for max_tokens=3); it is dropped now."""
    held = HeldForward(monkeypatch)

    async def main():
        engine = AsyncLLMEngine(tiny_engine(), "tiny")
        engine.start()
        try:
            old = await engine.add_request("x", [1, 2, 3], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
            await anext(old)
            held.armed = True
            await asyncio.to_thread(held.entered.wait, 30)  # a step with the old "x" is running
            engine.abort("x")
            new = await engine.add_request("x", [9, 9, 9, 9], SamplingParams(temperature=0, max_tokens=3,
                                                                               ignore_eos=True))
            held.release()
            outs = await asyncio.wait_for(_drain(new), 60)
            assert all(o.prompt_token_ids == [9, 9, 9, 9] for o in outs)
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
            await _wait(lambda: engine.get_stats()["num_free_blocks"] == 64)
        finally:
            held.release()
            engine.shutdown()

    asyncio.run(main())


def test_a_request_left_on_a_closed_loop_is_aborted_and_frees_its_queue_place():
    """An iterator never iterated (no ``finally`` aborts it) whose event loop closed: its
    request was scheduled, but the start was posted to the dead loop, so it held its place in
    the ``max_queue_len`` count for ever (every later request: QueueFullError) and ran to
    its end. The next loop to add a request aborts it."""
    engine = AsyncLLMEngine(tiny_engine(), "tiny", max_queue_len=1)
    engine.start()

    gate = threading.Event()

    async def orphan():
        # the engine thread waits on the gate before it takes the request: it is scheduled
        # (its start posted) once this loop is closed
        asyncio.ensure_future(engine.call_on_engine(gate.wait, 30))
        await asyncio.sleep(0)
        return await engine.add_request("orphan", [1, 2, 3], SamplingParams(temperature=0, max_tokens=200,
                                                                            ignore_eos=True))

    async def one():
        # taken and scheduled: its start went to the dead loop
        await _wait(lambda: engine._num_applied == 1 and engine.get_stats()["num_waiting"] == 0)
        it = await engine.add_request("next", [1, 2, 3], SamplingParams(temperature=0, max_tokens=2))
        return [out async for out in it][-1]

    try:
        asyncio.run(orphan())
        gate.set()
        assert asyncio.run(one()).finished
        assert not engine._unstarted and "orphan" not in engine._streams
        asyncio.run(_wait(lambda: engine.get_stats()["num_free_blocks"] == 64 and engine.get_stats()["num_running"] == 0))
    finally:
        gate.set()
        engine.shutdown()
