"""Incremental detokenization for streaming.

Decoding one token at a time is wrong for byte-level BPE (a multi-byte UTF-8 character can
span tokens) and for SentencePiece (leading spaces depend on the previous token). Following
vLLM's ``detokenize_incrementally``, each step decodes a short window that starts a few
tokens back (``prefix_offset``) twice, with and without the new tokens, and emits the
difference; text ending in U+FFFD (an incomplete character) is held back until the next
token completes it.
"""

from __future__ import annotations

from typing import Any

_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Text of one request's output, grown token by token.

    Args:
        tokenizer: a transformers tokenizer.
        prompt_token_ids: the prompt (its last tokens give the first output tokens context).
        skip_special_tokens: drop special tokens from the text.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, new_token_ids: list[int], finished: bool = False) -> str:
        """Append tokens and return the newly completed text (possibly empty).

        When ``finished`` is True, any held-back text is flushed as well.
        """
        self.token_ids.extend(new_token_ids)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(full_text) > len(prefix_text) and (finished or not full_text.endswith(_REPLACEMENT)):
            delta = full_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            self.text += delta
            return delta
        return ""
