"""The OpenAI-compatible server end to end: a real ``kvflow serve`` process on the real model,
driven by the official ``openai`` client, raw SSE over httpx, and a bounded schemathesis run.

Two server processes are started per module: the main one (no API key), and a small one with
``--api-key --max-queue-len 1 --max-num-seqs 1`` for the 401 and 429 paths. Every request
loop is bounded in count and time; requests use temperature 0 and a few tokens.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from conftest import requires_smollm2

pytestmark = [requires_smollm2, pytest.mark.integration]

REPO_ROOT = Path(__file__).resolve().parents[3]
API_KEY = "sk-kvflow-test"
STARTUP_TIMEOUT_S = 180
REQUEST_TIMEOUT_S = 120
PREFILL_TIMEOUT_S = 600  # a 4000-token prefill on one thread: about 100 s on the development machine


# ---------------------------------------------------------------------------- servers
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A ``kvflow serve`` subprocess on 127.0.0.1."""

    def __init__(self, model_dir: Path, log_path: Path, extra_args: list[str]) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        cmd = [
            sys.executable, "-m", "kvflow.entrypoints.cli", "serve",
            "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(self.port),
            "--num-threads", "1", "--num-kv-blocks", "256", "--log-level", "warning",
            # float32, whatever dtype "auto" picks on this CPU: the tests compare exact outputs
            # (with and without speculation, streamed and not)
            "--dtype", "float32",
            *extra_args,
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env)

    def log_tail(self, n: int = 4000) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_bytes()[-n:].decode("utf-8", "replace")

    def wait_healthy(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server not healthy after {timeout_s}s:\n{self.log_tail()}")

    def stop(self) -> int | None:
        """Terminate; the return code, or None if it had to be killed."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
                self._log.close()
                return None
        self._log.close()
        return self.proc.returncode


def _serve(model_dir, tmp_path_factory, name: str, extra_args: list[str]):
    server = Server(Path(model_dir), tmp_path_factory.mktemp(name) / "server.log", extra_args)
    try:
        server.wait_healthy()
    except BaseException:
        server.stop()
        raise
    yield server
    code = server.stop()
    assert code is not None, f"server ignored SIGTERM for 30 s:\n{server.log_tail()}"
    assert server.proc.poll() is not None
    assert "Traceback" not in server.log_tail(200_000), server.log_tail()


@pytest.fixture(scope="module")
def server(smollm2_dir, tmp_path_factory):
    # 4096 tokens a step: a 4k-token prompt is prefilled in one long step (test_health_during_a_4k_prefill)
    yield from _serve(smollm2_dir, tmp_path_factory, "server", ["--max-num-seqs", "32", "--max-num-batched-tokens", "4096",
                                                              "--max-step-seconds", "0"])


@pytest.fixture(scope="module")
def small_server(smollm2_dir, tmp_path_factory):
    """API key, one running sequence and a one-request waiting queue."""
    args = ["--max-num-seqs", "1", "--max-queue-len", "1", "--api-key", API_KEY]
    yield from _serve(smollm2_dir, tmp_path_factory, "small_server", args)


@pytest.fixture(scope="module")
def spec_server(smollm2_dir, tmp_path_factory):
    """N-gram speculative decoding (as in tests/spec_decode/test_ngram.py's real-model test)."""
    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}'
    yield from _serve(smollm2_dir, tmp_path_factory, "spec_server", ["--speculative-config", spec])


@pytest.fixture(scope="module")
def model(server) -> str:
    return httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=REQUEST_TIMEOUT_S) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=REQUEST_TIMEOUT_S) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from kvflow.model.resolve import load_tokenizer

    return load_tokenizer(smollm2_dir)


# ---------------------------------------------------------------------------- helpers
PROMPT = "The three primary colors are"
MESSAGES = [{"role": "user", "content": "Name three fruits."}]


def _chat_prompt_len(tokenizer, messages) -> int:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(tokenizer.encode(text, add_special_tokens=False))


def _nulls(obj, path="$") -> list[str]:
    """Paths of explicit nulls in a JSON value."""
    if obj is None:
        return [path]
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in _nulls(v, f"{path}.{k}")]
    if isinstance(obj, list):
        return [p for i, v in enumerate(obj) for p in _nulls(v, f"{path}[{i}]")]
    return []


