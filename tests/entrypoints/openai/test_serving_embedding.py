"""``POST /v1/embeddings`` on the tiny in-process server (``test_server_tiny.TinyServer``):
the vectors equal the engine's offline embeddings of the same model, float and base64 agree,
the ``openai`` client works, and bad inputs are 400s naming the field."""

from __future__ import annotations

import base64
import concurrent.futures

import httpx
import numpy as np
import openai
import pytest
import torch
from test_server_tiny import TinyServer, _assert_error, _wait_idle

from conftest import TINY_TEXT_VOCAB, tiny_engine, tiny_model_config, tiny_tokenizer
from kvflow.pooling_params import PoolingParams

E = "/v1/embeddings"
TEXTS = ["Paged attention", "hi", "The capital of France is Paris."]
HIDDEN = 64  # tiny_model_config's hidden_size


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def server():
    s = TinyServer(engine_kwargs={"max_num_batched_tokens": 8})  # every text prompt over 8 tokens is chunked
    yield s
    s.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def _offline(token_ids: list[list[int]], normalize: bool = True) -> torch.Tensor:
    """The same tiny model's embeddings through an engine of its own, unchunked."""
    engine = tiny_engine(tokenizer=tiny_tokenizer(), config=tiny_model_config(vocab_size=TINY_TEXT_VOCAB))
    for i, ids in enumerate(token_ids):
        engine.add_request(str(i), ids, PoolingParams(normalize=normalize))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs.embedding for o in engine.step() if o.finished})
    return torch.tensor([done[str(i)] for i in range(len(token_ids))])


def _embed(http, **body) -> dict:
    r = http.post(E, json={"input": TEXTS, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_float_and_base64_equal_the_offline_embeddings(server, http):
    ids = [tiny_tokenizer().encode(t) for t in TEXTS]
    floats = _embed(http, model="tiny")
    assert floats["object"] == "list" and floats["model"] == "tiny"
    assert floats["usage"] == {"prompt_tokens": sum(map(len, ids)), "total_tokens": sum(map(len, ids))}
    assert [d["index"] for d in floats["data"]] == [0, 1, 2] and {d["object"] for d in floats["data"]} == {"embedding"}
    got = torch.tensor([d["embedding"] for d in floats["data"]])
    assert got.shape == (3, HIDDEN)
    torch.testing.assert_close(got, _offline(ids), atol=1e-5, rtol=0)
    torch.testing.assert_close(got.norm(dim=1), torch.ones(3), atol=1e-5, rtol=0)
    encoded = _embed(http, encoding_format="base64")["data"]
    decoded = torch.tensor(np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in encoded]))
    # (another step, maybe batched otherwise: equal up to float32 rounding of the sums)
    torch.testing.assert_close(decoded, got, atol=1e-6, rtol=0)
    raw = _embed(http, normalize=False)["data"]
    torch.testing.assert_close(torch.tensor([d["embedding"] for d in raw]), _offline(ids, normalize=False),
                               atol=1e-5, rtol=0)
    _wait_idle(server)


def test_token_id_inputs_equal_text_inputs(http):
    ids = [tiny_tokenizer().encode(t) for t in TEXTS]
    text = torch.tensor([d["embedding"] for d in _embed(http)["data"]])
    lists = torch.tensor([d["embedding"] for d in _embed(http, input=ids)["data"]])
    one = _embed(http, input=ids[0])
    torch.testing.assert_close(lists, text, atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.tensor(one["data"][0]["embedding"]), text[0], atol=1e-6, rtol=0)
    assert len(one["data"]) == 1
    assert one["usage"]["prompt_tokens"] == len(ids[0])


def test_openai_client(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    want = torch.tensor([d["embedding"] for d in httpx.post(f"{server.url}{E}", json={"input": TEXTS}).json()["data"]])
    # The client asks for base64 unless told otherwise, and decodes it.
    default = client.embeddings.create(model="tiny", input=TEXTS)
    floats = client.embeddings.create(model="tiny", input=TEXTS[0], encoding_format="float")
    torch.testing.assert_close(torch.tensor([d.embedding for d in default.data]), want, atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.tensor(floats.data[0].embedding), want[0], atol=1e-6, rtol=0)
    assert default.usage.prompt_tokens == default.usage.total_tokens > 0
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model="tiny", input="x", dimensions=16)
    assert info.value.body["param"] == "dimensions"


