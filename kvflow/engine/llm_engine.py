"""The engine loop: add requests, step, read outputs.

``LLMEngine.step()`` runs the data flow of DESIGN.md once: schedule a batch, run the model on
it, append the sampled tokens, check stop conditions, free finished requests' blocks and
detokenize. ``LLM`` (offline) and the server drive this loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvflow.config import (
    CacheConfig,
    EngineArgs,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    resolve_dtype,
    resolve_kv_cache_dtype,
)
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.scheduler import Scheduler
from kvflow.distributed.worker import TPWorkers, torchrun_rank
from kvflow.engine.detokenizer import IncrementalDetokenizer
from kvflow.model.base import CausalLM
from kvflow.model.loader import load_model
from kvflow.model.resolve import load_tokenizer, resolve_model
from kvflow.outputs import CompletionOutput, RequestOutput
from kvflow.request import Request, RequestStatus, make_parallel_samples
from kvflow.sample.sampler import Sampler
from kvflow.sampling_params import SamplingParams
from kvflow.spec_decode.draft_model import DraftModelProposer
from kvflow.spec_decode.metrics import SpecDecodeStats
from kvflow.spec_decode.ngram import NgramProposer
from kvflow.worker.cache_engine import CacheEngine
from kvflow.worker.model_runner import ModelRunner
from kvflow.worker.worker import build_shard


def _has_tokenizer(model_dir) -> bool:
    """A folder without tokenizer files runs on token ids only (no text in or out)."""
    from pathlib import Path

    return any((Path(model_dir) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


@dataclass
class _RequestState:
    """Output state of one user request: its n samples and their detokenizers."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[Request]
    detokenizers: list[IncrementalDetokenizer | None]
    logprobs: list[list[dict[int, float]]]
    arrival_time: float
    first_scheduled_time: float | None = None
    prompt_logprobs: dict[int, dict[int, float]] = field(default_factory=dict)
    first_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return all(r.is_finished for r in self.samples)


