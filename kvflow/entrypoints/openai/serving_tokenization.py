"""``POST /tokenize``, ``POST /detokenize`` and ``GET /version`` (vLLM's extra endpoints, in
vLLM's shapes).

- ``/tokenize``: ``{"prompt": str, "add_special_tokens": true}`` or ``{"messages": [...],
  "add_generation_prompt": true, "continue_final_message": false, "add_special_tokens":
  false, "tools": [...], "chat_template_kwargs": {...}}`` (the messages and tools rendered exactly as
  ``/v1/chat/completions`` renders them), plus
  ``model`` and ``return_token_strs`` -> ``{"count", "max_model_len", "tokens"}`` and
  ``"token_strs"`` when asked for.
- ``/detokenize``: ``{"tokens": [int, ...]}`` -> ``{"prompt": str}``; an id the tokenizer
  does not have is a 400 naming ``tokens``.
- ``/version``: ``{"version": kvflow's version}`` (the installed package's metadata).
"""

from __future__ import annotations

import functools
import importlib.metadata
from typing import Any, ClassVar

from fastapi import Body, FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import Field, ValidationError, field_validator

from kvflow.entrypoints.chat_utils import render_chat_text
from kvflow.entrypoints.openai.protocol import (
    ChatMessage, ChatTool, _Body, check_template_kwargs, check_tool_count, unsupported_message_field,
)
from kvflow.entrypoints.openai.serving import APIError, OpenAIServing, _bad_request
from kvflow.entrypoints.openai.tools import template_tools


class TokenizeCompletionRequest(_Body):
    """POST /tokenize with a ``prompt``."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False

    # the messages form's fields -> their values that change nothing: a prompt is tokenized
    # as it is, with no chat template to render tools or template variables into
    CHAT_ONLY: ClassVar[dict[str, tuple[Any, ...]]] = {
        "tools": (None, []), "chat_template_kwargs": (None, {}), "add_generation_prompt": (None, False),
        "continue_final_message": (None, False),
    }

    def unsupported_field(self) -> tuple[str, str] | None:
        """See ``_Body.unsupported_field``; also refuses a field of the messages form set with a
        ``prompt`` (``tools`` were dropped and the count left them out)."""
        for name, harmless in self.CHAT_ONLY.items():
            value = (self.model_extra or {}).get(name)
            if not any(value == h and type(value) is type(h) for h in harmless):
                return name, (f"{name} is rendered by the chat template, which tokenizes messages, not a prompt: "
                              f"send messages, or leave {name} unset")
        return super().unsupported_field()


class TokenizeChatRequest(_Body):
    """POST /tokenize with ``messages`` (the chat template's rendering)."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    # the tools and template variables as /v1/chat/completions renders them into the prompt
    tools: list[ChatTool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM extras /v1/chat/completions does not take either (so that a count here is the
    # chat endpoint's prompt size): refused when set
    chat_template: Any = None
    mm_processor_kwargs: Any = None

    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {"chat_template": (), "mm_processor_kwargs": ({},)}

    # as /v1/chat/completions refuses them: the keys the server sets itself, more than MAX_TOOLS tools
    _free_template_kwargs = field_validator("chat_template_kwargs")(check_template_kwargs)
    _tools_bounded = field_validator("tools", mode="before")(check_tool_count)

    def unsupported_field(self) -> tuple[str, str] | None:
        """See ``_Body.unsupported_field``; also looks into the messages, and refuses a
        ``prompt`` sent with them (one or the other is tokenized, never both)."""
        if "prompt" in (self.model_extra or {}):
            return "prompt", "prompt and messages are exclusive: send one of them"
        return super().unsupported_field() or unsupported_message_field(self.messages)


class DetokenizeRequest(_Body):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[int]
    # false (the default): special tokens are decoded as their text, as vLLM's /detokenize does
    skip_special_tokens: bool = False


def kvflow_version() -> str:
    """The installed kvflow's version (package metadata), else ``kvflow.__version__``."""
    try:
        return importlib.metadata.version("kvflow")
    except importlib.metadata.PackageNotFoundError:
        import kvflow

        return kvflow.__version__


def _validate(model: type[_Body], body: Any) -> _Body:
    """``body`` as ``model``; a validation error is answered as FastAPI's are (400)."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None


def _tokenize(serving: OpenAIServing, req: TokenizeCompletionRequest | TokenizeChatRequest) -> list[int]:
    if isinstance(req, TokenizeCompletionRequest):
        return serving.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    try:
        text = render_chat_text(
            serving.tokenizer, [m.template_dict() for m in req.messages],
            add_generation_prompt=req.add_generation_prompt, continue_final_message=req.continue_final_message,
            chat_template=serving.chat_template, tools=template_tools(req.tools) if req.tools else None,
            chat_template_kwargs=req.chat_template_kwargs,
        )  # fmt: skip
        return serving.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
    except ValueError as exc:
        raise _bad_request(exc) from None


def _check_tokenizer(serving: OpenAIServing, field: str) -> None:
    if serving.tokenizer is None:
        raise APIError(400, f"{field}: this model has no tokenizer", "BadRequestError", field)


def attach_routes(app: FastAPI, serving: OpenAIServing) -> None:
    """Add ``POST /tokenize``, ``POST /detokenize`` and ``GET /version`` to the app."""
    version = kvflow_version()

    @app.post("/tokenize")
    async def tokenize(body: dict[str, Any] = Body(...)) -> Response:
        """Raises: APIError 400 for a bad body, an unsupported field, a template failure or a
        model without tokenizer; 404 for an unknown model."""
        # (a JSON object parsed and checked by the server's route, then one of two shapes)
        chat = "messages" in body
        req = _validate(TokenizeChatRequest if chat else TokenizeCompletionRequest, body)
        serving.check_request(req)
        _check_tokenizer(serving, "messages" if chat else "prompt")
        tokens = await serving.engine.run_off_loop(_tokenize, serving, req)
        out: dict[str, Any] = {"count": len(tokens), "max_model_len": serving.max_model_len, "tokens": tokens}
        if req.return_token_strs:
            out["token_strs"] = serving.tokenizer.convert_ids_to_tokens(tokens)
        return JSONResponse(out)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> Response:
        """Raises: APIError 400 naming ``tokens`` for an id outside the tokenizer's
        vocabulary (or a model without tokenizer); 404 for an unknown model."""
        serving.check_request(req)
        _check_tokenizer(serving, "tokens")
        size = len(serving.tokenizer)
        bad = next((t for t in req.tokens if not 0 <= t < size), None)
        if bad is not None:
            raise APIError(400, f"tokens: token id {bad} is out of vocabulary (the tokenizer has ids 0..{size - 1})",
                           "BadRequestError", "tokens")
        text = await serving.engine.run_off_loop(
            functools.partial(serving.tokenizer.decode, req.tokens, skip_special_tokens=req.skip_special_tokens))
        return JSONResponse({"prompt": text})

    @app.get("/version")
    async def get_version() -> dict[str, str]:
        return {"version": version}