def _sse(http: httpx.Client, path: str, body: dict) -> list[dict | str]:
    """The ``data:`` payloads of a streamed response (JSON objects, then "[DONE]")."""
    events: list[dict | str] = []
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    assert events and events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    for e in events[:-1]:
        # (a choice's logprobs and finish_reason are null until set: OpenAI's schema requires them)
        nulls = [p for p in _nulls(e) if not re.fullmatch(r"\$\.choices\[\d+\]\.(logprobs|finish_reason)", p)]
        assert not nulls, (nulls, e)
    return events


def _metrics(url: str) -> dict[str, float]:
    """``kvflow:*`` samples summed over labels, keyed by sample name."""
    out: dict[str, float] = {}
    # (the key is needed on small_server, which has --api-key, and ignored on the other)
    for line in httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10).text.splitlines():
        m = re.match(r"^(kvflow:[A-Za-z0-9_:]+)(\{[^}]*\})? (\S+)$", line)
        if m and 'le="' not in (m.group(2) or ""):
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    out["_successes"] = _successes(url)  # type: ignore[assignment]
    return out


def _successes(url: str, metrics: dict[str, float] | None = None) -> dict[str, float]:
    """``kvflow:request_success_total`` by ``finished_reason`` (of ``metrics``, a ``_metrics``
    result, when given: its labelled samples are kept under their full name there)."""
    if metrics is not None:
        return metrics["_successes"]
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10).text.splitlines():
        m = re.match(r'^kvflow:request_success_total\{.*finished_reason="(\w+)".*\} (\S+)$', line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def _assert_openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert {"message", "type", "param", "code"} <= set(err), err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert err["code"] == status
    return err


# ---------------------------------------------------------------------------- basics
def test_health_models_and_openapi(http, model, smollm2_dir):
    assert http.get("/health").text == "ok"
    assert model == Path(smollm2_dir).name  # --model was a path: the API shows its folder name, not the path
    models = http.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [model]
    paths = http.get("/openapi.json").json()["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(paths)


def test_completion_stream_matches_non_stream(client, http, model, tokenizer):
    kwargs = dict(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    full = client.completions.create(**kwargs)
    Completion.model_validate(full.model_dump(exclude_unset=True))
    assert full.object == "text_completion" and len(full.choices) == 1
    assert full.usage.prompt_tokens == len(tokenizer.encode(PROMPT))

    chunks = list(client.completions.create(**kwargs, stream=True))
    assert all(isinstance(c, Completion) for c in chunks)
    assert all(c.usage is None for c in chunks)
    streamed = "".join(ch.text for c in chunks for ch in c.choices)
    assert streamed == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason

    events = _sse(http, "/v1/completions", {**kwargs, "stream": True})
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == full.choices[0].text
    for e in events[:-1]:
        assert e["object"] == "text_completion" and e["id"].startswith("cmpl-") and e["model"] == model
        assert "usage" not in e
    Completion.model_validate(events[-2])  # the last chunk carries finish_reason


def test_chat_stream_matches_non_stream(client, http, model, tokenizer):
    kwargs = dict(model=model, messages=MESSAGES, max_tokens=12, temperature=0)
    full = client.chat.completions.create(**kwargs)
    ChatCompletion.model_validate(full.model_dump(exclude_unset=True))
    assert full.choices[0].message.role == "assistant"
    assert full.usage.prompt_tokens == _chat_prompt_len(tokenizer, MESSAGES)

    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert all(isinstance(c, ChatCompletionChunk) for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.usage is None for c in chunks)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason

    events = _sse(http, "/v1/chat/completions", {**kwargs, "stream": True})
    for e in events[:-1]:
        ChatCompletionChunk.model_validate(e)
        assert e["object"] == "chat.completion.chunk" and "usage" not in e
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert text == full.choices[0].message.content


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_include_usage(http, model, tokenizer, endpoint):
    max_tokens = 8
    if endpoint == "completions":
        path, body = "/v1/completions", {"prompt": PROMPT}
        prompt_tokens = len(tokenizer.encode(PROMPT))
    else:
        path, body = "/v1/chat/completions", {"messages": MESSAGES}
        prompt_tokens = _chat_prompt_len(tokenizer, MESSAGES)
    body.update(model=model, max_tokens=max_tokens, temperature=0, ignore_eos=True, stream=True)

    without = _sse(http, path, body)
    assert all("usage" not in e for e in without[:-1])
    without_off = _sse(http, path, {**body, "stream_options": {"include_usage": False}})
    assert all("usage" not in e for e in without_off[:-1])

    events = _sse(http, path, {**body, "stream_options": {"include_usage": True}})
    with_usage = [e for e in events[:-1] if "usage" in e]
    assert len(with_usage) == 1 and with_usage[0] is events[-2], events[-3:]
    final = events[-2]
    assert final["choices"] == []
    assert final["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": max_tokens,
        "total_tokens": prompt_tokens + max_tokens,
        "prompt_tokens_details": {"cached_tokens": final["usage"]["prompt_tokens_details"]["cached_tokens"]},
    }
    finish = [c["finish_reason"] for e in events[:-2] for c in e["choices"] if c.get("finish_reason")]
    assert finish == ["length"]


def test_non_stream_usage_is_exact(client, model, tokenizer):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=9, temperature=0, logprobs=0)
    assert out.usage.completion_tokens == len(out.choices[0].logprobs.tokens)
    if out.choices[0].finish_reason == "length":
        assert out.usage.completion_tokens == 9
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    chat = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=9, temperature=0, extra_body={"ignore_eos": True}
    )
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == 9
    assert chat.usage.prompt_tokens == _chat_prompt_len(tokenizer, MESSAGES)


# ---------------------------------------------------------------------------- parameters
def test_n_choices(client, model):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0.8, n=3, seed=7)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage.completion_tokens >= 3
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, temperature=0.8, n=2, seed=7)
    assert sorted(c.index for c in chat.choices) == [0, 1]
    stream = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=6, temperature=0.8, n=2, seed=7, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    texts = {0: "", 1: ""}
    finished = set()
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason is not None:
                finished.add(c.index)
    assert finished == {0, 1} and usage is not None and usage.completion_tokens >= 2


