"""``POST /v1/messages``: a Messages API request runs as the chat request it means
(``protocol.to_chat_fields``, ``OpenAIServing.start_translated_chat``: chat template, tools, forced
tool calls by guided decoding, tool and reasoning parsers); its output is rendered as
Anthropic content blocks (``thinking``, ``text``, ``tool_use``) whole or as Anthropic's SSE
events (``message_start``, ``content_block_start``, ``content_block_delta`` with
``text_delta`` / ``input_json_delta`` / ``thinking_delta``, ``content_block_stop``,
``message_delta`` with ``stop_reason`` and ``usage``, ``message_stop``).

Errors on this path are in Anthropic's shape, ``{"type": "error", "error": {"type",
"message"}}`` (``AnthropicErrorMiddleware`` rewrites the server's OpenAI-shaped error bodies;
a fault inside a stream is an ``error`` event).
"""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvflow.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest, to_chat_fields
from kvflow.entrypoints.openai.chat_output import ChatOutputParser, ChatRun, OutputSequencer

if TYPE_CHECKING:
    from kvflow.entrypoints.openai.serving import OpenAIServing

PATH = "/v1/messages"
TOOL_ID_PREFIX = "toolu_"
RENAMES = {"stop": "stop_sequences", "response_format": "output_config", "guided_json": "output_config"}

# HTTP status -> Anthropic's error type (https://docs.anthropic.com/en/api/errors)
ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
}  # fmt: skip


# field refused (an OpenAI-shaped body's ``param``) -> the ``details`` of Anthropic's error,
# which its SDK acts on: a ``thread`` (server-held conversation) refused with
# ``thread_unsupported_request`` makes the tool runner send the whole conversation again
# without one, where any other 400 ended the run.
ERROR_DETAILS = {"thread": {"error_code": "thread_unsupported_request"}}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")


