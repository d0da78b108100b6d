"""POST /v1/messages (Anthropic's Messages API) through the HTTP server with the
``anthropic`` client, on the scripted tiny model of ``agent_helpers`` (Hermes-format
template, ``--reasoning-parser qwen3``): text, streaming, a tool_use round trip, forced
tool use, stop reasons, Anthropic-shaped errors and the ``x-api-key`` header."""

from __future__ import annotations

import gzip
import json

import httpx
import pytest

from agent_helpers import ARGS, CALL, WEATHER_TOOL, scripted_server

anthropic = pytest.importorskip("anthropic")

API_KEY = "sk-tiny-anthropic"
TOOL = {"name": "get_weather", "description": WEATHER_TOOL["function"]["description"],
        "input_schema": WEATHER_TOOL["function"]["parameters"]}  # fmt: skip
MSG = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def served():
    yield from scripted_server(api_key=API_KEY)


@pytest.fixture(scope="module")
def script(served):
    return served[1]


@pytest.fixture(scope="module")
def client(served):
    with anthropic.Anthropic(base_url=served[0].url, api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


def _create(client, **kw):
    return client.messages.create(model="tiny", max_tokens=kw.pop("max_tokens", 120), messages=kw.pop("messages", MSG),
                                  **kw)  # fmt: skip


def test_text(client, script):
    script.set("It is sunny.")
    r = _create(client, system="Be brief.")
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
    assert [(b.type, b.text) for b in r.content] == [("text", "It is sunny.")]
    assert r.stop_reason == "end_turn" and r.stop_sequence is None
    assert r.usage.output_tokens == len(script.script) and r.usage.input_tokens > 0
    assert "<|im_start|>system\nBe brief.<|im_end|>" in script.tokenizer.decode(script.seq)


def test_stop_reasons(client, script):
    script.set("It is sunny. Really.")
    r = _create(client, stop_sequences=["."])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == "." and r.content[0].text == "It is sunny"
    r = _create(client, max_tokens=3)
    assert r.stop_reason == "max_tokens" and r.content[0].text == "It "


def test_text_streamed(client, script):
    script.set("<think>Easy.</think>It is sunny.")
    with client.messages.stream(model="tiny", max_tokens=120, messages=MSG) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events if e.type not in ("text", "thinking", "input_json", "signature")]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "text"]
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta") \
        == "It is sunny."
    assert [(b.type, getattr(b, "text", None) or getattr(b, "thinking", None)) for b in final.content] == [
        ("thinking", "Easy."), ("text", "It is sunny.")]
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == len(script.script)


