"""Tool-call parsers per family: whole texts, texts that are not calls, and streaming (the
deltas of any split of the text add up to the whole parse)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.entrypoints.openai.chat_output import ChatOutputParser
from kvflow.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS, JSONArrayToolParser, NamedFunctionParser, detect_tool_parser, get_tool_parser,
)  # fmt: skip
from kvflow.entrypoints.openai.tool_parsers.base import Incomplete, NotJSON, scan_value

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2], "note": "a \\"}\\" b"}}'
WEATHER_ARGS = '{"city": "Paris", "days": [1, 2], "note": "a \\"}\\" b"}'
TIME = '{"name": "get_time", "arguments": {}}'


def _calls(parsed):
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


# ---------------------------------------------------------------------------- whole texts
HERMES_CASES = [
    (f"<tool_call>\n{WEATHER}\n</tool_call>", "", [("get_weather", json.loads(WEATHER_ARGS))]),
    (f"Let me look.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>", "Let me look.",
     [("get_weather", json.loads(WEATHER_ARGS)), ("get_time", {})]),
    (f"<tool_call>{TIME}</tool_call> done", "done", [("get_time", {})]),  # text after the calls stays
    (f"<tool_call>\n{TIME}", "", [("get_time", {})]),  # no closing tag at the very end
    (f"<tool_call>\n{TIME}\n</tool", "", [("get_time", {})]),  # closing tag cut short (max_tokens)
    (f"{WEATHER}\n{TIME}", "", [("get_weather", json.loads(WEATHER_ARGS)), ("get_time", {})]),  # bare (Qwen2.5-Coder)
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}\n{"temperature_c": 18}', '{"temperature_c": 18}',
     [("get_weather", {"city": "Paris"})]),
    ('{"name": "f", "arguments": "{\\"x\\": 1}"}', "", [("f", {"x": 1})]),  # arguments as a JSON string
    ('{"name": "f", "parameters": {"x": 1}}', "", [("f", {"x": 1})]),
    ("Just text, no calls.", "Just text, no calls.", []),
    ('{"name": "Ann", "age": 3}', '{"name": "Ann", "age": 3}', []),  # JSON, but no arguments: not a call
    ("<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
    # cut short (max_tokens): no call, the raw text is content (vLLM)
    ('Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1', 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1', []),
    (f'<tool_call>{TIME}</tool_call>\n<tool_call>{{"name": "f", "argu', '<tool_call>{"name": "f", "argu',
     [("get_time", {})]),  # the complete call before stays a call
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),  # no name
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', []),
    (f"<tool_call>{TIME}</tool_call><tool_call>oops", "<tool_call>oops", [("get_time", {})]),  # the good call stays
]  # fmt: skip

# The forms small models write (Qwen2.5-Coder-0.5B-Instruct): the generic parser, and hermes
# (Qwen's detected family), read them all.
CONVERT = '{"name": "convert", "arguments": {"value": 18, "to": "F"}}'
GENERIC_CASES = [
    (f"```json\n{WEATHER}\n```", "", [("get_weather", json.loads(WEATHER_ARGS))]),
    (f"I will call it.\n```json\n[{TIME}, {CONVERT}]\n```\nDone.", "I will call it.\nDone.",
     [("get_time", {}), ("convert", {"value": 18, "to": "F"})]),
    (f"```\n{TIME}\n{CONVERT}\n```", "", [("get_time", {}), ("convert", {"value": 18, "to": "F"})]),
    (f"[{TIME}, {CONVERT}]", "", [("get_time", {}), ("convert", {"value": 18, "to": "F"})]),  # a list of calls
    (f"Checking: {CONVERT}", "Checking:", [("convert", {"value": 18, "to": "F"})]),  # {"name" mid-line
    (f"{TIME}\n\n{CONVERT}\n", "", [("get_time", {}), ("convert", {"value": 18, "to": "F"})]),  # JSON lines
    (f"<tool_call>\n{TIME}\n</tool_call>\n```json\n{CONVERT}\n```", "",
     [("get_time", {}), ("convert", {"value": 18, "to": "F"})]),  # forms mixed
    ("```json\n{\"a\": 1}\n```", "```json\n{\"a\": 1}\n```", []),  # a JSON answer, not a call
    ("```python\nx = {1: 2}\n```", "```python\nx = {1: 2}\n```", []),
    ("int f() {\n  return [x];\n}", "int f() {\n  return [x];\n}", []),
    ("See [the docs](http://x).", "See [the docs](http://x).", []),
    ('Sure.\n```json\n{"name": "convert", "arguments": {"value": 1', 'Sure.\n```json\n{"name": "convert", "arguments": {"value": 1',
     []),  # cut short: the raw text
    ('{"name": "convert", "argu', '{"name": "convert", "argu', []),
    ('[{"name": "convert", "arguments": {}}, {"name": "f"', '[{"name": "convert", "arguments": {}}, {"name": "f"', []),
]  # fmt: skip

LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", {"city": "Paris"})]),
    ('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}', "",
     [("a", {}), ("b", {"x": 1})]),
    ("The weather is fine.", "The weather is fine.", []),
    ('{"answer": 42}', '{"answer": 42}', []),
]  # fmt: skip

MISTRAL_CASES = [
    (f"[TOOL_CALLS][{WEATHER}, {TIME}]", "", [("get_weather", json.loads(WEATHER_ARGS)), ("get_time", {})]),
    ('Sure. [TOOL_CALLS] [{"name": "f", "arguments": {"x": 1}}]', "Sure. ", [("f", {"x": 1})]),
    ('[TOOL_CALLS]f[ARGS]{"x": 1}[TOOL_CALLS]g[ARGS]{}', "", [("f", {"x": 1}), ("g", {})]),  # v11 tokenizers
    ("No tools needed.", "No tools needed.", []),
    ("[TOOL_CALLS][{broken", "[TOOL_CALLS][{broken", []),
    ('[TOOL_CALLS]f[ARGS]{"x": 1}[TOOL_CALLS]g[ARGS]{"y', '[TOOL_CALLS]f[ARGS]{"x": 1}[TOOL_CALLS]g[ARGS]{"y', []),  # cut
    (f"[TOOL_CALLS][{WEATHER}, {{\"name", f"[TOOL_CALLS][{WEATHER}, {{\"name", []),  # cut
]  # fmt: skip


@pytest.mark.parametrize(
    "family,text,content,calls",
    [("hermes", *c) for c in HERMES_CASES] + [("llama3_json", *c) for c in LLAMA_CASES]
    + [("mistral", *c) for c in MISTRAL_CASES] + [(f, *c) for f in ("generic", "hermes") for c in GENERIC_CASES]
    + [("generic", *c) for c in HERMES_CASES],
)  # fmt: skip
def test_whole_text(family, text, content, calls):
    parsed = TOOL_PARSERS[family]().parse(text, final=True)
    assert parsed.content == content
    assert _calls(parsed) == calls
    assert all(c.complete for c in parsed.calls)


def test_guided_outputs():
    parsed = JSONArrayToolParser().parse('[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]', True)
    assert _calls(parsed) == [("a", {"x": 1}), ("b", {})] and parsed.content == ""
    parsed = JSONArrayToolParser().parse('[{"name": "a", "parameters": {"x"', True)  # cut by max_tokens
    assert parsed.calls == [] and parsed.content == '[{"name": "a", "parameters": {"x"'
    parsed = NamedFunctionParser("f").parse('{"x": [1, {"y": "}"}]}', True)
    assert _calls(parsed) == [("f", {"x": [1, {"y": "}"}]})]
    assert NamedFunctionParser("f").parse('{"x": ', True).calls == []


def test_scan_value():
    assert scan_value('{"a": "}"} tail', 0) == 10
    assert scan_value("[1, [2]]", 0) == 8
    assert scan_value("12 ", 0) == 2
    for partial in ('{"a": "}', "[1, [2]", "12", "tr", '"abc'):
        with pytest.raises(Incomplete):
            scan_value(partial, 0)
    assert scan_value("12", 0, final=True) == 2
    for bad in ("{]", "x", "@"):
        with pytest.raises(NotJSON):
            scan_value(bad, 0)


# ---------------------------------------------------------------------------- streaming
def _stream(parser_factory, text: str, cuts: list[int]) -> tuple[ChatOutputParser, dict]:
    """Feed the prefixes of ``text`` at ``cuts``, then all of it as final; the deltas summed."""
    parser = parser_factory()
    got = {"reasoning": "", "content": "", "calls": {}}
    for end in [*sorted(set(cuts)), len(text)]:
        delta = parser.update(text[:end], final=end == len(text))
        got["reasoning"] += delta.reasoning
        got["content"] += delta.content
        for d in delta.tool_calls:
            if d.id is not None:
                assert d.index not in got["calls"], "a call announced twice"
                assert d.index == len(got["calls"]), "calls announced out of order"
                got["calls"][d.index] = [d.id, d.name, d.arguments]
            else:
                assert d.index in got["calls"], "arguments before the call's name"
                got["calls"][d.index][2] += d.arguments
    return parser, got


def _whole(parser_factory, text):
    parser = parser_factory()
    parser.update(text, final=True)
    return parser


STREAM_CASES = (
    [("hermes", t) for t, _, calls in HERMES_CASES if calls and "oops" not in t]
    + [("llama3_json", t) for t, _, calls in LLAMA_CASES]
    + [("mistral", t) for t, _, calls in MISTRAL_CASES if calls]
    + [("hermes", "Plain text with a < and a <tool but no call.")]
    + [("generic", t) for t, _, _ in GENERIC_CASES]
)


@pytest.mark.parametrize("family,text", STREAM_CASES)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_stream_deltas_add_up_to_the_whole_parse(family, text, data):
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    factory = lambda: ChatOutputParser(tool_parser=TOOL_PARSERS[family]())  # noqa: E731
    parser, got = _stream(factory, text, cuts)
    whole = _whole(factory, text)
    assert got["content"] == whole.content
    assert [(n, a) for _, n, a in got["calls"].values()] == [(t.name, t.arguments) for t in whole.tool_calls]
    assert [i for i, _, _ in got["calls"].values()] == [t.id for t in parser.tool_calls]


@pytest.mark.parametrize("text", [t for t, c, _ in GENERIC_CASES + HERMES_CASES if "name" not in c and "<tool_call" not in c])
def test_stream_never_leaks_a_call_into_the_content(text):
    """At every prefix (character by character), the content sent so far holds no piece of a
    call: no tag, no call JSON, and it is a prefix of the whole parse's content."""
    parser = ChatOutputParser(tool_parser=TOOL_PARSERS["generic"]())
    whole = _whole(lambda: ChatOutputParser(tool_parser=TOOL_PARSERS["generic"]()), text)
    sent = ""
    for i in range(1, len(text) + 1):
        sent += parser.update(text[:i], final=i == len(text)).content
        assert whole.content.startswith(sent), (text[:i], sent)
        assert "<tool_call" not in sent
        assert '{"name"' not in sent and '"arguments"' not in sent, (text[:i], sent)


