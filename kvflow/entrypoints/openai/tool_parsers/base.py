"""What every tool-call parser shares: the parse result, a JSON scanner that tells where a
value ends in text that is still growing, and the scanner of one ``{"name": ..., "arguments":
...}`` call object.

A parser reads the whole text generated so far (not the last delta): ``parse(text, final)``
returns the content and the tool calls found, each call's ``arguments`` being the raw JSON
text of its arguments as far as it has been generated. Every result is a prefix of the next
one (content and each call's arguments only grow, calls are only appended), so a stream can
send the difference (``kvflow.entrypoints.openai.chat_output``). Re-reading the text each
step costs O(length) per step, nothing next to a model step.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import ClassVar

_WS = " \t\n\r"
_SCALAR = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null")


class Incomplete(Exception):
    """The text ends before the JSON value does."""


class NotJSON(ValueError):
    """The text is not (a prefix of) the JSON expected there."""


@dataclass
class ToolCallPart:
    """One tool call as far as it has been generated.

    Attributes:
        name: the function name, once complete (None before).
        arguments: the raw JSON text of the arguments so far (a JSON object's text once
            ``complete``).
        complete: the call's text has ended.
    """

    name: str | None = None
    arguments: str = ""
    complete: bool = False


@dataclass
class ParsedToolOutput:
    """Content and tool calls of a generated text.

    Attributes:
        content: the text that is not a tool call (so far: what can no longer turn into one).
        calls: the tool calls, in order.
    """

    content: str = ""
    calls: list[ToolCallPart] = field(default_factory=list)


def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WS:
        pos += 1
    return pos


def scan_string(text: str, pos: int) -> int:
    """End (exclusive) of the JSON string starting at ``text[pos] == '"'``.

    Raises:
        Incomplete: the text ends inside the string.
    """
    i = pos + 1
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == '"':
            return i + 1
        i += 1
    raise Incomplete


def scan_value(text: str, pos: int, final: bool = False) -> int:
    """End (exclusive) of the JSON value starting at ``text[pos]`` (no leading whitespace).

    Brackets are matched outside strings; the value's text is not validated here (callers
    ``json.loads`` it). A number or literal running to the end of the text is incomplete
    unless ``final``.

    Raises:
        Incomplete: the text ends before the value does.
        NotJSON: ``text[pos]`` cannot start a JSON value, or brackets do not match.
    """
    if pos >= len(text):
        raise Incomplete
    ch = text[pos]
    if ch == '"':
        return scan_string(text, pos)
    if ch in "{[":
        stack = [ch]
        i = pos + 1
        while i < len(text):
            c = text[i]
            if c == '"':
                i = scan_string(text, i)
                continue
            if c in "{[":
                stack.append(c)
            elif c in "}]":
                if stack.pop() != ("{" if c == "}" else "["):
                    raise NotJSON(f"mismatched {c!r} at {i}")
                if not stack:
                    return i + 1
            i += 1
        raise Incomplete
    match = _SCALAR.match(text, pos)
    if match is None:
        # a literal cut short ("tr", "nul") or a bare "-"
        rest = text[pos:]
        if not final and any(word.startswith(rest) for word in ("true", "false", "null", "-")):
            raise Incomplete
        raise NotJSON(f"not a JSON value at {pos}: {text[pos:pos + 20]!r}")
    if match.end() == len(text) and not final:
        raise Incomplete
    return match.end()


def partial_marker_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a marker (the
    part of the text to hold back: the next tokens may complete the marker)."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


def scan_call_object(
    text: str, pos: int, final: bool, name_keys: tuple[str, ...] = ("name",),
    args_keys: tuple[str, ...] = ("arguments", "parameters"), require_args: bool = False,
) -> tuple[ToolCallPart, int | None]:
    """Read a call object ``{"name": "f", "arguments": {...}}`` starting at ``text[pos]``.

    The arguments of an unfinished call are its raw text so far when they are a JSON object
    (streamable); arguments given as a JSON string holding JSON (some models do that) are the
    string's value, set once complete. Missing arguments are ``{}`` (unless
    ``require_args``: then the object is not a call).

    Returns:
        (the call as far as the text goes, the end of the object or None if unfinished).

    Raises:
        NotJSON: the text is not a call object (not an object, a non-string name, no name,
            arguments that are not a JSON object, invalid JSON).
    """
    call = ToolCallPart()
    if pos >= len(text):
        return call, None
    if text[pos] != "{":
        raise NotJSON(f"a tool call must be a JSON object, got {text[pos:pos + 20]!r}")
    i = pos + 1
    saw_args = False
    try:
        while True:
            i = skip_ws(text, i)
            if i >= len(text):
                raise Incomplete
            if text[i] == "}":
                end = i + 1
                break
            if text[i] != '"':
                raise NotJSON(f"expected a key at {i}")
            key_end = scan_string(text, i)
            key = json.loads(text[i:key_end])
            i = skip_ws(text, key_end)
            if i >= len(text):
                raise Incomplete
            if text[i] != ":":
                raise NotJSON(f"expected ':' at {i}")
            i = skip_ws(text, i + 1)
            if i >= len(text):
                raise Incomplete
            start = i
            if key in args_keys and not saw_args and text[i] == "{":
                saw_args = True
                try:
                    i = scan_value(text, start, final)
                except Incomplete:
                    call.arguments = text[start:]
                    raise
                call.arguments = text[start:i]
                _check_object(call.arguments)
            else:
                i = scan_value(text, start, final)
                value = json.loads(text[start:i])
                if key in name_keys and call.name is None:
                    if not isinstance(value, str):
                        raise NotJSON(f"the tool name must be a string, got {value!r}")
                    call.name = value
                elif key in args_keys and not saw_args:
                    saw_args = True
                    if not isinstance(value, str):
                        raise NotJSON(f"tool arguments must be a JSON object, got {value!r}")
                    _check_object(value)
                    call.arguments = value
            i = skip_ws(text, i)
            if i >= len(text):
                raise Incomplete
            if text[i] == ",":
                i += 1
            elif text[i] != "}":
                raise NotJSON(f"expected ',' or '}}' at {i}")
    except Incomplete:
        return call, None
    except json.JSONDecodeError as exc:
        raise NotJSON(str(exc)) from None
    except RecursionError:  # (see _check_object)
        raise NotJSON("a value of the call object is nested too deeply") from None
    if call.name is None:
        raise NotJSON("a tool call object has no name")
    if not saw_args:
        if require_args:
            raise NotJSON("a tool call object has no arguments")
        call.arguments = "{}"
    call.complete = True
    return call, end


def _check_object(arguments: str) -> None:
    """Raises NotJSON unless ``arguments`` is the JSON text of an object, one that Python's
    ``json`` reads: arguments nested past its recursion limit (a model repeating ``[``) are no
    call, as every reader of the call (``json.loads``) would fail on them (a RecursionError
    that failed the request, 500)."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError as exc:
        raise NotJSON(f"tool arguments are not valid JSON: {exc}") from None
    except RecursionError:
        raise NotJSON("tool arguments are nested too deeply") from None
    if not isinstance(value, dict):
        raise NotJSON(f"tool arguments must be a JSON object, got {arguments[:40]!r}")


def scan_call_array(text: str, pos: int, final: bool, name_keys: tuple[str, ...] = ("name",),
                    args_keys: tuple[str, ...] = ("arguments", "parameters")) -> tuple[list[ToolCallPart], int | None]:
    """Read a JSON array of call objects starting at ``text[pos] == '['``.

    Returns:
        (the calls as far as the text goes, the end of the array or None if unfinished).

    Raises:
        NotJSON: see ``scan_call_object``; also an empty array.
    """
    calls: list[ToolCallPart] = []
    i = pos + 1
    while True:
        i = skip_ws(text, i)
        if i >= len(text):
            return calls, None
        if text[i] == "]" and calls:
            return calls, i + 1
        call, end = scan_call_object(text, i, final, name_keys, args_keys)
        calls.append(call)
        if end is None:
            return calls, None
        i = skip_ws(text, end)
        if i >= len(text):
            return calls, None
        if text[i] == ",":
            i += 1
        elif text[i] != "]":
            raise NotJSON(f"expected ',' or ']' at {i}")


class ToolParser:
    """Turns a model family's tool-call text into ``ParsedToolOutput``.

    Subclasses set ``name`` (the ``--tool-call-parser`` value), ``template_markers`` (text
    that, found in a chat template, says the template is of this family), ``call_forms``
    (what the structural constraint of ``tool_choice: "auto"`` enforces once a call
    starts) and implement ``parse``. ``needs_special_tokens``: the markers are special
    tokens, so the request's text must keep special tokens (``skip_special_tokens=False``).
    """

    name: ClassVar[str] = ""
    template_markers: ClassVar[tuple[str, ...]] = ()
    needs_special_tokens: ClassVar[bool] = False
    # The forms of a call this parser reads, for the structural constraint of tool_choice
    # "auto" (tools.tool_call_structural_tag): (trigger, the text before the name (a JSON
    # string), the text between the name and the arguments object, the text after it);
    # empty: no constraint.
    call_forms: ClassVar[tuple[tuple[str, str, str, str], ...]] = ()

    def parse(self, text: str, final: bool) -> ParsedToolOutput:
        """The content and calls of ``text`` (everything generated so far).

        With ``final`` False the result holds back what may still change (a partial marker,
        an unfinished call's name); with ``final`` True a text whose calls do not parse is
        all content, with no calls.
        """
        raise NotImplementedError


class JSONArrayToolParser(ToolParser):
    """The output of ``tool_choice: "required"``: a JSON array ``[{"name", "parameters"}]``
    that guided decoding made valid for the tools' schemas (not a model family: no flag).

    The calls are read once the array is complete; an array cut short (``max_tokens``) is
    content, all of it (vLLM's answer), so no call of it is given before."""

    name = "json_array"

    def parse(self, text: str, final: bool) -> ParsedToolOutput:
        start = skip_ws(text, 0)
        if start >= len(text):
            return ParsedToolOutput()
        try:
            if text[start] != "[":
                raise NotJSON("expected '['")
            calls, end = scan_call_array(text, start, final)
        except NotJSON:
            return ParsedToolOutput(content=text if final else "")
        if end is None:
            # cut short (max_tokens): the raw text is the content, the calls in it none; so
            # while streaming no call is given before the array is complete
            return ParsedToolOutput(content=text) if final else ParsedToolOutput()
        return ParsedToolOutput(calls=calls)


class NamedFunctionParser(ToolParser):
    """The output of a named ``tool_choice``: the arguments object of that one function
    (complete at the end only; an object cut short is content)."""

    name = "named_function"

    def __init__(self, function_name: str) -> None:
        self.function_name = function_name

    def parse(self, text: str, final: bool) -> ParsedToolOutput:
        start = skip_ws(text, 0)
        # trailing whitespace is held back while streaming, so the final text extends it
        call = ToolCallPart(name=self.function_name, arguments=text[start:].rstrip(_WS))
        if final:
            try:
                _check_object(call.arguments)
            except NotJSON:  # cut short (max_tokens)
                return ParsedToolOutput(content=text)
            call.complete = True
        return ParsedToolOutput(calls=[call])


def parse_bare_calls(text: str, start: int, final: bool, separator: str | None = None) -> ParsedToolOutput | None:
    """Calls written as bare JSON objects ``{"name": ..., "arguments"/"parameters": ...}``
    from ``text[start]`` on, one after another (split by ``separator`` and/or whitespace);
    text after the last call is content.

    A call is taken only once its object is complete (an object may still turn out not to
    be a call), so nothing of an unfinished object is returned.

    Returns:
        None when the text there is not such a call (the caller reads it as content); an
        empty result while that cannot be told yet (``final`` False).
    """
    calls: list[ToolCallPart] = []
    i = start
    while True:
        try:
            call, end = scan_call_object(text, i, final, require_args=True)
        except NotJSON:
            return ParsedToolOutput(content=text[i:], calls=calls) if calls else None
        if end is None:
            if not final:
                return ParsedToolOutput(calls=calls)
            return ParsedToolOutput(content=text[i:], calls=calls) if calls else None
        calls.append(call)
        j = skip_ws(text, end)
        if separator is not None:
            if text.startswith(separator, j):
                j = skip_ws(text, j + len(separator))
            elif not final and separator.startswith(text[j:]):
                return ParsedToolOutput(calls=calls)
        if j >= len(text):
            return ParsedToolOutput(calls=calls)
        if text[j] != "{":
            return ParsedToolOutput(content=text[j:], calls=calls)
        i = j
