"""User-facing results of generation (the shapes vLLM users know)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One generated sequence.

    Attributes:
        index: position among the request's outputs (0 when n == 1).
        text: detokenized output text (cumulative).
        token_ids: generated token ids (cumulative).
        finish_reason: "stop", "length", "abort", or None while still generating.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None


@dataclass
class RequestOutput:
    """Progress or result of one request.

    Attributes:
        request_id: the id the request was added with.
        prompt: the prompt text, or None when the request was given as token ids.
        prompt_token_ids: the prompt's token ids.
        outputs: one ``CompletionOutput`` per sample.
        finished: True once every output has a finish reason.
        metrics: timings in seconds (arrival, first token, finish; monotonic clock).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict[str, float] = field(default_factory=dict)
