"""POST /v1/responses through the HTTP server with the ``openai`` client
(``client.responses.create``, whole and streamed), on the scripted tiny model of
``agent_helpers`` (Hermes-format template, ``--reasoning-parser qwen3``)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from agent_helpers import ARGS, CALL, WEATHER_TOOL, scripted_server

TOOL = {"type": "function", "name": "get_weather", "description": WEATHER_TOOL["function"]["description"],
        "parameters": WEATHER_TOOL["function"]["parameters"]}  # fmt: skip


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


def _create(client, **kw):
    return client.responses.create(model="tiny", input=kw.pop("input", "Weather in Paris?"), temperature=0,
                                   max_output_tokens=kw.pop("max_output_tokens", 120), **kw)  # fmt: skip


def test_text(client, script):
    script.set("It is sunny.")
    r = _create(client, instructions="Be brief.")
    assert r.status == "completed" and r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == "It is sunny."
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert r.usage.output_tokens == len(script.script) and r.usage.input_tokens > 0
    prompt = script.tokenizer.decode(script.seq)
    assert "<|im_start|>system\nBe brief.<|im_end|>" in prompt and "Weather in Paris?" in prompt


def test_max_output_tokens_is_incomplete(client, script):
    script.set("It is sunny and warm in Paris today.")
    r = _create(client, max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == "It "


@pytest.mark.parametrize("stream", [False, True])
def test_a_message_cut_by_max_output_tokens_is_an_incomplete_item(client, script, stream):
    """The message item that ``max_output_tokens`` cut has status ``incomplete`` (as OpenAI
    marks it; it said ``completed``), streamed (``output_item.done`` and the final response)
    or not, keeping its text; a whole reply's item is ``completed``."""
    script.set("It is sunny and warm in Paris today.")
    for max_output_tokens, status in [(3, "incomplete"), (120, "completed")]:
        if stream:
            events = list(_create(client, max_output_tokens=max_output_tokens, stream=True))
            (done,) = [e.item for e in events if e.type == "response.output_item.done"]
            (item,) = events[-1].response.output
            assert done.status == item.status == status and done.content[0].text == item.content[0].text
        else:
            (item,) = _create(client, max_output_tokens=max_output_tokens).output
        assert item.type == "message" and item.status == status
        assert item.content[0].text == ("It " if status == "incomplete" else "It is sunny and warm in Paris today.")


