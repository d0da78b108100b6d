"""Request bodies of the OpenAI-compatible API (pydantic), and their sampling parameters.

Field names and defaults follow the OpenAI API reference (completions and chat completions)
plus the extra sampling fields vLLM accepts (top_k, min_p, repetition_penalty, min_tokens,
ignore_eos, stop_token_ids, skip_special_tokens, include_stop_str_in_output, guided_json,
guided_regex). Responses are built as plain dicts in ``server.py`` so that no field is sent
as an explicit null.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvflow.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

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
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None

    def sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None) -> SamplingParams:
        """The engine's parameters for this request.

        Raises:
            ValueError: naming the field, for an invalid value.
        """
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            max_tokens=max_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=self.logit_bias,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            guided_json=self.guided_schema(),
            guided_regex=self.guided_regex,
        )

    def guided_schema(self) -> dict[str, Any] | str | None:
        """The JSON schema that constrains the output, if any."""
        return self.guided_json


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_are_strings(cls, content):
        if isinstance(content, list):
            for part in content:
                if part.get("type", "text") == "text" and not isinstance(part.get("text", ""), str):
                    raise ValueError("the text of a text content part must be a string")
        return content

    def text(self) -> str:
        """The message text; list content keeps its "text" parts, in order."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.get("text", "") for part in self.content if part.get("type", "text") == "text")


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: dict[str, Any] | None = None


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None

    def guided_schema(self) -> dict[str, Any] | str | None:
        """``guided_json`` from ``response_format`` (json_object: any JSON object)."""
        if self.guided_json is not None or self.response_format is None:
            return self.guided_json
        if self.response_format.type == "json_object":
            return {"type": "object"}
        if self.response_format.type == "json_schema":
            spec = self.response_format.json_schema or {}
            return spec.get("schema", spec)
        return None
