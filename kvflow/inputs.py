"""Prompt types of the offline API, vLLM's names (``vllm.inputs``): ``LLM.generate``,
``LLM.embed`` and ``LLM.llm_engine.add_request`` take a prompt as a string, a list of token
ids, or one of these dicts.

``TextPrompt`` and ``TokensPrompt`` are ``TypedDict``s, as in vLLM: ``TextPrompt(prompt=
"Hi")`` is the dict ``{"prompt": "Hi"}``. kvflow serves text models: ``multi_modal_data`` and
``mm_processor_kwargs`` are accepted only empty, and any other key (``cache_salt``,
``token_type_ids``...) is refused with a ValueError naming it (``LLM.generate``).
"""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict, Union


class TextPrompt(TypedDict):
    """A prompt as text, tokenized with the model's tokenizer.

    Keys:
        prompt: the text.
        multi_modal_data, mm_processor_kwargs: accepted only empty (text models only).
    """

    prompt: str
    multi_modal_data: NotRequired[Any]
    mm_processor_kwargs: NotRequired[dict[str, Any]]


class TokensPrompt(TypedDict):
    """A prompt as token ids (each in [0, vocabulary size)).

    Keys:
        prompt_token_ids: the ids, used as given (no special tokens added).
        prompt: optional text of those ids, reported back in ``RequestOutput.prompt``.
        multi_modal_data, mm_processor_kwargs: accepted only empty (text models only).
    """

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    multi_modal_data: NotRequired[Any]
    mm_processor_kwargs: NotRequired[dict[str, Any]]


SingletonPrompt = Union[str, list[int], TextPrompt, TokensPrompt]
PromptType = SingletonPrompt

# The keys a prompt dict may carry; those in EMPTY_ONLY only when empty.
PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids"})
EMPTY_ONLY = frozenset({"multi_modal_data", "mm_processor_kwargs"})

__all__ = ["TextPrompt", "TokensPrompt", "SingletonPrompt", "PromptType"]
