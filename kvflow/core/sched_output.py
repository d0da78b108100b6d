"""The scheduler -> model runner contract, as data.

After vLLM v1 (``vllm/v1/core/sched/output.py``): a request's static data goes to the runner
once (``NewRequestData``: the first time it is scheduled, when it is resumed after a
preemption, and when it is forked as a parallel sample), then each step only what changed
(``CachedRequestData``: the tokens appended since, the block-table change and the computed
count). The runner keeps the rest in its persistent per-request state
(``kvflow.worker.model_runner.CachedRequestState``) and drops it on the ids in
``finished_req_ids`` and ``preempted_req_ids``. Under tensor parallelism the driver
broadcasts this diff (``SchedulerOutput.for_workers``), not the requests' token lists.

Adapted to kvflow: block ids come per KV cache group (``tuple[list[int], ...]``, one list per
group in group order, a 1-tuple for a model with one group; ``kvflow/core/kv_cache_groups.py``);
copy-on-write, a speculative roll-back, a swap-in and a sliding window's freeing change blocks
already held, so a cached entry either appends block ids to every group's table or replaces
all of them (``replace_block_ids``);
parallel samples forked this step arrive as new requests holding their parent's table
(``forked``); a request's sampling handles (its seeded ``torch.Generator``, whose stream
must go on across preemptions, and its grammar matcher, which the scheduler's ``update``
advances) are engine-owned objects the driver's runner references, never sent to workers.
``RunnerStateTracker`` builds the diff for any request-like object, so the scheduler and the
draft proposer (which drives its own runner) share it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from kvflow.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvflow.sample.guided import GrammarMatcher


@dataclass
class NewRequestData:
    """Everything the runner keeps of a request, sent once.

    Attributes:
        request_id: the (sample) id.
        prompt_token_ids: the prompt.
        output_token_ids: tokens generated so far (empty for a new request; the outputs of a
            request resumed after preemption).
        sampling_params: its parameters (on workers only ``prompt_logprobs`` is kept).
        eos_token_id: the EOS id ``min_tokens`` bans, or None.
        bad_words_token_ids: token sequences of ``sampling_params.bad_words``.
        block_ids: its block tables, one per KV cache group in group order (physical block
            ids, in logical order).
        num_computed_tokens: tokens whose K/V are in the cache.
        generator: driver only: the request's own seeded generator (None: the engine's).
        grammar: driver only: its structured-output matcher, or None.
        pooling_params: an embedding request's ``PoolingParams`` (no logits row, never
            sampled), or None; workers keep it.
        pooled_sum: driver only: mean pooling's running sum (float32 [hidden_size]) of the
            tokens computed before a preemption by swap, or None.
        lora_request: its LoRA adapter (``kvflow.lora.request.LoRARequest``), or None.
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    bad_words_token_ids: list[list[int]]
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    generator: torch.Generator | None = None
    grammar: "GrammarMatcher | None" = None
    pooling_params: Any = None
    pooled_sum: torch.Tensor | None = None
    lora_request: Any = None

    @classmethod
    def from_request(cls, request: Any) -> "NewRequestData":
        """The data of a ``Request`` (or an object with its attributes), copied."""
        prompt = request.prompt_token_ids
        return cls(
            request.request_id, list(prompt), list(request.all_token_ids[len(prompt) :]), request.sampling_params,
            request.eos_token_id, request.bad_words_token_ids, tuple(list(t) for t in request.block_ids),
            request.num_computed_tokens,
            request.generator, request.grammar, getattr(request, "pooling_params", None),
            getattr(request, "pooled_sum", None), getattr(request, "lora_request", None),
        )

    def for_workers(self) -> "NewRequestData":
        """The part a tensor-parallel worker needs (it builds inputs and logits, samples nothing)."""
        params = SamplingParams(prompt_logprobs=self.sampling_params.prompt_logprobs, max_tokens=1)
        return replace(self, sampling_params=params, eos_token_id=None, bad_words_token_ids=[], generator=None,
                       grammar=None, pooled_sum=None)


@dataclass
class CachedRequestData:
    """Per-step changes of requests the runner already holds (one entry per request, as
    parallel lists, in the order of ``request_ids``).

    Attributes:
        request_ids: the requests.
        new_token_ids: tokens appended since the runner last saw each request (its sampled
            or accepted tokens).
        new_block_ids: per KV cache group, the block ids appended to that group's table, or
            the group's whole table when ``replace_block_ids``.
        replace_block_ids: True where held blocks changed (copy-on-write of a shared block,
            blocks freed by a speculative roll-back or behind a sliding window): every
            group's table is then replaced.
        num_computed_tokens: its computed count now.
    """

    request_ids: list[str] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...]] = field(default_factory=list)
    replace_block_ids: list[bool] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    def append(self, request_id: str, new_token_ids: list[int], new_block_ids: tuple[list[int], ...],
               replace_blocks: bool, num_computed_tokens: int) -> None:
        self.request_ids.append(request_id)
        self.new_token_ids.append(new_token_ids)
        self.new_block_ids.append(new_block_ids)
        self.replace_block_ids.append(replace_blocks)
        self.num_computed_tokens.append(num_computed_tokens)

    def __len__(self) -> int:
        return len(self.request_ids)


