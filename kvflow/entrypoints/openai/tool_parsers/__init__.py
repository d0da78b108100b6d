"""Tool-call parsers per model family, chosen by ``kvflow serve --tool-call-parser NAME`` or
detected from the chat template.

| name | format | families |
|---|---|---|
| ``generic`` | any of: ``<tool_call>`` blocks, bare ``{"name", "arguments"}`` objects or lists, ```` ```json ```` fences, ``[TOOL_CALLS]`` calls | the default when the chat template is of no family below |
| ``hermes`` | ``<tool_call>{"name", "arguments"}</tool_call>`` (and the generic forms) | Qwen2.5 / Qwen3, Hermes 2 Pro / 3 |
| ``llama3_json`` | ``{"name", "parameters"}`` (``;``-separated) | Llama 3.1-3.3 |
| ``mistral`` | ``[TOOL_CALLS][{"name", "arguments"}]`` | Mistral / Mixtral instruct |

A family adds one module here and one entry in ``TOOL_PARSERS``.
"""

from __future__ import annotations

from kvflow.entrypoints.openai.tool_parsers.base import (
    JSONArrayToolParser, NamedFunctionParser, ParsedToolOutput, ToolCallPart, ToolParser,
)  # fmt: skip
from kvflow.entrypoints.openai.tool_parsers.generic import GenericToolParser
from kvflow.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from kvflow.entrypoints.openai.tool_parsers.llama3_json import Llama3JSONToolParser
from kvflow.entrypoints.openai.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (GenericToolParser, HermesToolParser, Llama3JSONToolParser, MistralToolParser)
}

__all__ = [
    "TOOL_PARSERS", "GenericToolParser", "JSONArrayToolParser", "NamedFunctionParser", "ParsedToolOutput", "ToolCallPart", "ToolParser",
    "detect_tool_parser", "get_tool_parser",
]  # fmt: skip


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class of ``--tool-call-parser NAME``.

    Raises:
        ValueError: naming the flag and the known names, for an unknown one.
    """
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"--tool-call-parser must be one of {sorted(TOOL_PARSERS)}, got {name!r}") from None


def detect_tool_parser(chat_template: str | None) -> type[ToolParser]:
    """The family whose markers the chat template mentions, when exactly one family's do
    (a template naming ``<tool_call>`` is Hermes-style); else ``GenericToolParser``, which
    reads the forms most chat models write a call in."""
    if not chat_template:
        return GenericToolParser
    found = [cls for cls in TOOL_PARSERS.values() if cls.template_markers and any(m in chat_template for m in cls.template_markers)]
    return found[0] if len(found) == 1 else GenericToolParser