def test_completion_logprobs_shape(client, model):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    n = out.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens) == out.choices[0].text
    for tok, tok_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert tok_lp <= 0.0
        assert 2 <= len(top) <= 3 and tok in top
        assert abs(top[tok] - tok_lp) < 1e-5
        assert max(top.values()) == pytest.approx(tok_lp, abs=1e-5)  # greedy picks the top token


def test_chat_logprobs_shape(client, model):
    out = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert "".join(c.token for c in content) == out.choices[0].message.content
    for c in content:
        assert c.logprob <= 0.0 and c.bytes == list(c.token.encode("utf-8"))
        assert len(c.top_logprobs) == 2
        assert c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        assert c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-5)


def test_stop_string(client, model):
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    stripped = full.strip()
    assert len(stripped) >= 6, full
    stop = stripped[len(stripped) // 2 : len(stripped) // 2 + 2]
    cut = full.find(stop)
    assert cut > 0
    for stream in (False, True):
        kwargs = dict(model=model, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
        if stream:
            chunks = list(client.completions.create(**kwargs, stream=True))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = chunks[-1].choices[0].finish_reason
        else:
            out = client.completions.create(**kwargs)
            text, finish = out.choices[0].text, out.choices[0].finish_reason
        assert finish == "stop"
        assert text == full[:cut]


COPY_PROMPT = (
    "Repeat the following text exactly.\n\nText: The lighthouse keeper climbed the spiral stairs every evening at "
    "dusk. He trimmed the wick, polished the great lens, and wrote the weather in a leather logbook: wind from the "
    "north-east, a falling barometer, three fishing boats returning late.\n\nRepeated text: The lighthouse keeper"
)


def _completion(http: httpx.Client, body: dict, stream: bool) -> dict:
    """text, token strings, token logprobs, finish reason and usage of one choice."""
    if not stream:
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        c = out["choices"][0]
        return {"text": c["text"], "tokens": c["logprobs"]["tokens"], "logprobs": c["logprobs"]["token_logprobs"],
                "finish": c["finish_reason"], "usage": out["usage"]}
    events = _sse(http, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    choices = [c for e in events[:-1] for c in e["choices"]]
    finish = [c["finish_reason"] for c in choices if c.get("finish_reason")]
    return {"text": "".join(c["text"] for c in choices),
            "tokens": [t for c in choices if c.get("logprobs") for t in c["logprobs"]["tokens"]],
            "logprobs": [t for c in choices if c.get("logprobs") for t in c["logprobs"]["token_logprobs"]],
            "finish": finish[-1] if finish else None, "usage": events[-2]["usage"]}


@pytest.mark.parametrize("stop", ["dusk", "logbook"])
def test_stop_string_with_speculation_counts_no_draft_past_it(server, spec_server, model, stop):
    """With n-gram speculation a stop string completed by an accepted draft ends the request
    at that token: text, tokens, logprobs and usage.completion_tokens equal the server
    without speculation, streamed and not (the copy prompt makes drafts run past the stop)."""
    body = {"model": model, "prompt": COPY_PROMPT, "max_tokens": 60, "temperature": 0, "logprobs": 0, "stop": [stop]}
    with httpx.Client(base_url=server.url, timeout=REQUEST_TIMEOUT_S) as plain, \
            httpx.Client(base_url=spec_server.url, timeout=REQUEST_TIMEOUT_S) as spec:
        for stream in (False, True):
            ref, got = _completion(plain, body, stream), _completion(spec, body, stream)
            assert ref["finish"] == "stop" and ref["usage"]["completion_tokens"] < 60, ref
            assert got["text"] == ref["text"] and got["finish"] == ref["finish"]
            assert got["tokens"] == ref["tokens"]
            assert got["usage"] == ref["usage"]
            assert got["usage"]["completion_tokens"] == len(got["tokens"])
            assert got["logprobs"] == pytest.approx(ref["logprobs"], abs=1e-3)


def test_seed_reproducible(client, model):
    kwargs = dict(model=model, prompt="Once upon a time", max_tokens=10, temperature=1.0)
    a = client.completions.create(**kwargs, seed=1234).choices[0].text
    b = client.completions.create(**kwargs, seed=1234).choices[0].text
    assert a == b
    chat = dict(model=model, messages=MESSAGES, max_tokens=10, temperature=1.0, seed=99)
    assert (
        client.chat.completions.create(**chat).choices[0].message.content
        == client.chat.completions.create(**chat).choices[0].message.content
    )


def test_max_tokens_and_max_completion_tokens(client, model):
    ignore = {"ignore_eos": True}
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, extra_body=ignore, temperature=0)
    assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(
        model=model, messages=MESSAGES, max_completion_tokens=4, extra_body=ignore, temperature=0
    )
    assert chat.usage.completion_tokens == 4 and chat.choices[0].finish_reason == "length"
    # max_completion_tokens wins over the deprecated max_tokens
    chat = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=12, max_completion_tokens=3, extra_body=ignore, temperature=0
    )
    assert chat.usage.completion_tokens == 3


def test_chat_without_max_tokens(client, model):
    """The default max_tokens is what is left of the context that the KV cache can hold."""
    out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hi."}], temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length") and out.usage.completion_tokens >= 1


