"""Request bodies of the OpenAI-compatible API (pydantic), and their sampling parameters.

Field names and defaults follow the OpenAI API reference (completions and chat completions)
plus the extra sampling fields vLLM accepts (top_k, min_p, repetition_penalty, min_tokens,
ignore_eos, stop_token_ids, bad_words, skip_special_tokens, include_stop_str_in_output,
guided_json, guided_regex, guided_choice, guided_grammar, structured_outputs), vLLM's
``priority``, and SGLang's ``regex`` and ``ebnf`` (compiled as ``guided_regex`` and
``guided_grammar``). Responses are built as plain dicts in
``server.py`` so that no field is sent as an explicit null.

Validation is strict: a number field takes a JSON number (not ``true``, not ``"0.5"``), an
integer field an integer (not ``2.0``), and no float may be NaN or infinite. Fields of the
OpenAI API (or well-known vLLM extras) that kvflow does not implement and that would change
the result are declared here, and other servers' and APIs' such fields (llama.cpp's
``mirostat``, vLLM's ``cache_salt``, Chat's ``seed`` sent to Responses ...) are named in
``FOREIGN_FIELDS``, so that ``unsupported_field`` refuses them by name; any other unknown field
(one that changes nothing here, such as a client's bookkeeping) is accepted and logged once.
"""

from __future__ import annotations

import functools
import json
import logging
import typing
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationInfo, field_validator, model_validator

from kvflow.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)
_warned_fields: set[str] = set()
_MAX_WARNED_FIELDS = 100  # distinct names logged; a client inventing names cannot grow this

# vLLM's range of ``priority`` (a signed 64-bit integer).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

# ``metadata`` within OpenAI's documented bounds (16 pairs; keys up to 64 characters, values up
# to 512): kvflow keeps none of it, but a request may not carry an unbounded map of it either.
Metadata = Annotated[
    dict[Annotated[str, StringConstraints(max_length=64)], Annotated[str, StringConstraints(max_length=512)]],
    Field(max_length=16),
]

#: The most tools one request may declare (OpenAI's limit, 128 functions), on Chat
#: Completions, Responses and Anthropic Messages: each tool's schema becomes part of the
#: grammar that constrains tool calls, and llguidance gives up on thousands of them.
MAX_TOOLS = 128


def check_tool_count(tools: Any) -> Any:
    """``tools`` unchanged (a pydantic ``mode="before"`` validator: the raw list, before its
    items are parsed).

    Raises:
        ValueError: naming ``tools``, for a list of more than ``MAX_TOOLS`` tools.
    """
    if isinstance(tools, list) and len(tools) > MAX_TOOLS:
        raise ValueError(f"tools holds {len(tools)} tools; at most {MAX_TOOLS} (OpenAI's limit)")
    return tools


# Defaults of the sampling fields a request leaves unset when the model has no
# generation_config.json (documented in docs/serving.md, "Defaults of unset fields").
BUILTIN_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


#: The request fields that constrain the whole output, as sent (SGLang's ``regex`` / ``ebnf`` are
#: compiled as ``guided_regex`` / ``guided_grammar``).
CONSTRAINT_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs", "regex",
                     "ebnf")
# SGLang's field -> the guided_* field it is compiled as
_SGLANG_CONSTRAINTS = {"regex": "guided_regex", "ebnf": "guided_grammar"}


def _needs_flag(value: Any, info: ValidationInfo, flag: str, message: str) -> Any:
    """A field that only means something with ``flag`` set (as OpenAI and vLLM refuse it, rather
    than drop it silently): ``value`` unchanged, or ValueError(``message``) when ``flag`` is unset.
    ``flag`` must be declared before the field (pydantic validates in declaration order)."""
    if value is not None and not info.data.get(flag):
        raise ValueError(message)
    return value


