"""Structured output: constrain sampling to a JSON schema, a regular expression, a choice of
strings, a context-free grammar (Lark or GBNF), or vLLM's structural tag (free text with
constrained segments, e.g. tool calls).

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


def _llg_error(matcher: Any) -> str:
    """The first line of llguidance's error (the rest is a dump of the parser's state)."""
    return (matcher.get_error() or "").strip().split("\n", 1)[0] or "no reason given"


class GrammarMatcher:
    """The grammar state of one request.

    Args:
        matcher: an ``llguidance.LLMatcher`` compiled for the request.
        vocab_size: the model's vocabulary size (rows of the logits).
        field: the request field the grammar comes from (``guided_json``, ...), for errors.
    """

    def __init__(self, matcher: Any, vocab_size: int, field: str = "guided decoding") -> None:
        self._lt = _llguidance().torch
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.field = field
        self._bitmask = self._lt.allocate_token_bitmask(1, vocab_size)

    def fill_bitmask(self) -> torch.Tensor:
        """The int32 bitmask of the tokens the grammar allows next.

        Raises:
            ValueError: naming the field, when the grammar allows no token at all (no
                string continues the output: llguidance stops with an error, where it
                would otherwise let only EOS through and end the output silently).
        """
        self._lt.fill_next_token_bitmask(self.matcher, self._bitmask, 0)
        if self.matcher.is_error():
            raise ValueError(f"{self.field}: no output satisfies the constraint from here on "
                             f"(llguidance: {_llg_error(self.matcher)})")
        return self._bitmask[0]

    def mask_logits(self, row: torch.Tensor) -> None:
        """Set the logits of tokens the grammar forbids to -inf. row: float32 [vocab_size].

        Raises:
            ValueError: see ``fill_bitmask`` (the engine fails this request alone).
        """
        bitmask = self.fill_bitmask()
        row.masked_fill_(~unpack_bitmask(bitmask, row.shape[0]).to(row.device), float("-inf"))

    def accept(self, token_id: int) -> None:
        """Advance the grammar by the sampled token.

        Raises:
            ValueError: naming the field, for a token the grammar does not allow (e.g. when
                other masks, such as ``bad_words``, left none of its tokens to sample).
        """
        if not self.matcher.consume_token(token_id) or self.matcher.is_error():
            raise ValueError(f"{self.field}: token {token_id} does not satisfy the constraint "
                             f"(llguidance: {_llg_error(self.matcher)})")

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
        # llguidance reads added tokens (Qwen's <tool_call>, ...) as special: a grammar must
        # name them as tokens, not spell their text
        added = getattr(tokenizer, "added_tokens_encoder", None) or {}
        self._added_tokens = {text: i for text, i in added.items() if len(text) > 1 and i < vocab_size}

    def compile(self, params: SamplingParams) -> GrammarMatcher | None:
        """The matcher for ``params.guided_json`` / ``guided_regex`` / ``guided_choice`` /
        ``guided_grammar`` / ``structural_tag``, or None.

        Raises:
            ValueError: naming the field, for a schema or regex llguidance rejects, a
                schema nested too deeply for Python's JSON codec, or a constraint no output
                can satisfy from its start (an empty language, such as ``a[^\\s\\S]``).
                One that only dead-ends later (a grammar whose every path recurses forever)
                fails its request during generation (``GrammarMatcher.fill_bitmask``).
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
        elif params.structural_tag is not None:
            field = "structural_tag"
            grammar = matcher_cls.grammar_from_lark(structural_tag_lark(params.structural_tag, self._added_tokens))
        else:
            return None
        matcher = matcher_cls(self._lltokenizer, grammar)
        if matcher.is_error():
            raise ValueError(f"{field} is not a usable grammar: {matcher.get_error()}")
        guided = GrammarMatcher(matcher, self.vocab_size, field)
        try:  # an empty language (a regex or schema nothing matches) allows no first token
            guided.fill_bitmask()
        except ValueError:
            raise ValueError(f"{field} is unsatisfiable: no output matches it (llguidance: {_llg_error(matcher)})") from None
        return guided


def _tag_structures(spec: dict[str, Any] | str) -> tuple[list[dict[str, Any]], list[str]]:
    """The checked structures and triggers of a structural tag.

    Raises:
        ValueError: naming ``structural_tag``, for anything but vLLM's shape.
    """
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise ValueError(f"structural_tag is not valid JSON: {exc}") from None
    if not isinstance(spec, dict):
        raise ValueError("structural_tag must be an object with structures and triggers")
    structures, triggers = spec.get("structures"), spec.get("triggers")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError("structural_tag.triggers must be a non-empty list of non-empty strings")
    if not isinstance(structures, list) or not structures:
        raise ValueError("structural_tag.structures must be a non-empty list")
    for s in structures:
        if not (isinstance(s, dict) and isinstance(s.get("begin"), str) and isinstance(s.get("end"), str)
                and isinstance(s.get("schema"), dict)):  # fmt: skip
            raise ValueError("structural_tag.structures items must have begin (string), schema (object), end (string)")
        if not any(s["begin"].startswith(t) for t in triggers):
            raise ValueError(f"structural_tag: the begin {s['begin']!r} starts with none of the triggers")
    return structures, triggers


def structural_tag_lark(spec: dict[str, Any] | str, special_tokens: dict[str, int]) -> str:
    """The llguidance Lark grammar of a structural tag (vLLM's ``structural_tag``:
    ``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``).

    The output is text, then any number of (structure, text). The text before a structure
    ends at its trigger (a lazy lexeme, llguidance's tool-calling construct, as in
    ``llguidance.StructTag``); a trigger that is an added token of the tokenizer
    (``special_tokens``: text -> id, e.g. Qwen's ``<tool_call>``) is matched as that token,
    as is any such token's text inside ``begin`` / ``end``. The structure's JSON is
    ``%json`` of its schema.

    Raises:
        ValueError: naming ``structural_tag``, for a malformed tag.
    """
    structures, triggers = _tag_structures(spec)
    names = sorted(special_tokens, key=len, reverse=True)

    def pieces(text: str) -> str:
        """``text`` as Lark items: quoted strings and ``<[id]>`` tokens."""
        out, i, j = [], 0, 0
        while j < len(text):
            hit = next((n for n in names if text.startswith(n, j)), None)
            if hit is None:
                j += 1
                continue
            if j > i:
                out.append(json.dumps(text[i:j]))
            out.append(f"<[{special_tokens[hit]}]>")
            i = j = j + len(hit)
        if i < len(text):
            out.append(json.dumps(text[i:]))
        return " ".join(out)

    rules = []
    for k, s in enumerate(structures):
        trigger = max((t for t in triggers if s["begin"].startswith(t)), key=len)
        schema = json.dumps(s["schema"])
        body = f"{pieces(s['begin'][len(trigger):])} %json {schema} {pieces(s['end'])}"
        if trigger in special_tokens:
            rules.append(f"tag_{k}: TAG_TEXT <[{special_tokens[trigger]}]> {body}")
        else:
            rules.append(f"tag_{k}_trig[lazy]: TAG_TEXT {json.dumps(trigger)}\ntag_{k}: tag_{k}_trig {body}")
    options = " | ".join(f"tag_{k}" for k in range(len(structures)))
    header = f"%llguidance {{}}\nstart: ({options})* tag_end\ntag_end: TAG_TEXT\nTAG_TEXT: /(.|\\n)*/\n"
    return header + "\n".join(rules) + "\n"
