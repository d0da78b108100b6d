"""OpenAI-compatible HTTP server (FastAPI + uvicorn): ``kvflow serve``.

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (SSE streaming
with ``stream: true``), GET /health, GET /metrics (Prometheus). Errors use the OpenAI body
``{"error": {"message", "type", "param", "code"}}``: 400 for invalid parameters and prompts
that cannot fit (decided before any byte of a stream is sent), 401 for a wrong API key, 404
for an unknown model, 429 when the waiting queue is full. A client that disconnects has its
request aborted and its KV blocks freed.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvflow.engine.async_engine import AsyncLLMEngine, EngineDeadError, QueueFullError
from kvflow.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from kvflow.outputs import RequestOutput
from kvflow.sampling_params import SamplingParams


class APIError(Exception):
    """An error to return as an OpenAI-shaped body."""

    def __init__(self, status: int, message: str, err_type: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.err_type, self.param = status, message, err_type, param

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.err_type, self.param)


def error_response(status: int, message: str, err_type: str, param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": err_type, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


def _bad_request(exc: ValueError) -> APIError:
    message = str(exc)
    param = message.split(" ", 1)[0] if message and message.split(" ", 1)[0].isidentifier() else None
    return APIError(400, message, "BadRequestError", param)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


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
    """

    def __init__(self, engine: AsyncLLMEngine, model_name: str, max_model_len: int) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        kv = engine.engine.kv_cache_manager
        # Tokens one sequence can ever hold: the default max_tokens must fit the KV cache too.
        self.max_seq_tokens = min(max_model_len, kv.num_total_blocks * kv.block_size)

    # ------------------------------------------------------------------ helpers
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")

    def _max_tokens(self, requested: int | None, prompt_len: int, field: str) -> int:
        if requested is None:
            return max(self.max_seq_tokens - prompt_len, 1)
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

    def _add(self, prompts: list[tuple[list[int], str | None]], params: list[SamplingParams]) -> list[AsyncIterator[RequestOutput]]:
        """Validate every prompt, then queue them all (nothing is queued if one is invalid)."""
        try:
            for ids, _ in prompts:
                self.engine.engine.validate_prompt(ids, params[0])
            request_id = uuid.uuid4().hex
            return [
                self.engine.add_request(f"{request_id}-{i}", ids, p, prompt=text)
                for i, ((ids, text), p) in enumerate(zip(prompts, params))
            ]
        except ValueError as exc:
            raise _bad_request(exc) from None
        except QueueFullError as exc:
            raise APIError(429, str(exc), "RateLimitError") from None
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
        self.check_model(req.model)
        prompts = self._completion_prompts(req)
        max_tokens = max(self._max_tokens(req.max_tokens, len(ids), "max_tokens") for ids, _ in prompts)
        try:
            prompt_logprobs = req.logprobs if (req.echo and req.logprobs is not None) else None
            params = req.sampling_params(max_tokens, req.logprobs, prompt_logprobs)
        except ValueError as exc:
            raise _bad_request(exc) from None
        iterators = self._add(prompts, [params] * len(prompts))
        created, cid = int(time.time()), f"cmpl-{uuid.uuid4().hex}"
        n = params.n
        if req.stream:
            return StreamingResponse(
                self._stream_completion(iterators, prompts, req, cid, created, n), media_type="text/event-stream"
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
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages]
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
        self.check_model(req.model)
        ids = self._chat_prompt(req)
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = self._max_tokens(requested, len(ids), field)
        top_k = req.top_logprobs or 0
        try:
            params = req.sampling_params(max_tokens, top_k if req.logprobs else None)
        except ValueError as exc:
            raise _bad_request(exc) from None
        (iterator,) = self._add([(ids, None)], [params])
        created, cid = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
        if req.stream:
            return StreamingResponse(self._stream_chat(iterator, len(ids), req, cid, created), media_type="text/event-stream")
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
        """Final outputs of every iterator; aborts them all if the client disconnects."""
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
        except EngineDeadError as exc:
            raise APIError(503, str(exc), "ServiceUnavailableError") from None
        finally:
            if not task.done():
                task.cancel()
        return finals  # type: ignore[return-value]


class _APIKeyMiddleware:
    """401 for /v1 requests without ``Authorization: Bearer <api_key>``.

    A plain ASGI middleware: ``@app.middleware("http")`` (BaseHTTPMiddleware) wraps
    ``receive`` so that ``Request.is_disconnected()`` never turns true, and a non-streaming
    request whose client went away would then run to its end.
    """

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                await error_response(401, "Invalid or missing API key.", "AuthenticationError")(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: AsyncLLMEngine, model_name: str, max_model_len: int, api_key: str | None = None) -> FastAPI:
    """The FastAPI application over a (not yet started) async engine."""
    serving = OpenAIServing(engine, model_name, max_model_len)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="kvflow", version="0.1.0", lifespan=lifespan)
    if api_key is not None:
        app.add_middleware(_APIKeyMiddleware, api_key=api_key)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", []) if x != "body"]
        message = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', []) if x != 'body')}: {e.get('msg')}" for e in errors)
        return error_response(400, message or "invalid request", "BadRequestError", loc[0] if loc else None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        err_type = {404: "NotFoundError", 405: "MethodNotAllowed"}.get(exc.status_code, "BadRequestError")
        return error_response(exc.status_code, str(exc.detail), err_type)

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_healthy:
            return error_response(503, "engine is not running", "ServiceUnavailableError")
        return PlainTextResponse("ok")

    @app.get("/metrics")
    async def metrics() -> Response:
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

    return app
