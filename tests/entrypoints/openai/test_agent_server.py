"""The agent APIs on the real model in a real ``kvflow serve`` process: SmolLM2-135M with a
tool-capable Hermes-format template given by ``--chat-template FILE`` and
``--reasoning-parser qwen3``, driven by the ``openai`` client (chat tools, a tool loop,
``client.responses.create``) and the ``anthropic`` client (text, streaming, a tool_use round
trip). SmolLM2 is no tool model: forced tool calls (guided decoding) must still be valid calls,
and each API must give the text greedy decoding gives through chat completions."""

from __future__ import annotations

import json

import openai
import pytest

from agent_helpers import HERMES_TEMPLATE, WEATHER_TOOL
from conftest import requires_smollm2
from test_server import REQUEST_TIMEOUT_S, _serve

pytestmark = [requires_smollm2, pytest.mark.integration]

MSG = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [WEATHER_TOOL, {"type": "function", "function": {"name": "get_time", "description": "The time now."}}]


@pytest.fixture(scope="module")
def server(smollm2_dir, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "hermes.jinja"
    template.write_text(HERMES_TEMPLATE)
    args = ["--chat-template", str(template), "--reasoning-parser", "qwen3", "--max-num-seqs", "4"]
    yield from _serve(smollm2_dir, tmp_path_factory, "agent_server", args)


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=REQUEST_TIMEOUT_S) as c:
        global MODEL
        MODEL = c.models.list().data[0].id
        yield c


MODEL = ""  # the served model id, set by the client fixture


def _chat(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=kw.pop("messages", MSG), temperature=0,
                                          max_tokens=kw.pop("max_tokens", 40), **kw)  # fmt: skip


def _check_weather_args(arguments: str) -> dict:
    args = json.loads(arguments)
    assert set(args) == {"city", "unit"} and args["city"] in ("Paris", "Tokyo"), args
    assert args["unit"] in ("celsius", "fahrenheit"), args
    return args


def test_forced_calls_are_valid(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice = _chat(client, tools=TOOLS, tool_choice=named).choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and choice.finish_reason == "tool_calls"
    _check_weather_args(call.function.arguments)
    chunks = list(_chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=60,
                        stream=True))  # fmt: skip
    pieces = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert pieces[0].id and pieces[0].function.name in ("get_weather", "get_time")
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    arguments = "".join(p.function.arguments for p in pieces)
    if pieces[0].function.name == "get_weather":
        _check_weather_args(arguments)
    else:
        assert json.loads(arguments) == {}


def test_tool_loop(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = _chat(client, tools=TOOLS, tool_choice=named)
    call = first.choices[0].message.tool_calls[0]
    messages = [*MSG, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, cloudy"}]  # fmt: skip
    second = _chat(client, tools=TOOLS, messages=messages)
    # the call and its result are in the second prompt: it is longer by at least their text
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 10
    choice = second.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    for c in choice.message.tool_calls or []:  # any call the model writes is parsed whole
        json.loads(c.function.arguments)
    assert choice.message.content or choice.message.tool_calls


def test_responses_give_the_chat_text(client):
    expected = _chat(client, max_tokens=16).choices[0].message.content
    r = client.responses.create(model=MODEL, input=MSG[0]["content"], temperature=0, max_output_tokens=16)
    assert r.output_text == expected and r.usage.output_tokens <= 16
    events = list(client.responses.create(model=MODEL, input=MSG, temperature=0, max_output_tokens=16,
                                          stream=True))  # fmt: skip
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected
    assert events[-1].response.output_text == expected


def test_responses_forced_function_call(client):
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER_TOOL["function"]["parameters"]}]
    r = client.responses.create(model=MODEL, input=MSG, tools=tools, temperature=0, max_output_tokens=40,
                                tool_choice={"type": "function", "name": "get_weather"})  # fmt: skip
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    _check_weather_args(call.arguments)


def test_anthropic_client(server, client):
    anthropic = pytest.importorskip("anthropic")
    expected = _chat(client, max_tokens=16).choices[0].message.content
    with anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=REQUEST_TIMEOUT_S) as a:
        greedy = {"temperature": 0}  # this client version has no temperature argument
        r = a.messages.create(model=MODEL, max_tokens=16, messages=MSG, extra_body=greedy)
        assert r.content[0].text == expected and r.usage.output_tokens <= 16
        with a.messages.stream(model=MODEL, max_tokens=16, messages=MSG, extra_body=greedy) as stream:
            assert "".join(stream.text_stream) == expected
            assert stream.get_final_message().stop_reason in ("end_turn", "max_tokens")
        tools = [{"name": "get_weather", "input_schema": WEATHER_TOOL["function"]["parameters"]}]
        use = a.messages.create(model=MODEL, max_tokens=40, messages=MSG, tools=tools, extra_body=greedy,
                                tool_choice={"type": "tool", "name": "get_weather"})  # fmt: skip
        (block,) = use.content
        assert block.type == "tool_use" and use.stop_reason == "tool_use"
        _check_weather_args(json.dumps(block.input))
        messages = [*MSG, {"role": "assistant", "content": [block.model_dump()]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "18 C"}]}]
        answer = a.messages.create(model=MODEL, max_tokens=16, messages=messages, tools=tools, extra_body=greedy)
        assert answer.usage.input_tokens > use.usage.input_tokens
        assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use") and answer.content
