"""Hermes / Qwen2.5 tool calls: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.

The format of NousResearch's Hermes 2 Pro / 3 and of Qwen2.5's chat template (whose
``<tool_call>`` and ``</tool_call>`` are ordinary added tokens, kept in the text). Small
Qwen2.5 models (Qwen2.5-Coder-0.5B measured here) often write the call objects bare, one per
line, or in a ```` ```json ```` block instead: those forms are read too (``generic``).
"""

from __future__ import annotations

from kvflow.entrypoints.openai.tool_parsers.generic import END, START, GenericToolParser

__all__ = ["END", "START", "HermesToolParser"]


class HermesToolParser(GenericToolParser):
    """``<tool_call>`` blocks anywhere in the text, and the untagged forms of
    ``GenericToolParser``; the text outside them is content.

    A block is returned as far as its arguments go (a stream sends it once complete). At the
    end (``final``), a block that does not parse is content from its ``<tool_call>`` on; so
    is an unfinished one (cut by ``max_tokens``: the raw text, as vLLM); a last block
    without ``</tool_call>`` is accepted.
    """

    name = "hermes"
    template_markers = (START,)
