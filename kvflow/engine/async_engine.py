"""The engine behind the server: one background thread drives ``LLMEngine.step()``.

The event loop never waits on a model step, as in vLLM's engine-core client:

- Requests and aborts go to the engine thread through a command queue (a ``deque``) that
  the thread drains between steps; no lock is shared with the thread, so ``add_requests``,
  ``abort`` and ``get_stats`` return at once whatever the step in progress.
- The work before admission — validation, grammar compilation (``LLMEngine.prepare_request``)
  and, in the server, tokenization and the chat template — runs on a worker thread
  (``run_off_loop``), so that a bad request is still refused (HTTP 400) before a byte of its
  response is sent.
- Outputs come back to the loop with one wake-up per step, or fewer when the loop has not
  yet taken the previous steps' outputs (``_drain`` takes them all); the per-request streams,
  the queue count and the latency histograms are only touched on the loop. The wake-up is a
  byte written to a pipe that the loop watches (``loop.add_reader``; ``_Waker``), not
  ``loop.call_soon_threadsafe``: ``os.write`` releases the GIL around its system call, while
  uvloop's ``call_soon_threadsafe`` makes it holding the GIL, and on a busy CPU the kernel
  often switches to the woken loop thread inside that call, so the engine thread sat
  descheduled with the GIL while the loop thread waited for it (measured: 16 % of the engine
  thread's GIL time in a served single stream on 2 loaded cores). The thread publishes the
  engine's stats (the gauges) after each step, and after scheduling when requests started or
  were preempted, so that they are right during a long step. It also takes the dashboard's
  snapshots of the engine's state between steps (``kvflow/engine/snapshot.py``).

A request that fails inside the engine (``LLMEngine.step``) raises ``RequestFailedError`` in
its own iterator. A fault that stops the engine fails every open request with
``EngineDeadError`` and calls ``on_dead`` (the server then exits non-zero). Shutting down
(``begin_shutdown`` / ``shutdown``) fails every open request with ``EngineShutdownError`` at
once, and the thread exits after the step in progress: a stop waits for one step, not for
the requests to finish.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvflow.cpu_threads import release_openmp_threads
from kvflow.engine.llm_engine import LLMEngine, PreparedRequest, default_output_kind
from kvflow.engine.snapshot import SnapshotProducer
from kvflow.metrics import EngineMetrics
from kvflow.outputs import CompletionOutput, EmbeddingRequestOutput, RequestFailure, RequestOutput, RequestOutputKind
from kvflow.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")


class QueueFullError(RuntimeError):
    """Raised when admitting the requests would exceed ``max_queue_len``."""


class QueueTooSmallError(ValueError):
    """Raised when one call brings more requests than ``max_queue_len`` holds at all: it
    can never be admitted, so retrying is pointless (unlike ``QueueFullError``)."""


class EngineDeadError(RuntimeError):
    """Raised for requests once the engine thread has failed."""


class EngineShutdownError(EngineDeadError):
    """Raised for the requests still open when the engine is shut down (the server stops),
    and for requests that arrive after that."""


class RequestFailedError(RuntimeError):
    """Raised in a request's output iterator when the engine failed that request alone.

    Attributes:
        failure: what went wrong, and whether the request was at fault.
    """

    def __init__(self, failure: RequestFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure


@dataclass
class _Stream:
    queue: asyncio.Queue
    num_prompt_tokens: int
    last_token_time: float | None = None
    finished: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # CUMULATIVE streams: the outputs so far, grown from the engine's deltas on the loop
    texts: dict[int, list[str]] = field(default_factory=dict)
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list] = field(default_factory=dict)
    prompt_logprobs: list | None = None  # those a DELTA output gave
    loop: asyncio.AbstractEventLoop | None = None  # the loop its iterator belongs to


class _Waker:
    """Wakes one event loop from another thread: ``wake`` writes a byte to a pipe that the
    loop watches with ``add_reader``, and the loop then calls ``callback``.

    ``os.write`` releases the GIL for its system call, so a thread switch there (the kernel
    running the woken loop thread at once) never leaves the GIL with a descheduled thread, as
    ``loop.call_soon_threadsafe`` can under uvloop. A loop without ``add_reader`` (Windows'
    proactor loop) is woken with ``call_soon_threadsafe`` instead.

    Args:
        loop: the loop to wake (created on its thread: ``add_reader`` is called here).
        callback: called on the loop after one or more ``wake`` calls (at least once after
            each).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
        self.loop, self.callback = loop, callback
        self._read_fd: int | None = None
        self._write_fd: int | None = None
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        os.set_blocking(write_fd, False)
        try:
            loop.add_reader(read_fd, self._on_readable)
        except (NotImplementedError, RuntimeError):  # no selector (proactor) or a closed loop
            os.close(read_fd)
            os.close(write_fd)
            return
        self._read_fd, self._write_fd = read_fd, write_fd

    def wake(self) -> None:
        """Have ``callback`` run on the loop soon (any thread; never blocks)."""
        fd = self._write_fd
        if fd is None:
            AsyncLLMEngine._post(self.loop, self.callback)
            return
        try:
            os.write(fd, b"\0")
        except BlockingIOError:  # the pipe is full: the loop has wake-ups pending anyway
            pass
        except OSError:  # closed: nobody is listening
            pass

    def _on_readable(self) -> None:
        try:
            while len(os.read(self._read_fd, 4096)) == 4096:
                pass
        except (BlockingIOError, TypeError):
            pass
        self.callback()

    def close(self) -> None:
        """Stop watching the pipe and close it (on the loop's thread, or once it stopped)."""
        read_fd, write_fd, self._read_fd, self._write_fd = self._read_fd, self._write_fd, None, None
        if read_fd is None:
            return
        try:
            if not self.loop.is_closed():
                self.loop.remove_reader(read_fd)
        except RuntimeError:
            pass
        os.close(read_fd)
        os.close(write_fd)


