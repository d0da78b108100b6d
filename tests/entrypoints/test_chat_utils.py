"""kvflow.entrypoints.chat_utils: the messages LLM.chat renders (vLLM's LLM.chat takes them)."""

from __future__ import annotations

import pytest

from kvflow.entrypoints.chat_utils import normalize_conversation


def test_transformers_format_tool_use_is_rendered_as_given():
    # transformers' documented tool-use messages: calls without ids, arguments as an object,
    # the tool's answer named by the function; Llama 3.1 templates read an "ipython" role
    conversation = [
        {"role": "user", "content": "What is f(1)?"},
        {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
        {"role": "tool", "name": "f", "content": "42"},
        {"role": "ipython", "content": "42"},
    ]
    out = normalize_conversation(conversation)
    assert [m["role"] for m in out] == ["user", "assistant", "tool", "ipython"]
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1} and out[1]["content"] == ""
    assert out[2]["name"] == "f" and out[2]["content"] == "42"


def test_openai_format_tool_call_arguments_reach_the_template_as_an_object():
    """OpenAI's calls carry ``arguments`` as a JSON string: the template gets the object (as
    the server and vLLM's LLM.chat give it), so ``| tojson`` writes it once; it was written
    as a quoted string. The caller's messages are not changed; bad JSON is refused by name."""
    call = {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"c": "Paris"}'}}
    conversation = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    out = normalize_conversation(conversation)
    assert out[1]["tool_calls"] == [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": {"c": "Paris"}}}]
    assert call["function"]["arguments"] == '{"c": "Paris"}'  # the caller's dict as it was
    bad = {**call, "function": {"name": "w", "arguments": "{not json"}}
    with pytest.raises(ValueError, match=r"messages\[1\].tool_calls\[0\].function.arguments is not valid JSON"):
        normalize_conversation([conversation[0], {"role": "assistant", "tool_calls": [bad]}])


@pytest.mark.parametrize("message, where", [
    ({"content": "hi"}, r"messages\[0\] must be a dict with a string .role."),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, r"messages\[0\].content\[0\]"),
])
def test_a_message_without_a_role_or_with_a_non_text_part_is_refused_naming_it(message, where):
    with pytest.raises(ValueError, match=where):
        normalize_conversation([message])


def test_a_lone_surrogate_is_a_value_error_naming_the_messages(smollm2_llm):
    """LLM.chat with a lone surrogate in a message raised the tokenizer's TypeError
    ("TextEncodeInput must be Union[...]"); it is a ValueError naming the messages."""
    from kvflow import SamplingParams

    with pytest.raises(ValueError, match="messages hold a lone surrogate"):
        smollm2_llm.chat([{"role": "user", "content": "a\ud800b"}], SamplingParams(max_tokens=2))
    assert not smollm2_llm.engine.has_unfinished_requests()


def test_text_parts_are_one_per_line_on_every_api():
    """Two text parts are two lines, as vLLM joins them ("Hello" + "world" was "Helloworld"):
    chat content parts, Anthropic text blocks and tool results, Responses input_text parts."""
    from kvflow.entrypoints.anthropic.protocol import MessagesRequest, to_chat_fields
    from kvflow.entrypoints.chat_utils import text_content
    from kvflow.entrypoints.openai.serving_responses import _text_parts

    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    assert text_content(parts, "messages[0]") == "Hello\nworld"
    assert _text_parts([{"type": "input_text", "text": "Hello"}, {"type": "input_text", "text": "world"}],
                       "input[0].content", ("input_text",)) == "Hello\nworld"
    req = MessagesRequest.model_validate({"model": "m", "max_tokens": 4, "messages": [
        {"role": "user", "content": parts},
        {"role": "assistant", "content": [*parts, {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": parts}]},
    ]})
    messages = to_chat_fields(req)["messages"]
    assert [m.get("content") for m in messages] == ["Hello\nworld", "Hello\nworld", "Hello\nworld"]


def test_anthropic_thinking_disabled_asks_the_template_for_no_thinking():
    """``thinking: {"type": "disabled"}`` reaches templates that can turn thinking off
    (Qwen3's ``enable_thinking``); left unset, nothing is asked of the template."""
    from kvflow.entrypoints.anthropic.protocol import MessagesRequest, to_chat_fields

    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    off = to_chat_fields(MessagesRequest.model_validate({**body, "thinking": {"type": "disabled"}}))
    assert off["chat_template_kwargs"] == {"enable_thinking": False}
    assert "chat_template_kwargs" not in to_chat_fields(MessagesRequest.model_validate(body))


@pytest.mark.parametrize("kwargs, match", [
    ({"add_generation_prompt": "no"}, "^add_generation_prompt must be true or false, got 'no'"),
    ({"add_generation_prompt": False, "continue_final_message": "no"}, "^continue_final_message must be true or false"),
    ({"add_generation_prompt": None}, "^add_generation_prompt must be true or false"),
    ({"chat_template_kwargs": "x"}, "^chat_template_kwargs must be a dict, got str"),
    ({"chat_template_kwargs": [("enable_thinking", False)]}, "^chat_template_kwargs must be a dict, got list"),
])  # fmt: skip
def test_template_switches_and_kwargs_of_the_wrong_type_are_refused_by_name(kwargs, match):
    """LLM.chat(add_generation_prompt="no") rendered the assistant header (a truthy string);
    continue_final_message="no" reached transformers, which took the string for the text to
    continue ('the final message has no "no" to continue'); chat_template_kwargs="x" failed
    in dict() ('dictionary update sequence element #0 ...'). Each is a ValueError naming it,
    before the template runs."""
    from kvflow.entrypoints.chat_utils import render_chat_text

    calls = []

    class Tokenizer:
        chat_template = "{{ messages }}"

        def apply_chat_template(self, conversation, **kw):
            calls.append(kw)
            return "rendered"

    conversation = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match=match):
        render_chat_text(Tokenizer(), conversation, **kwargs)
    assert calls == []
    assert render_chat_text(Tokenizer(), conversation, add_generation_prompt=False, chat_template_kwargs={"x": 1}) == "rendered"


def test_a_model_without_a_chat_template_says_how_to_give_one():
    """A tokenizer with no chat template (a GGUF whose metadata has none) gave transformers'
    message, which names its own API; the ValueError names the messages, the server's
    --chat-template and LLM.chat's chat_template= (a given template renders)."""
    from kvflow.entrypoints.chat_utils import render_chat_text

    class Tokenizer:
        chat_template = None

        def apply_chat_template(self, conversation, chat_template=None, **kw):
            if chat_template is None:
                raise ValueError("Cannot use chat template functions because tokenizer.chat_template is not set")
            return "rendered"

    conversation = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match=r"^messages: this model has no chat template.*--chat-template FILE"):
        render_chat_text(Tokenizer(), conversation)
    assert render_chat_text(Tokenizer(), conversation, chat_template="{{ messages }}") == "rendered"