def test_embeddings_alongside_completions(server, http):
    """Both kinds batched together by the engine: each answer is what it is alone."""
    alone = _embed(http, input=TEXTS[2])["data"][0]["embedding"]
    completion = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 6, "temperature": 0}).json()

    def embed(_):
        return http.post(E, json={"input": TEXTS[2]}).json()["data"][0]["embedding"]

    def complete(_):
        return http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 6, "temperature": 0}).json()

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        embeds = list(pool.map(embed, range(3)))
        completions = list(pool.map(complete, range(3)))
    for vector in embeds:
        np.testing.assert_allclose(vector, alone, atol=1e-5, rtol=0)
    assert {c["choices"][0]["text"] for c in completions} == {completion["choices"][0]["text"]}
    _wait_idle(server)


def test_base64_is_the_little_endian_float32_bytes():
    from kvflow.entrypoints.openai.serving_embedding import _encode

    vector = [0.1, -2.5, 1e-8, 3.0]
    raw = base64.b64decode(_encode(vector, "base64"))
    assert raw == np.asarray(vector, dtype="<f4").tobytes() and len(raw) == 16
    assert _encode(vector, "float") == vector


@pytest.mark.parametrize("body,param", [
    ({"input": TEXTS, "dimensions": 16}, "dimensions"),
    ({"input": TEXTS, "dimensions": 0}, "dimensions"),
    ({"input": []}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": ""}, "input"),
    ({"input": [5, 99999]}, "input"),
    ({"input": [[1, 2], [-1]]}, "input"),
    ({"input": ["a", 1]}, "input"),
    ({"input": "x" * 300}, "input"),  # past max_model_len (256)
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "embed_dtype": "float16"}, "embed_dtype"),
    # the offline API's per-request pooling: the server's is --pooling (it was dropped, last-token vectors)
    ({"input": "x", "pooling": "mean"}, "pooling"),
    ({"input": "x", "pooling_type": "MEAN"}, "pooling_type"),
    # llama-server's normalization other than its default (Euclidean): it was dropped, L2 vectors came back
    ({"input": "x", "embd_normalize": -1}, "embd_normalize"),
    ({"input": "x", "embd_normalize": 1}, "embd_normalize"),
    ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"input": "x", "truncate_prompt_tokens": 257}, "truncate_prompt_tokens"),  # past max_model_len (256)
    ({"input": "x", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"input": "x", "normalize": True, "use_activation": False}, "normalize"),
    ({"input": "x", "priority": 1}, "priority"),
    ({"input": "x", "user": 5}, "user"),
    ({}, "input"),
])  # fmt: skip
def test_bad_embedding_requests_are_400s(server, http, body, param):
    _assert_error(http.post(E, json=body), 400, param)
    _wait_idle(server)


def test_truncate_prompt_tokens_embeds_the_inputs_last_tokens(http):
    ids = [5 + i % 200 for i in range(300)]  # 300 tokens: past max_model_len (256) unless truncated
    cut = _embed(http, input=[ids, ids], truncate_prompt_tokens=7)
    want = _embed(http, input=[ids[-7:]])["data"][0]["embedding"]
    assert cut["usage"]["prompt_tokens"] == 14
    for d in cut["data"]:  # (the same up to the batch's summation order)
        assert d["embedding"] == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert d["embedding"] != pytest.approx(_embed(http, input=[ids[-8:]])["data"][0]["embedding"], abs=1e-3)
    whole = _embed(http, input=[ids], truncate_prompt_tokens=-1)  # as many as the context takes
    assert whole["usage"]["prompt_tokens"] == 256
    assert whole["data"][0]["embedding"] == pytest.approx(_embed(http, input=[ids[-256:]])["data"][0]["embedding"],
                                                          rel=1e-5, abs=1e-6)


def test_unknown_model_is_404_and_dimensions_of_the_hidden_size_pass(http):
    _assert_error(http.post(E, json={"input": "x", "model": "other"}), 404, "model")
    assert len(_embed(http, input="x", dimensions=HIDDEN)["data"][0]["embedding"]) == HIDDEN
    assert _embed(http, input="x", embd_normalize=2)["data"][0]["embedding"] == _embed(http, input="x")["data"][0][
        "embedding"]  # llama-server's default normalization is kvflow's


def test_the_number_of_inputs_is_bounded(server, http):
    """10,000 inputs were accepted (minutes of engine time from one body): OpenAI's 2,048."""
    from kvflow.entrypoints.openai.serving_embedding import MAX_INPUTS

    for inputs in (["x"] * (MAX_INPUTS + 1), [[5, 6]] * 10_000):
        err = _assert_error(http.post("/v1/embeddings", json={"input": inputs}), 400, "input")
        assert str(MAX_INPUTS) in err["message"], err
    assert server.engine.get_stats()["num_waiting"] == 0
    r = http.post("/v1/embeddings", json={"input": [[5, 6]] * 3})  # many token ids in one input are one input
    assert r.status_code == 200 and len(r.json()["data"]) == 3, r.text
