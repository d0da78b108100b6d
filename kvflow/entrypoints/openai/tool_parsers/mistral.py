"""Mistral tool calls: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``.

``[TOOL_CALLS]`` is a control token of Mistral's tokenizers, so requests parsed with this
format keep special tokens in their text. Also read: the later tokenizers' form
``[TOOL_CALLS]name[ARGS]{...}`` (one per call), and a single object after the marker.
"""

from __future__ import annotations

import re

from kvflow.entrypoints.openai.tool_parsers.base import (
    Incomplete, NotJSON, ParsedToolOutput, ToolCallPart, ToolParser, partial_marker_suffix, scan_call_array,
    scan_call_object, scan_value, skip_ws,
)  # fmt: skip

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]*")


class MistralToolParser(ToolParser):
    """Content before ``[TOOL_CALLS]``, calls after it (given once all of them are complete).
    At the end, calls that do not parse or are unfinished are content from the marker on."""

    name = "mistral"
    template_markers = (MARKER,)
    needs_special_tokens = True

    def parse(self, text: str, final: bool) -> ParsedToolOutput:
        first = text.find(MARKER)
        if first < 0:
            hold = 0 if final else partial_marker_suffix(text, (MARKER,))
            return ParsedToolOutput(content=text[: len(text) - hold])
        out = ParsedToolOutput(content=text[:first])
        try:
            calls, end = scan_marked_calls(text, first + len(MARKER), final)
        except NotJSON:
            out.content += text[first:]
            return out
        if end is None:
            # unfinished: at the end (cut short) all content from the marker on, so while
            # streaming no call is given before the calls are complete
            if final:
                out.content += text[first:]
            return out
        out.calls = calls
        if end is not None and text[end:].strip():
            out.content += text[end:]
        return out


def scan_marked_calls(text: str, pos: int, final: bool) -> tuple[list[ToolCallPart], int | None]:
    """The calls written after a ``[TOOL_CALLS]`` marker that ends at ``pos``: a list of
    call objects, one call object, or ``name[ARGS]{...}`` calls (each after its own marker),
    and the end of the last one (None while they are unfinished).

    Raises:
        NotJSON: the text after the marker is none of these forms.
    """
    i = skip_ws(text, pos)
    if i >= len(text):
        return [], None
    if text[i] == "[":
        return scan_call_array(text, i, final)
    if text[i] == "{":
        call, end = scan_call_object(text, i, final)
        return [call], end
    calls: list[ToolCallPart] = []
    while True:  # name[ARGS]{...}, repeated after another [TOOL_CALLS]
        name = _NAME.match(text, i)
        j = name.end()
        if not text.startswith(ARGS, j):
            if j == len(text) or ARGS.startswith(text[j:]):
                return calls, None
            raise NotJSON(f"expected {ARGS} after the tool name")
        call = ToolCallPart(name=name.group())
        calls.append(call)
        start = skip_ws(text, j + len(ARGS))
        if start < len(text) and text[start] != "{":
            raise NotJSON("tool arguments must be a JSON object")
        try:
            end = scan_value(text, start, final)
        except Incomplete:
            call.arguments = text[start:]
            return calls, None
        call.arguments = text[start:end]
        call.complete = True
        nxt = skip_ws(text, end)
        if not text.startswith(MARKER, nxt):
            if not final and MARKER.startswith(text[nxt:]):  # another call may follow
                return calls, None
            return calls, end
        i = nxt + len(MARKER)
