"""The guided-decoding schema of tool_choice "required" / a named function, checked with the
grammar engine itself (llguidance over a byte-level tokenizer): calls valid for the tools'
schemas are accepted to the end, anything else is refused at the first wrong byte."""

from __future__ import annotations

import json

import pytest

from conftest import TINY_TEXT_VOCAB, tiny_tokenizer
from kvflow.entrypoints.openai.protocol import ChatCompletionRequest
from kvflow.entrypoints.openai.tools import check_tools, tool_call_structural_tag, tool_choice_schema
from kvflow.sample.guided import GrammarCompiler
from kvflow.sampling_params import SamplingParams

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time"}},  # no parameters
]  # fmt: skip
MSG = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def compiler():
    tok = tiny_tokenizer()
    return tok, GrammarCompiler(tok, TINY_TEXT_VOCAB, tok.eos_token_id)


def _request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MSG, "tools": TOOLS, **kw})


def _accepts(compiler, schema, text: str) -> bool:
    """Whether the grammar takes ``text`` byte by byte and is then complete."""
    tok, comp = compiler
    matcher = comp.compile(SamplingParams(guided_json=schema))
    for token in tok.encode(text, add_special_tokens=False):
        if not matcher.matcher.consume_token(token):
            return False
    return matcher.matcher.is_accepting()


def test_required_schema(compiler):
    schema = _request(tool_choice="required").guided_schema()
    ok = [
        '[{"name": "get_weather", "parameters": {"city": "Paris"}}]',
        '[{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}, {"name": "get_time", "parameters": {}}]',
    ]
    bad = [
        "[]",  # at least one call
        '[{"name": "get_news", "parameters": {}}]',  # not a tool
        '[{"name": "get_weather", "parameters": {"days": 3}}]',  # city is required
        '[{"name": "get_weather", "parameters": {"city": 3}}]',  # city is a string
        '[{"name": "get_time", "parameters": {"x": 1}}]',  # no parameters declared: none allowed
        '[{"name": "get_time", "parameters": {}, "extra": 1}]',
        '[{"name":"get_time","parameters":{}}]',  # one fixed layout (no free whitespace choices)
        '[{"name": "get_time", "parameters": {}}] ',
    ]
    assert all(_accepts(compiler, schema, t) for t in ok)
    assert not any(_accepts(compiler, schema, t) for t in bad)


def test_required_without_parallel_calls_allows_one(compiler):
    schema = _request(tool_choice="required", parallel_tool_calls=False).guided_schema()
    assert _accepts(compiler, schema, '[{"name": "get_time", "parameters": {}}]')
    assert not _accepts(compiler, schema, '[{"name": "get_time", "parameters": {}}, {"name": "get_time", "parameters": {}}]')


def test_named_function_schema_is_its_arguments(compiler):
    schema = _request(tool_choice={"type": "function", "function": {"name": "get_weather"}}).guided_schema()
    assert _accepts(compiler, schema, '{"city": "Rome", "days": 2}')
    assert not _accepts(compiler, schema, '{"days": 2}')
    assert not _accepts(compiler, schema, '[{"name": "get_weather", "parameters": {"city": "Rome"}}]')


def test_auto_and_none_do_not_constrain():
    assert _request(tool_choice="auto").guided_schema() is None
    assert _request(tool_choice="none").guided_schema() is None
    assert _request().guided_schema() is None


@pytest.mark.parametrize(
    "body,match",
    [({"tool_choice": "required", "tools": None}, "tool_choice 'required' needs tools"),
     ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
     ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
     ({"tool_choice": "required", "guided_regex": "a+"}, "cannot be combined"),
     ({"tools": TOOLS + TOOLS[:1]}, "two functions named 'get_weather'")],
)  # fmt: skip
def test_bad_tool_choices_are_named(body, match):
    with pytest.raises(ValueError, match=match) as exc:
        _request(**body).sampling_params(8, None)
    assert str(exc.value).split(" ", 1)[0] in ("tools", "tool_choice")


def test_assistant_tool_calls_reach_the_template_as_dicts():
    req = ChatCompletionRequest.model_validate({"messages": [
        *MSG,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]})  # fmt: skip
    assistant, tool = (m.template_dict() for m in req.messages[1:])
    assert assistant == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": {"tz": "UTC"}}}]}  # fmt: skip
    assert tool == {"role": "tool", "content": "12:00", "tool_call_id": "call_1"}


