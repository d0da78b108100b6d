"""Per-request sampling parameters.

The field names and semantics follow vLLM's ``SamplingParams`` so that users coming from
vLLM or the OpenAI API find what they expect. Validation happens at construction time and
raises ``ValueError`` whose message starts with the offending field name, so an invalid
request is refused before it reaches the engine.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """How to pick the next token of one request.

    Attributes:
        n: number of output sequences per prompt (parallel sampling). The samples share the
            prompt's KV blocks; sample i of a seeded request uses seed + i.
        temperature: softmax temperature (> 0 samples, 0 means greedy argmax). A finite
            number >= 0.
        top_p: nucleus sampling, keep the smallest set of tokens whose probability mass is
            >= top_p (Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration",
            section 3.1). Must be in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens. 0 or -1 disable it; otherwise >= 1 (a value
            at or above the vocabulary size keeps every token, as if disabled).
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
            distribution (before penalties, temperature and filtering). None: none. The
            engine refuses more than the vocabulary size.
        prompt_logprobs: the same for every prompt token after the first (the request then
            computes its whole prompt: prefix-cache hits are not used for it).
        presence_penalty: subtracted from the logit of every token that occurs in the output
            so far (OpenAI semantics). In [-2, 2].
        frequency_penalty: subtracted once per occurrence in the output so far. In [-2, 2].
        repetition_penalty: divides positive logits and multiplies negative ones of tokens in
            the prompt or the output (Keskar et al. 2019, "CTRL", section 4.1). A finite
            number > 0; 1 is off.
        logit_bias: token id -> value added to its logit (OpenAI semantics): keys are
            integers or integer strings >= 0 (the engine refuses ids outside the
            vocabulary), values numbers in [-100, 100].
        min_tokens: EOS and ``stop_token_ids`` are masked until this many tokens exist.
        bad_words: words never to generate: the last token of a word's token sequence is
            masked whenever the output ends with the rest of it.
        stop: strings that end generation when they appear in the output text, also across
            token boundaries. The stop string is cut from the text unless
            ``include_stop_str_in_output``.
        include_stop_str_in_output: keep the matched stop string in the text.
        guided_json: a JSON schema (dict or JSON string); the output is constrained to
            JSON that validates against it (llguidance grammar engine).
        guided_regex: a regular expression the whole output must match.
        structural_tag: vLLM's structural tag (dict or JSON string): ``{"structures":
            [{"begin": str, "schema": dict, "end": str}, ...], "triggers": [str, ...]}``.
            The text is free until it writes a trigger; from there it must be one of the
            structures that begin with that trigger (``begin``, JSON valid for ``schema``,
            ``end``), then it is free again. Tool calling under ``tool_choice: "auto"``
            uses it (``kvflow.entrypoints.openai.tools.tool_call_structural_tag``).

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
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    bad_words: list[str] | None = None
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    structural_tag: dict[str, Any] | str | None = None

    def __post_init__(self) -> None:
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.bad_words = list(self.bad_words or [])
        if self.logit_bias:
            self.logit_bias = _parse_logit_bias(self.logit_bias)
        self._verify()

    def _verify(self) -> None:
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        _check_number("temperature", self.temperature, finite=True)
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
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or isinstance(self.prompt_logprobs, bool) or self.prompt_logprobs < 0
        ):
            raise ValueError(f"prompt_logprobs must be a non-negative integer or None, got {self.prompt_logprobs!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        _check_number("repetition_penalty", self.repetition_penalty, finite=True)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}")
        if isinstance(self.max_tokens, int) and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if not all(isinstance(w, str) and w for w in self.bad_words):
            raise ValueError("bad_words must be a list of non-empty strings")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        if self.guided_json is not None and self.guided_regex is not None:
            raise ValueError("guided_json and guided_regex are mutually exclusive")
        if self.structural_tag is not None and (self.guided_json is not None or self.guided_regex is not None):
            raise ValueError("structural_tag cannot be combined with guided_json or guided_regex")
        if self.structural_tag is not None and not isinstance(self.structural_tag, (dict, str)):
            raise ValueError("structural_tag must be a dict or a JSON string")
        if self.guided_json is not None and not isinstance(self.guided_json, (dict, str)):
            raise ValueError("guided_json must be a JSON schema (dict or JSON string)")
        if self.guided_regex is not None and not isinstance(self.guided_regex, str):
            raise ValueError("guided_regex must be a string")
        for tok in self.stop_token_ids:
            if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
                raise ValueError(f"stop_token_ids must hold non-negative integers, got {tok!r}")

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax token at every step."""
        return self.temperature < _GREEDY_EPS or self.top_k == 1


def _check_number(name: str, value: object, finite: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value != value:  # NaN
        raise ValueError(f"{name} must not be NaN")
    if finite and not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")


def _parse_logit_bias(bias: object) -> dict[int, float]:
    """``logit_bias`` with int keys: keys are ints or integer strings (JSON object keys are
    strings) >= 0, values numbers in [-100, 100].

    Raises:
        ValueError: naming ``logit_bias``, for anything else.
    """
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must map token ids to numbers, got {type(bias).__name__}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        if isinstance(key, str) and re.fullmatch(r"-?[0-9]+", key):
            token = int(key)
        elif isinstance(key, int) and not isinstance(key, bool):
            token = key
        else:
            raise ValueError(f"logit_bias keys must be token ids (integers), got {key!r}")
        if token < 0:
            raise ValueError(f"logit_bias keys must be token ids >= 0, got {token}")
        _check_number("logit_bias", value)
        if not -100.0 <= value <= 100.0:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {token}: {value}")
        out[token] = float(value)
    return out
