"""The engine behind the server: one background thread drives ``LLMEngine.step()``.

The model forward runs in that thread, never on the asyncio event loop. Requests and aborts
from the event loop are queued as commands that the thread applies between steps; every
request has its own ``asyncio.Queue`` into which the thread posts its outputs with
``loop.call_soon_threadsafe``. Validation runs on the event loop before anything is queued,
so a bad request is refused (HTTP 400) before a byte of its response is sent.
"""

from __future__ import annotations

import asyncio
import threading
import time
import traceback
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from kvflow.engine.llm_engine import LLMEngine
from kvflow.metrics import EngineMetrics
from kvflow.outputs import RequestOutput
from kvflow.sampling_params import SamplingParams


class QueueFullError(RuntimeError):
    """Raised when ``max_queue_len`` requests are already waiting."""


class EngineDeadError(RuntimeError):
    """Raised for requests once the engine thread has failed."""


@dataclass
class _Stream:
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    num_prompt_tokens: int
    last_token_time: float | None = None
    num_generated: dict[int, int] = field(default_factory=dict)
    finished: bool = False


class AsyncLLMEngine:
    """Thread-driven wrapper of ``LLMEngine`` for asyncio servers.

    Args:
        engine: the engine (its methods are only called from the engine thread once
            ``start`` has run, except the read-only ``validate_prompt``).
        model_name: label of the Prometheus metrics.
        max_queue_len: refuse new requests with ``QueueFullError`` while this many are
            waiting (None: no limit).
    """

    def __init__(self, engine: LLMEngine, model_name: str, max_queue_len: int | None = None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_queue_len = max_queue_len
        self.metrics = EngineMetrics(model_name)
        self._commands: deque = deque()
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._num_waiting_snapshot = 0
        self._stopped = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvflow-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._stopped = True
        self._wakeup.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    @property
    def is_healthy(self) -> bool:
        return self._error is None and self._thread.is_alive()

    # ------------------------------------------------------------------ event-loop side
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Validate and queue a request; return the iterator of its outputs.

        Raises:
            ValueError: for a prompt or parameters the engine can never serve.
            QueueFullError: when ``max_queue_len`` requests are already waiting.
            EngineDeadError: when the engine thread has failed.
        """
        if self._error is not None:
            raise EngineDeadError(f"engine failed: {self._error!r}")
        self.engine.validate_prompt(prompt_token_ids, params)
        self.engine.check_request_features(params)
        with self._lock:
            pending = sum(1 for c in self._commands if c[0] == "add")
            if self.max_queue_len is not None and self._num_waiting_snapshot + pending >= self.max_queue_len:
                raise QueueFullError(f"{self.max_queue_len} requests are already waiting")
            loop = asyncio.get_running_loop()
            stream = _Stream(asyncio.Queue(), loop, len(prompt_token_ids))
            self._streams[request_id] = stream
            self._commands.append(("add", request_id, prompt_token_ids, params, prompt))
        self._wakeup.set()
        return self._iterate(request_id, stream)

    async def _iterate(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if not stream.finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (its blocks are freed before the next step)."""
        with self._lock:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.finished = True
            self._commands.append(("abort", request_id))
        self._wakeup.set()

    def get_stats(self) -> dict[str, float]:
        with self._lock:
            return self.engine.get_stats()

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            while not self._stopped:
                self._apply_commands()
                if not self.engine.has_unfinished_requests():
                    # Aborts can empty the engine without a step: refresh the gauges and the
                    # waiting count now, or they keep the last step's values while idle.
                    self._update_stats()
                    self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()
                    continue
                with self._lock:
                    outputs = self.engine.step()
                self._update_stats()
                self._dispatch(outputs)
        except BaseException as exc:  # noqa: BLE001 - report to every waiting client
            traceback.print_exc()
            self._error = exc
            with self._lock:
                streams, self._streams = list(self._streams.values()), {}
            for stream in streams:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, EngineDeadError(f"engine failed: {exc!r}"))

    def _update_stats(self) -> None:
        with self._lock:
            stats = self.engine.get_stats()
            self._num_waiting_snapshot = stats["num_waiting"]
        self.metrics.update_engine_stats(stats)

    def _apply_commands(self) -> None:
        with self._lock:
            commands, self._commands = list(self._commands), deque()
            for command in commands:
                if command[0] == "add":
                    _, request_id, prompt_token_ids, params, prompt = command
                    stream = self._streams.get(request_id)
                    if stream is None:  # aborted before it was added
                        continue
                    try:
                        self.engine.add_request(request_id, prompt_token_ids, params, prompt=prompt)
                    except ValueError as exc:
                        self._streams.pop(request_id, None)
                        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, exc)
                else:
                    self.engine.abort_request(command[1])

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        m = self.metrics
        with self._lock:
            targets = [(out, self._streams.get(out.request_id)) for out in outputs]
            for out in outputs:
                if out.finished:
                    self._streams.pop(out.request_id, None)
        for out, stream in targets:
            if stream is None:
                continue
            new_tokens = 0
            for c in out.outputs:
                new_tokens += len(c.token_ids) - stream.num_generated.get(c.index, 0)
                stream.num_generated[c.index] = len(c.token_ids)
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
                stream.finished = True
                m.e2e_request_latency.observe(now - out.metrics["arrival_time"])
                m.request_success.inc()
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)