def test_stream_sends_a_call_whole_once_complete():
    """A call is sent in one piece once its object is complete, never before: until then it
    may still be cut short by max_tokens (then it is content, not a call)."""
    text = f"<tool_call>\n{WEATHER}\n</tool_call>"
    complete_at = text.index(WEATHER) + len(WEATHER)
    parser = ChatOutputParser(tool_parser=TOOL_PARSERS["hermes"]())
    deltas = [parser.update(text[:i], final=i == len(text)) for i in range(1, len(text) + 1)]
    sent_at = [i for i, delta in enumerate(deltas, 1) if delta.tool_calls]
    assert sent_at == [complete_at]
    (piece,) = deltas[complete_at - 1].tool_calls
    assert piece.id and piece.name == "get_weather" and piece.arguments == WEATHER_ARGS
    assert not any(d.content for d in deltas)  # no tag or JSON leaked into the content


@pytest.mark.parametrize("family", ["hermes", "generic", "mistral", "llama3_json", "json_array", "named"])
def test_stream_of_a_call_cut_short_sends_no_call(family):
    """A call cut by max_tokens: at every prefix no call was sent, and the final deltas
    make the raw text the content, as the whole parse (streamed == non-streamed)."""
    texts = {
        "hermes": 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
        "generic": '{"name": "get_weather", "arguments": {"city"',
        "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {}}, {"name": "f", "arguments": {',
        "llama3_json": '{"name": "get_weather", "parameters": {"city": "Pa',
        "json_array": '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_weather", "par',
        "named": '{"city": "Pa',
    }
    make = {"json_array": JSONArrayToolParser, "named": lambda: NamedFunctionParser("get_weather")}.get(
        family, TOOL_PARSERS.get(family))
    text = texts[family]
    parser = ChatOutputParser(tool_parser=make())
    content = ""
    for i in range(1, len(text) + 1):
        delta = parser.update(text[:i], final=i == len(text))
        assert not delta.tool_calls, text[:i]
        content += delta.content
    whole = _whole(lambda: ChatOutputParser(tool_parser=make()), text)
    assert whole.tool_calls == [] and parser.tool_calls == []
    assert content == whole.content == text


