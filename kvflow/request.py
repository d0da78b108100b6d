"""State of one request inside the engine.

A request carries ``num_tokens`` (prompt + output so far) and ``num_computed_tokens``
(tokens whose K/V are in the paged cache). The scheduler's one rule is to let
``num_computed_tokens`` catch up with ``num_tokens``; see ``kvflow/core/scheduler.py``.
"""

from __future__ import annotations

import enum
import time

from typing import TYPE_CHECKING, Any

import torch

from kvflow.sampling_params import SamplingParams, generator_seed

if TYPE_CHECKING:
    from kvflow.pooling_params import PoolingParams

# A request's adapter is a ``kvflow.lora.request.LoRARequest`` (duck-typed here: ``lora_int_id``,
# ``cache_key``): ``lora/`` stands above this module (its PEFT loader builds layers).
LoRARequest = Any


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"  # failed inside the engine (see LLMEngine.step)

    @property
    def is_finished(self) -> bool:
        return self._is_finished  # (set on each member below: an enum hashes in Python)

    @property
    def finish_reason(self) -> str | None:
        """OpenAI-style finish reason: "stop", "length", "abort", "error" (failed inside the
        engine), or None while unfinished."""
        return self._finish_reason


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
}
_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}
for _status in RequestStatus:
    _status._is_finished = _status in _FINISHED
    _status._finish_reason = _FINISH_REASON.get(_status)


class Request:
    """One generation request.

    Attributes:
        request_id: unique id given by the caller.
        prompt: the prompt text, or None when the caller gave token ids.
        prompt_token_ids: prompt tokens (list of int).
        sampling_params: the validated ``SamplingParams``.
        all_token_ids: prompt followed by generated tokens.
        num_computed_tokens: tokens of ``all_token_ids`` whose K/V are in the cache.
        block_ids: the request's block tables, one per KV cache group (physical block ids,
            in logical order; empty while it holds no block).
        block_hashes: memoized prefix-cache hashes of the request's full blocks.
        seed: the request's seed (``seed`` if given, for parallel samples, else
            ``sampling_params.seed``), or None.
        generator: the request's own ``torch.Generator`` when it has a seed, else None.
        arrival_time: ``time.monotonic()`` at creation, in seconds.
        priority: scheduling priority under the ``priority`` policy; lower runs first.
        pooling_params: set (resolved) for an embedding request: it never samples and
            finishes once its prompt is computed (``sampling_params`` is then a placeholder).
        pooled_sum: float32 [hidden_size], the sum of the final hidden states computed so
            far (mean pooling; kept by the model runner across prefill chunks).
        num_cached_tokens: prompt tokens found in the prefix cache when it was first
            admitted (-1 before that).
        lora_request: the LoRA adapter it runs with, or None for the base model (its blocks
            are hashed with the adapter: ``cache_key``).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        prompt: str | None = None,
        arrival_time: float | None = None,
        seed: int | None = None,
        priority: int = 0,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.lora_request = lora_request
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_ids: tuple[list[int], ...] = ()  # one block table per KV cache group (set by KVCacheManager)
        self.block_hashes: list[bytes] = []  # chained hashes of full blocks, by content
        self.num_published_blocks = 0  # leading blocks already in the prefix index
        self.num_preemptions = 0
        self.priority = priority
        self.arrival_order = 0  # set by the scheduler; ties broken first-come first-served
        self.num_skips = 0  # times a later request was admitted past this one
        self.cpu_block_ids: list[int] = []  # host copies of the blocks while swapped out
        self.bad_words_token_ids: list[list[int]] = []  # set by the engine from params.bad_words
        # structured output state (a kvflow.sample.guided.GrammarMatcher), set by the engine
        self.grammar: Any = None
        self.stop_reason: int | str | None = None  # the stop token or stop string that ended it
        # Speculative decoding: draft tokens to verify next step, and the draft distribution
        # they were sampled from (float32 [k, vocab]; None for a deterministic proposer).
        self.spec_token_ids: list[int] = []
        self.spec_draft_probs: torch.Tensor | None = None
        # Parallel samples (n > 1) waiting to be forked from this request once its prompt
        # is computed; see Scheduler.schedule.
        self.pending_forks: list[Request] = []
        self.fork_parent: Request | None = None
        self.pooling_params = pooling_params
        self.pooled_sum: torch.Tensor | None = None
        self.num_cached_tokens = -1
        self.seed = seed = sampling_params.seed if seed is None else seed
        self.generator: torch.Generator | None = None
        if seed is not None:
            self.generator = torch.Generator()
            self.generator.manual_seed(generator_seed(seed))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens, in tokens."""
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def needs_every_position(self) -> bool:
        """True when every prompt token must be computed (no prefix-cache hits): for
        ``prompt_logprobs`` and for mean pooling."""
        if self.sampling_params.prompt_logprobs is not None:
            return True
        return self.pooling_params is not None and self.pooling_params.needs_every_position

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        # under ignore_eos an EOS is not the end, so the grammar (a structural tag's: free
        # text; a guided_* constraint refuses ignore_eos) does not see it and stays open
        if self.grammar is not None and not (token_id == self.eos_token_id and self.sampling_params.ignore_eos):
            self.grammar.accept(token_id)

    def check_stop(self, max_model_len: int) -> bool:
        """Set a finished status if the last token ends the request; return True if so.

        Order: a stop token or EOS, or a complete structured output, ends with "stop";
        otherwise reaching ``max_tokens`` or the model context ``max_model_len`` (in tokens)
        ends with "length". (Stop strings are matched on the text by the engine.)
        """
        params = self.sampling_params
        last = self.all_token_ids[-1]
        if (not params.ignore_eos and last == self.eos_token_id) or last in params.stop_token_ids:
            self.status = RequestStatus.FINISHED_STOPPED
            self.stop_reason = None if last == self.eos_token_id else last
        elif self.grammar is not None and self.grammar.is_terminated:
            self.status = RequestStatus.FINISHED_STOPPED
        elif self.num_output_tokens >= params.max_tokens or self.num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH
        return self.status.is_finished

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.value}, "
            f"num_tokens={self.num_tokens}, num_computed_tokens={self.num_computed_tokens})"
        )


def make_parallel_samples(
    request_id: str,
    prompt_token_ids: list[int],
    sampling_params: SamplingParams,
    eos_token_id: int | None,
    prompt: str | None = None,
    priority: int = 0,
    lora_request: LoRARequest | None = None,
) -> list[Request]:
    """The ``n`` requests of one prompt: the first computes the prompt, the others wait in its
    ``pending_forks`` to share its blocks. Sample i has id ``request_id`` when n == 1, else
    ``f"{request_id}#{i}"``, and seed ``seed + i`` when seeded.
    """
    n = sampling_params.n
    samples = []
    for i in range(n):
        seed = None if sampling_params.seed is None else sampling_params.seed + i
        sample_id = request_id if n == 1 else f"{request_id}#{i}"
        samples.append(
            Request(sample_id, prompt_token_ids, sampling_params, eos_token_id, prompt=prompt, seed=seed, priority=priority,
                    lora_request=lora_request)
        )
    leader = samples[0]
    leader.pending_forks = samples[1:]
    for child in leader.pending_forks:
        child.fork_parent = leader
    return samples
