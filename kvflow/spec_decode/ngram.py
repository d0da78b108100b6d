"""N-gram prompt lookup proposer (Saxena 2023, "Prompt Lookup Decoding"; vLLM's ``ngram``).

The draft for a request is the continuation of the most recent earlier occurrence of its
last n tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``) in its own prompt
and output. No model runs; the draft distribution is one-hot, so verification accepts a
draft token x with probability p(x).
"""

from __future__ import annotations

from kvflow.request import Request


def max_drafts(request: Request, k: int, max_model_len: int) -> int:
    """How many draft tokens the request can use: the verification step emits up to
    drafts + 1 tokens, within ``max_tokens`` and the context."""
    left_output = request.sampling_params.max_tokens - request.num_output_tokens
    left_context = max_model_len - request.num_tokens
    return max(0, min(k, left_output - 1, left_context - 1))


class NgramProposer:
    """Proposes up to ``k`` tokens per request by n-gram lookup.

    Args:
        k: draft tokens per step.
        prompt_lookup_min, prompt_lookup_max: n-gram sizes tried, longest first.
        max_model_len: the context limit, in tokens.
    """

    def __init__(self, k: int, prompt_lookup_min: int, prompt_lookup_max: int, max_model_len: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({prompt_lookup_min}) must be >= 1 and <= prompt_lookup_max ({prompt_lookup_max})"
            )
        self.k = k
        self.n_min, self.n_max = prompt_lookup_min, prompt_lookup_max
        self.max_model_len = max_model_len

    def propose(self, requests: list[Request]) -> None:
        """Set ``spec_token_ids`` (and ``spec_draft_probs = None``) of each request."""
        for request in requests:
            k = max_drafts(request, self.k, self.max_model_len)
            request.spec_token_ids = self.lookup(request.all_token_ids, k) if k else []
            request.spec_draft_probs = None

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """The up to k tokens after the latest earlier match of the longest suffix n-gram."""
        length = len(tokens)
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            suffix = tokens[length - n :]
            first = suffix[0]
            for start in range(length - n - 1, -1, -1):
                if tokens[start] == first and tokens[start : start + n] == suffix:
                    return tokens[start + n : start + n + k]
        return []

    def free(self, request_id: str) -> None:
        """Nothing is kept per request."""
