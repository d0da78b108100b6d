"""Tool-call parsers per model family, chosen by ``kvflow serve --tool-call-parser NAME`` or
detected from the chat template.

| name | format | families |
|---|---|---|
| ``hermes`` | ``<tool_call>{"name", "arguments"}</tool_call>`` | Qwen2.5 / Qwen3, Hermes 2 Pro / 3 |
| ``llama3_json`` | ``{"name", "parameters"}`` (``;``-separated) | Llama 3.1-3.3 |
| ``mistral`` | ``[TOOL_CALLS][{"name", "arguments"}]`` | Mistral / Mixtral instruct |

A family adds one module here and one entry in ``TOOL_PARSERS``.
"""

from __future__ import annotations

from kvflow.entrypoints.openai.tool_parsers.base import (
    JSONArrayToolParser, NamedFunctionParser, ParsedToolOutput, ToolCallPart, ToolParser,
)  # fmt: skip
from kvflow.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from kvflow.entrypoints.openai.tool_parsers.llama3_json import Llama3JSONToolParser
from kvflow.entrypoints.openai.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesToolParser, Llama3JSONToolParser, MistralToolParser)
}

__all__ = [
    "TOOL_PARSERS", "JSONArrayToolParser", "NamedFunctionParser", "ParsedToolOutput", "ToolCallPart", "ToolParser",
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


def detect_tool_parser(chat_template: str | None) -> type[ToolParser] | None:
    """The family whose markers the chat template mentions, when exactly one family's do
    (a template naming ``<tool_call>`` is Hermes-style); else None."""
    if not chat_template:
        return None
    found = [cls for cls in TOOL_PARSERS.values() if any(m in chat_template for m in cls.template_markers)]
    return found[0] if len(found) == 1 else None
