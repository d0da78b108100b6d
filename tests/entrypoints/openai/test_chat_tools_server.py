"""Tool calling and reasoning output of /v1/chat/completions through the HTTP server and the
``openai`` client, on a scripted tiny model (``agent_helpers``: the model writes the text a
test sets) with a Hermes-format chat template (the hermes parser is detected from it) and
``--reasoning-parser qwen3``."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from agent_helpers import ARGS, CALL, WEATHER_TOOL, scripted_engine, scripted_server
from conftest import InProcessServer

MSG = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def served():
    yield from scripted_server()


@pytest.fixture(scope="module")
def script(served):
    return served[1]


@pytest.fixture(scope="module")
def client(served):
    with openai.OpenAI(base_url=served[0].url + "/v1", api_key="x", max_retries=0, timeout=60) as c:
        yield c


def _chat(client, **kw):
    return client.chat.completions.create(model="tiny", messages=kw.pop("messages", MSG), temperature=0,
                                          max_tokens=kw.pop("max_tokens", 120), **kw)  # fmt: skip


def test_auto_tool_call(client, script):
    script.set(CALL)
    r = _chat(client, tools=[WEATHER_TOOL])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == ARGS


def test_auto_tool_call_streamed(client, script):
    script.set("Checking. " + CALL)
    chunks = list(_chat(client, tools=[WEATHER_TOOL], stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    pieces = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    (first,) = pieces  # sent whole, once complete
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_weather"
    assert json.loads(first.function.arguments) == ARGS
    assert content == "Checking."  # the space before the call is held back, then dropped
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("tool_choice", ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_call_cut_by_max_tokens_streams_as_the_whole_answer(client, script, tool_choice):
    """A call cut short by max_tokens is no call but content, the raw text (as vLLM), and
    the stream says the same: no delta.tool_calls was sent, the content deltas add up to
    the non-streamed content."""
    script.set("Checking. " + CALL)  # under a forced tool_choice the grammar writes the call
    kw = {"tools": [WEATHER_TOOL], "tool_choice": tool_choice, "max_tokens": 30}
    choice = _chat(client, **kw).choices[0]
    chunks = list(_chat(client, **kw, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    pieces = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert choice.finish_reason == chunks[-1].choices[0].finish_reason == "length"
    assert not choice.message.tool_calls and pieces == []
    assert content == choice.message.content
    if tool_choice == "auto":
        assert content == ("Checking. " + CALL)[: len(content)] and "<tool_call>" in content  # the text is not lost
    else:
        assert content.startswith("[{" if tool_choice == "required" else "{") and len(content) > 10


def test_auto_without_a_call_is_content(client, script):
    script.set("It is sunny.")
    r = _chat(client, tools=[WEATHER_TOOL])
    assert r.choices[0].message.content == "It is sunny." and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"


def test_tool_choice_none_reads_no_calls(client, script):
    script.set(CALL)
    r = _chat(client, tools=[WEATHER_TOOL], tool_choice="none")
    assert r.choices[0].message.content == CALL and not r.choices[0].message.tool_calls


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
@pytest.mark.parametrize("stream", [False, True])
def test_forced_call_is_valid_from_a_model_that_writes_prose(client, script, tool_choice, stream):
    script.set("I would rather not call any tool, thank you.")
    tools = [WEATHER_TOOL, {"type": "function", "function": {"name": "get_time"}}]
    # one call: a model that never stops would fill max_tokens with calls under parallel_tool_calls
    kw = {"tools": tools, "tool_choice": tool_choice, "parallel_tool_calls": False}
    if stream:
        chunks = list(_chat(client, **kw, stream=True))
        pieces = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
        name, arguments = pieces[0].function.name, "".join(p.function.arguments for p in pieces)
        finish = chunks[-1].choices[0].finish_reason
    else:
        choice = _chat(client, **kw).choices[0]
        (call,) = choice.message.tool_calls
        name, arguments, finish = call.function.name, call.function.arguments, choice.finish_reason
    assert finish == "tool_calls"
    if name == "get_weather":
        args = json.loads(arguments)
        assert set(args) == {"city", "unit"} and args["city"] in ("Paris", "Tokyo")
        assert args["unit"] in ("celsius", "fahrenheit")
    else:
        assert name == "get_time" and isinstance(tool_choice, str) and json.loads(arguments) == {}


def test_required_parallel_calls(client, script):
    script.set('[{"name": "get_weather", "parameters": {"city": "Tokyo", "unit": "celsius"}}, '
               '{"name": "get_time", "parameters": {}}]')
    tools = [WEATHER_TOOL, {"type": "function", "function": {"name": "get_time"}}]
    choice = _chat(client, tools=tools, tool_choice="required").choices[0]
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert calls == [("get_weather", {"city": "Tokyo", "unit": "celsius"}), ("get_time", {})]
    assert choice.finish_reason == "tool_calls" and len({c.id for c in choice.message.tool_calls}) == 2


ROUTE_TOOL = {"type": "function", "function": {"name": "route", "parameters": {  # as Pydantic writes a nested model
    "$defs": {"City": {"type": "object", "properties": {"name": {"type": "string", "enum": ["Paris", "Tokyo"]}},
                       "required": ["name"], "additionalProperties": False}},
    "type": "object", "properties": {"src": {"$ref": "#/$defs/City"}, "dst": {"$ref": "#/$defs/City"}},
    "required": ["src", "dst"], "additionalProperties": False}}}


@pytest.mark.parametrize("tools", [[ROUTE_TOOL], [ROUTE_TOOL, WEATHER_TOOL]])
def test_a_required_call_reads_the_tools_own_definitions(client, script, tools):
    """``$ref``s to a tool's ``$defs`` kept their meaning inside "required"'s wrapper schema
    (a 400 "Pointer '/$defs/City' does not exist" before)."""
    script.set('[{"name": "route", "parameters": {"src": {"name": "Paris"}, "dst": {"name": "Tokyo"}}}]')
    choice = _chat(client, tools=tools, tool_choice="required", parallel_tool_calls=False).choices[0]
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "route", {"src": {"name": "Paris"}, "dst": {"name": "Tokyo"}})


def test_tool_result_round_trip_reaches_the_template(client, script):
    script.set("It is 18 degrees in Paris.")
    messages = [
        *MSG,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]  # fmt: skip
    r = _chat(client, messages=messages, tools=[WEATHER_TOOL])
    assert r.choices[0].message.content == "It is 18 degrees in Paris."
    prompt = script.tokenizer.decode(script.seq)
    # the arguments rendered as an object (a dict in the template), not a quoted JSON string
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in prompt
    assert "<tool_response>\n18 C\n</tool_response>" in prompt
    assert '"name": "get_weather"' in prompt.split("</tools>")[0]  # the tool definitions


def test_reasoning_content(client, script):
    script.set("<think>2 and 2 make 4.</think>The answer is 4.")
    message = _chat(client).choices[0].message
    assert message.content == "The answer is 4."
    assert message.model_extra["reasoning_content"] == "2 and 2 make 4."
    chunks = list(_chat(client, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == "2 and 2 make 4."
    assert "".join(d.content or "" for d in deltas) == "The answer is 4."


def test_reasoning_content_is_null_without_reasoning(client, script):
    script.set("The answer is 4.")
    message = _chat(client).choices[0].message
    assert message.content == "The answer is 4." and message.model_extra["reasoning_content"] is None


def test_reasoning_then_tool_call(client, script):
    script.set("<think>Use the tool.</think>" + CALL)
    message = _chat(client, tools=[WEATHER_TOOL]).choices[0].message
    assert message.model_extra["reasoning_content"] == "Use the tool."
    assert message.tool_calls[0].function.name == "get_weather"


def test_chat_template_kwargs_reach_the_template(client, script):
    script.set("Hi.")
    _chat(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert "<|im_start|>assistant\n<think>\n\n</think>\n\n" in script.tokenizer.decode(script.seq)
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs may not set 'tools'"):
        _chat(client, extra_body={"chat_template_kwargs": {"tools": []}})


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
])  # fmt: skip
def test_image_and_audio_parts_are_refused_by_type(client, part):
    with pytest.raises(openai.BadRequestError, match=repr(part["type"])):
        _chat(client, messages=[{"role": "user", "content": [{"type": "text", "text": "What is it?"}, part]}])


@pytest.mark.parametrize("field, value", [
    ("functions", [{"name": "f", "parameters": {}}]), ("function_call", {"name": "f"}),
])  # fmt: skip
def test_legacy_function_fields_are_refused_by_name(served, field, value):
    r = httpx.post(served[0].url + "/v1/chat/completions", json={"messages": MSG, field: value}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == field


@pytest.fixture(scope="module")
def plain_server():
    """A server whose chat template is of no tool-call family (it does not even show the
    tools, as SmolLM2's): the generic parser is its default."""
    engine, script = scripted_engine()
    template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{{ '<|im_start|>assistant\\n' }}"
    server = InProcessServer(engine, chat_template=template)
    try:
        yield server, script
    finally:
        server.stop()


@pytest.mark.parametrize("written", [
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    'Sure.\n```json\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n```',
    CALL,
])  # fmt: skip
def test_auto_without_a_known_family_uses_the_generic_parser(plain_server, written):
    """No --tool-call-parser and no family in the template: tool_choice "auto" is served
    (it was a 400), and the forms small models write are read as calls."""
    server, script = plain_server
    script.set(written)
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                   json={"messages": MSG, "tools": [WEATHER_TOOL], "max_tokens": 200, "temperature": 0})  # fmt: skip
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == ARGS
    assert message["content"] in (None, "Sure."), message
    assert r.json()["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("written,args", [
    # a call the model gets wrong: the structural constraint makes it one of the tools with
    # arguments valid for its schema, from the point the model starts it ({"name" / <tool_call>)
    ('{"name": "get_weather", "arguments": {"city": Paris, unit=celsius}}', None),
    ('I will check.\n<tool_call>\n{"name": "get_weathr", "arguments": {"city": "Lyon"}}\n</tool_call>', None),
    ('{"name": "get_weather", "arguments": {"city": "Tokyo", "unit": "fahrenheit"}}', {"city": "Tokyo", "unit": "fahrenheit"}),
])  # fmt: skip
@pytest.mark.parametrize("stream", [False, True])
def test_auto_calls_are_constrained_to_the_tool_schemas(client, script, written, args, stream):
    script.set(written)
    if stream:
        chunks = list(_chat(client, tools=[WEATHER_TOOL], stream=True, max_tokens=200))
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        pieces = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
        name, arguments = pieces[0].function.name, "".join(p.function.arguments or "" for p in pieces)
        finish = chunks[-1].choices[0].finish_reason
    else:
        choice = _chat(client, tools=[WEATHER_TOOL], max_tokens=200).choices[0]
        (call,) = choice.message.tool_calls
        content, name, arguments, finish = choice.message.content or "", call.function.name, call.function.arguments, choice.finish_reason
    assert finish == "tool_calls"
    assert name == "get_weather"
    parsed = json.loads(arguments)
    assert set(parsed) == {"city", "unit"} and parsed["city"] in ("Paris", "Tokyo") and parsed["unit"] in ("celsius", "fahrenheit")
    if args is not None:  # a valid call goes through as written
        assert parsed == args
    assert "{" not in content and "tool_call" not in content  # no piece of the call in the content


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_an_unusable_parameter_schema_is_400_naming_the_tool(served, tool_choice):
    """Under "auto" (the constraint of every started call) a schema the grammar engine refuses
    was a 400 saying where in the constraint's own grammar ("at 5(8): failed to compile JSON
    schema: ..."), not which tool; it names the tool, as under "required"."""
    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {}, "required": ["x"], "additionalProperties": False}}}  # fmt: skip
    r = httpx.post(served[0].url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": MSG, "tools": [WEATHER_TOOL, bad], "tool_choice": tool_choice, "max_tokens": 5})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "tools" and error["message"].startswith(
        "tools[1].function.parameters is not a usable JSON schema: "), error
