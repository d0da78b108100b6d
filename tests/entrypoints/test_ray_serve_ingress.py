"""The Ray Serve ingress relays every route of ``kvflow serve``'s app
(``kvflow.entrypoints.ray_serve.OpenAIIngress`` over ``KVFlowServer.handle``).

Runs without Ray: when ``ray.serve`` is not installed, stand-in modules give
``kvflow.entrypoints.ray_serve`` the three names it imports (it uses them only in
``build_openai_app``), and a stand-in deployment handle calls ``KVFlowServer.handle`` in
process, as Ray's handle does in the replica. The end-to-end run on a real Ray cluster is
``tests/entrypoints/test_ray_serve.py``.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import sys
import types

import httpx
import pytest
import torch

from conftest import TINY_TEXT_VOCAB, tiny_engine, tiny_model_config, tiny_tokenizer


@pytest.fixture(scope="module")
def ray_serve():
    """``kvflow.entrypoints.ray_serve``, imported over stand-ins for Ray when it is absent."""
    try:
        import ray.serve  # noqa: F401
        stubs: dict[str, types.ModuleType] = {}
    except ImportError:
        stubs = {name: types.ModuleType(name) for name in ("ray", "ray.serve", "ray.serve.config")}
        stubs["ray"].serve = stubs["ray.serve"]
        stubs["ray.serve"].config = stubs["ray.serve.config"]
        stubs["ray.serve"].deployment = lambda cls, **kwargs: None
        stubs["ray.serve.config"].AutoscalingConfig = dict
        stubs["ray.serve.config"].RequestRouterConfig = dict
    saved = {name: sys.modules.get(name) for name in [*stubs, "kvflow.entrypoints.ray_serve"]}
    sys.modules.update(stubs)
    sys.modules.pop("kvflow.entrypoints.ray_serve", None)
    try:
        yield importlib.import_module("kvflow.entrypoints.ray_serve")
    finally:
        import kvflow.entrypoints

        if saved["kvflow.entrypoints.ray_serve"] is None and hasattr(kvflow.entrypoints, "ray_serve"):
            del kvflow.entrypoints.ray_serve
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


@pytest.fixture(scope="module")
def ingress_app(ray_serve):
    """An ASGI app running ``OpenAIIngress`` over one in-process ``KVFlowServer`` (model
    "tiny", a tiny random model)."""
    from kvflow.engine.async_engine import AsyncLLMEngine
    from kvflow.entrypoints.openai.server import build_app

    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = tiny_engine(tokenizer=tiny_tokenizer(), config=tiny_model_config(vocab_size=TINY_TEXT_VOCAB))
    server = ray_serve.KVFlowServer.__new__(ray_serve.KVFlowServer)  # (its __init__ loads a model by name)
    server.engine = AsyncLLMEngine(engine, "tiny")
    server.app = build_app(server.engine, "tiny", engine.scheduler_config.max_model_len)
    server.engine.start()

    class Handle:  # Ray's DeploymentHandle, as the ingress uses it
        def options(self, stream):
            assert stream is True
            return self

        @property
        def handle(self):
            return self

        def remote(self, req):
            # what Ray does: the request object is sent to the replica (pickled)
            assert isinstance(req, ray_serve.OpenAIRequest)
            return server.handle(req).__aiter__()

    ingress = ray_serve.OpenAIIngress(Handle())

    async def app(scope, receive, send):
        from starlette.requests import Request

        response = await ingress(Request(scope, receive))
        await response(scope, receive, send)

    yield app
    server.engine.shutdown()
    server.engine = None
    torch.set_num_threads(saved)


def _requests(app, calls):
    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ray") as client:
            return [await client.request(method, path, **kwargs) for method, path, kwargs in calls]

    return asyncio.run(run())


def test_the_ingress_serves_kvflow_serves_routes(ingress_app):
    """``GET /v1/models/{id}``, ``GET /version`` and ``POST /flush_cache`` were 404 "no such
    path" (the ingress had a list of paths of its own)."""
    completion = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
    model, unknown_model, version, flush, models, health, done, bad = _requests(ingress_app, [
        ("GET", "/v1/models/tiny", {}), ("GET", "/v1/models/nope", {}), ("GET", "/version", {}),
        ("POST", "/flush_cache", {}), ("GET", "/v1/models", {}), ("GET", "/health", {}),
        ("POST", "/v1/completions", {"json": completion}),
        ("POST", "/v1/completions", {"json": {**completion, "temperature": "hot"}}),
    ])
    assert model.status_code == 200 and model.json()["id"] == "tiny", model.text
    assert unknown_model.status_code == 404 and unknown_model.json()["error"]["param"] == "model", unknown_model.text
    assert version.status_code == 200 and "version" in version.json(), version.text
    assert flush.status_code == 200 and flush.text == "Cache flushed.", flush.text
    assert models.json()["data"][0]["id"] == "tiny" and health.text == "ok"
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 2, done.text
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature", bad.text


def test_the_ingress_relays_the_apps_checks_and_errors(ingress_app):
    """The app's own answers come through: its 404 and 405, the JSON-body rule (which reads
    Content-Type: the ingress forwards the headers), a query string."""
    plain, cross_site, no_path, wrong_method, with_query = _requests(ingress_app, [
        ("POST", "/flush_cache", {"content": b"{}", "headers": {"content-type": "text/plain"}}),
        ("POST", "/flush_cache", {"headers": {"sec-fetch-site": "cross-site"}}),
        ("GET", "/no/such/path", {}),
        ("GET", "/v1/completions", {}),
        ("GET", "/v1/models/tiny?x=1", {}),
    ])
    assert plain.status_code == 400 and "Content-Type: application/json" in plain.json()["error"]["message"]
    assert cross_site.status_code == 403, cross_site.text
    assert no_path.status_code == 404 and set(no_path.json()) == {"error"}, no_path.text
    assert wrong_method.status_code == 405 and "POST" in wrong_method.headers["allow"], wrong_method.headers
    assert with_query.status_code == 200 and json.loads(with_query.text)["id"] == "tiny"
