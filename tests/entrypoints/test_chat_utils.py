"""Messages of ``LLM.chat`` (``chat_utils.normalize_conversation``) are validated as the
server's chat endpoint validates them (``protocol.check_chat_message``, the ``ChatMessage``
body): what ``POST /v1/chat/completions`` refuses with 400, ``LLM.chat`` refuses with a
ValueError naming the same field."""

from __future__ import annotations

import re

import pytest
import torch
from pydantic import ValidationError

from conftest import tiny_hf_model_dir
from kvflow import LLM, SamplingParams
from kvflow.entrypoints.chat_utils import normalize_conversation
from kvflow.entrypoints.openai.protocol import ChatCompletionRequest

USER = {"role": "user", "content": "Hi"}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}

# (messages, the field named, a piece of the message)
REFUSED = [
    ([USER, {"role": "bot", "content": "Hi"}], "messages[1].role", "Input should be 'system'"),
    ([USER, {"role": 3, "content": "Hi"}], "messages[1].role", "Input should be"),
    ([{"content": "Hi"}], "messages[0].role", "Field required"),
    ([{"role": "user"}], "messages[0]", "a user message needs content"),
    ([USER, {"role": "user", "content": None}], "messages[1]", "a user message needs content"),
    ([{"role": "user", "content": 5}], "messages[0].content", "Input should be"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}], "messages[0].content",
     "content parts of type 'image_url' are not supported"),
    ([{"role": "user", "content": [{"type": "text", "text": 1}]}], "messages[0].content",
     "the text of a text content part must be a string"),
    ([USER, {"role": "tool", "content": "42"}], "messages[1]", "a tool message needs tool_call_id"),
    ([{"role": "user", "content": "Hi", "tool_calls": [CALL]}], "messages[0]", "tool_calls is for assistant messages"),
    ([USER, {"role": "assistant", "content": "x", "function_call": {"name": "f"}}], "messages[1].function_call",
     "not supported by kvflow"),
    ([USER, "Hi"], "messages[1]", "must be a message dict"),
]  # fmt: skip


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLM(model=str(tiny_hf_model_dir(tmp_path_factory.mktemp("chat") / "m")), dtype="float32", num_kv_blocks=64,
              block_size=4, attention_backend="torch")  # fmt: skip
    torch.set_num_threads(saved)


@pytest.mark.parametrize("messages,field,problem", REFUSED)
def test_llm_chat_refuses_what_the_server_refuses_naming_the_field(llm, messages, field, problem):
    """A role or content the chat endpoint refused with 400 was rendered by ``LLM.chat``
    (a role "bot", a user message without content...); both refuse it now."""
    if not isinstance(messages[-1], dict):
        with pytest.raises(ValidationError):  # the server: a body that is no message
            ChatCompletionRequest.model_validate({"messages": messages})
    else:
        with pytest.raises(ValidationError):
            request = ChatCompletionRequest.model_validate({"messages": messages})
            if request.unsupported_field() is not None:  # (the server's 400 for a field it does not implement)
                raise ValidationError.from_exception_data("unsupported", [])
    with pytest.raises(ValueError, match=re.escape(field) + r"[:.]? .*" + re.escape(problem)):
        llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False)


def test_what_the_server_takes_llm_chat_renders(llm):
    """The accepted forms still render: developer as system, text parts joined, an assistant
    message without content but with tool calls (arguments as JSON text or as an object,
    which vLLM's ``LLM.chat`` takes too), a tool result, and keys the template reads."""
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": [
        {"type": "text", "text": "H"}, {"type": "text", "text": "i"}]},
        {"role": "assistant", "content": None, "tool_calls": [CALL, {**CALL, "id": "c2", "function": {
            "name": "f", "arguments": {"x": 2}}}], "reasoning_content": "think"},
        {"role": "tool", "tool_call_id": "c1", "content": "1"}]  # fmt: skip
    ChatCompletionRequest.model_validate({"messages": [m for m in messages if m["role"] != "assistant"]})
    rendered = normalize_conversation(messages)
    assert [m["role"] for m in rendered] == ["system", "user", "assistant", "tool"]
    assert rendered[1]["content"] == "Hi" and rendered[2]["content"] == ""
    assert rendered[2]["tool_calls"] == messages[2]["tool_calls"] and rendered[2]["reasoning_content"] == "think"
    (out,) = llm.chat(messages[:2], SamplingParams(max_tokens=1), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 1
