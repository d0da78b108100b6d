"""The generic tool-call parser: the forms chat models (small ones above all) actually write a
call in, read wherever they occur in the text.

- Hermes / Qwen2.5 blocks: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  (the closing tag may be missing at the end of the output);
- bare call objects ``{"name": ..., "arguments"/"parameters": {...}}``, one per line or
  anywhere the text writes ``{"name"``;
- lists of calls ``[{"name": ...}, {...}]`` starting a line;
- Markdown fences ```` ```json ```` (or a bare ```` ``` ````) holding call objects or a list;
- Mistral's ``[TOOL_CALLS]`` marker and the calls after it (``[TOOL_CALLS][{"name": ...,
  "arguments": {...}}]``, the forms ``tool_parsers.mistral`` reads): neither the marker nor
  the calls are content, as in vLLM's Mistral parser.

Everything else is content. Measured on Qwen2.5-Coder-0.5B-Instruct, which writes its calls
as bare JSON lines or in a ```` ```json ```` block about as often as in ``<tool_call>``
tags. The same forms are what ``structural_tag`` (``tools.tool_call_structural_tag``)
constrains once the model starts one, so a constrained call always parses here.

Streaming: the content never holds a piece of a call. Text that may still turn into one (a
partial ``<tool_call>``, ``[TOOL_CALLS]`` or fence marker, an unfinished object or list that
started a line or is ``{"name"...``) is held back until it is told apart; trailing whitespace
is held back too (it may separate content from a call). A tagged call is returned as far as its arguments
go; a bare or fenced call once its object is complete (before that it may still turn out
not to be a call). A stream sends a call only once it is complete (``chat_output``): before
that it may still be cut short. An unfinished call at the end of
the output (cut by ``max_tokens``) is not a call: the text from its start is content, as
vLLM returns it.
"""

from __future__ import annotations

import re
from typing import ClassVar

from kvflow.entrypoints.openai.tool_parsers.base import (
    NotJSON, ParsedToolOutput, ToolCallPart, ToolParser, partial_marker_suffix, scan_call_array, scan_call_object,
    skip_ws,
)  # fmt: skip
from kvflow.entrypoints.openai.tool_parsers.mistral import MARKER, scan_marked_calls

START, END = "<tool_call>", "</tool_call>"
FENCE = "```"
_WS = " \t\n\r"
_CANDIDATE = re.compile(r"<tool_call>|\[TOOL_CALLS\]|```|[{\[]")
_LANG = re.compile(r"[A-Za-z0-9_+-]*")
_NAME_KEY = '"name"'

# What reading a candidate gives: a complete region (its calls and end), text that may still
# become a call (its calls so far), an unfinished call at the end of the output (cut short:
# content from its start, as the raw text), or None (not a call: content).
_DONE, _PENDING, _CUT = "done", "pending", "cut"


