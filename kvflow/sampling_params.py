"""Per-request sampling parameters.

The field names and semantics follow vLLM's ``SamplingParams`` so that users coming from
vLLM or the OpenAI API find what they expect. Validation happens at construction time and
raises ``ValueError`` whose message starts with the offending field name, so an invalid
request is refused before it reaches the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """How to pick the next token of one request.

    Attributes:
        n: number of output sequences per prompt (parallel sampling). The samples share the
            prompt's KV blocks; sample i of a seeded request uses seed + i.
        temperature: softmax temperature (> 0 samples, 0 means greedy argmax). Must be >= 0.
        top_p: nucleus sampling, keep the smallest set of tokens whose probability mass is
            >= top_p (Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration",
            section 3.1). Must be in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens. 0 or -1 disable it; otherwise >= 1.
        min_p: drop tokens whose probability is below ``min_p`` times the most likely
            token's probability. Must be in [0, 1]; 0 disables it.
        seed: per-request random seed. A seeded request samples from its own
            ``torch.Generator``, so it produces the same tokens whatever else is batched
            with it.
        max_tokens: maximum number of generated tokens (>= 1).
        stop_token_ids: generation stops after emitting any of these token ids (the token
            is kept in ``token_ids``).
        ignore_eos: keep generating past the model's end-of-sequence token.
        skip_special_tokens: drop special tokens when detokenizing the output text.
        logprobs: report, for every generated token, the log-probability of the sampled
            token and of the ``logprobs`` most likely tokens under the raw model
            distribution (before temperature and filtering). None: no log-probabilities.

    Raises:
        ValueError: naming the field, for any value outside the ranges above.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None

    def __post_init__(self) -> None:
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._verify()

    def _verify(self) -> None:
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool):
            raise ValueError(f"top_k must be an integer, got {self.top_k!r}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or >= 1, got {self.top_k}")
        _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            # torch.Generator.manual_seed would fail later with an unclear "Overflow" error.
            raise ValueError(f"seed must fit in a signed 64-bit integer, got {self.seed}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool):
            raise ValueError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool) or self.logprobs < 0
        ):
            raise ValueError(f"logprobs must be a non-negative integer or None, got {self.logprobs!r}")
        for tok in self.stop_token_ids:
            if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
                raise ValueError(f"stop_token_ids must hold non-negative integers, got {tok!r}")

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax token at every step."""
        return self.temperature < _GREEDY_EPS or self.top_k == 1


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value != value:  # NaN
        raise ValueError(f"{name} must not be NaN")
