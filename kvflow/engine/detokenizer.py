"""Incremental detokenization for streaming, with stop strings.

Decoding one token at a time is wrong for byte-level BPE (a multi-byte UTF-8 character can
span tokens) and for SentencePiece (leading spaces depend on the previous token). Following
vLLM's ``detokenize_incrementally``, each step decodes a short window that starts a few
tokens back (``prefix_offset``) twice, with and without the new tokens, and emits the
difference; text ending in U+FFFD (an incomplete character) is held back until the next
token completes it, and an incomplete character left at the end of the output (cut by
``max_tokens``) is dropped, not released as U+FFFD: the text is what decodes cleanly.

Stop strings are matched on the text, so they are found also when they span tokens. While a
request runs, the visible text holds back its longest suffix that could still grow into a
stop string, so streamed text never has to be taken back.
"""

from __future__ import annotations

from typing import Any

_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


def fast_decode(tokenizer: Any) -> Any | None:
    """The Rust ``tokenizers.Tokenizer.decode`` behind a transformers tokenizer, when calling
    it gives exactly what ``tokenizer.decode(ids, skip_special_tokens=...)`` gives: a
    ``TokenizersBackend`` whose ``decode``/``_decode`` no subclass overrides and that cleans
    up no tokenization spaces (``_decode`` then returns the backend's string unchanged).
    None otherwise (the transformers call is used). The transformers wrapper converts its
    arguments and looks up options on every call; for one token of one stream that costs
    several times the decoding itself."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # pragma: no cover - an older transformers
        return None
    cls = type(tokenizer)
    backend = getattr(tokenizer, "_tokenizer", None)
    if (not isinstance(tokenizer, TokenizersBackend) or backend is None
            or cls._decode is not TokenizersBackend._decode or cls.decode is not TokenizersBackend.decode
            or getattr(tokenizer, "clean_up_tokenization_spaces", False)):
        return None
    return backend.decode


#: The most one-token texts a ``token_texts`` cache keeps (the tokens seen first; later ones
#: are decoded each time): its memory stays ~3 MB whatever the vocabulary (151,936 for Qwen2.5).
MAX_CACHED_TOKEN_TEXTS = 32768


class IncrementalDetokenizer:
    """Text of one output sequence, grown token by token.

    Args:
        tokenizer: a transformers tokenizer.
        prompt_token_ids: the prompt (its last tokens give the first output tokens context).
        skip_special_tokens: drop special tokens from the text.
        stop: stop strings (may be empty).
        include_stop_str_in_output: keep a matched stop string in the text.
        token_texts: a cache of one-token decodes (token id -> its text decoded alone, with
            this ``skip_special_tokens``), shared by the detokenizers of one tokenizer and
            setting (``OutputProcessor`` keeps one per setting); None: no cache. A decode
            step's first window is usually the one token emitted at the previous step,
            so the cache saves one of the step's two decodes (a token id's text is a pure
            function of the id). It holds at most ``MAX_CACHED_TOKEN_TEXTS`` entries (~3 MB).
        min_tokens: the sampling ``min_tokens``: no stop string is matched in the text of
            the first ``min_tokens`` output tokens (vLLM's rule, vllm-project/vllm#22014);
            a stop string that the later text completes is.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        token_texts: dict[int, str] | None = None,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.min_tokens = min_tokens  # stop strings are not matched before this many output tokens (vLLM's rule)
        self._num_output = 0
        self._fast_decode = fast_decode(tokenizer)
        self._token_texts = token_texts
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop or [])
        self.include_stop_str_in_output = include_stop_str_in_output
        self.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        # A prompt that ends inside a multi-byte character must not lend its bytes to the
        # output (the output text is the decode of the output tokens alone): drop them.
        while self.token_ids and self._decode(self.token_ids).endswith(_REPLACEMENT):
            self.token_ids.pop()
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self._text = ""
        self.finished = False

    def _decode(self, ids: list[int]) -> str:
        if self._fast_decode is not None:
            return self._fast_decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, new_token_ids: list[int], finished: bool = False) -> str | None:
        """Append tokens; return the stop string they completed, if any.

        When ``finished`` is True (or a stop string matched), the text is final: any
        held-back characters are released.
        """
        if self.finished:
            return None
        ids = self.token_ids
        ids.extend(new_token_ids)
        self._num_output += len(new_token_ids)
        prefix_offset, fast = self.prefix_offset, self._fast_decode
        if fast is not None:
            skip, cache = self.skip_special_tokens, self._token_texts
            if cache is not None and self.read_offset - prefix_offset == 1:  # (a decode step)
                token = ids[prefix_offset]
                prefix_text = cache.get(token)
                if prefix_text is None:
                    prefix_text = fast([token], skip_special_tokens=skip)
                    if len(cache) < MAX_CACHED_TOKEN_TEXTS:  # bounded: a server lives long
                        cache[token] = prefix_text
            else:
                prefix_text = fast(ids[prefix_offset : self.read_offset], skip_special_tokens=skip)
            full_text = fast(ids[prefix_offset:], skip_special_tokens=skip)
        else:
            prefix_text = self._decode(ids[prefix_offset : self.read_offset])
            full_text = self._decode(ids[prefix_offset:])
        if finished and full_text.endswith(_REPLACEMENT):
            full_text = full_text[:-1]  # a character cut by the end: not text (vLLM's rule)
        if len(full_text) > len(prefix_text) and (finished or not full_text.endswith(_REPLACEMENT)):
            old_len = len(self._text)
            self._text += full_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(ids)
            if self.stop and self._num_output > self.min_tokens:
                matched = self._match_stop(old_len)
                if matched is not None:
                    self.finished = True
                    return matched
        self.finished = finished
        return None

    def _match_stop(self, old_len: int) -> str | None:
        """Find the stop string that the new text completes first; cut the text there.

        "First" is where its end falls in the text (the longest on a tie), as if the text
        grew one character at a time, so the result does not depend on token boundaries.
        """
        best: tuple[int, int, str] | None = None
        for stop in self.stop:
            index = self._text.find(stop, max(0, old_len - len(stop) + 1))
            if index != -1 and (best is None or (index + len(stop), index) < best[:2]):
                best = (index + len(stop), index, stop)
        if best is None:
            return None
        _, index, stop = best
        self._text = self._text[: index + (len(stop) if self.include_stop_str_in_output else 0)]
        return stop

    def _visible_len(self) -> int:
        """Characters of the text that may be shown: while unfinished, all but the longest
        suffix that may become a stop string (it never shrinks as tokens arrive)."""
        if self.finished or not self.stop:
            return len(self._text)
        hold = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(self._text)), hold, -1):
                if self._text.endswith(stop[:k]):
                    hold = k
                    break
        return len(self._text) - hold

    @property
    def text(self) -> str:
        """The text so far; while unfinished, without a suffix that may become a stop string."""
        if self.finished or not self.stop:
            return self._text
        return self._text[: self._visible_len()]

    def text_since(self, offset: int) -> str:
        """The visible text from character ``offset`` on (a streamed delta: ``offset`` is the
        length of the text already sent)."""
        return self._text[offset : self._visible_len()]
