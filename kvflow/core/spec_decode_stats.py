"""Counters of speculative decoding (vLLM v1's ``SpecDecodingStats``): plain counts at the
token level, next to the scheduler whose steps verify the drafts; ``EngineCore`` records
each step's (drafted, accepted) pairs.
"""

from __future__ import annotations

from collections.abc import Iterable


class SpecDecodeStats:
    """Draft and acceptance counts.

    Args:
        k: draft tokens per step (length of the per-position counts).

    ``as_dict()`` gives: spec_num_draft_tokens, spec_num_accepted_tokens, spec_acceptance_rate
    (accepted / drafted), spec_mean_accepted_length (tokens emitted per verification:
    1 + accepted / verifications, the (1 - a^(k+1)) / (1 - a) of Leviathan et al.), and
    spec_acceptance_per_position (rate at draft position 1..k).
    """

    def __init__(self, k: int) -> None:
        self.k = k
        self.num_verifications = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.drafted_at = [0] * k
        self.accepted_at = [0] * k

    def record(self, results: Iterable[tuple[int, int]]) -> None:
        """Add (drafts verified, drafts accepted) pairs; acceptance stops at the first rejection."""
        for drafted, accepted in results:
            self.num_verifications += 1
            self.num_draft_tokens += drafted
            self.num_accepted_tokens += accepted
            for i in range(drafted):
                self.drafted_at[i] += 1
                self.accepted_at[i] += int(i < accepted)

    def as_dict(self) -> dict[str, float | int | list[float]]:
        if not self.k:
            return {}
        return {
            "spec_num_draft_tokens": self.num_draft_tokens,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
            "spec_acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0,
            "spec_mean_accepted_length": (
                1 + self.num_accepted_tokens / self.num_verifications if self.num_verifications else 0.0
            ),
            "spec_acceptance_per_position": [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)],
        }
