"""OpenAI-compatible HTTP server (FastAPI + uvicorn): ``kvflow serve``.

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (SSE streaming
with ``stream: true``; tools and reasoning: ``tools.py``, ``tool_parsers``, ``reasoning.py``),
POST /v1/responses (``serving_responses.py``), POST /v1/messages (Anthropic's Messages API:
``kvflow.entrypoints.anthropic``), GET /health, GET /metrics (Prometheus); the web UI (``/``,
``/dashboard`` and their endpoints, ``kvflow/entrypoints/web/routes.py``) and the API docs
(``/docs``, ``/redoc``) with their assets served from installed packages, not a CDN. Every
error, of every endpoint and middleware, is an OpenAI-shaped JSON body
``{"error": {"message", "type", "param", "code"}}`` (on /v1/messages: Anthropic's shape):

- 400 for invalid parameters, fields kvflow does not implement, and prompts that cannot fit
  (all decided before any byte of a stream is sent); bodies that are not valid Unicode
  (lone surrogates), hold non-finite numbers or nest deeper than ``MAX_JSON_DEPTH``, or are
  not sent as JSON (``check_json_content_type``; on ``POST /flush_cache``, which reads no
  body, a body sent anyway: ``check_bodiless_post``).
- 403 for a browser's cross-site request to ``POST /flush_cache`` (``check_bodiless_post``).
- 415 for a body sent with a ``Content-Encoding`` other than ``identity`` (gzip, ...): it is
  not decoded, and is refused rather than read as if it were plain JSON
  (``check_content_encoding``).
- 401 for a wrong API key, 404 for an unknown model, 413 for a body over
  ``max_request_bytes`` (from its Content-Length, before reading it), 429 (with
  ``Retry-After``) when the waiting queue cannot take all of a request's prompts now (400
  when they outnumber ``max_queue_len``: they never could).
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
from collections.abc import Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi_offline import FastAPIOffline
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvflow import envs
from kvflow.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from kvflow.entrypoints.anthropic.serving import PATH as ANTHROPIC_PATH
from kvflow.entrypoints.anthropic.serving import AnthropicErrorMiddleware, count_tokens, create_message
from kvflow.engine.async_engine import AsyncLLMEngine
from kvflow.entrypoints.openai.errors import _ERROR_TYPES, APIError, error_response, validation_message
from kvflow.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, LoadLoRAAdapterRequest,
                                                UnloadLoRAAdapterRequest)
from kvflow.entrypoints.openai.serving_responses import ResponsesRequest, create_response
from kvflow.entrypoints.openai.serving import OpenAIServing, _as_api_error
from kvflow.utils import freeze_gc_heap, unfreeze_gc_heap

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 10 * 2**20
MAX_JSON_DEPTH = 64


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


def is_json_content_type(value: str | None) -> bool:
    """True for ``application/json`` (with any parameters, e.g. ``; charset=utf-8``) and
    ``application/*+json``."""
    media = (value or "").split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def check_json_content_type(value: str | None) -> None:
    """Refuse a request body not declared as JSON.

    A body sent as ``text/plain``, a form or with no Content-Type is refused even when it
    holds valid JSON, as vLLM and FastAPI do: those are what a web page of another origin
    can send to a server on this machine without the browser asking first (CORS
    preflight), so taking them would let any page drive the API.

    Raises:
        APIError: 400 saying that the body must be JSON sent as ``application/json``.
    """
    if not is_json_content_type(value):
        got = f"Content-Type: {value}" if value else "no Content-Type"
        raise APIError(400, f"the request body must be JSON sent with Content-Type: application/json (got {got})",
                       "BadRequestError")


def check_content_encoding(values: list[str]) -> None:
    """Refuse a request body sent compressed (or otherwise encoded).

    ``values`` are the request's Content-Encoding headers; none, or only ``identity``, is a
    plain body. kvflow does not decode request bodies, so an encoded one would otherwise be
    read as if it were the JSON text.

    Raises:
        APIError: 415 naming the Content-Encoding.
    """
    codings = [c.strip() for value in values for c in value.split(",") if c.strip()]
    refused = [c for c in codings if c.lower() != "identity"]
    if refused:
        raise APIError(415, f"Content-Encoding: {', '.join(refused)} is not supported: send the request body "
                       "uncompressed (no Content-Encoding, or identity)", "UnsupportedMediaTypeError")


def check_bodiless_post(headers: Any) -> None:
    """Refuse what a web page of another origin could send to a POST route that reads no body
    (``/flush_cache``; the cache-aware routers call it with an empty body): a body sent anyway
    must pass ``check_content_encoding`` and ``check_json_content_type``, as on every other
    POST route; and a browser's cross-site request (``Sec-Fetch-Site: cross-site`` or
    ``same-site``, which browsers send) is refused, since an empty POST needs no CORS
    preflight either.

    Raises:
        APIError: 415 / 400 as those two checks, for a body that is encoded or not declared
            JSON; 403 for a browser request from another site.
    """
    length = headers.get("content-length")
    if headers.get("content-type") is not None or headers.get("transfer-encoding") or length not in (None, "0"):
        check_content_encoding(headers.getlist("content-encoding"))
        check_json_content_type(headers.get("content-type"))
    site = (headers.get("sec-fetch-site") or "").strip().lower()
    if site in ("cross-site", "same-site"):
        raise APIError(403, f"a web page of another origin may not call this endpoint (Sec-Fetch-Site: {site})",
                       "PermissionDeniedError")


class _CheckedBodyRoute(APIRoute):
    """Routes whose bodies go through ``parse_body`` (after ``check_content_encoding`` and
    ``check_json_content_type``; a POST route without a body: ``check_bodiless_post``),
    and whose faults become API errors here (answered by the exception handlers, not
    re-raised to the server)."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()
        takes_body = self.body_field is not None
        bodiless_post = not takes_body and "POST" in self.methods

        async def route(request: Request) -> Response:
            if takes_body:
                check_content_encoding(request.headers.getlist("content-encoding"))
                check_json_content_type(request.headers.get("content-type"))
            elif bodiless_post:
                check_bodiless_post(request.headers)
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
    byte of it is read (the body is then drained, up to ``DRAIN_BYTES``, before the
    connection closes); for a chunked body, once its bytes pass the limit (raised from
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
            await _answer_too_large(self.max_bytes, int(length), receive, send)
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


# A body over the limit but at most this size is read (and dropped) after the 413 is sent, so
# that a client that sends its whole body before reading the answer (urllib, requests) gets
# the 413 rather than a connection reset; a larger one is cut off. Slow senders are bounded
# by the server's read timeout.
DRAIN_BYTES = 64 * 2**20


async def _answer_too_large(max_bytes: int, length: int, receive, send) -> None:
    """Send the 413 at once, then (for a body up to ``DRAIN_BYTES``) read the body before
    ending the response, after which the connection is closed."""
    response = _too_large(max_bytes)
    await send({"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers})
    if length > DRAIN_BYTES:
        await send({"type": "http.response.body", "body": response.body})
        return
    await send({"type": "http.response.body", "body": response.body, "more_body": True})
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            break
    await send({"type": "http.response.body", "body": b""})


def _too_large(max_bytes: int) -> JSONResponse:
    return error_response(413, f"the request body exceeds the limit of {max_bytes} bytes", "RequestTooLargeError",
                          headers={"Connection": "close"})


# llama-server's paths of an endpoint kvflow serves under another path
_OTHER_SERVERS_PATHS = {
    "/completion": "/v1/completions", "/completions": "/v1/completions", "/chat/completions": "/v1/chat/completions",
    "/embedding": "/v1/embeddings", "/embeddings": "/v1/embeddings", "/models": "/v1/models",
}


def _no_route_message(method: str, path: str) -> str:
    """The 404 message of a path no route serves: the method and path (Starlette's said "Not
    Found"), and the path kvflow serves it under where another server's path is known."""
    shown = path if len(path) <= 100 else path[:97] + "..."
    message = f"{method} {shown} is not an endpoint of kvflow"
    alt = _OTHER_SERVERS_PATHS.get(path.rstrip("/") or "/")
    return f"{message}: send it to {alt}" if alt else f"{message} (the API paths are listed at /docs)"


class _TrailingSlashMiddleware:
    """``/v1/completions/`` is ``/v1/completions`` (and so for every API path), as in
    OpenAI's and vLLM's servers; Starlette would answer 307 to the path without the slash,
    which a client posting a body does not follow."""

    _ROOT_PATHS = frozenset({"/tokenize", "/detokenize", "/version", "/health", "/metrics"})

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and len(path) > 1 and path.endswith("/"):
            stripped = path.rstrip("/")
            if stripped.startswith("/v1/") or stripped in self._ROOT_PATHS:
                scope = {**scope, "path": stripped, "raw_path": stripped.encode()}
        await self.app(scope, receive, send)


class _HeadMiddleware:
    """``HEAD`` answers as ``GET`` does, without the body (RFC 9110, 9.3.2): the request runs
    as a GET and its status and headers (Content-Length included) are sent, then the
    response ends. A streamed response (the dashboard's event stream) is told that the
    client has gone (``http.disconnect``), which ends it. (FastAPI's GET routes take no
    HEAD, which Starlette's own routes do.)"""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return
        sent = False

        async def head_receive():
            return {"type": "http.disconnect"} if sent else await receive()

        async def head_send(message) -> None:
            nonlocal sent
            if sent or message["type"] != "http.response.start":
                return  # the body (a HEAD response has none)
            await send(message)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            sent = True

        await self.app({**scope, "method": "GET"}, head_receive, head_send)


# ---------------------------------------------------------------------------- helpers
class _APIKeyMiddleware:
    """401 for requests without ``Authorization: Bearer <api_key>`` (or, on /v1/messages,
    ``x-api-key: <api_key>``), except on ``open_paths``.

    A plain ASGI middleware: ``@app.middleware("http")`` (BaseHTTPMiddleware) wraps
    ``receive`` so that ``Request.is_disconnected()`` never turns true, and a non-streaming
    request whose client went away would then run to its end.
    """

    def __init__(self, app, api_keys: tuple[str, ...], open_paths: frozenset[str]) -> None:
        self.app = app
        self.expected = [f"Bearer {key}".encode() for key in api_keys]
        self.keys = [key.encode() for key in api_keys]
        self.open_paths = open_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            headers = dict(scope.get("headers") or [])
            sent = headers.get(b"authorization", b"")
            ok = any([hmac.compare_digest(sent, expected) for expected in self.expected])  # (each compared)
            if not ok and scope["path"].startswith(ANTHROPIC_PATH):  # Anthropic clients send x-api-key
                sent = headers.get(b"x-api-key", b"")
                ok = any([hmac.compare_digest(sent, key) for key in self.keys])
            if not ok:
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

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            # uvicorn waits for the open requests before the lifespan's shutdown: fail them
            # first (EngineShutdownError: a 503, or an error event in a stream), so that a
            # stop waits for the engine's step in progress, not for a long prompt to finish
            begin_shutdown = getattr(app.state, "begin_shutdown", None)
            if begin_shutdown is not None:
                begin_shutdown()
            await super().shutdown(sockets)

    return Server(config)


def build_app(
    engine: AsyncLLMEngine,
    model_name: str,
    max_model_len: int,
    api_key: str | Sequence[str] | None = None,
    *,
    metrics_need_key: bool = True,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    model_aliases: tuple[str, ...] = (),
    served_model_names: tuple[str, ...] = (),
    chat_template: str | None = None,
    tool_parser: str | None = None,
    reasoning_parser: str | None = None,
    lora_modules: dict[str, str] | None = None,
) -> FastAPI:
    """The FastAPI application over a (not yet started) async engine.

    Args:
        engine: the async engine; the app's lifespan starts and stops it.
        model_name: the served model id.
        max_model_len: context limit in tokens.
        api_key: when set (one key, or several as vLLM's ``--api-key a b``: any of them),
            every path but /health and the web pages' files needs
            ``Authorization: Bearer <key>`` (/metrics, /get_load and the dashboard's
            snapshot stream too, unless ``metrics_need_key`` is False).
        metrics_need_key: see ``api_key``.
        max_request_bytes: larger bodies get 413, decided from Content-Length before the
            body is read (and by counting the bytes of a chunked body).
        model_aliases: other ``model`` values accepted for the served model (e.g. the
            ``--model`` path), not listed by ``/v1/models``.
        served_model_names: the served model's other names (``--served-model-name a b``:
            ``("b",)``), accepted and listed by ``/v1/models`` as models of their own, as vLLM
            lists them; responses name ``model_name``.
        chat_template, tool_parser, reasoning_parser: see ``OpenAIServing``.
        lora_modules: adapter name -> PEFT folder, served as models of their own
            (``--lora-modules``; the engine needs ``enable_lora``).

    Raises:
        ValueError: for a bad ``max_request_bytes``, an empty or blank ``api_key``, tool parser or reasoning parser, or a
            LoRA adapter the engine refuses (naming it).
    """
    if not isinstance(max_request_bytes, int) or max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be a positive integer, got {max_request_bytes!r}")
    api_keys = None if api_key is None else (api_key,) if isinstance(api_key, str) else tuple(api_key)
    if api_keys is not None and (not api_keys or any(not isinstance(k, str) or not k.strip() for k in api_keys)):
        # "Bearer " and an absent x-api-key header would match an empty key.
        raise ValueError("api_key must not be empty or blank (None: no key)")
    served_model_names = tuple(n for n in dict.fromkeys(served_model_names) if n != model_name)
    serving = OpenAIServing(engine, model_name, max_model_len, (*model_aliases, *served_model_names), chat_template,
                            tool_parser, reasoning_parser)
    for name, path in (lora_modules or {}).items():
        serving.register_lora(name, path)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        # The server process's startup heap (torch, transformers, the model, the tokenizer,
        # the app) never becomes garbage: frozen, the collector's full collections stop
        # scanning it (KVFLOW_GC_FREEZE; kvflow.utils.freeze_gc_heap).
        frozen = bool(envs.read("KVFLOW_GC_FREEZE"))
        if frozen:
            freeze_gc_heap()
        yield
        await asyncio.to_thread(engine.shutdown)  # waits for the step in progress
        if frozen:
            unfreeze_gc_heap()

    from kvflow.entrypoints import web

    # FastAPIOffline: /docs and /redoc load Swagger UI's and ReDoc's files from the
    # fastapi-offline package, not from a CDN (no online validator badge either).
    app = FastAPIOffline(title="kvflow", version="0.1.0", lifespan=lifespan, static_url="/docs-assets",
                         swagger_ui_parameters={"validatorUrl": None})
    app.router.route_class = _CheckedBodyRoute
    app.state.begin_shutdown = engine.begin_shutdown  # make_server's Server calls it first
    if api_keys is not None:
        open_paths = {"/health", *web.PUBLIC_PATHS}
        if not metrics_need_key:
            # /get_load is a load metric too: the routers poll it without the key (vllm-router
            # 0.1.17 does not send its --api-key there), so power_of_two and /get_loads saw a
            # load of -1 for every worker (docs/scale-out.md)
            open_paths |= {"/metrics", "/get_load", *web.METRICS_PATHS}
        app.add_middleware(_APIKeyMiddleware, api_keys=api_keys, open_paths=frozenset(open_paths))
    app.add_middleware(_BodyLimitMiddleware, max_bytes=max_request_bytes)
    app.add_middleware(_TrailingSlashMiddleware)  # before the API key check sees the path
    app.add_middleware(AnthropicErrorMiddleware)  # sees the errors of the two above
    app.add_middleware(_HeadMiddleware)  # outermost: HEAD runs as GET through all of them

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError):
        message, param = validation_message(exc.errors())
        return error_response(400, message, "BadRequestError", param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 413:
            return _too_large(max_request_bytes)
        err_type = _ERROR_TYPES.get(exc.status_code, "BadRequestError")
        if exc.status_code == 404 and exc.detail == "Not Found":  # no route: name the path
            return error_response(404, _no_route_message(request.method, request.url.path), err_type)
        headers = exc.headers
        if exc.status_code == 405 and headers and "Allow" in headers:
            # a GET route takes HEAD too (_HeadMiddleware): the Allow of its 405 says so
            allow = [m.strip() for m in headers["Allow"].split(",") if m.strip()]
            if "GET" in allow and "HEAD" not in allow:
                headers = {**headers, "Allow": ", ".join([*allow, "HEAD"])}
        return error_response(exc.status_code, str(exc.detail), err_type, headers=headers)

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
        created = int(time.time())
        entry = {"object": "model", "created": created, "owned_by": "kvflow", "max_model_len": max_model_len}
        return {
            "object": "list",
            # Every served name is a model of its own, as in vLLM (``--served-model-name a b``).
            "data": [*({"id": name, **entry, "parent": None} for name in (model_name, *served_model_names)),
                     *({"id": name, **entry, "parent": model_name} for name in serving.lora_modules)],
        }

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:  # the OpenAI SDK's client.models.retrieve(id)
        cards = (await models())["data"]
        for card in cards:
            if card["id"] == model_id:
                return card
        if model_id in serving.model_names:  # another name requests may use (--served-model-name b, --model)
            return cards[0]
        raise APIError(404, f"The model `{model_id}` does not exist.", "NotFoundError", "model")

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoRAAdapterRequest) -> Response:
        await serving.load_lora_adapter(req.lora_name, req.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest) -> Response:
        await serving.unload_lora_adapter(req.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await serving.create_completion(req, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await serving.create_chat_completion(req, raw)

    @app.post("/v1/responses")
    async def responses(req: ResponsesRequest, raw: Request) -> Response:
        return await create_response(serving, req, raw)

    @app.post(ANTHROPIC_PATH)
    async def messages(req: MessagesRequest, raw: Request) -> Response:
        return await create_message(serving, req, raw)

    @app.post(ANTHROPIC_PATH + "/count_tokens")
    async def messages_count_tokens(req: CountTokensRequest) -> Response:
        return await count_tokens(serving, req)

    # vLLM's further endpoints, in their own modules (they import this one)
    from kvflow.entrypoints.openai import serving_embedding, serving_tokenization

    serving_embedding.attach_routes(app, serving)
    serving_tokenization.attach_routes(app, serving)
    _attach_router_routes(app, engine, model_name, max_model_len)
    web.register(app, engine)
    return app


def _attach_router_routes(app: FastAPI, engine: AsyncLLMEngine, model_name: str, max_model_len: int) -> None:
    """What cache-aware routers (``vllm-router``, ``sglang-router``) call on a worker beside
    /health, /v1/models and /metrics, answered from the engine's state (see
    docs/scale-out.md):

    - ``GET /get_load``: ``{"load": running + waiting requests, "num_reqs": running,
      "num_waiting_reqs": waiting, "num_tokens": KV slots in use (allocated blocks x
      block_size)}`` (the routers' power-of-two policy reads ``load``);
    - ``GET /get_server_info``: the engine's configuration and live counters;
    - ``GET /get_model_info``: ``{"model_path", "tokenizer_path", "is_generation"}``;
    - ``POST /flush_cache``: drop every cached prefix no request holds (vLLM's
      ``reset_prefix_cache``); 400 while running requests hold blocks (sglang's answer).
    """
    config = engine.engine.config

    def load() -> dict[str, int]:
        stats = engine.get_stats()
        used_blocks = stats["num_total_blocks"] - stats["num_free_blocks"]
        return {"load": stats["num_running"] + stats["num_waiting"], "num_reqs": stats["num_running"],
                "num_waiting_reqs": stats["num_waiting"], "num_tokens": used_blocks * config.cache.block_size}

    @app.get("/get_load")
    async def get_load() -> dict[str, int]:
        return load()

    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        return {
            "model_path": model_name, "served_model_name": model_name, "max_model_len": max_model_len,
            "block_size": config.cache.block_size, "num_gpu_blocks": config.cache.num_blocks,
            "enable_prefix_caching": config.cache.enable_prefix_caching,
            "max_num_seqs": config.scheduler.max_num_seqs,
            "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
            "tensor_parallel_size": config.parallel.tensor_parallel_size,
            "device": config.device.device.type, "dtype": str(config.device.dtype).removeprefix("torch."),
            **load(), "stats": engine.get_stats(),
        }  # fmt: skip

    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        return {"model_path": model_name, "tokenizer_path": model_name, "is_generation": True,
                "max_model_len": max_model_len}  # fmt: skip

    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        if not await engine.call_on_engine(engine.engine.reset_prefix_cache):
            return error_response(400, "the prefix cache was not flushed: running requests hold cached blocks",
                                  "BadRequestError")
        return PlainTextResponse("Cache flushed.")