def test_tool_use_round_trip(client, script):
    script.set(CALL)
    r = _create(client, tools=[TOOL])
    assert r.stop_reason == "tool_use"
    (use,) = r.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.input == ARGS and use.id.startswith("toolu_")
    script.set("It is 18 C in Paris.")
    messages = [*MSG, {"role": "assistant", "content": [b.model_dump() for b in r.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C"}]}]
    r2 = _create(client, tools=[TOOL], messages=messages)
    assert r2.content[0].text == "It is 18 C in Paris." and r2.stop_reason == "end_turn"
    prompt = script.tokenizer.decode(script.seq)
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in prompt
    assert "<tool_response>\n18 C\n</tool_response>" in prompt


def test_tool_use_streamed(client, script):
    script.set("Let me check. " + CALL)
    with client.messages.stream(model="tiny", max_tokens=120, messages=MSG, tools=[TOOL]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    json_deltas = [e.delta.partial_json for e in events if e.type == "content_block_delta"
                   and e.delta.type == "input_json_delta"]  # fmt: skip
    assert len(json_deltas) == 1 and json.loads(json_deltas[0]) == ARGS  # sent whole, once complete
    assert [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[0].text == "Let me check." and final.content[1].input == ARGS
    assert final.stop_reason == "tool_use"


def test_sampling_fields_and_output_format(client, script):
    script.set('{"ok": true}')
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    r = _create(client, output_config={"format": {"type": "json_schema", "schema": schema}},
                extra_body={"temperature": 0, "top_p": 0.9, "top_k": 5})  # not in this client's signature
    assert json.loads(r.content[0].text) == {"ok": True}
    for temperature in (-1, 1.5):  # Anthropic's range is [0, 1]
        with pytest.raises(anthropic.BadRequestError, match="temperature"):
            _create(client, extra_body={"temperature": temperature})
    assert _create(client, extra_body={"temperature": 1}).content[0].text == '{"ok": true}'


def test_output_format_of_the_structured_outputs_beta(client, script):
    """``output_format`` (the beta's name of ``output_config.format``, which the SDK's
    ``client.beta.messages`` sends) constrains the output as ``output_config.format`` does: it
    was logged as an unknown field and dropped, and the reply was free text."""
    script.set("No JSON here.")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    r = _create(client, extra_body={"output_format": {"type": "json_schema", "schema": schema}})
    assert isinstance(json.loads(r.content[0].text)["ok"], bool), r.content
    with pytest.raises(anthropic.BadRequestError, match="output_format must be"):
        _create(client, extra_body={"output_format": {"type": "json_object"}})


@pytest.mark.parametrize("tool_choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_forced_tool_use(client, script, tool_choice):
    script.set("No tool for me.")
    r = _create(client, tools=[TOOL], tool_choice={**tool_choice, "disable_parallel_tool_use": True})
    (use,) = r.content
    assert use.type == "tool_use" and use.name == "get_weather" and r.stop_reason == "tool_use"
    assert use.input["city"] in ("Paris", "Tokyo") and use.input["unit"] in ("celsius", "fahrenheit")


@pytest.mark.parametrize("tool_choice", [{"type": "auto"}, {"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_tool_use_cut_by_max_tokens_streams_as_the_whole_message(client, script, tool_choice):
    """A call cut short is a text block with the raw text (no tool_use), streamed or not;
    the stream never started a tool_use block."""
    script.set("Checking. " + CALL)
    kw = {"tools": [TOOL], "tool_choice": tool_choice, "max_tokens": 30, "extra_body": {"temperature": 0}}
    whole = _create(client, **kw)
    with client.messages.stream(model="tiny", messages=MSG, **kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert whole.stop_reason == final.stop_reason == "max_tokens"
    assert [b.type for b in whole.content] == [b.type for b in final.content] == ["text"]
    assert [e.content_block.type for e in events if e.type == "content_block_start"] == ["text"]
    assert final.content[0].text == whole.content[0].text and len(whole.content[0].text) > 10


def test_errors_are_anthropic_shaped(client, served):
    with pytest.raises(anthropic.BadRequestError) as info:
        _create(client, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert info.value.body == {"type": "error", "error": {"type": "invalid_request_error", "message": info.value.body[
        "error"]["message"]}}
    assert "'image'" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-nope", max_tokens=5, messages=MSG)
    url = served[0].url + "/v1/messages"
    r = httpx.post(url, json={"model": "tiny", "max_tokens": 5, "messages": MSG}, headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["type"] == "error" and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(url, json={"model": "tiny", "messages": MSG}, headers={"x-api-key": API_KEY})  # no max_tokens
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in r.json()["error"]["message"]
    # Bearer works too; other paths keep OpenAI's shape and do not take x-api-key
    script_body = {"model": "tiny", "max_tokens": 5, "messages": MSG, "thinking": {"type": "enabled", "budget_tokens": 9}}
    r = httpx.post(url, json=script_body, headers={"authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 400 and "thinking" in r.json()["error"]["message"], r.text
    r = httpx.post(served[0].url + "/v1/chat/completions", json={"messages": MSG}, headers={"x-api-key": API_KEY})
    assert r.status_code == 401 and set(r.json()) == {"error"}


@pytest.mark.parametrize("body, match", [
    ({"tools": [{"type": "web_search_20250305", "name": "web_search", "input_schema": {}}]}, "'web_search_20250305'"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "'document'"),
    ({"system": [{"type": "image", "source": {}}]}, "'image'"),
    ({"messages": [*MSG, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "get_weather",
                                                            "input": {}}]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
                       {"type": "image", "source": {}}]}]}]}, "'image'"),
    ({"tool_choice": {"type": "tool"}, "tools": [TOOL]}, "tool_choice.name"),
    # named in Anthropic's terms (the message said "tool_choice 'required' needs tools")
    ({"tool_choice": {"type": "any"}}, "tool_choice of type 'any' needs tools"),
    ({"tool_choice": {"type": "tool", "name": "get_weather"}}, "tool_choice of type 'tool' needs tools"),
    ({"mcp_servers": [{"url": "x"}]}, "mcp_servers"),
    ({"messages": [*MSG, {"role": "assistant", "content": "It is"}]}, "prefill"),
    ({"output_config": {"effort": "high"}}, "output_config.effort"),
    ({"output_format": {"type": "json_schema", "schema": {}}, "output_config": {"format": {"type": "json_schema", "schema": {}}}},
     "output_format and output_config.format are both set"),
    # the context-management beta's edits were logged and dropped
    ({"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}, "context_management is not supported"),
    # the SDK's beta compaction request and server-held thread were logged and dropped
    ({"compaction": {"type": "enabled"}}, "compaction is not supported"),
    ({"thread": {"type": "continue", "previous_message_id": "msg_1"}}, "thread is not supported"),
    # other APIs' fields that change the output were logged and dropped (200 with the regex
    # unmet); a refusal names the field as the client sent it (``stop`` was named
    # "stop_sequences", ``response_format`` "output_config")
    ({"guided_regex": "a+"}, "guided_regex is not supported"), ({"guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"), ({"max_completion_tokens": 1}, "max_completion_tokens"),
    ({"bad_words": ["x"]}, "bad_words"), ({"allowed_token_ids": [5]}, "allowed_token_ids"), ({"priority": 3}, "priority"),
    ({"echo": True}, "echo"), ({"top_logprobs": 3}, "top_logprobs"), ({"truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
    ({"include_stop_str_in_output": True}, "include_stop_str_in_output"),
    ({"skip_special_tokens": False}, "skip_special_tokens"),
    ({"stop": ["x"]}, "stop is not supported"), ({"response_format": {"type": "json_object"}}, "response_format is not"),
    ({"text": {"format": {"type": "json_object"}}}, "text is not"), ({"max_output_tokens": 1}, "max_output_tokens"),
    ({"instructions": "Be brief."}, "instructions is not"),
    # at most 128 tools (OpenAI's limit; 2,000 reached llguidance, whose refusal was the 400)
    ({"tools": [{**TOOL, "name": f"f{i}"} for i in range(2000)]}, "tools holds 2000 tools; at most 128"),
    # a forced call with an output format named chat's fields ("cannot be combined with response_format, ...")
    ({"tools": [TOOL], "tool_choice": {"type": "any"}, "output_config": {"format": {"type": "json_schema", "schema": {}}}},
     "tool_choice of type 'any' (a forced tool call) cannot be combined with output_config.format"),
    ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "get_weather"},
      "output_format": {"type": "json_schema", "schema": {}}}, "tool_choice of type 'tool' (a forced tool call) "
                                                                "cannot be combined with output_format"),
    # Anthropic's error body has no param: the context-length 400 named no field
    ({"max_tokens": 10**6}, "max_tokens: This model's maximum context length is 2048 tokens"),
])  # fmt: skip
def test_refused_by_name(served, body, match):
    r = httpx.post(served[0].url + "/v1/messages", json={"model": "tiny", "max_tokens": 5, "messages": MSG, **body},
                   headers={"x-api-key": API_KEY})  # fmt: skip
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and match in r.json()["error"]["message"], r.json()


def test_count_tokens_is_the_prompt_messages_computes(client, script, served):
    """POST /v1/messages/count_tokens (was 404): the input tokens /v1/messages reports for
    the same system, messages and tools."""
    script.set("It is sunny.")
    counted = client.messages.count_tokens(model="tiny", messages=MSG, system="Be brief.", tools=[TOOL])
    usage = _create(client, system="Be brief.", tools=[TOOL]).usage
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens  # Anthropic's split
    without_tools = client.messages.count_tokens(model="tiny", messages=MSG, system="Be brief.")
    assert 0 < without_tools.input_tokens < counted.input_tokens
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}]}])
    assert info.value.body["type"] == "error" and "image" in info.value.body["error"]["message"]


def test_tokenize_takes_tools_as_chat_completions_renders_them(served):
    """vLLM's /tokenize accepts ``tools`` (it was refused): the count is the chat prompt's."""
    messages = [{"role": "system", "content": "Be brief."}, *MSG]
    with httpx.Client(base_url=served[0].url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as http:
        r = http.post("/tokenize", json={"messages": messages, "tools": [WEATHER_TOOL]})
        assert r.status_code == 200, r.text
        served[1].set("ok")
        chat = http.post("/v1/chat/completions", json={"messages": messages, "tools": [WEATHER_TOOL],
                                                       "tool_choice": "none", "max_tokens": 2})
        assert chat.status_code == 200, chat.text
        assert r.json()["count"] == chat.json()["usage"]["prompt_tokens"]
        plain = http.post("/tokenize", json={"messages": messages}).json()["count"]
        assert plain < r.json()["count"]
        bad = http.post("/tokenize", json={"messages": messages, "tools": [{"type": "function"}]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools", bad.text


@pytest.mark.parametrize("written", [
    'Sure.\n```json\n{\n  "name": "get_weather",\n  "arguments": {"city": "Paris", "unit": "celsius"}\n}\n```',
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
])  # fmt: skip
def test_untagged_call_is_a_tool_use_block_and_never_text(client, script, written):
    """A call written as a ```json fence or a bare JSON line is a tool_use block; no piece of
    it reaches a text block (streamed: no text delta holds it)."""
    script.set(written)
    with client.messages.stream(model="tiny", max_tokens=200, messages=MSG, tools=[TOOL]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    texts = "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta")
    assert "{" not in texts and "`" not in texts and "name" not in texts, texts
    assert [b.type for b in final.content] == (["text", "tool_use"] if written.startswith("Sure") else ["tool_use"])
    assert final.content[-1].name == "get_weather" and final.content[-1].input == ARGS
    assert final.stop_reason == "tool_use"


_USE = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}]}


def _result(tool_use_id: str) -> dict:
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use_id, "content": "18 C"}]}


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
@pytest.mark.parametrize("messages", [
    [_result("toolu_nope")],
    [*MSG, _USE, _result("toolu_nope")],
    [*MSG, _USE, _result("toolu_1"), {"role": "assistant", "content": "It is 18 C."}, _result("toolu_1")],
], ids=["no-tool-use", "another-id", "not-the-previous-message"])  # fmt: skip
def test_a_tool_result_without_its_tool_use_is_400_naming_the_id(served, messages, path):
    """Anthropic answers 400 when a tool_result's tool_use_id is not a tool_use of the
    previous message; kvflow took it (and rendered an answer to no call)."""
    r = httpx.post(served[0].url + path, json={"model": "tiny", "max_tokens": 5, "messages": messages},
                   headers={"x-api-key": API_KEY})  # fmt: skip
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    bad = messages[-1]["content"][0]["tool_use_id"]
    assert f"unexpected tool_use_id found in tool_result blocks: {bad!r}" in body["error"]["message"], body
    assert f"messages[{len(messages) - 1}].content[0]" in body["error"]["message"], body


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
@pytest.mark.parametrize("next_message", [
    {"role": "user", "content": "And Tokyo?"},
    {"role": "user", "content": [{"type": "text", "text": "And Tokyo?"}]},
], ids=["string", "text-block"])  # fmt: skip
def test_a_tool_use_without_its_tool_result_is_400_naming_the_id(served, next_message, path):
    """Anthropic answers 400 when a tool_use is not answered by a tool_result in the next
    message; kvflow took it (and rendered a call that was never answered)."""
    messages = [*MSG, _USE, next_message]
    r = httpx.post(served[0].url + path, json={"model": "tiny", "max_tokens": 5, "messages": messages},
                   headers={"x-api-key": API_KEY})  # fmt: skip
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    assert "messages[2]: tool_use ids were found without tool_result blocks immediately after: toolu_1" in body[
        "error"]["message"], body


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
@pytest.mark.parametrize("content, where", [
    ([{"type": "text", "text": "Here:"}, _result("toolu_1")["content"][0]], "messages[2].content[1]"),
    ([_result("toolu_1")["content"][0], {"type": "text", "text": "and"},
      {"type": "tool_result", "tool_use_id": "toolu_2", "content": "21 C"}], "messages[2].content[2]"),
], ids=["text-first", "text-between"])  # fmt: skip
def test_a_tool_result_after_a_text_block_is_400_naming_the_block(served, content, where, path):
    """Anthropic wants a user message's tool_result blocks before its text. Text before a
    tool_result was a 400 in chat's words naming chat's message, one further on with a system
    prompt ("messages[2]: an assistant message with 'tool_calls' must be followed by tool
    messages ..." for Anthropic's messages[1]); it names the block."""
    use = {"role": "assistant", "content": [*_USE["content"], {**_USE["content"][0], "id": "toolu_2"}]}
    messages = [*MSG, use, {"role": "user", "content": content}]
    r = httpx.post(served[0].url + path, json={"model": "tiny", "max_tokens": 5, "system": "Be brief.",
                                               "messages": messages}, headers={"x-api-key": API_KEY})  # fmt: skip
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    assert body["error"]["message"].startswith(f"{where}: tool_result blocks must come first"), body


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_sdk_tool_runner_finishes_a_tool_loop(client, script, stream):
    """The anthropic SDK's tool runner (``client.beta.messages.tool_runner``) sends
    ``thread: {"type": "create"}`` (a server-held conversation) and goes on without it when the
    400 says ``details.error_code`` ``thread_unsupported_request``; kvflow's 400 said only
    "thread is not supported", so the runner raised it and no agent loop ran."""
    if not hasattr(client.beta.messages, "tool_runner"):
        pytest.skip("this anthropic SDK has no tool runner")
    calls = []

    @anthropic.beta_tool
    def get_weather(city: str, unit: str) -> str:
        """The current weather in a city.

        Args:
            city: the city.
            unit: celsius or fahrenheit.
        """
        calls.append(city)
        script.set("It is 18 C in Paris.")
        return "18 C"

    script.set(CALL)
    runner = client.beta.messages.tool_runner(model="tiny", max_tokens=120, tools=[get_weather], messages=MSG,
                                              stream=stream, max_iterations=3)  # fmt: skip
    replies = [m.get_final_message() if stream else m for m in runner]
    assert calls == ["Paris"]
    assert [r.stop_reason for r in replies] == ["tool_use", "end_turn"], replies
    assert replies[-1].content[0].text == "It is 18 C in Paris."


def test_a_thread_is_refused_with_the_details_the_sdk_reads(served):
    r = httpx.post(served[0].url + "/v1/messages", json={"model": "tiny", "max_tokens": 5, "messages": MSG,
                                                         "thread": {"type": "create"}}, headers={"x-api-key": API_KEY})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["details"] == {"error_code": "thread_unsupported_request"} and "thread" in error["message"], error


@pytest.mark.parametrize("content_type", ["text/plain", None])
def test_a_body_not_sent_as_json_is_an_anthropic_shaped_400(served, content_type):
    """As on the OpenAI paths (tests/entrypoints/openai/test_server_tiny.py), in Anthropic's shape."""
    headers = {"x-api-key": API_KEY, **({} if content_type is None else {"content-type": content_type})}
    body = json.dumps({"model": "tiny", "max_tokens": 5, "messages": MSG}).encode()
    r = httpx.post(served[0].url + "/v1/messages", content=body, headers=headers)
    assert r.status_code == 400, r.text
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error", "message": r.json()["error"][
        "message"]}}
    assert "must be JSON sent with Content-Type: application/json" in r.json()["error"]["message"], r.json()


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_a_gzip_body_is_an_anthropic_shaped_415_naming_the_content_encoding(served, path):
    """A gzip body was read as if it were plain JSON; it is refused by name, in Anthropic's shape."""
    body = gzip.compress(json.dumps({"model": "tiny", "max_tokens": 5, "messages": MSG}).encode())
    r = httpx.post(served[0].url + path, content=body,
                   headers={"x-api-key": API_KEY, "content-type": "application/json", "content-encoding": "gzip"})
    assert r.status_code == 415, r.text
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error", "message": r.json()["error"][
        "message"]}}
    assert "Content-Encoding: gzip is not supported" in r.json()["error"]["message"], r.json()


