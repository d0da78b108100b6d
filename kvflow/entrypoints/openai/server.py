"""OpenAI-compatible HTTP server (FastAPI + uvicorn): ``kvflow serve``.

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (SSE streaming
with ``stream: true``), GET /health, GET /metrics (Prometheus); the web UI (``/``,
``/dashboard`` and their endpoints, ``kvflow/entrypoints/web/routes.py``) and the API docs
(``/docs``, ``/redoc``) with their assets served from installed packages, not a CDN. Every
error, of every endpoint and middleware, is an OpenAI-shaped JSON body
``{"error": {"message", "type", "param", "code"}}``:

- 400 for invalid parameters, fields kvflow does not implement, and prompts that cannot fit
  (all decided before any byte of a stream is sent); bodies that are not valid Unicode
  (lone surrogates), hold non-finite numbers or nest deeper than ``MAX_JSON_DEPTH``.
- 401 for a wrong API key, 404 for an unknown model, 413 for a body over
  ``max_request_bytes`` (from its Content-Length, before reading it), 429 (with
  ``Retry-After``) when the waiting queue cannot take all of a request's prompts.
- 400 or 500 for a request the engine failed alone (its fault, or an internal one); 503
  once the engine has stopped; 500 for any other fault.

In a stream, such a failure comes as a last ``data: {"error": ...}`` event before
``data: [DONE]``. A client that disconnects has its request aborted and its KV blocks freed.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi_offline import FastAPIOffline
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvflow.engine.async_engine import AsyncLLMEngine, EngineDeadError, QueueFullError, RequestFailedError
from kvflow.entrypoints.openai.errors import _ERROR_TYPES, APIError, _error_body, error_response  # noqa: F401
from kvflow.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from kvflow.outputs import RequestOutput
from kvflow.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 10 * 2**20
MAX_JSON_DEPTH = 64
RETRY_AFTER_S = 1

def _bad_request(exc: ValueError) -> APIError:
    message = str(exc)
    param = message.split(" ", 1)[0] if message and message.split(" ", 1)[0].isidentifier() else None
    return APIError(400, message, "BadRequestError", param)


def _as_api_error(exc: BaseException) -> APIError:
    """The API error for a fault after admission (or any other)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestFailedError):
        if exc.failure.is_invalid_request:
            return APIError(400, f"the request failed: {exc.failure.message}", "BadRequestError")
        return APIError(500, f"the request failed inside the engine: {exc.failure.message}", "InternalServerError")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), "ServiceUnavailableError")
    logger.error("internal error: %s: %s", type(exc).__name__, exc, exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", "InternalServerError")


# ---------------------------------------------------------------------------- request bodies
def _path(path: tuple[str | int, ...]) -> str:
    """``messages[0].content``; a deep path keeps its first 4 and last 2 steps."""
    if len(path) > 8:
        return f"{_path(path[:4])}...{_path(path[-2:])}"
    out = ""
    for key in path:
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else str(key))
    return out or "body"


def _body_error(path: tuple[str | int, ...], problem: str) -> APIError:
    param = path[0] if path and isinstance(path[0], str) else None
    return APIError(400, f"{_path(path)} {problem}", "BadRequestError", param)


def _check_string(value: str, path: tuple[str | int, ...]) -> None:
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            bad = value[exc.start]
            raise _body_error(path, f"holds a lone surrogate ({bad!r}); the text is not valid Unicode") from None


def check_json(value: Any) -> None:
    """Refuse a parsed body that no field could use.

    Raises:
        APIError: 400 naming the field, for a string with a lone surrogate (``"\\ud800"`` is
            valid JSON but not Unicode: the tokenizer and the response encoder fail on it),
            a number that is not finite (``NaN``, ``Infinity``, ``1e999``), or nesting
            deeper than ``MAX_JSON_DEPTH`` levels.
    """
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(value, ())]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            _check_string(item, path)
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise _body_error(path, f"must be a finite number, got {item}")
        elif isinstance(item, (dict, list)):
            if len(path) >= MAX_JSON_DEPTH:
                raise _body_error(path, f"is nested more than {MAX_JSON_DEPTH} levels deep")
            children = item.items() if isinstance(item, dict) else enumerate(item)
            for key, child in children:
                if isinstance(key, str):
                    _check_string(key, (*path, key))
                if isinstance(child, (str, float, dict, list)):
                    stack.append((child, (*path, key)))


