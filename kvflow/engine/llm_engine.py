"""The engine loop: add requests, step, read outputs.

``LLMEngine.step()`` runs the data flow of DESIGN.md once: schedule a batch, run the model on
it, append the sampled tokens, check stop conditions, free finished requests' blocks and
detokenize. ``LLM`` (offline) and the server drive this loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvflow.config import CacheConfig, EngineArgs, EngineConfig
from kvflow.cpu_threads import ThreadGovernor, check_wait_policy, thread_governor
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.scheduler import NewRequestData, Scheduler, SchedulerOutput
from kvflow.distributed.worker import TPWorkers, torchrun_rank
from kvflow.engine.detokenizer import IncrementalDetokenizer
from kvflow.logprobs import Logprob
from kvflow.model.base import CausalLM
from kvflow.model.loader import load_model
from kvflow.model.resolve import load_generation_defaults, load_tokenizer
from kvflow.ops import publish_background_builds
from kvflow.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, RequestFailure, RequestOutput
from kvflow.pooling_params import PoolingParams
from kvflow.request import Request, RequestStatus, make_parallel_samples
from kvflow.sample.sampler import Sampler
from kvflow.sampling_params import SamplingParams
from kvflow.spec_decode.draft_model import DraftModelProposer
from kvflow.spec_decode.metrics import SpecDecodeStats
from kvflow.spec_decode.ngram import NgramProposer
from kvflow.worker.cache_engine import CacheEngine
from kvflow.worker.model_runner import ModelRunner
from kvflow.worker.worker import attention_backend_for, build_shard, start_cpu_kernel_builds

logger = logging.getLogger(__name__)

# The ``sampling_params`` of an embedding request: it never samples (``Request.pooling_params``).
_POOLING_PLACEHOLDER = SamplingParams(max_tokens=1)


def _make_proposer(config: EngineConfig, backend) -> NgramProposer | DraftModelProposer:
    """The speculative proposer of ``config.speculative``: n-gram prompt lookup, or a draft
    model (loaded from ``config.draft``) with its own KV cache of as many blocks as the
    target's (prefix caching off)."""
    spec, max_len = config.speculative, config.scheduler.max_model_len
    k = spec.num_speculative_tokens
    if spec.method == "ngram":
        return NgramProposer(k, spec.prompt_lookup_min, spec.prompt_lookup_max, max_len)
    device = config.device
    draft, draft_config = load_model(config.draft.model_dir, device.dtype, device.device, config.draft.quantization,
                                     config.draft.group_size, model_config=config.draft_model)
    cache = config.cache
    draft_cache = CacheConfig(cache.block_size, cache.num_blocks, cache.dtype, enable_prefix_caching=False)
    return DraftModelProposer(draft, draft_config, draft_cache, k, max_len, device.device, config.seed,
                              attention_backend=backend)