class _Body(BaseModel):
    """Strict types, finite floats; unknown fields are kept (``model_extra``) to be logged."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """An explicit null for an optional field whose type has no null (``"stream": null``,
        ``"n": null``: nullable in OpenAI's API, and vLLM takes them) is the field left unset;
        a field that takes null (``max_tokens``: what is left of the context) keeps it."""
        if not isinstance(data, dict):
            return data
        drop = [key for key, value in data.items() if value is None and key in _optional_non_null(cls)]
        return {k: v for k, v in data.items() if k not in drop} if drop else data

    @model_validator(mode="after")
    def _warn_unknown_fields(self):
        for name in self.model_extra or {}:
            if name in FOREIGN_FIELDS:  # refused by name (unsupported_field), or set to its neutral value
                continue
            key = f"{type(self).__name__}.{name}"
            if key in _warned_fields or len(_warned_fields) > _MAX_WARNED_FIELDS:
                continue
            _warned_fields.add(key)
            if len(_warned_fields) > _MAX_WARNED_FIELDS:
                logger.warning("more unknown fields are ignored without a warning")
            else:
                logger.warning("ignoring the unknown field %r of %s (logged once)", name, type(self).__name__)
        return self

    # field -> the values that change nothing (None always does): set to anything else, the
    # field is refused.
    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {}

    def unsupported_field(self) -> tuple[str, str] | None:
        """(field, message) for the first field set to a value kvflow does not implement: a
        declared field of ``UNSUPPORTED``, or an undeclared one named in ``FOREIGN_FIELDS``
        (another API's or server's field that would change the output here)."""
        for name, harmless in self.UNSUPPORTED.items():
            value = getattr(self, name)
            if value is not None and value not in harmless:
                return name, f"{name} is not supported by kvflow (set to {_short(value)}); leave it unset"
        for name, value in (self.model_extra or {}).items():
            harmless = FOREIGN_FIELDS.get(name)
            if harmless is not None and value is not None and not _same(value, harmless):
                return name, (f"{name} is not supported by kvflow on this endpoint (set to {_short(value)}); "
                              "leave it unset")
        return None


@functools.cache
def _optional_non_null(cls: type[BaseModel]) -> frozenset[str]:
    """The names (as sent: aliases) of ``cls``'s fields that have a default and no null in
    their type."""
    names = set()
    for name, field in cls.model_fields.items():
        if field.is_required() or field.annotation is Any:
            continue
        ann = field.annotation
        if ann is type(None) or type(None) in typing.get_args(ann):
            continue
        names.add(field.alias or name)
    return frozenset(names)


def _same(value: Any, harmless: tuple[Any, ...]) -> bool:
    """``value`` is one of ``harmless`` (a bool is not taken for 0 or 1)."""
    return any(type(value) is type(h) and value == h or (type(value) in (int, float) and type(h) in (int, float)
                                                          and value == h) for h in harmless)


# Fields of other APIs and servers (vLLM, llama.cpp, OpenAI's other endpoints, Anthropic's) that
# a body here does not declare but that would change the output if honoured: refused by name
# when set to anything but their neutral values (the tuples), rather than logged and dropped.
# A body that declares one of these names handles it itself.
FOREIGN_FIELDS: dict[str, tuple[Any, ...]] = {
    # sampling of other servers (llama.cpp, text-generation-webui, vLLM)
    "typical_p": (1, 1.0), "tfs_z": (1, 1.0), "top_a": (0, 0.0), "top_n_sigma": (-1, -1.0),
    "mirostat": (0,), "mirostat_mode": (0,), "dry_multiplier": (0, 0.0), "xtc_probability": (0, 0.0),
    "epsilon_cutoff": (0, 0.0), "eta_cutoff": (0, 0.0), "no_repeat_ngram_size": (0,),
    "penalty_alpha": (0, 0.0), "dynatemp_range": (0, 0.0), "repeat_penalty": (1, 1.0),
    "n_probs": (0,), "n_predict": (), "num_predict": (), "grammar": (), "json_schema": (),
    "penalty_last_n": (), "smoothing_factor": (0, 0.0), "smoothing_curve": (1, 1.0), "temperature_last": (False,),
    "dynamic_temperature": (False,), "guidance_scale": (1, 1.0), "negative_prompt": (),
    "encoder_repetition_penalty": (1, 1.0), "repetition_penalty_range": (),
    # llama-server's other request fields that change the output or the answer's shape (its
    # cache_prompt, id_slot, n_keep and the parameters of samplers refused above change neither)
    "repeat_last_n": (),  # llama.cpp's older name of penalty_last_n
    "samplers": (), "min_keep": (0,), "n_indent": (0,), "t_max_predict_ms": (-1, 0), "t_max_prompt_ms": (-1, 0),
    "lora": ([],), "image_data": ([],), "multimodal_data": ([],),
    "return_tokens": (False,), "post_sampling_probs": (False,), "timings_per_token": (False,),
    "return_progress": (False,), "response_fields": ([],),
    # llama-server's /tokenize fields (its prompt is content; kvflow parses special tokens, as parse_special)
    "with_pieces": (False,), "add_special": (), "parse_special": (True,),
    # Hugging Face TGI's and transformers' generation fields
    "max_new_tokens": (), "do_sample": (True,), "return_full_text": (False,), "watermark": (False,),
    "truncate": (), "top_n_tokens": (0,),
    # vLLM request fields kvflow does not implement
    "add_special_tokens": (), "spaces_between_special_tokens": (True,), "cache_salt": (), "detokenize": (True,),
    "kv_transfer_params": (), "vllm_xargs": ({},), "logits_processors": (), "mm_processor_kwargs": (),
    "min_p_tokens": (), "guided_whitespace_pattern": (), "structural_tag": (),
    "return_token_ids": (False,),  # vLLM >= 0.10.2: the ids in the response; kvflow's answer has none
    "include_reasoning": (True,),  # vLLM's: false drops the reasoning from the answer; not implemented
    "guided_decoding_backend": ("auto", "guidance", "llguidance"),  # kvflow's grammar engine is llguidance
    # vLLM 0.2x-0.3x's newer request fields that change the output or the answer's shape
    "thinking_token_budget": (),  # caps the reasoning tokens
    "truncation_side": ("left",),  # "right" keeps the first truncate_prompt_tokens; kvflow keeps the last
    "logprob_token_ids": ([],),  # the logprobs of these ids at each position
    "repetition_detection": (),  # ends an output that repeats an n-gram
    "return_prompt_text": (False,),  # the rendered prompt in the answer
    "watermarking": (False,), "ec_transfer_params": (),
    # sampling fields of one API sent to an endpoint of another (OpenAI Chat's on Responses or
    # Anthropic's Messages, and the like)
    "n": (1,), "best_of": (1,), "seed": (), "stop": ([],), "suffix": ("",), "logit_bias": ({},),
    "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "repetition_penalty": (1, 1.0),
    "min_tokens": (0,), "ignore_eos": (False,), "logprobs": (False, 0), "stop_token_ids": ([],),
    "top_k": (-1, 0), "min_p": (0, 0.0), "response_format": ({"type": "text"},), "stop_sequences": ([],),
    "max_tokens": (), "max_completion_tokens": (), "top_logprobs": (0,), "echo": (False,),
    "max_output_tokens": (), "text": ({"format": {"type": "text"}},), "output_config": ({},), "instructions": (),
    "system": (), "reasoning": ({},), "thinking": ({"type": "disabled"},),
    # vLLM's request fields that only its completions / chat bodies here declare
    "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (), "structured_outputs": (),
    "bad_words": ([],), "allowed_token_ids": (), "priority": (0,), "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,), "truncate_prompt_tokens": (),
    "regex": (), "ebnf": (),  # SGLang's names of guided_regex / guided_grammar (completions and chat)
    # SGLang's request fields (sglang-router's clients send them) kvflow does not implement
    "lora_path": (),  # kvflow serves an adapter as a model of its own: send its name as model
    "no_stop_trim": (False,), "stop_regex": ([],), "custom_logit_processor": (), "custom_params": ({},),
    "session_params": (), "input_ids": (), "return_hidden_states": (False,), "return_routed_experts": (False,),
    "return_cached_tokens_details": (False,), "return_prompt_token_ids": (False,), "return_meta_info": (False,),
    "separate_reasoning": (True,), "stream_reasoning": (True,),
}  # fmt: skip


def unsupported_message_field(messages: list[Any]) -> tuple[str, str] | None:
    """("messages", message) for the first field of a message kvflow does not implement."""
    for i, message in enumerate(messages):
        found = message.unsupported_field()
        if found is not None:
            return "messages", f"messages[{i}].{found[1]}"
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class StreamOptions(_Body):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # no effect on the content
    continuous_usage_stats: bool | None = None  # vLLM's usage in every chunk: not implemented

    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {"continuous_usage_stats": (False,)}


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None
    # llama-server's form of a schema: {"type": "json_object", "schema": {...}} (type
    # json_object only; json_schema's is json_schema.schema)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")


class _SamplingRequest(_Body):
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # OpenAI fields that do not change the output
    user: str | None = None
    store: bool | None = None
    metadata: Metadata | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None  # the prompt's last k tokens (-1: as many as fit)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM >= 0.11's form of the four above: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}
    structured_outputs: dict[str, Any] | None = None
    # SGLang's names of guided_regex and guided_grammar (its EBNF is the GBNF the grammar engine reads)
    regex: str | None = None
    ebnf: str | None = None
    # OpenAI chat's output format; vLLM takes it on completions too (json_object / json_schema)
    response_format: ResponseFormat | None = None
    # vLLM: add the tokenizer's special tokens (BOS) to the prompt; only its default is served
    add_special_tokens: bool | None = None
    # scheduling priority (lower first); other than 0 it needs --scheduling-policy priority
    priority: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    # vLLM extras kvflow does not implement (refused when set; see unsupported_field)
    use_beam_search: Any = None
    length_penalty: Any = None
    prompt_logprobs: Any = None
    return_tokens_as_token_ids: Any = None

    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {
        "use_beam_search": (False,),
        "length_penalty": (1, 1.0), "prompt_logprobs": (),
        "return_tokens_as_token_ids": (False,),
    }  # fmt: skip

    def unsupported_field(self) -> tuple[str, str] | None:
        """See ``_Body.unsupported_field``; also looks into ``stream_options``."""
        found = super().unsupported_field()
        if found is None and self.stream_options is not None:
            inner = self.stream_options.unsupported_field()
            if inner is not None:
                return "stream_options", f"stream_options.{inner[1]}"
        return found

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value, info: ValidationInfo):
        return _needs_flag(value, info, "stream", "stream_options can only be set when stream is true")

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        defaults: dict[str, Any] | None = None,
    ) -> SamplingParams:
        """The engine's parameters for this request; a field left unset takes the model's
        generation-config default (``defaults``), else ``BUILTIN_DEFAULTS``.

        SGLang's ``regex`` is compiled as ``guided_regex`` and its ``ebnf`` as
        ``guided_grammar`` (GBNF, which the grammar engine reads).

        Raises:
            ValueError: naming the field, for an invalid value; SGLang's ``regex`` / ``ebnf``
                together with another output constraint; ``ignore_eos`` together
                with an output constraint (``output_constraint``), which ends the output
                where its grammar is complete. (``min_tokens`` is honoured with one, as
                vLLM does: until the grammar allows only EOS, which then ends the output.)
        """
        constraint = self.output_constraint()
        set_ = [name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None]
        if len(set_) > 1 and set(set_) & set(_SGLANG_CONSTRAINTS):
            raise ValueError(f"{set_[-1]} cannot be combined with {set_[0]}: send one output constraint")
        if constraint is not None and self.ignore_eos:
            raise ValueError(f"ignore_eos cannot be combined with {constraint}: the output constraint ends the "
                             "output once it is complete")
        chosen = {**BUILTIN_DEFAULTS, **(defaults or {})}

        def pick(name: str):
            value = getattr(self, name)
            return chosen[name] if value is None else value

        return SamplingParams(
            n=self.n,
            temperature=pick("temperature"),
            top_p=pick("top_p"),
            top_k=pick("top_k"),
            min_p=pick("min_p"),
            seed=self.seed,
            max_tokens=max_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=pick("repetition_penalty"),
            logit_bias=self.logit_bias,
            min_tokens=self.min_tokens,
            bad_words=self.bad_words,
            allowed_token_ids=self.allowed_token_ids,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            guided_json=self.guided_schema(),
            guided_regex=self.guided_regex if self.regex is None else self.regex,
            guided_choice=self.guided_choice,
            guided_grammar=self.guided_grammar if self.ebnf is None else self.ebnf,
            structured_outputs=self._structured_outputs(),
        )

    def output_constraint(self) -> str | None:
        """The field that constrains the whole output (``guided_*``, ``structured_outputs``,
        SGLang's ``regex`` / ``ebnf``, ``response_format`` other than text), or None."""
        for name in CONSTRAINT_FIELDS:
            if getattr(self, name) is not None:
                return name
        if self.response_format is not None and self.response_format.type != "text":
            return "response_format"
        return None

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """``structured_outputs`` as vLLM's ``StructuredOutputsParams``.

        Raises:
            ValueError: naming structured_outputs, for an unknown key or not exactly one
                constraint.
        """
        if self.structured_outputs is None:
            return None
        try:
            return StructuredOutputsParams(**self.structured_outputs)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"structured_outputs is invalid: {exc}") from None

    def guided_schema(self) -> dict[str, Any] | str | None:
        """The JSON schema that constrains the output, if any: ``guided_json``, else
        ``response_format``'s (json_object: any JSON object, or llama-server's ``schema`` beside
        it).

        Raises:
            ValueError: naming response_format, for type json_schema without a schema, a
                ``schema`` beside a type other than json_object, or a response_format together
                with another output constraint.
        """
        if self.response_format is not None and self.response_format.type != "text":
            other = next((name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None), None)
            if other is not None:
                raise ValueError(f"response_format cannot be combined with {other}: send one output constraint")
        if self.response_format is not None and self.response_format.schema_ is not None and (
                self.response_format.type != "json_object"):
            raise ValueError(f"response_format.schema is read with type json_object (llama-server's form), not "
                             f"{self.response_format.type}: send json_schema.schema for type json_schema")
        if self.guided_json is not None or self.response_format is None:
            return self.guided_json
        if self.response_format.type == "json_object":
            return {"type": "object"} if self.response_format.schema_ is None else self.response_format.schema_
        if self.response_format.type == "json_schema":
            spec = self.response_format.json_schema
            if spec is None or spec.schema_ is None:
                raise ValueError("response_format.json_schema.schema is required for type json_schema")
            return spec.schema_
        return None


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    # OpenAI fields kvflow does not implement
    best_of: int | None = None
    suffix: str | None = None

    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {
        **_SamplingRequest.UNSUPPORTED, "best_of": (1,), "suffix": ("",), "add_special_tokens": (True,),
    }  # fmt: skip


class FunctionDefinition(_Body):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    # Under "required" / a named tool_choice the arguments always follow the schema; under
    # "auto" they are the model's (as vLLM).
    strict: bool | None = None


class ChatTool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text of an object

    @field_validator("arguments")
    @classmethod
    def _json_arguments(cls, arguments):
        try:
            json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise ValueError(f"arguments is not valid JSON: {exc}") from None
        except RecursionError:  # (the body's own nesting is bounded; this JSON text is not: it was a 500)
            raise ValueError("arguments is nested too deeply") from None
        return arguments


class ToolCallMessage(_Body):
    """A tool call of an earlier assistant message."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall



_MESSAGE_UNSUPPORTED: dict[str, tuple[Any, ...]] = {"function_call": (), "audio": (), "refusal": ()}
# chat_template_kwargs may not set these: the server sets them (apply_chat_template's own
# arguments and the template variables it fills).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
     "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
     "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}
)  # fmt: skip


def check_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    """``chat_template_kwargs`` unchanged (a pydantic field validator of the endpoints that
    render the chat template: /v1/chat/completions, /tokenize).

    Raises:
        ValueError: naming the key, for one the server sets itself (``RESERVED_TEMPLATE_KWARGS``).
    """
    for key in kwargs or {}:
        if key in RESERVED_TEMPLATE_KWARGS:
            raise ValueError(f"chat_template_kwargs may not set {key!r} (the server sets it)")
    return kwargs


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None  # given to the chat template
    tool_calls: list[ToolCallMessage] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages
    # OpenAI message fields kvflow does not implement
    function_call: Any = None
    audio: Any = None
    refusal: Any = None

    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = _MESSAGE_UNSUPPORTED

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, content):
        if isinstance(content, list):
            for part in content:
                kind = part.get("type")
                if kind != "text":
                    raise ValueError(
                        f"content parts of type {_short(kind)} are not supported by kvflow (text parts only: "
                        "the served models read text)"
                    )
                if not isinstance(part.get("text"), str):
                    raise ValueError("the text of a text content part must be a string")
        return content

    @model_validator(mode="after")
    def _tool_fields(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls is for assistant messages, not {self.role}")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs tool_call_id (the id of the call it answers)")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError(f"tool_call_id is for tool messages, not {self.role}")
        if self.content is None and self.role != "assistant":  # (OpenAI: content is required but there)
            raise ValueError(f"a {self.role} message needs content")
        if self.content == []:  # (OpenAI: "empty array. Expected an array with minimum length 1")
            raise ValueError("content is an empty list of parts; send at least one part (or a string)")
        return self

    def text(self) -> str:
        """The message text; list content joins its text parts, in order."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part["text"] for part in self.content)

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it, as transformers' ``apply_chat_template``
        takes it: developer renders as system; tool calls have their arguments as a dict
        (Qwen2.5's template writes ``tool_call.arguments | tojson``, which would quote a
        JSON string a second time); null content is ""."""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": json.loads(c.function.arguments)}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def check_tool_answers(messages: list[ChatMessage]) -> list[ChatMessage]:
    """``messages`` unchanged when every tool message answers a call of an earlier assistant
    message (its ``tool_call_id`` is the id of one of their ``tool_calls``) and follows an
    assistant message with ``tool_calls`` (only tool messages between them: OpenAI's "messages
    with role 'tool' must be a response to a preceding message with 'tool_calls'"), and every
    call of an assistant message that the conversation goes on from is answered by the tool
    messages right after it, as OpenAI requires.

    Raises:
        ValueError: naming the message, its ``tool_call_id`` and the unknown id, or the
            message it follows; or naming the assistant message and the ids of its calls
            left unanswered.
    """
    call_ids: set[str] = set()
    follows_calls = False  # the messages since the last non-tool one: an assistant message with tool_calls
    for i, message in enumerate(messages):
        if message.role == "assistant":
            call_ids.update(call.id for call in message.tool_calls or [])
        elif message.role == "tool" and message.tool_call_id not in call_ids:
            before = ("no assistant message before it has tool_calls" if not call_ids
                      else "no tool_calls entry of an earlier assistant message has that id")
            raise ValueError(f"messages[{i}].tool_call_id {_short(message.tool_call_id)} answers no tool call: "
                             f"{before} (a tool message answers a call of an earlier assistant message)")
        elif message.role == "tool" and not follows_calls:
            raise ValueError(f"messages[{i}]: a tool message must follow an assistant message with tool_calls (or "
                             f"that message's other tool messages); it follows a {messages[i - 1].role} message")
        if message.role != "tool":
            follows_calls = message.role == "assistant" and bool(message.tool_calls)
    for i, message in enumerate(messages[:-1]):  # (the last one's calls: nothing went on from them)
        if message.role == "assistant" and message.tool_calls:
            answered = set()
            for later in messages[i + 1:]:
                if later.role != "tool":
                    break
                answered.add(later.tool_call_id)
            missing = [call.id for call in message.tool_calls if call.id not in answered]
            if missing:
                raise ValueError(f"messages[{i}]: an assistant message with 'tool_calls' must be followed by tool "
                                 "messages responding to each 'tool_call_id'. The following tool_call_ids did not "
                                 f"have response messages: {', '.join(_short(x) for x in missing)}")
    return messages


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # tool calling (kvflow/entrypoints/openai/tools.py)
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM: extra variables of the chat template (e.g. {"enable_thinking": false})
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM: end the prompt with the assistant's turn header (the default), or leave the last
    # message open for the model to continue it (assistant prefill); not both
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # OpenAI fields kvflow does not implement
    functions: list[Any] | None = None
    function_call: Any = None
    prediction: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    moderation: Any = None
    # vLLM / completions fields kvflow does not implement on chat
    best_of: int | None = None
    suffix: str | None = None
    echo: Any = None
    chat_template: Any = None
    documents: Any = None

    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {
        **_SamplingRequest.UNSUPPORTED,
        "functions": ([],), "function_call": ("none", "auto"),
        "prediction": (),
        "audio": (), "modalities": (["text"],), "web_search_options": (), "reasoning_effort": (), "verbosity": (),
        "moderation": (), "best_of": (1,), "suffix": ("",), "add_special_tokens": (False,),
        "echo": (False,), "chat_template": (),
        "documents": (),
    }  # fmt: skip

    def unsupported_field(self) -> tuple[str, str] | None:
        """See ``_Body.unsupported_field``; also looks into the messages."""
        return super().unsupported_field() or unsupported_message_field(self.messages)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value, info: ValidationInfo):
        return _needs_flag(value, info, "logprobs", "top_logprobs needs logprobs: true")

    _tools_bounded = field_validator("tools", mode="before")(check_tool_count)
    _tool_answers = field_validator("messages")(check_tool_answers)

    _free_template_kwargs = field_validator("chat_template_kwargs")(check_template_kwargs)

    @field_validator("continue_final_message")
    @classmethod
    def _not_both(cls, value, info: ValidationInfo):
        """vLLM's rule (its message): the prompt either opens a new assistant turn or
        continues the last message."""
        if value and info.data.get("add_generation_prompt"):
            raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        return value

    def output_constraint(self) -> str | None:
        """As the base class's; also ``tool_choice`` when it forces a tool call."""
        if self.tools and self.tool_choice not in (None, "none", "auto"):
            return "tool_choice"
        return super().output_constraint()

    def guided_schema(self) -> dict[str, Any] | str | None:
        """The schema of ``tool_choice`` "required" / a named function
        (``tools.tool_choice_schema``), else ``guided_json`` or ``response_format``'s
        (json_object: any JSON object).

        Raises:
            ValueError: naming the field, for a tool_choice that does not fit the tools, or
                a forced tool call together with another output constraint.
        """
        from kvflow.entrypoints.openai.tools import check_tools, tool_choice_schema

        check_tools(self.tools, self.tool_choice)
        if self.tools and self.tool_choice not in (None, "none", "auto"):
            constrained = any(getattr(self, name) is not None for name in CONSTRAINT_FIELDS) or (
                self.response_format is not None and self.response_format.type != "text"
            )
            if constrained:
                raise ValueError("tool_choice (a forced tool call) cannot be combined with response_format, "
                                 "guided_json, guided_regex, guided_choice, guided_grammar, structured_outputs, "
                                 "regex or ebnf")
            return tool_choice_schema(self.tools, self.tool_choice, self.parallel_tool_calls is not False)
        return super().guided_schema()


class LoadLoRAAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's body): serve the PEFT adapter folder ``lora_path``
    as model ``lora_name``. Unknown fields (vLLM's ``load_inplace``) are refused by name."""

    model_config = ConfigDict(strict=True, extra="forbid")

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter (vLLM's body): stop serving adapter ``lora_name``."""

    model_config = ConfigDict(strict=True, extra="forbid")

    lora_name: str = Field(min_length=1, max_length=256)
