"""kvflow.entrypoints.anthropic.protocol: the chat fields of a Messages body."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvflow.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest, to_chat_fields

USER = {"role": "user", "content": "Hi"}


@pytest.mark.parametrize("model", [MessagesRequest, CountTokensRequest])
@pytest.mark.parametrize("content", ["", []])
def test_an_empty_final_assistant_message_is_no_prefill(model, content):
    """Anthropic allows the final assistant message to be empty (its 400 says "all messages
    must have non-empty content except for the optional final assistant message"); kvflow
    refused it as a prefill it does not support. An empty one prefills nothing: dropped."""
    req = model.model_validate({"model": "m", "max_tokens": 5,
                                "messages": [USER, {"role": "assistant", "content": content}]})
    assert to_chat_fields(req)["messages"] == [{"role": "user", "content": "Hi"}]


def test_a_non_empty_final_assistant_message_is_still_refused_naming_it():
    for messages, where in (([USER, {"role": "assistant", "content": "Sure"}], "messages[1]"),
                            ([USER, {"role": "assistant", "content": "Sure"}, {"role": "assistant", "content": ""}],
                             "messages[1]"),
                            ([{"role": "assistant", "content": ""}], "messages[0]")):
        req = MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "messages": messages})
        with pytest.raises(ValueError, match=rf"^{where.replace('[', '.').replace(']', '.')}"):
            to_chat_fields(req)


@pytest.mark.parametrize("model", [MessagesRequest, CountTokensRequest])
def test_tools_are_bounded_at_128(model):
    tools = [{"name": f"f{i}", "input_schema": {"type": "object"}} for i in range(129)]
    with pytest.raises(ValidationError) as exc:
        model.model_validate({"model": "m", "max_tokens": 5, "messages": [USER], "tools": tools})
    error = exc.value.errors()[0]
    assert error["loc"] == ("tools",) and "tools holds 129 tools; at most 128" in error["msg"], error
    assert len(model.model_validate({"model": "m", "max_tokens": 5, "messages": [USER], "tools": tools[:128]}).tools) == 128


@pytest.mark.parametrize("model", [MessagesRequest, CountTokensRequest])
def test_an_input_schema_not_of_type_object_is_refused_naming_it(model):
    """A tool's input is an object (Anthropic refuses another type). input_schema
    {"type": "string"} was accepted, and under tool_choice "any" the forced output could never
    be read as a tool_use: the reply was a text block, stop_reason "end_turn"."""
    tools = [{"name": "f", "input_schema": {"type": "string"}}]
    with pytest.raises(ValidationError) as exc:
        model.model_validate({"model": "m", "max_tokens": 5, "messages": [USER], "tools": tools})
    error = exc.value.errors()[0]
    assert error["loc"] == ("tools", 0, "input_schema") and "type 'object', got type 'string'" in error["msg"], error
    ok = [{"name": "f", "input_schema": {"type": "object"}}, {"name": "g", "input_schema": {"properties": {}}}]
    assert len(model.model_validate({"model": "m", "max_tokens": 5, "messages": [USER], "tools": ok}).tools) == 2