def test_echo(client, model):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0)
    assert out.choices[0].text == PROMPT + plain.choices[0].text
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks).startswith(PROMPT)


# ---------------------------------------------------------------------------- errors
_C, _CH = "/v1/completions", "/v1/chat/completions"
_LONG = "word " * 9000
INVALID = [
    pytest.param(_C, {"prompt": "x", "temperature": -1}, "temperature", id="temperature-1"),
    pytest.param(_C, {"prompt": "x", "top_p": 2}, "top_p", id="top_p2"),
    pytest.param(_C, {"prompt": "x", "n": 0}, "n", id="n0"),
    pytest.param(_C, {"prompt": "x", "max_tokens": 0}, "max_tokens", id="max_tokens0"),
    pytest.param(_C, {"prompt": "x", "max_tokens": "many"}, "max_tokens", id="max_tokens-str"),
    pytest.param(_C, {"prompt": "x", "logprobs": 50}, "logprobs", id="logprobs50"),
    pytest.param(_C, {"prompt": _LONG, "max_tokens": 8}, None, id="too-long"),
    pytest.param(_C, {"prompt": _LONG, "max_tokens": 8, "stream": True}, None, id="too-long-stream"),
    pytest.param(_CH, {"messages": [{"role": "user", "content": _LONG}], "max_tokens": 8, "stream": True}, None, id="chat-too-long-stream"),
    pytest.param(_C, {"prompt": "x", "max_tokens": 10**12}, "max_tokens", id="max_tokens-huge"),
    pytest.param(_C, {"prompt": "", "max_tokens": 4}, "prompt", id="empty-prompt"),
    pytest.param(_C, {"prompt": [10**9], "max_tokens": 4}, None, id="token-out-of-vocab"),
    pytest.param(_CH, {"max_tokens": 4}, "messages", id="missing-messages"),
    pytest.param(_CH, {"messages": [], "max_tokens": 4}, "messages", id="empty-messages"),
    pytest.param(_CH, {"messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 4}, "messages", id="bad-role"),
    pytest.param(_CH, {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}], "max_tokens": 4}, "messages", id="non-string-text-part"),
    pytest.param(_CH, {"messages": MESSAGES, "max_tokens": 4, "guided_json": "{not json"}, "guided_json", id="guided_json-syntax"),
    pytest.param(_CH, {"messages": MESSAGES, "max_tokens": 4, "guided_json": {"type": "nonsense"}}, "guided_json", id="guided_json-schema"),
    pytest.param(_CH, {"messages": MESSAGES, "max_tokens": 4, "top_logprobs": 30, "logprobs": True}, "top_logprobs", id="top_logprobs30"),
    pytest.param(_CH, {"messages": MESSAGES, "max_tokens": 4, "n": 1000}, None, id="n-over-max-num-seqs"),
    pytest.param(_CH, {"messages": MESSAGES, "max_tokens": 4, "stop": [""]}, "stop", id="empty-stop"),
]


