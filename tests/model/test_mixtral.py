"""Mixtral against transformers on tiny random-weight models saved as Hugging Face folders and
loaded by kvflow (float32, CPU)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from conftest import prefill_logits
from hf_parity import (
    assert_greedy_matches,
    assert_quantized_greedy_close,
    hf_greedy,
    kvflow_engine,
    run_greedy,
    save_random_hf,
)
from kvflow.layers.moe import select_experts
from kvflow.model.loader import load_model
from kvflow.model.mixtral import MixtralForCausalLM

CPU = torch.device("cpu")


def mixtral_config(**overrides) -> transformers.MixtralConfig:
    fields = dict(vocab_size=128, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                  max_position_embeddings=256, rope_theta=1e6, sliding_window=None)
    return transformers.MixtralConfig(**{**fields, **overrides})


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral")
    return path, save_random_hf(transformers.MixtralForCausalLM, mixtral_config(), path)


@pytest.mark.parametrize("overrides", [{}, {"num_local_experts": 8, "num_experts_per_tok": 3, "num_key_value_heads": 1},
                                       {"tie_word_embeddings": True, "sliding_window": 256}, {"sliding_window": 8}],
                         ids=["8x2-like", "top3-mqa", "tied-window-covers-context", "window-8"])
def test_prompt_logits_match_transformers(overrides, tmp_path):
    hf = save_random_hf(transformers.MixtralForCausalLM, mixtral_config(**overrides), tmp_path)
    model, config = load_model(tmp_path, torch.float32, CPU)
    assert isinstance(model, MixtralForCausalLM) and config.model_type == "mixtral"
    ids = torch.randint(0, 128, (29,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    for chunk in (1, 7, 64):
        assert float((prefill_logits(model, ids, chunk) - ref).abs().max()) < 1e-4, chunk


def test_router_picks_the_same_experts_as_transformers(mixtral_dir):
    """transformers' routers (``output_router_logits=True``) and kvflow's on the same hidden
    states (captured by hooks) choose the same experts with the same weights."""
    path, hf = mixtral_dir
    model, _ = load_model(path, torch.float32, CPU)
    inputs = {}
    hooks = [layer.mlp.gate.register_forward_hook(lambda mod, args, out, i=i: inputs.__setitem__(i, args[0]))
             for i, layer in enumerate(hf.model.layers)]
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    try:
        with torch.inference_mode():
            router_logits = hf(torch.tensor([ids]), output_router_logits=True).router_logits
    finally:
        for h in hooks:
            h.remove()
    assert len(router_logits) == 2
    for i, layer in enumerate(model.layers):
        block = layer.block_sparse_moe
        ours = block.gate(inputs[i].reshape(-1, 64))
        torch.testing.assert_close(ours, router_logits[i], atol=1e-6, rtol=0)
        weights, chosen = select_experts(ours, 2, True)
        ref_probs = torch.softmax(router_logits[i].float(), -1)
        ref_weights, ref_ids = ref_probs.topk(2, -1)
        assert torch.equal(chosen, ref_ids)
        torch.testing.assert_close(weights, ref_weights / ref_weights.sum(-1, keepdim=True), atol=1e-6, rtol=0)


def test_greedy_through_the_engine_matches_transformers(mixtral_dir):
    """Chunked prefill (16 tokens per step: the long prompt's later chunks run next to the
    short one's decodes), then a prompt reusing the long one's first 4 cached blocks: 32
    greedy tokens each, as transformers decodes them."""
    path, hf = mixtral_dir
    engine = kvflow_engine(path)
    g = torch.Generator().manual_seed(3)
    base = torch.randint(0, 128, (26,), generator=g).tolist()
    rounds = [{"short": [5, 9, 2], "long": base}, {"shared-prefix": base[:17] + [1, 2]}]
    hits = []
    for prompts in rounds:
        outs = run_greedy(engine, prompts, 32)
        for rid, prompt in prompts.items():
            assert_greedy_matches(outs[rid], *hf_greedy(hf, prompt, 32))
        hits.append(engine.get_stats()["prefix_cache_hits"])
    assert hits[1] > hits[0]


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantized_experts_and_greedy_stays_close(method, mixtral_dir):
    """The experts are stored quantized; greedy decoding follows transformers' float tokens
    up to a near-tie at the scheme's precision (observed: int8 diverges at token 6 of 16,
    where the float top-2 margin is 0.057 against a median prompt-logit error of 0.13)."""
    path, hf = mixtral_dir
    quant, _ = load_model(path, torch.float32, CPU, quantization=method)
    experts = quant.layers[0].block_sparse_moe.experts
    assert experts.w2_weight.dtype == {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[method]
    ids = torch.randint(0, 128, (20,), generator=torch.Generator().manual_seed(4)).tolist()
    assert_quantized_greedy_close(hf, path, method, ids)


@pytest.mark.parametrize("field, value, match", [
    ("hidden_act", "gelu", "hidden_act"),
])
def test_unsupported_config_fields_are_refused_at_load(field, value, match, mixtral_dir, tmp_path):
    path, _ = mixtral_dir
    config = json.loads((path / "config.json").read_text())
    config[field] = value
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match):
        load_model(tmp_path, torch.float32, CPU)