class LLMEngine:
    """Owns the model, the KV cache, the scheduler and the per-request output state.

    Args:
        model: the decoder with loaded weights.
        model_config: its architecture facts.
        cache_config: KV block pool layout.
        scheduler_config: batching limits.
        tokenizer: a transformers tokenizer, or None to work on token ids only (no text).
        device: where the model and cache live.
        seed: seed of the engine generator for unseeded sampling.
        proposer: speculative decoding proposer, or None.
        tp_workers: the tensor-parallel workers (``model`` is then rank 0's shard).
        spec_disable_by_batch_size: no drafts in a step when at least this many requests are
            running (``speculative_config["disable_by_batch_size"]``), or None.
        attention_backend: "torch", "cpu" or "triton" (see ``EngineArgs.attention_backend``).
        cuda_graph_batch_sizes: capture decode CUDA graphs for these batch sizes (needs
            CUDA and the Triton backend), or None for none.
    """

    def __init__(
        self,
        model: CausalLM,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        tokenizer: Any | None,
        device: torch.device,
        seed: int = 0,
        proposer: NgramProposer | DraftModelProposer | None = None,
        tp_workers: TPWorkers | None = None,
        spec_disable_by_batch_size: int | None = None,
        attention_backend: str = "torch",
        cuda_graph_batch_sizes: list[int] | None = None,
    ) -> None:
        self.model_config = model_config
        self.tp_workers = tp_workers
        self.proposer = proposer
        self.spec_disable_by_batch_size = spec_disable_by_batch_size
        self.spec_stats = SpecDecodeStats(proposer.k if proposer is not None else 0)
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.tokenizer = tokenizer
        self.device = device
        self.kv_cache_manager = KVCacheManager(
            cache_config.num_blocks,
            cache_config.block_size,
            enable_prefix_caching=cache_config.enable_prefix_caching,
            hash_extra=str(cache_config.dtype).encode(),
            num_cpu_blocks=cache_config.num_cpu_blocks,
        )
        self.scheduler = Scheduler(scheduler_config, self.kv_cache_manager)
        self.cache_engine = CacheEngine(model.kv_cache_spec, cache_config, device)  # this rank's shard of heads
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
        self.model_runner = ModelRunner(
            model, self.cache_engine, cache_config.block_size, Sampler(generator), device,
            broadcast=tp_workers.broadcast if tp_workers is not None else None,
            attention_backend=attention_backend,
        )
        if cuda_graph_batch_sizes:
            if device.type != "cuda" or attention_backend != "triton":
                raise ValueError("cuda_graph_batch_sizes needs a CUDA device and attention_backend='triton'")
            if tp_workers is not None:  # the workers run eagerly: their collectives would not match
                raise ValueError("cuda_graph_batch_sizes cannot be used with tensor parallelism")
            from kvflow.worker.cuda_graph import DecodeGraphRunner

            self.model_runner.graph_runner = DecodeGraphRunner(
                model, self.cache_engine.kv_caches, -(-scheduler_config.max_model_len // cache_config.block_size),
                cuda_graph_batch_sizes, device,
            )
        self._states: dict[str, _RequestState] = {}  # by user request id
        self._sample_owner: dict[str, tuple[_RequestState, Request]] = {}  # by sample id
        self._grammar_compiler = None
        self.eos_token_id = model_config.eos_token_id
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_token_id = tokenizer.eos_token_id

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        """Load the model named by ``args.model`` and build the engine.

        Raises:
            ValueError: for invalid options or an unsupported model.
            FileNotFoundError: for a model path that does not exist.
        """
        args.verify()
        device = args.torch_device()
        if args.num_threads is not None and device.type == "cpu":
            torch.set_num_threads(args.num_threads)
        dtype = resolve_dtype(args.dtype, device)
        model_dir = resolve_model(args.model, cache_dir=args.model_cache_dir)
        tp_workers = None
        if args.tensor_parallel_size > 1:
            tp_workers = TPWorkers(args.tensor_parallel_size, args, spawn=torchrun_rank() is None)
            try:
                model, model_config, cache_config = build_shard(args, model_dir, 0)
            except BaseException:
                tp_workers.shutdown()
                raise
        else:
            model, model_config = load_model(model_dir, dtype, device, args.quantization, args.quantization_group_size,
                                             quantize_lm_head=args.quantize_lm_head, max_model_len=args.max_model_len)
        spec = SpeculativeConfig.from_dict(args.speculative_config) if args.speculative_config is not None else None
        draft = draft_config = None
        if spec is not None and spec.method == "draft_model":
            draft_dir = resolve_model(spec.model, cache_dir=args.model_cache_dir)
            draft, draft_config = load_model(draft_dir, dtype, device, spec.quantization, args.quantization_group_size)
            if draft_config.vocab_size != model_config.vocab_size:
                raise ValueError(
                    f"speculative_config.model has vocab_size {draft_config.vocab_size}, the target "
                    f"{model_config.vocab_size}: the draft must share the target's vocabulary"
                )
        if tp_workers is None:
            # The draft's cache has as many blocks as the target's (it mirrors every request),
            # and both come out of the one KV budget. (Under tensor parallelism the workers
            # size their shards on their own: the draft cache on rank 0 comes on top.)
            kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, dtype, device)
            extra = draft_config.kv_bytes_per_token(kv_dtype) if draft_config is not None else 0
            cache_config = args.cache_config(model_config.kv_cache_spec(), dtype, extra_bytes_per_token=extra)
        scheduler_config = args.scheduler_config(model_config)
        backend = args.resolved_attention_backend()
        graph_sizes = None
        if device.type == "cuda" and backend == "triton" and not args.enforce_eager and tp_workers is None:
            from kvflow.worker.cuda_graph import default_batch_sizes

            graph_sizes = default_batch_sizes(scheduler_config.max_num_seqs)
        proposer = None
        if spec is not None:
            k, max_len = spec.num_speculative_tokens, scheduler_config.max_model_len
            if spec.method == "ngram":
                proposer = NgramProposer(k, spec.prompt_lookup_min, spec.prompt_lookup_max, max_len)
            else:
                draft_cache = CacheConfig(
                    cache_config.block_size, cache_config.num_blocks, cache_config.dtype, enable_prefix_caching=False
                )
                proposer = DraftModelProposer(draft, draft_config, draft_cache, k, max_len, device, args.seed,
                                              attention_backend=backend)
        return cls(
            model=model,
            model_config=model_config,
            cache_config=cache_config,
            scheduler_config=scheduler_config,
            tokenizer=load_tokenizer(model_dir) if _has_tokenizer(model_dir) else None,
            device=device,
            seed=args.seed,
            proposer=proposer,
            tp_workers=tp_workers,
            spec_disable_by_batch_size=spec.disable_by_batch_size if spec is not None else None,
            attention_backend=backend,
            cuda_graph_batch_sizes=graph_sizes,
        )

    def shutdown(self) -> None:
        """Stop tensor-parallel workers (a no-op without them)."""
        if self.tp_workers is not None:
            self.tp_workers.shutdown()

    # ------------------------------------------------------------------ requests
    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Refuse a request the engine could never serve.

        Raises:
            ValueError: empty prompt, token id outside the vocabulary, prompt that leaves no
                room in the context (``max_model_len``), or a request whose tokens
                could never fit in the whole KV cache.
        """
        if len(prompt_token_ids) == 0:
            raise ValueError("prompt must not be empty")
        vocab = self.model_config.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in prompt_token_ids):
            raise ValueError(f"prompt_token_ids must be integers in [0, {vocab})")
        max_len = self.scheduler_config.max_model_len
        if len(prompt_token_ids) >= max_len:
            raise ValueError(
                f"prompt is {len(prompt_token_ids)} tokens; it must be shorter than "
                f"max_model_len={max_len} to leave room for output"
            )
        if params.n > self.scheduler_config.max_num_seqs:
            raise ValueError(f"n={params.n} exceeds max_num_seqs={self.scheduler_config.max_num_seqs}")
        needed_tokens = min(len(prompt_token_ids) + params.max_tokens, max_len)
        needed_blocks = self.kv_cache_manager.num_blocks_for(needed_tokens)
        if needed_blocks > self.kv_cache_manager.num_total_blocks:
            raise ValueError(
                f"prompt + max_tokens = {needed_tokens} tokens need {needed_blocks} KV blocks, "
                f"more than the whole cache ({self.kv_cache_manager.num_total_blocks} blocks); "
                "lower max_tokens or raise num_kv_blocks / kv_cache_memory_bytes"
            )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        priority: int = 0,
    ) -> None:
        """Validate and queue a request (``params.n`` samples sharing the prompt's blocks).

        ``priority`` matters under the "priority" scheduling policy (lower runs first).

        Raises:
            ValueError: see ``validate_prompt``; or a request_id already in use.
        """
        self.validate_prompt(prompt_token_ids, params)
        if request_id in self._states:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.check_request_features(params)
        samples = make_parallel_samples(request_id, prompt_token_ids, params, self.eos_token_id, prompt, priority)
        bad_words = self._bad_words_token_ids(params.bad_words)
        for sample in samples:
            sample.bad_words_token_ids = bad_words
            sample.grammar = self._compile_grammar(params)
        self.scheduler.add_request(samples[0])
        detoks = [
            IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, params.skip_special_tokens, params.stop, params.include_stop_str_in_output
            )
            if self.tokenizer is not None
            else None
            for _ in samples
        ]
        state = _RequestState(
            request_id, prompt, list(prompt_token_ids), samples, detoks, [[] for _ in samples], samples[0].arrival_time
        )
        self._states[request_id] = state
        for sample in samples:
            self._sample_owner[sample.request_id] = (state, sample)

    def check_request_features(self, params: SamplingParams) -> None:
        """Check the text-level features of ``params`` against this engine.

        Raises:
            ValueError: stop strings, bad words or guided decoding without a tokenizer, or a
                ``guided_json`` / ``guided_regex`` the grammar engine rejects.
        """
        guided = params.guided_json is not None or params.guided_regex is not None
        if (params.stop or params.bad_words or guided) and self.tokenizer is None:
            raise ValueError("stop, bad_words and guided decoding need a tokenizer")
        self._compile_grammar(params)

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Token sequences of each bad word, as written and with a leading space (as vLLM)."""
        sequences = []
        for word in words:
            for variant in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(variant, add_special_tokens=False)
                if ids and ids not in sequences:
                    sequences.append(ids)
        return sequences

    def _compile_grammar(self, params: SamplingParams):
        if params.guided_json is None and params.guided_regex is None:
            return None
        if self._grammar_compiler is None:
            from kvflow.sample.guided import GrammarCompiler

            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.eos_token_id)
        return self._grammar_compiler.compile(params)

    def abort_request(self, request_id: str) -> bool:
        """Abort a request (all its samples) and free its KV blocks at once.

        Returns:
            False for an unknown or already finished id.
        """
        state = self._states.pop(request_id, None)
        if state is None:
            return False
        for sample in state.samples:
            self._sample_owner.pop(sample.request_id, None)
            self.scheduler.abort_request(sample.request_id)
            if self.proposer is not None:
                self.proposer.free(sample.request_id)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """Run one iteration.

        Returns:
            A ``RequestOutput`` for every request that produced a token this step
            (cumulative text and token ids; ``finished`` set on the last one).
        """
        sched_out = self.scheduler.schedule()
        if sched_out.is_empty:
            return []
        scheduled_time = time.monotonic()
        for request in sched_out.scheduled_requests:
            owner = self._sample_owner[request.request_id][0]
            if owner.first_scheduled_time is None:
                owner.first_scheduled_time = scheduled_time
        result = self.model_runner.execute(sched_out)
        self.scheduler.update(sched_out, result.sampled_token_ids)
        now = time.monotonic()
        touched: dict[str, _RequestState] = {}
        for sample_id, positions in result.prompt_logprobs.items():
            self._sample_owner[sample_id][0].prompt_logprobs.update(positions)
        for sample_id, tokens in result.sampled_token_ids.items():
            state, sample = self._sample_owner[sample_id]
            index = state.samples.index(sample)
            if sample_id in result.logprobs:  # tokens may have been cut by a stop (speculation)
                state.logprobs[index].extend(result.logprobs[sample_id][: len(tokens)])
            detok = state.detokenizers[index]
            if detok is not None:
                stop = detok.update(tokens, finished=sample.is_finished)
                if stop is not None:
                    self.scheduler.finish_request(sample_id)
                    sample.status = RequestStatus.FINISHED_STOPPED
                    sample.stop_reason = stop
            if sample.is_finished:
                del self._sample_owner[sample_id]
            touched[state.request_id] = state
        outputs = []
        for state in touched.values():
            if state.first_token_time is None:
                state.first_token_time = now
            outputs.append(self._make_output(state, now))
            if state.finished:
                del self._states[state.request_id]
        if self.proposer is not None:
            self.spec_stats.record(result.num_accepted.values())
            self._propose(sched_out)
        return outputs

    def _propose(self, sched_out) -> None:
        """Draft the next tokens of every decoding request; drop the proposer's state of
        requests that left the running set."""
        for request in sched_out.preempted_requests:
            self.proposer.free(request.request_id)
        running = {r.request_id for r in self.scheduler.running}
        for request in sched_out.scheduled_requests:
            if request.request_id not in running:
                self.proposer.free(request.request_id)
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
            return
        self.proposer.propose(ready)

    def _make_output(self, state: _RequestState, now: float) -> RequestOutput:
        params = state.samples[0].sampling_params
        wants_logprobs = params.logprobs is not None
        metrics = {
            "arrival_time": state.arrival_time,
            "first_scheduled_time": state.first_scheduled_time,
            "first_token_time": state.first_token_time,
        }
        if state.finished:
            metrics["finished_time"] = now
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    index=i,
                    text=detok.text if detok is not None else "",
                    token_ids=sample.output_token_ids,
                    finish_reason=sample.status.finish_reason,
                    stop_reason=sample.stop_reason,
                    logprobs=logprobs if wants_logprobs else None,
                    cumulative_logprob=(
                        sum(lp[t] for lp, t in zip(logprobs, sample.output_token_ids)) if wants_logprobs else None
                    ),
                )
                for i, (sample, detok, logprobs) in enumerate(zip(state.samples, state.detokenizers, state.logprobs))
            ],
            finished=state.finished,
            metrics=metrics,
            prompt_logprobs=(
                [state.prompt_logprobs[i] for i in range(1, len(state.prompt_token_ids))]
                if state.finished and params.prompt_logprobs is not None
                else None
            ),
        )

    def get_stats(self) -> dict[str, float | int]:
        """Engine counters.

        Keys: num_total_blocks, num_free_blocks, kv_cache_usage (0-1), fragmentation
        (allocated slots not holding a token / allocated slots), prefix_cache_queries and
        prefix_cache_hits (tokens), num_cached_blocks, num_preemptions, num_running,
        num_waiting; with speculative decoding also the ``SpecDecodeStats`` counters.
        """
        kv = self.kv_cache_manager
        return {
            "num_total_blocks": kv.num_total_blocks,
            "num_free_blocks": kv.num_free_blocks,
            "kv_cache_usage": kv.usage(),
            "fragmentation": kv.fragmentation(self.scheduler.running),
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
            "num_cached_blocks": kv.block_pool.num_cached_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_swapped_out": self.scheduler.num_swapped_out,
            **self.spec_stats.as_dict(),
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
        }