def test_text_streamed(client, script):
    script.set("It is sunny.")
    events = list(_create(client, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "It is sunny."
    assert events[-1].response.output_text == "It is sunny."


def test_function_call_loop(client, script):
    script.set(CALL)
    r = _create(client, tools=[TOOL])
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == ARGS
    assert call.call_id.startswith("call_")
    script.set("It is 18 C in Paris.")
    history = [{"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}]  # fmt: skip
    r2 = _create(client, input=history, tools=[TOOL])
    assert r2.output_text == "It is 18 C in Paris."
    prompt = script.tokenizer.decode(script.seq)
    assert '"arguments": {"city": "Paris", "unit": "celsius"}' in prompt
    assert "<tool_response>\n18 C\n</tool_response>" in prompt


def test_a_turn_with_text_and_parallel_calls_is_one_assistant_message(served, client, script):
    """What openai-agents sends back after a turn that wrote text and two calls (a message
    item, two function_call items, two function_call_output items) is the prompt of the same
    conversation in Chat Completions: one assistant turn holding the text and both calls.
    The second call used to open a second assistant turn, and Qwen2.5-Coder-1.5B then
    answered the final turn with nothing."""
    tokyo = {"city": "Tokyo", "unit": "celsius"}
    calls = [("call_1", ARGS), ("call_2", tokyo)]
    items = [{"role": "user", "content": "Weather in Paris and Tokyo?"},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Looking.", "annotations": []}]}]  # fmt: skip
    items += [{"type": "function_call", "id": f"fc_{i}", "call_id": cid, "name": "get_weather",
               "arguments": json.dumps(args), "status": "completed"} for i, (cid, args) in enumerate(calls)]  # fmt: skip
    items += [{"type": "function_call_output", "call_id": cid, "output": out} for (cid, _), out in zip(calls, ("18 C", "21 C"))]
    messages = [{"role": "user", "content": "Weather in Paris and Tokyo?"},
                {"role": "assistant", "content": "Looking.", "tool_calls": [
                    {"id": cid, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(args)}}
                    for cid, args in calls]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
                {"role": "tool", "tool_call_id": "call_2", "content": "21 C"}]  # fmt: skip
    script.set("Paris 18 C, Tokyo 21 C.")
    assert _create(client, input=items, tools=[TOOL]).output_text == "Paris 18 C, Tokyo 21 C."
    responses_prompt = script.tokenizer.decode(script.seq)
    r = httpx.post(served[0].url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": messages, "tools": [WEATHER_TOOL], "temperature": 0, "max_tokens": 120})  # fmt: skip
    assert r.status_code == 200, r.text
    chat_prompt = script.tokenizer.decode(script.seq)
    assert responses_prompt == chat_prompt
    assert responses_prompt.count("<|im_start|>assistant") == 2, responses_prompt  # the turn, then the answer's


def test_function_call_streamed(client, script):
    script.set("<think>Use the tool.</think>" + CALL)
    events = list(_create(client, tools=[TOOL], stream=True))
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [i.type for i in added] == ["reasoning", "function_call"]
    assert added[1].name == "get_weather" and added[1].arguments == ""
    fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(fragments) == 1 and json.loads(fragments[0]) == ARGS  # sent whole, once complete
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(done.arguments) == ARGS
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning == "Use the tool."
    final = events[-1].response
    assert [i.type for i in final.output] == ["reasoning", "function_call"]
    assert final.output[1].call_id == added[1].call_id
    reasoning_tokens = len(script.tokenizer.encode("Use the tool.", add_special_tokens=False))
    assert final.usage.output_tokens_details.reasoning_tokens == reasoning_tokens > 0


def test_a_streamed_turn_with_text_after_its_call_can_be_sent_back(client, script):
    """A model that writes a call, then text, streams the items function_call, message (in
    that order); an agent sends them back with the call's output. That was a 400 in chat's
    words ("an assistant message with 'tool_calls' must be followed by tool input ..."): the
    text after the calls is the same turn, one assistant message with them."""
    script.set(CALL + "\nLet me know.")
    events = list(_create(client, tools=[TOOL], stream=True))
    output = events[-1].response.output
    assert [i.type for i in output] == ["function_call", "message"]
    items = [{"role": "user", "content": "Weather in Paris?"}, *(i.model_dump(exclude_none=True) for i in output),
             {"type": "function_call_output", "call_id": output[0].call_id, "output": "18 C"}]
    script.set("It is 18 C in Paris.")
    assert _create(client, input=items, tools=[TOOL]).output_text == "It is 18 C in Paris."
    prompt = script.tokenizer.decode(script.seq)
    assert prompt.count("<|im_start|>assistant") == 2 and "Let me know." in prompt, prompt


def test_reasoning_tokens_are_counted():
    """usage.output_tokens_details.reasoning_tokens was always 0 though the output had a
    reasoning item: it is the reasoning text's tokens (none without reasoning, at most the
    output's)."""
    from kvflow.entrypoints.openai.serving_responses import reasoning_token_count

    class Tok:
        def encode(self, text, add_special_tokens=True):
            assert add_special_tokens is False
            return text.split()

    assert reasoning_token_count(Tok(), "", 9) == 0
    assert reasoning_token_count(Tok(), "a b c", 9) == 3
    assert reasoning_token_count(Tok(), "a b c", 2) == 2


def test_reasoning_tokens_in_the_whole_response(client, script):
    script.set("<think>Think it over first.</think>It is sunny.")
    r = _create(client)
    assert [i.type for i in r.output] == ["reasoning", "message"]
    expected = len(script.tokenizer.encode("Think it over first.", add_special_tokens=False))
    assert r.usage.output_tokens_details.reasoning_tokens == expected > 0
    script.set("It is sunny.")
    assert _create(client).usage.output_tokens_details.reasoning_tokens == 0


@pytest.mark.parametrize("tool_choice", ["auto", "required", {"type": "function", "name": "get_weather"}])
def test_call_cut_by_max_output_tokens_streams_as_the_whole_response(client, script, tool_choice):
    """A call cut short is a message with the raw text (no function_call item), streamed or
    not; the stream never added a function_call item."""
    script.set("Checking. " + CALL)
    kw = {"tools": [TOOL], "tool_choice": tool_choice, "max_output_tokens": 30}
    whole = _create(client, **kw)
    events = list(_create(client, **kw, stream=True))
    final = events[-1].response
    assert whole.status == final.status == "incomplete"
    assert [i.type for i in whole.output] == [i.type for i in final.output] == ["message"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output[0].content[0].text == final.output[0].content[0].text and len(text) > 10
    assert not [e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]


def test_forced_function_call(client, script):
    script.set("No tool for me.")
    r = _create(client, tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"})
    (call,) = r.output
    args = json.loads(call.arguments)
    assert call.name == "get_weather" and args["city"] in ("Paris", "Tokyo") and args["unit"] in ("celsius", "fahrenheit")


def test_json_schema_text_format(client, script):
    script.set('{"ok": true}')
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    r = _create(client, text={"format": {"type": "json_schema", "name": "r", "schema": schema}})
    assert json.loads(r.output_text) == {"ok": True}


@pytest.mark.parametrize("body, param, match", [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "stateless"),
    ({"store": True}, "store", "stateless"),
    ({"tools": [{"type": "web_search"}]}, "tools", "'web_search'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]}, "input",
     "'input_image'"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}, "input",
     "'input_audio'"),
    ({"input": [{"type": "file_search_call", "id": "x"}]}, "input", "'file_search_call'"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice", "'file_search'"),
    ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens must be at least 1"),
    # other APIs' fields that change the output were logged and dropped (200 with 12 tokens
    # for max_tokens 1)
    ({"max_tokens": 1}, "max_tokens", "max_tokens is not supported"),
    ({"max_completion_tokens": 1}, "max_completion_tokens", "max_completion_tokens is not supported"),
    ({"guided_regex": "a+"}, "guided_regex", "guided_regex"), ({"guided_json": {}}, "guided_json", "guided_json"),
    ({"bad_words": ["x"]}, "bad_words", "bad_words"), ({"priority": 2}, "priority", "priority"),
    ({"allowed_token_ids": [5]}, "allowed_token_ids", "allowed_token_ids"), ({"echo": True}, "echo", "echo"),
    ({"skip_special_tokens": False}, "skip_special_tokens", "skip_special_tokens"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "integer"}}}}, "output_config",
     "output_config is not supported"), ({"system": "Be brief."}, "system", "system is not supported"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "'nope'"),
    # text.verbosity changes the output (was silently dropped; chat's verbosity is refused)
    ({"text": {"verbosity": "low"}}, "text", "text.verbosity is not supported"),
    ({"text": {"format": {"type": "text"}, "verbosity": "high"}}, "text", "text.verbosity"),
    # a json_schema format without its schema names the Responses field (it named chat's
    # response_format.json_schema.schema, renamed to "text.json_schema.schema")
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text",
     "text.format.schema is required for type json_schema"),
    # the OpenAI SDK's compaction and moderation change the prompt / the reply: were logged and dropped
    ({"context_management": [{"type": "compaction", "compact_threshold": 1000}]}, "context_management",
     "context_management is not supported"),
    ({"moderation": {"model": "omni-moderation-latest", "policy": {"input": {"mode": "block"}}}}, "moderation",
     "moderation is not supported"),
    # metadata within OpenAI's bounds (16 pairs, keys <= 64 characters, values <= 512)
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "at most 16"),
    # a function_call_output answers an earlier function_call item (OpenAI refuses it too)
    ({"input": [{"role": "user", "content": "Hi"}, {"type": "function_call_output", "call_id": "call_nope",
                                                     "output": "18 C"}]},
     "input", "input[1].call_id: no function_call item before it has call_id 'call_nope'"),
    ({"input": [{"role": "user", "content": "Hi"},
                {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_2", "output": "18 C"}]},
     "input", "input[2].call_id: no function_call item before it has call_id 'call_2'"),
    # a function_call's output comes before the next message: the 400 was chat's, in chat's words and
    # index, mangled by the renames ("input[2]: an assistant message with 'tool_calls' must be followed
    # by tool input ...", for the call at input[1] under instructions)
    ({"instructions": "Be brief.",
      "input": [{"role": "user", "content": "Hi"},
                {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
                {"role": "user", "content": "And Tokyo?"}]},
     "input", "input[1]: no function_call_output item answers this function_call (call_id 'call_1') before the "
              "next message item, input[2]"),
    ({"input": [{"role": "user", "content": "Hi"},
                {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
                {"type": "message", "role": "assistant", "content": "Done."}]},
     "input", "input[2]: no function_call_output item answers this function_call (call_id 'call_2')"),
    # the Responses field is named, not chat's ("tool_choice.literal['none','auto','required']: Input
    # should be ...", "tools.0.function.name: Field required", "input.1.tool_calls.0.function.arguments")
    ({"tools": [TOOL], "tool_choice": {"type": "function"}}, "tool_choice",
     "tool_choice.name must be a string (the function's name)"),
    ({"tools": [{"type": "function", "parameters": {"type": "object"}}]}, "tools", "tools[0].name must be a string"),
    ({"tools": [TOOL, {**TOOL, "name": "f", "parameters": "{}"}]}, "tools", "tools[1].parameters must be an object"),
    ({"input": [{"role": "user", "content": "Hi"},
                {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{oops"},
                {"type": "function_call_output", "call_id": "call_1", "output": "18 C"}]},
     "input", "input[1].arguments is not valid JSON"),
    ({"input": [{"role": "user", "content": "Hi"},
                {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                 "arguments": "[" * 5000 + "]" * 5000},
                {"type": "function_call_output", "call_id": "call_1", "output": "18 C"}]},
     "input", "input[1].arguments is nested too deeply"),
    # a forced call with text.format named chat's fields ("cannot be combined with response_format, guided_json, ...")
    ({"tools": [TOOL], "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "tool_choice",
     "tool_choice (a forced tool call) cannot be combined with text.format of type 'json_object'"),
    # an output after a message item answers no call of the turn it follows: chat's 400 came back in chat's
    # words and index, renamed ("input[4]: a tool input must follow ...")
    ({"input": [{"role": "user", "content": "Hi"},
                {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
                {"role": "user", "content": "And now?"},
                {"type": "function_call_output", "call_id": "call_1", "output": "19 C"}]},
     "input", "input[4]: a function_call_output item must follow the function_call items of its turn"),
    ({"input": [{"role": "user", "content": "Hi"},
                {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_2", "output": "18 C"}]},
     "input", "input[1]: no function_call_output item answers this function_call (call_id 'call_1')"),
    ({"input": [{"role": "user", "content": "Hi"},
                {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_2", "output": "18 C"},
                {"type": "function_call", "call_id": "call_3", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_3", "output": "19 C"}]},
     "input", "input[1]: no function_call_output item answers this function_call (call_id 'call_1') before the "
              "next turn's function_call item, input[4]"),
    # at most 128 tools (OpenAI's limit; 2,000 reached llguidance, whose refusal was the 400)
    ({"tools": [{**TOOL, "name": f"f{i}"} for i in range(2000)]}, "tools", "tools holds 2000 tools; at most 128"),
])  # fmt: skip
def test_refused_by_name(served, body, param, match):
    r = httpx.post(served[0].url + "/v1/responses", json={"input": "Hi", **body}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and match in error["message"], error


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
def test_openai_agents_responses_model_finishes_a_turn_of_parallel_calls(served, script, streamed):
    """openai-agents' ``OpenAIResponsesModel`` (whole and streamed) over a turn that writes
    text and two calls, then the answer: the agent runs both tools and ends with the answer,
    and the last prompt holds the calls' turn as one assistant turn (the second call opened
    a second one, and Qwen2.5-Coder-1.5B then answered the final turn with nothing)."""
    try:
        import agents
    except ImportError:
        pytest.skip("openai-agents is not installed: pip install openai-agents (or kvflow[agents])")
    import asyncio

    agents.set_tracing_disabled(True)
    answer = "Paris 18 C, Tokyo 21 C."
    turn = "Let me look." + CALL + CALL.replace("Paris", "Tokyo")

    async def pick_script(request: httpx.Request) -> None:  # the scripted model's reply to this request
        body = json.loads(request.content or b"{}")
        items = body.get("input") if isinstance(body.get("input"), list) else []
        if not any(i.get("type") == "function_call_output" for i in items):
            script.set(turn)
        else:
            script.set(answer)

    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str, unit: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return {"Paris": "18 C", "Tokyo": "21 C"}[city]

    async def main():
        http = httpx.AsyncClient(event_hooks={"request": [pick_script]}, timeout=60)
        client = openai.AsyncOpenAI(base_url=served[0].url + "/v1", api_key="x", max_retries=0, http_client=http)
        agent = agents.Agent(name="weather", instructions="Use the tool.", tools=[get_weather],
                             model=agents.OpenAIResponsesModel(model="tiny", openai_client=client),
                             model_settings=agents.ModelSettings(temperature=0, max_tokens=400))  # fmt: skip
        question = "Weather in Paris and Tokyo?"
        if not streamed:
            return await agents.Runner.run(agent, question, max_turns=4)
        result = agents.Runner.run_streamed(agent, question, max_turns=4)
        async for _ in result.stream_events():
            pass
        return result

    result = asyncio.run(main())
    assert calls == ["Paris", "Tokyo"]
    assert result.final_output == answer, [i.type for i in result.new_items]
    prompt = script.tokenizer.decode(script.seq)
    assert prompt.count("<|im_start|>assistant") == 2 and prompt.count("<tool_response>") == 2, prompt


@pytest.mark.parametrize("body, match", [
    ({"input": ""}, "input must be a non-empty string or a non-empty list of input items, got an empty string"),
    ({"input": [], "instructions": "Be brief."}, "got an empty list"),
    ({"input": [{"role": "user", "content": ""}]}, "input[0].content must not be empty"),
    ({"input": [{"role": "user", "content": []}]}, "input[0].content must not be empty"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": ""}]}]}, "input[0].content must not be empty"),
    ({"input": [{"role": "developer", "content": "Be brief."}, {"type": "message", "role": "user", "content": ""}]},
     "input[1].content must not be empty"),
])  # fmt: skip
def test_empty_input_is_400_naming_the_field(served, body, match):
    """``input: ""`` (and an empty list, or a user message without text) ran the model on an
    empty user turn; it is a 400 naming the field, and the server goes on serving."""
    r = httpx.post(served[0].url + "/v1/responses", json={"model": "tiny", **body}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "input" and match in error["message"], error


def test_an_empty_assistant_message_of_earlier_output_is_served(served, script):
    script.set("It is sunny.")
    r = httpx.post(served[0].url + "/v1/responses", timeout=60, json={"model": "tiny", "max_output_tokens": 20, "input": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": [{"type": "output_text", "text": ""}]},
        {"role": "user", "content": "Weather in Paris?"}]})  # fmt: skip
    assert r.status_code == 200, r.text
