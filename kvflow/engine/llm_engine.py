"""The engine's public facade: add requests, step, read outputs (vLLM's ``LLMEngine``).

``LLMEngine`` joins four parts (see docs/architecture.md, "Engine joints"), built downhill
from the one ``EngineConfig`` (the engine builds the core, the core the worker, the worker
the platform and its runner):

- the ``Platform`` (``kvflow/platforms/``): dtype "auto", the attention backend's
  eligibility, C++ kernel builds and their publishing, the thread governor, CUDA-graph
  eligibility; resolved once by the worker, its chores run once between steps;
- the ``Worker`` (``kvflow/worker/worker.py``): the platform, tensor-parallel workers, and
  a ``ModelRunner`` built by ``ModelRunner.from_config`` (model, KV cache, CUDA graphs,
  speculative proposer);
- the ``EngineCore`` (``kvflow/engine/core.py``): builds the worker, then the scheduler +
  KV cache manager over it, at the token level (no tokenizer);
- the ``OutputProcessor`` (``kvflow/engine/output_processor.py``): text, stop strings,
  logprob decoding and ``RequestOutput``s.

``step()`` = ``EngineCore.step`` (schedule, run, append tokens) -> ``OutputProcessor.
process_outputs`` (text, stop strings) -> ``EngineCore.finish_requests`` (the stop-string
hits end their requests in the core before anything is scheduled again) ->
``EngineCore.propose`` (speculative drafts). The input side (validation, grammars, bad
words, LoRA checks) stays here. ``LLM`` (offline) and the server drive this loop.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvflow import envs
from kvflow.config import EngineConfig
from kvflow.engine.arg_utils import EngineArgs
from kvflow.engine.core import EngineCore
from kvflow.engine.output_processor import OutputProcessor
from kvflow.model.resolve import load_eos_token_ids, load_generation_defaults, load_tokenizer
from kvflow.outputs import EmbeddingRequestOutput, RequestOutput, RequestOutputKind
from kvflow.pooling_params import PoolingParams
from kvflow.request import Request, make_parallel_samples
from kvflow.sampling_params import SamplingParams, check_truncate_prompt_tokens
from kvflow.utils import hold_gc_freeze, release_gc_freeze, release_free_heap

logger = logging.getLogger(__name__)

# The ``sampling_params`` of an embedding request: it never samples (``Request.pooling_params``).
_POOLING_PLACEHOLDER = SamplingParams(max_tokens=1)


def _has_tokenizer(model_dir) -> bool:
    """A folder without tokenizer files runs on token ids only (no text in or out)."""
    from pathlib import Path

    return any((Path(model_dir) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def _load_tokenizer(model_dir):
    """``load_tokenizer``, then the parse's freed memory handed back to the OS (a 151k-token
    ``tokenizer.json`` leaves ~60 MB of it in the heap: ``release_free_heap``). On the
    ``kvflow-tokenizer`` thread, so the trim happens while the weights are still loading,
    before the start's peak."""
    tokenizer = load_tokenizer(model_dir)
    release_free_heap()
    return tokenizer


def default_output_kind(params: SamplingParams | PoolingParams) -> RequestOutputKind:
    """The ``RequestOutputKind`` of a request whose caller names none: its
    ``SamplingParams.output_kind`` (vLLM's rule); CUMULATIVE for an embedding request."""
    return params.output_kind if isinstance(params, SamplingParams) else RequestOutputKind.CUMULATIVE


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


def _delegate(part: str, name: str, doc: str) -> property:
    """A read-write attribute of the facade that lives on ``self.<part>``."""
    return property(lambda self: getattr(getattr(self, part), name),
                    lambda self, value: setattr(getattr(self, part), name, value), doc=doc)


