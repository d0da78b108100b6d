"""The web UI's routes (kvflow/entrypoints/web/routes.py) on a tiny random model in this process:
the pages and their files, the API-key rules, the snapshot stream, the block endpoint,
offline /docs and /redoc, and the wheel's package data."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import httpx
import pytest
import torch

from conftest import TINY_TEXT_VOCAB, InProcessServer, tiny_engine, tiny_model_config, tiny_tokenizer
from kvflow.entrypoints.web.routes import PUBLIC_PATHS, STATIC_DIR

REPO_ROOT = Path(__file__).resolve().parents[3]
API_KEY = "sk-web"
STREAM, BLOCKS, METRICS_JSON = "/dashboard/api/stream", "/dashboard/api/blocks", "/dashboard/api/metrics"


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


class TinyServer(InProcessServer):
    """``kvflow serve``'s app over a tiny engine (byte-level tokenizer, blocks of 4), in a thread."""

    def __init__(self, **app_kwargs) -> None:
        engine = tiny_engine(tokenizer=tiny_tokenizer(), config=tiny_model_config(vocab_size=TINY_TEXT_VOCAB),
                             num_blocks=128, block_size=4, max_model_len=512)
        self.tokenizer = engine.tokenizer
        super().__init__(engine, **app_kwargs)


@pytest.fixture(scope="module")
def server():
    s = TinyServer()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def key_servers():
    closed, metrics_open = TinyServer(api_key=API_KEY), TinyServer(api_key=API_KEY, metrics_need_key=False)
    yield closed, metrics_open
    closed.stop()
    metrics_open.stop()


def _local_refs(html: str) -> list[str]:
    return re.findall(r"""(?:src|href)=["']([^"']+)["']""", html)


# ---------------------------------------------------------------------------- pages and files
def test_pages_load_their_files_from_the_server(server):
    for path, script in (("/", "/ui/chat.js"), ("/dashboard", "/ui/dashboard.js")):
        page = httpx.get(server.url + path)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert f'<script type="module" src="{script}">' in page.text
        refs = _local_refs(page.text)
        assert refs and all(ref.startswith("/") for ref in refs), refs
        for ref in refs:
            r = httpx.get(server.url + ref)
            assert r.status_code == 200 or ref == "/docs", (ref, r.status_code)
    js = httpx.get(server.url + "/ui/chat.js")
    assert js.headers["content-type"].startswith("text/javascript")  # ES modules need a JS MIME type
    assert httpx.get(server.url + "/ui/no-such-file.js").status_code == 404


def _static_files() -> list[Path]:
    return sorted(p for p in STATIC_DIR.rglob("*") if p.is_file())


def test_every_module_import_resolves_and_nothing_is_fetched_from_elsewhere():
    for path in _static_files():
        if path.suffix not in (".js", ".html", ".css", ".svg"):
            continue
        text = path.read_text()
        if path.suffix == ".js" and VENDOR_DIR not in path.parents:
            for target in re.findall(r"""from\s+["']([^"']+)["']""", text):
                assert target.startswith("./") and (path.parent / target).resolve().is_file(), (path.name, target)
            # The only absolute URL in our own files is the SVG namespace (an identifier, never fetched).
        if VENDOR_DIR not in path.parents:
            urls = set(re.findall(r"(?:https?:)?//[\w.-]+\.\w+[^\s\"'`)]*", text))
            assert urls <= {"http://www.w3.org/2000/svg"}, (path.name, urls)
    # (The vendored libraries name URLs in comments and as XML namespaces; the browser test
    # checks that no page requests anything outside the server.)


# ---------------------------------------------------------------------------- vendored libraries
VENDOR_DIR = STATIC_DIR / "vendor"
# directory -> (file whose header states the version, the pattern of that statement)
VENDOR_HEADERS = {
    "marked": ("marked.esm.js", r"marked v(\d+\.\d+\.\d+)"),
    "dompurify": ("purify.min.js", r"DOMPurify (\d+\.\d+\.\d+)"),
    "highlight.js": ("highlight.min.js", r"Highlight\.js v(\d+\.\d+\.\d+)"),
    "uplot": ("uPlot.iife.min.js", r"uPlot \(v(\d+\.\d+\.\d+)\)"),
}


