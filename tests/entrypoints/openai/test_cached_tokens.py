"""``usage.prompt_tokens_details.cached_tokens`` (OpenAI) and ``cache_read_input_tokens``
(Anthropic): the prompt tokens that were prefix-cache hits, from the engine's
``RequestOutput.num_cached_tokens``, on every endpoint, streamed and not."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest
import torch

from conftest import TINY_TEXT_VOCAB, InProcessServer, tiny_engine, tiny_model_config, tiny_tokenizer

BLOCK = 4
# a long, fixed prefix (byte-level tokenizer: one token per byte) and a distinct tail per call
PREFIX = "The quick brown fox jumps over the lazy dog. " * 2
# a chat template's header before the user's text can be cached from an earlier test
HEADER_MAX = 32


def _fresh() -> str:
    """A start no other request had: the first request with it is cold past the header."""
    return uuid.uuid4().hex + " "


@pytest.fixture(scope="module")
def server():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = tiny_engine(tokenizer=tiny_tokenizer(), config=tiny_model_config(vocab_size=TINY_TEXT_VOCAB),
                         block_size=BLOCK, num_blocks=256, max_model_len=512, max_num_batched_tokens=256)
    s = InProcessServer(engine)
    yield s
    s.stop()
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def _sse(http: httpx.Client, path: str, body: dict) -> list[dict]:
    events = []
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def _pair(http, path: str, body: dict, stream: bool, usage_of) -> tuple[dict, dict]:
    """(usage of a cold request, usage of the same request again); each body is sent once
    as given, the second after the first finished (its prefix blocks are then cached)."""
    out = []
    for _ in range(2):
        if stream:
            events = _sse(http, path, {**body, "stream": True, "stream_options": {"include_usage": True}})
            out.append(usage_of(events))
        else:
            r = http.post(path, json=body)
            assert r.status_code == 200, r.text
            out.append(r.json()["usage"])
    return out[0], out[1]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_openai_cached_tokens(http, path, stream):
    tail = _fresh()
    body = {"model": "tiny", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    if path == "/v1/completions":
        body["prompt"] = tail + PREFIX
    else:
        body["messages"] = [{"role": "user", "content": tail + PREFIX}]
    cold, warm = _pair(http, path, body, stream, lambda events: events[-1]["usage"])
    assert cold["prompt_tokens_details"]["cached_tokens"] <= HEADER_MAX, cold
    cached = warm["prompt_tokens_details"]["cached_tokens"]
    # every full block of the prompt but the last token's is a hit (the engine recomputes
    # at least one token to sample from)
    assert cached % BLOCK == 0 and warm["prompt_tokens"] - BLOCK <= cached < warm["prompt_tokens"], warm
    assert warm["prompt_tokens"] == cold["prompt_tokens"] and warm["total_tokens"] == warm["prompt_tokens"] + 3


def test_completions_cached_tokens_summed_over_prompts(http):
    a, b = _fresh() + PREFIX, _fresh() + PREFIX
    http.post("/v1/completions", json={"model": "tiny", "prompt": a, "max_tokens": 1})
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": [a, b], "max_tokens": 1})
    usage = r.json()["usage"]
    # a is cached whole (but its last block); b shares nothing with a's first block
    assert len(a) - BLOCK <= usage["prompt_tokens_details"]["cached_tokens"] < len(a), usage


@pytest.mark.parametrize("stream", [False, True])
def test_responses_cached_tokens(http, stream):
    body = {"model": "tiny", "input": _fresh() + PREFIX, "max_output_tokens": 3}

    def usage_of(events):
        return events[-1]["response"]["usage"]  # response.completed or .incomplete

    if stream:
        out = []
        for _ in range(2):
            out.append(usage_of(_sse(http, "/v1/responses", {**body, "stream": True})))
        cold, warm = out
    else:
        cold, warm = _pair(http, "/v1/responses", body, False, None)
    assert cold["input_tokens_details"]["cached_tokens"] <= HEADER_MAX, cold
    assert warm["input_tokens"] - BLOCK <= warm["input_tokens_details"]["cached_tokens"] < warm["input_tokens"], warm


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_cache_read_input_tokens(http, stream):
    body = {"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": _fresh() + PREFIX}]}
    counted = http.post("/v1/messages/count_tokens", json=body).json()["input_tokens"]
    usages = []
    for _ in range(2):
        if stream:
            events = _sse(http, "/v1/messages", {**body, "stream": True})
            usages.append([e for e in events if e["type"] == "message_delta"][0]["usage"])
        else:
            r = http.post("/v1/messages", json=body)
            assert r.status_code == 200, r.text
            usages.append(r.json()["usage"])
    cold, warm = usages
    assert cold["cache_read_input_tokens"] <= HEADER_MAX and cold["input_tokens"] + cold["cache_read_input_tokens"] == counted, cold
    # Anthropic's split: input_tokens are the prompt tokens not read from the cache
    assert warm["input_tokens"] + warm["cache_read_input_tokens"] == counted, warm
    assert 0 < warm["input_tokens"] <= BLOCK and warm["cache_creation_input_tokens"] == 0, warm
