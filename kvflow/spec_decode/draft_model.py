"""Draft-model proposer: a small model with its own paged KV cache proposes k tokens.

Each step the draft model first catches up on the request's tokens it has not seen (the
whole prompt the first time, then the tokens accepted since), then runs k - 1 single-token
steps; all requests are batched in each forward. The draft distribution q at every
position is computed with the request's own processing (penalties, temperature, top-k,
top-p, min-p), the same function as the target's p, and the draft token is sampled from it
(argmax for greedy requests). After verification the draft cache keeps only the tokens the
target accepted: its block table and computed count are rolled back to the common prefix.
"""

from __future__ import annotations

import torch

from kvflow.attention.backend import AttentionBackend
from kvflow.attention.torch_backend import TORCH_BACKEND
from kvflow.config import CacheConfig, ModelConfig
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.scheduler import SchedulerOutput
from kvflow.model.base import CausalLM
from kvflow.request import Request
from kvflow.sample.rejection_sampler import processed_probs
from kvflow.sample.sampler import Sampler
from kvflow.spec_decode.ngram import max_drafts
from kvflow.worker.cache_engine import CacheEngine
from kvflow.worker.model_runner import ModelRunner


class DraftModelProposer:
    """Proposes up to ``k`` tokens per request with a draft model.

    Args:
        model: the draft decoder (same vocabulary as the target).
        model_config: its architecture.
        cache_config: its own KV block pool (prefix caching off).
        k: draft tokens per step.
        max_model_len: the context limit, in tokens.
        device: where the draft runs.
        seed: seed of the generator for unseeded requests' draft sampling.
        attention_backend: the draft runner's attention backend (the engine's,
            ``kvflow.attention.selector``; default the PyTorch one).
    """

    def __init__(
        self,
        model: CausalLM,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        k: int,
        max_model_len: int,
        device: torch.device,
        seed: int = 0,
        attention_backend: AttentionBackend = TORCH_BACKEND,
    ) -> None:
        self.k = k
        self.max_model_len = max_model_len
        self.vocab_size = model_config.vocab_size
        self.kv = KVCacheManager(cache_config.num_blocks, cache_config.block_size, enable_prefix_caching=False)
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
        self.generator = generator
        self.runner = ModelRunner(model, CacheEngine(model.kv_cache_spec, cache_config, device), cache_config.block_size,
                                  Sampler(generator), device, attention_backend=attention_backend)
        self._shadows: dict[str, Request] = {}

    def _shadow(self, request: Request) -> Request:
        """The draft's copy of ``request``, rolled back to the tokens it shares with it."""
        shadow = self._shadows.get(request.request_id)
        if shadow is None:
            shadow = Request(request.request_id, request.prompt_token_ids, request.sampling_params, request.eos_token_id)
            self._shadows[request.request_id] = shadow
        common = 0
        for a, b in zip(shadow.all_token_ids, request.all_token_ids):
            if a != b:
                break
            common += 1
        shadow.all_token_ids = list(request.all_token_ids)
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, common, request.num_tokens - 1)
        shadow.bad_words_token_ids = request.bad_words_token_ids
        self.kv.trim(shadow)
        return shadow

    @torch.inference_mode()
    def propose(self, requests: list[Request]) -> None:
        """Set ``spec_token_ids`` and ``spec_draft_probs`` (float32 [k, vocab]) of each request."""
        proposing: list[tuple[Request, Request, int]] = []
        for request in requests:
            request.spec_token_ids, request.spec_draft_probs = [], None
            k = max_drafts(request, self.k, self.max_model_len)
            if k:
                proposing.append((request, self._shadow(request), k))
        probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r, _, _ in proposing}
        active = list(proposing)
        for step in range(self.k):
            out = SchedulerOutput()
            for _, shadow, _ in active:
                num_new = shadow.num_tokens - shadow.num_computed_tokens
                if self.kv.allocate_slots(shadow, num_new):
                    out._add(shadow, num_new)
            if out.is_empty:
                break
            inputs = self.runner.prepare_inputs(out)
            hidden = self.runner.model(inputs.input_ids, inputs.positions, self.runner.cache_engine.kv_caches, inputs.metadata)
            logits = self.runner.model.compute_logits(hidden[inputs.logits_indices])
            q = processed_probs(logits, inputs.sampling_requests, self.vocab_size)
            for shadow, q_row in zip(inputs.sampling_requests, q):
                shadow.num_computed_tokens += out.num_scheduled_tokens[shadow.request_id]
                gen = shadow.generator or self.generator
                token = int(torch.multinomial(q_row.to(gen.device), 1, generator=gen))
                shadow.all_token_ids.append(token)
                probs[shadow.request_id].append(q_row)
            scheduled = set(out.num_scheduled_tokens)  # a request the draft pool could not hold stops here
            active = [(r, s, k) for r, s, k in active if r.request_id in scheduled and step + 1 < k]
        for request, shadow, _ in proposing:
            drafts = shadow.all_token_ids[request.num_tokens :]
            if drafts:
                request.spec_token_ids = drafts
                request.spec_draft_probs = torch.stack(probs[request.request_id][: len(drafts)])

    def free(self, request_id: str) -> None:
        """Drop the draft's state and blocks of a finished, aborted or preempted request."""
        shadow = self._shadows.pop(request_id, None)
        if shadow is not None:
            self.kv.free(shadow)
