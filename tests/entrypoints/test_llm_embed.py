"""``LLM.embed`` against transformers: the pooled last hidden state (after the final norm,
``output_hidden_states=True``'s last entry), float32, on a tiny random Llama folder (CI) and
on SmolLM2-135M (integration)."""

from __future__ import annotations

import pytest
import torch

from conftest import requires_smollm2, tiny_hf_model_dir
from kvflow import LLM, PoolingParams, SamplingParams

TEXTS = ["Paged attention stores keys and values in blocks.", "hello", "The capital of France is Paris, a city on the Seine."]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def hf_embeddings(model_dir, token_ids: list[list[int]], pooling: str, normalize: bool = True) -> torch.Tensor:
    """[len(token_ids), hidden_size] from transformers' final hidden states (float32)."""
    from transformers import AutoModelForCausalLM

    from kvflow.model.resolve import hf_checkpoint_dir

    model = AutoModelForCausalLM.from_pretrained(hf_checkpoint_dir(str(model_dir)), dtype=torch.float32).eval()
    rows = []
    with torch.inference_mode():
        for ids in token_ids:
            hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
            vector = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
            rows.append(torch.nn.functional.normalize(vector, dim=0) if normalize else vector)
    return torch.stack(rows)


def _vectors(outputs) -> torch.Tensor:
    assert all(o.finished and o.error is None for o in outputs)
    return torch.tensor([o.outputs.embedding for o in outputs])


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny_hf_model_dir(tmp_path_factory.mktemp("embed") / "m")


@pytest.fixture(scope="module")
def tiny_llms(tiny_dir):
    """One LLM with the default budget and one that chunks every prompt into 3-token steps."""
    common = dict(dtype="float32", num_kv_blocks=64, block_size=4, attention_backend="torch")
    return LLM(model=str(tiny_dir), **common), LLM(model=str(tiny_dir), max_num_batched_tokens=3, **common)


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("normalize", [True, False])
def test_tiny_embeddings_match_transformers(tiny_dir, tiny_llms, pooling, normalize):
    whole, chunked = tiny_llms
    ids = [whole.get_tokenizer().encode(t) for t in TEXTS]
    want = hf_embeddings(tiny_dir, ids, pooling, normalize)
    for llm in (whole, chunked):
        outputs = llm.embed(TEXTS, pooling=pooling, normalize=normalize, use_tqdm=False)
        assert [o.prompt_token_ids for o in outputs] == ids
        assert all(o.outputs.hidden_size == 64 for o in outputs)
        torch.testing.assert_close(_vectors(outputs), want, atol=1e-5, rtol=0)
        stats = llm.get_stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_embed_takes_vllm_pooling_params_and_token_prompts(tiny_dir, tiny_llms):
    llm = tiny_llms[0]
    ids = llm.get_tokenizer().encode(TEXTS[0])
    per_prompt = [PoolingParams(pooling_type="MEAN"), PoolingParams(use_activation=False)]
    mean, raw_last = llm.embed([{"prompt_token_ids": ids}, ids], per_prompt, use_tqdm=False)
    torch.testing.assert_close(_vectors([mean]), hf_embeddings(tiny_dir, [ids], "mean"), atol=1e-5, rtol=0)
    torch.testing.assert_close(_vectors([raw_last]), hf_embeddings(tiny_dir, [ids], "last", False), atol=1e-5, rtol=0)


def test_embed_mixed_with_generation_in_one_engine(tiny_llms):
    """The same LLM generates and embeds; an embedding between generations changes nothing."""

    llm = tiny_llms[0]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    before = [o.outputs[0].token_ids for o in llm.generate(TEXTS, params, use_tqdm=False)]
    llm.embed(TEXTS, pooling="mean", use_tqdm=False)
    assert [o.outputs[0].token_ids for o in llm.generate(TEXTS, params, use_tqdm=False)] == before


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"pooling": "cls"}, "pooling_type"),
        ({"pooling_params": PoolingParams(dimensions=8)}, "dimensions"),
        ({"pooling_params": PoolingParams(), "pooling": "mean"}, "not both"),
        ({"pooling_params": [PoolingParams()]}, "pooling_params has 1 entries for 2 prompts"),
        ({"pooling_params": SamplingParams(max_tokens=2)}, "^pooling_params must be a PoolingParams .*got SamplingParams"),
        ({"pooling_params": [PoolingParams(), SamplingParams()]}, "^pooling_params entries must be PoolingParams"),
        ({"pooling_params": {"normalize": False}}, "^pooling_params must be a PoolingParams .*got dict"),
        ({"priority": [1, 0]}, "priority=1 needs the priority scheduling policy"),
    ],
)
def test_embed_refuses_bad_options(tiny_llms, kwargs, match):
    llm = tiny_llms[0]
    with pytest.raises(ValueError, match=match):
        llm.embed(["a", "b"], use_tqdm=False, **kwargs)
    assert not llm.engine.has_unfinished_requests()


@requires_smollm2
@pytest.mark.integration
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_smollm2_embeddings_match_transformers(smollm2_dir, smollm2_llm, pooling):
    ids = [smollm2_llm.get_tokenizer().encode(t) for t in TEXTS]
    want = hf_embeddings(smollm2_dir, ids, pooling)
    got = _vectors(smollm2_llm.embed(TEXTS, pooling=pooling, use_tqdm=False))
    assert got.shape == (3, 576)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # chunked prefill: 4-token steps
    from conftest import engine_like

    engine = engine_like(smollm2_llm, max_num_batched_tokens=4)
    for i, t in enumerate(ids):
        engine.add_request(str(i), t, PoolingParams(pooling_type=pooling))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step()})
    torch.testing.assert_close(_vectors([done[str(i)] for i in range(3)]), want, atol=1e-5, rtol=0)
