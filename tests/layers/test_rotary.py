"""apply_rotary: the C++ kernel is bit-identical to the three PyTorch ops it replaces; the
frequency schedules (YaRN, dynamic NTK, LongRoPE, ...) and partial rotary against transformers."""

from __future__ import annotations

import math

import pytest
import torch

from kvflow.layers import rotary
from kvflow.layers.rotary import RotaryEmbedding, apply_rotary


def _reference(x, cos, sin):
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


@pytest.mark.skipif(rotary._EXTENSION.load() is None, reason="the C++ rotary kernel could not be built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_kernel_is_bit_identical_on_strided_heads(dtype, tokens, monkeypatch):
    """Query and key heads read in place from a fused QKV row (strided), as the model does."""
    emb = RotaryEmbedding(64, 4096, 10000.0, None)
    g = torch.Generator().manual_seed(tokens)
    qkv = (torch.randn(tokens, 15 * 64, generator=g) * 4).to(dtype)
    x = qkv[:, : 12 * 64].view(tokens, -1, 64)
    cos, sin = emb.cos_sin(torch.randint(0, 4096, (tokens,), generator=g), dtype)
    calls = []
    load = rotary._EXTENSION.load
    monkeypatch.setattr(rotary._EXTENSION, "load", lambda: calls.append(1) or load())
    with torch.inference_mode():
        got = apply_rotary(x, cos, sin)
    assert calls and torch.equal(got, _reference(x, cos, sin))


def test_other_inputs_take_the_pytorch_ops(monkeypatch):
    monkeypatch.setattr(rotary._EXTENSION, "load", lambda: pytest.fail("the kernel must not run"))
    emb = RotaryEmbedding(16, 64, 10000.0, None)
    cos, sin = emb.cos_sin(torch.arange(3), torch.float16)
    x = torch.randn(3, 2, 16).half()
    assert torch.equal(apply_rotary(x, cos, sin), _reference(x, cos, sin))  # float16
    cos, sin = emb.cos_sin(torch.arange(1), torch.float32)
    x = torch.randn(3, 2, 16)
    assert torch.equal(apply_rotary(x, cos, sin), _reference(x, cos, sin))  # tables broadcast over tokens
    cos, sin = emb.cos_sin(torch.arange(3), torch.float32)
    x = torch.randn(3, 2, 16, requires_grad=True)
    apply_rotary(x, cos, sin).sum().backward()  # autograd
    assert x.grad is not None


# --- frequency schedules against transformers.modeling_rope_utils -----------------------------

import transformers  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from kvflow.config import ModelConfig  # noqa: E402
from kvflow.layers.rotary import rope_frequencies  # noqa: E402

_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}
SCHEDULES = {
    # name: (rope_parameters, max_position_embeddings of the config)
    "linear": ({"rope_type": "linear", "factor": 2.0}, 1024),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 512}, 4096),
    "yarn": (_YARN, 512),
    "yarn-betas-untruncated": ({**_YARN, "beta_fast": 16, "beta_slow": 2, "truncate": False}, 512),
    "yarn-mscale": ({**_YARN, "mscale": 0.707, "mscale_all_dim": 1.0}, 2048),  # DeepSeek-style
    "yarn-attention-factor": ({**_YARN, "attention_factor": 1.25}, 512),
    "yarn-implicit-factor": ({"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 512}, 2048),
    "dynamic": ({"rope_type": "dynamic", "factor": 3.0}, 512),
    "longrope": ({"rope_type": "longrope", "original_max_position_embeddings": 512,
                  "short_factor": [1.0 + 0.01 * i for i in range(32)],
                  "long_factor": [1.0 + 0.5 * i for i in range(32)]}, 8192),
}


def _hf_config(params: dict, max_position_embeddings: int) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(hidden_size=512, num_attention_heads=8, head_dim=64,
                                    max_position_embeddings=max_position_embeddings,
                                    rope_parameters={**params, "rope_theta": 10000.0})


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_frequencies_and_attention_factor_equal_transformers(name):
    """kvflow's inv_freq and attention factor against transformers' own rope init function,
    at the length where kvflow fixes the length-dependent ones: dynamic NTK at factor x
    context (kvflow's context; transformers recomputes for each longer sequence), LongRoPE's
    long factors past the original context (kvflow: max_model_len) and short ones within."""
    params, max_pos = SCHEDULES[name]
    hf = _hf_config(params, max_pos)
    config = ModelConfig.from_hf_config(hf)
    fn = ROPE_INIT_FUNCTIONS[params["rope_type"]]
    lengths = {"dynamic": [config.max_position_embeddings], "longrope": [512, 513, 8192]}.get(name, [max_pos])
    for length in lengths:
        want, want_factor = fn(hf, torch.device("cpu"), seq_len=length)
        got, factor = rope_frequencies(config.rotary_dim, config.rope_theta, config.rope_scaling, max_model_len=length)
        assert torch.equal(got, want), (name, length)
        assert factor == want_factor, (name, length)
    if name == "dynamic":
        assert config.max_position_embeddings == 3 * 512  # vLLM's derived context
        # below that length transformers would use other frequencies: the fixed choice is visible
        assert not torch.equal(fn(hf, torch.device("cpu"), seq_len=1000)[0], got)
    if name.startswith("yarn") and name != "yarn-implicit-factor":
        assert config.max_position_embeddings == max(max_pos, 4 * 512)


def test_tables_carry_the_attention_factor_like_transformers():
    """cos / sin equal transformers' rotary embedding output, which multiplies both by the
    schedule's attention_scaling (YaRN: 0.1 ln 4 + 1 here)."""
    hf = _hf_config(_YARN, 512)
    config = ModelConfig.from_hf_config(hf)
    emb = RotaryEmbedding(64, config.max_position_embeddings, config.rope_theta, config.rope_scaling)
    positions = torch.tensor([0, 1, 700, 2047])
    want_cos, want_sin = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf)(
        torch.zeros(1, dtype=torch.float32), positions[None]
    )
    cos, signed_sin = emb.cos_sin(positions, torch.float32)
    assert emb.attention_factor == pytest.approx(1 + 0.1 * math.log(4.0))
    torch.testing.assert_close(cos[:, 0], want_cos[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(signed_sin[:, 0, 32:], want_sin[0, :, 32:], atol=1e-6, rtol=0)
    torch.testing.assert_close(signed_sin[:, 0, :32], -want_sin[0, :, :32], atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_rotary_equals_transformers(dtype):
    """Tables of rotary_dim < head_dim rotate the first rotary_dim dims of each head and pass
    the rest through, as transformers' Phi-3 apply_rotary_pos_emb."""
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    emb = RotaryEmbedding(16, 64, 10000.0, None, rotary_dim=12)
    assert emb.slow_mask[12:].tolist() == [1.0] * 4  # unrotated dims never move
    positions = torch.arange(5, 10)
    x = torch.randn(5, 3, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    cos, signed_sin = emb.cos_sin(positions, dtype)
    sin = torch.cat([-signed_sin[..., :6], signed_sin[..., 6:]], dim=-1)
    # transformers' layout: [batch, heads, T, D] with cos / sin [batch, T, rotary_dim]
    want, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos[:, 0][None], sin[:, 0][None])
    got = apply_rotary(x, cos, signed_sin)
    assert torch.equal(got[..., 12:], x[..., 12:])
    tol = 1e-6 if dtype == torch.float32 else 2**-7  # bfloat16: one rounding step (fused multiply-add)
    torch.testing.assert_close(got, want[0].transpose(0, 1), atol=tol, rtol=tol)


def test_unsupported_schedules_are_refused():
    with pytest.raises(ValueError, match="rope scaling type 'mrope' is not supported"):
        RotaryEmbedding(16, 64, 10000.0, {"rope_type": "mrope"})
    bad = {"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 16,
           "short_factor": [1.0] * 3, "long_factor": [1.0] * 8}
    with pytest.raises(ValueError, match="short_factor has 3 entries, expected rotary_dim / 2 = 8"):
        RotaryEmbedding(16, 64, 10000.0, bad, max_model_len=16)
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        RotaryEmbedding(16, 64, 10000.0, None, rotary_dim=9)