@pytest.mark.parametrize("path,body,param", INVALID)
def test_invalid_request_is_400(http, model, path, body, param):
    r = http.post(path, json={"model": model, **body})
    assert r.headers["content-type"].startswith("application/json"), "an error must not start a stream"
    err = _assert_openai_error(r, 400)
    if param is not None:
        assert err["param"] == param, err


def test_malformed_json_is_400(http):
    r = http.post(_C, content=b"{not json", headers={"content-type": "application/json"})
    _assert_openai_error(r, 400)


@pytest.mark.parametrize("path,body", [(_C, {"prompt": "x", "max_tokens": 2}), (_CH, {"messages": MESSAGES, "max_tokens": 2})])
def test_unknown_model_is_404(http, path, body):
    err = _assert_openai_error(http.post(path, json={**body, "model": "no-such-model"}), 404)
    assert err["param"] == "model"


def test_client_raises_typed_errors(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="x", max_tokens=4, temperature=-1)
    assert e.value.status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MESSAGES, max_tokens=2)


@pytest.mark.parametrize("top_k", [2**63, 10**20])
def test_huge_top_k_is_top_k_off(client, http, model, top_k):
    """top_k = 2**63 used to overflow the sampler's int64 tensor in the engine thread, which
    then died: every later request got 503. It means "every token", as top_k = 0."""
    kwargs = dict(model=model, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=5)
    off = client.completions.create(**kwargs).choices[0].text
    assert client.completions.create(**kwargs, extra_body={"top_k": top_k}).choices[0].text == off
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, extra_body={"top_k": top_k})
    assert chat.usage.completion_tokens >= 1
    events = _sse(http, "/v1/completions", {**kwargs, "top_k": top_k, "stream": True})
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == off
    assert http.get("/health").status_code == 200


# ---------------------------------------------------------------------------- api key, queue
def test_api_key(small_server):
    body = {"prompt": "Hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(small_server.url + "/v1/completions", json=body, headers=headers, timeout=REQUEST_TIMEOUT_S)
        _assert_openai_error(r, 401)
    assert httpx.get(small_server.url + "/v1/models", timeout=10).status_code == 401
    assert httpx.get(small_server.url + "/health", timeout=10).status_code == 200  # open
    for path in ("/metrics", "/docs", "/openapi.json"):  # need the key
        _assert_openai_error(httpx.get(small_server.url + path, timeout=10), 401)
    assert httpx.get(small_server.url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10).status_code == 200
    with openai.OpenAI(base_url=small_server.url + "/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    with openai.OpenAI(base_url=small_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=REQUEST_TIMEOUT_S) as good:
        model = good.models.list().data[0].id
        assert good.completions.create(model=model, prompt="Hi", max_tokens=2).usage.completion_tokens >= 1


def test_queue_full_is_429(small_server):
    async def main():
        headers = {"Authorization": f"Bearer {API_KEY}"}
        body = {"prompt": "Count to ten:", "max_tokens": 16, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=small_server.url, headers=headers, timeout=REQUEST_TIMEOUT_S) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(6)))

    responses = asyncio.run(asyncio.wait_for(main(), REQUEST_TIMEOUT_S))
    codes = sorted(r.status_code for r in responses)
    assert set(codes) <= {200, 429}, codes
    assert 200 in codes and 429 in codes, codes
    for r in responses:
        if r.status_code == 429:
            assert _assert_openai_error(r, 429)["type"] == "RateLimitError"
        else:
            assert r.json()["usage"]["completion_tokens"] == 16
    # the queue drains: a later request is accepted again
    r = httpx.post(small_server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                   headers={"Authorization": f"Bearer {API_KEY}"}, timeout=REQUEST_TIMEOUT_S)  # fmt: skip
    assert r.status_code == 200, r.text