def test_vendored_libraries_carry_their_license_and_the_version_docs_state():
    docs = (REPO_ROOT / "docs" / "web.md").read_text()
    assert {p.name for p in VENDOR_DIR.iterdir()} == set(VENDOR_HEADERS)
    for name, (file, pattern) in VENDOR_HEADERS.items():
        assert (VENDOR_DIR / name / "LICENSE").stat().st_size > 500, name
        version = re.search(pattern, (VENDOR_DIR / name / file).read_text()[:600]).group(1)
        row = re.search(rf"^\| `{re.escape(name)}` \| ([^|]+) \|", docs, re.M)
        assert row and row.group(1).strip() == version, (name, version, row and row.group(0))


def test_docs_and_redoc_load_nothing_from_a_cdn(server):
    for path in ("/docs", "/redoc"):
        page = httpx.get(server.url + path)
        assert page.status_code == 200
        assert "http://" not in page.text and "https://" not in page.text, page.text
        refs = _local_refs(page.text) + re.findall(r"""url:\s*['"]([^'"]+)['"]""", page.text)
        scripts = [ref for ref in refs if ref.endswith(".js")]
        assert scripts, page.text
        for ref in refs:
            assert ref.startswith("/"), ref
            assert httpx.get(server.url + ref).status_code == 200, ref
    assert '"validatorUrl": null' in httpx.get(server.url + "/docs").text  # no online validator badge


# ---------------------------------------------------------------------------- the API key
def test_pages_are_open_and_data_needs_the_key(key_servers):
    closed, metrics_open = key_servers
    auth = {"Authorization": f"Bearer {API_KEY}"}
    for s in key_servers:
        for path in sorted(PUBLIC_PATHS):
            assert httpx.get(s.url + path).status_code == 200, path
        # the block endpoint shows users' text: the key, whatever --metrics-no-auth says
        assert httpx.get(s.url + BLOCKS + "/0").status_code == 401
        # no dashboard open: a snapshot is taken for the lookup (it was a 404 "no snapshot yet")
        block = httpx.get(s.url + BLOCKS + "/0", headers=auth, timeout=30)
        assert block.status_code == 200 and block.json()["block_id"] == 0 and block.json()["state"] == "f"
        assert httpx.get(s.url + "/v1/models").status_code == 401
    # the snapshot stream is operational data, guarded like /metrics
    assert httpx.get(closed.url + "/metrics").status_code == 401
    with httpx.stream("GET", closed.url + STREAM) as r:
        assert r.status_code == 401
        assert json.loads(r.read())["error"]["type"] == "AuthenticationError"
    for s, headers in ((closed, auth), (metrics_open, {})):
        with httpx.stream("GET", s.url + STREAM, headers=headers, timeout=10) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            assert _first_snapshot(r)["blocks"]["num_blocks"] == 128


