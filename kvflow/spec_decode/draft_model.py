"""Draft-model proposer: a small model with its own paged KV cache proposes k tokens.

Each step the draft model first catches up on the request's tokens it has not seen (the
whole prompt the first time, then the tokens accepted since), then runs k - 1 single-token
steps; all requests are batched in each forward. The draft distribution q at every
position is computed with the request's own processing (penalties, temperature, top-k,
top-p, min-p), the same function as the target's p, and the draft token is sampled from it
(argmax for greedy requests). After verification the draft cache keeps only the tokens the
target accepted: its block table and computed count are rolled back to the common prefix.

The proposer drives its own ``ModelRunner`` (built by the worker's builder,
``kvflow.worker.model_runner.ModelRunner.from_config``) through the public data contract
(``kvflow/core/sched_output.py``): its own block pool (``KVCacheManager``) holds a
``_DraftSequence`` per request, a ``RunnerStateTracker`` sends the runner each request's data
once and then per-step diffs (the last draft token, new blocks), and a request whose drafts
were rejected is dropped from the runner and sent again with the tokens it shares with the
target (``finished_req_ids``, then new-request data).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvflow.config import CacheConfig
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.sched_output import RunnerStateTracker, SchedulerOutput
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams, generator_seed
from kvflow.sample.rejection_sampler import processed_probs
from kvflow.spec_decode.ngram import max_drafts


@dataclass
class _DraftSequence:
    """The draft's copy of a request: its tokens (the target's, then this step's drafts), its
    block table in the draft pool and computed count (what ``KVCacheManager`` reads of a
    request), and what ``NewRequestData.from_request`` reads."""

    request_id: str
    prompt_token_ids: list[int]
    all_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    bad_words_token_ids: list[list[int]]
    generator: torch.Generator | None  # seeded with the request's seed (seed + i for sample i), for its draft sampling
    num_computed_tokens: int = 0
    block_ids: tuple[list[int], ...] = ()
    num_published_blocks: int = 0
    cpu_block_ids: list[int] = field(default_factory=list)
    grammar = None  # drafting is off for structured output

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class DraftModelProposer:
    """Proposes up to ``k`` tokens per request with a draft model.

    Args:
        runner: the draft model's ``ModelRunner`` (``kvflow.worker.model_runner``; duck-typed:
            this package stands below the worker's) over its own KV cache of
            ``cache_config``'s blocks; its sampler's generator draws the drafts of requests
            without a seed. Built by ``ModelRunner.from_config``.
        vocab_size: the draft's vocabulary size (the target's).
        cache_config: its own KV block pool (prefix caching off).
        k: draft tokens per step.
        max_model_len: the context limit, in tokens: the target's or the draft's, whichever
            is shorter (no drafts for a request past the draft's positions).
    """

    def __init__(self, runner, vocab_size: int, cache_config: CacheConfig, k: int, max_model_len: int) -> None:
        self.k = k
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.kv = KVCacheManager(cache_config.num_blocks, cache_config.block_size, enable_prefix_caching=False)
        self.generator = runner.sampler.generator
        self.runner = runner
        self._seqs: dict[str, _DraftSequence] = {}
        self._runner_state = RunnerStateTracker()  # what self.runner holds
        self._dropped: list[str] = []  # to drop from self.runner at its next batch

    def _sync(self, request: Request) -> _DraftSequence:
        """The draft's copy of ``request``, rolled back to the tokens it shares with it."""
        seq = self._seqs.get(request.request_id)
        if seq is None:
            generator = None
            if request.seed is not None:  # the sample's own (seed + i), as its target generator
                generator = torch.Generator()
                generator.manual_seed(generator_seed(request.seed))
            seq = _DraftSequence(request.request_id, list(request.prompt_token_ids), list(request.all_token_ids),
                                 request.sampling_params, request.eos_token_id, request.bad_words_token_ids, generator)
            self._seqs[request.request_id] = seq
            return seq
        common = 0
        for a, b in zip(seq.all_token_ids, request.all_token_ids):
            if a != b:
                break
            common += 1
        if common < seq.num_tokens and self._runner_state.forget(seq.request_id):
            self._dropped.append(seq.request_id)  # rejected drafts: send it again from the common prefix
        seq.all_token_ids = list(request.all_token_ids)
        seq.num_computed_tokens = min(seq.num_computed_tokens, common, request.num_tokens - 1)
        seq.bad_words_token_ids = request.bad_words_token_ids
        self.kv.trim(seq)
        return seq

    @torch.inference_mode()
    def propose(self, requests: list[Request]) -> None:
        """Set ``spec_token_ids`` and ``spec_draft_probs`` (float32 [k, vocab]) of each request."""
        proposing: list[tuple[Request, _DraftSequence, int]] = []
        for request in requests:
            request.spec_token_ids, request.spec_draft_probs = [], None
            k = max_drafts(request, self.k, self.max_model_len)
            if k:
                proposing.append((request, self._sync(request), k))
        probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r, _, _ in proposing}
        active = list(proposing)
        runner = self.runner
        for step in range(self.k):
            out = SchedulerOutput(finished_req_ids=self._dropped)
            self._dropped = []
            for _, seq, _ in active:
                num_new = seq.num_tokens - seq.num_computed_tokens
                if self.kv.allocate_slots(seq, num_new):
                    out._add(seq.request_id, num_new)
                    self._runner_state.record(out, seq)
            if out.is_empty:
                self._dropped = out.finished_req_ids
                break
            runner.update_states(out)
            inputs = runner.prepare_inputs(out)
            hidden = runner.model(inputs.input_ids, inputs.positions, runner.cache_engine.kv_caches, inputs.metadata)
            logits = runner.model.compute_logits(hidden[inputs.logits_indices])
            dead: list[bool] = []
            q = processed_probs(logits, inputs.sampling_requests, self.vocab_size, dead)
            stopped: set[str] = set()
            for state, q_row, no_token in zip(inputs.sampling_requests, q, dead):
                seq = self._seqs[state.request_id]
                seq.num_computed_tokens += out.num_scheduled_tokens[seq.request_id]
                if no_token:  # its masks leave no token after these drafts: propose no more
                    stopped.add(seq.request_id)
                    continue
                gen = seq.generator or self.generator
                token = int(torch.multinomial(q_row.to(gen.device), 1, generator=gen))
                seq.all_token_ids.append(token)
                probs[seq.request_id].append(q_row)
            scheduled = set(out.num_scheduled_tokens) - stopped  # a request the draft pool could not hold stops here
            active = [(r, s, k) for r, s, k in active if r.request_id in scheduled and step + 1 < k]
        for request, seq, _ in proposing:
            drafts = seq.all_token_ids[request.num_tokens :]
            if drafts:
                request.spec_token_ids = drafts
                request.spec_draft_probs = torch.stack(probs[request.request_id][: len(drafts)])

    def free(self, request_id: str) -> None:
        """Drop the draft's state and blocks of a finished, aborted or preempted request."""
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.kv.free(seq)
        if self._runner_state.forget(request_id):
            self._dropped.append(request_id)

