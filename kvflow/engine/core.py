"""The engine core: token ids in, token ids out (vLLM v1's ``EngineCore``).

``EngineCore.step()`` is the loop at the token level: ``Scheduler.schedule`` -> the
``Worker`` runs the batch (``ModelRunner.execute``) -> ``Scheduler.update`` appends the
sampled tokens and applies the token-level stops (EOS, stop token ids, ``max_tokens``, the
context limit, a finished grammar). It imports no tokenizer and makes no ``RequestOutput``:
it returns, per sample, the new token ids, their logprobs, the finish reason and the prefix
cache hits (``EngineCoreOutputs``), and the ``OutputProcessor``
(``kvflow/engine/output_processor.py``) turns those into text and outputs. A stop string is
found there and comes back as ``finish_requests({sample id: StopHit})``, which ends the
sample after its k-th output token before anything is scheduled again (the cut that
``Scheduler.update`` made when it asked the detokenizer after every token).

Failure isolation lives here: a request that fails in the runner or while its tokens are
appended is aborted (all its samples, blocks freed) and reported in ``failed``; when every
request of a step failed, a one-token probe forward tells a request's fault from the
engine's.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvflow.config import EngineConfig
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.scheduler import NewRequestData, Scheduler, SchedulerOutput, StopHit
from kvflow.logprobs import Logprob
from kvflow.request import Request, RequestStatus
from kvflow.sampling_params import SamplingParams
from kvflow.core.spec_decode_stats import SpecDecodeStats
from kvflow.worker.worker import Worker

logger = logging.getLogger(__name__)


@dataclass
class EngineCoreOutput:
    """What one step did for one sample (a ``Request``) that produced something.

    Attributes:
        request_id: the sample's id (``"{id}#{i}"`` for parallel samples, else the user's id).
        new_token_ids: the tokens appended this step (one, or accepted drafts plus one; cut
            after a token-level stop); a fresh list the receiver may keep.
        new_logprobs: per new token, {token id: ``Logprob``} (no ``decoded_token``) when the
            request asked for ``logprobs``, else None.
        finish_reason: "stop", "length" (or None while running): the token-level finish.
        stop_reason: the stop token id that ended it (None for EOS, length or running).
        num_cached_tokens: prompt tokens that were prefix-cache hits at its first schedule
            (0 before that).
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0


@dataclass
class EngineCoreOutputs:
    """The result of one ``EngineCore.step``.

    Attributes:
        outputs: one ``EngineCoreOutput`` per sample that got tokens this step.
        started: user request ids scheduled for the first time this step.
        scheduled_time: ``time.monotonic()`` when the batch was scheduled.
        prompt_logprobs: user request id -> {prompt position: {token id: ``Logprob``}} of
            the prompt tokens computed this step.
        pooled: user request id -> (the pooled final hidden state, float32 [hidden_size], not
            normalized; its prompt's prefix-cache hits) of an embedding request whose prompt
            completed this step.
        failed: user request id -> (exception, each sample's output token ids) of the
            requests that failed this step; they are already aborted (blocks freed).
    """

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    started: list[str] = field(default_factory=list)
    scheduled_time: float = 0.0
    prompt_logprobs: dict[str, dict[int, dict[int, Logprob]]] = field(default_factory=dict)
    pooled: dict[str, tuple[torch.Tensor, int]] = field(default_factory=dict)
    failed: dict[str, tuple[BaseException, list[list[int]]]] = field(default_factory=dict)