@pytest.mark.parametrize("text,calls", [
    ('[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]', 2),
    ('[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {"y', 0),
])  # fmt: skip
def test_stream_of_forced_calls_adds_up_to_the_whole_parse(text, calls):
    for make in (JSONArrayToolParser, lambda: NamedFunctionParser("f")):
        factory = lambda: ChatOutputParser(tool_parser=make())  # noqa: B023, E731
        for step in (1, 3, 7):
            _, got = _stream(factory, text, list(range(0, len(text), step)))
            whole = _whole(factory, text)
            assert got["content"] == whole.content
            assert [(n, a) for _, n, a in got["calls"].values()] == [(t.name, t.arguments) for t in whole.tool_calls]
    assert len(_whole(lambda: ChatOutputParser(tool_parser=JSONArrayToolParser()), text).tool_calls) == calls


def test_parallel_tool_calls_false_keeps_the_first_call():
    parser = ChatOutputParser(tool_parser=TOOL_PARSERS["hermes"](), max_tool_calls=1)
    parser.update(f"<tool_call>{WEATHER}</tool_call><tool_call>{TIME}</tool_call>", final=True)
    assert [t.name for t in parser.tool_calls] == ["get_weather"]


_DEEP = "[" * 3000 + "]" * 3000  # past Python's recursion limit for json.loads


