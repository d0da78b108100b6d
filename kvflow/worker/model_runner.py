"""Keeps the batch's per-request state, turns a ``SchedulerOutput`` into model inputs, runs
the model and samples.

The runner receives data, not the scheduler's requests (``kvflow/core/sched_output.py``):
``update_states`` writes each new request into a row of the persistent ``InputBatch``
(``kvflow/worker/input_batch.py``: token ids, computed counts, one block table per KV cache
group, sampling parameters, as preallocated arrays), applies each step's diff (appended
tokens, block-table change, computed count) to its row and drops finished and preempted
requests; ``prepare_inputs`` computes positions, input ids, slot mappings and the attention
layout of the whole batch with a few vectorized operations over those rows (as vLLM v1's
``GPUModelRunner`` over its ``InputBatch``, ``vllm/v1/worker/gpu_input_batch.py``). A
``CachedRequestState`` per row keeps the Python-side handles the sampler, the logits
processors and the logprobs read.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvflow.attention.backend import AttentionBackend, AttentionMetadata, BatchLayout, HybridMetadata
from kvflow.attention.cache_engine import CacheEngine
from kvflow.attention.cuda_graph import DecodeGraphRunner, default_batch_sizes
from kvflow.attention.torch_backend import TORCH_BACKEND
from kvflow.config import EngineConfig
from kvflow.core.sched_output import NewRequestData, SchedulerOutput
from kvflow.distributed.parallel_state import TensorParallel
from kvflow.layers.invariant_linear import make_batch_invariant
from kvflow.logprobs import Logprob
from kvflow.model.base import CausalLM
from kvflow.model.loader import build_model
from kvflow.sampling_params import SamplingParams
from kvflow.sample.logits_processor import apply_logits_processors
from kvflow.sample.rejection_sampler import RejectionSampler
from kvflow.sample.sampler import Sampler, SamplingTensors, row_argmax
from kvflow.spec_decode.proposer import build_proposer
from kvflow.worker.input_batch import InputBatch

if TYPE_CHECKING:
    from kvflow.sample.guided import GrammarMatcher

logger = logging.getLogger(__name__)


@dataclass
class CachedRequestState:
    """The Python side of one request's row in the runner's ``InputBatch``, built from its
    ``NewRequestData`` and kept up to date by the step diffs (its block tables live in the
    batch only). It has the attributes of a ``Request`` that the logits processors, the
    samplers and the rejection sampler read.

    Attributes:
        request_id: the (sample) id.
        prompt_token_ids: the prompt.
        all_token_ids: prompt followed by the generated tokens the runner was sent.
        sampling_params: its parameters.
        eos_token_id: EOS id for ``min_tokens``, or None.
        bad_words_token_ids: token sequences of the bad words.
        num_computed_tokens: tokens whose K/V are in the cache.
        generator: its own seeded generator, or None (the engine's).
        grammar: its structured-output matcher, or None.
        spec_token_ids: the draft tokens verified this step.
        spec_draft_probs: their draft distribution (float32 [k, vocab]), or None.
        pooling_params: an embedding request's ``PoolingParams`` (it never samples), or None.
        pooled_sum: mean pooling's running sum of its final hidden states (float32
            [hidden_size]) over the tokens computed so far, or None.
        lora_request: its LoRA adapter, or None.
    """

    request_id: str
    prompt_token_ids: list[int]
    all_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    bad_words_token_ids: list[list[int]]
    num_computed_tokens: int
    generator: torch.Generator | None = None
    grammar: "GrammarMatcher | None" = None
    spec_token_ids: list[int] = field(default_factory=list)
    spec_draft_probs: torch.Tensor | None = None
    pooling_params: Any = None
    pooled_sum: torch.Tensor | None = None
    lora_request: Any = None

    @classmethod
    def from_new(cls, data: NewRequestData) -> "CachedRequestState":
        return cls(data.request_id, data.prompt_token_ids, [*data.prompt_token_ids, *data.output_token_ids],
                   data.sampling_params, data.eos_token_id, data.bad_words_token_ids, data.num_computed_tokens,
                   data.generator, data.grammar, pooling_params=data.pooling_params, pooled_sum=data.pooled_sum,
                   lora_request=data.lora_request)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens


@dataclass
class ModelInputs:
    """Flat inputs of one step.

    Attributes:
        input_ids: int64 [T].
        positions: int64 [T].
        metadata: slot mapping and attention groups.
        logits_indices: int64 [N]; the token whose hidden state yields each sampling row.
        sampling_requests: the states of the N requests that sample a token this step.
        prompt_logprob_rows: (state, flat token index, prompt position) for every prompt
            token whose successor's log-probability a ``prompt_logprobs`` request needs.
        spec_requests: (state, draft tokens) of the requests verifying drafts; their
            ``len(drafts) + 1`` logits rows follow the N sampling rows in ``logits_indices``.
        pooling_rows: (state, flat index of its first token this step, tokens this step)
            of the embedding requests (they never sample).
        lora: the LoRA adapter slot of each token (``kvflow.lora.punica.LoRAMapping``), or
            None when no request of the step has an adapter.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_indices: torch.Tensor
    sampling_requests: list[CachedRequestState]
    prompt_logprob_rows: list[tuple[CachedRequestState, int, int]]
    spec_requests: list[tuple[CachedRequestState, list[int]]]
    pooling_rows: list[tuple[CachedRequestState, int, int]] = field(default_factory=list)
    lora: Any = None