def error_body(status: int, message: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
    error = {"type": error_type(status), "message": message}
    return {"type": "error", "error": {**error, "details": details} if details else error}


class AnthropicErrorMiddleware:
    """On ``/v1/messages``, rewrite an error response's OpenAI-shaped body
    (``{"error": {"message", ...}}``, from any handler or middleware) into Anthropic's shape,
    whose message names the field (``param``, prefixed where the message does not name it).
    Other paths and successful responses pass through untouched."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PATH):
            await self.app(scope, receive, send)
            return
        start: dict[str, Any] | None = None
        chunks: list[bytes] = []

        async def rewrite(message) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body"):
                return
            body = b"".join(chunks)
            try:
                error = json.loads(body)["error"]
                message, param = error["message"], error.get("param")
                if isinstance(param, str) and param and param not in message:
                    # Anthropic's body has no param: the message names the field (the context-length
                    # 400 of max_tokens named none)
                    message = f"{param}: {message}"
                details = ERROR_DETAILS.get(param) if start["status"] == 400 else None
                body = json.dumps(error_body(start["status"], message, details), ensure_ascii=False).encode()
            except (ValueError, KeyError, TypeError):
                pass  # not an OpenAI-shaped error body: sent as it is
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, rewrite)


def _new_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def _usage(prompt_tokens: int, output_tokens: int, cached_tokens: int = 0) -> dict[str, int]:
    """Anthropic's ``usage``: ``cache_read_input_tokens`` are the prompt tokens that were
    prefix-cache hits (``RequestOutput.num_cached_tokens``) and, as Anthropic counts them,
    ``input_tokens`` the rest (their sum is the prompt, what ``count_tokens`` answers).
    ``cache_creation_input_tokens`` is 0: kvflow caches every prefix, no write is billed."""
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached_tokens}  # fmt: skip


def stop_reason(finish_reason: str | None, engine_stop: int | str | None, stop_sequences: list[str] | None,
                tool_calls: bool) -> tuple[str, str | None]:
    """(``stop_reason``, ``stop_sequence``) of a finished output."""
    if tool_calls and finish_reason == "stop":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(engine_stop, str) and engine_stop in (stop_sequences or []):
        return "stop_sequence", engine_stop
    return "end_turn", None


def content_blocks(parser: ChatOutputParser) -> list[dict[str, Any]]:
    """The content blocks of a finished output: thinking, text, tool uses."""
    blocks: list[dict[str, Any]] = []
    if parser.reasoning:
        blocks.append({"type": "thinking", "thinking": parser.reasoning, "signature": ""})
    if parser.content and not (parser.tool_calls and not parser.content.strip()):
        blocks.append({"type": "text", "text": parser.content})
    for call in parser.tool_calls:
        blocks.append({"type": "tool_use", "id": call.id, "name": call.name, "input": json.loads(call.arguments)})
    return blocks


async def create_message(serving: OpenAIServing, req: MessagesRequest, raw: Request) -> Response:
    """Handle POST /v1/messages.

    Raises:
        APIError: 400 naming the field (unsupported fields, blocks, tools), and the errors
            of ``OpenAIServing.start_chat`` (rendered in Anthropic's shape by the middleware).
    """
    run = await serving.start_translated_chat(req, to_chat_fields, RENAMES)
    message = {"id": _new_id(), "type": "message", "role": "assistant", "model": serving.served_name(req.model)}
    if req.stream:
        return StreamingResponse(_stream(run, message, req), media_type="text/event-stream")
    (out,) = await serving._collect([run.iterator], raw)
    (choice,) = out.outputs
    parser = run.new_parser(TOOL_ID_PREFIX)
    parser.update(choice.text, final=True)
    reason, sequence = stop_reason(choice.finish_reason, choice.stop_reason, req.stop_sequences, bool(parser.tool_calls))
    return JSONResponse({
        **message, "content": content_blocks(parser), "stop_reason": reason, "stop_sequence": sequence,
        "usage": _usage(len(run.prompt_ids), len(choice.token_ids), out.num_cached_tokens),
    })  # fmt: skip


async def count_tokens(serving: OpenAIServing, req: CountTokensRequest) -> Response:
    """Handle POST /v1/messages/count_tokens: ``{"input_tokens": N}``, the prompt tokens
    (system, messages and tools rendered with the chat template) ``/v1/messages`` would
    compute for the same body.

    Raises:
        APIError: 400 / 404 as ``create_message`` before generation.
    """
    return JSONResponse({"input_tokens": await serving.count_translated_chat_tokens(req, to_chat_fields, RENAMES)})


def _event(kind: str, **fields: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n"


_STARTS = {"reasoning": {"type": "thinking", "thinking": "", "signature": ""}, "text": {"type": "text", "text": ""}}
_DELTAS = {"reasoning": ("thinking_delta", "thinking"), "text": ("text_delta", "text"),
           "tool_call": ("input_json_delta", "partial_json")}  # fmt: skip


async def _stream(run: ChatRun, message: dict[str, Any], req: MessagesRequest):
    """Anthropic's SSE events of one run; a fault after the start is an ``error`` event."""
    from kvflow.entrypoints.openai.serving import _as_api_error, _merge

    prompt_tokens = len(run.prompt_ids)
    yield _event("message_start", message={**message, "content": [], "stop_reason": None, "stop_sequence": None,
                                           "usage": _usage(prompt_tokens, 0)})  # fmt: skip
    parser = run.new_parser(TOOL_ID_PREFIX)
    sequencer = OutputSequencer()
    try:
        async for _, out in _merge([run.iterator]):
            (c,) = out.outputs
            events = sequencer.feed(parser.update(c.text, final=c.finish_reason is not None))
            if c.finish_reason is not None:
                events += sequencer.close()
            for ev in events:
                if ev.kind == "start":
                    block = (_STARTS[ev.part] if ev.call is None
                             else {"type": "tool_use", "id": ev.call.id, "name": ev.call.name, "input": {}})  # fmt: skip
                    yield _event("content_block_start", index=ev.index, content_block=block)
                elif ev.kind == "delta":
                    kind, key = _DELTAS[ev.part]
                    yield _event("content_block_delta", index=ev.index, delta={"type": kind, key: ev.text})
                else:
                    yield _event("content_block_stop", index=ev.index)
            if c.finish_reason is not None:
                reason, sequence = stop_reason(c.finish_reason, c.stop_reason, req.stop_sequences, bool(parser.tool_calls))
                yield _event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                             usage=_usage(prompt_tokens, len(c.token_ids), out.num_cached_tokens))  # fmt: skip
                yield _event("message_stop")
    except Exception as exc:  # noqa: BLE001 - reported to the client in the stream
        error = _as_api_error(exc)
        yield _event("error", error=error_body(error.status, error.message)["error"])