@pytest.mark.parametrize("body, where", [
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": ""}]}]},
     "messages[0].content[1]"),
    ({"system": [{"type": "text", "text": ""}]}, "system[0]"),
    ({"messages": [*MSG, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "get_weather",
                                                            "input": {}}]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
                       {"type": "text", "text": ""}]}]}]}, "messages[2].content[0].content[0]"),
    ({"messages": [*MSG, {"role": "assistant", "content": [{"type": "text", "text": ""}]}, *MSG]},
     "messages[1].content[0]"),
])  # fmt: skip
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_an_empty_text_block_is_400_naming_it(served, body, where, path):
    """``{"type": "text", "text": ""}`` was served; it is Anthropic's 400 "text content blocks
    must be non-empty", naming the block."""
    r = httpx.post(served[0].url + path, json={"model": "tiny", "max_tokens": 5, "messages": MSG, **body},
                   headers={"x-api-key": API_KEY})  # fmt: skip
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error", r.json()
    assert f"{where}: text content blocks must be non-empty" in r.json()["error"]["message"], r.json()


@pytest.mark.parametrize("messages, where", [
    ([{"role": "user", "content": ""}], "messages[0]"),
    ([{"role": "user", "content": []}], "messages[0]"),
    ([*MSG, {"role": "assistant", "content": ""}, *MSG], "messages[1]"),
    ([*MSG, {"role": "assistant", "content": []}, *MSG], "messages[1]"),
])  # fmt: skip
def test_a_message_with_empty_content_is_400_naming_it(served, messages, where):
    r = httpx.post(served[0].url + "/v1/messages", json={"model": "tiny", "max_tokens": 5, "messages": messages},
                   headers={"x-api-key": API_KEY})  # fmt: skip
    assert r.status_code == 400, r.text
    assert (f"{where}: all messages must have non-empty content except for the optional final assistant message"
            in r.json()["error"]["message"]), r.json()
