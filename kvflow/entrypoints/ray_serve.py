"""kvflow on Ray Serve: N engine replicas behind Ray Serve's prefix-affinity request router,
an OpenAI-compatible HTTP app in front (``pip install 'kvflow[ray]'``: ``ray[serve]``, not
``ray[llm]``, which pulls vLLM).

The layout is Ray Serve LLM's: an ingress deployment (``OpenAIIngress``, a FastAPI app on
Ray Serve's HTTP proxy) hands each request to a model deployment (``KVFlowServer``, one
kvflow engine per replica, like Ray's ``LLMServer``) through a deployment handle whose
request router is ``PrefixCacheAffinityRouter``: it keeps a prefix tree of the prompt text
each replica was sent and sends a request to the replica with the longest match while the
replicas' queues are balanced (power of two choices otherwise; Ray Serve's docs, "Prefix
aware routing"). The model deployment runs kvflow's own OpenAI app in process (all of
``kvflow serve``'s endpoints and checks, ``usage.prompt_tokens_details.cached_tokens``
included), so answers are exactly ``kvflow serve``'s; streaming responses stream through the
handle chunk by chunk.

Usage::

    import ray
    from ray import serve
    from kvflow.entrypoints.ray_serve import build_openai_app

    ray.init()                                   # or ray.init(address="auto") on a cluster
    serve.run(build_openai_app({"model": "smollm2-135m", "num_threads": 1},
                               min_replicas=2, max_replicas=4), route_prefix="/")
    # OpenAI clients use http://127.0.0.1:8000/v1

Multi-node: ``ray start --head`` on one machine, ``ray start --address=HEAD:6379`` on the
others, then the same script with ``ray.init(address="auto")`` (docs/scale-out.md).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig

# Ray Serve's prefix-aware router. Its public name, ray.serve.llm.request_router.
# PrefixCacheAffinityRouter (a documented subclass of this class, nothing added), is imported
# through ray.serve.llm, whose __init__ needs vLLM or SGLang; the class itself needs only
# ray[serve], so it is named by its defining module.
PREFIX_ROUTER = "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router.PrefixCacheAffinityRouter"
# The ingress forwards every request (method, path, query, headers, body) to the model
# deployment, whose kvflow app answers it with ``kvflow serve``'s routes and checks (its 404s
# and 405s included): the paths are listed once, in ``build_app``.
MAX_BODY_BYTES = 10 * 1024 * 1024
# hop-by-hop headers (RFC 9110, 7.6.1): about the connection to the ingress, not the request
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer",
                         "upgrade"})


class OpenAIRequest:
    """One HTTP request for the model deployment: method, path, headers (a dict, or a list
    of (name, value) pairs, which keeps repeated headers), body and query string.
    ``prompt`` / ``messages`` are what ``PrefixCacheAffinityRouter`` reads to route on (the
    prompt text, or the chat messages; the path for requests without either)."""

    def __init__(self, method: str, path: str, body: bytes, headers: dict[str, str] | list[tuple[str, str]],
                 query_string: str = "") -> None:
        self.method, self.path, self.body, self.query_string = method, path, body, query_string
        self.headers = list(headers.items()) if isinstance(headers, dict) else list(headers)
        parsed: Any = None
        if body:
            try:
                parsed = json.loads(body)
            except ValueError:
                parsed = None
        parsed = parsed if isinstance(parsed, dict) else {}
        if "messages" in parsed:  # chat, Anthropic messages
            system = parsed.get("system")
            self.messages = ([{"content": system}] if isinstance(system, str) else []) + list(parsed["messages"] or [])
        else:
            prompt = parsed.get("prompt", parsed.get("input", ""))
            # never empty: the router divides by the text's length (a GET routes on its path)
            self.prompt = prompt if isinstance(prompt, (str, list)) and prompt else path


async def _asgi_call(app, req: OpenAIRequest) -> AsyncIterator[dict[str, Any] | bytes]:
    """Run ``req`` through the ASGI ``app`` in this process: yields the response start
    (``{"status", "headers"}``, the headers a list of (name, value) pairs), then the body
    chunks as the app sends them."""
    queue: asyncio.Queue = asyncio.Queue()
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": req.body, "more_body": False}
        await asyncio.Event().wait()  # no disconnect while the handle is open
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await queue.put(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": req.method,
        "scheme": "http", "path": req.path, "raw_path": req.path.encode(),
        "query_string": getattr(req, "query_string", "").encode("latin-1"),
        "root_path": "", "server": ("127.0.0.1", 0), "client": ("127.0.0.1", 0),
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in req.headers],
    }  # fmt: skip
    task = asyncio.create_task(app(scope, receive, send))
    try:
        while True:
            getter = asyncio.create_task(queue.get())
            await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                task.result()  # raises the app's error, if any
                return
            message = getter.result()
            if message["type"] == "http.response.start":
                headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])]
                yield {"status": message["status"], "headers": headers}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    return
    finally:
        if not task.done():
            task.cancel()


class KVFlowServer:
    """The model deployment's class (Ray's ``LLMServer`` role): one kvflow engine and its
    OpenAI app per replica.

    Args:
        engine_kwargs: ``EngineArgs`` keyword arguments (``model``, ``num_threads``, ...).
        served_model_name: the model id clients send (default: as ``kvflow serve``).
        app_kwargs: further ``build_app`` keyword arguments (``api_key``, ``tool_parser``...).

    Raises:
        ValueError: for bad engine arguments (as ``EngineArgs``).
    """

    def __init__(self, engine_kwargs: dict[str, Any], served_model_name: str | None = None,
                 app_kwargs: dict[str, Any] | None = None) -> None:
        from kvflow.engine.arg_utils import EngineArgs
        from kvflow.engine.async_engine import AsyncLLMEngine
        from kvflow.engine.llm_engine import LLMEngine
        from kvflow.entrypoints.openai.server import build_app, default_served_name

        args = EngineArgs(**engine_kwargs)
        engine = LLMEngine.from_engine_args(args)
        name = served_model_name or default_served_name(args.model)
        self.engine = AsyncLLMEngine(engine, name)
        self.app = build_app(self.engine, name, engine.scheduler_config.max_model_len, model_aliases=(args.model,),
                             **(app_kwargs or {}))
        self.engine.start()  # the app's lifespan is not run in process

    async def handle(self, req: OpenAIRequest) -> AsyncIterator[dict[str, Any] | bytes]:
        """The response to ``req``: ``{"status", "headers"}`` first, then body chunks."""
        async for item in _asgi_call(self.app, req):
            yield item

    async def check_health(self) -> None:
        """Ray Serve's replica health check: raises when the engine has stopped."""
        if not self.engine.is_healthy:
            raise RuntimeError(f"the kvflow engine has stopped: {self.engine.error!r}")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


