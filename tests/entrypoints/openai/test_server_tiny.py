"""The HTTP server on a tiny random model (byte-level tokenizer), in this process: hostile
input, limits, connection timeouts, injected faults, the API key, generation defaults.

Each server is a real uvicorn on 127.0.0.1 in a thread (``make_server``), so the raw-socket
tests see uvicorn's own connection handling; injected faults (``monkeypatch``) reach its
engine thread. One server per module where the tests can share it.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import socket
import threading
import time

import httpx
import pytest
import torch

from conftest import TINY_TEXT_VOCAB, InProcessServer, tiny_engine, tiny_model_config, tiny_tokenizer
from kvflow.entrypoints.openai.server import default_served_name
from kvflow.entrypoints.web.routes import STREAM_PATH

MAX_REQUEST_BYTES = 64 * 1024
READ_TIMEOUT_S = 1.0
KEEP_ALIVE_S = 1.0
API_KEY = "sk-tiny"
C, CH = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "Hi"}]
MARK = [250, 250]  # prompts starting with these token ids are the injected faults' target


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


class TinyServer(InProcessServer):
    """``kvflow serve``'s app and uvicorn server over a tiny engine, in a thread (this
    module's body limit and connection timeouts)."""

    def __init__(self, max_queue_len=None, engine_kwargs=None, **app_kwargs) -> None:
        engine = tiny_engine(tokenizer=tiny_tokenizer(), config=tiny_model_config(vocab_size=TINY_TEXT_VOCAB),
                             **(engine_kwargs or {}))
        app_kwargs.setdefault("max_request_bytes", MAX_REQUEST_BYTES)
        super().__init__(engine, max_queue_len, KEEP_ALIVE_S, READ_TIMEOUT_S, **app_kwargs)


@pytest.fixture(scope="module")
def server():
    s = TinyServer()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def _post_raw(http: httpx.Client, path: str, body: bytes | str) -> httpx.Response:
    data = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body
    return http.post(path, content=data, headers={"content-type": "application/json"})


def _assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json"), r.headers
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == status and body["error"]["message"], body
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]


