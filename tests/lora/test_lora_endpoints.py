"""Every generating endpoint names the adapter a request chose as the response's ``model``
(as chat and completions do), on a tiny random Llama with a tokenizer and a PEFT adapter."""

from __future__ import annotations

import httpx
import pytest

from conftest import InProcessServer, tiny_hf_model_dir
from kvflow import LLM
from lora_helpers import save_adapter

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_endpoints")
    tiny_hf_model_dir(root / "base")
    save_adapter(root / "base", root / "ad", seed=1)
    llm = LLM(str(root / "base"), device="cpu", dtype="float32", block_size=4, num_kv_blocks=64, enable_lora=True,
              max_lora_rank=8)
    srv = InProcessServer(llm.engine, lora_modules={"ad": str(root / "ad")})
    yield srv
    srv.stop()


MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 3}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3}),
    ("/v1/responses", {"input": MESSAGES, "max_output_tokens": 3}),
    ("/v1/messages", {"messages": MESSAGES, "max_tokens": 3}),
    ("/v1/embeddings", {"input": "hi"}),
])
@pytest.mark.parametrize("stream", [False, True])
def test_the_response_names_the_adapter(server, path, body, stream):
    if stream and path == "/v1/embeddings":
        pytest.skip("embeddings do not stream")
    for model in ("ad", "tiny"):
        sent = {**body, "model": model, "temperature": 0} if path != "/v1/embeddings" else {**body, "model": model}
        if stream:
            sent["stream"] = True
        r = httpx.post(server.url + path, json=sent, timeout=60)
        assert r.status_code == 200, r.text
        if stream:
            assert f'"model": "{model}"' in r.text or f'"model":"{model}"' in r.text, r.text[:400]
            assert '"model": "tiny"' not in r.text or model == "tiny"
        else:
            assert r.json()["model"] == model
