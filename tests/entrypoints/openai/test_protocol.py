"""The request models: strict types, unsupported fields by name, defaults of unset fields."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvflow.entrypoints.openai.protocol import BUILTIN_DEFAULTS, ChatCompletionRequest, CompletionRequest

MSG = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize(
    "field,value",
    [("temperature", True), ("temperature", "0.5"), ("temperature", float("inf")), ("top_p", float("nan")),
     ("n", 2.0), ("n", "2"), ("max_tokens", True), ("seed", 1e20), ("top_k", "5"), ("stream", "true"),
     ("logit_bias", {"5": True}), ("stop", 5)],
)  # fmt: skip
def test_types_are_strict(field, value):
    with pytest.raises(ValidationError) as exc:
        CompletionRequest.model_validate({"prompt": "x", field: value})
    assert exc.value.errors()[0]["loc"][0] == field


def test_json_numbers_fill_float_fields():
    req = CompletionRequest.model_validate({"prompt": "x", "temperature": 1, "top_p": 0, "presence_penalty": -2})
    assert (req.temperature, req.top_p, req.presence_penalty) == (1.0, 0.0, -2.0)


@pytest.mark.parametrize(
    "body,field",
    [({"tools": [{"type": "function"}]}, "tools"), ({"tool_choice": "required"}, "tool_choice"),
     ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
     ({"modalities": ["audio"]}, "modalities"), ({"add_generation_prompt": False}, "add_generation_prompt"),
     ({"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}]}, "messages"),
     ({"messages": [{"role": "user", "content": "x", "audio": {"id": "a"}}]}, "messages")],
)  # fmt: skip
def test_chat_fields_kvflow_lacks_are_named(body, field):
    req = ChatCompletionRequest.model_validate({"messages": MSG, **body})
    name, message = req.unsupported_field()
    assert name == field and "not supported" in message


@pytest.mark.parametrize(
    "body",
    [{}, {"tools": []}, {"tool_choice": "none"}, {"tool_choice": "auto"}, {"modalities": ["text"]},
     {"parallel_tool_calls": True}, {"add_generation_prompt": True}, {"user": "u", "store": True}],
)  # fmt: skip
def test_values_that_change_nothing_pass(body):
    assert ChatCompletionRequest.model_validate({"messages": MSG, **body}).unsupported_field() is None


@pytest.mark.parametrize("body,field", [({"best_of": 3}, "best_of"), ({"suffix": "z"}, "suffix"),
                                        ({"truncate_prompt_tokens": 5}, "truncate_prompt_tokens")])
def test_completion_fields_kvflow_lacks_are_named(body, field):
    assert CompletionRequest.model_validate({"prompt": "x", **body}).unsupported_field()[0] == field
    assert CompletionRequest.model_validate({"prompt": "x", "best_of": 1, "suffix": ""}).unsupported_field() is None


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "u"}}, {"type": "file"}, {"text": "untyped"}])
def test_content_parts_other_than_text_are_refused(part):
    with pytest.raises(ValidationError, match="not supported"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [part]}]})


def test_unset_fields_take_the_generation_config_then_the_builtin_defaults():
    req = CompletionRequest.model_validate({"prompt": "x", "top_p": 0.5})
    params = req.sampling_params(4, None, defaults={"temperature": 0.2, "top_p": 0.9, "top_k": 7})
    assert (params.temperature, params.top_p, params.top_k) == (0.2, 0.5, 7)  # the request's top_p wins
    assert (params.min_p, params.repetition_penalty) == (BUILTIN_DEFAULTS["min_p"], BUILTIN_DEFAULTS["repetition_penalty"])
    assert CompletionRequest.model_validate({"prompt": "x"}).sampling_params(4, None).temperature == 1.0


def test_json_schema_response_format_is_the_guided_schema():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = ChatCompletionRequest.model_validate(
        {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    )
    assert req.sampling_params(4, None).guided_json == schema
    with pytest.raises(ValueError, match="json_schema.schema"):
        ChatCompletionRequest.model_validate(
            {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}
        ).sampling_params(4, None)