def _wait_idle(server: TinyServer, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while server.engine.get_stats()["num_free_blocks"] != 64 or server.engine.get_stats()["num_running"]:
        assert time.monotonic() < deadline, server.engine.get_stats()
        time.sleep(0.05)


def _completion(http, **kw) -> dict:
    r = http.post(C, json={"prompt": "Hello", "max_tokens": 4, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


# ---------------------------------------------------------------------------- hostile values
_INF = '{"prompt": "Hello", "max_tokens": 4, "temperature": Infinity}'
BAD_VALUES = [
    pytest.param(C, _INF, "temperature", id="temperature-Infinity"),
    pytest.param(C, _INF.replace("Infinity", "-Infinity"), "temperature", id="temperature--Infinity"),
    pytest.param(C, _INF.replace("Infinity", "NaN"), "temperature", id="temperature-NaN"),
    pytest.param(C, _INF.replace("Infinity", "1e999"), "temperature", id="temperature-1e999"),
    pytest.param(C, _INF.replace("Infinity", "true"), "temperature", id="temperature-true"),
    pytest.param(C, _INF.replace("Infinity", '"0.5"'), "temperature", id="temperature-string"),
    pytest.param(C, _INF.replace("temperature\": Infinity", 'top_p": NaN'), "top_p", id="top_p-NaN"),
    pytest.param(C, {"prompt": "x", "min_p": 2}, "min_p", id="min_p-2"),
    pytest.param(C, {"prompt": "x", "presence_penalty": 1e308}, "presence_penalty", id="presence_penalty-huge"),
    pytest.param(C, _INF.replace("temperature", "repetition_penalty"), "repetition_penalty", id="repetition_penalty-inf"),
    pytest.param(C, {"prompt": "x", "top_k": 1e20}, "top_k", id="top_k-1e20"),
    pytest.param(C, {"prompt": "x", "top_k": -5}, "top_k", id="top_k--5"),
    pytest.param(C, {"prompt": "x", "seed": 2**64}, "seed", id="seed-2**64"),
    pytest.param(C, {"prompt": "x", "seed": 1e20}, "seed", id="seed-1e20"),
    pytest.param(C, {"prompt": "x", "n": True}, "n", id="n-true"),
    pytest.param(C, {"prompt": "x", "n": 2.0}, "n", id="n-2.0"),
    pytest.param(C, {"prompt": "x", "max_tokens": 1e20}, "max_tokens", id="max_tokens-1e20"),
    pytest.param(C, {"prompt": "x", "max_tokens": 2**63}, "max_tokens", id="max_tokens-2**63"),
    pytest.param(C, {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias", id="logit_bias-key-abc"),
    pytest.param(C, {"prompt": "x", "logit_bias": {str(10**20): 1}}, "logit_bias", id="logit_bias-key-10**20"),
    pytest.param(C, {"prompt": "x", "logit_bias": {"300": 1}}, "logit_bias", id="logit_bias-key-past-vocab"),
    pytest.param(C, {"prompt": "x", "logit_bias": {"5": True}}, "logit_bias", id="logit_bias-value-true"),
    pytest.param(C, {"prompt": "x", "logit_bias": {"5": 1e300}}, "logit_bias", id="logit_bias-value-huge"),
    pytest.param(C, {"prompt": "x", "allowed_token_ids": [300]}, "allowed_token_ids", id="allowed_token_ids-past-vocab"),
    pytest.param(C, {"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids", id="allowed_token_ids-empty"),
    pytest.param(CH, {"messages": MSG, "allowed_token_ids": [-1]}, "allowed_token_ids", id="allowed_token_ids--1"),
    pytest.param(C, {"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", id="truncate-0"),
    pytest.param(C, {"prompt": "x", "truncate_prompt_tokens": 257}, "truncate_prompt_tokens", id="truncate-past-len"),
    pytest.param(CH, {"messages": MSG, "truncate_prompt_tokens": "4"}, "truncate_prompt_tokens", id="truncate-str"),
    pytest.param(C, {"prompt": "x", "logprobs": 2**63}, "logprobs", id="logprobs-2**63"),
    pytest.param(CH, {"messages": MSG, "logprobs": True, "top_logprobs": 2**63}, "top_logprobs", id="top_logprobs-2**63"),
    pytest.param(C, {"prompt": "x", "min_tokens": 2**63}, "min_tokens", id="min_tokens-2**63"),
    pytest.param(C, {"prompt": [-1]}, "prompt", id="prompt-token--1"),
    pytest.param(C, {"prompt": [2**63]}, "prompt", id="prompt-token-2**63"),
    pytest.param(C, {"prompt": [[1, 2], []]}, "prompt", id="prompt-empty-in-list"),
    pytest.param(C, {"prompt": "x", "stream": "yes"}, "stream", id="stream-string"),
    pytest.param(C, {"prompt": "x", "stop_token_ids": [10**30]}, "stop_token_ids", id="stop_token_ids-10**30"),
    pytest.param(C, {"prompt": "x", "stop_token_ids": [300]}, "stop_token_ids", id="stop_token_ids-past-vocab"),
    pytest.param(C, {"prompt": "x", "stop_token_ids": [1e30]}, "stop_token_ids", id="stop_token_ids-1e30"),
    pytest.param(C, {"prompt": "x", "guided_grammar": "start: ("}, "guided_grammar", id="guided_grammar-broken"),
    pytest.param(C, {"prompt": "x", "guided_choice": []}, "guided_choice", id="guided_choice-empty"),
    pytest.param(C, {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
                 id="structured_outputs-two"),
    pytest.param(C, {"prompt": "x", "structured_outputs": {"nonsense": 1}}, "structured_outputs",
                 id="structured_outputs-unknown-key"),
    # as OpenAI and vLLM: silently dropped before
    pytest.param(CH, {"messages": MSG, "top_logprobs": 3}, "top_logprobs", id="top_logprobs-without-logprobs"),
    pytest.param(C, {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options",
                 id="stream_options-without-stream"),
    pytest.param(CH, {"messages": MSG, "stream_options": {"include_usage": True}}, "stream_options",
                 id="chat-stream_options-without-stream"),
    # a message about a nested field names its top-level field (param was null)
    pytest.param(CH, {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
                 "response_format", id="response_format-json_schema-without-schema"),
]


@pytest.mark.parametrize("path,body,param", BAD_VALUES)
def test_hostile_values_are_400_naming_the_field(server, http, path, body, param):
    r = _post_raw(http, path, body) if isinstance(body, str) else http.post(path, json={"max_tokens": 4, **body})
    _assert_error(r, 400, param)
    assert server.engine.is_healthy


_SURROGATE = "abc\\ud800"
SURROGATES = [
    pytest.param(C, f'{{"prompt": "{_SURROGATE}"}}', "prompt", id="prompt"),
    pytest.param(C, f'{{"prompt": ["ok", "{_SURROGATE}"]}}', "prompt", id="prompt-list"),
    pytest.param(CH, f'{{"messages": [{{"role": "user", "content": "{_SURROGATE}"}}]}}', "messages", id="chat-content"),
    pytest.param(CH, f'{{"messages": [{{"role": "user", "content": [{{"type": "text", "text": "{_SURROGATE}"}}]}}]}}',
                 "messages", id="chat-content-part"),
    pytest.param(C, f'{{"prompt": "x", "stop": ["{_SURROGATE}"]}}', "stop", id="stop"),
    pytest.param(C, f'{{"prompt": "x", "model": "{_SURROGATE}"}}', "model", id="model"),
    pytest.param(C, f'{{"prompt": "x", "user": "{_SURROGATE}"}}', "user", id="user"),
    pytest.param(C, f'{{"prompt": "x", "guided_regex": "{_SURROGATE}"}}', "guided_regex", id="guided_regex"),
    pytest.param(C, f'{{"prompt": "x", "guided_json": {{"enum": ["{_SURROGATE}"]}}}}', "guided_json", id="guided_json"),
    pytest.param(C, f'{{"prompt": "x", "logit_bias": {{"{_SURROGATE}": 1}}}}', "logit_bias", id="logit_bias-key"),
    pytest.param(C, f'{{"prompt": "x", "zzz": "{_SURROGATE}"}}', "zzz", id="unknown-field"),
    pytest.param(C, f'{{"prompt": "x", "{_SURROGATE}": 1}}', None, id="key"),
    pytest.param(C, '{"prompt": "\\udfff\\ud800"}', "prompt", id="reversed-pair"),
]


@pytest.mark.parametrize("path,body,param", SURROGATES)
def test_lone_surrogates_anywhere_are_400(http, path, body, param):
    err = _assert_error(_post_raw(http, path, body), 400, param)
    assert "surrogate" in err["message"], err


def test_a_valid_surrogate_pair_is_text(http):
    r = _post_raw(http, C, '{"prompt": "smile \\ud83d\\ude00", "max_tokens": 2}')
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len("smile ".encode()) + 4


def _nested(n: int, leaf: str = "1") -> str:
    return '{"a":' * n + leaf + "}" * n


DEEP = [
    pytest.param(C, '{"prompt": "x", "guided_json": ' + _nested(100, '{"type": "object"}') + "}", "guided_json", id="guided_json-100"),
    pytest.param(C, '{"prompt": "x", "guided_json": ' + _nested(5000) + "}", None, id="guided_json-5000"),
    pytest.param(C, '{"prompt": "x", "zzz": ' + "[" * 20_000 + "]" * 20_000 + "}", None, id="unknown-20000"),
    pytest.param(C, json.dumps({"prompt": "x", "guided_json": _nested(5000)}), "guided_json", id="guided_json-string-5000"),
    pytest.param(C, json.dumps({"prompt": "x", "guided_json": _nested(200)}), "guided_json", id="guided_json-string-200"),
]


@pytest.mark.parametrize("path,body,param", DEEP)
def test_deeply_nested_bodies_and_schemas_are_400(server, http, path, body, param):
    _assert_error(_post_raw(http, path, body), 400, param)
    assert server.engine.is_healthy


@pytest.mark.parametrize(
    "body", [b'{"prompt": "\xff\xfe"}', b"\xff\xfe\x00", b"{not json", b"[]", b"null", b'"x"'],
    ids=["invalid-utf8-in-string", "invalid-utf8", "not-json", "list", "null", "string"],
)
def test_bodies_that_are_not_a_request_are_400(http, body):
    _assert_error(http.post(C, content=body, headers={"content-type": "application/json"}), 400)


_JSON_BODIES = {C: {"prompt": "x", "max_tokens": 1}, CH: {"messages": MSG, "max_tokens": 1},
                "/v1/embeddings": {"input": "x"}, "/tokenize": {"prompt": "x"}}


@pytest.mark.parametrize("path", list(_JSON_BODIES))
@pytest.mark.parametrize("content_type", ["text/plain", None, "application/x-www-form-urlencoded", "multipart/form-data"],
                         ids=["text-plain", "none", "form", "multipart"])
def test_a_body_not_sent_as_json_is_a_clear_400(http, path, content_type):
    """Valid JSON sent as text/plain, a form or without a Content-Type got pydantic's "Input
    should be a valid dictionary or object to extract fields from"; it is refused (as vLLM
    and FastAPI do: a browser sends those cross-origin without a preflight) by a message
    that says what to send."""
    headers = {} if content_type is None else {"content-type": content_type}
    r = http.post(path, content=json.dumps(_JSON_BODIES[path]).encode(), headers=headers)
    assert "content-type" not in {k.lower() for k in r.request.headers} or content_type is not None
    err = _assert_error(r, 400)
    assert err["param"] is None and "must be JSON sent with Content-Type: application/json" in err["message"], err
    assert (content_type or "no Content-Type") in err["message"], err


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_flush_cache_refuses_a_body_not_sent_as_json(http, content_type):
    """POST /flush_cache reads no body, so the JSON rule of the other POST routes did not
    apply: a text/plain body (what another site's page sends without a CORS preflight) flushed
    the cache (200)."""
    r = http.post("/flush_cache", content=b"{}", headers={"content-type": content_type})
    err = _assert_error(r, 400)
    assert "must be JSON sent with Content-Type: application/json" in err["message"] and content_type in err["message"]


@pytest.mark.parametrize("site", ["cross-site", "same-site"])
def test_flush_cache_refuses_a_browsers_cross_site_request(http, site):
    err = _assert_error(http.post("/flush_cache", headers={"sec-fetch-site": site}), 403)
    assert f"Sec-Fetch-Site: {site}" in err["message"], err


@pytest.mark.parametrize("kwargs", [{}, {"json": {}}, {"headers": {"sec-fetch-site": "same-origin"}},
                                    {"headers": {"sec-fetch-site": "none"}}], ids=["empty", "json", "same-origin", "none"])
def test_flush_cache_as_the_routers_call_it_is_served(http, kwargs):
    r = http.post("/flush_cache", **kwargs)
    assert r.status_code == 200 and r.text == "Cache flushed.", r.text


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8", "Application/JSON", "application/vnd.x+json"])
def test_json_content_types_with_parameters_are_served(http, content_type):
    r = http.post(C, content=json.dumps(_JSON_BODIES[C]).encode(), headers={"content-type": content_type})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", list(_JSON_BODIES))
@pytest.mark.parametrize("encoding", ["gzip", "br", "deflate, identity", "x-unknown"])
def test_an_encoded_body_is_415_naming_the_content_encoding(http, path, encoding):
    """A gzip body was read as if it were plain JSON (a confusing 400 on its bytes); any
    Content-Encoding but identity is refused by name, before the body is read."""
    body = gzip.compress(json.dumps(_JSON_BODIES[path]).encode())
    r = http.post(path, content=body, headers={"content-type": "application/json", "content-encoding": encoding})
    err = _assert_error(r, 415)
    assert err["type"] == "UnsupportedMediaTypeError" and err["param"] is None, err
    assert f"Content-Encoding: {encoding.split(',')[0]} is not supported" in err["message"], err


@pytest.mark.parametrize("encoding", ["identity", "Identity"])
def test_an_identity_content_encoding_is_a_plain_body(http, encoding):
    r = http.post(C, content=json.dumps({"prompt": "Hi", "max_tokens": 2}).encode(),
                  headers={"content-type": "application/json", "content-encoding": encoding})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", ["/health", "/v1/models", "/v1/models/tiny", "/metrics", "/version", "/", "/dashboard",
                                  "/dashboard/api/metrics", "/openapi.json"])
def test_head_answers_as_get_without_a_body(server, path):
    """HEAD on a GET endpoint answered 405 (FastAPI's GET routes take no HEAD); it has GET's
    status and headers and no body (RFC 9110, 9.3.2). Checked on the raw socket: an HTTP
    client would drop a body that a HEAD response wrongly carried."""
    with httpx.Client(base_url=server.url, timeout=30) as c:
        get = c.get(path)
    assert get.status_code == 200, (path, get.status_code)
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"HEAD {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in header_lines)
    assert status_line.split(" ")[1] == "200", (path, status_line)
    assert body == b"", (path, body[:200])
    assert headers["content-type"] == get.headers["content-type"].lower(), (path, headers)
    if path not in ("/v1/models", "/v1/models/tiny", "/metrics", "/dashboard/api/metrics"):  # (their bodies hold the time)
        assert headers.get("content-length") == get.headers.get("content-length"), (path, headers)


def test_head_of_the_dashboard_stream_ends_and_of_a_post_route_is_405(server, http):
    """The endless event stream answers HEAD with its headers and ends (the stream is told
    the client left); a POST-only route answers HEAD as it answers GET: 405."""
    r = http.head(STREAM_PATH)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream") and r.content == b""
    r = http.head(C)
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.content == b""
    assert http.get("/health").text == "ok"  # the server goes on


def test_the_allow_of_a_get_routes_405_lists_head(http):
    """A GET endpoint answers HEAD too, but its 405 (POST /health) said ``Allow: GET``; the
    Allow of a 405 lists the methods the resource supports (RFC 9110, 15.5.6)."""
    for path in ("/health", "/v1/models", "/metrics"):
        r = http.post(path, json={})
        assert r.status_code == 405 and r.headers["allow"] == "GET, HEAD", (path, r.status_code, r.headers)
    assert http.put(C, json={}).headers["allow"] == "POST"  # a POST route takes no HEAD


def test_a_path_no_route_serves_is_a_404_naming_it(http):
    """llama-server's paths (``/completion``, ``/props``, ``/slots``) were answered 404 "Not
    Found", which names neither the path nor where kvflow serves the endpoint."""
    cases = [("post", "/completion", "/v1/completions"), ("post", "/chat/completions", "/v1/chat/completions"),
             ("post", "/embedding", "/v1/embeddings"), ("get", "/props", None), ("get", "/slots", None),
             ("get", "/v1/no/such/path", None)]
    for method, path, alt in cases:
        err = _assert_error(getattr(http, method)(path, **({"json": {"prompt": "x"}} if method == "post" else {})),
                            404)
        assert f"{method.upper()} {path} is not an endpoint of kvflow" in err["message"], err
        assert (alt in err["message"]) if alt else "/docs" in err["message"], err
    err = _assert_error(http.get("/x" * 500), 404)
    assert len(err["message"]) < 200, err


def test_llama_servers_reasoning_format_is_served_or_refused_by_name(http):
    """llama-server's ``reasoning_format`` was dropped: ``"deepseek"`` (split the reasoning out)
    on a server without ``--reasoning-parser`` left it in the content."""
    body = {"messages": MSG, "max_tokens": 1}
    for value in ("auto", "none"):
        assert http.post(CH, json={**body, "reasoning_format": value}).status_code == 200
    for value in ("deepseek", "deepseek-legacy", "bogus"):
        err = _assert_error(http.post(CH, json={**body, "reasoning_format": value}), 400, "reasoning_format")
        assert "no --reasoning-parser" in err["message"], err
    assert http.post(C, json={"prompt": "x", "max_tokens": 1, "reasoning_format": "deepseek"}).status_code == 200
    split = TinyServer(reasoning_parser="deepseek_r1")
    try:
        with httpx.Client(base_url=split.url, timeout=60) as c:
            assert c.post(CH, json={**body, "reasoning_format": "deepseek"}).status_code == 200
            err = _assert_error(c.post(CH, json={**body, "reasoning_format": "none"}), 400, "reasoning_format")
            assert "splits the reasoning" in err["message"], err
    finally:
        split.stop()


def test_a_trailing_slash_is_the_same_path(http):
    """``/v1/completions/`` answered 307 (a redirect a POST client does not follow)."""
    for path, body in ((C + "/", {"prompt": "Hello", "max_tokens": 2}), (CH + "/", {"messages": MSG, "max_tokens": 2}),
                       ("/tokenize/", {"prompt": "a"})):
        r = http.post(path, json=body)
        assert r.status_code == 200, (path, r.status_code, r.text)
    assert http.get("/v1/models/").status_code == 200


def test_the_number_of_prompts_is_bounded(server, http):
    """A list of 20,000 prompts was accepted (the engine thread held for a minute while they
    queued): at most MAX_PROMPTS, as the embeddings' inputs; token ids of one prompt are one."""
    from kvflow.entrypoints.openai.serving import MAX_PROMPTS

    for prompt in (["a b"] * (MAX_PROMPTS + 1), [[5, 6]] * 10_000):
        err = _assert_error(http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}), 400, "prompt")
        assert str(MAX_PROMPTS) in err["message"], err
    assert server.engine.get_stats()["num_waiting"] == 0
    r = http.post("/v1/completions", json={"prompt": [5] * 40, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
    r = http.post("/v1/completions", json={"prompt": [[5, 6]] * 3, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200 and len(r.json()["choices"]) == 3, r.text


def test_streamed_completion_chunks_carry_text(http):
    """A token that is only part of a character (the tiny tokenizer is byte-level) sent a
    chunk with ``"text": ""``; now every chunk but the last has text."""
    body = {"prompt": "Hi", "max_tokens": 8, "temperature": 0, "guided_regex": "\U0001F600\U0001F600", "stream": True}
    with http.stream("POST", C, json=body) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    texts = [c["choices"][0]["text"] for c in chunks]
    assert "".join(texts) == "\U0001F600\U0001F600", texts
    assert all(texts[:-1]) and len(texts) >= 2, texts


def test_chat_logprobs_bytes_are_each_token_s_own_bytes(http):
    """OpenAI's ``bytes`` lets a client rebuild a character split over tokens: a token holding
    part of a character (each token is one byte here) has its own byte, not U+FFFD's three."""
    tok = tiny_tokenizer()
    emoji = "\U0001F600"
    ids = tok.encode(emoji, add_special_tokens=False)
    assert len(ids) == 4 and tok.decode([ids[0]]) == "\ufffd"
    r = http.post(CH, json={"messages": MSG, "max_tokens": 1, "temperature": 0, "logprobs": True, "top_logprobs": 20,
                            "logit_bias": {str(ids[0]): 100}})
    assert r.status_code == 200, r.text
    (entry,) = r.json()["choices"][0]["logprobs"]["content"]
    assert entry["token"] == "\ufffd" and entry["bytes"] == [emoji.encode("utf-8")[0]], entry  # 0xF0
    for e in entry["top_logprobs"]:
        assert len(e["bytes"]) == 1, e  # one byte per token in this tokenizer
        if e["token"] != "\ufffd":
            assert bytes(e["bytes"]) == e["token"].encode("utf-8"), e


@pytest.mark.parametrize("path", [C, CH])
def test_allowed_token_ids_are_the_only_tokens_generated(http, path):
    body = {"prompt": "hello"} if path == C else {"messages": MSG}
    r = http.post(path, json={**body, "max_tokens": 12, "temperature": 1.0, "seed": 1, "ignore_eos": True,
                              "allowed_token_ids": [40, 41, 42], "logprobs": True if path == CH else 1})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    tok = tiny_tokenizer()
    tokens = ([e["token"] for e in choice["logprobs"]["content"]] if path == CH else choice["logprobs"]["tokens"])
    assert len(tokens) == 12 and set(tokens) <= {tok.decode([t]) for t in (40, 41, 42)}, tokens


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(http):
    """vLLM's left truncation: the answer, usage and echo are those of the last k tokens; a
    prompt longer than the context (256) is served when truncated."""
    ids = [5 + i % 200 for i in range(300)]
    body = {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "echo": True, "logprobs": 0}
    cut = http.post(C, json={**body, "prompt": ids, "truncate_prompt_tokens": 9})
    want = http.post(C, json={**body, "prompt": ids[-9:]})
    assert cut.status_code == want.status_code == 200, cut.text
    assert cut.json()["choices"][0]["text"] == want.json()["choices"][0]["text"]
    assert cut.json()["choices"][0]["logprobs"]["tokens"][:9] == want.json()["choices"][0]["logprobs"]["tokens"][:9]
    assert cut.json()["usage"]["prompt_tokens"] == 9
    assert http.post(C, json={**body, "prompt": ids}).status_code == 400  # (untruncated: too long)
    chat = http.post(CH, json={"messages": MSG, "max_tokens": 2, "truncate_prompt_tokens": 3})
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == 3, chat.text
    whole = http.post(C, json={"prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": -1})
    assert whole.status_code == 200 and whole.json()["usage"]["prompt_tokens"] == 255, whole.text


@pytest.mark.parametrize("echo", [True, False])
def test_streamed_completion_logprobs_add_up_to_the_whole_response(http, echo):
    """With ``echo`` the first chunk carries the prompt tokens' entries (``token_logprobs``
    null for the first), and every ``text_offset`` counts in the echoed text, as the
    non-streamed response (the stream sent only the completion's entries, offsets from 0)."""
    body = {"prompt": "The sky", "max_tokens": 4, "temperature": 0, "logprobs": 1, "echo": echo, "ignore_eos": True}
    whole = http.post(C, json=body).json()["choices"][0]
    with http.stream("POST", C, json={**body, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert "".join(c["text"] for c in choices) == whole["text"]
    got = {k: [x for c in choices if c.get("logprobs") for x in c["logprobs"][k]] for k in whole["logprobs"]}
    assert got["tokens"] == whole["logprobs"]["tokens"]
    assert got["text_offset"] == whole["logprobs"]["text_offset"]
    assert got["token_logprobs"] == pytest.approx(whole["logprobs"]["token_logprobs"])
    if echo:
        n_prompt = len(whole["logprobs"]["tokens"]) - 4
        assert n_prompt >= 1 and whole["logprobs"]["token_logprobs"][0] is None
        assert choices[0]["text"].startswith("The sky") and len(choices[0]["logprobs"]["tokens"]) > n_prompt


@pytest.mark.parametrize("n", [1, 2])
def test_a_streamed_echo_sends_the_prompt_first(http, n):
    """A streamed completion with ``echo`` and ``logprobs`` starts with the prompt: each
    choice's first chunk has the prompt's text and entries first, before any generated
    text, and the stream goes on with the generated tokens (the prompt's logprobs come with
    the engine's first output, as vLLM's; the stream used to come in one chunk at the end,
    after all the tokens were generated)."""
    max_tokens = 32
    body = {"prompt": "The sky", "max_tokens": max_tokens, "temperature": 0, "logprobs": 2, "echo": True,
            "ignore_eos": True, "n": n}
    whole = http.post(C, json=body).json()["choices"]
    with http.stream("POST", C, json={**body, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    for index in range(n):
        want = whole[index]["logprobs"]
        n_prompt = len(want["tokens"]) - max_tokens
        assert n_prompt >= 1 and want["token_logprobs"][0] is None
        choices = [c for chunk in chunks for c in chunk["choices"] if c["index"] == index]
        first = choices[0]
        assert first["text"].startswith("The sky") and first.get("finish_reason") is None
        got = first["logprobs"]
        assert got["tokens"][:n_prompt] == want["tokens"][:n_prompt]
        assert got["text_offset"][:n_prompt] == want["text_offset"][:n_prompt] and got["text_offset"][0] == 0
        assert got["token_logprobs"][0] is None and got["top_logprobs"][0] is None
        assert got["token_logprobs"][1:n_prompt] == pytest.approx(want["token_logprobs"][1:n_prompt])
        # the generated tokens follow, in later chunks, none of them echoing the prompt again
        assert len(choices) >= 2 and len(got["tokens"]) < len(want["tokens"])
        assert not any(c["text"].startswith("The sky") for c in choices[1:])
        assert "".join(c["text"] for c in choices) == whole[index]["text"]
        assert [t for c in choices for t in c["logprobs"]["tokens"]] == want["tokens"]
        assert choices[-1]["finish_reason"] == "length"


# the tiny tokenizer is byte-level: "a", then the 4 bytes of U+1F600, then "b"
SCRIPT_TEXT = "a\U0001F600b"
CUT = {2: "a", 3: "a", 4: "a", 5: "a\U0001F600"}  # max tokens -> the text that decodes cleanly


def _script_output(monkeypatch, server) -> None:
    """Every request's i-th output token is ``SCRIPT_TEXT``'s i-th byte token (crafted ids)."""
    import kvflow.worker.model_runner as model_runner

    script = server.engine.engine.tokenizer.encode(SCRIPT_TEXT, add_special_tokens=False)
    assert len(script) == 6, script

    sample = model_runner.ModelRunner._sample

    def scripted(self, logits, requests):
        # The sampler's input is forced to one token a row (the runner skips the logits
        # processors of a batch that has none, so the hook sits at the sampling call).
        forced = torch.full_like(logits, float("-inf"))
        for row, r in enumerate(requests):
            forced[row, script[(len(r.all_token_ids) - len(r.prompt_token_ids)) % len(script)]] = 0.0
        return sample(self, forced, requests)

    monkeypatch.setattr(model_runner.ModelRunner, "_sample", scripted)


@pytest.mark.parametrize("stream", [False, True])
def test_completion_text_offsets_count_characters_split_over_tokens(http, server, monkeypatch, stream):
    """``text_offset`` indexes the response's text when a character is split over tokens
    (the byte-level tiny tokenizer: U+1F600 is 4 tokens that each decode to U+FFFD): the
    tokens of one character share its offset, and the offsets stay within the text, in the
    echoed prompt and in the generated text, streamed or not (each piece used to count one
    character, so every later offset ran 3 past its token)."""
    _script_output(monkeypatch, server)
    body = {"prompt": SCRIPT_TEXT, "max_tokens": 6, "temperature": 0, "logprobs": 0, "echo": True,
            "stream": stream}
    if stream:
        with http.stream("POST", C, json=body) as r:
            choices = [c for line in r.iter_lines() if line.startswith("data: {")
                       for c in json.loads(line[6:])["choices"]]
        text = "".join(c["text"] for c in choices)
        offsets = [x for c in choices if c.get("logprobs") for x in c["logprobs"]["text_offset"]]
    else:
        choice = http.post(C, json=body).json()["choices"][0]
        text, offsets = choice["text"], choice["logprobs"]["text_offset"]
    assert text == SCRIPT_TEXT * 2
    # "a", the emoji's 4 bytes, "b": the prompt's 6 tokens, then the same 6 generated
    assert offsets == [0, 1, 1, 1, 1, 2, 3, 4, 4, 4, 4, 5], offsets
    assert all(text[o] == ch for o, ch in zip(offsets, "a" + "\U0001F600" * 4 + "b" + "a" + "\U0001F600" * 4 + "b"))


def _streamed_and_final(http, path: str, max_tokens: int, stream: bool) -> tuple[list[str], str]:
    """(text deltas, final text) of one request; for a non-streamed one, deltas are []."""
    if path == C:
        body = {"prompt": "x", "max_tokens": max_tokens}
    elif path == "/v1/responses":
        body = {"input": "x", "max_output_tokens": max_tokens}
    else:
        body = {"messages": MSG, "max_tokens": max_tokens, "model": "tiny"}
    body = {**body, "temperature": 0, "stream": stream}
    if not stream:
        r = http.post(path, json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        if path == C:
            return [], out["choices"][0]["text"]
        if path == CH:
            return [], out["choices"][0]["message"]["content"]
        if path == "/v1/responses":
            return [], "".join(p["text"] for item in out["output"] for p in item["content"])
        return [], "".join(block["text"] for block in out["content"])
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    if path == C:
        deltas = [e["choices"][0]["text"] for e in events]
        return deltas, "".join(deltas)
    if path == CH:
        deltas = [e["choices"][0]["delta"].get("content") or "" for e in events]
        return deltas, "".join(deltas)
    if path == "/v1/responses":
        deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
        (last,) = [e for e in events if e["type"] in ("response.completed", "response.incomplete")]
        done = [e["text"] for e in events if e["type"] == "response.output_text.done"]
        final = "".join(p["text"] for item in last["response"]["output"] for p in item["content"])
        assert done in ([], [final]), (done, final)
        return deltas, final
    deltas = [e["delta"]["text"] for e in events if e["type"] == "content_block_delta"]
    return deltas, "".join(deltas)


@pytest.mark.parametrize("path", [C, CH, "/v1/responses", "/v1/messages"])
def test_a_cut_mid_character_streams_no_replacement_character(server, http, monkeypatch, path):
    """max tokens that end inside a multi-byte character: the text is what decodes cleanly
    (as vLLM's), streamed or not; the dangling bytes were released at the finish as U+FFFD,
    a character the model never wrote."""
    _script_output(monkeypatch, server)
    for max_tokens, expected in CUT.items():
        deltas, final = _streamed_and_final(http, path, max_tokens, stream=True)
        assert "".join(deltas) == final == expected, (max_tokens, deltas, final)
        assert _streamed_and_final(http, path, max_tokens, stream=False)[1] == expected, max_tokens


def test_a_json_decode_error_names_no_param(http):
    """pydantic's loc of a JSON decode error is the byte offset (it was sent as ``param``)."""
    err = _assert_error(http.post(C, content=b'{"prompt": "x",, }', headers={"content-type": "application/json"}), 400)
    assert err["param"] is None and "JSON" in err["message"], err
    # the message says the body is not JSON, why and where (it read "15: JSON decode error")
    assert err["message"].startswith("the request body is not valid JSON: Expecting property name"), err
    assert "(at character 15)" in err["message"] and not err["message"].startswith("15:"), err


GUIDED = [
    ({"guided_choice": ["red", "green", 'say "blue"']}, r'red|green|say "blue"'),
    # float32 made 1e300 inf, the masked logits NaN, and the row sampled token 0 outside the choice
    ({"guided_choice": ["red", "green"], "temperature": 1e300}, r"red|green"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, r"yes|no"),
    ({"guided_grammar": 'start: "ab" | "cd" "e"*'}, r"ab|cde*"),
    ({"guided_grammar": 'root ::= "x" [0-9]'}, r"x[0-9]"),
    ({"structured_outputs": {"regex": "[a-c]{2}"}}, r"[a-c]{2}"),
    # SGLang's names (sglang-router's clients send them): they were logged and dropped (200, free text)
    ({"regex": "[a-c]{2}"}, r"[a-c]{2}"),
    ({"ebnf": 'root ::= "yes" | "no"'}, r"yes|no"),
]


@pytest.mark.parametrize("path", [C, CH])
@pytest.mark.parametrize("extra,pattern", GUIDED,
                         ids=["choice", "choice-temperature-1e300", "so-choice", "lark", "gbnf", "so-regex",
                              "sglang-regex", "sglang-ebnf"])
def test_guided_choice_and_grammar_constrain_the_output(http, path, extra, pattern):
    import re

    body = {"prompt": "x"} if path == C else {"messages": MSG}
    for seed in range(2):
        r = http.post(path, json={**body, "max_tokens": 12, "temperature": 1.0, "seed": seed, **extra})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text = choice["text"] if path == C else choice["message"]["content"]
        assert re.fullmatch(pattern, text), (extra, text)


_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CONSTRAINED = [
    (C, {"guided_json": {"type": "object"}}, "guided_json"),
    (C, {"guided_regex": "[a-z]+"}, "guided_regex"),
    (CH, {"guided_choice": ["yes", "no"]}, "guided_choice"),
    (CH, {"guided_grammar": 'start: "a"+'}, "guided_grammar"),
    (C, {"structured_outputs": {"regex": "[a-z]+"}}, "structured_outputs"),
    (CH, {"response_format": {"type": "json_object"}}, "response_format"),
    (CH, {"tools": [_TOOL], "tool_choice": "required"}, "tool_choice"),
    (CH, {"tools": [_TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
]


@pytest.mark.parametrize("path,extra,constraint", CONSTRAINED, ids=[f"{c}{i}" for i, (_, _, c) in enumerate(CONSTRAINED)])
def test_ignore_eos_with_an_output_constraint_is_400(server, http, path, extra, constraint):
    """The constraint's grammar ends the output once it is complete: it was ignored
    silently (200) before."""
    body = {"prompt": "x"} if path == C else {"messages": MSG}
    err = _assert_error(http.post(path, json={**body, "max_tokens": 8, **extra, "ignore_eos": True}), 400, "ignore_eos")
    assert f"ignore_eos cannot be combined with {constraint}" in err["message"], err
    assert server.engine.is_healthy


@pytest.mark.parametrize("path,extra,constraint", CONSTRAINED, ids=[f"{c}{i}" for i, (_, _, c) in enumerate(CONSTRAINED)])
def test_min_tokens_with_an_output_constraint_is_served(server, http, path, extra, constraint):
    """As vLLM (vllm-project/vllm#54218): min_tokens holds until the grammar allows only EOS
    (a 400 before)."""
    body = {"prompt": "x"} if path == C else {"messages": MSG}
    r = http.post(path, json={**body, "max_tokens": 8, "temperature": 0, **extra, "min_tokens": 2})
    assert r.status_code == 200, r.text
    assert server.engine.is_healthy


_BOOL_SCHEMA = {"type": "json_schema", "json_schema": {"name": "b", "schema": {"type": "boolean"}}}


def test_min_tokens_with_a_json_schema_is_200_and_the_schema_ends_the_output(http):
    """A vLLM script's min_tokens + response_format json_schema: a boolean is complete within
    5 tokens, before min_tokens = 8, and ends the output (the grammar wins), valid JSON."""
    r = http.post(CH, json={"messages": MSG, "max_tokens": 16, "min_tokens": 8, "temperature": 0,
                            "response_format": _BOOL_SCHEMA})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert isinstance(json.loads(choice["message"]["content"]), bool), choice
    assert r.json()["usage"]["completion_tokens"] < 8, r.json()


def test_min_tokens_with_a_regex_holds_until_reached(http):
    """min_tokens masks EOS while the grammar allows more, even when the model wants EOS."""
    eos = str(TINY_TEXT_VOCAB - 1)
    r = http.post(C, json={"prompt": "x", "max_tokens": 10, "min_tokens": 6, "temperature": 0,
                           "logit_bias": {eos: 100}, "structured_outputs": {"regex": "[a-z]+"}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert len(choice["text"]) >= 6 and choice["text"].isalpha(), choice


def test_a_tool_message_that_answers_no_call_is_400_naming_it_and_the_id(server, http):
    messages = [*MSG, {"role": "tool", "tool_call_id": "call_nope", "content": "18 C"}]
    err = _assert_error(http.post(CH, json={"messages": messages, "max_tokens": 2}), 400, "messages")
    assert "messages[1].tool_call_id 'call_nope' answers no tool call" in err["message"], err


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_more_than_128_tools_are_400_naming_tools_and_the_limit(server, http, tool_choice):
    """2,000 tools came back as a 400 quoting llguidance's refusal of the tools' grammar
    (with a listing of it); this server's 64 KiB body limit holds 300 small ones."""
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(300)]
    err = _assert_error(http.post(CH, json={"messages": MSG, "max_tokens": 2, "tools": tools, "tool_choice": tool_choice}),
                        400, "tools")
    assert "tools holds 300 tools; at most 128" in err["message"] and "llguidance" not in err["message"], err
    assert server.engine.is_healthy


@pytest.mark.parametrize("extra", [{"response_format": {"type": "json_object"}}, {"tool_choice": "none"},
                                   {"guided_regex": "[a-z]+"}, {}], ids=["response_format", "none", "guided", "auto"])
def test_a_tool_schema_the_grammar_engine_refuses_is_400_naming_tools(server, http, extra):
    """A tool whose parameters are no JSON schema ("type": "objectx") was refused under
    tool_choice "auto" (its calls' constraint compiles it) and accepted with 200 where no
    constraint compiles it (the request's own response_format, tool_choice "none")."""
    tools = [_TOOL, {"type": "function", "function": {"name": "bad", "parameters": {"type": "objectx"}}}]
    err = _assert_error(http.post(CH, json={"messages": MSG, "max_tokens": 2, "tools": tools, **extra}), 400, "tools")
    assert "objectx" in err["message"], err
    r = http.post(CH, json={"messages": MSG, "max_tokens": 2, "tools": [_TOOL], "temperature": 0, **extra})
    assert r.status_code == 200, r.text


def test_ignore_eos_with_tools_under_auto_is_served(http):
    """tool_choice "auto" leaves the text free (a structural tag): ignore_eos holds (the
    grammar took the first EOS as its end before), and so does min_tokens."""
    eos = str(TINY_TEXT_VOCAB - 1)
    for extra in ({"ignore_eos": True, "logit_bias": {eos: 100}}, {"min_tokens": 3}):
        r = http.post(CH, json={"messages": MSG, "max_tokens": 3, "tools": [_TOOL], "temperature": 0, **extra})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3, (extra, r.json())


UNSATISFIABLE = [
    (C, {"guided_regex": "a[^\\s\\S]"}, "guided_regex"),
    (CH, {"guided_grammar": "start: /[^\\s\\S]/"}, "guided_grammar"),
    (C, {"structured_outputs": {"regex": "[^\\s\\S]"}}, "structured_outputs"),
    (CH, {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "integer", "minimum": 5, "maximum": 2}}}}, "response_format"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path,extra,param", UNSATISFIABLE, ids=[f"{p}{i}" for i, (_, _, p) in enumerate(UNSATISFIABLE)])
def test_an_unsatisfiable_constraint_is_400_naming_it(server, http, path, extra, param, stream):
    """It answered 200 with empty text before (llguidance let only EOS through)."""
    body = {"prompt": "x"} if path == C else {"messages": MSG}
    err = _assert_error(http.post(path, json={**body, "max_tokens": 8, "stream": stream, **extra}), 400, param)
    assert "unsatisfiable" in err["message"] or "Unsatisfiable" in err["message"], err
    assert server.engine.is_healthy


@pytest.mark.parametrize("path", [C, CH])
def test_a_grammar_that_dead_ends_during_generation_fails_the_request_visibly(server, http, path):
    """After "a" no token fits: the request fails (400 naming the field; an error event in
    a stream) instead of ending with "stop" and a cut output; the engine goes on."""
    body = {"prompt": "x"} if path == C else {"messages": MSG}
    body = {**body, "max_tokens": 8, "guided_grammar": 'start: "a" b\nb: b "x"'}
    err = _assert_error(http.post(path, json=body), 400, "guided_grammar")
    assert "guided_grammar: no output satisfies the constraint" in err["message"], err
    r = http.post(path, json={**body, "stream": True})
    assert r.status_code == 200
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "guided_grammar: no output satisfies" in json.loads(events[-2])["error"]["message"]
    assert server.engine.is_healthy
    _wait_idle(server)


@pytest.mark.parametrize("path,extra,param", [
    (C, {"guided_regex": "a{1000000}"}, "guided_regex"),
    (CH, {"structured_outputs": {"regex": "a{1000000}"}}, "structured_outputs"),
], ids=["guided_regex", "structured_outputs"])
def test_a_regex_too_complex_for_the_grammar_engine_is_400_naming_it(server, http, path, extra, param):
    """It was accepted, then failed during generation with "token 64 does not satisfy the
    constraint"; now it is refused before anything runs, and the engine goes on."""
    body = {"prompt": "x"} if path == C else {"messages": MSG}
    err = _assert_error(http.post(path, json={**body, "max_tokens": 4, **extra}), 400, param)
    assert "too complex for the grammar engine" in err["message"], err
    assert server.engine.is_healthy
    assert _completion(http, prompt="x", max_tokens=2)["choices"][0]["text"] is not None


def test_huge_top_k_samples_as_top_k_off(server, http):
    """top_k = 2**63 used to crash the sampler's tensor build and stop the engine."""
    base = {"prompt": "Hello", "max_tokens": 6, "temperature": 1.0, "seed": 3, "ignore_eos": True}
    off = _completion(http, **base)["choices"][0]["text"]
    for top_k in (2**63, 2**63 - 1, 10**30):
        assert _completion(http, **base, top_k=top_k)["choices"][0]["text"] == off
    r = http.post(CH, json={"messages": MSG, "max_tokens": 3, "top_k": 2**63})
    assert r.status_code == 200, r.text
    with http.stream("POST", C, json={**base, "top_k": 2**63, "stream": True}) as r:
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events)
    assert "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]) == off
    assert server.engine.is_healthy


# ---------------------------------------------------------------------------- unsupported fields
UNSUPPORTED = [
    (CH, {"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    (CH, {"function_call": {"name": "f"}}, "function_call"),
    (C, {"best_of": 2}, "best_of"),
    (C, {"suffix": "the end"}, "suffix"),
    (CH, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "messages"),
    (CH, {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AA", "format": "wav"}}]}]}, "messages"),
    (CH, {"messages": [{"role": "user", "content": [{"text": "no type"}]}]}, "messages"),
    (CH, {"messages": [{"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}, *MSG]},
     "messages"),
    (CH, {"response_format": {"type": "grammar", "grammar": "x"}}, "response_format"),
    (CH, {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    (CH, {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    (CH, {"modalities": ["text", "audio"]}, "modalities"),
    (CH, {"web_search_options": {}}, "web_search_options"),
    (CH, {"reasoning_effort": "high"}, "reasoning_effort"),
    # the OpenAI SDK's moderation (block mode stops a flagged reply): was logged and dropped
    (CH, {"moderation": {"model": "omni-moderation-latest", "policy": {"output": {"mode": "block"}}}}, "moderation"),
    (C, {"use_beam_search": True}, "use_beam_search"),
    (C, {"prompt_logprobs": 1}, "prompt_logprobs"),
    # SGLang's (sglang-router's clients send them): logged and dropped (200) before
    (C, {"lora_path": "/adapters/a"}, "lora_path"),
    (CH, {"lora_path": "/adapters/a"}, "lora_path"),
    (C, {"no_stop_trim": True}, "no_stop_trim"),
    (CH, {"no_stop_trim": True}, "no_stop_trim"),
    (C, {"return_hidden_states": True}, "return_hidden_states"),
    (CH, {"return_hidden_states": True}, "return_hidden_states"),
    (C, {"stop_regex": "[0-9]"}, "stop_regex"),
]


@pytest.mark.parametrize("path,extra,param", [(C, {"regex": "[a-z]+", "guided_regex": "[0-9]+"}, "regex"),
                                              (CH, {"ebnf": 'root ::= "a"', "guided_choice": ["b"]}, "ebnf")])
def test_sglangs_constraint_with_another_one_is_400_naming_it(http, path, extra, param):
    body = {"prompt": "x"} if path == C else {"messages": MSG}
    err = _assert_error(http.post(path, json={**body, "max_tokens": 2, **extra}), 400, param)
    assert "cannot be combined" in err["message"], err


@pytest.mark.parametrize("path,extra,param", UNSUPPORTED, ids=[p for _, _, p in UNSUPPORTED])
def test_unimplemented_fields_are_refused_by_name(http, path, extra, param):
    body = {"prompt": "x"} if path == C else {"messages": MSG}
    err = _assert_error(http.post(path, json={**body, "max_tokens": 2, **extra}), 400, param)
    assert "support" in err["message"] or "Input should be" in err["message"], err


@pytest.mark.parametrize(
    "path,extra",
    [
        (C, {"best_of": 1, "suffix": "", "user": "u", "store": False, "metadata": {"k": "v"}}),
        (CH, {"tools": [], "tool_choice": "none", "parallel_tool_calls": False, "modalities": ["text"],
              "stream_options": None, "service_tier": "auto"}),
        (CH, {"messages": [{"role": "user", "content": "Hi", "name": "ann"}]}),
        # what a Rust router (sgl-router) serializes for fields its client left unset
        (C, {"regex": None, "ebnf": None, "json_schema": None, "lora_path": None, "session_params": None,
             "no_stop_trim": False, "return_hidden_states": False}),
        (CH, {"regex": None, "ebnf": None, "lora_path": None, "no_stop_trim": False, "return_hidden_states": False,
              "separate_reasoning": True, "stream_reasoning": True}),
    ],
    ids=["completions", "chat", "message-name", "sglang-defaults-completions", "sglang-defaults-chat"],
)
def test_fields_that_change_nothing_are_accepted(http, path, extra):
    body = {"prompt": "x"} if path == C else {"messages": MSG}
    r = http.post(path, json={**body, "max_tokens": 2, **extra})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "path,extra",
    [
        (C, {"stream": None, "n": None, "echo": None, "presence_penalty": None, "frequency_penalty": None,
             "min_tokens": None, "ignore_eos": None, "skip_special_tokens": None}),
        (CH, {"stream": None, "n": None, "logprobs": None, "presence_penalty": None, "frequency_penalty": None,
              "include_stop_str_in_output": None}),
    ],
    ids=["completions", "chat"],
)
def test_an_explicit_null_is_the_field_left_unset(http, path, extra):
    # OpenAI's API declares these nullable (and vLLM takes null): null is the default.
    body = {"prompt": "x"} if path == C else {"messages": MSG}
    r = http.post(path, json={**body, "max_tokens": 2, **extra})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/json") and len(r.json()["choices"]) == 1, r.text


def test_a_null_for_a_required_field_is_still_refused(http):
    _assert_error(http.post(CH, json={"messages": None, "max_tokens": 2}), 400, "messages")


@pytest.mark.parametrize("key", ["", " ", ("k", " "), ()])
def test_an_empty_api_key_is_refused(key):
    # An empty key would let "Authorization: Bearer " and a request without x-api-key through.
    from kvflow.engine.async_engine import AsyncLLMEngine
    from kvflow.entrypoints.openai.server import build_app

    engine = tiny_engine(tokenizer=tiny_tokenizer(), config=tiny_model_config(vocab_size=TINY_TEXT_VOCAB))
    with pytest.raises(ValueError, match="api_key"):
        build_app(AsyncLLMEngine(engine, "tiny"), "tiny", engine.scheduler_config.max_model_len, api_key=key)


def test_every_served_name_is_listed_and_retrievable():
    """``--served-model-name tiny other``: ``/v1/models`` listed only "tiny" and
    ``/v1/models/other`` was 404, though requests naming "other" were served (vLLM lists
    each name). An alias that is no served name (the ``--model`` path) stays unlisted."""
    s = TinyServer(served_model_names=("other", "tiny"))
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            ids = [card["id"] for card in c.get("/v1/models").json()["data"]]
            assert ids == ["tiny", "other"]
            assert c.get("/v1/models/other").json()["id"] == "other"
            assert c.get("/v1/models//models/tiny").json()["id"] == "tiny"  # an alias: the served id's card
            r = c.post("/v1/completions", json={"model": "other", "prompt": "a", "max_tokens": 1})
            assert r.status_code == 200 and r.json()["model"] == "tiny"
    finally:
        s.stop()


def test_unknown_fields_are_accepted_and_logged_once(http, caplog):
    with caplog.at_level(logging.WARNING, logger="kvflow.entrypoints.openai.protocol"):
        for _ in range(3):
            _completion(http, zzz_not_a_field=1)
    warnings = [r for r in caplog.records if "zzz_not_a_field" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]


# ---------------------------------------------------------------------------- size limit
def _raw_exchange(port: int, data: bytes, read_s: float = 10.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=read_s) as s:
        s.sendall(data)
        chunks = []
        try:
            while chunk := s.recv(65536):
                chunks.append(chunk)
        except TimeoutError:
            pass
        return b"".join(chunks)


def _read_response(port: int, data: bytes, read_s: float = 10.0) -> bytes:
    """The first complete response (its headers and Content-Length bytes) to ``data``."""
    with socket.create_connection(("127.0.0.1", port), timeout=read_s) as s:
        s.sendall(data)
        reply = b""
        while b"\r\n\r\n" not in reply or len(reply.partition(b"\r\n\r\n")[2]) < int(
                reply.lower().partition(b"content-length: ")[2].split(b"\r\n")[0] or 0):
            chunk = s.recv(65536)
            assert chunk, reply
            reply += chunk
        return reply


def test_body_over_the_limit_is_413_from_its_content_length(server):
    """Only the headers are sent: the 413 comes without reading (or waiting for) the body."""
    head = (f"POST {C} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {MAX_REQUEST_BYTES + 1}\r\n\r\n").encode()  # fmt: skip
    t0 = time.monotonic()
    reply = _read_response(server.port, head)
    assert time.monotonic() - t0 < READ_TIMEOUT_S  # answered, not timed out
    status, _, rest = reply.partition(b"\r\n")
    assert b" 413 " in status, reply
    headers, _, body = rest.partition(b"\r\n\r\n")
    assert b"connection: close" in headers.lower() and b"application/json" in headers.lower(), headers
    err = json.loads(body)["error"]
    assert err["code"] == 413 and str(MAX_REQUEST_BYTES) in err["message"], err


def test_a_client_that_sends_its_whole_body_first_reads_the_413():
    """urllib sends the whole body before reading the answer: the server used to close the
    socket after the 413 with the body unread, and urllib got a connection reset."""
    import urllib.error
    import urllib.request

    server = TinyServer(max_request_bytes=1024)
    try:
        body = json.dumps({"prompt": "x" * (8 * 2**20)}).encode()  # 8 MiB: more than the socket buffers
        request = urllib.request.Request(server.url + C, data=body, headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request, timeout=30)
        assert info.value.code == 413 and json.loads(info.value.read())["error"]["code"] == 413
        r = httpx.post(server.url + C, json={"prompt": "Hello", "max_tokens": 2})  # and the server serves on
        assert r.status_code == 200, r.text
    finally:
        server.stop()


def test_chunked_body_over_the_limit_is_413(http):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(MAX_REQUEST_BYTES // 1024 + 1):
            yield b"x" * 1024
        yield b'"}'

    _assert_error(http.post(C, content=chunks(), headers={"content-type": "application/json"}), 413)


def test_body_under_the_limit_is_served(http):
    r = http.post(C, json={"prompt": "word " * 30, "max_tokens": 1, "filler": "x" * (MAX_REQUEST_BYTES - 1000)})
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------------------- slow clients
def _closed_after(port: int, sends: list[tuple[float, bytes]], limit_s: float = 10.0) -> tuple[float, bytes]:
    """Open a connection, send each (delay, bytes), then read until the server closes it.

    Returns: seconds from the connection to its close, and what the server sent."""
    t0 = time.monotonic()
    received = b""
    with socket.create_connection(("127.0.0.1", port), timeout=limit_s) as s:
        s.settimeout(0.05)
        pending = list(sends)
        while time.monotonic() - t0 < limit_s:
            if pending and time.monotonic() - t0 >= pending[0][0]:
                try:
                    s.sendall(pending.pop(0)[1])
                except (BrokenPipeError, ConnectionResetError):
                    return time.monotonic() - t0, received
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                continue
            except ConnectionResetError:
                return time.monotonic() - t0, received
            if not chunk:
                return time.monotonic() - t0, received
            received += chunk
    raise AssertionError(f"connection still open after {limit_s} s; received {received[:200]!r}")


def _request(body: bytes = b'{"prompt": "Hi", "max_tokens": 1}') -> bytes:
    return (f"POST {C} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body  # fmt: skip


def test_a_connection_that_sends_nothing_is_closed(server):
    elapsed, received = _closed_after(server.port, [])
    assert READ_TIMEOUT_S * 0.8 <= elapsed and received == b""


def test_slowloris_headers_are_cut_off_although_bytes_keep_coming(server):
    head = _request()[:60]
    drip = [(0.25 * i, head[i : i + 1]) for i in range(len(head))]  # one byte every 0.25 s: 15 s in all
    elapsed, received = _closed_after(server.port, drip)
    assert READ_TIMEOUT_S * 0.8 <= elapsed < 5 and received == b"", (elapsed, received)


def test_a_half_sent_body_is_cut_off(server):
    request = _request(b'{"prompt": "Hi", "max_tokens": 1, "pad": "' + b"x" * 200 + b'"}')
    elapsed, _ = _closed_after(server.port, [(0, request[:-100])])
    assert READ_TIMEOUT_S * 0.8 <= elapsed < 5, elapsed
    assert server.engine.is_healthy
    _wait_idle(server)


def test_an_idle_keep_alive_connection_is_closed_and_a_slow_second_request_too(server):
    elapsed, received = _closed_after(server.port, [(0, _request())])
    assert received.startswith(b"HTTP/1.1 200") and KEEP_ALIVE_S * 0.8 <= elapsed < 5, (elapsed, received[:100])
    second = _request()[:40]
    drip = [(0, _request())] + [(0.3 + 0.25 * i, second[i : i + 1]) for i in range(len(second))]
    elapsed, received = _closed_after(server.port, drip)
    assert received.count(b"HTTP/1.1 200") == 1 and elapsed < 0.3 + READ_TIMEOUT_S + 4, (elapsed, received[:100])


def test_a_prompt_request_on_a_keep_alive_connection_is_served(server):
    """The deadline does not cut a client that sends its requests at once, one after the other."""
    with httpx.Client(base_url=server.url, timeout=30) as c:
        for _ in range(3):
            assert c.post(C, json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
            time.sleep(KEEP_ALIVE_S / 3)


# ---------------------------------------------------------------------------- injected faults
def _inject_prepare_fault(monkeypatch, exc_type=RuntimeError):
    from kvflow.worker.model_runner import ModelRunner

    original = ModelRunner.prepare_inputs

    def prepare(self, out):
        if any(r.prompt_token_ids[:2] == MARK for r in map(self.requests.get, out.scheduled_req_ids)):
            raise exc_type("injected fault")
        return original(self, out)

    monkeypatch.setattr(ModelRunner, "prepare_inputs", prepare)


@pytest.mark.parametrize("exc_type,status,err_type", [(RuntimeError, 500, "InternalServerError"),
                                                      (ValueError, 400, "BadRequestError")])
def test_a_request_that_fails_in_the_engine_fails_alone(server, monkeypatch, exc_type, status, err_type):
    """The marked request gets an OpenAI-shaped error (non-streamed: the HTTP status; streamed:
    an error event before [DONE]) while concurrent requests complete, and later ones too."""
    _inject_prepare_fault(monkeypatch, exc_type)
    good = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    marked = {"prompt": [*MARK, 1, 2, 3], **good}

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            async def stream(body):
                async with c.stream("POST", C, json={**body, "stream": True}) as r:
                    assert r.status_code == 200
                    return [line async for line in r.aiter_lines() if line]

            return await asyncio.gather(
                c.post(C, json=marked), stream(marked),
                *(c.post(C, json={"prompt": f"Good {i}", **good}) for i in range(3)),
                stream({"prompt": "Good s", **good}),
                c.post(CH, json={"messages": MSG, **good}),
            )

    bad, bad_stream, *goods, good_stream, chat = asyncio.run(main())
    err = _assert_error(bad, status)
    assert err["type"] == err_type and "injected fault" in err["message"], err
    assert bad_stream[-1] == "data: [DONE]"
    event = json.loads(bad_stream[-2][len("data: "):])
    assert event["error"]["code"] == status and "injected fault" in event["error"]["message"], event
    for r in [*goods, chat]:
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text
    assert good_stream[-1] == "data: [DONE]" and not any('"error"' in e for e in good_stream)
    _wait_idle(server)
    assert _completion(server_http := httpx.Client(base_url=server.url, timeout=60))["usage"]["completion_tokens"] >= 1
    server_http.close()
    metrics = httpx.get(server.url + "/metrics").text
    assert 'kvflow:request_failure_total{model_name="tiny"}' in metrics


def test_a_handler_fault_is_an_openai_shaped_500(server, http, monkeypatch):
    from kvflow.entrypoints.openai.serving import OpenAIServing

    def broken(self, req):
        raise KeyError("injected handler fault")

    monkeypatch.setattr(OpenAIServing, "_chat_prompt", broken)
    err = _assert_error(http.post(CH, json={"messages": MSG, "max_tokens": 2}), 500)
    assert err["type"] == "InternalServerError" and "injected handler fault" in err["message"]
    assert http.get("/health").status_code == 200


def test_a_dead_engine_fails_requests_with_503_and_health_says_so(monkeypatch):
    from kvflow.model.llama import LlamaForCausalLM

    def forward(model, *args, **kwargs):
        raise RuntimeError("injected: the device is gone")

    s = TinyServer()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert c.get("/health").status_code == 200
            monkeypatch.setattr(LlamaForCausalLM, "forward", forward)
            err = _assert_error(c.post(C, json={"prompt": "Hi", "max_tokens": 2}), 503)
            assert "engine failed" in err["message"]
            err = _assert_error(c.get("/health"), 503)
            assert "device is gone" in err["message"] or "unusable" in err["message"], err
            _assert_error(c.post(CH, json={"messages": MSG, "max_tokens": 2}), 503)
    finally:
        s.stop()


STEP_S = 0.25  # each injected forward's duration


def test_a_stop_during_a_long_prefill_fails_the_open_requests_and_waits_for_one_step(monkeypatch):
    """Told to stop (SIGTERM sets ``should_exit``) while a long prompt prefills in chunks:
    the server fails the open requests at once (an error event in the stream, 503 for the
    other one) and stops within about one step; its engine and preparation threads are
    gone. It used to wait for every open request to finish (the prefill, then all tokens)."""
    from kvflow.model.llama import LlamaForCausalLM

    original = LlamaForCausalLM.forward
    prefilling = threading.Event()

    def slow_forward(model, input_ids, *args, **kwargs):
        if input_ids.numel() > 1:
            prefilling.set()
        time.sleep(STEP_S)
        return original(model, input_ids, *args, **kwargs)

    monkeypatch.setattr(LlamaForCausalLM, "forward", slow_forward)
    # 16 tokens a step: the 200-token prompt prefills in 13 steps (> 3 s), then 40 tokens
    s = TinyServer(engine_kwargs={"max_num_batched_tokens": 16})
    long_prompt = "x" * 200
    results: dict[str, object] = {}

    def stream():
        body = {"prompt": long_prompt, "max_tokens": 40, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", s.url + C, json=body, timeout=60) as r:
            results["stream"] = (r.status_code, [line for line in r.iter_lines() if line])

    def whole():
        body = {"messages": MSG, "max_tokens": 40, "ignore_eos": True}
        results["whole"] = httpx.post(s.url + CH, json=body, timeout=60)

    clients = [threading.Thread(target=stream), threading.Thread(target=whole)]
    try:
        clients[0].start()
        assert prefilling.wait(30)
        clients[1].start()
        time.sleep(2 * STEP_S)  # the second request is queued behind the prefill
        assert s.engine.get_stats()["num_running"] + s.engine.get_stats()["num_waiting"] == 2
        t0 = time.monotonic()
        s.server.should_exit = True
        s.thread.join(30)
        stop_s = time.monotonic() - t0
    finally:
        s.server.should_exit = True
        for c in clients:
            c.join(30)
    assert not s.thread.is_alive()
    assert stop_s < 8 * STEP_S, f"the stop took {stop_s:.1f} s"
    status, lines = results["stream"]
    assert status == 200 and lines[-1] == "data: [DONE]", lines
    error = json.loads(lines[-2][len("data: "):])["error"]
    assert error["code"] == 503 and "shutting down" in error["message"], error
    err = _assert_error(results["whole"], 503)
    assert "shutting down" in err["message"], err
    assert not s.engine._thread.is_alive()
    deadline = time.monotonic() + 5
    while any(t.is_alive() for t in s.engine._executor._threads) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(t.is_alive() for t in s.engine._executor._threads)


# ---------------------------------------------------------------------------- the event loop
def _health_latencies(url: str, stop: threading.Event) -> list[float]:
    latencies = []
    with httpx.Client(base_url=url, timeout=30) as c:
        while not stop.is_set():
            t0 = time.monotonic()
            assert c.get("/health").status_code == 200
            latencies.append(time.monotonic() - t0)
            time.sleep(0.02)
    return latencies


def _during(url: str, action) -> list[float]:
    """/health latencies measured while ``action()`` runs in another thread."""
    stop = threading.Event()
    result: list[list[float]] = []
    poller = threading.Thread(target=lambda: result.append(_health_latencies(url, stop)))
    poller.start()
    try:
        action()
    finally:
        stop.set()
        poller.join(30)
    return result[0]


SLOW_S = 3.0  # each injected stall; /health must answer within half of it, at worst


def test_health_does_not_wait_for_a_long_step_nor_for_requests_arriving_during_it(server, monkeypatch):
    from kvflow.model.llama import LlamaForCausalLM

    original = LlamaForCausalLM.forward
    entered = threading.Event()

    def slow_forward(model, input_ids, *args, **kwargs):
        if input_ids.numel() > 20 and not entered.is_set():  # the long prompt's prefill only
            entered.set()
            time.sleep(SLOW_S)
        return original(model, input_ids, *args, **kwargs)

    monkeypatch.setattr(LlamaForCausalLM, "forward", slow_forward)

    def action():
        with httpx.Client(base_url=server.url, timeout=60) as c:
            long = threading.Thread(target=lambda: c.post(C, json={"prompt": "x" * 40, "max_tokens": 2}))
            long.start()
            assert entered.wait(30)
            # Requests, aborts and metrics arriving during the step must not stall the loop.
            with httpx.Client(base_url=server.url, timeout=60) as c2:
                with c2.stream("POST", C, json={"prompt": "Hi", "max_tokens": 50, "stream": True}):
                    pass  # closed at once: an abort
                metrics = c2.get("/metrics").text
                others = [threading.Thread(target=lambda: c2.post(C, json={"prompt": "Hi", "max_tokens": 2}))
                          for _ in range(3)]
                for t in others:
                    t.start()
                for t in [long, *others]:
                    t.join(60)
            assert 'kvflow:num_requests_running{model_name="tiny"} 1.0' in metrics, metrics  # real during the step

    latencies = _during(server.url, action)
    assert len(latencies) >= 10 and max(latencies) < SLOW_S / 2, sorted(latencies)[-5:]


@pytest.mark.parametrize("what", ["tokenizer", "template", "grammar"])
def test_preparation_runs_off_the_loop(server, monkeypatch, what):
    """Tokenization, the chat template and grammar compilation are slow for big inputs (a
    10 MB prompt, a first guided request): each is stalled here, and /health still answers."""
    from kvflow.sample.guided import GrammarCompiler

    tok = server.engine.tokenizer
    target, name = {"tokenizer": (tok, "encode"), "template": (tok, "apply_chat_template"),
                    "grammar": (GrammarCompiler, "compile")}[what]  # fmt: skip
    original = getattr(target, name)
    called = threading.Event()

    def slow(*args, **kwargs):
        called.set()
        time.sleep(SLOW_S)
        return original(*args, **kwargs)

    monkeypatch.setattr(target, name, slow if what != "grammar" else lambda self, p: slow(self, p))
    body = {"messages": MSG, "max_tokens": 2} if what == "template" else {"prompt": "Hi", "max_tokens": 2}
    if what == "grammar":
        body["guided_regex"] = "[ab]+"
    path = CH if what == "template" else C
    responses = []
    latencies = _during(server.url, lambda: responses.append(httpx.post(server.url + path, json=body, timeout=60)))
    assert called.is_set() and responses[0].status_code == 200, responses[0].text
    assert len(latencies) >= 10 and max(latencies) < SLOW_S / 2, sorted(latencies)[-5:]


def test_a_bad_schema_is_400_before_any_stream_byte(http):
    r = http.post(C, json={"prompt": "x", "max_tokens": 2, "stream": True, "guided_json": {"type": "nonsense"}})
    assert r.headers["content-type"].startswith("application/json")
    _assert_error(r, 400, "guided_json")


# ---------------------------------------------------------------------------- the queue
def test_a_multi_prompt_request_refused_with_429_runs_none_of_its_prompts():
    s = TinyServer(max_queue_len=2, engine_kwargs={"max_num_seqs": 1})
    step = s.engine.engine.step

    def slow_step(*args, **kwargs):  # so that "first" (200 tokens) outlasts the test's steps
        time.sleep(0.02)
        return step(*args, **kwargs)

    s.engine.engine.step = slow_step
    try:
        async def main():
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
                long = {"max_tokens": 200, "ignore_eos": True, "stream": True}
                async with c.stream("POST", C, json={"prompt": "first", **long}) as running:
                    lines = running.aiter_lines()
                    while not (await anext(lines)).startswith("data:"):
                        pass
                    async with c.stream("POST", C, json={"prompt": "second", **long}) as waiting:
                        assert waiting.status_code == 200
                        deadline = time.monotonic() + 30
                        while s.engine.engine.get_stats()["num_waiting"] != 1:
                            assert time.monotonic() < deadline
                            await asyncio.sleep(0.02)
                        before = s.engine.engine.get_stats()
                        refused = await c.post(C, json={"prompt": ["a", "b"], "max_tokens": 2})
                        after = s.engine.engine.get_stats()
                        assert refused.status_code == 429, refused.text
                        assert refused.headers["retry-after"] == "1"
                        assert refused.json()["error"]["type"] == "RateLimitError"
                        # none of its two prompts was queued
                        assert after["num_waiting"] == before["num_waiting"] == 1, (before, after)
                        assert len(s.engine.engine._states) == 2
                        # one place is left: a one-prompt request is accepted
                        fits = asyncio.create_task(c.post(C, json={"prompt": "c", "max_tokens": 2}))
                        await asyncio.sleep(0.3)
                        over = await c.post(C, json={"prompt": "d", "max_tokens": 2})
                        assert over.status_code == 429, over.text
                # the two streams are closed (aborted): the accepted request runs
                return await asyncio.wait_for(fits, 60)

        fits = asyncio.run(main())
        assert fits.status_code == 200, fits.text
    finally:
        s.stop()


def test_more_prompts_than_the_queue_holds_is_400_not_429():
    # 4 prompts can never fit a queue of 3: retrying (429 + Retry-After) would loop forever
    s = TinyServer(max_queue_len=3)
    try:
        r = httpx.post(s.url + C, json={"prompt": ["a", "b", "c", "d"], "max_tokens": 2}, timeout=60)
        err = _assert_error(r, 400, "prompt")
        assert "retry-after" not in r.headers
        assert "4 prompts" in err["message"] and "at most 3" in err["message"], err
        assert not s.engine._unstarted and not s.engine._streams  # none queued
        r = httpx.post(s.url + C, json={"prompt": ["a", "b", "c"], "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text  # exactly the limit fits
    finally:
        s.stop()


# ---------------------------------------------------------------------------- api key, names
@pytest.fixture(scope="module")
def key_servers():
    closed, metrics_open = TinyServer(api_key=API_KEY), TinyServer(api_key=API_KEY, metrics_need_key=False)
    yield closed, metrics_open
    closed.stop()
    metrics_open.stop()


@pytest.mark.parametrize(
    "path,closed_status,open_status",
    [("/health", 200, 200), ("/metrics", 401, 200), ("/get_load", 401, 200), ("/docs", 401, 401),
     ("/openapi.json", 401, 401), ("/redoc", 401, 401), ("/v1/models", 401, 401), ("/no/such/path", 401, 401)],
)
def test_api_key_guards_every_path_but_health(key_servers, path, closed_status, open_status):
    closed, metrics_open = key_servers
    assert httpx.get(closed.url + path).status_code == closed_status
    assert httpx.get(metrics_open.url + path).status_code == open_status
    if closed_status == 401:
        _assert_error(httpx.get(closed.url + path), 401)
        r = httpx.get(closed.url + path, headers={"Authorization": f"Bearer {API_KEY}"})
        assert r.status_code == (404 if path == "/no/such/path" else 200)


def test_several_api_keys_each_open_the_server():
    """vLLM's ``--api-key k1 k2``: any of them is accepted (kvflow took one key, and the
    second became the MODEL argument or an unrecognized argument)."""
    server = TinyServer(api_key=("k1", "k2"))
    try:
        for key in ("k1", "k2"):
            assert httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        _assert_error(httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer k3"}), 401)
        _assert_error(httpx.get(server.url + "/v1/models"), 401)
        messages = server.url + "/v1/messages/count_tokens"
        body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
        assert httpx.post(messages, json=body, headers={"x-api-key": "k2"}).status_code == 200
    finally:
        server.stop()


def test_model_names(http):
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["tiny"]
    assert _completion(http, model="/models/tiny")["model"] == "tiny"  # the --model value is an alias
    _assert_error(http.post(C, json={"prompt": "x", "model": "other"}), 404, "model")


def test_a_model_is_retrieved_by_its_id(http):
    # the OpenAI SDK's client.models.retrieve("tiny") is GET /v1/models/tiny
    listed = http.get("/v1/models").json()["data"][0]
    r = http.get("/v1/models/tiny")
    assert r.status_code == 200, r.text
    card = r.json()
    assert {k: v for k, v in card.items() if k != "created"} == {k: v for k, v in listed.items() if k != "created"}
    assert card["object"] == "model" and card["id"] == "tiny"
    err = _assert_error(http.get("/v1/models/other"), 404, "model")
    assert err["type"] == "NotFoundError" and "other" in err["message"]
    _assert_error(http.get("/v1/models/org/other"), 404, "model")  # ids may hold a slash


def test_a_model_is_retrieved_by_any_name_requests_may_use(http):
    # "/models/tiny" (the --model value; --served-model-name's later names likewise) is accepted
    # as a request's model, so models.retrieve of it finds the model (it was a 404): the card
    # /v1/models lists, under the served id (a path is never echoed)
    assert _completion(http, model="/models/tiny")["model"] == "tiny"
    r = http.get("/v1/models//models/tiny")
    assert r.status_code == 200, r.text
    assert r.json()["id"] == "tiny"


@pytest.mark.parametrize(
    "model,name",
    [("smollm2-135m", "smollm2-135m"), ("/data/models/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct"),
     ("/data/models/SmolLM2-135M-Instruct/", "SmolLM2-135M-Instruct"), ("/w/qwen2.5-0.5b-q4_0.gguf", "qwen2.5-0.5b-q4_0"),
     ("./local-model", "local-model")],
)
def test_default_served_name_never_echoes_a_path(model, name):
    assert default_served_name(model) == name


# ---------------------------------------------------------------------------- generation defaults
def test_generation_config_defaults_apply_to_unset_fields():
    """A model's generation_config.json (temperature 0, max_new_tokens 5 here) fills the
    fields a request leaves unset; a request that sets them wins."""
    s = TinyServer(engine_kwargs={"generation_defaults": {"temperature": 0.0, "max_tokens": 5}})
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            unset = c.post(C, json={"prompt": "Hello", "ignore_eos": True}).json()
            greedy = c.post(C, json={"prompt": "Hello", "ignore_eos": True, "temperature": 0, "max_tokens": 5}).json()
            assert unset["usage"]["completion_tokens"] == 5
            assert unset["choices"][0]["text"] == greedy["choices"][0]["text"]
            chat = c.post(CH, json={"messages": MSG, "ignore_eos": True}).json()
            assert chat["usage"]["completion_tokens"] == 5
            explicit = c.post(C, json={"prompt": "Hello", "ignore_eos": True, "max_tokens": 7}).json()
            assert explicit["usage"]["completion_tokens"] == 7
    finally:
        s.stop()


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                                       ("/v1/completions", {"prompt": "hi"})])
def test_a_stream_of_n_choices_finishes_each_once(http, path, body):
    """n > 1 with stop strings, so the choices finish at different steps: the engine's later
    outputs still carry a finished choice, and the stream must not finish it again (nor count
    its tokens twice in usage); the usage equals the whole response's."""
    lengths_differ = False
    for seed in range(4):
        req = {**body, "n": 3, "max_tokens": 12, "temperature": 1.0, "seed": seed, "stop": ["a", "e"]}
        finishes: dict[int, int] = {}
        with http.stream("POST", path, json={**req, "stream": True, "stream_options": {"include_usage": True}}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        for chunk in chunks:
            for choice in chunk["choices"]:
                if choice.get("finish_reason"):
                    finishes[choice["index"]] = finishes.get(choice["index"], 0) + 1
        whole = http.post(path, json=req).json()
        assert finishes == {0: 1, 1: 1, 2: 1}, (seed, finishes)
        assert chunks[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"], seed
        lengths = {len(c.get("text") or c.get("message", {}).get("content") or "") for c in whole["choices"]}
        lengths_differ |= len(lengths) > 1
    assert lengths_differ  # some choice finished before the others


@pytest.mark.parametrize("path,body,logprobs", [(CH, {"messages": MSG}, {"logprobs": True}),
                                                (C, {"prompt": "hi"}, {"logprobs": 0})])
@pytest.mark.parametrize("want_logprobs", [False, True])
def test_every_choice_carries_finish_reason_and_logprobs(http, path, body, logprobs, want_logprobs):
    """OpenAI's schema requires ``finish_reason`` and ``logprobs`` on every choice (null when
    unset: every streamed chunk's ``finish_reason`` but the last, ``logprobs`` not asked for), as
    OpenAI and vLLM send them; the chunks and responses left them out."""
    req = {**body, "n": 2, "max_tokens": 6, "temperature": 1.0, "seed": 0, **(logprobs if want_logprobs else {})}
    with http.stream("POST", path, json={**req, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    choices = [c for chunk in chunks for c in chunk["choices"]]
    assert len(choices) > 4, chunks
    for choice in choices:
        assert "finish_reason" in choice and "logprobs" in choice, choice
        if not want_logprobs:
            assert choice["logprobs"] is None, choice
    finishes = [c["finish_reason"] for c in choices if c["finish_reason"] is not None]
    assert len(finishes) == 2, choices  # one per choice, the rest null
    whole = http.post(path, json=req)
    assert whole.status_code == 200, whole.text
    for choice in whole.json()["choices"]:
        assert choice["finish_reason"] is not None and "logprobs" in choice, choice
        assert (choice["logprobs"] is not None) == want_logprobs, choice


def test_the_server_freezes_its_startup_heap_and_unfreezes_it_when_it_stops(monkeypatch):
    """KVFLOW_GC_FREEZE (on by default; conftest.py turns it off for the other tests): the
    app's start collects and freezes the heap, requests are served, its stop unfreezes it;
    with the switch off the collector is left alone. (The engine's own freeze while requests
    are in flight: tests/engine/test_llm_engine.py.)"""
    import gc

    try:
        engine = tiny_engine(config=tiny_model_config(vocab_size=TINY_TEXT_VOCAB), tokenizer=tiny_tokenizer())
        assert gc.get_freeze_count() == 0
        monkeypatch.setenv("KVFLOW_GC_FREEZE", "1")
        server = InProcessServer(engine)
        try:
            assert gc.get_freeze_count() > 0
            r = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "a b", "max_tokens": 3,
                                                                 "temperature": 0}, timeout=60)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        finally:
            server.stop()
        assert gc.get_freeze_count() == 0
        monkeypatch.setenv("KVFLOW_GC_FREEZE", "0")
        server = InProcessServer(tiny_engine(config=tiny_model_config(vocab_size=TINY_TEXT_VOCAB),
                                             tokenizer=tiny_tokenizer()))
        try:
            assert gc.get_freeze_count() == 0
        finally:
            server.stop()
    finally:
        gc.unfreeze()


def test_chat_continues_the_final_message_as_vllm(http):
    """vLLM's assistant prefill (continue_final_message: true, add_generation_prompt: false)
    was a 400 "add_generation_prompt is not supported by kvflow"; the prompt is now rendered
    as vLLM's (and as /tokenize renders the same body)."""
    tok = tiny_tokenizer()
    prefill = [*MSG, {"role": "assistant", "content": "Hel"}]
    for extra, text in (({"messages": MSG}, "<user>Hi\n<assistant>"),
                        ({"messages": prefill, "add_generation_prompt": False, "continue_final_message": True},
                         "<user>Hi\n<assistant>Hel"),
                        ({"messages": MSG, "add_generation_prompt": False}, "<user>Hi\n")):
        ids = tok.encode(text, add_special_tokens=False)
        r = http.post(CH, json={"max_tokens": 2, "temperature": 0, "ignore_eos": True, **extra})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(ids), (extra, r.json()["usage"])
        t = http.post("/tokenize", json=extra)
        assert t.status_code == 200 and t.json()["tokens"] == ids, t.text
    for extra in ({"add_generation_prompt": True, "continue_final_message": True}, {"continue_final_message": True}):
        r = http.post(CH, json={"messages": prefill, "max_tokens": 2, **extra})
        error = _assert_error(r, 400, "continue_final_message")
        assert "Cannot set both `continue_final_message` and `add_generation_prompt` to True" in error["message"]
    _assert_error(http.post(CH, json={"messages": MSG, "add_generation_prompt": "no"}), 400, "add_generation_prompt")


def test_a_prompt_longer_than_the_context_is_400_naming_the_prompt_with_max_tokens_set(http):
    """A prompt that leaves no room for output (max_model_len 256 here) named the prompt with
    max_tokens unset but ``max_tokens`` (or max_completion_tokens, max_output_tokens) when it
    was set, or, on /v1/completions, when it was left to its default of 16: no value of that
    field would fit. It names the prompt, as the engine's check does."""
    long = "word " * 100  # 500 tokens of the byte-level tokenizer
    for path, body, param in (
            (C, {"prompt": long, "max_tokens": 5}, "prompt"), (C, {"prompt": long}, "prompt"),
            (CH, {"messages": [{"role": "user", "content": long}], "max_tokens": 5}, "messages"),
            (CH, {"messages": [{"role": "user", "content": long}], "max_completion_tokens": 5}, "messages"),
            ("/v1/responses", {"input": long, "max_output_tokens": 5}, "input")):
        err = _assert_error(http.post(path, json=body), 400, param)
        assert err["message"].startswith("prompt is ") and "max_model_len=256" in err["message"], (path, body, err)
    r = http.post("/v1/messages", json={"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": long}]})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("messages: prompt is "), r.text


def test_max_tokens_beyond_the_whole_kv_cache_is_400_naming_the_field_sent():
    """prompt + max_tokens needing more KV blocks than the whole cache holds named the prompt
    (``param`` "prompt" / "messages" / "input") though the prompt fit: it names the field that
    set the output length, and the prompt only when it cannot fit with one output token."""
    s = TinyServer(engine_kwargs={"num_blocks": 8})  # 8 blocks of 4 tokens: 32 tokens in all
    try:
        with httpx.Client(base_url=s.url, timeout=60) as http:
            err = _assert_error(http.post(C, json={"prompt": "x", "max_tokens": 100}), 400, "max_tokens")
            assert "more than the whole cache" in err["message"], err
            _assert_error(http.post(CH, json={"messages": MSG, "max_completion_tokens": 100}), 400,
                          "max_completion_tokens")
            _assert_error(http.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 100}), 400,
                          "max_output_tokens")
            err = _assert_error(http.post(C, json={"prompt": "y" * 40, "max_tokens": 1}), 400, "prompt")
            assert err["message"].startswith("prompt is 40 tokens"), err
            assert _completion(http, max_tokens=4)["usage"]["completion_tokens"] >= 1
    finally:
        s.stop()


@pytest.mark.parametrize("path, prefix, body", [
    (C, "cmpl", {"prompt": "Hi", "max_tokens": 2}),
    (CH, "chatcmpl", {"messages": MSG, "max_tokens": 2}),
])
def test_the_answers_id_is_vllms_request_id(http, path, prefix, body):
    """vLLM answers ``{prefix}-<X-Request-Id header or request_id field>`` (clients match their
    logs to the answer by it); kvflow ignored both and sent a random id."""
    assert http.post(path, json={**body, "request_id": "job-7"}).json()["id"] == f"{prefix}-job-7"
    headed = http.post(path, json={**body, "request_id": "job-7"}, headers={"X-Request-Id": "hdr-1"})
    assert headed.json()["id"] == f"{prefix}-hdr-1"  # the header wins, as in vLLM
    streamed = http.post(path, json={**body, "request_id": "job-8", "stream": True})
    ids = {json.loads(line[6:])["id"] for line in streamed.text.splitlines()
           if line.startswith("data: {")}
    assert ids == {f"{prefix}-job-8"}
    plain = http.post(path, json=body).json()["id"]
    assert plain.startswith(f"{prefix}-") and len(plain) > len(prefix) + 8
    bad = http.post(path, json={**body, "request_id": 7})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "request_id"