def parse_body(body: bytes) -> Any:
    """The JSON value of a request body, checked by ``check_json``.

    Raises:
        json.JSONDecodeError: for text that is not JSON (FastAPI answers 400).
        APIError: 400 for a body that is not UTF-8, nests too deeply for the parser, or
            fails ``check_json``.
    """
    try:
        value = json.loads(body)
    except RecursionError:
        raise APIError(400, f"the body is nested more than {MAX_JSON_DEPTH} levels deep", "BadRequestError") from None
    except UnicodeDecodeError:
        raise APIError(400, "the body is not UTF-8 encoded JSON", "BadRequestError") from None
    check_json(value)
    return value


class _CheckedBodyRequest(Request):
    """A request whose JSON body is parsed (off the loop) and checked by ``parse_body``."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            self._json = await asyncio.get_running_loop().run_in_executor(None, parse_body, body)
        return self._json


class _CheckedBodyRoute(APIRoute):
    """Routes whose bodies go through ``parse_body``, and whose faults become API errors
    here (answered by the exception handlers, not re-raised to the server)."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(_CheckedBodyRequest(request.scope, request.receive))
            except (StarletteHTTPException, RequestValidationError):
                raise
            except Exception as exc:  # noqa: BLE001 - an OpenAI-shaped 500, logged
                raise _as_api_error(exc) from exc

        return route


class _BodyTooLarge(StarletteHTTPException):
    def __init__(self) -> None:
        super().__init__(413, "Content Too Large")


class _BodyLimitMiddleware:
    """413 for a request body over ``max_bytes``: at once from its Content-Length, before a
    byte of it is read; for a chunked body, once its bytes pass the limit (raised from
    ``receive`` as an HTTPException, which FastAPI's body reading lets through to the
    handler). Both answers are OpenAI-shaped with ``Connection: close``.

    (Starlette's own ``RequestBodyLimitMiddleware`` replaces every over-limit response with
    a text/plain one, hence this.)
    """

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await _too_large(self.max_bytes)(scope, receive, send)
            return
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge()
            return message

        await self.app(scope, limited_receive, send)


def _too_large(max_bytes: int) -> JSONResponse:
    return error_response(413, f"the request body exceeds the limit of {max_bytes} bytes", "RequestTooLargeError",
                          headers={"Connection": "close"})  # the rest of the body is not read


# ---------------------------------------------------------------------------- helpers
def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