def merge_delta(into: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """``newer`` (a DELTA output) appended to ``into`` (an earlier DELTA output of the same
    request), as vLLM's ``RequestOutput.add``: one DELTA output covering both steps."""
    by_index = {c.index: c for c in into.outputs}
    for c in newer.outputs:
        old = by_index.get(c.index)
        if old is None:
            into.outputs.append(c)
            continue
        old.text += c.text
        old.token_ids = old.token_ids + c.token_ids
        if c.logprobs is not None:
            old.logprobs = (old.logprobs or []) + c.logprobs
        old.cumulative_logprob = c.cumulative_logprob
        old.finish_reason, old.stop_reason = c.finish_reason, c.stop_reason
    into.finished = newer.finished
    into.metrics = newer.metrics
    if newer.prompt_logprobs is not None:  # (the first DELTA output has them)
        into.prompt_logprobs = newer.prompt_logprobs
    into.num_cached_tokens = newer.num_cached_tokens
    return into


class AsyncLLMEngine:
    """Thread-driven wrapper of ``LLMEngine`` for asyncio servers.

    Args:
        engine: the engine. Once ``start`` has run, its methods are only called from the
            engine thread, except ``prepare_request`` (thread-safe) on the worker thread.
        model_name: label of the Prometheus metrics.
        max_queue_len: at most this many requests accepted and not yet scheduled (a hard
            bound); more raise ``QueueFullError`` (None: no limit).
        on_dead: called (on the engine thread) with the exception that stopped the engine.
    """

    def __init__(
        self,
        engine: LLMEngine,
        model_name: str,
        max_queue_len: int | None = None,
        on_dead: Callable[[BaseException], None] | None = None,
    ) -> None:
        if max_queue_len is not None and (not isinstance(max_queue_len, int) or max_queue_len < 1):
            raise ValueError(f"max_queue_len must be a positive integer or None, got {max_queue_len!r}")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_queue_len = max_queue_len
        self.on_dead = on_dead
        self.metrics = EngineMetrics(model_name)
        # Appended on the loop, drained by the engine thread (deque appends and pops are
        # thread-safe).
        self._commands: deque = deque()
        self._wakeup = threading.Event()
        # Loop side only.
        self._streams: dict[str, _Stream] = {}
        self._unstarted: set[str] = set()  # accepted, not scheduled yet: the max_queue_len count
        self._loops: set[asyncio.AbstractEventLoop] = set()
        self._num_submitted = 0  # add commands queued (written by the loop only)
        # Step outputs on their way to each loop: the engine thread appends a batch and posts
        # one ``_drain`` unless one is pending (``_drain_pending``), the loop drains them all.
        self._outbox: dict[asyncio.AbstractEventLoop, deque] = {}
        self._drain_pending: dict[asyncio.AbstractEventLoop, bool] = {}
        # One waker per loop, made on the loop's thread when it first submits (``_register``).
        self._wakers: dict[asyncio.AbstractEventLoop, _Waker] = {}
        # Engine thread only (read elsewhere as whole values).
        self._request_loops: dict[str, asyncio.AbstractEventLoop] = {}
        # (engine thread) request id -> the stream its outputs are for: an id aborted and
        # added again has a new stream, which must not get the old request's last outputs
        self._request_streams: dict[str, _Stream] = {}
        self._num_applied = 0  # add commands applied
        self._stats: dict[str, Any] = engine.get_stats()
        self._stopped = False
        self._error: BaseException | None = None
        # Per-step snapshots for the dashboard, taken on the engine thread between steps
        # (nothing but a counter while nobody is subscribed).
        self.snapshots = SnapshotProducer(engine, wake=self._wakeup.set)
        self._thread = threading.Thread(target=self._run, name="kvflow-engine", daemon=True)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvflow-prepare")

    def start(self) -> None:
        """Start the engine thread; on the CPU also release the calling thread's OpenMP
        workers (``kvflow.cpu_threads.release_openmp_threads``): from now on the engine
        thread runs the forwards, and a second team of workers would cut OpenMP's spinning
        short for both."""
        self._thread.start()
        if self.engine.config.device.device.type == "cpu":
            release_openmp_threads()

    def begin_shutdown(self) -> None:
        """Stop: refuse new requests and fail the open ones with ``EngineShutdownError``
        (on their event loops); the engine thread exits after the step in progress (a step
        lasts about ``max_step_seconds``). Never waits; a second call does nothing."""
        if self._stopped:
            return
        self._stopped = True
        self._wakeup.set()
        exc = EngineShutdownError("the server is shutting down: the request was stopped before it finished")
        for loop in list(self._loops):
            self._post(loop, self._fail_all, exc)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """``begin_shutdown``, then wait up to ``timeout_s`` seconds for the engine thread
        to finish its step and exit."""
        self.begin_shutdown()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)
            if self._thread.is_alive():
                logger.warning("the engine thread is still in its step after %.0f s of shutdown", timeout_s)
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._thread.is_alive():  # it may still write to the pipes: keep their descriptors
            return
        self.engine.release_gc_hold()  # (its requests left in flight would keep the heap frozen)
        for loop, waker in list(self._wakers.items()):
            if loop.is_closed() or not loop.is_running():
                waker.close()
            else:
                self._post(loop, waker.close)

    @property
    def is_healthy(self) -> bool:
        return self._error is None and self._thread.is_alive()

    @property
    def error(self) -> BaseException | None:
        """The exception that stopped the engine thread, if any."""
        return self._error

    # ------------------------------------------------------------------ event-loop side
    async def run_off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the preparation thread (tokenization, templates, grammars).

        One thread, so the tokenizer is never used by two preparations at once.
        """
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def prepare(self, prompt_token_ids: list[int], params: SamplingParams, lora_request=None) -> PreparedRequest:
        """``LLMEngine.prepare_request`` off the loop.

        Raises:
            ValueError: for a prompt, parameters or a LoRA adapter the engine can never serve.
        """
        return await self.run_off_loop(self.engine.prepare_request, prompt_token_ids, params, lora_request)

    async def call_on_engine(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the engine thread, between two steps (e.g. ``remove_lora``: no
        forward runs meanwhile), in order with the adds and aborts queued before it.

        Raises:
            EngineDeadError: when the engine thread has failed (``EngineShutdownError``
                once it was shut down).
            Exception: whatever ``fn`` raises.
        """
        self._check_running()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._register(loop)
        self._commands.append(("call", fn, args, loop, future))
        self._wakeup.set()
        return await future

    def _register(self, loop: asyncio.AbstractEventLoop) -> None:
        """On ``loop``'s thread: remember the loop, with its waker (``_Waker``) for the outputs."""
        if loop not in self._wakers:
            self._outbox.setdefault(loop, deque())
            self._wakers[loop] = _Waker(loop, lambda: self._drain(loop))
            # Loops that closed since (a script's ``asyncio.run`` per call) are forgotten, their
            # wakers' pipes closed, on the engine thread (the one that writes to the pipes):
            # each kept two file descriptors and the loop for the engine's life.
            closed = [other for other in list(self._loops) if other.is_closed()]
            if closed:
                # Their open requests (an iterator never iterated: no ``finally`` aborted it)
                # have no reader left: aborted, or they ran on and held a place of the
                # ``max_queue_len`` count for ever (the start is posted to their loop).
                gone = set(closed)
                for request_id, stream in list(self._streams.items()):
                    if stream.loop in gone:
                        self.abort(request_id)
                self._commands.append(("forget_loops", closed))
                self._wakeup.set()
        self._loops.add(loop)

    def _check_running(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"engine failed: {self._error!r}")
        if self._stopped:
            raise EngineShutdownError("the server is shutting down: no new requests")

    @staticmethod
    def _settle(future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
        if future.done():
            return
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)

    def add_requests(self, requests: list[tuple[str, PreparedRequest, str | None]],
                     priority: int = 0, output_kind: RequestOutputKind | None = None,
                     ) -> list[AsyncIterator[RequestOutput]]:
        """Queue (request_id, prepared request, prompt text) triples, all or none, with one
        scheduling ``priority`` (see ``LLMEngine.add_request``); return their output
        iterators (``EmbeddingRequestOutput`` ones for ``PoolingParams``). Never waits.

        The engine thread makes DELTA outputs (only the new tokens and text of a step); an
        iterator yields them as such with ``output_kind=RequestOutputKind.DELTA`` (several
        steps merged into one when its consumer lags), with CUMULATIVE the request's whole
        output so far, grown from the deltas on the event loop, and with FINAL_ONLY that
        whole output once, when the request finishes. ``output_kind`` None: each request's
        ``params.output_kind`` (CUMULATIVE for an embedding request).

        Raises:
            QueueTooSmallError: when there are more of them than ``max_queue_len`` (they
                could never all be admitted); none of them is queued then.
            QueueFullError: when they would take the accepted-but-not-started requests past
                ``max_queue_len``; none of them is queued then.
            EngineDeadError: when the engine thread has failed (``EngineShutdownError``
                once it was shut down).
        """
        self._check_running()
        loop = asyncio.get_running_loop()
        self._register(loop)  # (first: the requests of closed loops are aborted, their places freed)
        if self.max_queue_len is not None and len(requests) > self.max_queue_len:
            raise QueueTooSmallError(
                f"this request has {len(requests)} prompts but the queue holds at most {self.max_queue_len} "
                "(--max-queue-len): it can never be admitted; send at most that many prompts per request"
            )
        if self.max_queue_len is not None and len(self._unstarted) + len(requests) > self.max_queue_len:
            raise QueueFullError(
                f"{len(self._unstarted)} requests are waiting and the queue holds {self.max_queue_len}"
                + (f"; this one needs {len(requests)} places" if len(requests) > 1 else "")
            )
        iterators = []
        for request_id, prepared, prompt in requests:
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use")
        kinds = [output_kind if output_kind is not None else default_output_kind(prepared.params)
                 for _, prepared, _ in requests]
        for kind in kinds:
            if not isinstance(kind, RequestOutputKind):
                raise ValueError(f"output_kind must be a RequestOutputKind, got {kind!r}")
        for (request_id, prepared, prompt), kind in zip(requests, kinds):
            stream = _Stream(asyncio.Queue(), len(prepared.prompt_token_ids), output_kind=kind, loop=loop)
            self._streams[request_id] = stream
            self._unstarted.add(request_id)
            self._commands.append(("add", request_id, prepared, prompt, loop, priority, stream))
            self._num_submitted += 1
            iterators.append(self._iterate(request_id, stream))
        self._wakeup.set()
        return iterators

    async def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Prepare (off the loop) and queue one request; its output iterator.

        Raises:
            ValueError, QueueFullError, EngineDeadError: see ``prepare`` and ``add_requests``.
        """
        prepared = await self.prepare(prompt_token_ids, params)
        (iterator,) = self.add_requests([(request_id, prepared, prompt)])
        return iterator

    async def _iterate(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        """The request's outputs; when the consumer lags, those queued merged into one.

        The engine sends DELTA outputs; a consumer that fell behind gets the queued ones as
        one (merged deltas, or the newest cumulative view), as vLLM's
        ``RequestOutputCollector`` does: one SSE event then carries several tokens instead of
        one event per token, and the event loop and the client do the per-event work once.
        The final output and an error are always delivered (the outputs before an error
        are coalesced up to it).
        """
        pending: RequestOutput | BaseException | None = None
        try:
            while True:
                item = pending if pending is not None else await stream.queue.get()
                pending = None
                while not isinstance(item, BaseException) and not item.finished and not stream.queue.empty():
                    newer = stream.queue.get_nowait()
                    if isinstance(newer, BaseException):
                        pending = newer
                        break
                    item = merge_delta(item, newer) if isinstance(item, RequestOutput) else newer
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, RequestOutput) and stream.output_kind is not RequestOutputKind.DELTA:
                    item = self._cumulative(stream, item)
                    if stream.output_kind is RequestOutputKind.FINAL_ONLY and not item.finished:
                        continue
                yield item
                if item.finished:
                    return
        finally:
            if not stream.finished:
                self.abort(request_id)

    @staticmethod
    def _cumulative(stream: _Stream, delta: RequestOutput) -> RequestOutput:
        """The request's whole output so far: ``delta`` appended to the stream's own lists
        (on the loop, never on the engine thread); the lists handed out are copies."""
        outputs = []
        for c in delta.outputs:
            texts = stream.texts.setdefault(c.index, [])
            token_ids = stream.token_ids.setdefault(c.index, [])
            texts.append(c.text)
            token_ids.extend(c.token_ids)
            logprobs = None
            if c.logprobs is not None:
                logprobs = stream.logprobs.setdefault(c.index, [])
                logprobs.extend(c.logprobs)
            if len(texts) > 1:
                texts[:] = ["".join(texts)]
            outputs.append(CompletionOutput(c.index, texts[0], list(token_ids), c.finish_reason, c.stop_reason,
                                            list(logprobs) if logprobs is not None else None, c.cumulative_logprob,
                                            c.lora_request))
        if delta.prompt_logprobs is not None:  # (a DELTA output gives them once: kept from then on)
            stream.prompt_logprobs = delta.prompt_logprobs
        return RequestOutput(delta.request_id, delta.prompt, delta.prompt_token_ids, outputs, delta.finished,
                             delta.metrics, stream.prompt_logprobs, delta.error, delta.num_cached_tokens,
                             delta.lora_request)

    def abort(self, request_id: str) -> None:
        """Abort a request (its blocks are freed before the next step). Never waits."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            if not stream.finished:
                self.metrics.request_finished("abort")
            stream.finished = True
        self._unstarted.discard(request_id)
        self._commands.append(("abort", request_id))
        self._wakeup.set()

    def get_stats(self) -> dict[str, Any]:
        """The engine's stats as of the last scheduling (``LLMEngine.get_stats``), with
        ``num_waiting`` counting the requests queued for admission too. Never waits."""
        stats = dict(self._stats)
        stats["num_waiting"] += self._num_submitted - self._num_applied
        return stats

    def refresh_gauges(self) -> None:
        """Set the waiting gauge from ``get_stats`` (requests that arrived during the step
        in progress are waiting too)."""
        self.metrics.num_requests_waiting.set(self.get_stats()["num_waiting"])

    def _started(self, request_ids: list[str]) -> None:
        self._unstarted.difference_update(request_ids)

    def _dispatch(self, outputs: list[RequestOutput], now: float) -> None:
        m = self.metrics
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # aborted meanwhile
                continue
            if out.finished:
                del self._streams[out.request_id]
                self._unstarted.discard(out.request_id)
                stream.finished = True
            if out.error is not None:
                m.request_failure.inc()
                stream.queue.put_nowait(RequestFailedError(out.error))
                continue
            if isinstance(out, EmbeddingRequestOutput):  # one output, no generated tokens
                m.prompt_tokens.inc(stream.num_prompt_tokens)
                if out.metrics.get("first_scheduled_time") is not None:
                    m.request_queue_time.observe(out.metrics["first_scheduled_time"] - out.metrics["arrival_time"])
                m.e2e_request_latency.observe(now - out.metrics["arrival_time"])
                m.request_finished("stop")
                stream.queue.put_nowait(out)
                continue
            new_tokens = sum(len(c.token_ids) for c in out.outputs)  # (DELTA outputs)
            if stream.last_token_time is None:
                m.prompt_tokens.inc(stream.num_prompt_tokens)
                m.time_to_first_token.observe(now - out.metrics["arrival_time"])
                if out.metrics.get("first_scheduled_time") is not None:
                    m.request_queue_time.observe(out.metrics["first_scheduled_time"] - out.metrics["arrival_time"])
            else:
                m.inter_token_latency.observe(now - stream.last_token_time)
            stream.last_token_time = now
            m.generation_tokens.inc(new_tokens)
            if out.finished:
                m.e2e_request_latency.observe(now - out.metrics["arrival_time"])
                m.request_finished(out.outputs[0].finish_reason if out.outputs else None)
            stream.queue.put_nowait(out)

    def _fail_one(self, request_id: str, exc: BaseException, stream: _Stream | None = None) -> None:
        """Fail ``request_id``'s open stream (only ``stream`` when given: not a newer one
        under the same id)."""
        if stream is not None and self._streams.get(request_id) is not stream:
            return
        stream = self._streams.pop(request_id, None)
        self._unstarted.discard(request_id)
        if stream is not None:
            stream.finished = True
            stream.queue.put_nowait(exc)

    def _fail_all(self, exc: BaseException) -> None:
        streams, self._streams = self._streams, {}
        self._unstarted.clear()
        for stream in streams.values():
            stream.finished = True
            stream.queue.put_nowait(exc)

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            while not self._stopped:
                self._apply_commands()
                if not self.engine.has_unfinished_requests():
                    # Aborts can empty the engine without a step: refresh the gauges now, or
                    # they keep the last step's values while idle.
                    self._publish_stats()
                    due = self.snapshots.on_idle(self._stats)
                    self._wakeup.wait(timeout=0.5 if due is None else min(0.5, due))
                    self._wakeup.clear()
                    continue
                outputs = self.engine.step(on_scheduled=self._on_scheduled)
                self._publish_stats()
                self._deliver(outputs)
                self.snapshots.after_step(self._stats)
        except BaseException as exc:  # noqa: BLE001 - reported to every waiting client
            logger.critical("the engine stopped: %s: %s", type(exc).__name__, exc, exc_info=exc)
            self._error = exc
            dead = EngineDeadError(f"engine failed: {exc!r}")
            for loop in list(self._loops):
                self._post(loop, self._fail_all, dead)
            if self.on_dead is not None:
                self.on_dead(exc)

    @staticmethod
    def _post(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening
            pass

    def _publish_stats(self) -> None:
        stats = self.engine.get_stats()
        self._stats = stats
        self.metrics.update_engine_stats(self.get_stats())

    def _on_scheduled(self, started: list[str]) -> None:
        # The gauges change at scheduling only when requests start or are preempted; otherwise
        # the last step's publication stands (``get_stats`` walks every running request's
        # block table: ~0.3 ms at 16 sequences of ~300 tokens).
        batch = self.engine.last_scheduler_output
        if started or (batch is not None and batch.preempted_req_ids):
            self._publish_stats()
        self.snapshots.on_scheduled(self.engine.last_scheduler_output)
        by_loop: dict[asyncio.AbstractEventLoop, list[str]] = {}
        for request_id in started:
            loop = self._request_loops.get(request_id)
            if loop is not None:
                by_loop.setdefault(loop, []).append(request_id)
        for loop, ids in by_loop.items():
            self._post(loop, self._started, ids)

    def _apply_commands(self) -> None:
        while self._commands:
            command = self._commands.popleft()
            if command[0] == "add":
                _, request_id, prepared, prompt, loop, priority, stream = command
                self._num_applied += 1
                try:
                    self.engine.add_request(request_id, prepared.prompt_token_ids, prepared.params, prompt=prompt,
                                            priority=priority, prepared=prepared, output_kind=RequestOutputKind.DELTA)
                except ValueError as exc:
                    self._post(loop, self._fail_one, request_id, exc, stream)
                    continue
                self._request_loops[request_id] = loop
                self._request_streams[request_id] = stream
            elif command[0] == "call":
                _, fn, args, loop, future = command
                try:
                    result, exc = fn(*args), None
                except Exception as error:  # noqa: BLE001 - the caller's to handle
                    result, exc = None, error
                self._post(loop, self._settle, future, result, exc)
            elif command[0] == "forget_loops":
                self._forget_loops(command[1])
            else:
                self.engine.abort_request(command[1])
                self._request_loops.pop(command[1], None)
                self._request_streams.pop(command[1], None)

    def _forget_loops(self, loops: list[asyncio.AbstractEventLoop]) -> None:
        """On the engine thread: drop closed event loops, their outboxes and wakers (pipes
        closed), and the requests still mapped to them (nobody reads their outputs)."""
        for loop in loops:
            self._loops.discard(loop)
            self._outbox.pop(loop, None)
            self._drain_pending.pop(loop, None)
            waker = self._wakers.pop(loop, None)
            if waker is not None:
                waker.close()
        gone = set(loops)
        for request_id in [r for r, loop in self._request_loops.items() if loop in gone]:
            del self._request_loops[request_id]
            self._request_streams.pop(request_id, None)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        by_loop: dict[asyncio.AbstractEventLoop, tuple[list[RequestOutput], list[_Stream | None]]] = {}
        for out in outputs:
            loop = self._request_loops.get(out.request_id)
            if loop is None:
                continue
            stream = self._request_streams.get(out.request_id)
            if out.finished:
                del self._request_loops[out.request_id]
                self._request_streams.pop(out.request_id, None)
            outs, streams = by_loop.setdefault(loop, ([], []))
            outs.append(out)
            streams.append(stream)
        for loop, (outs, streams) in by_loop.items():
            outbox = self._outbox.setdefault(loop, deque())
            outbox.append((outs, now, streams))
            # A drain already posted and not started yet will take this batch too: no second
            # wake-up of the loop (a self-pipe write and the GIL hand-off to the loop thread).
            if not self._drain_pending.get(loop, False):
                self._drain_pending[loop] = True
                self._wakers[loop].wake()

    def _drain(self, loop: asyncio.AbstractEventLoop) -> None:
        """On ``loop``: dispatch every step's outputs queued for it, oldest first (each batch
        with its own step time, so the latency metrics are those of one call per step)."""
        # Cleared before draining: a batch appended from here on is either seen by the loop
        # below or posts a new drain (deque appends and pops are atomic).
        self._drain_pending[loop] = False
        outbox = self._outbox.get(loop)
        while outbox:
            outs, now, streams = outbox.popleft()
            current = self._streams
            if any(current.get(out.request_id) is not stream for out, stream in zip(outs, streams) if stream is not None):
                # outputs of a request aborted since, whose id was added again: not the new one's
                outs = [out for out, stream in zip(outs, streams)
                        if stream is None or current.get(out.request_id) is stream]
            self._dispatch(outs, now)
