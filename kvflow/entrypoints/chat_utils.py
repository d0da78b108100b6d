"""Rendering a conversation with the tokenizer's chat template (transformers'
``apply_chat_template``), for ``LLM.chat`` and the server's ``POST /tokenize``.

A message is a dict with ``role`` and ``content`` (a string, None, or a list of OpenAI
content parts of which only ``{"type": "text", "text": ...}`` is accepted: kvflow's models
take text only), plus whatever else the template reads (``name``, ``tool_calls``,
``tool_call_id``...), passed through as given.
"""

from __future__ import annotations

import json
from typing import Any

# apply_chat_template's own parameters: not settable through chat_template_kwargs.
_RESERVED_KWARGS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs",
})  # fmt: skip


def text_content(content: Any, where: str) -> str:
    """A message's content as one string: list content joins its text parts in order, one
    per line (``"\n"``, as vLLM's ``_parse_chat_message_content_parts`` for string-format
    templates: ``["Hello", "world"]`` is not "Helloworld").

    Raises:
        ValueError: naming ``where`` and the part type, for a non-text part (image, audio,
            file...) or a content that is neither a string, None nor a list of parts.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}.content must be a string or a list of content parts, got {type(content).__name__}")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise ValueError(f"{where}.content[{i}]: content parts of type {kind!r} are not supported by kvflow "
                             "(text parts only; no multimodal model is served)")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where}.content[{i}].text must be a string")
        texts.append(part["text"])
    return "\n".join(texts)


def normalize_conversation(conversation: Any, content_format: str = "string") -> list[dict[str, Any]]:
    """The messages as the template sees them: "developer" rendered as "system" (as
    OpenAI's servers do), content flattened to a string (``text_content``), or with
    ``content_format="openai"`` as one text part ``[{"type": "text", "text": ...}]`` (for
    templates that iterate over parts; vLLM's two formats).

    Raises:
        ValueError: for a message that is not a dict with a string ``role``, bad content, or
            an unknown ``content_format``.
    """
    if content_format not in ("string", "openai"):
        raise ValueError(f"chat_template_content_format must be 'auto', 'string' or 'openai', got {content_format!r}")
    if not isinstance(conversation, list) or not conversation:
        raise ValueError("messages must be a non-empty list of message dicts")
    out = []
    for i, message in enumerate(conversation):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] must be a dict with a string 'role'")
        rendered = dict(message)
        text = text_content(message.get("content"), f"messages[{i}]")
        rendered["content"] = text if content_format == "string" else [{"type": "text", "text": text}]
        if rendered["role"] == "developer":
            rendered["role"] = "system"
        if isinstance(message.get("tool_calls"), list):
            rendered["tool_calls"] = [_call_with_object_arguments(call, f"messages[{i}].tool_calls[{j}]")
                                      for j, call in enumerate(message["tool_calls"])]
        out.append(rendered)
    return out


def _call_with_object_arguments(call: Any, where: str) -> Any:
    """A tool call as the template takes it: OpenAI's ``function.arguments`` JSON string as
    the object it holds (transformers' form, which templates write with ``| tojson``: the
    string was written quoted a second time), as the server and vLLM's ``LLM.chat`` render it;
    a copy (the caller's message is not changed). Anything else is kept as given.

    Raises:
        ValueError: naming the call, for arguments that are a string but not JSON.
    """
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}.function.arguments is not valid JSON: {exc}") from None
    return {**call, "function": {**function, "arguments": arguments}}


def render_chat_text(
    tokenizer: Any,
    conversation: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """``conversation`` rendered with the chat template (the tokenizer's, or
    ``chat_template``, a Jinja string): the prompt text (what vLLM's ``LLM.chat`` outputs
    carry as ``prompt``); callers encode it with ``add_special_tokens=False`` (the template
    writes the special tokens) unless asked otherwise.

    Args:
        tokenizer: a transformers tokenizer.
        conversation: messages as ``normalize_conversation`` returns them.
        add_generation_prompt: end with the assistant's turn header.
        continue_final_message: leave the last (assistant) message open, for the model to
            continue it; excludes ``add_generation_prompt``.
        chat_template: a template to use instead of the tokenizer's.
        chat_template_kwargs: extra variables for the template (e.g. ``enable_thinking``).
        tools: tool (function) schemas, given to the template as transformers does.

    Raises:
        ValueError: without a tokenizer, or without a chat template (none given and the
            tokenizer has none); for ``add_generation_prompt`` or
            ``continue_final_message`` not a bool, or both true; ``chat_template_kwargs`` not a
            dict; for a ``chat_template_kwargs`` key that is one of
            apply_chat_template's own parameters; when the template fails on the messages
            (its message says why); for rendered text with a lone surrogate (not Unicode).
    """
    if tokenizer is None:
        raise ValueError("messages: this model has no tokenizer (and no chat template); send token ids")
    for name, value in (("add_generation_prompt", add_generation_prompt),
                        ("continue_final_message", continue_final_message)):
        if not isinstance(value, bool):  # ("no" was truthy; transformers read a string as the text to continue)
            raise ValueError(f"{name} must be true or false, got {value!r}")
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise ValueError(f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}")
    kwargs = dict(chat_template_kwargs or {})
    reserved = sorted(_RESERVED_KWARGS & set(kwargs))
    if reserved:
        raise ValueError(f"chat_template_kwargs cannot set {', '.join(reserved)} (an argument of its own)")
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        # (transformers' own message names its API, not what the user can do here)
        raise ValueError("messages: this model has no chat template (its tokenizer files or GGUF metadata carry "
                         "none); give one with --chat-template FILE (kvflow serve) or chat_template= (LLM.chat), "
                         "or send a prompt to the completions API")
    try:
        text = tokenizer.apply_chat_template(
            conversation, tools=tools, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tokenize=False, **kwargs,
        )  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - the template's errors are the caller's messages
        raise ValueError(f"messages could not be rendered with the chat template: {type(exc).__name__}: {exc}") from None
    require_unicode(text, "messages hold")
    return text


def require_unicode(text: str, subject: str) -> None:
    """Refuse text the tokenizer cannot take: a lone surrogate (``"\\ud800"``) is not Unicode,
    and the tokenizer's own error is a TypeError that names no field. ``subject`` opens the
    message and names the field ("prompt holds", "messages hold").

    Raises:
        ValueError: naming the field and the first lone surrogate.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{subject} a lone surrogate ({text[exc.start]!r}); the text is not valid Unicode") from None
