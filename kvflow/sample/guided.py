"""Structured output: constrain sampling to a JSON schema, a regular expression, a choice of
strings or a context-free grammar (Lark or GBNF).

The grammar engine is llguidance (Microsoft's Rust implementation of constrained decoding
over a tokenizer's vocabulary, the one vLLM and SGLang also use): for each step it gives a
bitmask of the tokens that keep the output a valid prefix of the language, and the masked
logits are then processed and sampled as usual.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from kvflow.sampling_params import SamplingParams


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch
    except ImportError as exc:  # pragma: no cover - llguidance is a dependency
        raise ValueError("structured output needs the llguidance package: pip install llguidance") from exc
    return llguidance


_BIT = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The allowed tokens of an llguidance token bitmask: bool [vocab_size] from int32
    [ceil(vocab_size / 32)] (bit j of word i is token 32 i + j), as
    ``llguidance.torch.apply_token_bitmask_inplace`` reads it. That function is a
    ``torch.compile`` kernel, compiled on its first call: a stall of seconds in the engine
    thread for the first guided request, hence this eager version."""
    return (((bitmask.unsqueeze(1) >> _BIT) & 1) != 0).flatten()[:vocab_size]


class GrammarMatcher:
    """The grammar state of one request.

    Args:
        matcher: an ``llguidance.LLMatcher`` compiled for the request.
        vocab_size: the model's vocabulary size (rows of the logits).
    """

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._lt = _llguidance().torch
        self.matcher = matcher
        self.vocab_size = vocab_size
        self._bitmask = self._lt.allocate_token_bitmask(1, vocab_size)

    def mask_logits(self, row: torch.Tensor) -> None:
        """Set the logits of tokens the grammar forbids to -inf. row: float32 [vocab_size]."""
        self._lt.fill_next_token_bitmask(self.matcher, self._bitmask, 0)
        row.masked_fill_(~unpack_bitmask(self._bitmask[0], row.shape[0]).to(row.device), float("-inf"))

    def accept(self, token_id: int) -> None:
        """Advance the grammar by the sampled token."""
        self.matcher.consume_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """True when the grammar admits no further token (the output is complete)."""
        return self.matcher.is_stopped()


class GrammarCompiler:
    """Builds a ``GrammarMatcher`` per request; holds the vocabulary tables once.

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        vocab_size: the model's vocabulary size (may exceed the tokenizer's).
        eos_token_id: the token that ends the output when the grammar is complete.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int | None) -> None:
        self._llg = _llguidance()
        self.vocab_size = vocab_size
        self._lltokenizer = self._llg.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_token_id)

    def compile(self, params: SamplingParams) -> GrammarMatcher | None:
        """The matcher for ``params.guided_json`` / ``guided_regex`` / ``guided_choice`` /
        ``guided_grammar``, or None.

        Raises:
            ValueError: naming the field, for a schema or regex llguidance rejects, or a
                schema nested too deeply for Python's JSON codec.
        """
        matcher_cls = self._llg.LLMatcher
        if params.guided_json is not None:
            field = "guided_json"
            try:
                schema = params.guided_json if isinstance(params.guided_json, str) else json.dumps(params.guided_json)
                json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"guided_json is not valid JSON: {exc}") from None
            except RecursionError:
                raise ValueError("guided_json is nested too deeply") from None
            grammar = matcher_cls.grammar_from_json_schema(schema)
        elif params.guided_regex is not None:
            field = "guided_regex"
            grammar = matcher_cls.grammar_from_regex(params.guided_regex)
        elif params.guided_choice is not None:
            field = "guided_choice"
            grammar = self._llg.grammar_from("choice", json.dumps(params.guided_choice))
        elif params.guided_grammar is not None:
            field = "guided_grammar"  # Lark, or llama.cpp's GBNF (llguidance converts it)
            try:
                grammar = self._llg.grammar_from("grammar", params.guided_grammar)
            except ValueError as exc:
                raise ValueError(f"guided_grammar is not a usable grammar: {exc}") from None
        else:
            return None
        matcher = matcher_cls(self._lltokenizer, grammar)
        if matcher.is_error():
            raise ValueError(f"{field} is not a usable grammar: {matcher.get_error()}")
        return GrammarMatcher(matcher, self.vocab_size)