async def _guard_stream(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Forward an SSE stream; a fault ends it with an error event and ``[DONE]``."""
    try:
        async for event in events:
            yield event
    except Exception as exc:  # noqa: BLE001 - reported to the client in the stream
        yield _sse(_as_api_error(exc).body())
        yield _sse("[DONE]")


async def _merge(iterators: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several output streams, tagging each item with its stream index."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, it: AsyncIterator[RequestOutput]) -> None:
        try:
            async for item in it:
                await queue.put((i, item))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
            await queue.put((i, exc))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(iterators)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        for it in iterators:
            # One that its pump is still awaiting is closed (and its request aborted) by the
            # pump's cancellation; aclose() on it would raise "already running".
            if not getattr(it, "ag_running", False):
                await it.aclose()


class OpenAIServing:
    """Request handling shared by the endpoints.

    Args:
        engine: the started async engine.
        model_name: the served model id (``/v1/models``, the ``model`` field).
        max_model_len: context limit in tokens.
        model_aliases: other ``model`` values accepted for it (e.g. the ``--model`` path).
    """

    def __init__(self, engine: AsyncLLMEngine, model_name: str, max_model_len: int,
                 model_aliases: tuple[str, ...] = ()) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = model_name
        self.model_names = {model_name, *model_aliases}
        self.max_model_len = max_model_len
        self.defaults = dict(engine.engine.generation_defaults)
        kv = engine.engine.kv_cache_manager
        # Tokens one sequence can ever hold: the default max_tokens must fit the KV cache too.
        self.max_seq_tokens = min(max_model_len, kv.num_total_blocks * kv.block_size)

    # ------------------------------------------------------------------ helpers
    def check_request(self, req: CompletionRequest | ChatCompletionRequest) -> None:
        """The model exists and every field set is one kvflow implements.

        Raises:
            APIError: 404 for an unknown model, 400 naming an unsupported field.
        """
        if req.model is not None and req.model not in self.model_names:
            raise APIError(404, f"The model `{req.model}` does not exist.", "NotFoundError", "model")
        unsupported = req.unsupported_field()
        if unsupported is not None:
            raise APIError(400, unsupported[1], "BadRequestError", unsupported[0])

    def _max_tokens(self, requested: int | None, prompt_len: int, field: str) -> int:
        """``requested``, checked against the context; for an unset one, what is left of the
        context (capped by the model's generation-config ``max_tokens``)."""
        if requested is None:
            left = max(self.max_seq_tokens - prompt_len, 1)
            return min(left, self.defaults.get("max_tokens", left))
        if requested < 1:
            raise APIError(400, f"{field} must be at least 1, got {requested}", "BadRequestError", field)
        if prompt_len + requested > self.max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{prompt_len + requested} tokens ({prompt_len} in the messages, {requested} in the completion).",
                "BadRequestError",
                field,
            )
        return requested

    def _params(self, req, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None) -> SamplingParams:
        try:
            return req.sampling_params(max_tokens, logprobs, prompt_logprobs, self.defaults)
        except ValueError as exc:
            raise _bad_request(exc) from None

    async def _add(self, prompts: list[tuple[list[int], str | None]], params: SamplingParams,
                   prompt_field: str) -> list[AsyncIterator[RequestOutput]]:
        """Prepare every prompt off the loop, then queue them all or none.

        Raises:
            APIError: 400 for a prompt or parameters the engine refuses (a prompt's fault
                names ``prompt_field``), 429 when the queue cannot take them all, 503 once
                the engine has stopped.
        """
        engine = self.engine.engine
        try:
            prepared = await self.engine.run_off_loop(lambda: [engine.prepare_request(ids, params) for ids, _ in prompts])
        except ValueError as exc:
            error = _bad_request(exc)
            if error.param in ("prompt", "prompt_token_ids"):
                error.param = prompt_field
            raise error from None
        request_id = uuid.uuid4().hex
        try:
            return self.engine.add_requests(
                [(f"{request_id}-{i}", p, text) for i, (p, (_, text)) in enumerate(zip(prepared, prompts))]
            )
        except QueueFullError as exc:
            raise APIError(429, str(exc), "RateLimitError", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), "ServiceUnavailableError") from None

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    # ------------------------------------------------------------------ completions
    def _completion_prompts(self, req: CompletionRequest) -> list[tuple[list[int], str | None]]:
        p = req.prompt
        if isinstance(p, str):
            return [(self.tokenizer.encode(p), p)]
        if not p:
            raise APIError(400, "prompt must not be empty", "BadRequestError", "prompt")
        if all(isinstance(x, int) for x in p):
            return [(list(p), None)]
        if all(isinstance(x, str) for x in p):
            return [(self.tokenizer.encode(x), x) for x in p]
        return [(list(x), None) for x in p]

    def _completion_logprobs(self, token_ids: list[int], entries: list[dict[int, float] | None], offset: int) -> dict[str, Any]:
        tokens, token_logprobs, top, offsets = [], [], [], []
        for tok, entry in zip(token_ids, entries):
            text = self._token_text(tok)
            tokens.append(text)
            token_logprobs.append(None if entry is None else entry[tok])
            top.append(None if entry is None else {self._token_text(t): lp for t, lp in entry.items()})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    async def create_completion(self, req: CompletionRequest, raw: Request) -> Response:
        self.check_request(req)
        prompts = await self.engine.run_off_loop(self._completion_prompts, req)
        if "max_tokens" in req.model_fields_set:
            requested = req.max_tokens  # null: what is left of the context
        else:  # the model's generation-config default, else OpenAI's 16
            requested = None if "max_tokens" in self.defaults else 16
        max_tokens = max(self._max_tokens(requested, len(ids), "max_tokens") for ids, _ in prompts)
        prompt_logprobs = req.logprobs if (req.echo and req.logprobs is not None) else None
        params = self._params(req, max_tokens, req.logprobs, prompt_logprobs)
        iterators = await self._add(prompts, params, "prompt")
        created, cid = int(time.time()), f"cmpl-{uuid.uuid4().hex}"
        n = params.n
        if req.stream:
            return StreamingResponse(
                _guard_stream(self._stream_completion(iterators, prompts, req, cid, created, n)),
                media_type="text/event-stream",
            )
        finals = await self._collect(iterators, raw)
        choices = []
        completion_tokens = 0
        for p_idx, (out, (ids, text)) in enumerate(zip(finals, prompts)):
            prompt_text = text if text is not None else self.tokenizer.decode(ids)
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                choice: dict[str, Any] = {
                    "index": p_idx * n + c.index,
                    "text": (prompt_text if req.echo else "") + c.text,
                    "finish_reason": c.finish_reason,
                }
                if c.stop_reason is not None:
                    choice["stop_reason"] = c.stop_reason
                if req.logprobs is not None:
                    tokens, entries = list(c.token_ids), list(c.logprobs or [])
                    if req.echo:
                        tokens, entries = ids + tokens, [None, *(out.prompt_logprobs or [])] + entries
                    choice["logprobs"] = self._completion_logprobs(tokens, entries, 0)
                choices.append(choice)
        prompt_tokens = sum(len(ids) for ids, _ in prompts)
        return JSONResponse(
            {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": choices,
                "usage": _usage(prompt_tokens, completion_tokens),
            }
        )

    async def _stream_completion(self, iterators, prompts, req: CompletionRequest, cid: str, created: int, n: int):
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        completion_tokens = 0
        base = {"id": cid, "object": "text_completion", "created": created, "model": self.model_name}
        async for p_idx, out in _merge(iterators):
            for c in out.outputs:
                index = p_idx * n + c.index
                start_text, start_tok = sent_text.get(index, 0), sent_tokens.get(index, 0)
                delta = c.text[start_text:]
                new_tokens = c.token_ids[start_tok:]
                if not delta and not new_tokens and c.finish_reason is None:
                    continue
                if req.echo and index not in sent_tokens:
                    ids, text = prompts[p_idx]
                    delta = (text if text is not None else self.tokenizer.decode(ids)) + delta
                choice: dict[str, Any] = {"index": index, "text": delta}
                if req.logprobs is not None and new_tokens:
                    entries = (c.logprobs or [])[start_tok:]
                    choice["logprobs"] = self._completion_logprobs(new_tokens, entries, start_text)
                if c.finish_reason is not None:
                    choice["finish_reason"] = c.finish_reason
                    if c.stop_reason is not None:
                        choice["stop_reason"] = c.stop_reason
                sent_text[index], sent_tokens[index] = len(c.text), len(c.token_ids)
                if c.finish_reason is not None:
                    completion_tokens += len(c.token_ids)
                yield _sse({**base, "choices": [choice]})
        if req.stream_options is not None and req.stream_options.include_usage:
            prompt_tokens = sum(len(ids) for ids, _ in prompts)
            yield _sse({**base, "choices": [], "usage": _usage(prompt_tokens, completion_tokens)})
        yield _sse("[DONE]")

    # ------------------------------------------------------------------ chat
    def _chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        messages = [m.template_dict() for m in req.messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - template errors are the client's messages
            raise APIError(400, f"messages could not be rendered with the chat template: {exc}", "BadRequestError", "messages") from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _chat_logprobs(self, token_ids: list[int], entries: list[dict[int, float]], top_k: int) -> dict[str, Any]:
        content = []
        for tok, entry in zip(token_ids, entries):
            text = self._token_text(tok)
            top = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:top_k]
            content.append(
                {
                    "token": text,
                    "logprob": entry[tok],
                    "bytes": list(text.encode("utf-8")),
                    "top_logprobs": [
                        {"token": self._token_text(t), "logprob": lp, "bytes": list(self._token_text(t).encode("utf-8"))}
                        for t, lp in top
                    ],
                }
            )
        return {"content": content}

    async def create_chat_completion(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self.check_request(req)
        ids = await self.engine.run_off_loop(self._chat_prompt, req)
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = self._max_tokens(requested, len(ids), field)
        top_k = req.top_logprobs or 0
        params = self._params(req, max_tokens, top_k if req.logprobs else None)
        (iterator,) = await self._add([(ids, None)], params, "messages")
        created, cid = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
        if req.stream:
            return StreamingResponse(
                _guard_stream(self._stream_chat(iterator, len(ids), req, cid, created)), media_type="text/event-stream"
            )
        (out,) = await self._collect([iterator], raw)
        choices = []
        for c in out.outputs:
            choice: dict[str, Any] = {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "finish_reason": c.finish_reason,
            }
            if c.stop_reason is not None:
                choice["stop_reason"] = c.stop_reason
            if req.logprobs:
                choice["logprobs"] = self._chat_logprobs(c.token_ids, c.logprobs or [], top_k)
            choices.append(choice)
        return JSONResponse(
            {
                "id": cid,
                "object": "chat.completion",
                "created": created,
                "model": self.model_name,
                "choices": choices,
                "usage": _usage(len(ids), sum(len(c.token_ids) for c in out.outputs)),
            }
        )

    async def _stream_chat(self, iterator, prompt_tokens: int, req: ChatCompletionRequest, cid: str, created: int):
        base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": self.model_name}
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        completion_tokens = 0
        for i in range(req.n):
            yield _sse({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}}]})
        async for _, out in _merge([iterator]):
            for c in out.outputs:
                start_text, start_tok = sent_text.get(c.index, 0), sent_tokens.get(c.index, 0)
                delta, new_tokens = c.text[start_text:], c.token_ids[start_tok:]
                if not delta and not new_tokens and c.finish_reason is None:
                    continue
                choice: dict[str, Any] = {"index": c.index, "delta": {"content": delta} if delta else {}}
                if req.logprobs and new_tokens:
                    choice["logprobs"] = self._chat_logprobs(new_tokens, (c.logprobs or [])[start_tok:], req.top_logprobs or 0)
                if c.finish_reason is not None:
                    choice["finish_reason"] = c.finish_reason
                    if c.stop_reason is not None:
                        choice["stop_reason"] = c.stop_reason
                    completion_tokens += len(c.token_ids)
                sent_text[c.index], sent_tokens[c.index] = len(c.text), len(c.token_ids)
                yield _sse({**base, "choices": [choice]})
        if req.stream_options is not None and req.stream_options.include_usage:
            yield _sse({**base, "choices": [], "usage": _usage(prompt_tokens, completion_tokens)})
        yield _sse("[DONE]")

    # ------------------------------------------------------------------ non-streaming
    async def _collect(self, iterators: list[AsyncIterator[RequestOutput]], raw: Request) -> list[RequestOutput]:
        """Final outputs of every iterator; aborts them all if the client disconnects.

        Raises:
            APIError: for a request the engine failed (400 / 500) or a stopped engine (503).
        """
        finals: list[RequestOutput | None] = [None] * len(iterators)

        async def consume() -> None:
            async for i, out in _merge(iterators):
                finals[i] = out

        task = asyncio.create_task(consume())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=0.2)
                if not task.done() and await raw.is_disconnected():
                    task.cancel()
                    raise APIError(499, "client disconnected", "ClientDisconnected")
            task.result()
        except (RequestFailedError, EngineDeadError) as exc:
            raise _as_api_error(exc) from None
        finally:
            if not task.done():
                task.cancel()
        return finals  # type: ignore[return-value]


