"""The server's 400 messages for bodies that fail validation (``errors.validation_message``)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvflow.entrypoints.openai import protocol
from kvflow.entrypoints.openai.errors import validation_message


def _errors(cls, body: dict) -> list[dict]:
    with pytest.raises(ValidationError) as info:
        cls.model_validate(body)
    # as FastAPI reports them: each location under "body"
    return [{**e, "loc": ("body", *e["loc"])} for e in info.value.errors()]


def test_a_union_members_type_follows_the_path_instead_of_standing_in_it():
    message, param = validation_message(_errors(protocol.CompletionRequest, {"model": "m", "prompt": "x", "stop": 5}))
    assert param == "stop"
    assert message == "stop (as str): Input should be a valid string; stop (as list[str]): Input should be a valid list"


def test_a_validator_wrapped_member_is_named_by_its_type():
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "function"}}
    message, param = validation_message(_errors(protocol.ChatCompletionRequest, body))
    assert param == "tool_choice"
    assert "function-after" not in message
    assert "tool_choice.function (as NamedToolChoice): Field required" in message


def test_list_indexes_and_nested_fields_stay_in_the_path():
    body = {"model": "m", "prompt": [[1, "a"]]}
    message, _ = validation_message(_errors(protocol.CompletionRequest, body))
    assert "prompt.0.1 (as list[list[int]]): Input should be a valid integer" in message
    body = {"model": "m", "messages": [{"role": "bogus", "content": "x"}]}
    message, param = validation_message(_errors(protocol.ChatCompletionRequest, body))
    assert (param, message.split(":")[0]) == ("messages", "messages.0.role")


def test_a_body_that_is_no_json_names_no_field():
    errors = [{"type": "json_invalid", "loc": ("body", 7), "msg": "JSON decode error"}]
    assert validation_message(errors) == ("the request body is not valid JSON: JSON decode error (at character 7)", None)
    errors[0]["ctx"] = {"error": "Expecting value"}  # (FastAPI's: the decoder's reason)
    assert validation_message(errors) == ("the request body is not valid JSON: Expecting value (at character 7)", None)
    assert validation_message([]) == ("invalid request", None)
