"""The web pages of ``kvflow serve`` and the endpoints behind its live engine view.

- ``GET /``: the chat playground; ``GET /dashboard``: the live engine view; their files
  under ``/ui/`` (plain HTML, CSS and ES modules from ``static/``: no CDN, no build step).
  These hold no data and are open even with ``--api-key``: the pages ask for the key once,
  keep it in the browser's localStorage and send it as ``Authorization: Bearer`` with
  every API call.
- ``GET /dashboard/api/stream``: server-sent events, one ``snapshot`` event per engine
  snapshot (``kvflow/engine/snapshot.py``; at most 10 a second while the engine steps, one
  a second while idle). Operational data, guarded like ``/metrics``: it needs the key when
  ``--api-key`` is set, unless ``--metrics-no-auth``.
- ``GET /dashboard/api/metrics``: the server's Prometheus registry (the samples ``/metrics``
  exposes) as JSON, ``{"time": <Unix seconds>, "metrics": {sample name: [{"labels": {...},
  "value": <float>}]}}``, read by prometheus_client itself so that the page parses no text
  format. Guarded like ``/metrics``.
- ``GET /dashboard/api/blocks/{block_id}``: one KV block as of the latest snapshot (taken
  for the lookup when no dashboard stream keeps one current: ``SnapshotProducer.fresh``): its
  state, ref count, owner requests and its tokens' text, detokenized on demand. It shows
  users' text, so it always needs the key when ``--api-key`` is set (like ``/v1/*``).
"""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CollectorRegistry

from kvflow.engine.async_engine import AsyncLLMEngine
from kvflow.engine.snapshot import Snapshot
from kvflow.entrypoints.openai.errors import APIError

STATIC_DIR = Path(__file__).parent / "static"
STATIC_URL = "/ui"
PAGES = {"/": "index.html", "/dashboard": "dashboard.html"}
STREAM_PATH = "/dashboard/api/stream"
BLOCK_PATH = "/dashboard/api/blocks/{block_id}"
METRICS_JSON_PATH = "/dashboard/api/metrics"
KEEP_ALIVE_S = 15.0  # an SSE comment when no snapshot came for this long

# Paths that hold no data (the pages and their files): open whatever the API key.
PUBLIC_PATHS = frozenset(
    {*PAGES, *(f"{STATIC_URL}/{p.relative_to(STATIC_DIR).as_posix()}" for p in STATIC_DIR.rglob("*") if p.is_file())}
)
# Paths guarded like /metrics (open with --metrics-no-auth).
METRICS_PATHS = frozenset({STREAM_PATH, METRICS_JSON_PATH})


def snapshot_events(engine: AsyncLLMEngine, keep_alive_s: float = KEEP_ALIVE_S):
    """The SSE text of the snapshot stream: ``event: snapshot`` + ``data: <json>`` per
    snapshot, the latest only when the client reads slower than they come (a slow client
    never queues snapshots up). Subscribed while iterated; unsubscribed when closed."""
    queue: asyncio.Queue[Snapshot] = asyncio.Queue(maxsize=1)

    def push(snap: Snapshot) -> None:
        if queue.full():
            queue.get_nowait()
        queue.put_nowait(snap)

    async def events():
        token = engine.snapshots.subscribe(push)
        try:
            yield "retry: 2000\n\n"
            while True:
                try:
                    snap = await asyncio.wait_for(queue.get(), timeout=keep_alive_s)
                except TimeoutError:
                    yield ": keep-alive\n\n"
                    continue
                yield f"event: snapshot\ndata: {snap.json()}\n\n"
        finally:
            engine.snapshots.unsubscribe(token)

    return events()


def registry_samples(registry: CollectorRegistry) -> dict[str, list[dict[str, Any]]]:
    """Every sample of ``registry`` by sample name (``kvflow:generation_tokens_total``,
    ``kvflow:time_to_first_token_seconds_bucket``, ...): ``[{"labels": {...}, "value": v}]``,
    with +-Inf and NaN values as null (JSON has no such numbers)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for family in registry.collect():
        for sample in family.samples:
            value = sample.value if math.isfinite(sample.value) else None
            out.setdefault(sample.name, []).append({"labels": dict(sample.labels), "value": value})
    return out


def register(app: FastAPI, engine: AsyncLLMEngine) -> None:
    """Add the pages, their static files and the dashboard endpoints to ``app``."""
    tokenizer = engine.tokenizer

    def page(name: str):
        async def serve_page() -> Response:
            return FileResponse(STATIC_DIR / name, media_type="text/html", headers={"Cache-Control": "no-cache"})

        return serve_page

    for path, name in PAGES.items():
        app.add_api_route(path, page(name), methods=["GET"], include_in_schema=False)
    app.mount(STATIC_URL, StaticFiles(directory=STATIC_DIR), name="ui")

    # (Not in /openapi.json: a schema-driven client would read the endless stream forever.)
    @app.get(STREAM_PATH, include_in_schema=False)
    async def snapshot_stream() -> Response:
        return StreamingResponse(snapshot_events(engine), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.get(METRICS_JSON_PATH, include_in_schema=False)
    async def metrics_json() -> Response:
        return JSONResponse({"time": time.time(), "metrics": registry_samples(engine.metrics.registry)},
                            headers={"Cache-Control": "no-cache"})

    @app.get(BLOCK_PATH, summary="One KV block of the latest snapshot: owners and text")
    async def block(block_id: int) -> Response:
        await engine.snapshots.fresh()  # no dashboard open: one taken for this lookup
        try:
            info = engine.snapshots.describe_block(block_id)
        except ValueError as exc:
            status = 404 if engine.snapshots.latest is None else 400
            raise APIError(status, str(exc), param="block_id") from None
        ids = info["token_ids"]
        if tokenizer is not None and ids:
            info["text"], info["tokens"] = await engine.run_off_loop(
                lambda: (tokenizer.decode(ids), [tokenizer.decode([t]) for t in ids])
            )
        else:
            info["text"], info["tokens"] = None, None
        return JSONResponse(info)