class GenericToolParser(ToolParser):
    """Calls in any of the forms above, anywhere in the text; the rest is content (see the
    module docstring). The default parser of a server whose chat template is of no family
    kvflow detects."""

    name = "generic"
    template_markers: ClassVar[tuple[str, ...]] = ()
    # tagged; a bare object, compact or pretty-printed (as in a ```json fence) by 2 or 4 spaces
    call_forms = (
        (START, START + '\n{"name": ', ', "arguments": ', "}\n" + END),
        ('{"name"', '{"name": ', ', "arguments": ', "}"),
        ('{\n  "name"', '{\n  "name": ', ',\n  "arguments": ', "\n}"),
        ('{\n    "name"', '{\n    "name": ', ',\n    "arguments": ', "\n}"),
    )

    def parse(self, text: str, final: bool) -> ParsedToolOutput:
        out = ParsedToolOutput()
        pos = search = 0  # content is read from pos; candidates are looked for from search
        while True:
            found = self._next_candidate(text, search, final)
            if found is None:
                tail = text[pos:]
                if not final:
                    tail = tail[: len(tail) - partial_marker_suffix(tail, (START, FENCE, MARKER))].rstrip(_WS)
                elif out.calls:
                    tail = tail.rstrip(_WS)
                out.content += self._after_calls(out, tail)
                return out
            start, kind = found
            read = self._read(text, start, kind, final)
            if read is None:  # not a call: content, look further
                search = start + 1
                continue
            status, calls, end = read
            if status == _CUT:  # the rest of the text, as it is
                out.content += self._after_calls(out, text[pos:])
                return out
            out.content += self._after_calls(out, text[pos:start].rstrip(_WS))
            out.calls += calls
            if status != _DONE:
                return out
            pos = search = end

    @staticmethod
    def _after_calls(out: ParsedToolOutput, piece: str) -> str:
        """A piece of content, without the whitespace that separates it from the calls
        before it when it is the first content."""
        return piece.lstrip(_WS) if out.calls and not out.content else piece

    # ------------------------------------------------------------------ candidates
    def _next_candidate(self, text: str, search: int, final: bool) -> tuple[int, str] | None:
        """The next place at or after ``search`` where a call may start, and its kind
        ("tag", "fence", "marked", "object", "list")."""
        for match in _CANDIDATE.finditer(text, search):
            at, token = match.start(), match.group()
            if token == START:
                return at, "tag"
            if token == MARKER:
                return at, "marked"
            if token == FENCE:
                return at, "fence"
            line_start = not text[text.rfind("\n", 0, at) + 1 : at].strip()
            if token == "[":
                if line_start:
                    return at, "list"
                continue
            if line_start:
                return at, "object"
            rest = text[skip_ws(text, at + 1) :]
            if rest.startswith(_NAME_KEY) or (not final and _NAME_KEY.startswith(rest)):
                return at, "object"
        return None

    def _read(self, text: str, start: int, kind: str, final: bool) -> tuple[str, list[ToolCallPart], int] | None:
        if kind == "tag":
            return self._read_tag(text, start, final)
        if kind == "fence":
            return self._read_fence(text, start, final)
        if kind == "marked":
            return self._read_marked(text, start, final)
        return self._read_json(text, start, final, require_args=True)

    def _read_tag(self, text: str, start: int, final: bool) -> tuple[str, list[ToolCallPart], int] | None:
        body = skip_ws(text, start + len(START))
        try:
            call, end = scan_call_object(text, body, final)
        except NotJSON:
            return None
        if end is None:  # streams its arguments as they come
            return (_CUT, [], len(text)) if final else (_PENDING, [call], len(text))
        after = skip_ws(text, end)
        if text.startswith(END, after):
            return _DONE, [call], after + len(END)
        if END.startswith(text[after:]):  # the closing tag is on its way (or was cut short)
            return (_DONE, [call], len(text)) if final else (_PENDING, [call], len(text))
        return _DONE, [call], end  # no closing tag, text follows

    @staticmethod
    def _read_marked(text: str, start: int, final: bool) -> tuple[str, list[ToolCallPart], int] | None:
        """``[TOOL_CALLS]`` at ``start`` and the calls after it; sent once all are complete."""
        try:
            calls, end = scan_marked_calls(text, start + len(MARKER), final)
        except NotJSON:
            return None
        if end is not None:
            return _DONE, calls, end
        return (_CUT, [], len(text)) if final else (_PENDING, [], len(text))

    def _read_fence(self, text: str, start: int, final: bool) -> tuple[str, list[ToolCallPart], int] | None:
        i = _LANG.match(text, start + len(FENCE)).end()
        i = skip_ws(text, i)
        if i >= len(text):
            return None if final else (_PENDING, [], len(text))
        if text[i] not in "{[":
            return None
        calls: list[ToolCallPart] = []
        while True:
            read = self._read_json(text, i, final, require_args=True)
            if read is None:
                return None if not calls else self._fence_end(text, calls, i, final)
            status, more, end = read
            if status != _DONE:
                return status, [], len(text)  # a fenced call is sent once complete
            calls += more
            j = skip_ws(text, end)
            if j < len(text) and text[j] == ",":
                j = skip_ws(text, j + 1)
            if j < len(text) and text[j] in "{[":
                i = j
                continue
            return self._fence_end(text, calls, j, final)

    @staticmethod
    def _fence_end(text: str, calls: list[ToolCallPart], at: int, final: bool) -> tuple[str, list[ToolCallPart], int]:
        at = skip_ws(text, at)
        if text.startswith(FENCE, at):
            return _DONE, calls, at + len(FENCE)
        if not final and FENCE.startswith(text[at:]):
            return _PENDING, [], len(text)
        return _DONE, calls, at

    @staticmethod
    def _read_json(text: str, start: int, final: bool, require_args: bool) -> tuple[str, list[ToolCallPart], int] | None:
        """A call object or a list of them at ``text[start]``; sent once complete."""
        try:
            if text[start] == "[":
                calls, end = scan_call_array(text, start, final)
            else:
                call, end = scan_call_object(text, start, final, require_args=require_args)
                calls = [call]
        except NotJSON:
            return None
        if end is not None:
            return _DONE, calls, end
        if not final:
            return _PENDING, [], len(text)
        # cut short: a call once its name is read (the rest of the text is content), else
        # text that never became one
        return (_CUT, [], len(text)) if any(c.name is not None for c in calls) else None