class EngineCore:
    """Scheduler + KV cache manager over a worker (and its speculative proposer), at the
    token level; the loop asks the platform for its chores once between steps.

    A user request is a list of samples (``Request``: one, or ``n`` parallel samples sharing
    the prompt's blocks); the core runs samples and answers by sample id, and keeps which
    user request each belongs to, so that a fault fails all of one user request's samples.

    Built downhill from the config (vLLM v1's ``EngineCore``): first the ``Worker``
    (``kvflow.worker.worker``: the platform, then model, KV cache, runner, CUDA graphs,
    speculative proposer, tensor-parallel workers), then, from the config alone and
    independent of the worker, the KV cache manager and the scheduler.

    Args:
        config: the engine's ``EngineConfig``.
        model: a loaded model to run instead of loading ``config.load`` (tests).
        proposer: a speculative proposer instead of ``config.speculative``'s (tests).

    Attributes:
        worker: the ``Worker``; platform: its ``kvflow.platforms.Platform``
        (``between_steps()`` is called before each step's schedule); proposer: the
        worker's speculative proposer, or None; kv_cache_manager, scheduler.

    Raises:
        ValueError: as ``Worker`` (a model that cannot be loaded as configured, a backend
            that cannot run here).
    """

    def __init__(self, config: EngineConfig, model=None, proposer=None) -> None:
        self.config = config
        self.worker = Worker(config, model=model, proposer=proposer)
        with contextlib.ExitStack() as on_failure:  # a failed build stops the worker's processes
            on_failure.callback(self.worker.shutdown)
            self.platform = self.worker.platform
            self.proposer = self.worker.proposer
            spec = config.speculative
            self.spec_disable_by_batch_size = spec.disable_by_batch_size if spec is not None else None
            self.spec_stats = SpecDecodeStats(self.proposer.k if self.proposer is not None else 0)
            # The scheduler-side owner of the block tables: one table per KV cache group
            # (kvflow.core.kv_cache_coordinator; one group, windowed when every layer is, for
            # most models).
            self.kv_cache_manager = KVCacheManager.from_cache_config(config.cache, config.model.kv_free_window)
            self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager)
            on_failure.pop_all()
        self.last_scheduler_output: SchedulerOutput | None = None
        self._to_propose: SchedulerOutput | None = None  # the batch run since the last propose()
        self._samples: dict[str, list[Request]] = {}  # user request id -> its samples
        self._owner: dict[str, str] = {}  # sample id -> user request id
        self._started: set[str] = set()  # user request ids scheduled at least once

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, samples: list[Request]) -> None:
        """Queue user request ``request_id``: its first sample computes the prompt, the
        others wait in its ``pending_forks`` (``make_parallel_samples``).

        Raises:
            ValueError: a sample id already in use.
        """
        self.scheduler.add_request(samples[0])
        self._samples[request_id] = samples
        for sample in samples:
            self._owner[sample.request_id] = request_id

    def abort_request(self, request_id: str) -> bool:
        """Abort user request ``request_id`` (every sample; blocks freed at once). False
        for an unknown or finished id."""
        samples = self._samples.pop(request_id, None)
        if samples is None:
            return False
        self._started.discard(request_id)
        for sample in samples:
            self._owner.pop(sample.request_id, None)
            self.scheduler.abort_request(sample.request_id)
            if self.proposer is not None:
                self.proposer.free(sample.request_id)
        return True

    def samples(self, request_id: str) -> list[Request]:
        """The samples of a live user request (KeyError once it finished)."""
        return self._samples[request_id]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def _forget_finished(self, request_id: str) -> None:
        samples = self._samples.get(request_id)
        if samples is not None and all(s.is_finished for s in samples):
            del self._samples[request_id]
            self._started.discard(request_id)
            for sample in samples:
                self._owner.pop(sample.request_id, None)

    # ------------------------------------------------------------------ the loop
    def step(self, on_scheduled: Callable[[list[str]], None] | None = None) -> EngineCoreOutputs:
        """Schedule a batch, run it, append its tokens (see ``LLMEngine.step`` for the fault
        isolation). ``on_scheduled`` is called with the user request ids started this step,
        after scheduling and before the forward.

        Raises:
            Exception: the engine cannot go on (a fault in the scheduler, the block copies,
                a tensor-parallel forward, or the probe).
        """
        self.platform.between_steps()  # (thread count, kernels built since: never inside a step)
        sched_out = self.scheduler.schedule()
        result = EngineCoreOutputs()
        if sched_out.is_empty:
            return result
        self.last_scheduler_output = self._to_propose = sched_out
        result.scheduled_time = time.monotonic()
        owners, started = self._owner, self._started
        for sample_id in sched_out.num_scheduled_tokens:
            owner = owners[sample_id]
            if owner not in started:
                started.add(owner)
                result.started.append(owner)
        if on_scheduled is not None:
            on_scheduled(result.started)
        run = self.worker.execute_model(sched_out)
        if run.failed:
            failures: dict[str, BaseException] = {}
            for sample_id, exc in run.failed.items():
                failures.setdefault(self._owner[sample_id], exc)
            everyone = all(self._owner[s] in failures for s in sched_out.num_scheduled_tokens)
            self._drop_from_batch(sched_out, {s.request_id for rid in failures for s in self._samples[rid]})
            for request_id, exc in failures.items():
                self._fail(result, request_id, exc)
            if everyone:
                self._probe()
        errors: dict[str, BaseException] = {}
        self.scheduler.update(sched_out, run.sampled_token_ids, errors=errors)
        for sample_id, positions in run.prompt_logprobs.items():
            if sample_id in self._owner:
                result.prompt_logprobs.setdefault(self._owner[sample_id], {}).update(positions)
        for sample_id, pooled_sum in run.pooled_sums.items():  # mean pooling's sum so far, kept on
            if sample_id in self._owner:                       # the request (a swap resumes from it)
                self._samples[self._owner[sample_id]][0].pooled_sum = pooled_sum
        for sample_id, vector in run.pooled.items():
            if sample_id in self._owner:
                request_id = self._owner[sample_id]
                result.pooled[request_id] = (vector, max(self._samples[request_id][0].num_cached_tokens, 0))
                self._forget_finished(request_id)
        for sample_id, exc in errors.items():
            if sample_id in self._owner:
                self._fail(result, self._owner[sample_id], exc)
        done = []
        requests, all_logprobs, outputs = self.scheduler.requests, run.logprobs, result.outputs
        for sample_id, tokens in run.sampled_token_ids.items():
            request_id = owners.get(sample_id)
            if request_id is None:  # failed above
                continue
            sample = requests.get(sample_id) or next(
                s for s in self._samples[request_id] if s.request_id == sample_id)  # (finished: gone from there)
            logprobs = all_logprobs.get(sample_id) if all_logprobs else None
            status = sample.status
            outputs.append(EngineCoreOutput(
                sample_id, tokens, logprobs[: len(tokens)] if logprobs is not None else None,
                status.finish_reason, sample.stop_reason, max(sample.num_cached_tokens, 0),
            ))
            if status.is_finished:
                done.append(request_id)
        for request_id in done:  # after every sample's output: n samples may finish in one step
            self._forget_finished(request_id)
        if self.proposer is not None:
            self.spec_stats.record(run.num_accepted.values())
        return result

    def finish_requests(self, stops: dict[str, StopHit]) -> None:
        """End each sample of ``stops`` (sample id -> ``StopHit``) after its
        ``num_output_tokens``-th output token with "stop" (a stop string the output processor
        matched), freeing its blocks; an already finished sample is left as it is. Then
        publish the blocks of this step's final tokens (``Scheduler.finish_requests``)."""
        for sample_id in self.scheduler.finish_requests(stops):
            request_id = self._owner.get(sample_id)
            if request_id is not None:
                self._forget_finished(request_id)

    def propose(self) -> dict[str, BaseException]:
        """Draft the next tokens of every decoding request (no-op without a proposer); the
        user requests whose drafting failed are aborted and returned (id -> exception)."""
        sched_out, self._to_propose = self._to_propose, None
        if self.proposer is None or sched_out is None:  # (no batch ran since the last call)
            return {}
        failures = self._propose(sched_out)
        for request_id in failures:
            self.abort_request(request_id)
        return failures

    # ------------------------------------------------------------------ faults
    def _fail(self, result: EngineCoreOutputs, request_id: str, exc: BaseException) -> None:
        samples = self._samples.get(request_id)
        if samples is None or request_id in result.failed:
            return
        logger.error("request %s failed and was aborted: %s: %s", request_id, type(exc).__name__, exc)
        result.failed[request_id] = (exc, [s.output_token_ids for s in samples])
        result.outputs = [o for o in result.outputs if self._owner.get(o.request_id) != request_id]
        self.abort_request(request_id)
        for sample in samples:
            sample.status = RequestStatus.FINISHED_ERROR

    @staticmethod
    def _drop_from_batch(sched_out: SchedulerOutput, sample_ids: set[str]) -> None:
        """Take the samples ``sample_ids`` out of the executed batch, so that
        ``Scheduler.update`` neither advances them nor publishes their blocks."""
        for request_id in [r for r in sched_out.num_scheduled_tokens if r in sample_ids]:
            sched_out._remove(request_id)
            sched_out.scheduled_spec_tokens.pop(request_id, None)
        sched_out.forked = [(c, p) for c, p in sched_out.forked if c not in sample_ids and p not in sample_ids]

    def _probe(self) -> None:
        """One greedy token of a throwaway one-token request, in a fresh block.

        Raises:
            RuntimeError: when that fails too: the fault is the engine's, not a request's.
        """
        probe_id = "kvflow-probe"
        while probe_id in self.scheduler.requests:  # the runner holds states by id: never a live one's
            probe_id += "'"
        probe = Request(probe_id, [0], SamplingParams(temperature=0, max_tokens=1), None)
        if not self.kv_cache_manager.allocate_slots(probe, 1):
            return  # not reached: the failed requests' blocks were just freed
        batch = SchedulerOutput(scheduled_new_reqs=[NewRequestData.from_request(probe)])
        batch._add(probe.request_id, 1)
        try:
            result = self.worker.execute_model(batch)
        finally:
            self.kv_cache_manager.free(probe)
            self.scheduler.release(probe.request_id)
        if result.failed:
            raise RuntimeError(
                "the engine is unusable: every request of a step failed, and so did a one-token probe forward"
            ) from result.failed[probe.request_id]

    def _propose(self, sched_out: SchedulerOutput) -> dict[str, BaseException]:
        """Draft the next tokens of every decoding request; drop the proposer's state of
        requests that left the running set.

        Returns:
            user request id -> exception, for the requests whose drafting failed (when a
            batched proposal raises, its requests' draft state is dropped and each is
            proposed alone).
        """
        for request_id in sched_out.preempted_req_ids:
            self.proposer.free(request_id)
        running = {r.request_id for r in self.scheduler.running}
        for request_id in sched_out.num_scheduled_tokens:
            if request_id not in running:
                self.proposer.free(request_id)
        ready = [
            r
            for r in self.scheduler.running
            if r.num_computed_tokens == r.num_tokens - 1 and r.grammar is None and not r.pending_forks
        ]
        limit = self.spec_disable_by_batch_size
        if limit is not None and len(self.scheduler.running) >= limit:
            # A large batch is no longer memory-bound per sequence: plain decoding is cheaper.
            # The draft model catches up on the skipped tokens the next time it proposes.
            for r in ready:
                r.spec_token_ids, r.spec_draft_probs = [], None
            return {}
        try:
            self.proposer.propose(ready)
            return {}
        except Exception as exc:  # noqa: BLE001 - isolated below
            logger.warning("drafting for %d requests failed (%s: %s); drafting for each alone",
                           len(ready), type(exc).__name__, exc)
        failures: dict[str, BaseException] = {}
        for r in ready:  # the batched call may have left any of them half-way: start afresh
            self.proposer.free(r.request_id)
            r.spec_token_ids, r.spec_draft_probs = [], None
        for r in ready:
            try:
                self.proposer.propose([r])
            except Exception as exc:  # noqa: BLE001 - this request's fault
                logger.warning("drafting for request %s failed", r.request_id, exc_info=exc)
                r.spec_token_ids, r.spec_draft_probs = [], None
                failures.setdefault(self._owner[r.request_id], exc)
        return failures

    # ------------------------------------------------------------------ stats
    def get_stats(self) -> dict[str, float | int]:
        """The scheduler's and KV cache's counters (see ``LLMEngine.get_stats``)."""
        kv = self.kv_cache_manager
        return {
            "num_total_blocks": kv.num_total_blocks,
            "num_free_blocks": kv.num_free_blocks,
            "kv_cache_usage": kv.usage(),
            "fragmentation": kv.fragmentation(self.scheduler.running),
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
            "num_cached_blocks": kv.block_pool.num_cached_blocks,
            "num_window_freed_blocks": kv.num_window_freed_blocks,
            "num_kv_cache_groups": kv.num_groups,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_swapped_out": self.scheduler.num_swapped_out,
            **self.spec_stats.as_dict(),
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
        }
