"""Per-step snapshots of the engine's state, for the live dashboard (``/dashboard``).

The engine thread takes a snapshot between two steps (after one step's outputs, before the
next scheduling), so that what it shows is one consistent state: the block pool (the state
and reference count of every block), the running and waiting queues with each request's
progress and block table, and the batch of the step that just ran (which requests, how many
tokens each and of which kind, the preemptions, the token budget used). It costs the engine
nothing measurable:

- nothing but a counter increment when nobody is subscribed;
- at most ``max_rate_hz`` snapshots per second (a step summary of a few numbers for every
  other step, so that the dashboard still sees each step's budget and preemptions);
- the engine thread only copies plain values (ints, short lists, one character per block);
  the JSON encoding and the fan-out to the subscribers happen on their event loops.

Thread model: ``subscribe`` / ``unsubscribe`` / ``describe_block`` run on the event loop;
``on_scheduled``, ``after_step`` and ``on_idle`` on the engine thread. The two sides share
only whole values (the latest snapshot, the subscriber dict), which are replaced, never
mutated, once published.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvflow.core.block_pool import BlockPool
    from kvflow.core.scheduler import SchedulerOutput
    from kvflow.engine.llm_engine import LLMEngine
    from kvflow.request import Request

# One character per block in ``Snapshot.data["blocks"]["states"]``.
BLOCK_FREE = "f"  # no reference, no indexed content
BLOCK_CACHED = "c"  # no reference, in the prefix index (reusable until evicted)
BLOCK_USED = "u"  # one request's block table holds it
BLOCK_SHARED = "s"  # several block tables hold it (ref_cnt > 1)
# (a host block holding a swapped-out request's K/V is BLOCK_USED in ``cpu_blocks``)

DEFAULT_MAX_RATE_HZ = 10.0
IDLE_RATE_HZ = 1.0  # snapshots while no request is unfinished (the engine does not step)
STEP_HISTORY = 512  # step summaries kept for a snapshot (steps between two snapshots)


def block_states(pool: BlockPool) -> tuple[str, dict[int, int]]:
    """The state of every block of ``pool``: one of ``BLOCK_FREE``, ``BLOCK_CACHED``,
    ``BLOCK_USED``, ``BLOCK_SHARED`` per block id, and block id -> ref_cnt of the shared ones.
    O(num_blocks), about 0.2 us a block."""
    chars = []
    shared = {}
    append = chars.append
    for block in pool.blocks:
        ref_cnt = block.ref_cnt
        if ref_cnt == 0:
            append(BLOCK_FREE if block.block_hash is None else BLOCK_CACHED)
        elif ref_cnt == 1:
            append(BLOCK_USED)
        else:
            append(BLOCK_SHARED)
            shared[block.block_id] = ref_cnt
    return "".join(chars), shared


def batch_entry(request: Request, num_new: int, num_spec: int) -> dict[str, Any]:
    """One request's part of a batch, before its forward: ``kind`` is "prefill" (prompt
    tokens, or the recompute of a preempted request; ``last_chunk`` False for a chunk that
    samples nothing), "decode" (one token) or "verify" (a decode checking ``num_spec``
    draft tokens); ``num_computed_tokens`` counts the tokens already cached before it
    (earlier chunks and prefix-cache hits)."""
    remaining = request.num_tokens - request.num_computed_tokens
    if num_spec > 0:
        kind = "verify"
    elif request.num_computed_tokens < request.num_prompt_tokens or remaining > 1:
        kind = "prefill"
    else:
        kind = "decode"
    return {
        "id": request.request_id,
        "kind": kind,
        "num_tokens": num_new,
        "num_spec": num_spec,
        "num_computed_tokens": request.num_computed_tokens,
        "last_chunk": num_new >= remaining,
    }


def request_info(request: Request) -> dict[str, Any]:
    """A request's progress and block tables (copies), for the queues."""
    return {
        "id": request.request_id,
        "status": request.status.value,
        "num_prompt_tokens": request.num_prompt_tokens,
        "num_tokens": request.num_tokens,
        "num_computed_tokens": request.num_computed_tokens,
        "max_tokens": request.sampling_params.max_tokens,
        "num_preemptions": request.num_preemptions,
        "priority": request.priority,
        "block_ids": [b for table in request.block_ids for b in table],  # the KV cache groups' tables, in turn
        "cpu_block_ids": list(request.cpu_block_ids),
    }


