"""Llama 3.x JSON tool calls: the whole output is ``{"name": ..., "parameters": {...}}``
(calls separated by ``;``), optionally after ``<|python_tag|>``, as Llama 3.1-3.3's chat
templates ask for JSON-based tool calling."""

from __future__ import annotations

from kvflow.entrypoints.openai.tool_parsers.base import ParsedToolOutput, ToolParser, parse_bare_calls, skip_ws

PYTHON_TAG = "<|python_tag|>"


class Llama3JSONToolParser(ToolParser):
    """An output that starts with a call object is calls (each taken once its object is
    complete; text after the last call is content); any other output is content."""

    name = "llama3_json"
    template_markers = (PYTHON_TAG,)
    call_forms = (('{"name"', '{"name": ', ', "parameters": ', "}"),)

    def parse(self, text: str, final: bool) -> ParsedToolOutput:
        start = skip_ws(text, 0)
        if text.startswith(PYTHON_TAG, start):
            start = skip_ws(text, start + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(text[start:]):
            return ParsedToolOutput()  # empty, or a tag on its way
        if start == len(text) and not final:
            return ParsedToolOutput()
        if start < len(text) and text[start] == "{":
            calls = parse_bare_calls(text, start, final, separator=";")
            if calls is not None:
                return calls
        return ParsedToolOutput(content=text)