@pytest.mark.parametrize(
    "message,match",
    [({"role": "tool", "content": "x"}, "needs tool_call_id"),
     ({"role": "user", "content": "x", "tool_call_id": "c"}, "tool_call_id is for tool messages"),
     ({"role": "user", "content": "x", "tool_calls": []}, "tool_calls is for assistant messages"),
     ({"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                            "function": {"name": "f", "arguments": "{oops"}}]}, "not valid JSON"),
     # JSON text nested past Python's recursion limit: a RecursionError, answered 500 (the body's
     # own nesting is bounded at 64 levels, the JSON text of arguments was not)
     ({"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
         "name": "f", "arguments": "[" * 5000 + "]" * 5000}}]}, "arguments is nested too deeply")],
)  # fmt: skip
def test_bad_tool_messages(message, match):
    with pytest.raises(ValueError, match=match):
        ChatCompletionRequest.model_validate({"messages": [message]})


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "f"}}, "auto", "none"])
@pytest.mark.parametrize("kind", ["string", "array", "integer"])
def test_a_parameters_schema_not_of_type_object_is_refused_naming_the_tool(tool_choice, kind):
    """A call's arguments are a JSON object. A tool whose parameters were {"type": "string"}
    was accepted, and under "required" / a named function the forced output (a string, a list)
    could never be read as a call: the reply came back as content, finish_reason "stop", no
    tool call (seen on kvflow serve with SmolLM2). OpenAI refuses such a schema; so does kvflow,
    naming the tool."""
    tools = [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": {"type": kind}}}]
    with pytest.raises(ValueError, match=rf"^tools\[1\]\.function\.parameters must be a JSON schema of type "
                                         rf"'object'.*got type '{kind}'"):
        _request(tools=tools, tool_choice=tool_choice).sampling_params(8, None)


def test_a_parameters_schema_of_type_object_or_without_a_type_is_taken():
    tools = [TOOLS[0], TOOLS[1], {"type": "function", "function": {"name": "f", "parameters": {
        "properties": {"a": {"type": "integer"}}}}}]  # fmt: skip
    check_tools(_request(tools=tools).tools, "required")


def test_check_tools_accepts_no_tools():
    check_tools(None, None)
    check_tools([], "none")
    assert json.loads(json.dumps(tool_choice_schema([], "auto", True))) is None


# ---------------------------------------------------------------------------- tool_choice "auto"
def _tag_accepts(compiler, tag, text: str, special: dict[str, int] | None = None) -> bool:
    """Whether the structural tag's grammar takes ``text`` and may then end."""
    tok, comp = compiler
    matcher = comp.compile(SamplingParams(structural_tag=tag))
    for token in tok.encode(text, add_special_tokens=False):
        if not matcher.matcher.consume_token(token):
            return False
    return matcher.matcher.is_accepting()


def test_auto_structural_tag_constrains_each_started_call(compiler):
    from kvflow.entrypoints.openai.tool_parsers import GenericToolParser

    request = _request(tool_choice="auto")
    tag = tool_call_structural_tag(request.tools, GenericToolParser.call_forms)
    ok = [
        "It is sunny, no tool needed.",  # free text
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        '{"name": "get_time", "arguments": {}}\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}} done',
        '```json\n{\n  "name": "get_weather",\n  "arguments": {"city": "Paris"}\n}\n```',
        "x = {1: 2}  # a brace that starts no call",
    ]
    bad = [
        '<tool_call>\n{"name": "get_news", "arguments": {}}\n</tool_call>',  # not a tool
        '{"name": "get_weather", "arguments": {"days": 3}}',  # city is required
        '{"name": "get_weather", "arguments": {"city": Paris}}',  # not JSON
        '{"name": "get_time", "arguments": {"x": 1}}',  # no parameters declared
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}',  # a started call must finish
    ]
    assert all(_tag_accepts(compiler, tag, t) for t in ok)
    assert not any(_tag_accepts(compiler, tag, t) for t in bad)
    # the parser reads every call the constraint lets through
    parsed = GenericToolParser().parse(ok[2], final=True)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("get_time", {}), ("get_weather", {"city": "Rome", "days": 2})]


def test_structural_tag_matches_an_added_token_as_that_token():
    """A trigger that is an added token (Qwen's <tool_call>) is the token, not its spelling:
    llguidance reads added tokens as special."""
    from kvflow.sample.guided import structural_tag_lark

    tag = {"structures": [{"begin": "<tool_call>\n{", "schema": {"type": "object"}, "end": "}</tool_call>"}],
           "triggers": ["<tool_call>"]}  # fmt: skip
    lark = structural_tag_lark(tag, {"<tool_call>": 300, "</tool_call>": 301})
    assert "TAG_TEXT <[300]>" in lark and "<[301]>" in lark and '"<tool_call>"' not in lark
    assert '[lazy]: TAG_TEXT "<tool_call>"' in structural_tag_lark(tag, {})  # spelled: a lazy trigger


@pytest.mark.parametrize("tag,match", [
    ({"structures": [], "triggers": ["<a>"]}, "structures"),
    ({"structures": [{"begin": "<a>", "schema": {}, "end": ""}], "triggers": []}, "triggers"),
    ({"structures": [{"begin": "<b>", "schema": {}, "end": ""}], "triggers": ["<a>"]}, "none of the triggers"),
    ({"structures": [{"begin": "<a>", "end": ""}], "triggers": ["<a>"]}, "schema"),
    ("{not json", "not valid JSON"),
])  # fmt: skip
def test_bad_structural_tags_are_named(compiler, tag, match):
    with pytest.raises(ValueError, match="structural_tag") as exc:
        compiler[1].compile(SamplingParams(structural_tag=tag))
    assert match in str(exc.value)
