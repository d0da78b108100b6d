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


def json_schema_error(schema: Any) -> str | None:
    """llguidance's complaint about ``schema`` (a JSON-schema dict) as a constraint, checked
    without a tokenizer (``LLMatcher.validate_grammar``), or None when it compiles (or the
    installed llguidance has no such check)."""
    matcher_cls = _llguidance().LLMatcher
    validate = getattr(matcher_cls, "validate_grammar", None)
    if validate is None:  # pragma: no cover - llguidance before validate_grammar
        return None
    try:
        return validate(matcher_cls.grammar_from_json_schema(json.dumps(schema))) or None
    except RecursionError:
        return "nested too deeply"
    except Exception as exc:  # noqa: BLE001 - the grammar engine's refusal of this schema
        return f"{type(exc).__name__}: {exc}"


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


def _llg_compile_error(text: str) -> str:
    """llguidance's compile error, cleaned for a client: its first line and the lines that
    say what is wrong (``error: ...``), without the listing of the grammar it appends (for a
    structural tag of many tools, thousands of lines of generated grammar), at most 500
    characters."""
    lines = [line.strip() for line in (text or "").strip().split("\n")]
    kept = [lines[0]] + [line for line in lines[1:] if line.startswith("error:")] if lines else []
    message = " ".join(line for line in kept if line) or "no reason given"
    return message if len(message) <= 500 else message[:497] + "..."


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
        self._mask_fresh = False  # the bitmask holds the tokens allowed now (filled since the last accept)

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
        self._mask_fresh = True
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
                other masks, such as ``bad_words``, left none of its tokens to sample), or
                when the grammar engine gives up on a token its mask allowed (a constraint
                too complex for it, such as a regex with a huge repetition count).
        """
        mask_fresh, self._mask_fresh = self._mask_fresh, False
        if not self.matcher.consume_token(token_id) or self.matcher.is_error():
            # (the bitmask still holds the mask filled before this token: read only on failure)
            allowed = mask_fresh and 0 <= token_id < self.vocab_size and bool(
                (int(self._bitmask[0, token_id >> 5]) >> (token_id & 31)) & 1)
            if allowed:
                raise ValueError(f"{self.field} is too complex for the grammar engine: it gave up during "
                                 f"generation (llguidance: {_llg_error(self.matcher)})")
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
                can satisfy from its start (an empty language, such as ``a[^\\s\\S]``), or
                one too complex for the grammar engine (a regex such as ``a{1000000}``, which
                it gives up on at the first token).
                One that only dead-ends later (a grammar whose every path recurses forever)
                fails its request during generation (``GrammarMatcher.fill_bitmask``).
        """
        try:
            field, grammar = self._grammar(params)
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001 - the grammar engine's own fault, on this input
            field = _field(params)
            raise ValueError(f"{field} is not a usable grammar: the grammar engine failed on it "
                             f"({type(exc).__name__}: {_llg_compile_error(str(exc))})") from None
        except BaseException as exc:  # a Rust panic (pyo3's PanicException is a BaseException)
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            field = _field(params)
            raise ValueError(f"{field} is not a usable grammar: the grammar engine failed on it") from None
        if grammar is None:
            return None
        return self._matcher(field, grammar)

    def _grammar(self, params: SamplingParams) -> tuple[str | None, str | None]:
        """The field and the llguidance grammar of ``params``' constraint, or (None, None).

        Raises:
            ValueError: naming the field, as ``compile``.
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
                raise ValueError(f"guided_grammar is not a usable grammar: {_llg_compile_error(str(exc))}") from None
        elif params.structural_tag is not None:
            field = "structural_tag"
            grammar = matcher_cls.grammar_from_lark(structural_tag_lark(params.structural_tag, self._added_tokens))
        else:
            return None, None
        return field, grammar

    def _matcher(self, field: str, grammar: str) -> GrammarMatcher:
        """The checked matcher of ``grammar`` (see ``compile``)."""
        try:
            matcher = self._llg.LLMatcher(self._lltokenizer, grammar)
        except BaseException as exc:  # documented never to raise; a Rust panic would
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            raise ValueError(f"{field} is not a usable grammar: the grammar engine failed on it") from None
        if matcher.is_error():
            raise ValueError(f"{field} is not a usable grammar: {_llg_compile_error(matcher.get_error())}")
        guided = GrammarMatcher(matcher, self.vocab_size, field)
        try:  # an empty language (a regex or schema nothing matches) allows no first token
            bitmask = guided.fill_bitmask()
        except ValueError:
            raise ValueError(f"{field} is unsatisfiable: no output matches it (llguidance: {_llg_error(matcher)})") from None
        self._probe(matcher, bitmask, field)
        return guided

    def _probe(self, matcher: Any, bitmask: torch.Tensor, field: str) -> None:
        """Consume the first allowed token on a copy of ``matcher``: llguidance builds a
        regex's automaton lazily, so a constraint too complex for it (``a{1000000}``: "too
        many expressions constructed") compiles and masks its first token, then fails on
        the first token consumed, i.e. during generation. This makes it fail here, before
        the request runs.

        Raises:
            ValueError: naming the field, when the grammar engine gives up on that token.
        """
        allowed = unpack_bitmask(bitmask, self.vocab_size).nonzero().flatten()
        if len(allowed) == 0:
            return
        probe = matcher.deep_copy()
        if not probe.consume_token(int(allowed[0])) or probe.is_error():
            raise ValueError(f"{field} is too complex for the grammar engine (llguidance: {_llg_error(probe)})")


def _field(params: SamplingParams) -> str:
    """The constraint field ``params`` sets (for errors)."""
    kind = params.guided_kind
    return "structural_tag" if kind == "structural_tag" else f"guided_{kind}"


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
