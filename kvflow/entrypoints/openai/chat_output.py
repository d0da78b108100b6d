"""One chat choice's generated text as an assistant message: reasoning, content and tool
calls, read whole (non-streaming) or step by step as deltas (streaming).

The text goes through the reasoning parser (``reasoning.py``: ``<think>...</think>`` out of
the answer), then the tool parser (``tool_parsers``) on the answer. Both read the whole text
so far and return results that only grow, so a stream sends differences: new reasoning,
new content, and each tool call whole (id, name and arguments) once it is complete. A call
is never sent before: one cut short (``max_tokens``) is no call but content (the raw text),
so the same output parsed whole gives the same message as the concatenated deltas.

Every API (chat completions, responses, Anthropic messages) renders these parts in its own
shape.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from kvflow.entrypoints.openai.reasoning import ReasoningParser
from kvflow.entrypoints.openai.tool_parsers import ToolParser
from kvflow.outputs import RequestOutput


def new_call_id(prefix: str = "call_") -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    """A finished tool call: ``arguments`` is the JSON text of an object."""

    id: str
    name: str
    arguments: str


@dataclass
class ToolCallDelta:
    """A streamed tool call ``index``, sent whole once complete: ``id``, ``name`` and its
    ``arguments`` (the JSON text of an object)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class ChatOutputParser:
    """Reads one choice's text into reasoning, content and tool calls.

    Args:
        reasoning_parser: splits off the reasoning (None: no reasoning).
        tool_parser: reads tool calls out of the answer (None: never any).
        max_tool_calls: keep at most this many calls (1 for ``parallel_tool_calls: false``).
        id_prefix: prefix of the tool call ids made here (``call_``; ``toolu_`` for Anthropic).
    """

    def __init__(
        self,
        reasoning_parser: ReasoningParser | None = None,
        tool_parser: ToolParser | None = None,
        max_tool_calls: int | None = None,
        id_prefix: str = "call_",
    ) -> None:
        self.reasoning_parser = reasoning_parser
        self.tool_parser = tool_parser
        self.max_tool_calls = max_tool_calls
        self.id_prefix = id_prefix
        self.reasoning = ""
        self.content = ""
        self._calls: list[tuple[str, str, str]] = []  # (id, name, arguments sent)
        self.tool_calls: list[ToolCall] = []  # set by the final update

    def update(self, text: str, final: bool = False) -> ChatDelta:
        """Read ``text`` (all of the choice's text so far); return what is new since the
        last call. With ``final``, ``reasoning``, ``content`` and ``tool_calls`` are the
        whole message."""
        if self.reasoning_parser is not None:
            reasoning, answer = self.reasoning_parser.parse(text, final)
        else:
            reasoning, answer = "", text
        calls = []
        if self.tool_parser is not None:
            parsed = self.tool_parser.parse(answer, final)
            answer, calls = parsed.content, parsed.calls[: self.max_tool_calls]
        delta = ChatDelta(reasoning=_grown(self.reasoning, reasoning), content=_grown(self.content, answer))
        self.reasoning += delta.reasoning
        self.content += delta.content
        for index, call in enumerate(calls):
            if call.name is None or not call.complete:
                break  # calls are sent in order, each whole once complete (a call cut short is content)
            if index == len(self._calls):
                call_id = new_call_id(self.id_prefix)
                self._calls.append((call_id, call.name, call.arguments))
                delta.tool_calls.append(ToolCallDelta(index, call_id, call.name, call.arguments))
        if final:
            self.tool_calls = [
                ToolCall(call_id, name, call.arguments) for (call_id, name, _), call in zip(self._calls, calls) if call.complete
            ]
        return delta


def _grown(sent: str, now: str) -> str:
    """What ``now`` adds to ``sent`` (nothing if it does not extend it: a parse that took
    back text it had given, which the parsers avoid; what was sent stays)."""
    return now[len(sent) :] if now.startswith(sent) else ""


@dataclass
class ChatRun:
    """A queued chat request: its prompt, its output stream, and the maker of its choices'
    output parsers (argument: the tool call id prefix)."""

    prompt_ids: list[int]
    iterator: AsyncIterator[RequestOutput]
    new_parser: Callable[..., ChatOutputParser]


@dataclass
class PartEvent:
    """One step of an output part's life (``OutputSequencer``).

    Attributes:
        kind: "start" (``call`` set for a tool call: its id and name), "delta" (``text``:
            reasoning or content text, or a tool call's arguments) or "stop".
        part: "reasoning", "text" or "tool_call".
        index: the part's position in the output (0, 1, ...).
    """

    kind: str
    part: str
    index: int
    text: str = ""
    call: ToolCallDelta | None = None


class OutputSequencer:
    """Streamed ``ChatDelta`` s as a sequence of output parts, each started, filled and
    stopped before the next starts: the shape of the Responses API's output items and of
    Anthropic's content blocks (reasoning / thinking, text, one part per tool call).

    A part starts at its first piece of text; a piece of another kind (or another tool
    call) stops the current part. Within one delta the order is reasoning, content, tool
    calls (the order the text normally has).
    """

    def __init__(self) -> None:
        self._current: tuple[str, int | None] | None = None
        self._count = 0

    def feed(self, delta: ChatDelta) -> list[PartEvent]:
        events: list[PartEvent] = []
        if delta.reasoning:
            events += self._switch(("reasoning", None))
            events.append(PartEvent("delta", "reasoning", self._count - 1, delta.reasoning))
        if delta.content:
            events += self._switch(("text", None))
            events.append(PartEvent("delta", "text", self._count - 1, delta.content))
        for t in delta.tool_calls:
            if t.id is not None:
                events += self._switch(("tool_call", t.index), t)
            if t.arguments:
                events.append(PartEvent("delta", "tool_call", self._count - 1, t.arguments))
        return events

    def close(self) -> list[PartEvent]:
        """Stop the open part, if any (at the end of the output)."""
        if self._current is None:
            return []
        part, self._current = self._current[0], None
        return [PartEvent("stop", part, self._count - 1)]

    def _switch(self, key: tuple[str, int | None], call: ToolCallDelta | None = None) -> list[PartEvent]:
        if self._current == key:
            return []
        events = self.close()
        self._current = key
        self._count += 1
        events.append(PartEvent("start", key[0], self._count - 1, call=call))
        return events
