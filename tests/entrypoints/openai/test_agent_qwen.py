"""Tool calling with a real tool model: Qwen2.5-Coder-0.5B-Instruct (package
``qwen2.5-coder-0.5b``; skipped when it is not installed) in a ``kvflow serve`` process, its
own template (the hermes parser is detected from its ``<tool_call>``), driven by the
``openai`` client and by LangChain (``langchain-openai``; skipped when not installed)
binding a tool and running a tool loop."""

from __future__ import annotations

import json

import openai
import pytest

from test_server import REQUEST_TIMEOUT_S, _serve

pytestmark = [pytest.mark.integration, pytest.mark.packaged_model]  # opt-in (tests/conftest.py)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city name"}},
                       "required": ["city"]},
    },
}  # fmt: skip
QUESTION = "What is the weather in Paris right now?"


@pytest.fixture(scope="module")
def qwen_dir():
    from kvflow.model.resolve import resolve_model

    try:
        return resolve_model("qwen2.5-coder-0.5b")
    except Exception as exc:  # noqa: BLE001 - a missing package: the test is opt-in
        pytest.skip(f"Qwen2.5-Coder-0.5B is not installed: {str(exc)[:100]}")


@pytest.fixture(scope="module")
def server(qwen_dir, tmp_path_factory):
    yield from _serve(qwen_dir, tmp_path_factory, "qwen_server", ["--max-num-seqs", "2", "--num-threads", "2"])


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=REQUEST_TIMEOUT_S) as c:
        yield c


def test_auto_tool_call(client):
    model = client.models.list().data[0].id
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}], tools=[WEATHER],
                                       temperature=0, max_tokens=30)  # fmt: skip
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


def test_langchain_tool_loop(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return f"18 degrees Celsius and cloudy in {city}"

    llm = langchain_openai.ChatOpenAI(base_url=server.url + "/v1", api_key="x", model="qwen", temperature=0,
                                      max_tokens=30, max_retries=0, timeout=REQUEST_TIMEOUT_S)  # fmt: skip
    # the served model id is the model folder's name; any other "model" is a 404
    llm.model_name = openai.OpenAI(base_url=server.url + "/v1", api_key="x").models.list().data[0].id
    agent = llm.bind_tools([get_weather])
    messages = [HumanMessage(QUESTION)]
    first = agent.invoke(messages)
    (call,) = first.tool_calls
    assert call["name"] == "get_weather" and call["args"] == {"city": "Paris"}
    messages += [first, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])]
    second = agent.invoke(messages)
    # the second turn ran on the whole loop (the call and its result are in its prompt)
    assert second.usage_metadata["input_tokens"] > first.usage_metadata["input_tokens"] + 20
    assert second.content or second.tool_calls
