"""Qwen3 (dense) against transformers' Qwen3ForCausalLM on tiny random checkpoints: logits
through the paged path, greedy tokens through the engine, YaRN, GGUF, refused fields."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

from conftest import engine_greedy_matches_hf, prefill_logits, randomize_hf_model
from kvflow.model import resolve
from kvflow.model.loader import load_model
from kvflow.model.qwen3 import Qwen3ForCausalLM
from model.test_resolve import write_gguf

pytestmark = pytest.mark.usefixtures("one_thread")
CPU = torch.device("cpu")
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


def qwen3_config(**overrides) -> transformers.Qwen3Config:
    """2 layers, 4 query / 2 KV heads of head_dim 32 (not hidden / heads = 16)."""
    fields = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6,
                  tie_word_embeddings=False)
    fields.update(overrides)
    return transformers.Qwen3Config(**fields)


def save_qwen3(path: Path, seed: int = 0, **overrides) -> transformers.Qwen3ForCausalLM:
    hf = randomize_hf_model(transformers.Qwen3ForCausalLM(qwen3_config(**overrides)), seed)
    hf.save_pretrained(path)
    return hf


def _ids(n: int, seed: int, vocab: int = 128) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize(
    "overrides",
    [{}, {"tie_word_embeddings": True}, {"attention_bias": True}, {"num_key_value_heads": 1},
     {"rope_scaling": YARN, "max_position_embeddings": 64}],
    ids=["gqa", "tied", "bias", "mqa", "yarn"],
)  # fmt: skip
def test_logits_match_transformers(overrides, tmp_path):
    hf = save_qwen3(tmp_path, **overrides)
    model, config = load_model(tmp_path, torch.float32, CPU)
    assert isinstance(model, Qwen3ForCausalLM) and config.head_dim == 32
    assert model.layers[0].self_attn.q_norm.weight.shape == (32,)
    # 100 tokens: past YaRN's original 64-token context (its scaled context is 256)
    ids = _ids(100 if "rope_scaling" in overrides else 29, seed=1)
    with torch.inference_mode():
        want = hf(torch.tensor([ids])).logits[0]
    for chunk in (1, 7, 64):
        torch.testing.assert_close(prefill_logits(model, ids, chunk), want, atol=1e-4, rtol=1e-4)


def test_yarn_context_and_attention_factor(tmp_path):
    """YaRN's attention factor scales the cos / sin tables (as transformers'
    ``attention_scaling``), and the context becomes the original one times the factor."""
    save_qwen3(tmp_path, rope_scaling=YARN, max_position_embeddings=64)
    model, config = load_model(tmp_path, torch.float32, CPU)
    assert config.max_position_embeddings == 256
    assert model.rotary.attention_factor == pytest.approx(0.1 * np.log(4.0) + 1)
    assert model.rotary.cos[0].tolist() == [pytest.approx(model.rotary.attention_factor)] * 32


@pytest.mark.parametrize("overrides", [{}, {"rope_scaling": YARN, "max_position_embeddings": 64}], ids=["plain", "yarn"])
def test_engine_greedy_matches_transformers(overrides, tmp_path):
    """32 greedy tokens per request through LLMEngine: a mixed batch of three prompts with
    chunked prefill (16-token steps), then a prompt sharing a cached prefix."""
    hf = save_qwen3(tmp_path, seed=2, **overrides)
    prompts = [_ids(21, 3), _ids(9, 4), _ids(30, 5)]
    stats = engine_greedy_matches_hf(tmp_path, hf, prompts, prompts[0][:12] + _ids(7, 6))
    assert stats["min_margin"] > 1e-4  # every step decided by more than the 1e-4 logits tolerance


def test_sliding_window_matches_transformers(tmp_path):
    """use_sliding_window with max_window_layers=1: layer 1 attends within 8 tokens, layer 0
    to all (transformers' layer_types); 40-token prompts in chunks of 1, 7 and 64. Off (every
    released Qwen3), transformers attends to all tokens and so does kvflow."""
    hf = save_qwen3(tmp_path, use_sliding_window=True, sliding_window=8, max_window_layers=1,
                    attn_implementation="eager")
    model, config = load_model(tmp_path, torch.float32, CPU)
    assert config.sliding_windows == [None, 8]
    ids = _ids(40, seed=1)
    with torch.inference_mode():
        want = hf(torch.tensor([ids])).logits[0]
    for chunk in (1, 7, 64):
        torch.testing.assert_close(prefill_logits(model, ids, chunk), want, atol=1e-4, rtol=1e-4)
    save_qwen3(tmp_path / "off", use_sliding_window=False, sliding_window=8, max_window_layers=1)
    _, config = load_model(tmp_path / "off", torch.float32, CPU)
    assert config.sliding_windows == [None, None]


def test_unsupported_activation_is_refused(tmp_path):
    save_qwen3(tmp_path, hidden_act="gelu")
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        load_model(tmp_path, torch.float32, CPU)


def _qwen3_gguf_tensors(hf: transformers.Qwen3ForCausalLM) -> dict[str, np.ndarray]:
    """The HF state dict under llama.cpp's qwen3 names (``gguf.constants`` MODEL_TENSORS; the
    qwen3 converter keeps Q/K unpermuted)."""
    layer = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    out = {}
    for name, t in hf.state_dict().items():
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            out[f"blk.{i}.{layer[module]}.{kind}"] = t.numpy()
        else:
            out[{"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}[name]] = t.numpy()
    return out


def test_gguf_matches_the_hf_folder(tmp_path):
    """A qwen3 GGUF (with YaRN metadata) written as llama.cpp does converts to the same
    config and weights as the HF folder it came from, and runs the same logits."""
    cfg = dict(vocab_size=261, rope_scaling={**YARN, "beta_fast": 16.0, "rope_theta": 5e5}, max_position_embeddings=64)
    hf = save_qwen3(tmp_path / "hf", seed=7, **cfg)

    def configure(w: gguf.GGUFWriter) -> None:
        w.add_block_count(2)
        w.add_context_length(64)
        w.add_embedding_length(64)
        w.add_feed_forward_length(96)
        w.add_head_count(4)
        w.add_head_count_kv(2)
        w.add_key_length(32)
        w.add_value_length(32)
        w.add_rope_freq_base(5e5)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)
        w.add_rope_scaling_orig_ctx_len(64)
        w.add_float32("qwen3.rope.scaling.yarn_beta_fast", 16.0)

    write_gguf(tmp_path / "tiny-qwen3.gguf", "qwen3", _qwen3_gguf_tensors(hf), configure)
    out = resolve.resolve_model(str(tmp_path / "tiny-qwen3.gguf"), cache_dir=tmp_path / "cache")
    config = resolve.load_config(out)
    assert type(config).__name__ == "Qwen3Config" and config.head_dim == 32
    assert config.rope_parameters == {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0,
                                      "original_max_position_embeddings": 64, "beta_fast": 16.0}
    from_gguf, gguf_config = load_model(out, torch.float32, CPU)
    from_hf, hf_config = load_model(tmp_path / "hf", torch.float32, CPU)
    assert gguf_config.rope_scaling == hf_config.rope_scaling and gguf_config.max_position_embeddings == 256
    for (name, a), (_, b) in zip(from_gguf.state_dict().items(), from_hf.state_dict().items()):
        assert torch.equal(a, b), name
    ids = _ids(80, 8, vocab=261)
    with torch.inference_mode():
        want = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(prefill_logits(from_gguf, ids, 16), want, atol=1e-4, rtol=1e-4)
