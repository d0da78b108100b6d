"""Iteration-level (continuous batching) scheduler.

Orca (Yu et al. 2022, "Orca: A Distributed Serving System for Transformer-Based Generative
Models", section 3.1) schedules at the granularity of one model iteration: finished requests
leave the batch at once and waiting requests join at the next step. Following vLLM v1, there
is no separate prefill and decode phase. Each request has ``num_tokens`` (prompt + output)
and ``num_computed_tokens`` (tokens whose K/V are cached); every step gives each running
request new tokens to compute so that the second catches up with the first, within a token
budget (``max_num_batched_tokens``) and a sequence cap (``max_num_seqs``). A long prompt is
therefore split across steps (chunked prefill, Agrawal et al. 2023, "SARATHI", section 3)
and mixed with other requests' decodes in one batch.

When the KV cache has no free block, a running request is preempted (the most recently
admitted under ``fcfs``, the lowest-priority one under ``priority``) and goes back to the
head of the waiting queue, its tokens so far kept so that its final output is unchanged:
by recompute (its blocks are freed and ``num_computed_tokens`` reset) or, with
``preemption_mode="swap"``, by copying its blocks to host memory and back (Kwon et al. 2023,
PagedAttention, section 4.5, which compares the two).

The batch goes to the model runner as data (``kvflow/core/sched_output.py``): each
request's static data once, then per-step diffs; ``RunnerStateTracker`` remembers what the
runner holds.

Within a step, a prompt chunk of a running request leaves a token of the budget for every
decode after it in the running list and, while a waiting request could be admitted, half of
the rest for the waiting ones (vLLM caps a long prompt's chunk with
``long_prefill_token_threshold`` for the same reason): a long prompt stalls neither the
decodes nor the first tokens of the prompts that arrive during its prefill.

A step is bounded in time too (``max_step_seconds``): the scheduler measures each step that
holds prompt tokens (from ``schedule`` to ``update``: the model's forward and sampling; a
decode-only step may run another path at another cost, such as a GGUF model's fused decode
step), fits its duration as a fixed part plus a part per token
(``kvflow/core/step_time.py``), and cuts the next step's budget to the tokens predicted to
fit in that time, so that on a slow or loaded CPU a long
prompt prefills in smaller chunks and an abort or a new request waits for at most about one
step, while the chunks stay as large as the bound allows. Where the fixed part is large
against the bound, the bound stretches so that the fixed part is at most a quarter of a step
(``MAX_FIXED_SHARE``): chunks of a few tokens that each pay the fixed part again would
lengthen every prompt's prefill. Chunking does not change a request's tokens.

Admission does not block on the head of the queue: a request that does not fit yet may be
passed by later ones at most ``max_head_skips`` times; after that nothing passes it, so it is
admitted as soon as running requests release enough blocks.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvflow.config import SchedulerConfig
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.sched_output import CachedRequestData, NewRequestData, RunnerStateTracker, SchedulerOutput
from kvflow.core.step_time import StepTimeModel
from kvflow.request import Request, RequestStatus

__all__ = ["CachedRequestData", "NewRequestData", "Scheduler", "SchedulerOutput", "StopHit"]

# A step's budget is never cut below this many tokens (progress on any machine).
MIN_STEP_TOKENS = 32
# The time bound never makes a step's fixed part (``StepTimeModel.fixed_seconds``) more than
# this share of the step: when the fixed part exceeds this share of ``max_step_seconds``, the
# bound stretches to ``fixed_seconds / MAX_FIXED_SHARE``.
MAX_FIXED_SHARE = 0.25


@dataclass(frozen=True)
class StopHit:
    """A stop string the output processor matched: end the request after its
    ``num_output_tokens``-th output token, with finish reason "stop" and ``stop_reason``.

    Attributes:
        num_output_tokens: output tokens the request keeps (>= 1).
        stop_reason: the stop string.
    """

    num_output_tokens: int
    stop_reason: str


class Scheduler:
    """Decides, each step, which requests compute how many tokens.

    Args:
        config: token budget, sequence cap, context limit, policy and preemption mode.
        kv_cache_manager: owner of the block tables.
    """

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.waiting: list[Request] = []  # in admission order (see _queue_key)
        self.running: list[Request] = []  # in admission order
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_swapped_out = 0
        self._arrivals = 0
        self._runner_state = RunnerStateTracker()  # what the model runner holds
        self._finished_req_ids: list[str] = []  # for the runner, at the next step
        self.clock: Callable[[], float] = time.monotonic
        self.step_time = StepTimeModel()  # fixed + per-token seconds of a step, fitted as steps run
        # (clock at schedule, tokens) of the last batch when it held a prompt chunk; None otherwise
        self._step_start: tuple[float, int] | None = None
        # Running requests whose new full blocks are published once this step's stop strings
        # are known (``finish_requests``): a block never holds a token past a stop.
        self._to_publish: list[Request] = []

    def release(self, request_id: str) -> None:
        """Tell the runner, at the next step, to drop ``request_id``'s state: for a request
        that finished outside the scheduler (the engine's probe)."""
        self._runner_state.forget(request_id)
        self._finished_req_ids.append(request_id)

    # ---------------------------------------------------------------- queue management
    def add_request(self, request: Request) -> None:
        """Queue a validated request (see ``LLMEngine.add_request`` for the checks).

        Its ``pending_forks`` (parallel samples) are registered too and start running when
        its prompt has been computed.

        Raises:
            ValueError: if one of the ids is already in use.
        """
        ids = [request.request_id, *(c.request_id for c in request.pending_forks)]
        for request_id in ids:
            if request_id in self.requests:
                raise ValueError(f"request_id {request_id!r} is already in use")
        for r in (request, *request.pending_forks):
            self.requests[r.request_id] = r
            r.arrival_order = self._arrivals
            self._arrivals += 1
        self._enqueue(request)

    def _queue_key(self, request: Request) -> tuple[int, int]:
        if self.config.policy == "priority":
            return (request.priority, request.arrival_order)
        return (0, request.arrival_order)

    def _enqueue(self, request: Request) -> None:
        """Insert by (priority, arrival); a preempted request keeps its arrival, so it goes
        back ahead of everything that arrived after it. O(log n) comparisons: a new arrival
        under fcfs goes at the end, anything else by bisection (``waiting`` is kept sorted
        by ``_queue_key``, whose arrival part makes every key distinct)."""
        waiting, key = self.waiting, self._queue_key(request)
        if not waiting or self._queue_key(waiting[-1]) <= key:
            waiting.append(request)
        else:
            waiting.insert(bisect.bisect_right(waiting, key, key=self._queue_key), request)

    def _remove_waiting(self, request: Request) -> bool:
        """Take ``request`` out of ``waiting`` (found by bisection on its key, or by a scan
        where the queue was reordered from outside, as tests do); False when it is not
        there."""
        waiting = self.waiting
        i = bisect.bisect_left(waiting, self._queue_key(request), key=self._queue_key)
        if i < len(waiting) and waiting[i] is request:
            del waiting[i]
            return True
        try:
            waiting.remove(request)
        except ValueError:
            return False
        return True

    def abort_request(self, request_id: str) -> Request | None:
        """Remove a request wherever it is and free its blocks (device and host) at once.

        Returns:
            The aborted request, or None when the id is unknown or already finished.
        """
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request in self._to_publish:  # its last step's blocks wait for no stop string now
            self._to_publish.remove(request)
            self.kv_cache_manager.cache_full_blocks(request)
        # By membership, not status: a request that failed half-way through ``update`` may
        # carry a finished status while still in the running list.
        if request in self.running:
            self.running.remove(request)
        elif not self._remove_waiting(request):
            parent = request.fork_parent
            if parent is not None and request in parent.pending_forks:
                parent.pending_forks.remove(request)  # a parallel sample not forked yet
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.FINISHED_ABORTED
        if self._runner_state.forget(request_id):
            self._finished_req_ids.append(request_id)
        return request

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---------------------------------------------------------------- scheduling
    def schedule(self) -> SchedulerOutput:
        """Build the next batch: running requests first, then waiting ones."""
        self._publish_pending()
        out = SchedulerOutput()
        budget = self.step_budget()
        kv = self.kv_cache_manager

        # A prompt chunk of a running request leaves one token of the budget for each decode
        # after it in the running list, and, while a waiting request could be admitted, half
        # of the rest for the waiting ones: a long prompt neither stalls the decodes admitted
        # after it nor holds new prompts back for its whole prefill.
        running = self.running
        decodes_after = [0] * (len(running) + 1)
        count = 0
        for i in range(len(running) - 1, -1, -1):
            r = running[i]
            count += len(r.all_token_ids) - r.num_computed_tokens <= 1
            decodes_after[i] = count
        share = self._waiting_could_run()
        decode_tokens = 0  # of decodes (with their drafts): a step of nothing else is not timed
        index = 0
        allocate_slots, add, running_status = kv.allocate_slots, out._add, RequestStatus.RUNNING
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            remaining = len(request.all_token_ids) - request.num_computed_tokens
            if remaining > 1:  # a prompt chunk (or a preempted request's recompute)
                limit = budget - min(decodes_after[index + 1], budget - 1)
                if share and self._queue_key(self.waiting[0])[0] <= self._queue_key(request)[0]:
                    limit = max(1, (limit + 1) // 2)
                num_new = min(remaining, limit)
            else:
                num_new = min(remaining + len(request.spec_token_ids), budget)
            while not allocate_slots(request, num_new):
                victim = self._pick_victim()
                victim_index = self.running.index(victim)
                self.running.pop(victim_index)
                if victim.request_id in out.num_scheduled_tokens:  # priority: already in this batch
                    removed = out._remove(victim.request_id)
                    budget += removed
                    if victim.num_tokens - victim.num_computed_tokens <= 1:
                        decode_tokens -= removed
                    out.scheduled_spec_tokens.pop(victim.request_id, None)
                    out.spec_draft_probs.pop(victim.request_id, None)
                if victim_index < index:
                    index -= 1
                self._preempt(victim, out)
                if victim is request:
                    break
            if request.status is not running_status:
                continue
            add(request.request_id, num_new)
            if remaining <= 1:
                decode_tokens += num_new
            num_spec = num_new - remaining
            if num_spec > 0:  # a decode verifying draft tokens (the budget may trim them)
                out.scheduled_spec_tokens[request.request_id] = request.spec_token_ids[:num_spec]
                if request.spec_draft_probs is not None:
                    out.spec_draft_probs[request.request_id] = request.spec_draft_probs
            budget -= num_new
            index += 1

        # Admitting new work while others are being preempted would only thrash the cache.
        if not out.preempted_req_ids:
            self._admit(out, budget)
        # Fork only once the batch is final: a child forked inside the loops above would be
        # visited (and scheduled) by the running loop, or chosen as a victim, in this step.
        for request_id, num_new in list(out.num_scheduled_tokens.items()):
            self._maybe_fork(self.requests[request_id], num_new, out)
        out.blocks_to_copy = kv.take_pending_copies()
        # The runner's view: new-request data or diffs of the batch, then the forked samples.
        record, requests = self._runner_state.record, self.requests
        for request_id in (*out.num_scheduled_tokens, *(child for child, _ in out.forked)):
            record(out, requests[request_id])
        out.finished_req_ids, self._finished_req_ids = self._finished_req_ids, []
        # Only steps holding prompt tokens are timed: the budget bounds those, and a decode-only
        # step may run another path (a GGUF model's fused decode step) at another cost.
        has_prompt = out.total_num_scheduled_tokens > decode_tokens
        self._step_start = (self.clock(), out.total_num_scheduled_tokens) if has_prompt else None
        return out

    def _waiting_could_run(self) -> bool:
        """Whether the head of the waiting queue might be admitted this step (a free
        sequence slot and a free KV block): only then is budget kept for it."""
        if not self.waiting:
            return False
        num_seqs = len(self.running) + sum(len(r.pending_forks) for r in self.running)
        return (num_seqs + 1 + len(self.waiting[0].pending_forks) <= self.config.max_num_seqs
                and self.kv_cache_manager.num_free_blocks > 0)

    def step_budget(self) -> int:
        """This step's token budget: ``max_num_batched_tokens``, cut (to no less than
        ``MIN_STEP_TOKENS``) to the tokens ``step_time`` predicts to fit in
        ``max_step_seconds`` once a step was measured, or in ``fixed_seconds /
        MAX_FIXED_SHARE`` when that is longer.

        The stretch matters where a step's fixed part is large against the bound (measured on
        a loaded 2-core machine with a GGUF model: 0.47 s fixed + 2.5 ms a token in steps
        holding prompt tokens, so a 1 s step held ~210 tokens and spent half its time on the
        fixed part; the 16 prompts arriving at once then took 17 steps to prefill, and the
        last one's first token waited for 17 fixed parts). Steps of 4x the fixed part spend at
        most a quarter on it: fewer, larger prompt chunks and an earlier last first token."""
        budget = self.config.max_num_batched_tokens
        if self.config.max_step_seconds > 0:
            seconds = max(self.config.max_step_seconds, self.step_time.fixed_seconds / MAX_FIXED_SHARE)
            fits = self.step_time.tokens_within(seconds)
            if fits is not None:
                budget = min(budget, max(MIN_STEP_TOKENS, fits))
        return budget

    def _measure_step(self) -> None:
        """Fold the step that just ran (schedule -> update) into ``step_time``."""
        if self._step_start is None:
            return
        (start, tokens), self._step_start = self._step_start, None
        self.step_time.observe(tokens, self.clock() - start)

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        kv = self.kv_cache_manager
        # LoRA: a step uses at most max_loras distinct adapters (the slot table's size); a
        # request of another adapter waits, without blocking those that fit (at most
        # max_head_skips times, as below).
        adapters = {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}
        for request in list(self.waiting):
            if budget <= 0:
                break
            num_seqs = len(self.running) + sum(len(r.pending_forks) for r in self.running)
            if num_seqs + 1 + len(request.pending_forks) > self.config.max_num_seqs:
                break
            lora = request.lora_request
            if lora is not None and lora.lora_int_id not in adapters and len(adapters) >= self.config.max_loras:
                # (bounded as a request that does not fit the KV cache: a steady stream of the
                # running adapters' requests would otherwise pass it for ever)
                if request.num_skips >= self.config.max_head_skips:
                    break  # nobody passes it any more: the running adapters drain, then it runs
                request.num_skips += 1
                continue
            if request.status == RequestStatus.SWAPPED:
                num_new = min(request.num_tokens - request.num_computed_tokens, budget)
                mapping = kv.swap_in(request, num_new)
                admitted = mapping is not None
                if admitted:
                    out.blocks_to_swap_in.extend(mapping)
            else:
                hits = kv.get_computed_blocks(request)
                num_cached = kv.num_hit_tokens(hits)
                num_new = min(request.num_tokens - num_cached, budget)
                admitted = kv.allocate_slots(request, num_new, hits)
                if admitted:
                    request.num_computed_tokens = num_cached
                    if request.num_cached_tokens < 0:
                        request.num_cached_tokens = num_cached
            if not admitted:
                if request.num_skips >= self.config.max_head_skips:
                    break  # nobody passes it any more
                request.num_skips += 1
                continue
            self._remove_waiting(request)
            if lora is not None:
                adapters.add(lora.lora_int_id)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out._add(request.request_id, num_new)
            budget -= num_new

    def _pick_victim(self) -> Request:
        """The request to preempt: latest admitted (fcfs) or lowest priority, latest arrival."""
        if self.config.policy == "priority":
            return max(self.running, key=self._queue_key)
        return self.running[-1]

    def _maybe_fork(self, request: Request, num_new: int, out: SchedulerOutput) -> None:
        """When ``request``'s prompt completes this step, start its parallel samples.

        They share its blocks (written by this step's forward) and join the running set;
        copy-on-write separates them at their first own token.
        """
        if not request.pending_forks or request.num_computed_tokens + num_new < request.num_tokens:
            return
        for child in request.pending_forks:
            child.fork_parent = None
            self.kv_cache_manager.fork(request, child)
            child.status = RequestStatus.RUNNING
            self.running.append(child)
            out.forked.append((child.request_id, request.request_id))
        request.pending_forks = []

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        request.spec_token_ids = []
        mapping = None
        if self.config.preemption_mode == "swap":
            mapping = self.kv_cache_manager.swap_out(request)
        if mapping is not None:
            out.blocks_to_swap_out.extend(mapping)
            request.status = RequestStatus.SWAPPED
            self.num_swapped_out += 1
        else:  # recompute (also the fallback when host swap space is full)
            self.kv_cache_manager.free(request)
            request.num_computed_tokens = 0
            request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._runner_state.forget(request.request_id)  # the runner drops it (preempted_req_ids)
        out.preempted_req_ids.append(request.request_id)
        self._enqueue(request)

    def update(
        self,
        out: SchedulerOutput,
        sampled_token_ids: dict[str, list[int]],
        errors: dict[str, BaseException] | None = None,
    ) -> list[Request]:
        """Advance the scheduled requests after the model ran.

        Args:
            out: the batch that was executed.
            sampled_token_ids: request_id -> new tokens, for every request whose scheduled
                tokens reached ``num_tokens`` (a partial prefill chunk samples nothing): one
                token, or the accepted draft tokens plus one for a speculative decode. A
                list is cut in place after the token that ends its request.
                An embedding request (``pooling_params`` set) samples nothing and finishes
                in the step that computes the end of its prompt.
            errors: when given, an exception raised while advancing one request (e.g. by
                its grammar on a token) is recorded here under its id and the others are
                still advanced; the caller must then abort that request. When None, the
                exception propagates.

        Returns:
            The requests that finished this step (their blocks are already freed).

        Tokens are taken one at a time, as if each had come from its own step (as vLLM's
        multi-step output processor does): a stop token, EOS, ``max_tokens``, the context
        limit or a finished grammar ends the request at that token, and later tokens of the
        step (accepted drafts past the stop) are dropped before anything is kept for them.
        Stop strings are matched on the text by the output processor after this call; it
        ends a request through ``finish_requests`` before the next ``schedule``, and the
        full blocks of the requests still running are published only then, so that no
        block holding a token past a stop string is published. The K/V of rejected draft
        tokens is rolled back: ``num_computed_tokens`` counts only accepted tokens, blocks
        past them are freed. The step's duration is measured here (``step_time``).
        """
        self._measure_step()
        for child_id, parent_id in out.forked:
            self.requests[child_id].num_computed_tokens = (self.requests[parent_id].num_computed_tokens
                                                           + out.num_scheduled_tokens[parent_id])
        finished = []
        requests, advance = self.requests, self._advance
        for request_id in [*out.num_scheduled_tokens, *(child for child, _ in out.forked)]:
            request = requests[request_id]
            try:
                if advance(request, out, sampled_token_ids.get(request_id)):
                    finished.append(request)
            except Exception as exc:  # noqa: BLE001 - recorded for the caller, or re-raised
                if errors is None:
                    raise
                errors[request.request_id] = exc
        if finished:
            done = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in done]
            for request in finished:
                self._free_finished(request)
        return finished

    def _free_finished(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        if self._runner_state.forget(request.request_id):
            self._finished_req_ids.append(request.request_id)

    def finish_requests(self, stops: dict[str, StopHit]) -> list[str]:
        """End requests at the stop strings the output processor matched in the tokens of
        the last ``update``, then publish the full blocks of the requests still running.

        Args:
            stops: request id -> ``StopHit``: keep the first ``num_output_tokens`` output
                tokens, drop the later ones of the step (accepted drafts past the stop),
                finish with "stop" and ``stop_reason``, free the blocks. A request already
                finished (a stop token on the same token, or aborted) is left as it is.

        Returns:
            The ids of the requests this call finished.

        Raises:
            ValueError: a ``num_output_tokens`` outside [1, the request's output tokens].
        """
        ended = []
        for request_id, hit in stops.items():
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if not 1 <= hit.num_output_tokens <= request.num_output_tokens:
                raise ValueError(f"num_output_tokens={hit.num_output_tokens} is outside [1, "
                                 f"{request.num_output_tokens}] for request {request_id!r}")
            del request.all_token_ids[request.num_prompt_tokens + hit.num_output_tokens:]
            # accepted drafts past the stop were computed but are not the request's
            request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = hit.stop_reason
            self.running.remove(request)
            ended.append(request_id)
        self._publish_pending()
        for request_id in ended:
            self._free_finished(self.requests[request_id])
        return ended

    def _publish_pending(self) -> None:
        """Publish the full blocks of the requests ``update`` advanced (only final tokens:
        the hashes are taken from ``all_token_ids``, cut at any stop by then)."""
        pending, self._to_publish = self._to_publish, []
        for request in pending:
            if request.request_id in self.requests:
                self.kv_cache_manager.cache_full_blocks(request)

    def _advance(self, request: Request, out: SchedulerOutput, tokens: list[int] | None) -> bool:
        """``update`` for one request; True when it finished."""
        request_id = request.request_id
        request.num_computed_tokens += out.num_scheduled_tokens.get(request_id, 0)
        if request.pooling_params is not None:  # an embedding: done once its prompt is computed
            if request.num_computed_tokens >= request.num_tokens:
                request.status = RequestStatus.FINISHED_STOPPED
            self.kv_cache_manager.cache_full_blocks(request)
            return request.is_finished
        num_drafts = len(out.scheduled_spec_tokens[request_id]) if request_id in out.scheduled_spec_tokens else 0
        if num_drafts:
            num_rejected = num_drafts - (len(tokens) - 1)
            request.num_computed_tokens -= num_rejected
            request.spec_token_ids = []
            self.kv_cache_manager.trim(request)
        finished = False
        if tokens:
            max_model_len = self.config.max_model_len
            for i, token in enumerate(tokens):
                request.append_output_token(token)
                if request.check_stop(max_model_len):
                    del tokens[i + 1 :]  # tokens past a stop are dropped (callers see the cut list)
                    # accepted drafts past the stop were computed but are not the request's
                    request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)
                    finished = True
                    break
        else:  # (nothing sampled: a prompt chunk; or a request the step finished otherwise)
            finished = request.is_finished
        # Publish after appending (and cutting): the computed tokens include accepted drafts,
        # which are only in all_token_ids now (the block hashes are taken from all_token_ids).
        # A running request waits for this step's stop strings (``finish_requests``).
        if finished:
            self.kv_cache_manager.cache_full_blocks(request)
        else:
            self._to_publish.append(request)
        return finished