class _APIKeyMiddleware:
    """401 for requests without ``Authorization: Bearer <api_key>``, except on ``open_paths``.

    A plain ASGI middleware: ``@app.middleware("http")`` (BaseHTTPMiddleware) wraps
    ``receive`` so that ``Request.is_disconnected()`` never turns true, and a non-streaming
    request whose client went away would then run to its end.
    """

    def __init__(self, app, api_key: str, open_paths: frozenset[str]) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.open_paths = open_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                await error_response(401, "Invalid or missing API key.", "AuthenticationError")(scope, receive, send)
                return
        await self.app(scope, receive, send)


def default_served_name(model: str) -> str:
    """The model id the API shows for ``--model``: a short name as given, a path as its file
    stem or folder name (the absolute path is never echoed)."""
    from pathlib import Path

    from kvflow.model import packages

    if model in packages.REGISTRY:
        return model
    path = Path(model)
    return (path.stem if path.suffix == ".gguf" else path.name) or model


def make_server(
    app: FastAPI,
    host: str,
    port: int,
    log_level: str = "info",
    timeout_keep_alive: float = 5.0,
    request_read_timeout: float = 30.0,
):
    """A ``uvicorn.Server`` for ``app`` whose connections close when idle for
    ``timeout_keep_alive`` seconds between requests, or when a request (headers and body)
    has not arrived within ``request_read_timeout`` seconds (``TimedH11Protocol``)."""
    import uvicorn

    from kvflow.entrypoints.openai.http_timeouts import TimedH11Protocol

    if not timeout_keep_alive > 0:
        raise ValueError(f"timeout_keep_alive must be > 0 seconds, got {timeout_keep_alive}")
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_keep_alive=timeout_keep_alive,
        http=TimedH11Protocol.with_timeout(request_read_timeout),
    )  # fmt: skip
    return uvicorn.Server(config)