class ModelRunner:
    """Executes one scheduled batch on the model and its paged KV cache.

    Args:
        model: the decoder.
        cache_engine: the KV tensors.
        block_size: tokens per block.
        sampler: the token sampler.
        device: where inputs are built.
        is_driver: False on a tensor-parallel worker: it runs the same forward and logits
            collectives as the driver but samples nothing.
        broadcast: on a tensor-parallel driver, sends each step's batch to the workers.
        attention_backend: the paged-attention backend (``kvflow.attention.selector``); one
            that asks for batch-invariant linears (over a quantized cache) needs a model whose
            dense CPU linears were switched (``ModelRunner.from_config`` does it).
        lora_manager: the model's LoRA adapters (``kvflow.lora.manager.LoRAManager``), or
            None without ``enable_lora``.
        max_num_seqs, max_model_len: the ``InputBatch``'s first allocation (rows, token
            columns); it grows past them when needed.
    """

    def __init__(
        self,
        model: CausalLM,
        cache_engine: CacheEngine,
        block_size: int,
        sampler: Sampler,
        device: torch.device,
        is_driver: bool = True,
        broadcast=None,
        attention_backend: AttentionBackend = TORCH_BACKEND,
        lora_manager=None,
        max_num_seqs: int = 16,
        max_model_len: int = 256,
    ) -> None:
        if not isinstance(attention_backend, AttentionBackend):
            raise ValueError(f"attention_backend must be an AttentionBackend (kvflow.attention.selector), "
                             f"got {attention_backend!r}")
        self.attention_backend = attention_backend
        self.lora_manager = lora_manager
        self.graph_runner = None  # a DecodeGraphRunner (kvflow.attention.cuda_graph) when set
        self.is_driver = is_driver
        self.broadcast = broadcast
        self.model = model
        self.cache_engine = cache_engine
        self.block_size = block_size
        self.sampler = sampler
        self.rejection_sampler = RejectionSampler(sampler.generator)
        self.device = device
        # KV cache groups: 1, or a hybrid cache's
        groups = getattr(cache_engine, "groups", None)
        self.num_kv_cache_groups = groups.num_groups if groups is not None else 1
        self._layer_group = _layer_group(groups) if self.num_kv_cache_groups > 1 else None
        self.input_batch = InputBatch(self.num_kv_cache_groups, max_num_seqs, max_model_len, block_size)
        self.drafter = None  # the speculative proposer (driver only), set by from_config

    @classmethod
    def from_config(cls, config: EngineConfig, attention_backend: AttentionBackend, *, rank: int = 0,
                    is_driver: bool = True, broadcast=None, use_cuda_graphs: bool = False, model=None,
                    proposer=None) -> "ModelRunner":
        """A runner built from the whole ``EngineConfig``, the one way every runner of an
        engine is made (the driver's, a tensor-parallel rank's, a draft model's; after vLLM
        v1's ``GPUModelRunner``, which loads its own model, KV cache and drafter). In order:

        1. ``load_model``: this rank's shard (``kvflow.model.loader.build_model``, loaded as
           ``config.load`` resolved it; the whole model without tensor parallelism), its LoRA
           slots (``config.lora``), and, when the backend asks for batch-invariant linears
           (over a quantized KV cache), the model's dense CPU linears switched in place
           (``kvflow.layers.invariant_linear.make_batch_invariant``) so that a token's stored
           K/V never depends on how its step was batched or chunked;
        2. its KV cache: ``config.cache``'s blocks for this rank's KV heads (``CacheEngine``);
        3. the runner, its sampler's generator seeded with ``config.seed``;
        4. the decode CUDA graphs (``use_cuda_graphs``);
        5. on the driver, its drafter (``config.speculative``, chosen by
           ``kvflow.spec_decode.proposer.build_proposer``): n-gram prompt lookup, or a draft
           model with a runner of its own built by this method from the draft's
           ``EngineConfig`` (``config.draft``, resolved up front with the target's).

        Args:
            config: the engine's ``EngineConfig`` (or the draft's).
            attention_backend: the backend (``Platform.select_attention_backend``).
            rank: this tensor-parallel rank (0: the driver).
            is_driver, broadcast: as ``ModelRunner``; a worker rank has no drafter.
            use_cuda_graphs: capture decode graphs (``Platform.use_cuda_graphs``).
            model: a loaded model to run instead of loading ``config.load`` (tests).
            proposer: a speculative proposer instead of ``config.speculative``'s (tests).

        Raises:
            ValueError: a model or draft that cannot be loaded as configured (``build_model``).
        """
        device = config.device.device
        lora_manager = None
        if model is None:
            model = cls.load_model(config, rank)
        if config.lora is not None:
            from kvflow.lora.manager import LoRAManager

            lora = config.lora
            lora_manager = LoRAManager(model, lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras)
        if attention_backend.needs_batch_invariant_linears:
            make_batch_invariant(model)  # (CUDA linears stay; idempotent)
        cache = CacheEngine(model.kv_cache_spec, config.cache, device)  # this rank's shard of heads
        generator = torch.Generator(device=device)
        generator.manual_seed(config.seed)
        runner = cls(model, cache, config.cache.block_size, Sampler(generator), device, is_driver=is_driver,
                     broadcast=broadcast, attention_backend=attention_backend, lora_manager=lora_manager)
        if use_cuda_graphs:
            runner.graph_runner = DecodeGraphRunner(
                model, cache.kv_caches, -(-config.scheduler.max_model_len // config.cache.block_size),
                default_batch_sizes(config.scheduler.max_num_seqs), device, attention_backend,
            )
        if proposer is None and is_driver and config.speculative is not None:
            # A draft model's runner is built the same way, from the draft's own config.
            draft_runner = cls.from_config(config.draft, attention_backend) if config.draft is not None else None
            proposer = build_proposer(config, draft_runner)
        runner.drafter = proposer
        return runner

    @staticmethod
    def load_model(config: EngineConfig, rank: int = 0) -> CausalLM:
        """Rank ``rank``'s model shard (the whole model without tensor parallelism), loaded as
        ``config.load`` resolved it.

        Raises:
            ValueError: see ``kvflow.model.loader.build_model``.
        """
        world = config.parallel.tensor_parallel_size
        tp = TensorParallel(rank, world) if world > 1 else None
        return build_model(config.model, config.load, config.device.dtype, config.device.device, tp)

    @property
    def requests(self) -> Mapping[str, CachedRequestState]:
        """request_id -> the state of each request the runner holds (a read-only view of the
        ``InputBatch``'s rows)."""
        return _StatesView(self.input_batch)

    def _group_block_ids(self, block_ids) -> tuple[list[int], ...]:
        """Block ids per KV cache group: a tuple of per-group lists is taken as it is (the
        scheduler's form, one list per group); a flat list of a G-group cache is its logical
        blocks' ids interleaved (entry ``i * G + g`` is logical block i of group g)."""
        if isinstance(block_ids, tuple):
            return block_ids
        num_groups = self.num_kv_cache_groups
        if num_groups == 1:
            return (block_ids,)
        return tuple(block_ids[g::num_groups] for g in range(num_groups))

    def update_states(self, out: SchedulerOutput) -> None:
        """Apply a step's state changes to the ``InputBatch``: drop the finished and
        preempted requests (the last rows move into their places), add the new ones as
        rows, write the diffs of the held ones into their rows (``execute`` calls it
        first). A request that finishes in a step is dropped at the next step (its id comes
        in that step's ``finished_req_ids``), as in vLLM; a held request that is not
        scheduled in a step keeps its row until it is.

        Raises:
            KeyError: a diff for a request the runner does not hold (a broken contract).
        """
        batch = self.input_batch
        for request_id in (*out.finished_req_ids, *out.preempted_req_ids):
            batch.remove_request(request_id)
        for data in out.scheduled_new_reqs:
            batch.remove_request(data.request_id)  # (a resumed request the runner was never told to drop)
            batch.add_request(CachedRequestState.from_new(data), self._group_block_ids(data.block_ids))
        cached = out.scheduled_cached_reqs
        index = batch.req_id_to_index
        if cached.request_ids:
            # The tokens and computed counts of every held request in a few array writes.
            num = len(cached.request_ids)
            rows = np.fromiter((index[request_id] for request_id in cached.request_ids), dtype=np.int64, count=num)
            batch.append_tokens_batch(rows, cached.new_token_ids)
            batch.num_computed_tokens[rows] = cached.num_computed_tokens
            states = batch.states
            for row, new_tokens, computed in zip(rows.tolist(), cached.new_token_ids, cached.num_computed_tokens):
                state = states[row]
                state.all_token_ids.extend(new_tokens)
                state.num_computed_tokens = computed
            for i, (new_blocks, replace) in enumerate(zip(cached.new_block_ids, cached.replace_block_ids)):
                if replace or (any(map(len, new_blocks)) if isinstance(new_blocks, tuple) else new_blocks):
                    row = int(rows[i])
                    for g, ids in enumerate(self._group_block_ids(new_blocks)):
                        batch.set_block_ids(row, g, ids, replace)
        for request_id, drafts in out.scheduled_spec_tokens.items():
            state = batch.states[index[request_id]]
            state.spec_token_ids = drafts
            state.spec_draft_probs = out.spec_draft_probs.get(request_id)

    def prepare_inputs(self, out: SchedulerOutput) -> ModelInputs:
        """Flatten the batch (from the ``InputBatch``'s rows, after ``update_states``):
        decodes (one new token) first, in the backend's decode groups, then prefill chunks.

        Each request contributes tokens ``all_token_ids[num_computed : num_computed + n]`` at
        positions ``num_computed .. num_computed + n - 1`` (its drafts last, for a request
        verifying drafts); a request samples only when its chunk reaches ``num_tokens``.
        Positions, input ids, slot mappings, context lengths and block tables are gathered
        for the whole batch at once from the rows (numpy indexing; no per-request tensor
        op). With G > 1 KV cache groups the metadata is a ``HybridMetadata``: one backend
        metadata per group, over that group's block tables.
        """
        batch = self.input_batch
        n_sched = out.num_scheduled_tokens
        index = batch.req_id_to_index
        num = len(n_sched)
        rows = np.fromiter((index[request_id] for request_id in n_sched), dtype=np.int64, count=num)
        q_all = np.fromiter(n_sched.values(), dtype=np.int64, count=num)
        bs = self.block_size
        backend = self.attention_backend
        computed_all = batch.num_computed_tokens[rows]
        dec = np.flatnonzero(q_all == 1)
        pre = np.flatnonzero(q_all > 1)
        # The backend orders the decodes (a padding-bound one groups them by context length).
        parts, group_sizes = [], []
        for group in backend.decode_groups((-(-(computed_all[dec] + 1) // bs)).tolist(), bs):
            if group:
                parts.append(dec[np.asarray(group, dtype=np.int64)])
                group_sizes.append(len(group))
        if len(pre):
            parts.append(pre)
            group_sizes.append(len(pre))
        order = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        rows = rows[order]
        q_lens = q_all[order]
        begins = computed_all[order]
        ends = begins + q_lens
        token_rows, positions, starts = batch.token_positions(rows, q_lens)
        if len(ends) and int(ends.max()) > batch.token_ids.shape[1]:
            batch._ensure_tokens(int(ends.max()))  # (draft positions past the known tokens)
        input_ids = batch.token_ids[token_rows, positions]
        states = batch.states
        ordered = [states[r] for r in rows.tolist()]
        spec = out.scheduled_spec_tokens
        prompt_logprob_rows: list[tuple[CachedRequestState, int, int]] = []
        spec_requests: list[tuple[CachedRequestState, list[int]]] = []
        pooling_rows: list[tuple[CachedRequestState, int, int]] = []
        special = bool(spec) or (batch.num_special_reqs > 0 and any(
            r.pooling_params is not None or r.sampling_params.prompt_logprobs is not None for r in ordered))
        if not special:  # the common step: a row samples when its chunk reaches its known tokens
            samples = np.flatnonzero(ends == batch.num_tokens[rows])
            logits_indices: list[int] = (starts[1:][samples] - 1).tolist()
            sampling_requests = [ordered[i] for i in samples.tolist()]
            spec_indices: list[int] = []
        else:
            logits_indices, sampling_requests, spec_indices = [], [], []
            num_tokens = batch.num_tokens[rows].tolist()
            for i, (r, begin, n, start) in enumerate(zip(ordered, begins.tolist(), q_lens.tolist(),
                                                         starts[:-1].tolist())):
                end = start + n
                if r.sampling_params.prompt_logprobs is not None:
                    prompt_logprob_rows.extend(
                        (r, start + p - begin, p) for p in range(begin, min(begin + n, r.num_prompt_tokens - 1))
                    )
                drafts = spec.get(r.request_id, [])
                if drafts:
                    input_ids[end - len(drafts) : end] = drafts
                if r.pooling_params is not None:  # an embedding: pooled, never sampled
                    pooling_rows.append((r, start, n))
                elif drafts:
                    spec_requests.append((r, drafts))
                    spec_indices.extend(range(end - len(drafts) - 1, end))
                elif begin + n == num_tokens[i]:
                    logits_indices.append(end - 1)
                    sampling_requests.append(r)
        for child_id, parent_id in out.forked:  # parallel samples draw from their parent's logits (no drafts yet)
            parent_row = next(i for i, r in enumerate(sampling_requests) if r.request_id == parent_id)
            logits_indices.append(logits_indices[parent_row])
            sampling_requests.append(states[index[child_id]])
        logits_indices.extend(spec_indices)
        dev = self.device
        q_t, ctx_t = torch.from_numpy(q_lens), torch.from_numpy(ends)
        prompt_lens = torch.from_numpy(np.clip(batch.num_prompt_tokens[rows] - begins, 0, q_lens))
        layouts = []
        for g in range(self.num_kv_cache_groups):
            slots = torch.from_numpy(batch.slot_mapping(g, token_rows, positions)).to(dev)
            table, lens = batch.padded_block_tables(g, rows)
            layouts.append(BatchLayout(slots, q_t, ctx_t, table, group_sizes, bs, dev, block_table_lens=lens,
                                       prompt_lens=prompt_lens))
        if self.num_kv_cache_groups == 1:
            metadata = backend.build_metadata(layouts[0])
        else:
            metadata = HybridMetadata([backend.build_metadata(layout) for layout in layouts], self._layer_group)
        lora = None
        if self.lora_manager is not None:
            lora = self.lora_manager.mapping([(r.lora_request, n) for r, n in zip(ordered, q_lens.tolist())])
        return ModelInputs(
            input_ids=torch.from_numpy(input_ids).to(dev),
            positions=torch.from_numpy(positions).to(dev),
            metadata=metadata,
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=dev),
            sampling_requests=sampling_requests,
            prompt_logprob_rows=prompt_logprob_rows,
            spec_requests=spec_requests,
            pooling_rows=pooling_rows,
            lora=lora,
        )

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Apply the step's state changes (``update_states``, after broadcasting the step to
        tensor-parallel workers), run the model on the batch and sample.

        Fault isolation: when preparing the inputs, the forward or the logits of the batch
        raise, the batch runs again one request at a time (each with the parallel samples
        it forks this step). That is safe because re-writing the same tokens' K/V into the
        same slots is idempotent, the scheduler has not advanced yet, and the generators
        are first restored to their state before the step (so a seeded request that
        succeeds alone samples what it would have sampled in the batch). The requests that
        still raise are reported in ``failed`` instead of in ``sampled_token_ids``; so is a
        request whose sampling raises (the batch's rows are then sampled one by one). Under
        tensor parallelism the forward is not re-run, since the workers' collectives follow
        the driver's batch: a forward fault there propagates.

        Returns:
            The sampled token of every request whose chunk reached the end of its known
            tokens, log-probabilities for those that asked for them, and the failed ones.

        Raises:
            Exception: a fault in the block copies (swap and copy-on-write: the cache is then
                in an unknown state), or a forward fault under tensor parallelism.
        """
        if self.broadcast is not None:
            self.broadcast(out)
        self.update_states(out)
        # Order matters: swapped-out blocks may be reused by swap-ins and copies this step.
        if out.blocks_to_swap_out:
            self.cache_engine.swap_out(out.blocks_to_swap_out)
        if out.blocks_to_swap_in:
            self.cache_engine.swap_in(out.blocks_to_swap_in)
        if out.blocks_to_copy:
            self.cache_engine.copy_blocks(out.blocks_to_copy)
        # (a tensor-parallel worker samples nothing: no generator to restore)
        rng = self._generator_states(out) if self.is_driver else []
        try:
            result = self._run(out, rng)
        except Exception as exc:  # noqa: BLE001 - isolated below, or re-raised
            if self.broadcast is not None or not self.is_driver:
                raise
            logger.warning("a batch of %d requests failed (%s: %s); running them one at a time",
                           len(out.num_scheduled_tokens), type(exc).__name__, exc)
            result = self._run_one_by_one(out, rng)
        # Mean pooling's running sums are kept only now: a batch re-run one request at a
        # time must not add a chunk twice. (They stay in ``result.pooled_sums`` too: the
        # engine keeps them on the request, so that a request resumed after a swap
        # preemption comes back with its sum in its ``NewRequestData``.)
        for request_id, pooled_sum in result.pooled_sums.items():
            self.requests[request_id].pooled_sum = pooled_sum
        return result

    def _run_one_by_one(self, out: SchedulerOutput, rng: list[tuple[torch.Generator, torch.Tensor]]) -> ModelRunnerOutput:
        """``execute`` without block copies, for one request (and its forks) at a time."""
        _restore(rng)
        result = ModelRunnerOutput()
        for request_id in out.num_scheduled_tokens:
            sub = out.subset(request_id)
            try:
                part = self._run(sub, rng)
            except Exception as exc:  # noqa: BLE001 - this request's fault, reported
                logger.warning("request %s failed: %s: %s", request_id, type(exc).__name__, exc, exc_info=exc)
                for r in (request_id, *(child for child, _ in sub.forked)):
                    result.failed[r] = exc
                continue
            result.merge(part)
        return result

    def _run(self, out: SchedulerOutput, rng: list[tuple[torch.Generator, torch.Tensor]]) -> ModelRunnerOutput:
        inputs = self.prepare_inputs(out)
        if inputs.lora is not None:  # (eager: the captured graphs have no LoRA deltas)
            hidden = self.model(inputs.input_ids, inputs.positions, self.cache_engine.layer_kv_caches, inputs.metadata,
                                lora=inputs.lora)
        elif self.graph_runner is not None and self.graph_runner.can_run(inputs):
            hidden = self.graph_runner.run(inputs)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, self.cache_engine.layer_kv_caches, inputs.metadata)
        result = ModelRunnerOutput()
        if inputs.pooling_rows and self.is_driver:
            self._pool(hidden, inputs.pooling_rows, result)
        if inputs.prompt_logprob_rows:
            prompt_logprobs = self._prompt_logprobs(hidden, inputs.prompt_logprob_rows)
            if self.is_driver:
                result.prompt_logprobs = prompt_logprobs
        if not inputs.sampling_requests and not inputs.spec_requests:
            return result
        all_logits = self.model.compute_logits(hidden[inputs.logits_indices])
        if not self.is_driver:
            return result
        num_plain = len(inputs.sampling_requests)
        # (request, its raw logits rows, its emitted tokens) for logprobs
        emitted: list[tuple[CachedRequestState, torch.Tensor, list[int]]] = []
        if num_plain:
            logits = all_logits[:num_plain]
            try:
                tokens = self._sample(logits, inputs.sampling_requests)
            except Exception as exc:  # noqa: BLE001 - one row's fault: sample the rows alone
                logger.warning("sampling a batch of %d rows failed (%s: %s); sampling them one at a time",
                               num_plain, type(exc).__name__, exc)
                _restore(rng)
                tokens = []
                for i, r in enumerate(inputs.sampling_requests):
                    try:
                        tokens.append(self._sample(logits[i : i + 1], [r])[0])
                    except Exception as row_exc:  # noqa: BLE001 - reported
                        logger.warning("sampling request %s failed: %s: %s", r.request_id, type(row_exc).__name__,
                                       row_exc, exc_info=row_exc)
                        result.failed[r.request_id] = row_exc
                        tokens.append(None)
            sampled = result.sampled_token_ids
            for i, (r, t) in enumerate(zip(inputs.sampling_requests, tokens)):
                if t is not None:
                    sampled[r.request_id] = [t]
                    if r.sampling_params.logprobs is not None:  # (no tensor slice per row otherwise)
                        emitted.append((r, logits[i : i + 1], [t]))
        row = num_plain
        for r, drafts in inputs.spec_requests:
            rows = all_logits[row : row + len(drafts) + 1]
            row += len(drafts) + 1
            try:
                tokens = self.rejection_sampler(r, drafts, rows)
            except Exception as exc:  # noqa: BLE001 - reported
                logger.warning("verifying the drafts of request %s failed: %s: %s", r.request_id,
                               type(exc).__name__, exc, exc_info=exc)
                result.failed[r.request_id] = exc
                continue
            result.sampled_token_ids[r.request_id] = tokens
            result.num_accepted[r.request_id] = (len(drafts), len(tokens) - 1)
            if r.sampling_params.logprobs is not None:
                emitted.append((r, rows[: len(tokens)], tokens))
        for r, rows, tokens in emitted:
            k = r.sampling_params.logprobs
            if k is not None:
                try:
                    result.logprobs[r.request_id] = compute_logprobs(
                        rows, torch.tensor(tokens, device=rows.device), [k] * len(tokens)
                    )
                except Exception as exc:  # noqa: BLE001 - reported
                    logger.warning("logprobs of request %s failed: %s: %s", r.request_id, type(exc).__name__, exc,
                                   exc_info=exc)
                    result.failed[r.request_id] = exc
                    del result.sampled_token_ids[r.request_id]
                    result.num_accepted.pop(r.request_id, None)
        return result

    def _sample(self, logits: torch.Tensor, requests: list[CachedRequestState]) -> list[int]:
        """One token per row of ``logits`` (float32 [N, vocab_size]) for the N ``requests``.

        The rows' settings come from the ``InputBatch``'s arrays: only a batch holding a row
        with a logits processor goes through ``apply_logits_processors``, and a batch of
        greedy rows takes ``row_argmax`` directly (what ``Sampler`` returns for it)."""
        batch = self.input_batch
        index = batch.req_id_to_index
        rows = np.fromiter((index[r.request_id] for r in requests), dtype=np.int64, count=len(requests))
        if batch.needs_logits_processing[rows].any():
            logits = apply_logits_processors(logits, requests, fail_when_all_masked=True)
        if not batch.temperature[rows].any():
            return row_argmax(logits).tolist()
        return self.sampler(logits, self._sampling_tensors(requests, logits.shape[-1], rows)).tolist()

    def _sampling_tensors(self, requests: list[CachedRequestState], vocab_size: int,
                          rows: np.ndarray | None = None) -> SamplingTensors:
        """The rows' sampling settings, gathered from the ``InputBatch``'s parameter arrays
        (written once when each request joined) instead of rebuilt from its parameters;
        ``rows``: the requests' rows in the batch, when the caller has them."""
        batch = self.input_batch
        if rows is None:
            index = batch.req_id_to_index
            rows = np.fromiter((index[r.request_id] for r in requests), dtype=np.int64, count=len(requests))
        top_k = torch.from_numpy(batch.top_k[rows])
        dev = self.device
        return SamplingTensors(
            temperature=torch.from_numpy(batch.temperature[rows]).to(dev),
            top_k=torch.where((top_k > 0) & (top_k < vocab_size), top_k, vocab_size).to(dev),
            top_p=torch.from_numpy(batch.top_p[rows]).to(dev),
            min_p=torch.from_numpy(batch.min_p[rows]).to(dev),
            generators=[r.generator for r in requests],
        )

    def _generator_states(self, out: SchedulerOutput) -> list[tuple[torch.Generator, torch.Tensor]]:
        """The state of every generator this step's batch (``out``'s scheduled and forked
        requests) may draw from: the engine's, and the seeded requests' own."""
        if not self.input_batch.num_generator_reqs:  # (no request of the batch has its own)
            g = self.sampler.generator
            return [(g, g.get_state())] if g is not None else []
        requests = (self.requests[request_id] for request_id in
                    (*out.num_scheduled_tokens, *(child for child, _ in out.forked)))
        generators = {id(g): g for g in (self.sampler.generator, *(r.generator for r in requests)) if g is not None}
        return [(g, g.get_state()) for g in generators.values()]

    @staticmethod
    def _pool(hidden: torch.Tensor, rows: list[tuple[CachedRequestState, int, int]], result: "ModelRunnerOutput") -> None:
        """Pool the embedding requests' final hidden states (``kvflow.pooling_params``).

        Last-token pooling reads the prompt's last hidden state when the step computes it.
        Mean pooling adds the step's states (in float32) to the request's running sum (a
        first chunk starts it afresh, so a request preempted by recompute starts over) and
        divides by the prompt length at the end. Results go to ``result.pooled`` (the
        un-normalized vector, float32 [hidden_size], once the prompt is complete) and
        ``result.pooled_sums`` (the new sums, kept by ``execute``).
        """
        for r, start, n in rows:
            begin = r.num_computed_tokens
            done = begin + n >= r.num_tokens
            if r.pooling_params.pooling_type == "mean":
                chunk = hidden[start : start + n].float().sum(dim=0)
                if begin > 0:
                    if r.pooled_sum is None:
                        raise RuntimeError(f"request {r.request_id}: mean pooling lost the sum of its first "
                                           f"{begin} tokens")
                    chunk = r.pooled_sum + chunk
                if done:
                    result.pooled[r.request_id] = chunk / r.num_tokens
                else:
                    result.pooled_sums[r.request_id] = chunk
            elif done:
                result.pooled[r.request_id] = hidden[start + n - 1].float().clone()

    def _prompt_logprobs(
        self, hidden: torch.Tensor, rows: list[tuple[CachedRequestState, int, int]]
    ) -> dict[str, dict[int, dict[int, Logprob]]]:
        index = torch.tensor([i for _, i, _ in rows], device=hidden.device)
        logits = self.model.compute_logits(hidden[index])
        targets = torch.tensor([r.all_token_ids[p + 1] for r, _, p in rows], device=hidden.device)
        entries = compute_logprobs(logits, targets, [r.sampling_params.prompt_logprobs for r, _, _ in rows])
        out: dict[str, dict[int, dict[int, Logprob]]] = {}
        for (r, _, p), entry in zip(rows, entries):
            out.setdefault(r.request_id, {})[p + 1] = entry
        return out


@dataclass
class ModelRunnerOutput:
    """Result of one step.

    Attributes:
        sampled_token_ids: request_id -> new token ids (one, or accepted drafts plus one).
        logprobs: request_id -> per new token, {token id: log-probability} holding the
            sampled token and the ``logprobs`` most likely tokens, for requests that set
            ``logprobs``.
        num_accepted: request_id -> (drafts verified, drafts accepted), for speculation.
        prompt_logprobs: request_id -> {prompt position: {token id: log-probability}} for
            the prompt tokens computed this step (positions >= 1), for requests that set
            ``prompt_logprobs``.
        failed: request_id -> the exception of each request that failed this step (it has
            no entry in the fields above; see ``ModelRunner.execute``).
        pooled: request_id -> the pooled final hidden state (float32 [hidden_size], not
            normalized), for the embedding requests whose prompt completed this step.
        pooled_sums: request_id -> the new running sum (float32 [hidden_size]) of a mean
            pooling request whose prompt is not complete yet (``execute`` moves it onto the
            request).
    """

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[dict[int, Logprob]]] = field(default_factory=dict)
    num_accepted: dict[str, tuple[int, int]] = field(default_factory=dict)
    prompt_logprobs: dict[str, dict[int, dict[int, Logprob]]] = field(default_factory=dict)
    failed: dict[str, BaseException] = field(default_factory=dict)
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)
    pooled_sums: dict[str, torch.Tensor] = field(default_factory=dict)

    def merge(self, other: "ModelRunnerOutput") -> None:
        """Add another (disjoint) batch's results."""
        self.pooled.update(other.pooled)
        self.pooled_sums.update(other.pooled_sums)
        self.sampled_token_ids.update(other.sampled_token_ids)
        self.logprobs.update(other.logprobs)
        self.num_accepted.update(other.num_accepted)
        self.prompt_logprobs.update(other.prompt_logprobs)
        self.failed.update(other.failed)


def _layer_group(groups) -> tuple[int, ...]:
    """Each decoder layer's KV cache group: ``groups.layer_group``, or from each group's
    ``layer_ids`` (a group spec per group, in ``groups.groups`` or iterating ``groups``)."""
    layer_group = getattr(groups, "layer_group", None)
    if layer_group is not None:
        return tuple(layer_group)
    specs = list(getattr(groups, "groups", groups))
    owner = {layer: g for g, spec in enumerate(specs) for layer in spec.layer_ids}
    return tuple(owner[layer] for layer in range(len(owner)))


class _StatesView(Mapping):
    """request_id -> ``CachedRequestState`` over an ``InputBatch`` (read-only)."""

    def __init__(self, batch: InputBatch) -> None:
        self._batch = batch

    def __getitem__(self, request_id: str) -> CachedRequestState:
        return self._batch.states[self._batch.req_id_to_index[request_id]]

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._batch.req_ids))

    def __len__(self) -> int:
        return self._batch.num_reqs

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._batch.req_id_to_index


