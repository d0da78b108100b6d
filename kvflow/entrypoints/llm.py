"""The offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import contextlib
import itertools
import operator
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Union

from tqdm.auto import tqdm

from kvflow.engine.arg_utils import EngineArgs
from kvflow.engine.llm_engine import LLMEngine
from kvflow.entrypoints.chat_utils import normalize_conversation, render_chat_text, require_unicode
from kvflow.inputs import EMPTY_ONLY, PROMPT_KEYS
from kvflow.lora.request import LoRARequest
from kvflow.outputs import BeamSearchOutput, BeamSearchSequence, EmbeddingRequestOutput, RequestOutput, RequestOutputKind
from kvflow.pooling_params import PoolingParams
from kvflow.sampling_params import BeamSearchParams, SamplingParams

PromptType = Union[str, list[int], dict[str, Any]]
Conversation = list[dict[str, Any]]


def _as_ints(token_ids: Any) -> list[int]:
    """``prompt_token_ids`` as a list of Python ints: integer ids of another type (numpy's,
    a 1-D integer tensor's elements: ``operator.index`` takes them) become ints, as
    ``SamplingParams`` takes numpy scalars; anything else is kept for ``validate_prompt`` to
    refuse (a numpy array was refused as "must be integers in [0, vocab)" with every id in it)."""
    ids = []
    for t in token_ids:
        if not isinstance(t, (int, bool)) and "bool" not in str(getattr(t, "dtype", "")):  # (a bool is no id)
            with contextlib.suppress(TypeError):
                t = operator.index(t)
        ids.append(t)
    return ids



def _vllm_only(name: str, instead: str) -> Callable[..., Any]:
    """A method of vLLM's ``LLM`` that kvflow does not implement: it raises
    NotImplementedError naming ``LLM.<name>`` and ``instead`` (what kvflow offers)."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"LLM.{name} (vLLM's) is not supported by kvflow: {instead}")

    method.__name__, method.__qualname__ = name, f"LLM.{name}"
    method.__doc__ = f"vLLM's ``LLM.{name}``, not implemented: raises NotImplementedError ({instead})."
    return method


class LLM:
    """Offline batched generation over the continuous-batching engine.

    Args:
        model: packaged short name (``smollm2-135m``, ``qwen2.5-coder-0.5b``,
            ``qwen2.5-coder-1.5b``), a ``.gguf`` file or a Hugging Face directory.
        **kwargs: any ``EngineArgs`` field (``dtype``, ``block_size``, ``num_kv_blocks``,
            ``kv_cache_memory_bytes``, ``max_num_batched_tokens``, ``max_num_seqs``,
            ``max_model_len``, ``seed``, ...), or one of vLLM's ``LLM`` keywords, mapped
            or accepted without effect as ``kvflow.entrypoints.vllm_compat`` lists
            (``gpu_memory_utilization``, ``swap_space``, ``trust_remote_code``...).

    Raises:
        ValueError: for an unknown option or an invalid value (naming the field).
    """

    def __init__(self, model: str = "smollm2-135m", **kwargs: Any) -> None:
        from kvflow.entrypoints import vllm_compat

        fields = set(EngineArgs.__dataclass_fields__)
        kwargs = vllm_compat.translate_llm_kwargs(model, kwargs, fields)
        unknown = set(kwargs) - fields
        if unknown:
            raise ValueError(f"unknown LLM option(s) {sorted(unknown)}; known: {sorted(fields)} and vLLM's "
                             f"{sorted(vllm_compat.vllm_option_names())}")
        self._start(EngineArgs(model=model, **kwargs))

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "LLM":
        """An ``LLM`` over the engine ``engine_args`` describes (what ``LLM(model, **kwargs)``
        builds from its keywords)."""
        if not isinstance(engine_args, EngineArgs):
            raise ValueError(f"engine_args must be a kvflow EngineArgs, got {type(engine_args).__name__}")
        llm = cls.__new__(cls)
        llm._start(engine_args)
        return llm

    def _start(self, engine_args: EngineArgs) -> None:
        self.engine = LLMEngine.from_engine_args(engine_args)
        self.tokenizer = self.engine.tokenizer
        self.chat_template: str | None = None
        self._counter = itertools.count()

    @property
    def llm_engine(self) -> "VLLMStyleEngine":
        """The engine as vLLM's ``LLM.llm_engine``: ``add_request(request_id, prompt, params)``
        takes any prompt form ``generate`` takes; ``step()``, ``abort_request``,
        ``has_unfinished_requests()``, ``get_tokenizer()`` and the rest of ``LLMEngine``
        work as on ``LLM.engine``."""
        return VLLMStyleEngine(self)

    def get_tokenizer(self) -> Any:
        """The transformers tokenizer of the model (None for a token-ids-only model), as
        vLLM's ``LLM.get_tokenizer``."""
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``sampling_params=None`` means: ``SamplingParams()`` with the sampling
        defaults of the model folder's ``generation_config.json`` where it has one
        (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), as vLLM."""
        return self.engine.default_sampling_params()

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget every cached prompt prefix no request holds (vLLM's ``reset_prefix_cache``):
        later prompts are computed from scratch. Returns True when nothing cached is left
        (always between ``generate`` calls).

        Raises:
            ValueError: for ``reset_running_requests`` (kvflow never preempts requests to
                reset the cache); ``reset_connector`` has no effect (no KV connector).
        """
        if reset_running_requests:
            raise ValueError("reset_running_requests is not supported by kvflow")
        return self.engine.reset_prefix_cache()

    # ------------------------------------------------------------------ inputs
    def _to_token_ids(self, prompt: PromptType) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass token ids")
            require_unicode(prompt, "prompt holds")
            return self.tokenizer.encode(prompt), prompt
        if isinstance(prompt, dict):
            for key, value in prompt.items():
                if key in EMPTY_ONLY and value:
                    raise ValueError(f"{key} is not supported by kvflow (text models only)")
                if key not in PROMPT_KEYS | EMPTY_ONLY:
                    raise ValueError(f"prompt key {key!r} is not supported by kvflow (a prompt dict takes "
                                     f"{sorted(PROMPT_KEYS)})")
            if "prompt_token_ids" in prompt:
                return _as_ints(prompt["prompt_token_ids"]), prompt.get("prompt")
            if "prompt" in prompt:
                return self._to_token_ids(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return list(prompt), None
        raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {_describe(prompt)}")

    @staticmethod
    def _normalize_prompts(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
            return [list(prompts)]
        if not isinstance(prompts, (list, tuple)):
            # an int or None would fail later as a TypeError ("'int' object is not iterable")
            raise ValueError(f"prompts must be a string, a list of token ids, a dict or a list of these, got "
                             f"{type(prompts).__name__}")
        return list(prompts)

    def _add_all(
        self,
        prompts: list[PromptType],
        params: SamplingParams | PoolingParams | Sequence[SamplingParams | PoolingParams],
        priority: int | Sequence[int] | None = None,
        params_name: str = "sampling_params",
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
    ) -> list[str]:
        # generate / generate_stream take SamplingParams, embed PoolingParams (vLLM's
        # signatures): the other kind would run the other task and return its output type.
        expected = PoolingParams if params_name == "pooling_params" else SamplingParams
        if isinstance(params, expected):
            params_list = [params] * len(prompts)
        elif isinstance(params, (list, tuple)):
            params_list = list(params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"{params_name} has {len(params_list)} entries for {len(prompts)} prompts"
                )
            for p in params_list:
                if not isinstance(p, expected):
                    raise ValueError(f"{params_name} entries must be {expected.__name__}, got {type(p).__name__}")
        else:
            raise ValueError(f"{params_name} must be a {expected.__name__} or a list of them (one per prompt), "
                             f"got {type(params).__name__}")
        if priority is None or isinstance(priority, int):
            priorities = [priority or 0] * len(prompts)
        else:
            priorities = list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"priority has {len(priorities)} entries for {len(prompts)} prompts")
        for prio in priorities:
            if isinstance(prio, bool) or not isinstance(prio, int):
                raise ValueError(f"priority must hold integers, got {prio!r}")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        elif isinstance(lora_request, (list, tuple)):
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"lora_request has {len(loras)} entries for {len(prompts)} prompts")
        else:
            raise ValueError(f"lora_request must be a LoRARequest or a list of them, got {type(lora_request).__name__}")
        for lora in loras:
            if lora is not None and not isinstance(lora, LoRARequest):
                raise ValueError(f"lora_request entries must be LoRARequest or None, got {type(lora).__name__}")
        encoded = [self._to_token_ids(p) for p in prompts]
        # Validate everything first so that one bad prompt adds nothing.
        for lora in {id(x): x for x in loras}.values():
            self.engine.check_lora_request(lora)
        encoded = [(self.engine.truncate_prompt(ids, getattr(p, "truncate_prompt_tokens", None),
                                                isinstance(p, PoolingParams)), text)
                   for (ids, text), p in zip(encoded, params_list)]
        for (ids, _), p in zip(encoded, params_list):
            self.engine.validate_prompt(ids, p)
        request_ids = []
        try:
            for (ids, text), p, prio, lora in zip(encoded, params_list, priorities, loras):
                request_id = str(next(self._counter))
                kind = output_kind if isinstance(p, SamplingParams) else RequestOutputKind.CUMULATIVE
                self.engine.add_request(request_id, ids, p, prompt=text, priority=prio, lora_request=lora,
                                        output_kind=kind)
                request_ids.append(request_id)
        except BaseException:
            # add_request can still refuse one (e.g. a guided_json / guided_regex that does
            # not compile): take back the ones already queued, so that nothing is added.
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise
        return request_ids

    def _run_to_completion(self, request_ids: list[str], use_tqdm: bool | Callable[..., Any]) -> list[Any]:
        """Step until every request of ``request_ids`` finished; their final outputs in that
        order (aborting the rest when interrupted). ``use_tqdm``: a progress bar when there
        is more than one request, or a tqdm-like factory (as vLLM)."""
        results: dict[str, Any] = {}
        factory = use_tqdm if callable(use_tqdm) else tqdm
        bar = factory(total=len(request_ids), desc="Processed prompts",
                      disable=not use_tqdm or len(request_ids) < 2)
        try:
            while len(results) < len(request_ids):
                for output in self.engine.step():
                    if output.finished:
                        results[output.request_id] = output
                        bar.update(1)
        except BaseException:
            for request_id in request_ids:
                if request_id not in results:
                    self.engine.abort_request(request_id)
            raise
        finally:
            bar.close()
        return [results[r] for r in request_ids]

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        priority: int | Sequence[int] | None = None,
        *,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; results come back in input order (vLLM's
        ``LLM.generate``; ``tokenization_kwargs`` and ``mm_processor_kwargs`` are accepted
        unset).

        Args:
            prompts: a string, a list of token ids, a dict with ``prompt`` or
                ``prompt_token_ids``, or a list of these.
            sampling_params: one for all prompts or one per prompt (default
                ``get_default_sampling_params()``).
            use_tqdm: show a progress bar when there is more than one prompt (or a tqdm-like
                factory to make it, as vLLM).
            priority: one priority for all prompts or one per prompt, for the "priority"
                scheduling policy (lower first); other than 0 it needs that policy.
            lora_request: one ``LoRARequest`` for all prompts or one (or None) per prompt
                (needs ``enable_lora``; see docs/lora.md).

        A request that fails inside the engine (see ``LLMEngine.step``) comes back finished
        with ``error`` set and finish_reason "error"; the others are not affected.

        Raises:
            ValueError: for an invalid prompt or parameters, an adapter that does not load
                (naming it; ``LLMEngine.check_lora_request``), or non-empty
                ``tokenization_kwargs`` / ``mm_processor_kwargs``; nothing is queued then.
        """
        _refuse_unset(tokenization_kwargs=tokenization_kwargs, mm_processor_kwargs=mm_processor_kwargs)
        prompt_list = self._normalize_prompts(prompts)
        # One output per request, when it finishes (vLLM's FINAL_ONLY): no per-step copies.
        request_ids = self._add_all(prompt_list, sampling_params or self.get_default_sampling_params(), priority,
                                    lora_request=lora_request, output_kind=RequestOutputKind.FINAL_ONLY)
        return self._run_to_completion(request_ids, use_tqdm)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        pooling: str | None = None,
        normalize: bool | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        priority: int | Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding vector per prompt (vLLM's ``LLM.embed``), in input order.

        Each prompt runs through the engine like any prompt (batched with other requests,
        chunked by ``max_num_batched_tokens``) and is pooled from the decoder's final hidden
        states (after the last norm): see ``kvflow.pooling_params``.

        Args:
            prompts: as for ``generate``.
            pooling_params: one ``PoolingParams`` for all prompts or one per prompt.
            pooling: "last" or "mean" for every prompt (default: ``EngineArgs.pooling``);
                a shortcut for ``PoolingParams(pooling_type=...)``.
            normalize: L2-normalize the vectors (default True); with ``pooling``, instead of
                ``pooling_params``.
            use_tqdm: as for ``generate``.
            priority: as for ``generate``.
            lora_request: as for ``generate``.

        Returns:
            ``EmbeddingRequestOutput`` per prompt: ``.outputs.embedding`` is a list of
            ``hidden_size`` floats. A request that failed inside the engine has ``error``
            set and an empty vector.

        Raises:
            ValueError: for an invalid prompt or parameters (e.g. ``dimensions`` other than
                the hidden size); nothing is queued then.
        """
        _refuse_unset(tokenization_kwargs=tokenization_kwargs)
        if pooling_params is None:
            pooling_params = PoolingParams(pooling_type=pooling, normalize=normalize)
        elif pooling is not None or normalize is not None:
            raise ValueError("give pooling / normalize or pooling_params, not both")
        prompt_list = self._normalize_prompts(prompts)
        request_ids = self._add_all(prompt_list, pooling_params, priority, "pooling_params", lora_request)
        return self._run_to_completion(request_ids, use_tqdm)

    def generate_stream(
        self, prompt: PromptType, sampling_params: SamplingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> Iterator[RequestOutput]:
        """Yield the request's cumulative output after every new token (``lora_request``: as
        for ``generate``).

        Closing the iterator early aborts the request and frees its blocks.
        """
        (request_id,) = self._add_all([prompt], sampling_params or self.get_default_sampling_params(),
                                      lora_request=lora_request)
        finished = False
        try:
            while not finished:
                for output in self.engine.step():
                    if output.request_id == request_id:
                        finished = output.finished
                        yield output
        finally:
            if not finished:
                self.engine.abort_request(request_id)

    def apply_chat_template(
        self,
        conversation: Conversation,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        chat_template_content_format: str = "auto",
    ) -> list[int]:
        """Token ids of a conversation rendered with the chat template (see
        ``kvflow.entrypoints.chat_utils.render_chat_text`` for the arguments; ``chat_template``
        defaults to the one given to ``LLM(chat_template=...)``, else the tokenizer's).

        Raises:
            ValueError: for a message that is not a dict with a ``role``, a non-text content
                part, both ``add_generation_prompt`` and ``continue_final_message``, or a
                template that fails on the messages.
        """
        text = self._chat_text(conversation, add_generation_prompt, continue_final_message, chat_template,
                               chat_template_kwargs, tools, chat_template_content_format)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _chat_text(self, conversation, add_generation_prompt, continue_final_message, chat_template,
                   chat_template_kwargs, tools, chat_template_content_format) -> str:
        """The prompt text of a conversation (``apply_chat_template``'s, before encoding)."""
        content_format = "string" if chat_template_content_format == "auto" else chat_template_content_format
        return render_chat_text(
            self.tokenizer, normalize_conversation(conversation, content_format),
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            chat_template=chat_template or self.chat_template, chat_template_kwargs=chat_template_kwargs, tools=tools,
        )  # fmt: skip

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: int | Sequence[int] | None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of conversations (vLLM's
        ``LLM.chat``, same arguments in the same order).

        Each conversation is a list of messages (dicts with ``role`` and ``content``, which
        may be a list of text parts; ``tool_calls`` (a call's ``arguments`` JSON string as
        the object it holds), ``tool_call_id``, ``name`` and other keys reach the template
        as given) rendered with the chat template; see
        ``apply_chat_template`` for the template arguments and ``generate`` for the rest.

        Raises:
            ValueError: see ``apply_chat_template`` and ``generate`` (``lora_request``,
                ``tokenization_kwargs``, ``mm_processor_kwargs`` set).
        """
        _refuse_unset(tokenization_kwargs=tokenization_kwargs, mm_processor_kwargs=mm_processor_kwargs)
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        texts = [self._chat_text(c, add_generation_prompt, continue_final_message, chat_template, chat_template_kwargs,
                                 tools, chat_template_content_format) for c in conversations]
        # the rendered text is each output's prompt, as vLLM's
        prompts = [{"prompt": t, "prompt_token_ids": self.tokenizer.encode(t, add_special_tokens=False)} for t in texts]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, priority=priority, lora_request=lora_request)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams | None = None,
        lora_request: None = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
        **options: Any,
    ) -> list[BeamSearchOutput]:
        """Beam search (the standard left-to-right algorithm; e.g. Graves 2012, "Sequence
        Transduction with Recurrent Neural Networks", section 3.2, without the transducer),
        vLLM's ``LLM.beam_search(prompts, BeamSearchParams(beam_width=..., max_tokens=...))``.
        ``options``: instead of ``params``, its fields as keywords (``beam_width=4,
        max_tokens=16``, kvflow's earlier signature). ``use_tqdm`` and ``concurrency_limit``
        are accepted and change nothing (each step runs every beam of every prompt as one
        batch).

        Each step every live beam of every prompt is one engine request for a single token
        with its top ``2 * beam_width`` log-probabilities; the beams' common prefixes share
        KV blocks through the prefix cache, so a step computes only each beam's unfinished
        last block. Candidates are ranked by cumulative log-probability; a candidate ending
        in EOS is set aside as finished. Final ranking uses
        ``cumulative_logprob / num_generated ** length_penalty``.

        Returns:
            one ``BeamSearchOutput`` per prompt; its ``sequences`` (best first) carry the
            prompt and generated ids in ``tokens`` / ``token_ids`` and the generated text in
            ``text``.

        Raises:
            ValueError: see ``BeamSearchParams``; both ``params`` and keywords; a
                ``lora_request``; an invalid prompt.
        """
        _refuse_unset(lora_request=lora_request)
        if params is None:
            try:
                params = BeamSearchParams(**{"beam_width": 4, "max_tokens": 16, **options})
            except TypeError as exc:
                raise ValueError(f"beam_search: {exc}") from None
        elif options:
            raise ValueError(f"give BeamSearchParams or keywords, not both (got {sorted(options)})")
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        beam_width, max_tokens = params.beam_width, params.max_tokens
        vocab = self.engine.model_config.vocab_size
        if 2 * beam_width > vocab:  # (each step asks for 2 * beam_width logprobs: named so, it said "logprobs")
            raise ValueError(f"beam_width must be at most half the vocabulary size ({vocab // 2}), got {beam_width}")
        length_penalty, ignore_eos = params.length_penalty, params.ignore_eos
        eos = None if ignore_eos else self.engine.eos_token_id
        params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2 * beam_width, ignore_eos=True)
        prompt_ids = [self._to_token_ids(p)[0] for p in self._normalize_prompts(prompts)]
        for ids in prompt_ids:
            self.engine.validate_prompt(ids, SamplingParams(max_tokens=max_tokens))
        # Per prompt: the tokens its beams may generate, at most what the context leaves (as
        # generate stops there with "length"; a beam used to reach max_model_len and fail
        # the search with "prompt is N tokens", N not the prompt's).
        max_model_len = self.engine.scheduler_config.max_model_len
        limits = [min(max_tokens, max_model_len - len(ids)) for ids in prompt_ids]
        # Per prompt: live beams (token ids, cumulative logprob) and finished ones.
        live = [[(list(ids), 0.0)] for ids in prompt_ids]
        done: list[list[tuple[list[int], float, str]]] = [[] for _ in prompt_ids]
        for step in range(max_tokens):
            flat = [(p, beam) for p, beams in enumerate(live) for beam in beams]
            if not flat:
                break
            outs = self.generate([{"prompt_token_ids": tokens} for _, (tokens, _) in flat], params, use_tqdm=False)
            candidates: list[list[tuple[list[int], float]]] = [[] for _ in prompt_ids]
            for (p, (tokens, score)), out in zip(flat, outs):
                for token, logprob in out.outputs[0].logprobs[0].items():
                    candidates[p].append((tokens + [token], score + logprob))
            for p, cands in enumerate(candidates):
                cands.sort(key=lambda c: c[1], reverse=True)
                live[p] = []
                for tokens, score in cands:
                    if len(live[p]) == beam_width:
                        break
                    if tokens[-1] == eos:
                        done[p].append((tokens, score, "stop"))
                    elif step == limits[p] - 1:
                        done[p].append((tokens, score, "length"))
                        live[p].append((tokens, score))
                    else:
                        live[p].append((tokens, score))
                if step == limits[p] - 1:
                    live[p] = []
        results = []
        for ids, finished in zip(prompt_ids, done):
            seqs = []
            for tokens, logprob, reason in finished:
                generated = tokens[len(ids) :]
                text = self.tokenizer.decode(generated, skip_special_tokens=True) if self.tokenizer else ""
                score = logprob / (len(generated) ** length_penalty)
                seqs.append(BeamSearchSequence(tokens, text, logprob, score, reason))
            seqs.sort(key=lambda s: s.score, reverse=True)
            results.append(BeamSearchOutput(seqs[:beam_width]))
        return results

    def shutdown(self) -> None:
        """Release the engine's worker processes (tensor parallelism); idempotent."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def get_stats(self) -> dict[str, float | int]:
        """See ``LLMEngine.get_stats``."""
        return self.engine.get_stats()

    # vLLM's ``LLM`` methods kvflow does not implement: each raises NotImplementedError naming
    # itself and what kvflow offers instead (an AttributeError said nothing of why).
    encode = _vllm_only("encode", "LLM.embed gives the embeddings (vLLM's encode with pooling_task='embed')")
    classify = _vllm_only("classify", "kvflow runs no classification models")
    score = _vllm_only("score", "kvflow runs no cross-encoder or scoring models; compare LLM.embed vectors")
    reward = _vllm_only("reward", "kvflow runs no reward models")
    get_metrics = _vllm_only("get_metrics", "LLM.get_stats() gives the engine's counters and gauges")
    sleep = _vllm_only("sleep", "kvflow keeps its weights and KV cache resident")
    wake_up = _vllm_only("wake_up", "kvflow keeps its weights and KV cache resident (it never sleeps)")


class VLLMStyleEngine:
    """vLLM's ``LLMEngine`` (``kvflow.LLMEngine``, and ``LLM.llm_engine``): the ``LLMEngine``
    of an ``LLM`` with vLLM's ``add_request`` signature; every other attribute is the
    engine's. ``LLMEngine.from_engine_args(EngineArgs(...))`` builds one, as vLLM's."""

    def __init__(self, llm: LLM) -> None:
        self._llm = llm

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, usage_context: Any = None, stat_loggers: Any = None,
                         enable_multiprocessing: bool = False) -> "VLLMStyleEngine":
        """Load the model and build the engine (vLLM's ``LLMEngine.from_engine_args``);
        ``usage_context``, ``stat_loggers`` and ``enable_multiprocessing`` are accepted and
        not used. A kvflow ``EngineArgs`` takes vLLM's keywords as ``LLM(...)`` does only
        through ``LLM``; here its own fields.

        Raises:
            ValueError: see ``LLMEngine.from_engine_args``.
        """
        return cls(LLM.from_engine_args(engine_args))

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams,
                    arrival_time: float | None = None, lora_request: LoRARequest | None = None,
                    tokenization_kwargs: dict[str, Any] | None = None, trace_headers: Any = None,
                    priority: int = 0) -> None:
        """Queue one request (vLLM's ``LLMEngine.add_request``); its outputs come from
        ``step()``. ``lora_request``: the adapter it runs with (None: the base model).
        ``arrival_time`` and ``trace_headers`` are accepted and not used.

        Raises:
            ValueError: see ``LLMEngine.add_request``; a ``lora_request`` that is no
                ``LoRARequest``; ``tokenization_kwargs``.
        """
        _refuse_unset(tokenization_kwargs=tokenization_kwargs)
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest or None, got {type(lora_request).__name__}")
        ids, text = self._llm._to_token_ids(prompt)
        self._llm.engine.add_request(str(request_id), ids, params, prompt=text, priority=priority,
                                     lora_request=lora_request)

    def abort_request(self, request_id: str | Iterable[str]) -> bool | None:
        """Abort one request or several (vLLM's ``abort_request`` takes a list of ids), by the
        ids ``add_request`` took (made strings as there). One id: False when it is unknown or
        already finished (``LLMEngine.abort_request``); a list: None, as vLLM's."""
        if isinstance(request_id, (str, int)):
            return self._llm.engine.abort_request(str(request_id))
        for one in request_id:
            self._llm.engine.abort_request(str(one))
        return None

    def get_tokenizer(self) -> Any:
        return self._llm.tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm.engine, name)



def _refuse_unset(**options: Any) -> None:
    """vLLM arguments kvflow accepts only unset (None or empty).

    Raises:
        ValueError: naming the first one set.
    """
    why = {"tokenization_kwargs": "the tokenizer's defaults are used",
           "mm_processor_kwargs": "text models only",
           "lora_request": "here the base model runs; generate, chat and embed take adapters"}
    for name, value in options.items():
        if value is not None and value != {}:
            raise ValueError(f"{name} is not supported by kvflow ({why[name]}); leave it unset")


def _describe(prompt: Any) -> str:
    """What a refused prompt is, for its error: a list names what it holds (a list of
    strings is a batch of prompts, given where one prompt is expected)."""
    if isinstance(prompt, (list, tuple)) and prompt:
        kinds = sorted({type(x).__name__ for x in prompt})
        return f"a {type(prompt).__name__} of {' / '.join(kinds)} (one prompt is expected here)"
    return type(prompt).__name__