class LLMEngine:
    """The public engine: a ``Worker``, an ``EngineCore`` over it and an ``OutputProcessor``.

    Args:
        config: everything the engine is built from (``EngineArgs.create_config()``).
        model: the decoder with loaded weights; None loads it from ``config.load`` (this
            rank's shard, with the tensor-parallel workers started first).
        tokenizer: a transformers tokenizer (or a ``Future`` of one, awaited once the worker
            is built), or None to work on token ids only (no text).
        generation_defaults: ``SamplingParams`` field -> value, the model's own sampling
            defaults (its ``generation_config.json``; see ``load_generation_defaults``), for
            requests that leave a field unset.
        proposer: the speculative proposer; None builds the one ``config.speculative``
            names (a draft model is loaded from ``config.draft``).
        default_pooling: the pooling of embedding requests that do not choose one ("last"
            or "mean"; see ``kvflow.pooling_params``).
        eos_token_ids: the model's end tokens (its ``generation_config.json``'s
            ``eos_token_id``; see ``load_eos_token_ids``): those other than the EOS join each
            request's ``stop_token_ids`` unless it ignores EOS, as vLLM does.

    Raises:
        ValueError: for a model that cannot be loaded as configured, an attention backend
            that cannot run here (``kvflow.attention.selector``), or CUDA graphs where the
            backend has no graph-safe metadata.
    """

    # The parts' state, read (and in tests replaced) through the facade as before the split.
    model_runner = _delegate("worker", "model_runner", "the ``ModelRunner`` (rank 0)")
    cache_engine = _delegate("worker", "cache_engine", "the per-layer K/V tensors (rank 0's shard)")
    lora_manager = _delegate("worker", "lora_manager", "LoRA slots and host cache, or None")
    tp_workers = _delegate("worker", "tp_workers", "the tensor-parallel worker processes, or None")
    kernel_builds = _delegate("platform", "kernel_builds", "C++ kernels building in the background")
    thread_governor = _delegate("platform", "thread_governor", "the CPU thread governor, or None")
    scheduler = _delegate("engine_core", "scheduler", "the ``Scheduler``")
    kv_cache_manager = _delegate("engine_core", "kv_cache_manager", "the block tables' owner")
    proposer = _delegate("engine_core", "proposer", "the speculative proposer, or None")
    spec_stats = _delegate("engine_core", "spec_stats", "speculative decoding counters")
    last_scheduler_output = _delegate("engine_core", "last_scheduler_output",
                                      "the batch of the step in progress / last run")

    def __init__(
        self,
        config: EngineConfig,
        model=None,
        tokenizer: Any | None = None,
        generation_defaults: dict[str, Any] | None = None,
        proposer=None,
        default_pooling: str = "last",
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self.config = config
        self.default_pooling = PoolingParams(pooling_type=default_pooling).pooling_type
        self.device = config.device.device
        self.model_config = config.model
        self.cache_config = config.cache
        self.scheduler_config = config.scheduler
        # Downhill: the core builds the worker side (platform, model, cache, runner, proposer,
        # tensor-parallel workers), then its scheduler.
        self.engine_core = EngineCore(config, model=model, proposer=proposer)
        self.worker = self.engine_core.worker
        self.platform = self.engine_core.platform
        if isinstance(tokenizer, Future):  # loaded on a thread while the weights loaded
            try:
                tokenizer = tokenizer.result()
            except BaseException:
                self.worker.shutdown()
                raise
        self.tokenizer = tokenizer
        self.eos_token_id = config.model.eos_token_id
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_token_id = tokenizer.eos_token_id
        self.output_processor = OutputProcessor(tokenizer, self.eos_token_id)
        self.extra_eos_token_ids = [i for i in dict.fromkeys(eos_token_ids) if i != self.eos_token_id]
        self._grammar_compiler = None
        self._grammar_lock = threading.Lock()
        self.generation_defaults = dict(generation_defaults or {})
        # While requests are in flight the heap is frozen (KVFLOW_GC_FREEZE; kvflow.utils.
        # hold_gc_freeze): the steps' full collections skip the startup heap.
        self._gc_freeze = bool(envs.read("KVFLOW_GC_FREEZE"))
        self._gc_held = False

    @property
    def _states(self):
        """The output state of the unfinished user requests, by id."""
        return self.output_processor.request_states

    @property
    def _sample_owner(self):
        return self.output_processor._sample_owner

    def _probe(self) -> None:
        self.engine_core._probe()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        """Load the model named by ``args.model`` and build the engine.

        Raises:
            ValueError: for invalid options or an unsupported model.
            FileNotFoundError: for a model path that does not exist.
        """
        config = args.create_config()
        model_dir = config.load.model_dir
        # The tokenizer (~1-2 s of parsing for a 151k-token vocabulary) loads on a second
        # thread while the model builds: most of the weight loading is C++ that releases the GIL.
        with ThreadPoolExecutor(1, thread_name_prefix="kvflow-tokenizer") as pool:
            tokenizer = pool.submit(_load_tokenizer, model_dir) if _has_tokenizer(model_dir) else None
            return cls(
                config,
                tokenizer=tokenizer,
                generation_defaults=load_generation_defaults(model_dir),
                default_pooling=args.pooling,
                eos_token_ids=load_eos_token_ids(model_dir),
            )

    def default_sampling_params(self, **overrides: Any) -> SamplingParams:
        """``SamplingParams`` with the model's ``generation_defaults`` (then ``overrides``)
        in place of the built-in defaults."""
        return SamplingParams(**{**self.generation_defaults, **overrides})

    def shutdown(self) -> None:
        """Stop tensor-parallel workers (a no-op without them); let go of the heap's freeze."""
        self.release_gc_hold()
        self.worker.shutdown()

    def release_gc_hold(self) -> None:
        """Let go of the heap's freeze (KVFLOW_GC_FREEZE) now, requests in flight or not: for
        an engine that stops stepping with requests left (``shutdown``, the server's engine
        thread once it exits). A request added later holds it again."""
        self._release_heap(force=True)

    def _hold_heap(self) -> None:
        """Freeze the heap for the requests now in flight (once per busy period)."""
        if self._gc_freeze and not self._gc_held:
            hold_gc_freeze()
            self._gc_held = True

    def _release_heap(self, force: bool = False) -> None:
        """Unfreeze the heap once no request is in flight (or at once with ``force``)."""
        if self._gc_held and (force or not self.output_processor.request_states):
            self._gc_held = False
            release_gc_freeze()

    # ------------------------------------------------------------------ requests
    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams | PoolingParams) -> None:
        """Refuse a request the engine could never serve.

        Raises:
            ValueError: empty prompt, token id outside the vocabulary, a SamplingParams field
                set after construction to an invalid value (``SamplingParams.verify``), prompt that leaves no
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
        params.verify()  # (a field set after construction was never checked)
        for name, ids in (("logit_bias", params.logit_bias or {}), ("stop_token_ids", params.stop_token_ids),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
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
        needed_tokens = (max_len if params.max_tokens is None  # None: until the context is full
                         else min(len(prompt_token_ids) + params.max_tokens, max_len))
        # (behind a sliding window a request holds only its window's blocks)
        needed_blocks = self.kv_cache_manager.max_blocks_held(needed_tokens,
                                                              self.scheduler_config.max_num_batched_tokens)
        if needed_blocks > self.kv_cache_manager.num_total_blocks:
            # the prompt's fault when it cannot fit with a single output token, else max_tokens'
            # (the first word names the field, as the server reports it)
            alone = self.kv_cache_manager.max_blocks_held(len(prompt_token_ids) + 1,
                                                          self.scheduler_config.max_num_batched_tokens)
            if alone > self.kv_cache_manager.num_total_blocks:
                raise ValueError(
                    f"prompt is {len(prompt_token_ids)} tokens and needs {alone} KV blocks with its first output "
                    f"token, more than the whole cache ({self.kv_cache_manager.num_total_blocks} blocks); shorten "
                    "it or raise num_kv_blocks / kv_cache_memory_bytes"
                )
            raise ValueError(
                f"max_tokens: prompt + max_tokens = {needed_tokens} tokens need {needed_blocks} KV blocks, "
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

    def truncate_prompt(self, prompt_token_ids: list[int], k: int | None, pooling: bool = False) -> list[int]:
        """The prompt as ``truncate_prompt_tokens`` = ``k`` leaves it: its last k tokens
        (vLLM's left truncation; -1: ``max_model_len`` for an embedding (``pooling``),
        ``max_model_len`` - 1 for a generation, which needs room for a token; None: all).
        Idempotent.

        Raises:
            ValueError: naming ``truncate_prompt_tokens``, for k other than None, -1 or an
                integer >= 1, or above ``max_model_len``.
        """
        if k is None:
            return prompt_token_ids
        check_truncate_prompt_tokens(k)
        max_len = self.scheduler_config.max_model_len
        if k == -1:
            k = max_len if pooling else max_len - 1
        if k > max_len:
            raise ValueError(f"truncate_prompt_tokens ({k}) is greater than max_model_len ({max_len})")
        return list(prompt_token_ids[-k:])

    def prepare_request(self, prompt_token_ids: list[int], params: SamplingParams | PoolingParams,
                        lora_request=None) -> PreparedRequest:
        """Validate a request and do its engine-independent work: the bad words' token ids,
        one compiled grammar per sample, its LoRA adapter read and checked. It touches no
        engine state, so the server runs it on a worker thread while the engine thread steps.

        ``prompt_token_ids`` are truncated first where ``params.truncate_prompt_tokens`` asks
        (``truncate_prompt``); the prepared request holds the ids the engine runs.

        Raises:
            ValueError: see ``truncate_prompt``, ``validate_prompt``,
                ``check_request_features`` and ``check_lora_request``.
        """
        self.check_lora_request(lora_request)
        prompt_token_ids = self.truncate_prompt(prompt_token_ids, getattr(params, "truncate_prompt_tokens", None),
                                                isinstance(params, PoolingParams))
        self.validate_prompt(prompt_token_ids, params)
        if isinstance(params, PoolingParams):
            return PreparedRequest(list(prompt_token_ids), params.resolved(self.default_pooling), [], [None],
                                   lora_request)
        params = self._resolve_max_tokens(prompt_token_ids, params)
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
        output_kind: RequestOutputKind | None = None,
    ) -> None:
        """Validate and queue a request (``params.n`` samples sharing the prompt's blocks),
        or, with ``PoolingParams``, an embedding request (see ``kvflow.pooling_params``).

        ``priority`` matters under the "priority" scheduling policy (lower runs first).
        ``prepared``: the result of ``prepare_request`` for these ids and params, when the
        caller did that work already. ``lora_request``: the ``kvflow.lora.request.LoRARequest``
        the request runs with (None: the base model). ``output_kind``: what each of its
        ``RequestOutput``s holds (``RequestOutputKind``: CUMULATIVE, DELTA or FINAL_ONLY);
        None: ``params.output_kind`` (CUMULATIVE for an embedding request).

        Raises:
            ValueError: see ``validate_prompt``; a request_id already in use; a priority
                other than 0 without the "priority" scheduling policy; an ``output_kind``
                that is not a ``RequestOutputKind``.
        """
        if output_kind is None:
            output_kind = default_output_kind(params)
        if not isinstance(output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {output_kind!r}")
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
        prompt_token_ids = prepared.prompt_token_ids  # (truncated where params ask)
        if isinstance(prepared.params, PoolingParams):
            self._add_pooling_request(request_id, prompt_token_ids, prepared.params, prompt, priority, lora_request)
            return
        params = self._resolve_max_tokens(prompt_token_ids, params)
        missing = [] if params.ignore_eos else [i for i in self.extra_eos_token_ids if i not in params.stop_token_ids]
        if missing:  # the model's other end tokens (Gemma's <end_of_turn>...) end it too, as EOS does
            params = copy.copy(params)
            params.stop_token_ids = [*params.stop_token_ids, *missing]
        samples = make_parallel_samples(request_id, prompt_token_ids, params, self.eos_token_id, prompt, priority,
                                        lora_request)
        for sample, grammar in zip(samples, prepared.grammars):
            sample.bad_words_token_ids = prepared.bad_words_token_ids
            sample.grammar = grammar
        self.engine_core.add_request(request_id, samples)
        self.output_processor.add_request(request_id, [s.request_id for s in samples], prompt, prompt_token_ids,
                                          params, samples[0].arrival_time, output_kind, lora_request)
        self._hold_heap()

    def _resolve_max_tokens(self, prompt_token_ids: list[int], params: SamplingParams) -> SamplingParams:
        """``params``, or with ``max_tokens=None`` (vLLM's "until the context is full") a
        copy whose ``max_tokens`` is the room the prompt leaves in ``max_model_len``."""
        if params.max_tokens is not None:
            return params
        params = copy.copy(params)
        params.max_tokens = self.scheduler_config.max_model_len - len(prompt_token_ids)
        return params

    def _add_pooling_request(self, request_id: str, prompt_token_ids: list[int], params: PoolingParams,
                             prompt: str | None, priority: int, lora_request=None) -> None:
        request = Request(request_id, prompt_token_ids, _POOLING_PLACEHOLDER, self.eos_token_id, prompt,
                          priority=priority, pooling_params=params, lora_request=lora_request)
        self.engine_core.add_request(request_id, [request])
        self.output_processor.add_request(request_id, [request_id], prompt, prompt_token_ids, params,
                                          request.arrival_time)
        self._hold_heap()

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
        if self.output_processor.abort_request(request_id) is None:
            return False
        self.engine_core.abort_request(request_id)
        self._release_heap()
        return True

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

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
            (in its ``RequestOutputKind``: cumulative text and token ids by default, only
            the new ones for DELTA, nothing until the last for FINAL_ONLY; ``finished`` set
            on the last one), and an ``EmbeddingRequestOutput`` for every embedding request
            whose prompt was completed this step (or that failed).

        Raises:
            Exception: the engine cannot go on: a fault in the scheduler, in the KV block
                copies, in a tensor-parallel forward, or in the probe (RuntimeError).
        """
        core = self.engine_core
        core_outputs = core.step(on_scheduled)
        now = time.monotonic()
        processor = self.output_processor
        failed = [processor.make_failure_output(request_id, exc, now, token_ids)
                  for request_id, (exc, token_ids) in core_outputs.failed.items()]
        outputs, stops, failures = processor.process_outputs(core_outputs, now)
        core.finish_requests(stops)
        for request_id, exc in failures.items():
            failed.append(self._fail(request_id, exc, now))
        for request_id, exc in core.propose().items():
            failed.append(self._fail(request_id, exc, now))
        self._release_heap()
        return outputs + [out for out in failed if out is not None]

    def _fail(self, request_id: str, exc: BaseException, now: float) -> RequestOutput | EmbeddingRequestOutput | None:
        """Abort a user request that failed inside the engine (freeing its blocks); its final
        output, with ``error`` set. None when it is already gone."""
        try:
            token_ids = [s.output_token_ids for s in self.engine_core.samples(request_id)]
        except KeyError:
            token_ids = None
        logger.error("request %s failed and was aborted: %s: %s", request_id, type(exc).__name__, exc)
        self.engine_core.abort_request(request_id)
        return self.output_processor.make_failure_output(request_id, exc, now, token_ids)

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
        return {**self.engine_core.get_stats(), **self.platform.get_stats()}