def build_app(
    engine: AsyncLLMEngine,
    model_name: str,
    max_model_len: int,
    api_key: str | None = None,
    *,
    metrics_need_key: bool = True,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    model_aliases: tuple[str, ...] = (),
) -> FastAPI:
    """The FastAPI application over a (not yet started) async engine.

    Args:
        engine: the async engine; the app's lifespan starts and stops it.
        model_name: the served model id.
        max_model_len: context limit in tokens.
        api_key: when set, every path but /health and the web pages' files needs
            ``Authorization: Bearer <key>`` (/metrics and the dashboard's snapshot stream
            too, unless ``metrics_need_key`` is False).
        metrics_need_key: see ``api_key``.
        max_request_bytes: larger bodies get 413, decided from Content-Length before the
            body is read (and by counting the bytes of a chunked body).
        model_aliases: other ``model`` values accepted for the served model.
    """
    if not isinstance(max_request_bytes, int) or max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be a positive integer, got {max_request_bytes!r}")
    serving = OpenAIServing(engine, model_name, max_model_len, model_aliases)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.shutdown()

    from kvflow.entrypoints import web

    # FastAPIOffline: /docs and /redoc load Swagger UI's and ReDoc's files from the
    # fastapi-offline package, not from a CDN (no online validator badge either).
    app = FastAPIOffline(title="kvflow", version="0.1.0", lifespan=lifespan, static_url="/docs-assets",
                         swagger_ui_parameters={"validatorUrl": None})
    app.router.route_class = _CheckedBodyRoute
    if api_key is not None:
        open_paths = {"/health", *web.PUBLIC_PATHS}
        if not metrics_need_key:
            open_paths |= {"/metrics", *web.METRICS_PATHS}
        app.add_middleware(_APIKeyMiddleware, api_key=api_key, open_paths=frozenset(open_paths))
    app.add_middleware(_BodyLimitMiddleware, max_bytes=max_request_bytes)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", []) if x != "body"]
        message = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', []) if x != 'body') or 'body'}: {e.get('msg')}"
                            for e in errors)
        return error_response(400, message or "invalid request", "BadRequestError", loc[0] if loc else None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        if exc.status_code == 413:
            return _too_large(max_request_bytes)
        err_type = _ERROR_TYPES.get(exc.status_code, "BadRequestError")
        return error_response(exc.status_code, str(exc.detail), err_type, headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception):
        return _as_api_error(exc).response()

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_healthy:
            return error_response(503, f"the engine has stopped: {engine.error!r}", "ServiceUnavailableError")
        return PlainTextResponse("ok")

    @app.get("/metrics")
    async def metrics() -> Response:
        engine.refresh_gauges()
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "kvflow", "max_model_len": max_model_len}],
        }

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await serving.create_completion(req, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await serving.create_chat_completion(req, raw)

    web.register(app, engine)
    return app
