"""Phi-3 against transformers' Phi3ForCausalLM on tiny random checkpoints: fused qkv /
gate_up tensors (also sharded over two ranks), LongRoPE in its short and long regimes,
partial rotary, GGUF, refused fields."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

from conftest import engine_greedy_matches_hf, prefill_logits, randomize_hf_model
from kvflow.distributed.parallel_state import TensorParallel
from kvflow.model import resolve
from kvflow.model.loader import load_model
from kvflow.model.phi3 import Phi3ForCausalLM
from model.test_resolve import write_gguf

pytestmark = pytest.mark.usefixtures("one_thread")
CPU = torch.device("cpu")
ORIGINAL = 64  # original_max_position_embeddings of the LongRoPE configs (context: 256)


def _factors(n: int, low: float, high: float, seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    return (low + (high - low) * torch.rand(n, generator=g)).tolist()


def longrope(rotary_dim: int) -> dict:
    return {"rope_type": "longrope", "short_factor": _factors(rotary_dim // 2, 1.0, 1.5, 1),
            "long_factor": _factors(rotary_dim // 2, 1.0, 8.0, 2)}


def phi3_config(**overrides) -> transformers.Phi3Config:
    """2 layers, 4 query / 2 KV heads of 16 dims (hidden 64)."""
    fields = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, original_max_position_embeddings=ORIGINAL,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    fields.update(overrides)
    return transformers.Phi3Config(**fields)


def save_phi3(path: Path, seed: int = 0, **overrides) -> transformers.Phi3ForCausalLM:
    hf = randomize_hf_model(transformers.Phi3ForCausalLM(phi3_config(**overrides)), seed)
    hf.save_pretrained(path)
    return hf


def _ids(n: int, seed: int, vocab: int = 128) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0]


CASES = {
    # name: (config overrides, max_model_len, prompt length)
    "default-rope": ({}, None, 29),
    "longrope-short": ({"rope_scaling": longrope(16)}, ORIGINAL, 40),  # every sequence <= 64: short factors
    "longrope-long": ({"rope_scaling": longrope(16)}, None, 100),  # max_model_len 256 > 64, prompt > 64
    "partial-tied": ({"rope_scaling": longrope(12), "partial_rotary_factor": 0.75, "tie_word_embeddings": True},
                     None, 100),  # Phi-4-mini's shape: 12 of 16 dims rotate
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, tmp_path):
    overrides, max_model_len, n = CASES[case]
    hf = save_phi3(tmp_path, **overrides)
    model, config = load_model(tmp_path, torch.float32, CPU, max_model_len=max_model_len)
    assert isinstance(model, Phi3ForCausalLM)
    assert config.rotary_dim == int(16 * overrides.get("partial_rotary_factor", 1.0))
    ids = _ids(n, seed=3)
    want = _hf_logits(hf, ids)
    for chunk in (1, 7, 64):
        torch.testing.assert_close(prefill_logits(model, ids, chunk), want, atol=1e-4, rtol=1e-4)


def test_longrope_factor_set_is_fixed_by_max_model_len(tmp_path):
    """The documented difference from transformers: with max_model_len above the original
    context kvflow rotates a short sequence with the long factors (every position, so that
    cached keys stay valid as the request grows); transformers uses the short ones until
    the sequence itself passes 64 tokens. The attention factor is the same either way."""
    hf = save_phi3(tmp_path, rope_scaling=longrope(16))
    long_model, _ = load_model(tmp_path, torch.float32, CPU)  # max_model_len 256
    short_model, _ = load_model(tmp_path, torch.float32, CPU, max_model_len=ORIGINAL)
    expected_factor = np.sqrt(1 + np.log(256 / ORIGINAL) / np.log(ORIGINAL))
    assert long_model.rotary.attention_factor == short_model.rotary.attention_factor == pytest.approx(expected_factor)
    ids = _ids(30, seed=4)
    want = _hf_logits(hf, ids)
    torch.testing.assert_close(prefill_logits(short_model, ids, 8), want, atol=1e-4, rtol=1e-4)
    assert (prefill_logits(long_model, ids, 8) - want).abs().max() > 1e-2


@pytest.mark.parametrize("case", ["longrope-short", "longrope-long", "partial-tied"])
def test_engine_greedy_matches_transformers(case, tmp_path):
    """32 greedy tokens per request through LLMEngine (mixed batch, 16-token chunked prefill,
    then a prompt sharing a cached prefix). Short regime: prompt + output stay within 64
    tokens; long regime: prompts longer than 64, so that transformers uses the long factors
    at every step, as kvflow does."""
    overrides, max_model_len, _ = CASES[case]
    hf = save_phi3(tmp_path, seed=5, **overrides)
    if max_model_len == ORIGINAL:
        prompts = [_ids(21, 6), _ids(9, 7), _ids(30, 8)]
        shared = prompts[0][:12] + _ids(7, 9)
    else:
        prompts = [_ids(70, 6), _ids(66, 7), _ids(90, 8)]
        shared = prompts[0][:68] + _ids(5, 9)
    kwargs = {} if max_model_len is None else {"max_model_len": max_model_len}
    stats = engine_greedy_matches_hf(tmp_path, hf, prompts, shared, **kwargs)
    assert stats["min_margin"] > 1e-4  # every step decided by more than the 1e-4 logits tolerance


def test_fused_tensors_shard_over_two_ranks(tmp_path):
    """qkv_proj and gate_up_proj load whole (shard_id None) on each rank; each rank's shard
    holds its query heads, its KV head and its half of gate and of up, and the two shards
    reassemble the checkpoint tensors."""
    hf = save_phi3(tmp_path)
    shards = [load_model(tmp_path, torch.float32, CPU, tp=TensorParallel(rank, 2))[0] for rank in (0, 1)]
    hd, ff = 16, 96
    for i in range(2):
        ref = hf.model.layers[i]
        qkv = [s.layers[i].self_attn.qkv_proj.weight for s in shards]
        assert qkv[0].shape == (2 * hd + 2 * hd, 64)  # 2 query heads, 1 K head, 1 V head
        (q0, k0, v0), (q1, k1, v1) = [t.split([2 * hd, hd, hd]) for t in qkv]
        full = torch.cat([q0, q1, k0, k1, v0, v1])
        assert torch.equal(full, ref.self_attn.qkv_proj.weight)
        (gate0, up0), (gate1, up1) = [s.layers[i].mlp.gate_up_proj.weight.split(ff // 2) for s in shards]
        full = torch.cat([gate0, gate1, up0, up1])
        assert torch.equal(full, ref.mlp.gate_up_proj.weight)
        o = torch.cat([s.layers[i].self_attn.o_proj.weight for s in shards], dim=1)
        assert torch.equal(o, ref.self_attn.o_proj.weight)
        down = torch.cat([s.layers[i].mlp.down_proj.weight for s in shards], dim=1)
        assert torch.equal(down, ref.mlp.down_proj.weight)


def test_sliding_window_matches_transformers(tmp_path):
    """Phi-3-mini-4k's window (2047 of 4096), here 8 tokens of 256, in every layer: 40-token
    prompts in chunks of 1, 7 and 64 as transformers (eager, sliding-window mask)."""
    hf = save_phi3(tmp_path, sliding_window=8, attn_implementation="eager")
    model, config = load_model(tmp_path, torch.float32, CPU)
    assert set(config.sliding_windows) == {8} and config.kv_free_window == 8
    ids = _ids(40, seed=1)
    with torch.inference_mode():
        want = hf(torch.tensor([ids])).logits[0]
    for chunk in (1, 7, 64):
        torch.testing.assert_close(prefill_logits(model, ids, chunk), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [({"hidden_act": "gelu_new"}, "hidden_act='gelu_new'"),
     ({"partial_rotary_factor": 0.5625}, "partial_rotary_factor=0.5625")],  # 9 of 16 dims: odd
)  # fmt: skip
def test_unsupported_fields_are_refused(overrides, message, tmp_path):
    save_phi3(tmp_path, **overrides)
    with pytest.raises(ValueError, match=message):
        load_model(tmp_path, torch.float32, CPU)


def _phi3_gguf_tensors(hf: transformers.Phi3ForCausalLM) -> dict[str, np.ndarray]:
    """The HF state dict under llama.cpp's phi3 names: fused attn_qkv, ffn_up = gate_up."""
    layer = {"self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output", "mlp.gate_up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
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
    """A phi3 GGUF written as llama.cpp's Phi3MiniModel does (fused tensors, LongRoPE factors
    as tensors, attn_factor, partial rotary dimension count, sliding_window 0) converts to the
    HF folder's config and weights and runs the same logits."""
    rope = longrope(12)
    hf = save_phi3(tmp_path / "hf", seed=11, vocab_size=261, rope_scaling=rope, partial_rotary_factor=0.75)
    attn_factor = float(np.sqrt(1 + np.log(256 / ORIGINAL) / np.log(ORIGINAL)))

    def configure(w: gguf.GGUFWriter) -> None:
        w.add_context_length(256)
        w.add_rope_scaling_orig_ctx_len(ORIGINAL)
        w.add_embedding_length(64)
        w.add_feed_forward_length(96)
        w.add_block_count(2)
        w.add_head_count(4)
        w.add_head_count_kv(2)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_rope_dimension_count(12)
        w.add_rope_freq_base(10000.0)
        w.add_sliding_window(0)
        w.add_rope_scaling_attn_factors(attn_factor)

    tensors = _phi3_gguf_tensors(hf)
    tensors["rope_factors_long.weight"] = np.array(rope["long_factor"], np.float32)
    tensors["rope_factors_short.weight"] = np.array(rope["short_factor"], np.float32)
    write_gguf(tmp_path / "tiny-phi3.gguf", "phi3", tensors, configure)
    out = resolve.resolve_model(str(tmp_path / "tiny-phi3.gguf"), cache_dir=tmp_path / "cache")
    config = resolve.load_config(out)
    assert type(config).__name__ == "Phi3Config" and config.sliding_window is None
    params = config.rope_parameters
    assert params["rope_type"] == "longrope" and params["partial_rotary_factor"] == 0.75
    assert params["original_max_position_embeddings"] == ORIGINAL
    for name in ("long_factor", "short_factor"):  # float32 in the file, as the model uses them
        np.testing.assert_array_equal(np.float32(params[name]), np.float32(rope[name]))
    from_gguf, gguf_config = load_model(out, torch.float32, CPU)
    from_hf, hf_config = load_model(tmp_path / "hf", torch.float32, CPU)
    assert gguf_config.rotary_dim == hf_config.rotary_dim == 12
    assert from_gguf.rotary.attention_factor == pytest.approx(from_hf.rotary.attention_factor, rel=1e-7)
    for (name, a), (_, b) in zip(from_gguf.state_dict().items(), from_hf.state_dict().items()):
        assert torch.equal(a, b), name
    ids = _ids(100, 12, vocab=261)
    torch.testing.assert_close(prefill_logits(from_gguf, ids, 16), _hf_logits(hf, ids), atol=1e-4, rtol=1e-4)