def test_queue_recovers_after_cancelled_requests(small_server):
    """One running and one waiting request, both cancelled: the engine goes idle without a
    step, and the queue must not stay "full" (429) from the last step's waiting count."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True}

    async def main():
        async with httpx.AsyncClient(base_url=small_server.url, headers=headers, timeout=REQUEST_TIMEOUT_S) as c:
            async with c.stream("POST", "/v1/completions", json=body) as running:
                assert running.status_code == 200
                lines = running.aiter_lines()
                while not (await anext(lines)).startswith("data:"):
                    pass
                async with c.stream("POST", "/v1/completions", json=body) as waiting:
                    assert waiting.status_code == 200
                    deadline = time.monotonic() + 30
                    while _metrics(small_server.url)["kvflow:num_requests_waiting"] != 1:
                        assert time.monotonic() < deadline, "the second request never showed as waiting"
                        await asyncio.sleep(0.2)
            # both closed here

    asyncio.run(asyncio.wait_for(main(), REQUEST_TIMEOUT_S))
    deadline = time.monotonic() + 15
    while True:
        r = httpx.post(small_server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                       headers=headers, timeout=REQUEST_TIMEOUT_S)  # fmt: skip
        if r.status_code != 429 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert r.status_code == 200, r.text
    m = _wait_idle(small_server.url)
    assert m["kvflow:num_requests_waiting"] == 0 and m["kvflow:kv_cache_usage_perc"] == 0, m


# ---------------------------------------------------------------------------- load
def _wait_idle(url: str, timeout_s: float = 15.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        m = _metrics(url)
        idle = (
            m["kvflow:kv_cache_usage_perc"] == 0
            and m["kvflow:num_requests_running"] == 0
            and m["kvflow:num_requests_waiting"] == 0
        )
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.25)


def test_cancelled_streams_free_their_blocks(server, model, client):
    before = _metrics(server.url)

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=REQUEST_TIMEOUT_S) as ac:

            async def one(i: int) -> int:
                stream = await ac.completions.create(
                    model=model, prompt=f"Story number {i}: once upon a time", max_tokens=200,
                    temperature=0, stream=True, extra_body={"ignore_eos": True},
                )  # fmt: skip
                seen = 0
                async for _ in stream:
                    seen += 1
                    if seen >= 2 + i % 2:
                        break
                await stream.close()
                return seen

            return await asyncio.gather(*(one(i) for i in range(20)))

    seen = asyncio.run(asyncio.wait_for(main(), REQUEST_TIMEOUT_S))
    assert all(s >= 2 for s in seen)
    m = _wait_idle(server.url)
    assert m["kvflow:kv_cache_usage_perc"] == 0, m
    assert m["kvflow:num_requests_running"] == 0, m
    assert m["kvflow:num_requests_waiting"] == 0, m
    # aborted: far fewer than 20 x 200 tokens were generated
    generated = m["kvflow:generation_tokens_total"] - before["kvflow:generation_tokens_total"]
    assert generated < 20 * 200 / 2, generated
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0)
    assert out.usage.completion_tokens >= 1


@pytest.mark.parametrize("which", ["server", "small_server"])
def test_cancelled_non_stream_request_is_aborted(request, which):
    """A client that times out on a non-streaming request gets its request aborted (also
    behind the API-key middleware of ``small_server``)."""
    server = request.getfixturevalue(which)
    before = _metrics(server.url)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(
            server.url + "/v1/completions",
            json={"prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True},
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=httpx.Timeout(2.0, connect=5.0),
        )
    m = _wait_idle(server.url)
    assert m["kvflow:num_requests_running"] == 0 and m["kvflow:kv_cache_usage_perc"] == 0, m
    assert m["kvflow:generation_tokens_total"] - before["kvflow:generation_tokens_total"] < 1000
    assert _successes(server.url)["abort"] - _successes(server.url, before)["abort"] == 1  # counted as vLLM does


def test_32_concurrent_streaming_chats(server, model, tokenizer):
    max_tokens = 16

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=REQUEST_TIMEOUT_S) as ac:

            async def one(i: int):
                messages = [{"role": "user", "content": f"Tell me one fact about the number {i}."}]
                stream = await ac.chat.completions.create(
                    model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
                    logprobs=True, stream_options={"include_usage": True},
                )  # fmt: skip
                text, tokens, finish, usage, chunks = "", 0, None, None, []
                async for chunk in stream:
                    chunks.append(chunk)
                    if chunk.usage is not None:
                        usage = chunk.usage
                    for c in chunk.choices:
                        text += c.delta.content or ""
                        if c.logprobs is not None and c.logprobs.content:
                            tokens += len(c.logprobs.content)
                        finish = c.finish_reason or finish
                return messages, text, tokens, finish, usage, chunks

            return await asyncio.gather(*(one(i) for i in range(32)))

    t0 = time.monotonic()
    results = asyncio.run(asyncio.wait_for(main(), 2 * REQUEST_TIMEOUT_S))
    assert time.monotonic() - t0 < 2 * REQUEST_TIMEOUT_S
    for messages, text, tokens, finish, usage, chunks in results:
        assert finish in ("stop", "length")
        assert usage is not None and chunks[-1].usage is usage and chunks[-1].choices == []
        assert usage.completion_tokens == tokens
        if finish == "length":
            assert tokens == max_tokens
        assert usage.prompt_tokens == _chat_prompt_len(tokenizer, messages)
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        assert chunks[0].choices[0].delta.role == "assistant"
    m = _wait_idle(server.url)
    assert m["kvflow:kv_cache_usage_perc"] == 0 and m["kvflow:num_requests_running"] == 0


def test_health_during_a_4k_prefill(server, model, tokenizer):
    """/health answers in milliseconds (p99 < 100 ms) while a 4000-token prompt is prefilled in
    one step, and while requests arrive and are aborted meanwhile; the gauges are real
    during the step. (/health took 25 s when a request arriving during the step waited for it.)

    The probes are open-loop (one every 20 ms, whether or not the previous one answered), so
    a stalled event loop shows in every probe sent while it stalls, not in one."""
    ids = tokenizer.encode("The history of the printing press in Europe. " * 500)[:4000]
    assert len(ids) == 4000
    body = {"model": model, "prompt": ids, "max_tokens": 1}
    _wait_idle(server.url)

    async def main() -> list[float]:
        async with httpx.AsyncClient(base_url=server.url, timeout=PREFILL_TIMEOUT_S) as c:
            prefill = asyncio.create_task(c.post("/v1/completions", json=body))
            deadline = time.monotonic() + 30
            while _metrics(server.url)["kvflow:num_requests_running"] != 1:  # the gauge, during the step
                assert time.monotonic() < deadline, "the 4k prompt never showed as running"
                await asyncio.sleep(0.02)
            assert _metrics(server.url)["kvflow:kv_cache_usage_perc"] > 0.9  # its 250 blocks

            async def arrive_and_abort() -> None:
                async with c.stream("POST", "/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 50, "stream": True}):
                    pass

            latencies: list[float] = []

            async def probe() -> None:
                t0 = time.monotonic()
                assert (await c.get("/health")).status_code == 200
                latencies.append(time.monotonic() - t0)

            others = [asyncio.create_task(c.post("/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 1}))
                      for _ in range(2)] + [asyncio.create_task(arrive_and_abort()) for _ in range(2)]
            probes = []
            while not prefill.done():
                probes.append(asyncio.create_task(probe()))
                await asyncio.sleep(0.02)
            await asyncio.gather(*probes, *others)
            assert prefill.result().status_code == 200, prefill.result().text
            return latencies

    latencies = sorted(asyncio.run(asyncio.wait_for(main(), PREFILL_TIMEOUT_S)))
    assert len(latencies) >= 20, f"the prefill took only {len(latencies)} probes"
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    print(f"/health during the prefill: {len(latencies)} probes, median {latencies[len(latencies) // 2] * 1e3:.1f} ms, "
          f"p99 {p99 * 1e3:.1f} ms, max {latencies[-1] * 1e3:.1f} ms")
    assert p99 < 0.1, (p99, latencies[-5:], len(latencies))
    _wait_idle(server.url)


# ---------------------------------------------------------------------------- metrics
METRIC_NAMES = [
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
    "generation_tokens_total", "time_to_first_token_seconds", "inter_token_latency_seconds",
    "e2e_request_latency_seconds", "request_queue_time_seconds", "num_preemptions_total",
    "prefix_cache_queries_total", "prefix_cache_hits_total",
]  # fmt: skip


def test_metrics(server, client, model):
    r = httpx.get(server.url + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    for name in METRIC_NAMES:
        assert re.search(rf"^kvflow:{name}(_bucket|_count|_sum)?\{{", r.text, re.M), name
    before = _metrics(server.url)
    prompt = "The quick brown fox jumps over the lazy dog. " * 6  # several full KV blocks
    for _ in range(2):  # the second one finds the prompt's blocks in the prefix cache
        out = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    after = _metrics(server.url)
    assert after["kvflow:prompt_tokens_total"] - before["kvflow:prompt_tokens_total"] == 2 * out.usage.prompt_tokens
    assert after["kvflow:generation_tokens_total"] - before["kvflow:generation_tokens_total"] == 8
    gained = {k: v - before["_successes"].get(k, 0) for k, v in after["_successes"].items()}
    assert gained == {"stop": 0, "length": 2, "abort": 0}, gained  # by finish reason, as vLLM's
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert after[f"kvflow:{name}_count"] - before[f"kvflow:{name}_count"] == 2, name
    assert after["kvflow:inter_token_latency_seconds_count"] > before["kvflow:inter_token_latency_seconds_count"]
    assert after["kvflow:prefix_cache_queries_total"] > before["kvflow:prefix_cache_queries_total"]
    assert after["kvflow:prefix_cache_hits_total"] - before["kvflow:prefix_cache_hits_total"] >= 16
    assert after["kvflow:num_preemptions_total"] >= before["kvflow:num_preemptions_total"]


# ---------------------------------------------------------------------------- fuzzing
SCHEMATHESIS_EXAMPLES = 25


def _small(v) -> bool:
    return v is None or (isinstance(v, int) and not isinstance(v, bool) and 4 < v <= 4096)


def _cap_work(case):
    """Keep generated requests cheap: max_tokens (and max_completion_tokens) values that the
    server would accept are lowered to 4, absent ones set to 4, n to at most 2. Values above
    the KV cache's 4096 tokens are left alone: they must be refused (400), quickly."""
    body = case.body
    if isinstance(body, dict):
        keys = ("max_tokens", "max_completion_tokens", "max_output_tokens")  # the last: /v1/responses
        for key in keys:
            if key in body and _small(body[key]):
                body[key] = 4
        if not any(key in body for key in keys):
            body["max_tokens"] = body["max_output_tokens"] = 4  # (an unknown field elsewhere: ignored)
        n = body.get("n")
        if isinstance(n, int) and not isinstance(n, bool) and 2 < n <= 64:
            body["n"] = 2
    return case


