"""Every generating endpoint names the adapter a request chose as the response's ``model``
(as chat and completions do), and an adapter whose folder went away is a 400 naming ``model``;
on a tiny random Llama with a tokenizer and a PEFT adapter."""

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
    srv.root = root
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


def test_an_adapter_whose_folder_went_away_is_400_naming_model(server):
    """The engine keeps one validated adapter in host memory (max_cpu_loras 1) and reads an
    evicted one again from its folder: when that folder is gone, the request is refused with
    param "model" (the field that chose the adapter), not the message's first word."""
    import shutil

    shutil.copytree(server.root / "ad", server.root / "gone")
    assert httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "gone", "lora_path": str(server.root / "gone")},
                      timeout=60).status_code == 200
    assert httpx.post(server.url + "/v1/completions", json={"model": "ad", "prompt": "hi", "max_tokens": 2},
                      timeout=60).status_code == 200  # evicts "gone" from the host cache
    shutil.rmtree(server.root / "gone")
    r = httpx.post(server.url + "/v1/completions", json={"model": "gone", "prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "model" and "LoRA adapter 'gone': no adapter_config.json" in error["message"]
    assert httpx.post(server.url + "/v1/completions", json={"model": "ad", "prompt": "hi", "max_tokens": 2},
                      timeout=60).status_code == 200