class OpenAIIngress:
    """The HTTP ingress (Ray Serve hands it each HTTP request as a Starlette ``Request``):
    forwards every request (method, path, query string, end-to-end headers, body) to the
    model deployment through its (prefix-affinity-routed) handle and relays status, headers
    and the body as it streams. The replica's kvflow app answers it as ``kvflow serve`` does:
    the same routes (``/v1/models/{id}``, ``/version``, ``/flush_cache``, the web UI ...) and
    the same checks and errors (404 for an unknown path, 405 for a wrong method). A body over
    ``MAX_BODY_BYTES`` is refused here (413), before it is sent on."""

    def __init__(self, server) -> None:
        self.server = server.options(stream=True)

    async def __call__(self, request: Request) -> Response:
        body = await request.body()
        if len(body) > MAX_BODY_BYTES:
            return JSONResponse({"error": {"message": f"request body over {MAX_BODY_BYTES} bytes", "type":
                                           "RequestTooLargeError", "param": None, "code": 413}}, status_code=413)
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP]
        req = OpenAIRequest(request.method, request.url.path or "/", body, headers, request.url.query)
        stream = self.server.handle.remote(req)
        start = await stream.__anext__()
        media_type = next((v for k, v in start["headers"] if k.lower() == "content-type"), None)
        response = StreamingResponse(_rest(stream), status_code=start["status"], media_type=media_type)
        for k, v in start["headers"]:  # (repeated ones, e.g. set-cookie, each kept)
            if k.lower() not in ("content-length", "content-type", *_HOP_BY_HOP):
                response.headers.append(k, v)
        return response


async def _rest(stream) -> AsyncIterator[bytes]:
    async for chunk in stream:
        yield chunk


def build_openai_app(engine_kwargs: dict[str, Any], *, num_replicas: int | None = None, min_replicas: int = 1,
                     max_replicas: int = 1, target_ongoing_requests: float = 4.0, num_cpus_per_replica: float = 1.0,
                     served_model_name: str | None = None, app_kwargs: dict[str, Any] | None = None,
                     router_kwargs: dict[str, Any] | None = None):
    """The Ray Serve application: ``OpenAIIngress`` over ``KVFlowServer`` replicas.

    Args:
        engine_kwargs: ``EngineArgs`` keyword arguments of every replica's engine.
        num_replicas: a fixed replica count; None: autoscale between ``min_replicas`` and
            ``max_replicas`` on ``target_ongoing_requests`` per replica (Ray Serve's
            ``AutoscalingConfig``).
        num_cpus_per_replica: Ray CPUs each replica reserves (set ``engine_kwargs
            ["num_threads"]`` to match).
        served_model_name, app_kwargs: see ``KVFlowServer``.
        router_kwargs: ``PrefixCacheAffinityRouter`` options (``imbalanced_threshold``,
            ``match_rate_threshold``...).

    Raises:
        ValueError: for replica bounds that are not 1 <= min <= max, or num_replicas < 1.
    """
    if num_replicas is not None and num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if not 1 <= min_replicas <= max_replicas:
        raise ValueError(f"need 1 <= min_replicas <= max_replicas, got {min_replicas}, {max_replicas}")
    router = RequestRouterConfig(request_router_class=PREFIX_ROUTER, request_router_kwargs=router_kwargs or {})
    scaling: dict[str, Any] = (
        {"num_replicas": num_replicas} if num_replicas is not None else
        {"autoscaling_config": AutoscalingConfig(min_replicas=min_replicas, max_replicas=max_replicas,
                                                 target_ongoing_requests=target_ongoing_requests)})
    server = serve.deployment(KVFlowServer, name="KVFlowServer", request_router_config=router,
                              ray_actor_options={"num_cpus": num_cpus_per_replica}, max_ongoing_requests=64,
                              health_check_period_s=5, **scaling)
    ingress = serve.deployment(OpenAIIngress, name="OpenAIIngress",
                               ray_actor_options={"num_cpus": 0})
    return ingress.bind(server.bind(engine_kwargs, served_model_name, app_kwargs))
