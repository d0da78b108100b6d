"""Gemma 3 (text) against transformers' Gemma3ForCausalLM on tiny random checkpoints: logits
through the paged path over prompts longer than the sliding window (chunked prefill), greedy
tokens through the engine (mixed batch, prefix cache, both CPU backends), refused fields."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from conftest import engine_greedy_matches_hf, prefill_logits, randomize_hf_model
from kvflow.model.gemma3 import Gemma3ForCausalLM
from kvflow.model.loader import load_model

pytestmark = pytest.mark.usefixtures("one_thread")
CPU = torch.device("cpu")
LOCAL, GLOBAL = "sliding_attention", "full_attention"


def gemma3_config(**overrides) -> transformers.Gemma3TextConfig:
    """4 layers (local, local, global, local) with a window of 8 tokens, 4 query / 2 KV heads of
    head_dim 32, query_pre_attn_scalar 24 (not head_dim), logits soft-capped at 30."""
    fields = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, sliding_window=8,
                  layer_types=[LOCAL, LOCAL, GLOBAL, LOCAL], max_position_embeddings=256,
                  final_logit_softcapping=30.0, rope_local_base_freq=100.0, attn_implementation="eager")
    fields.update(overrides)
    return transformers.Gemma3TextConfig(**fields)


def save_gemma3(path: Path, seed: int = 0, **overrides) -> transformers.Gemma3ForCausalLM:
    hf = randomize_hf_model(transformers.Gemma3ForCausalLM(gemma3_config(**overrides)), seed)
    hf.save_pretrained(path)
    return hf


def _ids(n: int, seed: int, vocab: int = 128) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize(
    "overrides",
    [{}, {"num_key_value_heads": 1, "final_logit_softcapping": None},
     {"sliding_window_pattern": 2, "layer_types": None, "num_hidden_layers": 3},
     {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}],
    ids=["gqa-softcap", "mqa", "pattern", "linear-rope"],
)  # fmt: skip
def test_logits_match_transformers(overrides, tmp_path):
    """40 tokens against a window of 8: prefill in chunks of 1 (decode-like), 7 and 64."""
    hf = save_gemma3(tmp_path, **overrides)
    model, config = load_model(tmp_path, torch.float32, CPU)
    assert isinstance(model, Gemma3ForCausalLM)
    want_windows = [8 if t == LOCAL else None for t in hf.config.layer_types]
    assert config.sliding_windows == want_windows and any(want_windows) and not all(want_windows)
    assert [layer.self_attn.attn.sliding_window for layer in model.layers] == want_windows
    # local RoPE base 100: the second frequency pair turns 100 ** (-2 / 32) rad per position
    assert model.rotary_local.cos[1, 1].item() == pytest.approx(torch.cos(torch.tensor(100 ** (-1 / 16))).item())
    ids = _ids(40, seed=1)
    with torch.inference_mode():
        want = hf(torch.tensor([ids])).logits[0]
    for chunk in (1, 7, 64):
        torch.testing.assert_close(prefill_logits(model, ids, chunk), want, atol=1e-4, rtol=1e-4)


def test_window_changes_the_logits(tmp_path):
    """The window acts: the same weights with the window as wide as the context give other
    logits past the window (so the parity above cannot pass with full attention)."""
    hf = save_gemma3(tmp_path / "w")
    wide = transformers.Gemma3ForCausalLM(gemma3_config(sliding_window=256))
    wide.load_state_dict(hf.state_dict())
    ids = _ids(40, seed=1)
    with torch.inference_mode():
        a, b = hf(torch.tensor([ids])).logits[0], wide.eval()(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(a[:8], b[:8], atol=1e-5, rtol=1e-5)
    assert (a[8:] - b[8:]).abs().max() > 1e-2


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_engine_greedy_matches_transformers(backend, tmp_path):
    """32 greedy tokens per request through LLMEngine (prompts and generations far past the
    8-token window): a mixed batch of three prompts with chunked prefill (16-token steps),
    then a prompt sharing a cached prefix."""
    hf = save_gemma3(tmp_path, seed=2)
    prompts = [_ids(21, 3), _ids(9, 4), _ids(30, 5)]
    stats = engine_greedy_matches_hf(tmp_path, hf, prompts, prompts[0][:12] + _ids(7, 6), attention_backend=backend)
    assert stats["min_margin"] > 1e-4


@pytest.mark.parametrize(
    ("overrides", "match"),
    [({"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
     ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
     ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
     ({"layer_types": [LOCAL, "chunked_attention", GLOBAL, LOCAL]}, r"layer_types \['chunked_attention'\]")],
)  # fmt: skip
def test_unsupported_fields_are_refused(overrides, match, tmp_path):
    cfg = gemma3_config(**overrides)
    cfg.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=match):
        load_model(tmp_path, torch.float32, CPU)
