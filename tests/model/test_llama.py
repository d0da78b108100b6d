"""The model forward against Hugging Face transformers on tiny random-weight models."""

from __future__ import annotations

import pytest
import torch
import transformers

from conftest import prefill_logits, tiny_model, tiny_model_config
from kvflow.model.llama import LlamaForCausalLM


def to_hf_state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """Split our fused Q/K/V and gate/up weights back into Hugging Face names."""
    cfg = model.config
    q, kv, ff = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
    sd = {"model.embed_tokens.weight": model.embed_tokens.weight, "model.norm.weight": model.norm.weight}
    if not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = model.lm_head_weight
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        for kind in ("weight", "bias"):
            t = getattr(layer.self_attn.qkv_proj, kind)
            if t is not None:
                sd[p + f"self_attn.q_proj.{kind}"], sd[p + f"self_attn.k_proj.{kind}"], sd[p + f"self_attn.v_proj.{kind}"] = t.split([q, kv, kv])
        sd[p + "self_attn.o_proj.weight"] = layer.self_attn.o_proj.weight
        sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"] = layer.mlp.gate_up_proj.weight.split([ff, ff])
        sd[p + "mlp.down_proj.weight"] = layer.mlp.down_proj.weight
        sd[p + "input_layernorm.weight"] = layer.input_layernorm.weight
        sd[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
    return {k: v.detach().clone() for k, v in sd.items()}


def hf_model(model: LlamaForCausalLM):
    cfg = model.config
    common = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        rope_theta=cfg.rope_theta,
    )
    if cfg.model_type == "qwen2":
        hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    else:
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, head_dim=cfg.head_dim))
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(model), strict=False)
    assert not unexpected and all("lm_head" in m for m in missing)
    return hf.eval()


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"num_key_value_heads": 1},  # MQA
        {"num_key_value_heads": 4},  # MHA
        {"tie_word_embeddings": True},
        {"model_type": "qwen2", "attention_bias": True, "head_dim": 16},
    ],
    ids=["gqa", "mqa", "mha", "tied", "qwen2-bias"],
)
@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_logits_match_transformers(overrides, chunk):
    model = tiny_model(tiny_model_config(**overrides))
    ids = torch.randint(0, 128, (23,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        ref = hf_model(model)(torch.tensor([ids])).logits[0]
    ours = prefill_logits(model, ids, chunk)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("overrides", [{"model_type": "qwen2", "attention_bias": True}, {"tie_word_embeddings": True}])
def test_load_weights_roundtrip_and_errors(overrides):
    src = tiny_model(tiny_model_config(**overrides))
    sd = to_hf_state_dict(src)
    dst = LlamaForCausalLM(src.config)
    dst.load_weights(sd.items())
    for (name, a), (_, b) in zip(src.named_parameters(), dst.named_parameters()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="missing"):
        dst.load_weights([(k, v) for k, v in sd.items() if "layers.1.self_attn.k_proj" not in k])
    with pytest.raises(ValueError, match="shape"):
        dst.load_weights([("model.norm.weight", torch.ones(3))])
    with pytest.raises(ValueError, match="unexpected"):
        dst.load_weights([("model.bogus.weight", torch.ones(3))])
