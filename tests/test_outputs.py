"""``kvflow.outputs``: the result shapes vLLM scripts read."""

from __future__ import annotations

from kvflow import CompletionOutput


def test_completion_output_finished_is_vllms_method():
    """vLLM's ``CompletionOutput.finished()`` (a finish reason is set); it was an
    AttributeError."""
    running = CompletionOutput(index=0, text="a", token_ids=[1])
    done = CompletionOutput(index=0, text="ab", token_ids=[1, 2], finish_reason="length")
    assert running.finished() is False and done.finished() is True
