"""Per-request sampling parameters.

The field names and semantics follow vLLM's ``SamplingParams`` so that users coming from
vLLM or the OpenAI API find what they expect. Validation happens at construction time and
raises ``ValueError`` whose message starts with the offending field name, so an invalid
request is refused before it reaches the engine.
"""

from __future__ import annotations

import copy
import enum
import math
import numbers
import re
from dataclasses import dataclass, field
from typing import Any

_GREEDY_EPS = 1e-5
# The grammar engine's backend names a vLLM script may pass (kvflow always uses llguidance).
_BACKENDS = (None, "auto", "guidance", "llguidance")


class RequestOutputKind(enum.Enum):
    """What each ``RequestOutput`` of a request holds (vLLM's ``RequestOutputKind``).

    CUMULATIVE: all the text, token ids and logprobs so far, every step (the default).
    DELTA: only what is new since the request's previous output (``cumulative_logprob``
    stays the running total; ``prompt_logprobs`` come once, with the first output, as
    vLLM's); the server's streams. FINAL_ONLY: one output, when the request finishes
    (``LLM.generate``). A request's kind is ``SamplingParams.output_kind`` unless its caller
    names one (``LLMEngine.add_request(output_kind=...)``).
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class StructuredOutputsParams:
    """One output constraint, vLLM's ``StructuredOutputsParams`` (vllm/sampling_params.py),
    taken by ``SamplingParams(structured_outputs=...)``. Exactly one of the constraint fields
    is set; kvflow enforces it with llguidance (see ``kvflow.sample.guided``).

    Attributes:
        json: a JSON schema (dict or JSON string) the output validates against.
        regex: a regular expression the whole output matches (Rust ``regex`` syntax).
        choice: a list of strings; the output is exactly one of them.
        grammar: a context-free grammar the output belongs to, in Lark syntax (llguidance's)
            or llama.cpp's GBNF (``root ::= ...``).
        json_object: True: any JSON object (``{"type": "object"}``).
        disable_any_whitespace, disable_additional_properties, whitespace_pattern,
        structural_tag: vLLM's options kvflow does not implement; refused when set.

    Raises:
        ValueError: naming the field, when no constraint or more than one is set, or for an
            option kvflow does not implement.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        for name, default in (("disable_any_whitespace", False), ("disable_additional_properties", False),
                              ("whitespace_pattern", None), ("structural_tag", None)):
            if getattr(self, name) != default:  # (named first: alone it is no constraint kvflow takes)
                raise ValueError(f"{type(self).__name__}.{name} is not supported by kvflow"
                                 + (" (SamplingParams.structural_tag is)" if name == "structural_tag" else ""))
        set_ = [name for name in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, name) is not None]
        if len(set_) != 1:
            raise ValueError(f"{type(self).__name__} takes exactly one of json, regex, choice, grammar, json_object; "
                             f"got {set_ or 'none'}")
        if self.json_object not in (None, True):
            raise ValueError("json_object must be True when set")

    def constraint(self) -> dict[str, Any]:
        """The constraint as ``SamplingParams`` keywords (``guided_json`` etc.)."""
        if self.json_object:
            return {"guided_json": {"type": "object"}}
        name = next(n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None)
        return {f"guided_{name}": getattr(self, name)}


@dataclass
class GuidedDecodingParams(StructuredOutputsParams):
    """vLLM's name for ``StructuredOutputsParams`` before v0.11 (``SamplingParams(
    guided_decoding=...)``), with its ``backend`` field: None, "auto", "guidance" or
    "llguidance" (kvflow's grammar engine); any other backend is refused.

    Raises:
        ValueError: as ``StructuredOutputsParams``, or naming ``backend``.
    """

    backend: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.backend not in _BACKENDS:
            raise ValueError(f"backend={self.backend!r} is not supported by kvflow (it uses llguidance); "
                             f"use one of {[b for b in _BACKENDS if b]}")

    @classmethod
    def from_optional(cls, json: dict[str, Any] | str | None = None, regex: str | None = None,
                      choice: list[str] | None = None, grammar: str | None = None,
                      json_object: bool | None = None, backend: str | None = None) -> "GuidedDecodingParams | None":
        """None when no constraint is given, else the params (vLLM's helper)."""
        if all(v is None for v in (json, regex, choice, grammar, json_object)):
            return None
        return cls(json=json, regex=regex, choice=choice, grammar=grammar, json_object=json_object, backend=backend)