def _restore(states: list[tuple[torch.Generator, torch.Tensor]]) -> None:
    for generator, state in states:
        generator.set_state(state)


def compute_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top_k: list[int]) -> list[dict[int, Logprob]]:
    """Log-probabilities of the raw model distribution (before temperature and filtering).

    Args:
        logits: float32 [N, vocab_size] raw logits.
        tokens: int64 [N] the sampled tokens.
        top_k: per row, how many of the most likely tokens to report (0: only the sampled one).

    Returns:
        Per row, {token id: ``Logprob``}: the sampled token first (its rank: the number of
        tokens at least as likely), then the top ``top_k`` (ranks 1..k), in vLLM's order;
        without ``decoded_token`` (the engine adds it).
    """
    logprobs = torch.log_softmax(logits, dim=-1)
    k_max = max(top_k)
    top_vals, top_ids = logprobs.topk(k_max, dim=-1) if k_max > 0 else (None, None)
    sampled_t = logprobs.gather(1, tokens.view(-1, 1))
    ranks = (logprobs >= sampled_t).sum(dim=-1).tolist()
    sampled = sampled_t.squeeze(1).tolist()
    entries = []
    for row, k in enumerate(top_k):
        # As vLLM: the sampled (or actual prompt) token first, then the top k in rank order;
        # a sampled token among the top k keeps its place first and takes its top-k rank.
        entry = {int(tokens[row]): Logprob(sampled[row], ranks[row])}
        if k > 0:
            for i, (t, v) in enumerate(zip(top_ids[row, :k].tolist(), top_vals[row, :k].tolist())):
                entry[t] = Logprob(v, i + 1)
        entries.append(entry)
    return entries