@pytest.mark.parametrize("factory, text", [
    (lambda: TOOL_PARSERS["hermes"](), '<tool_call>{"name": "f", "arguments": {"a": %s}}</tool_call>' % _DEEP),
    (lambda: TOOL_PARSERS["generic"](), '{"name": "f", "arguments": {"a": %s}}' % _DEEP),
    (lambda: TOOL_PARSERS["llama3_json"](), '{"name": "f", "parameters": {"a": %s}}' % _DEEP),
    (lambda: TOOL_PARSERS["mistral"](), '[TOOL_CALLS][{"name": "f", "arguments": {"a": %s}}]' % _DEEP),
    (lambda: TOOL_PARSERS["hermes"](), '<tool_call>{"name": "f", "arguments": {"a": 1}, "x": %s}</tool_call>' % _DEEP),
    (lambda: JSONArrayToolParser(), '[{"name": "f", "parameters": {"a": %s}}]' % _DEEP),
    (lambda: NamedFunctionParser("f"), '{"a": %s}' % _DEEP),
], ids=["hermes", "generic", "llama3_json", "mistral", "other-key", "required", "named"])  # fmt: skip
def test_a_call_nested_past_the_recursion_limit_is_content_not_a_crash(factory, text):
    """A model that repeats "[" inside a call's arguments (free-form arguments allow it) made
    the parser's json.loads raise RecursionError, and the request failed (500, or an error
    event mid-stream). Such a call is no call: its text is content, streamed or whole."""
    parser = ChatOutputParser(tool_parser=factory())
    for end in range(0, len(text), 997):
        parser.update(text[:end])
    parser.update(text, final=True)
    assert parser.tool_calls == [] and parser.content == text