def _is_openai_error(response, anthropic: bool = False) -> bool:
    """A JSON body {"error": {..., "code": status}} (schemathesis' headers map names to lists);
    with ``anthropic`` (/v1/messages and /v1/messages/count_tokens), Anthropic's {"type": "error", "error": {"type", "message"}}."""
    try:
        body = response.json()
        err = body["error"]
    except (ValueError, KeyError, TypeError):
        return False
    ctype = {k.lower(): v for k, v in response.headers.items()}.get("content-type", "")
    ctype = ctype[0] if isinstance(ctype, list) else ctype
    if anthropic:
        return ctype.startswith("application/json") and body["type"] == "error" and set(err) == {"type", "message"}
    return ctype.startswith("application/json") and err["code"] == response.status_code


def test_schemathesis_finds_no_server_errors(server):
    """Positive and negative bodies from /openapi.json, 25 of each per operation: no 5xx, and
    every error is an OpenAI-shaped JSON body."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    failures: list[tuple] = []
    counts: dict[tuple[str, str], int] = {}
    for result in schema.get_all_operations():
        op = result.ok()
        for mode in schemathesis.GenerationMode:

            @settings(
                max_examples=SCHEMATHESIS_EXAMPLES, deadline=None, database=None, derandomize=True,
                phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck),
            )  # fmt: skip
            @given(case=op.as_strategy(generation_mode=mode).map(_cap_work))
            def run(case):
                response = case.call(timeout=60)
                counts[(op.label, mode.value)] = counts.get((op.label, mode.value), 0) + 1
                if response.status_code >= 500:
                    failures.append((op.label, mode.value, case.body, response.status_code, response.text[:500]))
                elif response.status_code >= 400 and not _is_openai_error(response, op.label.startswith("POST /v1/messages")):
                    failures.append((op.label, mode.value, case.body, response.status_code, response.text[:500]))

            try:
                run()
            except Unsatisfiable:  # no invalid input exists for a GET without parameters
                assert mode is schemathesis.GenerationMode.NEGATIVE
    assert not failures, failures
    assert counts[("POST /v1/chat/completions", "positive")] >= 10, counts
    assert counts[("POST /v1/completions", "negative")] >= 10, counts
