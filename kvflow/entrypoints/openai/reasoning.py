"""Reasoning parsers: split a thinking model's output into its reasoning (``<think>...</think>``)
and its answer, chosen by ``kvflow serve --reasoning-parser NAME``.

The server returns the reasoning as ``message.reasoning_content`` (streamed as
``delta.reasoning_content``), as vLLM does, and the answer as ``content``.

| name | models | output without ``</think>`` |
|---|---|---|
| ``deepseek_r1`` | DeepSeek-R1 and its distills (the template opens ``<think>`` in the prompt, so the output may start inside it) | all reasoning (thinking cut short) |
| ``qwen3`` | Qwen3 (the model writes ``<think>``; with ``chat_template_kwargs: {"enable_thinking": false}`` it writes none) | reasoning if it began with ``<think>``; an output that does not begin with it is all content |

Like the tool parsers, ``parse`` reads the whole text so far and holds back what may still
change (a partial ``<think>`` / ``</think>``), so each result extends the previous one.
"""

from __future__ import annotations

from typing import ClassVar

from kvflow.entrypoints.openai.tool_parsers.base import partial_marker_suffix

THINK_START, THINK_END = "<think>", "</think>"


class ReasoningParser:
    """Splits ``<think>reasoning</think>content``. ``implicit_start``: an output that does
    not begin with ``<think>`` is reasoning up to ``</think>`` (the template opened the
    block in the prompt); otherwise such an output is all content."""

    name: ClassVar[str] = ""
    implicit_start: ClassVar[bool] = False

    def parse(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of ``text``, everything generated so far.

        While streaming (``final`` False) a suffix that may grow into ``<think>`` or
        ``</think>`` is held back. A block never closed is all reasoning.
        """
        start = 0
        if text.startswith(THINK_START):
            start = len(THINK_START)
        elif not final and THINK_START.startswith(text):
            return "", ""  # empty, or "<thi": the tag may be on its way
        elif not self.implicit_start:
            return "", text
        end = text.find(THINK_END, start)
        if end >= 0:
            return text[start:end], text[end + len(THINK_END) :]
        hold = 0 if final else partial_marker_suffix(text[start:], (THINK_END,))
        return text[start : len(text) - hold], ""


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    implicit_start = True


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class of ``--reasoning-parser NAME``.

    Raises:
        ValueError: naming the flag and the known names, for an unknown one.
    """
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"--reasoning-parser must be one of {sorted(REASONING_PARSERS)}, got {name!r}") from None