def test_metrics_json_is_the_registry_and_guarded_like_metrics(key_servers):
    from prometheus_client.parser import text_string_to_metric_families

    closed, metrics_open = key_servers
    assert httpx.get(closed.url + METRICS_JSON).status_code == 401
    assert httpx.get(metrics_open.url + METRICS_JSON).status_code == 200  # --metrics-no-auth
    r = httpx.get(closed.url + METRICS_JSON, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200 and r.headers["cache-control"] == "no-cache"
    body = r.json()
    assert abs(body["time"] - time.time()) < 60
    text = httpx.get(closed.url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    expected = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("kvflow:") and not sample.name.endswith("_created"):
                expected.setdefault(sample.name, []).append({"labels": sample.labels, "value": sample.value})
    got = {k: v for k, v in body["metrics"].items() if not k.endswith("_created")}
    assert got == expected
    assert got["kvflow:num_requests_running"] == [{"labels": {"model_name": "tiny"}, "value": 0.0}]
    le = [s["labels"]["le"] for s in got["kvflow:time_to_first_token_seconds_bucket"]]
    assert le[-1] == "+Inf" and len(le) > 5


def _first_snapshot(response) -> dict:
    for snap in _snapshots(response):
        return snap
    raise AssertionError("the stream ended without a snapshot")


def _snapshots(response):
    """The snapshot events of an SSE response, parsed (one iterator per response)."""
    event = None
    for line in response.iter_lines():
        if line.startswith("event:"):
            event = line.split(":", 1)[1].strip()
        elif line.startswith("data:") and event == "snapshot":
            yield json.loads(line.split(":", 1)[1])


def _wait(predicate, timeout_s=20, what="condition"):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# ---------------------------------------------------------------------------- the stream
def test_stream_shows_a_request_and_unsubscribes_when_closed(server):
    prompt = "The quick brown fox jumps over the lazy dog."
    ids = server.tokenizer.encode(prompt)
    with httpx.Client(base_url=server.url, timeout=30) as http:
        with http.stream("GET", STREAM) as response:
            events = _snapshots(response)
            assert next(events)["running"] == []
            assert server.engine.snapshots.num_subscribers == 1
            server.engine.snapshots.min_interval_s = 0.0  # every step (the tiny model's take ms)
            try:
                with http.stream("POST", "/v1/completions",
                                 json={"prompt": prompt, "max_tokens": 400, "ignore_eos": True, "stream": True}) as gen:
                    lines = gen.iter_lines()
                    next(line for line in lines if line.startswith("data:"))
                    running = next(s for s in events if s["running"])
                    (req,) = running["running"]
                    assert req["num_prompt_tokens"] == len(ids) and req["max_tokens"] == 400
                    assert req["num_computed_tokens"] <= req["num_tokens"]
                    assert len(req["block_ids"]) >= -(-req["num_computed_tokens"] // 4) > 0
                    first = req["block_ids"][0]
                    assert running["blocks"]["states"][first] == "u"
                    info = http.get(f"{BLOCKS}/{first}").json()
                    assert info["owners"] == [{"id": req["id"], "index": 0}]
                    assert info["token_ids"] == ids[:4] and info["text"] == server.tokenizer.decode(ids[:4])
                    assert info["tokens"] == [server.tokenizer.decode([t]) for t in ids[:4]]
                # the generation's stream is closed mid-way: the request is aborted, its blocks freed
                idle = next(s for s in events if not s["running"] and not s["waiting"])
                assert set(idle["blocks"]["states"]) <= {"f", "c"}
                cached = [i for i, ch in enumerate(idle["blocks"]["states"]) if ch == "c"]
                assert first in cached  # the prompt's full blocks stay in the prefix index
                info = http.get(f"{BLOCKS}/{first}").json()
                assert info["state"] == "c" and info["source"] == "cache" and info["text"] == server.tokenizer.decode(ids[:4])
            finally:
                server.engine.snapshots.min_interval_s = 0.1
        _wait(lambda: server.engine.snapshots.num_subscribers == 0, what="the stream's unsubscription")
        metrics = http.get("/metrics").text
        assert 'kvflow:num_requests_running{model_name="tiny"} 0.0' in metrics
        assert 'kvflow:kv_cache_usage_perc{model_name="tiny"} 0.0' in metrics


def test_block_endpoint_refuses_bad_ids(server):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        with http.stream("GET", STREAM) as events:
            _first_snapshot(events)
            r = http.get(f"{BLOCKS}/128")
            assert r.status_code == 400 and r.json()["error"]["param"] == "block_id"
            assert http.get(f"{BLOCKS}/-1").status_code == 400
            assert http.get(f"{BLOCKS}/x").status_code == 400
            free = http.get(f"{BLOCKS}/127").json()
            assert free["owners"] == [] and free["token_ids"] == [] and free["text"] is None


# ---------------------------------------------------------------------------- packaging
def test_the_wheel_holds_the_web_files(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(REPO_ROOT / "kvflow", src / "kvflow", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(src), "-w",
                    str(tmp_path / "dist")], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("kvflow-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"kvflow/entrypoints/web/static/{p.relative_to(STATIC_DIR).as_posix()}" for p in _static_files()}
    assert any("/vendor/marked/LICENSE" in n for n in expected)
    assert expected <= names, expected - names


def test_openapi_lists_the_block_endpoint_but_not_the_endless_stream(server):
    paths = httpx.get(server.url + "/openapi.json").json()["paths"]
    assert BLOCKS + "/{block_id}" in paths
    assert STREAM not in paths and "/" not in paths and "/dashboard" not in paths