def _has_tokenizer(model_dir) -> bool:
    """A folder without tokenizer files runs on token ids only (no text in or out)."""
    from pathlib import Path

    return any((Path(model_dir) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


@dataclass
class PreparedRequest:
    """A validated request with its engine-independent work done (``prepare_request``).

    Attributes:
        prompt_token_ids: the prompt.
        params: its sampling parameters.
        bad_words_token_ids: token sequences of ``params.bad_words``.
        grammars: one compiled ``GrammarMatcher`` (or None) per sample.
        lora_request: its LoRA adapter (checked), or None.
    """

    prompt_token_ids: list[int]
    params: SamplingParams
    bad_words_token_ids: list[list[int]]
    grammars: list[Any]
    lora_request: Any = None


@dataclass
class _RequestState:
    """Output state of one user request: its n samples and their detokenizers."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[Request]
    detokenizers: list[IncrementalDetokenizer | None]
    logprobs: list[list[dict[int, Logprob]]]
    arrival_time: float
    first_scheduled_time: float | None = None
    prompt_logprobs: dict[int, dict[int, Logprob]] = field(default_factory=dict)
    first_token_time: float | None = None
    embedding: list[float] | None = None  # an embedding request's vector, once computed

    @property
    def is_pooling(self) -> bool:
        return self.samples[0].pooling_params is not None

    @property
    def finished(self) -> bool:
        return all(r.is_finished for r in self.samples)


class LLMEngine:
    """Owns the model, the KV cache, the scheduler and the per-request output state.

    Args:
        config: everything the engine is built from (``EngineArgs.create_config()``).
        model: the decoder with loaded weights; None loads it from ``config.load`` (this
            rank's shard, with the tensor-parallel workers started first).
        tokenizer: a transformers tokenizer, or None to work on token ids only (no text).
        generation_defaults: ``SamplingParams`` field -> value, the model's own sampling
            defaults (its ``generation_config.json``; see ``load_generation_defaults``), for
            requests that leave a field unset.
        proposer: the speculative proposer; None builds the one ``config.speculative``
            names (a draft model is loaded from ``config.draft``).
        default_pooling: the pooling of embedding requests that do not choose one ("last"
            or "mean"; see ``kvflow.pooling_params``).

    Raises:
        ValueError: for a model that cannot be loaded as configured, an attention backend
            that cannot run here (``kvflow.attention.selector``), or CUDA graphs where the
            backend has no graph-safe metadata.
    """

    def __init__(
        self,
        config: EngineConfig,
        model: CausalLM | None = None,
        tokenizer: Any | None = None,
        generation_defaults: dict[str, Any] | None = None,
        proposer: NgramProposer | DraftModelProposer | None = None,
        default_pooling: str = "last",
    ) -> None:
        self.config = config
        self.default_pooling = PoolingParams(pooling_type=default_pooling).pooling_type
        device = config.device.device
        self.device = device
        self.model_config = config.model
        self.cache_config = config.cache
        self.scheduler_config = config.scheduler
        # C++ CPU kernels not built yet build in the background while PyTorch's paths serve;
        # step() switches to each between two steps (never inside one).
        self.kernel_builds = start_cpu_kernel_builds(config)
        # Fits the CPU thread count to the free cores between steps (kvflow.cpu_threads). Not
        # with tensor parallelism: the ranks share the machine's cores and each would count
        # the others as load.
        self.thread_governor: ThreadGovernor | None = None
        if config.device.device.type == "cpu" and config.parallel.tensor_parallel_size == 1:
            self.thread_governor = thread_governor(config.device.num_threads or torch.get_num_threads(),
                                                   explicit=config.device.num_threads is not None)
        backend = attention_backend_for(config)
        self.tp_workers = None
        if model is None:
            if config.parallel.tensor_parallel_size > 1:
                self.tp_workers = TPWorkers(config, spawn=torchrun_rank() is None)
            try:
                model = build_shard(config, 0)
            except BaseException:
                self.shutdown()
                raise
        spec = config.speculative
        self.proposer = proposer if proposer is not None or spec is None else _make_proposer(config, backend)
        self.spec_disable_by_batch_size = spec.disable_by_batch_size if spec is not None else None
        self.spec_stats = SpecDecodeStats(self.proposer.k if self.proposer is not None else 0)
        self.tokenizer = tokenizer
        cache_config = config.cache
        # one table per KV cache group (one group: windowed when every layer is)
        self.kv_cache_manager = KVCacheManager.from_cache_config(cache_config, config.model.kv_free_window)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager)
        self.cache_engine = CacheEngine(model.kv_cache_spec, cache_config, device)  # this rank's shard of heads
        generator = torch.Generator(device=device)
        generator.manual_seed(config.seed)
        self.lora_manager = None
        if config.lora is not None:
            from kvflow.lora.manager import LoRAManager

            lora = config.lora
            self.lora_manager = LoRAManager(model, lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras)
        self.model_runner = ModelRunner(
            model, self.cache_engine, cache_config.block_size, Sampler(generator), device,
            broadcast=self.tp_workers.broadcast if self.tp_workers is not None else None,
            attention_backend=backend, lora_manager=self.lora_manager,
        )
        # Decode CUDA graphs: on CUDA, with a backend that has graph-safe metadata, without
        # tensor parallelism (the workers run eagerly: their collectives would not match).
        if device.type == "cuda" and backend.supports_cuda_graphs and not config.kernels.enforce_eager \
                and self.tp_workers is None and config.parallel.tensor_parallel_size == 1 \
                and cache_config.kv_cache_groups is None:  # (hybrid caches: eager, per-group metadata)
            from kvflow.worker.cuda_graph import DecodeGraphRunner, default_batch_sizes

            self.model_runner.graph_runner = DecodeGraphRunner(
                model, self.cache_engine.kv_caches, -(-config.scheduler.max_model_len // cache_config.block_size),
                default_batch_sizes(config.scheduler.max_num_seqs), device, backend,
            )
        self.last_scheduler_output: SchedulerOutput | None = None  # the batch of the step in progress / last run
        self._states: dict[str, _RequestState] = {}  # by user request id
        self._sample_owner: dict[str, tuple[_RequestState, Request]] = {}  # by sample id
        self._grammar_compiler = None
        self._grammar_lock = threading.Lock()
        self.generation_defaults = dict(generation_defaults or {})
        self._token_texts: dict[int, str] = {}  # token id -> decode([id]), for Logprob.decoded_token
        self.eos_token_id = config.model.eos_token_id
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_token_id = tokenizer.eos_token_id

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        """Load the model named by ``args.model`` and build the engine.

        Raises:
            ValueError: for invalid options or an unsupported model.
            FileNotFoundError: for a model path that does not exist.
        """
        config = args.create_config()
        if config.device.device.type == "cpu":
            check_wait_policy()  # (a hint when torch came first and the machine is busy)
            if config.device.num_threads is not None:
                torch.set_num_threads(config.device.num_threads)
        model_dir = config.load.model_dir
        return cls(
            config,
            tokenizer=load_tokenizer(model_dir) if _has_tokenizer(model_dir) else None,
            generation_defaults=load_generation_defaults(model_dir),
            default_pooling=args.pooling,
        )

    def default_sampling_params(self, **overrides: Any) -> SamplingParams:
        """``SamplingParams`` with the model's ``generation_defaults`` (then ``overrides``)
        in place of the built-in defaults."""
        return SamplingParams(**{**self.generation_defaults, **overrides})

    def shutdown(self) -> None:
        """Stop tensor-parallel workers (a no-op without them)."""
        if self.tp_workers is not None:
            self.tp_workers.shutdown()

    # ------------------------------------------------------------------ requests
    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams | PoolingParams) -> None:
        """Refuse a request the engine could never serve.

        Raises:
            ValueError: empty prompt, token id outside the vocabulary, prompt that leaves no
                room in the context (``max_model_len``), a request whose tokens could
                never fit in the whole KV cache, ``logit_bias`` token ids outside the
                vocabulary, or ``logprobs`` / ``prompt_logprobs`` above the vocabulary size.
                An embedding request (``PoolingParams``): empty prompt, ids outside the
                vocabulary, a prompt longer than ``max_model_len`` or the whole KV cache,
                ``dimensions`` other than the hidden size.
        """
        if len(prompt_token_ids) == 0:
            raise ValueError("prompt must not be empty")
        vocab = self.model_config.vocab_size
        if any((not isinstance(t, int)) or isinstance(t, bool) or t < 0 or t >= vocab for t in prompt_token_ids):
            raise ValueError(f"prompt_token_ids must be integers in [0, {vocab})")
        if isinstance(params, PoolingParams):
            self._validate_pooling(prompt_token_ids, params)
            return
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams or PoolingParams, got {type(params).__name__}")
        for name, ids in (("logit_bias", params.logit_bias or {}), ("stop_token_ids", params.stop_token_ids)):
            outside = sorted(t for t in ids if t >= vocab)
            if outside:
                raise ValueError(f"{name} has token ids outside the vocabulary [0, {vocab}): {outside[:5]}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > vocab:
                raise ValueError(f"{name} must be at most the vocabulary size {vocab}, got {value}")
        max_len = self.scheduler_config.max_model_len
        if len(prompt_token_ids) >= max_len:
            raise ValueError(
                f"prompt is {len(prompt_token_ids)} tokens; it must be shorter than "
                f"max_model_len={max_len} to leave room for output"
            )
        if params.n > self.scheduler_config.max_num_seqs:
            raise ValueError(f"n must be at most max_num_seqs={self.scheduler_config.max_num_seqs}, got {params.n}")
        needed_tokens = min(len(prompt_token_ids) + params.max_tokens, max_len)
        # (behind a sliding window a request holds only its window's blocks)
        needed_blocks = self.kv_cache_manager.max_blocks_held(needed_tokens,
                                                              self.scheduler_config.max_num_batched_tokens)
        if needed_blocks > self.kv_cache_manager.num_total_blocks:
            raise ValueError(
                f"prompt + max_tokens = {needed_tokens} tokens need {needed_blocks} KV blocks, "
                f"more than the whole cache ({self.kv_cache_manager.num_total_blocks} blocks); "
                "lower max_tokens or raise num_kv_blocks / kv_cache_memory_bytes"
            )

    def _validate_pooling(self, prompt_token_ids: list[int], params: PoolingParams) -> None:
        max_len = self.scheduler_config.max_model_len
        if len(prompt_token_ids) > max_len:
            raise ValueError(f"prompt is {len(prompt_token_ids)} tokens, more than max_model_len={max_len}")
        needed_blocks = self.kv_cache_manager.num_pages_for(len(prompt_token_ids))
        if needed_blocks > self.kv_cache_manager.num_total_blocks:
            raise ValueError(
                f"prompt is {len(prompt_token_ids)} tokens and needs {needed_blocks} KV blocks, more than the whole "
                f"cache ({self.kv_cache_manager.num_total_blocks} blocks); raise num_kv_blocks / kv_cache_memory_bytes"
            )
        hidden = self.model_config.hidden_size
        if params.dimensions is not None and params.dimensions != hidden:
            raise ValueError(f"dimensions ({params.dimensions}) is not supported: this model's embeddings have "
                             f"{hidden} dimensions and kvflow does no matryoshka truncation; leave it unset")

    def check_lora_request(self, lora_request) -> None:
        """Check that this engine can run ``lora_request`` (a ``LoRARequest`` or None), reading
        and validating its adapter into the CPU cache (thread-safe: the server calls it off the
        engine thread).

        Raises:
            ValueError: an adapter without ``enable_lora``; see ``LoRAManager.get`` (a
                missing folder, a rank above ``max_lora_rank``, a target module the model
                lacks, shapes that disagree with the base, naming the adapter and module).
        """
        if lora_request is None:
            return
        if self.lora_manager is None:
            raise ValueError(f"lora_request {getattr(lora_request, 'lora_name', lora_request)!r}: this engine "
                             "serves no LoRA adapters (start it with enable_lora=True)")
        self.lora_manager.get(lora_request)

    def add_lora(self, lora_request) -> bool:
        """Read and validate an adapter ahead of its requests (vLLM's ``add_lora``); True.

        Raises:
            ValueError: see ``check_lora_request``.
        """
        self.check_lora_request(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget adapter ``lora_int_id`` (its slot and host copy; vLLM's ``remove_lora``).
        Call it between steps (the server runs it on the engine thread). Its prefix-cache
        blocks stay keyed by (id, path) and are evicted as any others.

        Returns:
            False when no such adapter is loaded.

        Raises:
            ValueError: while an unfinished request uses it (naming it and how many do): an
                adapter in use is never pulled from under its requests.
        """
        if self.lora_manager is None:
            return False
        users = [r.request_id for r in self.scheduler.requests.values()
                 if r.lora_request is not None and r.lora_request.lora_int_id == lora_int_id]
        if users:
            name = self.lora_manager.known[lora_int_id].lora_name if lora_int_id in self.lora_manager.known else lora_int_id
            raise ValueError(f"LoRA adapter {name!r} is in use by {len(users)} unfinished request(s); unload it once "
                             "they finish")
        return self.lora_manager.remove(lora_int_id)

    def list_loras(self) -> set[int]:
        """Ids of the adapters read so far and not removed (vLLM's ``list_loras``)."""
        return set() if self.lora_manager is None else set(self.lora_manager.known)

    def prepare_request(self, prompt_token_ids: list[int], params: SamplingParams | PoolingParams,
                        lora_request=None) -> PreparedRequest:
        """Validate a request and do its engine-independent work: the bad words' token ids,
        one compiled grammar per sample, its LoRA adapter read and checked. It touches no
        engine state, so the server runs it on a worker thread while the engine thread steps.

        Raises:
            ValueError: see ``validate_prompt``, ``check_request_features`` and
                ``check_lora_request``.
        """
        self.check_lora_request(lora_request)
        self.validate_prompt(prompt_token_ids, params)
        if isinstance(params, PoolingParams):
            return PreparedRequest(list(prompt_token_ids), params.resolved(self.default_pooling), [], [None],
                                   lora_request)
        self._check_tokenizer_features(params)
        grammars = [self._compile_grammar(params) for _ in range(params.n)]  # the first one validates
        bad_words = self._bad_words_token_ids(params.bad_words)
        return PreparedRequest(list(prompt_token_ids), params, bad_words, grammars, lora_request)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams,
        prompt: str | None = None,
        priority: int = 0,
        prepared: PreparedRequest | None = None,
        lora_request=None,
    ) -> None:
        """Validate and queue a request (``params.n`` samples sharing the prompt's blocks),
        or, with ``PoolingParams``, an embedding request (see ``kvflow.pooling_params``).

        ``priority`` matters under the "priority" scheduling policy (lower runs first).
        ``prepared``: the result of ``prepare_request`` for these ids and params, when the
        caller did that work already. ``lora_request``: the ``kvflow.lora.request.LoRARequest``
        the request runs with (None: the base model).

        Raises:
            ValueError: see ``validate_prompt``; a request_id already in use; a priority
                other than 0 without the "priority" scheduling policy.
        """
        if request_id in self._states:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if priority != 0 and self.scheduler_config.policy != "priority":
            raise ValueError(f"priority={priority} needs the priority scheduling policy (scheduling_policy="
                             f"'priority'); this engine schedules {self.scheduler_config.policy!r}")
        if prepared is None:
            prepared = self.prepare_request(prompt_token_ids, params, lora_request)
        else:
            lora_request = lora_request if lora_request is not None else prepared.lora_request
            self.check_lora_request(lora_request)  # (cached by then: no file read)
        if isinstance(prepared.params, PoolingParams):
            self._add_pooling_request(request_id, prompt_token_ids, prepared.params, prompt, priority, lora_request)
            return
        samples = make_parallel_samples(request_id, prompt_token_ids, params, self.eos_token_id, prompt, priority,
                                        lora_request)
        for sample, grammar in zip(samples, prepared.grammars):
            sample.bad_words_token_ids = prepared.bad_words_token_ids
            sample.grammar = grammar
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

    def _add_pooling_request(self, request_id: str, prompt_token_ids: list[int], params: PoolingParams,
                             prompt: str | None, priority: int, lora_request=None) -> None:
        request = Request(request_id, prompt_token_ids, _POOLING_PLACEHOLDER, self.eos_token_id, prompt,
                          priority=priority, pooling_params=params, lora_request=lora_request)
        self.scheduler.add_request(request)
        state = _RequestState(request_id, prompt, list(prompt_token_ids), [request], [None], [[]], request.arrival_time)
        self._states[request_id] = state
        self._sample_owner[request_id] = (state, request)

    def check_request_features(self, params: SamplingParams) -> None:
        """Check the text-level features of ``params`` against this engine.

        Raises:
            ValueError: stop strings, bad words or guided decoding without a tokenizer, or a
                ``guided_json`` / ``guided_regex`` the grammar engine rejects.
        """
        self._check_tokenizer_features(params)
        self._compile_grammar(params)

    def _check_tokenizer_features(self, params: SamplingParams) -> None:
        if (params.stop or params.bad_words or params.guided_kind) and self.tokenizer is None:
            raise ValueError("stop, bad_words and guided decoding need a tokenizer")

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
        if params.guided_kind is None:
            return None
        with self._grammar_lock:  # built once, from whichever thread needs it first
            if self._grammar_compiler is None:
                from kvflow.sample.guided import GrammarCompiler

                self._grammar_compiler = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.eos_token_id)
        return self._grammar_compiler.compile(params)

    def reset_prefix_cache(self) -> bool:
        """Forget the cached K/V of every block no request holds, so that later requests
        recompute their prompts (vLLM's ``reset_prefix_cache``; e.g. after changing
        weights, or to measure cold prefill).

        Returns:
            True when nothing cached is left, False when running requests' blocks stay
            indexed.
        """
        return self.kv_cache_manager.reset_prefix_cache()

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
    def step(self, on_scheduled: Callable[[list[str]], None] | None = None) -> list[RequestOutput | EmbeddingRequestOutput]:
        """Run one iteration.

        Args:
            on_scheduled: called after scheduling, before the forward, with the ids of the
                requests scheduled for the first time (the server refreshes its gauges and
                its queue count there, so that they are right during a long step; the batch
                itself is ``last_scheduler_output`` then).

        A fault of one request fails that request alone: raised while preparing its inputs,
        in the forward of a batch containing it, while sampling it (``ModelRunner.execute``
        isolates those), or while its tokens are appended, detokenized or drafted. Its
        blocks are freed at once and its output comes back finished, with ``error`` set
        and finish_reason "error"; the other requests go on. When every request of the step
        failed, a one-token probe forward checks that the engine itself still works.

        Returns:
            A ``RequestOutput`` for every request that produced a token this step or failed
            (cumulative text and token ids; ``finished`` set on the last one), and an
            ``EmbeddingRequestOutput`` for every embedding request whose prompt was
            completed this step (or that failed).

        Raises:
            Exception: the engine cannot go on: a fault in the scheduler, in the KV block
                copies, in a tensor-parallel forward, or in the probe (RuntimeError).
        """
        if self.thread_governor is not None:  # between two steps, on the thread that runs the forwards
            threads = self.thread_governor.update()
            if torch.get_num_threads() != threads:  # (per OS thread under OpenMP)
                torch.set_num_threads(threads)
        if self.kernel_builds:  # between two steps: no forward of this engine is running
            publish_background_builds(self.kernel_builds)
            self.kernel_builds = [k for k in self.kernel_builds if k.pending()]
        sched_out = self.scheduler.schedule()
        if sched_out.is_empty:
            return []
        self.last_scheduler_output = sched_out
        scheduled_time = time.monotonic()
        started = []
        for request_id in sched_out.num_scheduled_tokens:
            owner = self._sample_owner[request_id][0]
            if owner.first_scheduled_time is None:
                owner.first_scheduled_time = scheduled_time
                started.append(owner.request_id)
        if on_scheduled is not None:
            on_scheduled(started)
        result = self.model_runner.execute(sched_out)
        failures: dict[str, BaseException] = {}  # by user request id
        failed_outputs: list[RequestOutput] = []
        if result.failed:
            for sample_id, exc in result.failed.items():
                failures.setdefault(self._sample_owner[sample_id][0].request_id, exc)
            everyone = all(self._sample_owner[request_id][0].request_id in failures
                           for request_id in sched_out.num_scheduled_tokens)
            self._drop_from_batch(sched_out, {s.request_id for rid in failures for s in self._states[rid].samples})
            failed_outputs = [self._fail(request_id, exc) for request_id, exc in failures.items()]
            if everyone:
                self._probe()
        errors: dict[str, BaseException] = {}
        # The scheduler appends the tokens one at a time and asks the detokenizer after each
        # (``_text_stop``), so a stop string ends a request at the token that completed it.
        self.scheduler.update(sched_out, result.sampled_token_ids, errors=errors, text_stop=self._text_stop)
        now = time.monotonic()
        touched: dict[str, _RequestState] = {}
        for sample_id, positions in result.prompt_logprobs.items():
            if sample_id in self._sample_owner:
                self._sample_owner[sample_id][0].prompt_logprobs.update(positions)
        for sample_id, pooled_sum in result.pooled_sums.items():  # mean pooling's sum so far, kept on
            if sample_id in self._sample_owner:                    # the request (a swap resumes from it)
                self._sample_owner[sample_id][1].pooled_sum = pooled_sum
        for sample_id, vector in result.pooled.items():  # embeddings whose prompt is done
            owner = self._sample_owner.pop(sample_id, None)
            if owner is None:  # its request failed above
                continue
            state, request = owner
            vector = torch.nn.functional.normalize(vector, dim=0) if request.pooling_params.l2_normalize else vector
            state.embedding = vector.tolist()
            touched[state.request_id] = state
        for sample_id, tokens in result.sampled_token_ids.items():
            owner = self._sample_owner.get(sample_id)
            if owner is None:  # its request failed above
                continue
            state, sample = owner
            if sample_id in errors:
                touched.pop(state.request_id, None)
                failed_outputs.append(self._fail(state.request_id, errors[sample_id]))
                continue
            try:
                self._append_output(state, sample, tokens, result.logprobs.get(sample_id))
            except Exception as exc:  # noqa: BLE001 - this request's fault
                touched.pop(state.request_id, None)
                failed_outputs.append(self._fail(state.request_id, exc))
                continue
            touched[state.request_id] = state
        for sample_id, exc in errors.items():  # failed without sampling a token
            if sample_id in self._sample_owner:
                state = self._sample_owner[sample_id][0]
                touched.pop(state.request_id, None)
                failed_outputs.append(self._fail(state.request_id, exc))
        outputs = []
        for state in touched.values():
            if state.request_id not in self._states:  # failed after it was touched
                continue
            if state.first_token_time is None and not state.is_pooling:
                state.first_token_time = now
            try:
                outputs.append(self._make_output(state, now))
            except Exception as exc:  # noqa: BLE001 - this request's fault
                failed_outputs.append(self._fail(state.request_id, exc))
                continue
            if state.finished:
                del self._states[state.request_id]
        if self.proposer is not None:
            self.spec_stats.record(result.num_accepted.values())
            failed_outputs.extend(self._fail(request_id, exc) for request_id, exc in self._propose(sched_out).items())
        return outputs + [out for out in failed_outputs if out is not None]

    def _text_stop(self, sample: Request) -> str | None:
        """Feed the sample's newest token to its detokenizer; the stop string the text
        completed with it, or None (also without a tokenizer). ``Scheduler.update``'s
        ``text_stop``."""
        state, _ = self._sample_owner[sample.request_id]
        detok = state.detokenizers[state.samples.index(sample)]
        if detok is None:
            return None
        return detok.update(sample.all_token_ids[-1:], finished=sample.is_finished)

    def _append_output(self, state: _RequestState, sample: Request, tokens: list[int],
                       logprobs: list[dict[int, Logprob]] | None) -> None:
        """Record a sample's new tokens' logprobs, with their decoded tokens (its text was
        detokenized, and stop strings matched, by ``_text_stop`` during ``Scheduler.update``)."""
        index = state.samples.index(sample)
        if logprobs is not None:  # tokens may have been cut by a stop (speculation)
            state.logprobs[index].extend(self._decoded(entry) for entry in logprobs[: len(tokens)])
        if sample.is_finished:
            del self._sample_owner[sample.request_id]

    def _decoded(self, entry: dict[int, Logprob]) -> dict[int, Logprob]:
        """``entry`` with every ``Logprob.decoded_token`` set (``tokenizer.decode([id])``,
        as vLLM; None without a tokenizer)."""
        if self.tokenizer is None:
            return entry
        texts = self._token_texts
        out = {}
        for token, logprob in entry.items():
            text = texts.get(token)
            if text is None:
                text = texts[token] = self.tokenizer.decode([token])
            out[token] = logprob.with_decoded_token(text)
        return out

    @staticmethod
    def _drop_from_batch(sched_out: SchedulerOutput, sample_ids: set[str]) -> None:
        """Take the samples ``sample_ids`` out of the executed batch, so that
        ``Scheduler.update`` neither advances them nor publishes their blocks."""
        for request_id in [r for r in sched_out.num_scheduled_tokens if r in sample_ids]:
            sched_out._remove(request_id)
            sched_out.scheduled_spec_tokens.pop(request_id, None)
        sched_out.forked = [(c, p) for c, p in sched_out.forked if c not in sample_ids and p not in sample_ids]

    def _fail(self, request_id: str, exc: BaseException) -> RequestOutput | None:
        """Abort a user request that failed inside the engine (freeing its blocks); its final
        output, with ``error`` set. None when it is already gone."""
        state = self._states.get(request_id)
        if state is None:
            return None
        failure = RequestFailure.from_exception(exc)
        logger.error("request %s failed and was aborted: %s", request_id, failure.message)
        self.abort_request(request_id)
        for sample in state.samples:
            sample.status = RequestStatus.FINISHED_ERROR
        now = time.monotonic()
        if state.is_pooling:
            return EmbeddingRequestOutput(
                request_id, EmbeddingOutput([]), state.prompt_token_ids, max(state.samples[0].num_cached_tokens, 0),
                True, state.prompt, {"arrival_time": state.arrival_time,
                                     "first_scheduled_time": state.first_scheduled_time, "finished_time": now},
                error=failure,
            )
        return RequestOutput(
            request_id=request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[
                CompletionOutput(index=i, text="", token_ids=sample.output_token_ids, finish_reason="error")
                for i, sample in enumerate(state.samples)
            ],
            finished=True,
            metrics={"arrival_time": state.arrival_time, "first_scheduled_time": state.first_scheduled_time,
                     "first_token_time": state.first_token_time, "finished_time": now},
            error=failure,
        )

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
            result = self.model_runner.execute(batch)
        finally:
            self.kv_cache_manager.free(probe)
            self.scheduler.release(probe.request_id)
        if result.failed:
            raise RuntimeError(
                "the engine is unusable: every request of a step failed, and so did a one-token probe forward"
            ) from result.failed[probe.request_id]

    def _propose(self, sched_out) -> dict[str, BaseException]:
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
                failures.setdefault(self._sample_owner[r.request_id][0].request_id, exc)
        return failures

    def _make_output(self, state: _RequestState, now: float) -> RequestOutput | EmbeddingRequestOutput:
        if state.is_pooling:
            request = state.samples[0]
            return EmbeddingRequestOutput(
                state.request_id, EmbeddingOutput(state.embedding), state.prompt_token_ids,
                max(request.num_cached_tokens, 0), True, state.prompt,
                {"arrival_time": state.arrival_time, "first_scheduled_time": state.first_scheduled_time,
                 "finished_time": now},
            )
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
            prompt_logprobs=(  # as vLLM: None for the first prompt token, which has no predecessor
                [None, *(self._decoded(state.prompt_logprobs[i]) for i in range(1, len(state.prompt_token_ids)))]
                if state.finished and params.prompt_logprobs is not None
                else None
            ),
            num_cached_tokens=max(state.samples[0].num_cached_tokens, 0),
        )

    def get_stats(self) -> dict[str, float | int]:
        """Engine counters.

        Keys: num_total_blocks, num_free_blocks, kv_cache_usage (0-1), fragmentation
        (allocated slots not holding a token / allocated slots), prefix_cache_queries and
        prefix_cache_hits (tokens), num_cached_blocks, num_preemptions, num_running,
        num_waiting, num_window_freed_blocks (blocks returned to the pool behind a sliding
        window as requests advanced, in all; 0 without a windowed layer, or with a hybrid
        model under ``disable_hybrid_kv_cache_manager``), num_kv_cache_groups (1, or the
        hybrid cache's groups; a block is then a page of ``group_size`` layers); with
        speculative decoding also the ``SpecDecodeStats`` counters; with a CPU thread
        governor (``kvflow.cpu_threads``) also num_cpu_threads (intra-op threads now),
        cpu_other_load (cores other processes wanted, last measurement) and
        num_cpu_thread_changes.
        """
        governor = self.thread_governor
        threads = {} if governor is None else {"num_cpu_threads": governor.threads, "cpu_other_load": governor.others,
                                               "num_cpu_thread_changes": governor.num_changes}
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
            **threads,
        }