# ---------------------------------------------------------------------------- registry
def test_detection_from_the_chat_template():
    assert detect_tool_parser("... <tool_call>\n{{ tool_call.name }} ...").name == "hermes"
    assert detect_tool_parser("{{ '[TOOL_CALLS]' }}").name == "mistral"
    assert detect_tool_parser("<|python_tag|>").name == "llama3_json"
    # no family, or two: the generic parser (not a 400 under tool_choice "auto")
    assert detect_tool_parser("{% for m in messages %}{{ m.content }}{% endfor %}").name == "generic"
    assert detect_tool_parser("<tool_call> and [TOOL_CALLS]").name == "generic"  # ambiguous
    assert detect_tool_parser(None).name == "generic"


def test_unknown_parser_names_the_flag():
    with pytest.raises(ValueError, match="--tool-call-parser"):
        get_tool_parser("nope")


GENERIC_MARKED_CASES = [  # Mistral's [TOOL_CALLS] marker written by a model of no detected family
    (f"[TOOL_CALLS][{WEATHER}]", "", [("get_weather", json.loads(WEATHER_ARGS))]),
    (f"Sure. [TOOL_CALLS][{TIME}, {CONVERT}]", "Sure.", [("get_time", {}), ("convert", {"value": 18, "to": "F"})]),
    (f"[TOOL_CALLS]{TIME}", "", [("get_time", {})]),
    ('[TOOL_CALLS]f[ARGS]{"x": 1}[TOOL_CALLS]g[ARGS]{}', "", [("f", {"x": 1}), ("g", {})]),
    ("[TOOL_CALLS] no call here", "[TOOL_CALLS] no call here", []),  # not a call: the raw text
    ('[TOOL_CALLS][{"name": "f", "argu', '[TOOL_CALLS][{"name": "f", "argu', []),  # cut short: the raw text
]  # fmt: skip


@pytest.mark.parametrize("text,content,calls", GENERIC_MARKED_CASES)
def test_generic_parser_keeps_the_tool_calls_marker_out_of_the_content(text, content, calls):
    """``[TOOL_CALLS][{...}]`` under the generic parser: the calls, and neither the marker
    nor a residue of it (``[TOOL_CALLS][]``) in the content, whole or streamed character by
    character (as vLLM's Mistral parser treats the marker)."""
    parsed = TOOL_PARSERS["generic"]().parse(text, final=True)
    assert (parsed.content, _calls(parsed)) == (content, calls)
    parser = ChatOutputParser(tool_parser=TOOL_PARSERS["generic"]())
    sent, streamed_calls = "", []
    for i in range(1, len(text) + 1):
        delta = parser.update(text[:i], final=i == len(text))
        sent += delta.content
        streamed_calls += [(d.name, d.arguments) for d in delta.tool_calls]
        assert content.startswith(sent), (text[:i], sent)
    assert sent == content
    assert [(n, json.loads(a)) for n, a in streamed_calls] == calls