class Snapshot:
    """One published snapshot: ``data`` (JSON-ready, never mutated) and its JSON text,
    encoded once on first use (on a subscriber's loop) for all subscribers."""

    __slots__ = ("data", "_json", "_tokens")

    def __init__(self, data: dict[str, Any], tokens: dict[str, tuple[list[int], int]]) -> None:
        self.data = data
        self._json: str | None = None
        # request id -> (its live all_token_ids list, num_computed_tokens at the snapshot):
        # for describe_block; not part of the JSON.
        self._tokens = tokens

    def json(self) -> str:
        if self._json is None:
            self._json = json.dumps(self.data, separators=(",", ":"))
        return self._json


@dataclass
class _Subscriber:
    loop: asyncio.AbstractEventLoop
    callback: Callable[[Snapshot], None]


class SnapshotProducer:
    """Takes snapshots of ``engine`` on its engine thread and hands them to subscribers.

    Args:
        engine: the engine whose state is shown (read on the engine thread only, but for
            one attribute read per call of ``describe_block``).
        max_rate_hz: at most this many snapshots a second while the engine steps (a step
            that ends sooner after the previous snapshot is summarised only).
        wake: called (from the loop) when a new subscriber wants a first snapshot at once,
            e.g. the engine thread's wake-up event's ``set``.
        clock: monotonic clock in seconds (tests).

    Raises:
        ValueError: for a ``max_rate_hz`` that is not a positive number.
    """

    def __init__(
        self,
        engine: LLMEngine,
        max_rate_hz: float = DEFAULT_MAX_RATE_HZ,
        wake: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(max_rate_hz, bool) or not isinstance(max_rate_hz, (int, float)) or not max_rate_hz > 0:
            raise ValueError(f"max_rate_hz must be a positive number, got {max_rate_hz!r}")
        self.engine = engine
        self.min_interval_s = 1.0 / max_rate_hz
        self.wake = wake
        self.clock = clock
        self.num_steps = 0  # steps seen (counted with or without subscribers)
        self.num_snapshots = 0
        self.capture_seconds = 0.0  # engine-thread time spent on snapshots and summaries
        self.latest: Snapshot | None = None
        self._subscribers: dict[int, _Subscriber] = {}  # replaced whole on (un)subscribe
        self._next_id = 0
        self._lock = threading.Lock()  # (un)subscribe from several loops
        self._force = False
        self._dirty = False
        self._last_time = -float("inf")
        self._last_signature: tuple[int, int] | None = None
        self._pending_batch: dict[str, Any] | None = None
        self._step_start: float | None = None
        self._steps: deque[dict[str, Any]] = deque(maxlen=STEP_HISTORY)
        # block hash -> (token ids list of a request that held that content, logical index):
        # the text of a cached block whose last owner has finished (see describe_block).
        self._content: OrderedDict[bytes, tuple[list[int], int]] = OrderedDict()
        self._content_limit = 2 * engine.kv_cache_manager.num_total_blocks
        self._hashes_seen: dict[str, int] = {}

    # ------------------------------------------------------------------ event-loop side
    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    def subscribe(self, callback: Callable[[Snapshot], None]) -> int:
        """Call ``callback(snapshot)`` on the running loop for every snapshot from now on
        (the first one as soon as the engine thread is between steps and the rate allows).
        Returns a token for ``unsubscribe``."""
        loop = asyncio.get_running_loop()
        with self._lock:
            token = self._next_id
            self._next_id += 1
            self._subscribers = {**self._subscribers, token: _Subscriber(loop, callback)}
            self._force = True
        if self.wake is not None:
            self.wake()
        return token

    def unsubscribe(self, token: int) -> None:
        with self._lock:
            self._subscribers = {k: v for k, v in self._subscribers.items() if k != token}

    async def fresh(self, timeout_s: float = 5.0) -> Snapshot | None:
        """A current snapshot for a one-off reader (the block route): ``latest`` when it is
        at most ``1 / IDLE_RATE_HZ`` seconds old (a dashboard's stream keeps it so), else the
        next one the engine thread publishes, subscribed for until then (within the rate, so
        one-off readers add no snapshots past ``max_rate_hz``). Event loop.

        Args:
            timeout_s: seconds to wait for it (a step can be longer: then ``latest`` as it is).

        Returns:
            The snapshot, or None when none was ever taken and none came in time.
        """
        snap = self.latest
        if snap is not None and self.clock() - self._last_time <= 1.0 / IDLE_RATE_HZ:
            return snap
        first: asyncio.Future[Snapshot] = asyncio.get_running_loop().create_future()

        def take(snapshot: Snapshot) -> None:
            if not first.done():
                first.set_result(snapshot)

        token = self.subscribe(take)
        try:
            return await asyncio.wait_for(first, timeout_s)
        except asyncio.TimeoutError:
            return self.latest
        finally:
            self.unsubscribe(token)

    def describe_block(self, block_id: int) -> dict[str, Any]:
        """Block ``block_id`` as of the latest snapshot: its state and ref_cnt, the requests
        whose block tables hold it (id and logical block index), and the token ids it holds:
        an owner's computed tokens of that block, or for a cached block (no owner), those of
        the last request seen holding the same content (its current content hash, read from
        the pool now, selects them; none when that content was never seen in a snapshot).

        Raises:
            ValueError: no snapshot yet, or ``block_id`` not a block of the pool.
            """
        snap = self.latest
        if snap is None:
            raise ValueError("no snapshot has been taken yet")
        blocks = snap.data["blocks"]
        if not 0 <= block_id < blocks["num_blocks"]:
            raise ValueError(f"block_id must be in [0, {blocks['num_blocks']}), got {block_id}")
        state = blocks["states"][block_id]
        block_size = blocks["block_size"]
        owners = []
        token_ids: list[int] = []
        for info in (*snap.data["running"], *snap.data["waiting"]):
            if block_id in info["block_ids"]:
                index = info["block_ids"].index(block_id)
                owners.append({"id": info["id"], "index": index})
                if not token_ids:
                    tokens, num_computed = snap._tokens[info["id"]]
                    token_ids = list(tokens[index * block_size : min((index + 1) * block_size, num_computed)])
        source = "owner" if owners else None
        if not owners and state == BLOCK_CACHED:
            block_hash = self.engine.kv_cache_manager.block_pool.blocks[block_id].block_hash
            seen = self._content.get(block_hash) if block_hash is not None else None
            if seen is not None:
                tokens, index = seen
                token_ids = list(tokens[index * block_size : (index + 1) * block_size])
                source = "cache"
        ref_cnt = 0 if state in (BLOCK_FREE, BLOCK_CACHED) else blocks["shared"].get(block_id, 1)
        return {"block_id": block_id, "state": state, "ref_cnt": ref_cnt, "owners": owners, "token_ids": token_ids,
                "source": source, "block_size": block_size, "seq": snap.data["seq"]}

    # ------------------------------------------------------------------ engine thread
    def on_scheduled(self, sched_out: SchedulerOutput) -> None:
        """After scheduling, before the forward: summarise the batch and describe it (the
        description goes into the snapshot after this step, if one is due then). Engine
        thread."""
        self.num_steps += 1
        if not self._subscribers:
            return
        start = time.perf_counter()
        self._step_start = self.clock()
        entries = []
        tokens = {"prefill": 0, "decode": 0, "verify": 0}
        spec = sched_out.scheduled_spec_tokens
        requests = self.engine.scheduler.requests
        for rid, num_tokens in sched_out.num_scheduled_tokens.items():
            entry = batch_entry(requests[rid], num_tokens, len(spec.get(rid, ())))
            tokens[entry["kind"]] += entry["num_tokens"]
            entries.append(entry)
        summary = {
            "step": self.num_steps,
            "num_reqs": len(entries),
            "num_scheduled_tokens": sched_out.total_num_scheduled_tokens,
            **{f"num_{kind}_tokens": n for kind, n in tokens.items()},
            "num_preempted": len(sched_out.preempted_req_ids),
            "duration_s": None,
        }
        self._steps.append(summary)
        # (Whether a snapshot is due is decided after the step, from the time since the last
        # one: a step longer than the interval is shown every time.)
        self._pending_batch = {
            "step": self.num_steps,
            "requests": entries,
            "forked": [{"id": child, "parent": parent} for child, parent in sched_out.forked],
            "preempted": list(sched_out.preempted_req_ids),
            "num_scheduled_tokens": sched_out.total_num_scheduled_tokens,
            "max_num_batched_tokens": self.engine.scheduler_config.max_num_batched_tokens,
            "num_blocks_to_copy": len(sched_out.blocks_to_copy),
            "num_blocks_swapped_out": len(sched_out.blocks_to_swap_out),
            "num_blocks_swapped_in": len(sched_out.blocks_to_swap_in),
            "duration_s": None,
        }
        self.capture_seconds += time.perf_counter() - start

    def after_step(self, stats: dict[str, Any] | None = None) -> None:
        """After a step's outputs: publish a snapshot when one is due. Engine thread.

        Args:
            stats: the engine's ``get_stats()`` of this step, when the caller has it.
        """
        if not self._subscribers or self._step_start is None:
            self._pending_batch = None
            return
        start = time.perf_counter()
        now = self.clock()
        duration = now - self._step_start
        self._step_start = None
        if self._steps:
            self._steps[-1]["duration_s"] = duration
        batch, self._pending_batch = self._pending_batch, None
        # (A new subscriber's first snapshot waits for the rate too: else a client that
        # reconnects after every event forces one per reconnect, past max_rate_hz.)
        if batch is not None and now - self._last_time >= self.min_interval_s:
            batch["duration_s"] = duration
            self._publish(now, batch, stats)
        else:
            self._dirty = True  # a step the subscribers have not seen the end of
        self.capture_seconds += time.perf_counter() - start

    def on_idle(self, stats: dict[str, Any] | None = None) -> float | None:
        """While the engine has nothing to run: a snapshot as soon as the rate allows when
        the state changed since the last one (steps ran, an abort freed blocks) or a new
        subscriber waits for its first, else one every ``1 / IDLE_RATE_HZ`` seconds. Engine
        thread.

        Returns:
            Seconds until a snapshot the rate held back is due (the caller's idle wait
            should end by then), or None when none is pending.
        """
        if not self._subscribers:
            return None
        now = self.clock()
        elapsed = now - self._last_time
        pending = self._force or self._dirty or self._signature() != self._last_signature
        if elapsed >= self.min_interval_s and (pending or elapsed >= 1.0 / IDLE_RATE_HZ):
            start = time.perf_counter()
            self._publish(now, None, stats)
            self.capture_seconds += time.perf_counter() - start
            return None
        return self.min_interval_s - elapsed if pending else None

    def _signature(self) -> tuple[int, int]:
        """What an idle engine's snapshot would show differently (O(1))."""
        return self.engine.kv_cache_manager.num_free_blocks, len(self.engine.scheduler.requests)

    def _publish(self, now: float, batch: dict[str, Any] | None, stats: dict[str, Any] | None) -> None:
        self._force = self._dirty = False
        self._last_time = now
        self._last_signature = self._signature()
        snap = self.capture(batch, stats)
        self.latest = snap
        self.num_snapshots += 1
        by_loop: dict[asyncio.AbstractEventLoop, list[Callable[[Snapshot], None]]] = {}
        for sub in self._subscribers.values():
            by_loop.setdefault(sub.loop, []).append(sub.callback)
        for loop, callbacks in by_loop.items():
            try:
                loop.call_soon_threadsafe(_fan_out, callbacks, snap)
            except RuntimeError:  # that loop is closed: its subscribers are gone
                pass

    def capture(self, batch: dict[str, Any] | None = None, stats: dict[str, Any] | None = None) -> Snapshot:
        """A snapshot of the engine's state now (engine thread, between steps).

        ``data`` keys: seq, time (Unix seconds), step (steps so far), config (num_blocks,
        block_size, max_num_batched_tokens, max_num_seqs, max_model_len, num_cpu_blocks,
        enable_prefix_caching, num_speculative_tokens), blocks (num_blocks, block_size,
        states: one ``BLOCK_*`` character per block, shared: {block id: ref_cnt} for the
        ref_cnt > 1 ones), cpu_blocks (the same for the host swap pool, or None), running
        and waiting (``request_info`` each, in queue order; waiting includes swapped and
        preempted requests), batch (the last step's, see ``on_scheduled``; None when idle),
        steps (``on_scheduled`` summaries since the previous snapshot), stats
        (``LLMEngine.get_stats``).
        """
        engine = self.engine
        kv = engine.kv_cache_manager
        scheduler = engine.scheduler
        states, shared = block_states(kv.block_pool)
        cpu = None
        if kv.cpu_pool is not None:
            cpu_states, cpu_shared = block_states(kv.cpu_pool)
            cpu = {"num_blocks": kv.cpu_pool.num_blocks, "states": cpu_states, "shared": cpu_shared}
        tokens: dict[str, tuple[list[int], int]] = {}
        queues = {}
        for name, requests in (("running", scheduler.running), ("waiting", scheduler.waiting)):
            infos = []
            for r in requests:
                infos.append(request_info(r))
                tokens[r.request_id] = (r.all_token_ids, r.num_computed_tokens)
                self._remember_content(r)
            queues[name] = infos
        self._forget_finished(tokens)
        steps = list(self._steps)
        self._steps.clear()
        cfg = engine.scheduler_config
        data = {
            "seq": self.num_snapshots,
            "time": time.time(),
            "step": self.num_steps,
            "config": {
                "num_blocks": kv.num_total_blocks,
                "block_size": kv.block_size,
                "max_num_batched_tokens": cfg.max_num_batched_tokens,
                "max_num_seqs": cfg.max_num_seqs,
                "max_model_len": cfg.max_model_len,
                "num_cpu_blocks": kv.cpu_pool.num_blocks if kv.cpu_pool is not None else 0,
                "enable_prefix_caching": kv.enable_prefix_caching,
                "num_speculative_tokens": engine.proposer.k if engine.proposer is not None else 0,
            },
            "blocks": {"num_blocks": kv.num_total_blocks, "block_size": kv.block_size, "states": states,
                       "shared": shared},
            "cpu_blocks": cpu,
            **queues,
            "batch": batch,
            "steps": steps,
            "stats": _plain(stats if stats is not None else engine.get_stats()),
        }
        return Snapshot(data, tokens)

    def _remember_content(self, request: Request) -> None:
        """Index the request's newly hashed blocks by content hash (amortised O(1))."""
        hashes = request.block_hashes
        start = self._hashes_seen.get(request.request_id, 0)
        if start >= len(hashes):
            return
        content = self._content
        for index in range(start, len(hashes)):
            content[hashes[index]] = (request.all_token_ids, index)
            content.move_to_end(hashes[index])
        while len(content) > self._content_limit:
            content.popitem(last=False)
        self._hashes_seen[request.request_id] = len(hashes)

    def _forget_finished(self, live: dict[str, Any]) -> None:
        if len(self._hashes_seen) > len(live):
            self._hashes_seen = {k: v for k, v in self._hashes_seen.items() if k in live}


def _fan_out(callbacks: list[Callable[[Snapshot], None]], snap: Snapshot) -> None:
    for callback in callbacks:
        callback(snap)


def _plain(stats: dict[str, Any]) -> dict[str, Any]:
    """Stats with JSON-safe values (floats stay floats, lists of floats stay lists)."""
    return {k: v for k, v in stats.items() if isinstance(v, (int, float, list))}
