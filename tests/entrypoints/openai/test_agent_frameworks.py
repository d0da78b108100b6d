"""Agent frameworks finish a two-step tool task against ``kvflow serve`` on a packaged model
(opt-in: ``KVFLOW_TEST_PACKAGED_MODELS=1``; minutes on a CPU).

The task: look up a price (``get_price``), convert it to euros (``convert_currency``), answer
with the result. Run by openai-agents with its Chat Completions model and with its Responses
model, and by LangChain's ``bind_tools`` in a tool loop, each against a ``kvflow serve``
process on Qwen2.5-Coder-1.5B-Instruct (``qwen2.5-coder-1.5b``, its own chat template; the
hermes parser is detected from it, the calls constrained by the tool schemas). The model
(``KVFLOW_TEST_AGENT_MODEL``, default ``qwen2.5-coder-1.5b``) and the frameworks
(``pip install kvflow[agents]``) are skipped by name when missing.
"""

from __future__ import annotations

import functools
import os

import openai
import pytest

import test_server
from test_server import _serve

pytestmark = [pytest.mark.integration, pytest.mark.packaged_model]  # opt-in (tests/conftest.py)

MODEL = os.environ.get("KVFLOW_TEST_AGENT_MODEL", "qwen2.5-coder-1.5b")
QUESTION = "What does a laptop cost in euros? Look up its price in US dollars, then convert it to EUR."
PRICES_USD = {"laptop": 1200.0}
EUR_PER_USD = 0.9
ANSWER = "1080"  # 1200 USD * 0.9
STARTUP_TIMEOUT_S = 900
REQUEST_TIMEOUT_S = 600  # one agent turn: a prompt of ~1k tokens on a busy CPU


def get_price(product: str) -> str:
    """Look up the price of a product, in US dollars.

    Args:
        product: the product's name, e.g. "laptop".
    """
    price = PRICES_USD.get(product.strip().lower().rstrip("s"))
    return f"{price:.0f} USD" if price is not None else f"unknown product {product!r}; known: {', '.join(PRICES_USD)}"


def convert_currency(amount: float, from_currency: str, to_currency: str) -> str:
    """Convert an amount of money from one currency to another.

    Args:
        amount: the amount to convert.
        from_currency: the currency code of the amount, e.g. "USD".
        to_currency: the currency code to convert to, e.g. "EUR".
    """
    if (from_currency.upper(), to_currency.upper()) != ("USD", "EUR"):
        return "only USD to EUR is known"
    return f"{float(amount) * EUR_PER_USD:.0f} EUR"


@pytest.fixture(scope="module")
def model_dir():
    from kvflow.model.resolve import resolve_model

    try:
        return resolve_model(MODEL)
    except Exception as exc:  # noqa: BLE001 - a missing package: the test is opt-in
        pytest.skip(f"{MODEL} is not installed (docs/models.md): {str(exc)[:160]}")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory, monkeypatch_module):
    # a 1.5B model loads in minutes on a busy 2-core machine: more than the SmolLM2 tests allow
    monkeypatch_module.setattr(test_server.Server.wait_healthy, "__defaults__", (STARTUP_TIMEOUT_S,))
    yield from _serve(model_dir, tmp_path_factory, "agent_server", ["--max-num-seqs", "2", "--num-threads", "2"])


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def model_id(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x").models.list().data[0].id


def _agents():
    try:
        import agents
    except ImportError:
        pytest.skip("openai-agents is not installed: pip install openai-agents (or kvflow[agents])")
    agents.set_tracing_disabled(True)
    return agents


@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_openai_agents_two_step_task(server, model_id, api):
    agents = _agents()
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=REQUEST_TIMEOUT_S)
    model_cls = agents.OpenAIChatCompletionsModel if api == "chat_completions" else agents.OpenAIResponsesModel
    calls: list[str] = []

    def traced(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            calls.append(fn.__name__)
            return fn(*args, **kwargs)

        return wrapper

    agent = agents.Agent(
        name="shopper",
        instructions="Use the tools: first get_price, then convert_currency with its result, then answer.",
        tools=[agents.function_tool(traced(get_price)), agents.function_tool(traced(convert_currency))],
        model=model_cls(model=model_id, openai_client=client),
        model_settings=agents.ModelSettings(temperature=0, max_tokens=200),
    )
    result = agents.Runner.run_sync(agent, QUESTION, max_turns=6)
    assert calls[:2] == ["get_price", "convert_currency"], (calls, result.final_output, [i.type for i in result.new_items])
    last = result.raw_responses[-1]
    assert ANSWER in result.final_output.replace(",", ""), (result.final_output, last.output, last.usage)


def test_langchain_bind_tools_two_step_task(server, model_id):
    try:
        from langchain_core.messages import HumanMessage, ToolMessage
        from langchain_core.tools import tool
        from langchain_openai import ChatOpenAI
    except ImportError:
        pytest.skip("langchain-openai is not installed: pip install langchain-openai (or kvflow[agents])")
    tools = {t.name: t for t in (tool(get_price), tool(convert_currency))}
    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="x", model=model_id, temperature=0, max_tokens=200,
                     max_retries=0, timeout=REQUEST_TIMEOUT_S).bind_tools(list(tools.values()))  # fmt: skip
    messages = [HumanMessage(QUESTION)]
    called: list[str] = []
    for _ in range(6):
        reply = llm.invoke(messages)
        messages.append(reply)
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            called.append(call["name"])
            messages.append(ToolMessage(tools[call["name"]].invoke(call["args"]), tool_call_id=call["id"]))
    assert called[:2] == ["get_price", "convert_currency"], called
    assert not reply.tool_calls, "the loop did not end with an answer"
    assert ANSWER in str(reply.content).replace(",", ""), reply.content
