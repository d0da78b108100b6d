"""``kvflow serve --enable-lora --lora-modules`` with the real SmolLM2-135M and a PEFT adapter
made here (random, non-zero B), through the OpenAI SDK: adapters listed as models with their
parent, a request's ``model`` selects the adapter (greedy tokens as transformers + PEFT's
merged model), loading and unloading at run time while a stream runs, and the refusals."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from conftest import hf_greedy, requires_smollm2
from entrypoints.openai.test_server import REQUEST_TIMEOUT_S, _assert_openai_error, _serve

pytestmark = requires_smollm2
PROMPT = "The capital of France is"


def _make_adapter(model_dir, path, seed: int, r: int, targets: list[str]):
    """A PEFT adapter of SmolLM2 with N(0, 0.08) A and B; the merged transformers model."""
    import peft
    import transformers

    from kvflow.model.resolve import hf_checkpoint_dir

    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_checkpoint_dir(str(model_dir)), dtype=torch.float32)
    model = peft.get_peft_model(hf, peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, task_type="CAUSAL_LM"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
    model.save_pretrained(path)
    return model.merge_and_unload().eval()


def _variant(src, dst, scale: float, rank: int | None = None):
    """Another adapter from ``src``'s files: B scaled (and A, B zero-padded to ``rank``)."""
    import json

    from safetensors.torch import load_file, save_file

    dst.mkdir()
    config = json.loads((src / "adapter_config.json").read_text())
    tensors = load_file(str(src / "adapter_model.safetensors"))
    if rank is not None:
        pad = rank - config["r"]
        config["r"] = rank
        tensors = {k: torch.nn.functional.pad(v, (0, 0, 0, pad) if ".lora_A." in k else (0, pad)) for k, v in tensors.items()}
    tensors = {k: v * scale if ".lora_B." in k else v for k, v in tensors.items()}
    (dst / "adapter_config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def adapters(smollm2_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    merged = _make_adapter(smollm2_dir, root / "sql", seed=1, r=8, targets=["q_proj", "v_proj", "o_proj", "down_proj"])
    _variant(root / "sql", root / "chat", -0.5)
    _variant(root / "sql", root / "wide", 1.0, rank=16)
    return root, merged


@pytest.fixture(scope="module")
def server(smollm2_dir, adapters, tmp_path_factory):
    root, _ = adapters
    yield from _serve(smollm2_dir, tmp_path_factory, "lora", ["--enable-lora", "--max-loras", "2", "--max-lora-rank",
                                                              "8", "--lora-modules", f"sql={root / 'sql'}"])


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=REQUEST_TIMEOUT_S) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=REQUEST_TIMEOUT_S) as c:
        yield c


def _base(client) -> str:
    return next(m.id for m in client.models.list().data if m.model_extra["parent"] is None)


def test_models_list_adapters_with_parent(client):
    models = {m.id: m.model_extra["parent"] for m in client.models.list().data}
    base = _base(client)
    assert models == {base: None, "sql": base}


def test_adapter_tokens_follow_peft(client, adapters, smollm2_dir):
    from transformers import AutoTokenizer

    _, merged = adapters
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    ref, margins = hf_greedy(merged, tokenizer.encode(PROMPT), 8)
    assert min(margins) > 1e-3  # no near-tie: float32 rounding cannot flip a token
    out = client.completions.create(model="sql", prompt=PROMPT, max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == tokenizer.decode(ref)
    assert out.model == "sql"
    base = client.completions.create(model=_base(client), prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert base.choices[0].text != out.choices[0].text  # the adapter changes the continuation


def test_every_endpoint_names_the_adapter_it_ran(http, client):
    """A response's ``model`` is the adapter's name on every endpoint, as vLLM's
    (``model_name(lora_request)``): /v1/messages, /v1/responses and /v1/embeddings ran the
    adapter but named the base model."""
    base = _base(client)
    hi = [{"role": "user", "content": "Hi"}]
    bodies = {
        "/v1/completions": {"prompt": PROMPT, "max_tokens": 2},
        "/v1/chat/completions": {"messages": hi, "max_tokens": 2},
        "/v1/responses": {"input": "Hi", "max_output_tokens": 2},
        "/v1/messages": {"messages": hi, "max_tokens": 2},
        "/v1/embeddings": {"input": PROMPT},
    }
    for path, body in bodies.items():
        for model in ("sql", base):
            r = http.post(path, json={**body, "model": model, **({} if "embeddings" in path else {"temperature": 0})})
            assert r.status_code == 200, (path, r.text)
            assert r.json()["model"] == model, (path, model, r.json()["model"])
    vectors = [http.post("/v1/embeddings", json={"model": m, "input": PROMPT}).json()["data"][0]["embedding"]
               for m in ("sql", base)]
    assert vectors[0] != vectors[1]  # the adapter ran


def test_unknown_adapter_is_404(client):
    with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist"):
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)


def test_load_and_unload_during_a_stream(client, http, adapters):
    root, _ = adapters
    # A stream under "sql" runs while "chat" is loaded, used and unloaded; its text is the
    # same as when it runs alone.
    alone = client.completions.create(model="sql", prompt=PROMPT, max_tokens=24, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
    stream = client.completions.create(model="sql", prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    pieces = [next(iter(stream)).choices[0].text]
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": str(root / "chat")})
    assert r.status_code == 200, r.text
    assert "chat" in {m.id for m in client.models.list().data}
    busy = _assert_openai_error(http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}), 400)
    assert "LoRA adapter 'sql' is in use by 1 unfinished request" in busy["message"]
    chat = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0)
    assert chat.choices[0].message.content
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "chat"}).status_code == 200
    pieces += [chunk.choices[0].text for chunk in stream]
    assert "".join(pieces) == alone
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="chat", prompt=PROMPT, max_tokens=2)
    assert _assert_openai_error(http.post("/v1/unload_lora_adapter", json={"lora_name": "chat"}), 404)["param"] == "lora_name"


def test_bad_adapters_are_400(http, adapters, tmp_path):
    root, _ = adapters
    wide = _assert_openai_error(http.post("/v1/load_lora_adapter", json={"lora_name": "wide", "lora_path": str(root / "wide")}), 400)
    assert "LoRA adapter 'wide'" in wide["message"] and "more than max_lora_rank=8" in wide["message"]
    missing = _assert_openai_error(http.post("/v1/load_lora_adapter", json={"lora_name": "m", "lora_path": str(tmp_path)}), 400)
    assert "no adapter_config.json" in missing["message"] and missing["param"] == "lora_path"
    again = _assert_openai_error(http.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(root / "sql")}), 400)
    assert "already served" in again["message"] and again["param"] == "lora_name"
    extra = _assert_openai_error(http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "p", "load_inplace": True}), 400)
    assert "load_inplace" in extra["message"]
    assert http.get("/health").status_code == 200