@dataclass
class BeamSearchParams:
    """Parameters of ``LLM.beam_search`` (vLLM's ``BeamSearchParams``).

    Attributes:
        beam_width: beams kept per prompt (>= 1).
        max_tokens: generated tokens per beam (>= 1).
        ignore_eos: keep extending beams past the end-of-sequence token.
        temperature: 0 (kvflow's beam search ranks the raw log-probabilities; other values
            are refused).
        length_penalty: final ranking is ``cumulative_logprob / num_generated **
            length_penalty``.
        include_stop_str_in_output: accepted for vLLM's signature; beam search has no stop
            strings, so it changes nothing.

    Raises:
        ValueError: naming the field, for a value outside the ranges above.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("ignore_eos", "include_stop_str_in_output"):  # ("false" was truthy: ignore_eos on)
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if self.temperature != 0:
            raise ValueError(f"temperature must be 0 for kvflow's beam search, got {self.temperature!r}")
        _check_number("length_penalty", self.length_penalty, finite=True)


@dataclass
class SamplingParams:
    """How to pick the next token of one request.

    Attributes:
        n: number of output sequences per prompt (parallel sampling). The samples share the
            prompt's KV blocks; sample i of a seeded request uses seed + i.
        temperature: softmax temperature (> 0 samples, 0 means greedy argmax). A finite
            number >= 0.
        top_p: nucleus sampling, keep the smallest set of tokens whose probability mass is
            >= top_p (Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration",
            section 3.1). Must be in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens. 0 or -1 disable it; otherwise >= 1 (a value
            at or above the vocabulary size keeps every token, as if disabled).
        min_p: drop tokens whose probability is below ``min_p`` times the most likely
            token's probability. Must be in [0, 1]; 0 disables it.
        seed: per-request random seed (-1, as in vLLM and llama.cpp, is None: no seed). A
            seeded request samples from its own ``torch.Generator``, so it produces the
            same tokens whatever else is batched with it, except under speculative
            decoding: there a sampled request draws from its generator once per verified
            draft or plain step, so its tokens depend on which drafts each step verifies,
            and that depends on the schedule, i.e. on the other requests: the token
            budget they leave it (a prompt's last chunk carries drafts when it holds
            only the prompt's last token; a short budget trims drafts), whether it is
            preempted (its first step back verifies no drafts), and with
            ``disable_by_batch_size`` (``SpeculativeConfig``) how many requests are
            running. Under speculation a seed reproduces a run with the same schedule
            only. Greedy requests are exact either way.
        max_tokens: maximum number of generated tokens (>= 1); None (as vLLM): until the
            context is full, i.e. ``max_model_len`` minus the prompt's length (the engine
            sets it per request).
        stop_token_ids: generation stops after emitting any of these token ids (the token
            is kept in ``token_ids``). At most ``MAX_STOP_TOKEN_IDS`` (1024).
        ignore_eos: keep generating past the model's end-of-sequence token. Not with a
            ``guided_*`` constraint (its grammar ends the output: a ``ValueError``); with a
            ``structural_tag`` the text stays free past EOS.
        skip_special_tokens: drop special tokens when detokenizing the output text.
        logprobs: report, for every generated token, the log-probability of the sampled
            token and of the ``logprobs`` most likely tokens under the raw model
            distribution (before penalties, temperature and filtering). None: none. The
            engine refuses more than the vocabulary size.
        prompt_logprobs: the same for every prompt token after the first (the request then
            computes its whole prompt: prefix-cache hits are not used for it).
        presence_penalty: subtracted from the logit of every token that occurs in the output
            so far (OpenAI semantics). In [-2, 2].
        frequency_penalty: subtracted once per occurrence in the output so far. In [-2, 2].
        repetition_penalty: divides positive logits and multiplies negative ones of tokens in
            the prompt or the output (Keskar et al. 2019, "CTRL", section 4.1). A number
            > 0 within float32's normal range (about 1.2e-38 to 3.4e38); 1 is off.
        logit_bias: token id -> value added to its logit (OpenAI semantics): keys are
            integers or integer strings >= 0 (the engine refuses ids outside the
            vocabulary), values numbers in [-100, 100]. At most ``MAX_LOGIT_BIAS`` (1024)
            entries.
        allowed_token_ids: vLLM's: a non-empty list of token ids, the only ones that may be
            sampled (every other logit is set to -inf before the penalties, temperature and
            filtering; ``logprobs`` stay those of the raw distribution). At most
            ``MAX_ALLOWED_TOKEN_IDS`` (the engine refuses ids outside the vocabulary).
        min_tokens: EOS and ``stop_token_ids`` are masked until this many tokens exist,
            and ``stop`` strings are not matched in their text (as vLLM).
            With a ``guided_*`` constraint (as vLLM): masked while its grammar allows
            another token; a grammar that allows only them (or is complete) ends the
            output earlier.
        bad_words: words never to generate: the last token of a word's token sequence is
            masked whenever the output ends with the rest of it. At most ``MAX_BAD_WORDS``
            (1024) words of at most ``MAX_STRING_CHARS`` (1024) characters.
        stop: strings that end generation when they appear in the output text, also across
            token boundaries. The stop string is cut from the text unless
            ``include_stop_str_in_output``. At most ``MAX_STOP_STRINGS`` (64) strings of at
            most ``MAX_STRING_CHARS`` (1024) characters.
        include_stop_str_in_output: keep the matched stop string in the text.
        guided_json: a JSON schema (dict or JSON string); the output is constrained to
            JSON that validates against it (llguidance grammar engine).
        guided_regex: a regular expression the whole output must match.
        guided_choice: a non-empty list of strings; the output is exactly one of them. At
            most ``MAX_GUIDED_CHOICES`` (1024) choices of at most ``MAX_STRING_CHARS`` characters.
        guided_grammar: a context-free grammar (Lark syntax, or llama.cpp's GBNF) the output
            belongs to.
        structured_outputs: vLLM's form of the four above (``StructuredOutputsParams``); it
            sets the matching ``guided_*`` field.
        guided_decoding: vLLM's older name (``GuidedDecodingParams``), the same way.
        structural_tag: vLLM's structural tag (dict or JSON string): ``{"structures":
            [{"begin": str, "schema": dict, "end": str}, ...], "triggers": [str, ...]}``.
            The text is free until it writes a trigger; from there it must be one of the
            structures that begin with that trigger (``begin``, JSON valid for ``schema``,
            ``end``), then it is free again. Tool calling under ``tool_choice: "auto"``
            uses it (``kvflow.entrypoints.openai.tools.tool_call_structural_tag``).
        output_kind: vLLM's: what each ``RequestOutput`` of the request holds
            (``RequestOutputKind``: CUMULATIVE, DELTA or FINAL_ONLY) where the caller does
            not name a kind itself (``LLM.generate`` always gives final outputs).
        truncate_prompt_tokens: vLLM's: keep only the prompt's last k tokens (left
            truncation); -1: as many as the context takes (``max_model_len`` - 1, leaving
            room for one output token); None: no truncation. The engine refuses k above
            ``max_model_len`` (``LLMEngine.truncate_prompt``).
        detokenize: vLLM's: False gives token ids only: every output's ``text`` is "" and
            its logprobs' ``decoded_token`` None (the text is never made). Not with ``stop``
            strings (vLLM's rule: they are matched in the text).
        spaces_between_special_tokens: vLLM's; True (its default) only, unless
            ``skip_special_tokens`` (then special tokens are not in the text, and vLLM too
            ignores it).
        extra_args: vLLM's: a dict of anything, carried along with the request for the
            caller's own use (kvflow's sampling reads none of it, as vLLM's in-tree
            sampling).
        best_of: older vLLM versions' (vLLM 0.32's ``SamplingParams`` has none): accepted
            as None or equal to ``n`` (n samples, all returned); any other value is refused.
        logits_processors: older vLLM versions' per-request logits processors: accepted as
            None or an empty list; kvflow does not run them, so any other value is refused.
        thinking_token_budget, repetition_detection, logprob_token_ids,
        prompt_logprob_token_ids, prompt_logprob_start, watermarking, flat_logprobs,
        stream_interval, skip_reading_prefix_cache, routed_experts_prompt_start: vLLM 0.32's
        newer fields, which kvflow does not implement: accepted at their neutral values
        (``VLLM_NEUTRAL``: None, an empty list, False, 0, a ``stream_interval`` of 1), any other
        value refused by name. skip_clone: vLLM's copy hint, any bool (no effect).

    Integer fields take any ``numbers.Integral`` and float fields any ``numbers.Real``
    (numpy scalars included), stored as Python ``int`` / ``float``; ``bool`` is not a number
    here.

    Raises:
        ValueError: naming the field, for any value outside the ranges above or of another
            type.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    min_tokens: int = 0
    bad_words: list[str] | None = None
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None
    structural_tag: dict[str, Any] | str | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    truncate_prompt_tokens: int | None = None
    detokenize: bool = True
    spaces_between_special_tokens: bool = True
    extra_args: dict[str, Any] | None = None
    best_of: int | None = None
    logits_processors: list[Any] | None = None
    thinking_token_budget: int | None = None
    repetition_detection: Any = None
    logprob_token_ids: list[int] | None = None
    prompt_logprob_token_ids: list[int] | None = None
    prompt_logprob_start: int | None = None
    watermarking: Any = None
    flat_logprobs: bool = False
    stream_interval: int | None = None
    skip_clone: bool = False
    skip_reading_prefix_cache: bool | None = None
    routed_experts_prompt_start: int = 0

    @staticmethod
    def from_optional(
        n: int | None = 1,
        presence_penalty: float | None = 0.0,
        frequency_penalty: float | None = 0.0,
        repetition_penalty: float | None = 1.0,
        temperature: float | None = 1.0,
        top_p: float | None = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        seed: int | None = None,
        stop: str | list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        bad_words: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        ignore_eos: bool = False,
        max_tokens: int | None = 16,
        min_tokens: int = 0,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        detokenize: bool = True,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
        structured_outputs: StructuredOutputsParams | None = None,
        logit_bias: dict[int, float] | dict[str, float] | None = None,
        allowed_token_ids: list[int] | None = None,
        extra_args: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> "SamplingParams":
        """vLLM's ``SamplingParams.from_optional``: None for ``n``, ``presence_penalty``,
        ``frequency_penalty``, ``repetition_penalty``, ``temperature`` or ``top_p`` means
        its default (as an OpenAI request's null field); ``logit_bias`` keys become ints
        and its values are clamped to [-100, 100] (keys and values are then checked as the
        constructor checks them). ``kwargs``: kvflow's other fields
        (``guided_json``, ``truncate_prompt_tokens``...).

        Raises:
            ValueError: naming ``logit_bias`` for a key that is no integer, or as the
                constructor.
            TypeError: for a keyword that is no field (as the constructor).
        """
        if logit_bias is not None:
            if not isinstance(logit_bias, dict):
                raise ValueError(f"logit_bias must map token ids to numbers, got {type(logit_bias).__name__}")
            # Only the values are clamped; the constructor reads the keys and refuses what is no
            # token id or number. int(token) made 1.5 and True token 1, and a NaN value passed
            # max / min as -100 (the token banned) where the constructor refuses NaN.
            logit_bias = {token: _clamp_bias(bias) for token, bias in logit_bias.items()}
        return SamplingParams(
            n=1 if n is None else n,
            presence_penalty=0.0 if presence_penalty is None else presence_penalty,
            frequency_penalty=0.0 if frequency_penalty is None else frequency_penalty,
            repetition_penalty=1.0 if repetition_penalty is None else repetition_penalty,
            temperature=1.0 if temperature is None else temperature,
            top_p=1.0 if top_p is None else top_p,
            top_k=top_k, min_p=min_p, seed=seed, stop=stop, stop_token_ids=stop_token_ids, bad_words=bad_words,
            include_stop_str_in_output=include_stop_str_in_output, ignore_eos=ignore_eos, max_tokens=max_tokens,
            min_tokens=min_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs, detokenize=detokenize,
            skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=spaces_between_special_tokens,
            output_kind=output_kind, structured_outputs=structured_outputs, logit_bias=logit_bias,
            allowed_token_ids=allowed_token_ids, extra_args=extra_args, **kwargs,
        )  # fmt: skip

    def clone(self) -> "SamplingParams":
        """A deep copy (vLLM's ``SamplingParams.clone``): changing it, its lists or its
        ``extra_args`` leaves this one as it is."""
        return copy.deepcopy(self)

    def __post_init__(self) -> None:
        self._take_structured_outputs()
        for name in ("stop_token_ids", "bad_words", "stop", "allowed_token_ids"):
            value = getattr(self, name)
            is_list = isinstance(value, (list, tuple)) or (name == "stop" and isinstance(value, str))
            if value is not None and not is_list:
                raise ValueError(f"{name} must be a list, got {type(value).__name__}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.bad_words = list(self.bad_words or [])
        if self.logit_bias:
            self.logit_bias = _parse_logit_bias(self.logit_bias)
        self._verify()

    def _take_structured_outputs(self) -> None:
        """Set the ``guided_*`` field that ``structured_outputs`` / ``guided_decoding`` names."""
        for name in ("structured_outputs", "guided_decoding"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, dict):  # as the server's JSON gives it
                value = StructuredOutputsParams(**value)
                setattr(self, name, value)
            if not isinstance(value, StructuredOutputsParams):
                raise ValueError(f"{name} must be a StructuredOutputsParams, got {type(value).__name__}")
        if self.structured_outputs is not None and self.guided_decoding is not None:
            raise ValueError("structured_outputs and guided_decoding are mutually exclusive")
        given = self.structured_outputs or self.guided_decoding
        constraint = {} if given is None else given.constraint()
        # What an earlier call took from them (verify's, after construction): the one set now
        # decides again; one assigned, replaced or removed since was ignored, the old constraint
        # or none run. (A value that stays is not touched: no reader sees it unset meanwhile.)
        for key, value in self.__dict__.pop("_taken_constraint", {}).items():
            if getattr(self, key) == value and constraint.get(key) != value:
                setattr(self, key, None)
        if given is None:
            return
        for key, value in constraint.items():
            if getattr(self, key) is not None and getattr(self, key) != value:
                raise ValueError(f"{key} and structured_outputs / guided_decoding are mutually exclusive")
            setattr(self, key, value)
        self._taken_constraint = constraint

    @property
    def guided_kind(self) -> str | None:
        """Which output constraint is set: "json", "regex", "choice", "grammar", "structural_tag" or None."""
        if self.structural_tag is not None:
            return "structural_tag"
        return next((k for k in ("json", "regex", "choice", "grammar") if getattr(self, f"guided_{k}") is not None), None)

    def verify(self) -> None:
        """Check the fields again: a field assigned after construction (the dataclass's
        fields can be set, ``params.temperature = -1``) skipped ``__post_init__``'s checks.
        The engine calls it on every request's params. A ``structured_outputs`` or
        ``guided_decoding`` assigned, replaced or removed since sets the ``guided_*``
        field again (as the constructor does).

        Raises:
            ValueError: naming the field, as the constructor does.
        """
        self._take_structured_outputs()  # (structured_outputs / guided_decoding set since)
        for name in ("stop_token_ids", "bad_words", "stop"):
            value = getattr(self, name)
            if not isinstance(value, list):
                raise ValueError(f"{name} must be a list, got {type(value).__name__}")
        if self.logit_bias:
            _parse_logit_bias(self.logit_bias)
            if not all(isinstance(k, int) and not isinstance(k, bool) for k in self.logit_bias):
                raise ValueError("logit_bias keys must be token ids (integers)")
        if self.allowed_token_ids is not None and not isinstance(self.allowed_token_ids, list):
            raise ValueError(f"allowed_token_ids must be a list, got {type(self.allowed_token_ids).__name__}")
        self._verify()

    def _normalise_numbers(self) -> None:
        """Integer fields given as another ``numbers.Integral`` (``numpy.int64``, ...) become
        Python ints, float fields given as another ``numbers.Real`` (``numpy.float32``, ...)
        Python floats, so that nothing downstream sees numpy scalars. bool stays refused
        where it is (``_verify``); anything else is left for ``_verify`` to refuse."""
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, bool) and type(value) is not int:
                setattr(self, name, int(value))
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, numbers.Real) and not isinstance(value, (bool, int, float)):
                setattr(self, name, float(value))
        for name in ("stop_token_ids", "allowed_token_ids"):
            ids = getattr(self, name)
            if isinstance(ids, list):
                setattr(self, name, [int(t) if isinstance(t, numbers.Integral) and not isinstance(t, bool) else t
                                     for t in ids])

    def _verify(self) -> None:
        self._normalise_numbers()
        # (here, not in __post_init__ alone: numpy's -1 is an int only from _normalise_numbers
        # on, and verify sees a seed set after construction; both were kept as the fixed seed -1)
        if type(self.seed) is int and self.seed == -1:
            self.seed = None  # as vLLM's SamplingParams (and llama.cpp's seed -1): no seed, a random draw
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "detokenize",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        self._verify_vllm_extras()
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        _check_number("temperature", self.temperature, finite=True)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool):
            raise ValueError(f"top_k must be an integer, got {self.top_k!r}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or >= 1, got {self.top_k}")
        _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            # torch.Generator.manual_seed would fail later with an unclear "Overflow" error.
            raise ValueError(f"seed must fit in a signed 64-bit integer, got {self.seed}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool)):
            raise ValueError(f"max_tokens must be an integer or None, got {self.max_tokens!r}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool) or self.logprobs < 0
        ):
            raise ValueError(f"logprobs must be a non-negative integer or None, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or isinstance(self.prompt_logprobs, bool) or self.prompt_logprobs < 0
        ):
            raise ValueError(f"prompt_logprobs must be a non-negative integer or None, got {self.prompt_logprobs!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        _check_number("repetition_penalty", self.repetition_penalty, finite=True)
        if not _FLOAT32_TINY <= self.repetition_penalty <= _FLOAT32_MAX:
            # the sampler applies it in float32, where it would become 0 or inf (and 0 * inf a NaN logit)
            raise ValueError(f"repetition_penalty must be > 0 and within float32's normal range "
                             f"[{_FLOAT32_TINY:.4g}, {_FLOAT32_MAX:.4g}], got {self.repetition_penalty}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}")
        if isinstance(self.max_tokens, int) and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if not all(isinstance(w, str) and w for w in self.bad_words):
            raise ValueError("bad_words must be a list of non-empty strings")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        # Bounds: every stop string is searched in the new text at each step and every bad word
        # is a token sequence matched at each step, so their number and length are capped.
        for name, limit in (("stop", MAX_STOP_STRINGS), ("bad_words", MAX_BAD_WORDS),
                            ("stop_token_ids", MAX_STOP_TOKEN_IDS), ("logit_bias", MAX_LOGIT_BIAS)):
            if len(getattr(self, name) or ()) > limit:
                raise ValueError(f"{name} holds {len(getattr(self, name))} entries; at most {limit}")
        for name in ("stop", "bad_words"):
            longest = max((len(s) for s in getattr(self, name)), default=0)
            if longest > MAX_STRING_CHARS:
                raise ValueError(f"{name}: an entry of {longest} characters; at most {MAX_STRING_CHARS}")
        guided = [f"guided_{k}" for k in ("json", "regex", "choice", "grammar") if getattr(self, f"guided_{k}") is not None]
        if len(guided) > 1:
            raise ValueError(f"{' and '.join(guided)} are mutually exclusive")
        if self.guided_choice is not None and (
            not isinstance(self.guided_choice, (list, tuple)) or not self.guided_choice
            or not all(isinstance(c, str) for c in self.guided_choice)
        ):
            raise ValueError("guided_choice must be a non-empty list of strings")
        if self.guided_choice is not None:
            self.guided_choice = list(self.guided_choice)
            if len(self.guided_choice) > MAX_GUIDED_CHOICES:
                raise ValueError(f"guided_choice: {len(self.guided_choice)} choices; at most {MAX_GUIDED_CHOICES}")
            longest = max(len(c) for c in self.guided_choice)
            if longest > MAX_STRING_CHARS:
                raise ValueError(f"guided_choice: a choice of {longest} characters; at most {MAX_STRING_CHARS}")
        if self.guided_grammar is not None and (not isinstance(self.guided_grammar, str) or not self.guided_grammar.strip()):
            raise ValueError("guided_grammar must be a non-empty string")
        if self.structural_tag is not None and guided:
            raise ValueError(f"structural_tag cannot be combined with {guided[0]}")
        if guided and self.ignore_eos:
            # the constraint's grammar ends the output once it is complete: EOS is then the
            # only token it allows, so ignoring EOS cannot be honoured
            raise ValueError(f"ignore_eos cannot be combined with {guided[0]}: the constraint ends the output "
                             "once it is complete")
        # min_tokens is honoured with one, as vLLM does (vllm-project/vllm#54218): EOS and the
        # stop tokens stay masked while the grammar allows another token; once it allows
        # only those, the grammar wins and ends the output (sample/logits_processor.py)
        if self.structural_tag is not None and not isinstance(self.structural_tag, (dict, str)):
            raise ValueError("structural_tag must be a dict or a JSON string")
        if self.guided_json is not None and not isinstance(self.guided_json, (dict, str)):
            raise ValueError("guided_json must be a JSON schema (dict or JSON string)")
        if self.guided_regex is not None and not isinstance(self.guided_regex, str):
            raise ValueError("guided_regex must be a string")
        for tok in self.stop_token_ids:
            if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
                raise ValueError(f"stop_token_ids must hold non-negative integers, got {tok!r}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (None allows every token)")
            if len(self.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS:
                raise ValueError(f"allowed_token_ids holds {len(self.allowed_token_ids)} entries; "
                                 f"at most {MAX_ALLOWED_TOKEN_IDS}")
            for tok in self.allowed_token_ids:
                if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
                    raise ValueError(f"allowed_token_ids must hold non-negative integers, got {tok!r}")
            if len(set(self.allowed_token_ids)) < len(self.allowed_token_ids):  # (duplicates change nothing)
                self.allowed_token_ids = list(dict.fromkeys(self.allowed_token_ids))

    def _verify_vllm_extras(self) -> None:
        """``detokenize``, ``spaces_between_special_tokens``, ``extra_args``, ``best_of`` and
        ``logits_processors`` (see the class docstring)."""
        if not self.detokenize and self.stop:
            raise ValueError("stop strings need detokenize=True (they are matched in the text, which "
                             "detokenize=False does not make; vLLM's rule); use stop_token_ids")
        if not self.spaces_between_special_tokens and not self.skip_special_tokens:
            raise ValueError("spaces_between_special_tokens=False is not supported by kvflow (with "
                             "skip_special_tokens=False); leave it True")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args must be a dict or None, got {type(self.extra_args).__name__}")
        if self.best_of is not None and (not isinstance(self.best_of, int) or isinstance(self.best_of, bool)
                                         or self.best_of != self.n):
            raise ValueError(f"best_of={self.best_of!r} is not supported by kvflow (vLLM's SamplingParams no longer "
                             "has it either): n samples give n outputs; leave best_of None")
        if self.logits_processors is not None and (not isinstance(self.logits_processors, (list, tuple))
                                                   or len(self.logits_processors) > 0):
            raise ValueError("logits_processors is not supported by kvflow (per-request logits processors are not "
                             "run); leave it None")
        for name, (neutral, why) in VLLM_NEUTRAL.items():
            value = getattr(self, name)
            if not any(value is n or (type(value) is type(n) and value == n) for n in neutral):
                raise ValueError(f"{name}={value!r} is not supported by kvflow ({why}); leave it unset"[:400])
        if not isinstance(self.skip_clone, bool):
            raise ValueError(f"skip_clone must be a bool, got {self.skip_clone!r}")

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax token at every step."""
        return self.temperature < _GREEDY_EPS or self.top_k == 1


#: vLLM 0.32's ``SamplingParams`` fields kvflow does not implement: field -> (the values that
#: change nothing, why another value is refused).
VLLM_NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "thinking_token_budget": ((None,), "no cap on reasoning tokens"),
    "repetition_detection": ((None,), "no repetition stop"),
    "logprob_token_ids": ((None, []), "logprobs are the top `logprobs` tokens and the sampled one"),
    "prompt_logprob_token_ids": ((None, []), "prompt logprobs are the top `prompt_logprobs` tokens and the "
                                 "prompt's own"),
    "prompt_logprob_start": ((None, 0), "prompt logprobs cover the whole prompt"),
    "watermarking": ((None, False), "no watermarking"),
    "flat_logprobs": ((False,), "logprobs are a list of {token id: Logprob} dicts"),
    "stream_interval": ((None, 1), "streamed outputs come every step"),
    "skip_reading_prefix_cache": ((None, False), "a request always reads the prefix cache (its outputs do "
                                  "not depend on it)"),
    "routed_experts_prompt_start": ((0,), "no routed-expert data is returned"),
}

#: Bounds on the list fields (a request past one is a ValueError naming the field).
MAX_STOP_STRINGS = 64
MAX_BAD_WORDS = 1024
MAX_STOP_TOKEN_IDS = 1024
#: The most ``logit_bias`` entries (each is applied at every step; ``allowed_token_ids`` is the
#: way to keep a set of tokens, ``bad_words`` to ban words).
MAX_LOGIT_BIAS = 1024
#: The most ``allowed_token_ids`` (Gemma 3's vocabulary, the largest kvflow runs: 262,144).
MAX_ALLOWED_TOKEN_IDS = 1 << 18
#: The longest ``stop`` string, ``bad_words`` entry or ``guided_choice`` choice, in characters.
MAX_STRING_CHARS = 1024
#: The most ``guided_choice`` choices (the grammar engine, llguidance, gives up on a rule of
#: 2,000 alternatives and more: the output would not be one of them).
MAX_GUIDED_CHOICES = 1024

# The fields ``_normalise_numbers`` turns into Python ints / floats.
_INT_FIELDS = ("n", "top_k", "seed", "max_tokens", "logprobs", "prompt_logprobs", "min_tokens",
               "truncate_prompt_tokens", "best_of")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")

_FLOAT32_MAX = 3.4028234663852886e38
_FLOAT32_TINY = 1.1754943508222875e-38


def check_truncate_prompt_tokens(value: object) -> None:
    """``truncate_prompt_tokens`` (of ``SamplingParams`` and ``PoolingParams``): None, -1 or
    an integer >= 1.

    Raises:
        ValueError: naming the field, for anything else.
    """
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or not (value == -1 or value >= 1):
        raise ValueError(f"truncate_prompt_tokens must be -1 (the context's size) or an integer >= 1, got {value!r}")


_MASK64 = (1 << 64) - 1


def generator_seed(seed: int) -> int:
    """The seed a request's CPU ``torch.Generator`` is given for ``SamplingParams.seed``.

    PyTorch's CPU generator (Mersenne Twister) keeps only the low 32 bits of its seed
    (``mt19937``'s ``init_with_uint32``), so seeds ``s`` and ``s + 2**32`` (or ``-1`` and
    ``2**63 - 1``) drew the same numbers. Seeds in [0, 2**32) are used as given (their samples
    are unchanged); any other is first mixed by splitmix64 (Steele, Lea and Flood 2014, "Fast
    splittable pseudorandom number generators", the ``mix64`` finalizer) over its 64-bit
    two's-complement value, so that two seeds meet only by chance (2**-32 a pair), never by
    such a pattern.

    Args:
        seed: an integer in [-2**63, 2**63) (``SamplingParams`` checks it).

    Returns:
        An integer in [0, 2**32).
    """
    if 0 <= seed < 1 << 32:
        return seed
    z = (seed + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & 0xFFFFFFFF


def _check_number(name: str, value: object, finite: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value != value:  # NaN
        raise ValueError(f"{name} must not be NaN")
    if finite:
        try:
            finite_value = math.isfinite(value)
        except OverflowError:  # an int past float's range (math.isfinite converts it to float)
            raise ValueError(f"{name} must be a finite number, got an integer of {value.bit_length()} bits, "
                             "beyond float's range") from None
        if not finite_value:
            raise ValueError(f"{name} must be a finite number, got {value}")


def _clamp_bias(value: object) -> object:
    """A ``logit_bias`` value clamped to [-100, 100] (``from_optional``); anything but a
    real number other than NaN (bool included) is returned as given, for the constructor to
    refuse naming ``logit_bias``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or value != value:
        return value
    return min(100.0, max(-100.0, value))


def _parse_logit_bias(bias: object) -> dict[int, float]:
    """``logit_bias`` with int keys: keys are ints or integer strings (JSON object keys are
    strings) >= 0, values numbers in [-100, 100].

    Raises:
        ValueError: naming ``logit_bias``, for anything else.
    """
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must map token ids to numbers, got {type(bias).__name__}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        if isinstance(key, str) and re.fullmatch(r"-?[0-9]+", key):
            token = int(key)
        elif isinstance(key, numbers.Integral) and not isinstance(key, bool):
            token = int(key)
        else:
            raise ValueError(f"logit_bias keys must be token ids (integers), got {key!r}")
        if token < 0:
            raise ValueError(f"logit_bias keys must be token ids >= 0, got {token}")
        if isinstance(value, numbers.Real) and not isinstance(value, (bool, int, float)):
            value = float(value)
        _check_number("logit_bias", value)
        if not -100.0 <= value <= 100.0:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {token}: {value}")
        out[token] = float(value)
    return out
