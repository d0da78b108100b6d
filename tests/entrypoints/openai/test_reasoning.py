"""Reasoning parsers: ``<think>...</think>`` split off the answer, whole and streamed (a tag
split across deltas never leaks into either part)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.entrypoints.openai.chat_output import ChatOutputParser
from kvflow.entrypoints.openai.reasoning import REASONING_PARSERS, get_reasoning_parser
from kvflow.entrypoints.openai.tool_parsers import TOOL_PARSERS

CASES = [
    # (parser, text, reasoning, content)
    ("qwen3", "<think>\nLet me add.\n</think>\n\nIt is 4.", "\nLet me add.\n", "\n\nIt is 4."),
    ("qwen3", "It is 4.", "", "It is 4."),  # enable_thinking false: no block
    ("qwen3", "<think>still thinking", "still thinking", ""),  # cut short
    ("qwen3", "4 </think> x", "", "4 </think> x"),  # not opened: all content
    ("deepseek_r1", "Let me add.</think>It is 4.", "Let me add.", "It is 4."),  # opened in the prompt
    ("deepseek_r1", "<think>a</think>b", "a", "b"),
    ("deepseek_r1", "no end tag", "no end tag", ""),
    ("deepseek_r1", "<think></think>", "", ""),
]


@pytest.mark.parametrize("name,text,reasoning,content", CASES)
def test_whole_text(name, text, reasoning, content):
    assert REASONING_PARSERS[name]().parse(text, final=True) == (reasoning, content)


@pytest.mark.parametrize("name,text,reasoning,content", CASES)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_stream_any_split(name, text, reasoning, content, data):
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(text)), max_size=10))))
    parser = ChatOutputParser(reasoning_parser=REASONING_PARSERS[name]())
    got_r, got_c = "", ""
    for end in [*cuts, len(text)]:
        delta = parser.update(text[:end], final=end == len(text))
        got_r += delta.reasoning
        got_c += delta.content
    assert (got_r, got_c) == (reasoning, content)


def test_tags_split_across_single_characters():
    text = "<think>abc</think>def"
    parser = ChatOutputParser(reasoning_parser=REASONING_PARSERS["qwen3"]())
    deltas = [parser.update(text[:i], final=i == len(text)) for i in range(1, len(text) + 1)]
    assert "".join(d.reasoning for d in deltas) == "abc"
    assert "".join(d.content for d in deltas) == "def"
    assert not any("<" in d.reasoning + d.content for d in deltas)


def test_reasoning_then_tool_calls():
    text = '<think>I need the weather.</think>\n<tool_call>\n{"name": "w", "arguments": {"c": "P"}}\n</tool_call>'
    parser = ChatOutputParser(REASONING_PARSERS["qwen3"](), TOOL_PARSERS["hermes"]())
    for i in range(1, len(text)):
        parser.update(text[:i])
    parser.update(text, final=True)
    assert parser.reasoning == "I need the weather."
    assert parser.content == ""  # the whitespace around a call is not content (docs/tools.md)
    assert [(t.name, t.arguments) for t in parser.tool_calls] == [("w", '{"c": "P"}')]


def test_unknown_parser_names_the_flag():
    with pytest.raises(ValueError, match="--reasoning-parser"):
        get_reasoning_parser("o1")
