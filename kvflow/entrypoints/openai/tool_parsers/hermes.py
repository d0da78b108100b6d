"""Hermes / Qwen2.5 tool calls: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.

The format of NousResearch's Hermes 2 Pro / 3 and of Qwen2.5's chat template (whose
``<tool_call>`` and ``</tool_call>`` are ordinary added tokens, kept in the text). Small
Qwen2.5 models (Qwen2.5-Coder-0.5B measured here) often write the call objects bare, with no
tags: an output that starts with such objects is read as calls too.
"""

from __future__ import annotations

from kvflow.entrypoints.openai.tool_parsers.base import (
    NotJSON, ParsedToolOutput, ToolParser, parse_bare_calls, partial_marker_suffix, scan_call_object, skip_ws,
)  # fmt: skip

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    """``<tool_call>`` blocks anywhere in the text; the text outside them is content.

    A block's arguments stream as they are generated. At the end (``final``), a block that
    does not parse, or is unfinished, is content from its ``<tool_call>`` on (the calls
    before it stay calls); a last block without ``</tool_call>`` is accepted.
    """

    name = "hermes"
    template_markers = (START,)

    def parse(self, text: str, final: bool) -> ParsedToolOutput:
        first = text.find(START)
        if first < 0:
            return self._untagged(text, final)
        out = self._untagged(text[:first], final=True)
        pos = first
        while True:
            body = skip_ws(text, pos + len(START))
            try:
                call, end = scan_call_object(text, body, final)
            except NotJSON:
                out.content += text[pos:]
                return out
            if end is None:
                if final:
                    out.content += text[pos:]
                else:
                    out.calls.append(call)
                return out
            out.calls.append(call)
            after = skip_ws(text, end)
            if not text.startswith(END, after):
                if not END.startswith(text[after:]):  # something else after the object
                    out.calls.pop()
                    out.content += text[pos:]
                return out  # the closing tag is on its way (or missing at the very end)
            after += len(END)
            nxt = text.find(START, after)
            segment = text[after:] if nxt < 0 else text[after:nxt]
            if nxt < 0 and not final:
                segment = segment[: len(segment) - partial_marker_suffix(segment, (START,))]
            if segment.strip():
                out.content += segment
            if nxt < 0:
                return out
            pos = nxt

    def _untagged(self, text: str, final: bool) -> ParsedToolOutput:
        start = skip_ws(text, 0)
        if start == len(text) and not final:
            return ParsedToolOutput()  # leading whitespace: calls may follow
        if start < len(text) and text[start] == "{":
            bare = parse_bare_calls(text, start, final)
            if bare is not None:
                return bare
        hold = 0 if final else partial_marker_suffix(text, (START,))
        return ParsedToolOutput(content=text[: len(text) - hold])