@dataclass
class SchedulerOutput:
    """One step's batch, as the runner receives it.

    Attributes:
        scheduled_new_reqs: requests the runner does not hold yet (new, resumed, forked).
        scheduled_cached_reqs: changes of the scheduled requests it holds.
        num_scheduled_tokens: request_id -> tokens to compute this step, in batch order.
        total_num_scheduled_tokens: sum of the above (<= max_num_batched_tokens).
        scheduled_spec_tokens: request_id -> draft tokens verified this step (speculative
            decoding); they are part of the request's scheduled tokens.
        spec_draft_probs: driver only: request_id -> the draft distribution of those tokens
            (float32 [k, vocab]); absent for a deterministic proposer.
        blocks_to_copy: (src, dst) block copies to do before the forward (copy-on-write).
        blocks_to_swap_out: (device block, host block) copies, done first.
        blocks_to_swap_in: (host block, device block) copies, done after the swap-outs.
        forked: (child id, parent id) pairs: parallel samples that joined this step sharing
            the parent's blocks; each samples its first token from the parent's logits.
        preempted_req_ids: requests preempted while building this batch (the runner drops
            them; they come back as new-request data).
        finished_req_ids: requests that finished or were aborted since the previous step.
    """

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    scheduled_spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    spec_draft_probs: dict[str, torch.Tensor] = field(default_factory=dict)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    forked: list[tuple[str, str]] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)

    @property
    def scheduled_req_ids(self) -> list[str]:
        """The scheduled requests' ids, in batch order."""
        return list(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens

    def _add(self, request_id: str, num_tokens: int) -> None:
        self.num_scheduled_tokens[request_id] = num_tokens
        self.total_num_scheduled_tokens += num_tokens

    def _remove(self, request_id: str) -> int:
        num_tokens = self.num_scheduled_tokens.pop(request_id)
        self.total_num_scheduled_tokens -= num_tokens
        return num_tokens

    def for_workers(self) -> "SchedulerOutput":
        """The picklable copy a tensor-parallel driver broadcasts: the diff without the
        driver-only fields (sampling handles, draft distributions)."""
        return replace(self, scheduled_new_reqs=[d.for_workers() for d in self.scheduled_new_reqs],
                       spec_draft_probs={})

    def subset(self, request_id: str) -> "SchedulerOutput":
        """The step of one scheduled request and the samples it forks, without state
        changes or block copies (for re-running a failed batch one request at a time)."""
        sub = SchedulerOutput()
        sub._add(request_id, self.num_scheduled_tokens[request_id])
        if request_id in self.scheduled_spec_tokens:
            sub.scheduled_spec_tokens[request_id] = self.scheduled_spec_tokens[request_id]
        if request_id in self.spec_draft_probs:
            sub.spec_draft_probs[request_id] = self.spec_draft_probs[request_id]
        sub.forked = [(child, parent) for child, parent in self.forked if parent == request_id]
        return sub


@dataclass
class _Held:
    num_tokens: int
    block_ids: tuple[list[int], ...]


class RunnerStateTracker:
    """What a model runner holds of each request, to send it only the difference.

    ``record`` adds a scheduled request to a ``SchedulerOutput``: as ``NewRequestData`` when
    the runner does not hold it, else as a ``CachedRequestData`` entry with the tokens
    appended and the block-table change since the last record. ``forget`` marks a request
    the runner is told to drop (finished, aborted, preempted, rolled back).
    """

    def __init__(self) -> None:
        self._held: dict[str, _Held] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held

    def forget(self, request_id: str) -> bool:
        """Stop tracking ``request_id``; True when the runner held it."""
        return self._held.pop(request_id, None) is not None

    def record(self, out: SchedulerOutput, request: Any) -> None:
        """Add ``request``'s new-request data or diff to ``out`` (a ``Request`` or an object
        with its attributes: request_id, all_token_ids, block_ids, num_computed_tokens...)."""
        held = self._held.get(request.request_id)
        tokens, tables = request.all_token_ids, request.block_ids
        if held is None:
            data = NewRequestData.from_request(request)
            out.scheduled_new_reqs.append(data)
            self._held[request.request_id] = _Held(len(tokens), tuple(list(t) for t in data.block_ids))
            return
        # Append-only: every group's table starts with what the runner holds (compared
        # without a copy when the lengths are equal, the common decode step).
        append_only = len(tables) == len(held.block_ids)
        new_list: list[list[int]] = []
        if append_only:
            for table, was in zip(tables, held.block_ids):
                n = len(was)
                if len(table) == n and table == was:
                    new_list.append([])
                elif len(table) > n and table[:n] == was:
                    new = table[n:]
                    was.extend(new)
                    new_list.append(new)
                else:
                    append_only = False
                    break
        if append_only:
            new_blocks = tuple(new_list)
        else:
            new_blocks = tuple(list(t) for t in tables)
            held.block_ids = tuple(list(t) for t in tables)
        out.scheduled_cached_reqs.append(request.request_id, list(tokens[held.num_tokens :]), new_blocks,
                                         not append_only, request.num_computed_tokens)
        held.num_tokens = len(tokens)
