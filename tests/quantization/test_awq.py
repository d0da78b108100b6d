"""Activation-aware weight quantization (``kvflow.quantization.awq``) on tiny random models.

The tiny models get a few outlier input channels on every quantized linear (large RMSNorm
weights for Q/K/V and gate/up, large "up" rows for down_proj): the situation AWQ is built
for (Lin et al. 2024, section 3.2: a few salient channels dominate the output error of
round-to-nearest). Calibration uses 128 tokens, within ``MAX_SEARCH_ROWS``, so the per-layer
search sees all of them and can never pick a scale worse than plain RTN (alpha = 0 is in the
grid) on that data.
"""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import prefill_logits, tiny_model, tiny_model_config
from kvflow.model.loader import quantize_model
from kvflow.quantization.int4 import Int4LinearMethod
from kvflow.quantization.awq import MAX_SEARCH_ROWS, apply_awq, collect_linear_inputs, search_scale
from kvflow.quantization.schemes import dequantize_int4, quantize_int4

GROUP = 32
NUM_CALIBRATION = 128
OUTLIERS = [3, 17, 40, 58]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def outlier_model(**overrides):
    config = tiny_model_config(**overrides)
    model = tiny_model(config, seed=1)
    inter = config.intermediate_size
    with torch.no_grad():
        for layer in model.layers:
            layer.input_layernorm.weight[OUTLIERS] = 12.0
            layer.post_attention_layernorm.weight[OUTLIERS] = 12.0
            up_rows = [inter + c for c in (5, 77, 100)]
            layer.mlp.gate_up_proj.weight[up_rows] *= 10.0
    return model


def calibration_ids(seed: int = 0, n: int = NUM_CALIBRATION) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (n,), generator=g).tolist()


def linear_names(model) -> list[str]:
    names = []
    for i in range(len(model.layers)):
        names += [f"layers.{i}.self_attn.qkv_proj", f"layers.{i}.mlp.gate_up_proj", f"layers.{i}.mlp.down_proj"]
    return names


@pytest.mark.parametrize("biases", [False, True])
def test_folding_leaves_float_model_unchanged(biases):
    model = outlier_model(attention_bias=biases, mlp_bias=biases)
    ids = calibration_ids()
    before = prefill_logits(model, ids, chunk=len(ids))
    awq = copy.deepcopy(model)
    alphas = apply_awq(awq, ids, GROUP)
    after = prefill_logits(awq, ids, chunk=len(ids))
    # the weights did change (this is not a no-op) ...
    changed = [
        name for name, p in awq.named_parameters()
        if not torch.equal(p, dict(model.named_parameters())[name])
    ]
    assert any("qkv_proj" in n for n in changed) and any("input_layernorm" in n for n in changed)
    assert any(a > 0 for a in alphas.values())
    # ... but the float function did not: rescaling by s and 1/s is exact up to float rounding
    scale = float(before.abs().max())
    assert float((after - before).abs().max()) <= 1e-4 * max(1.0, scale), (scale, float((after - before).abs().max()))
    # also on text it was not calibrated on
    other = calibration_ids(seed=5, n=64)
    torch.testing.assert_close(
        prefill_logits(awq, other, chunk=64), prefill_logits(model, other, chunk=64), rtol=0, atol=1e-4 * max(1.0, scale)
    )


def test_alphas_cover_every_linear_and_stay_in_grid():
    model = outlier_model()
    alphas = apply_awq(model, calibration_ids(), GROUP)
    assert set(alphas) == set(linear_names(model))
    assert all(0.0 <= a <= 1.0 for a in alphas.values())


def _rtn_error(w: torch.Tensor, x: torch.Tensor, s: torch.Tensor) -> float:
    q, scale, zero = quantize_int4(w * s, GROUP)
    w_hat = dequantize_int4(q, scale, zero) / s
    return float((x @ w_hat.t() - x @ w.t()).pow(2).mean())


def test_search_never_worse_than_rtn_per_linear():
    """On its calibration inputs each linear's AWQ output error is at most RTN's, and the
    outlier channels make it clearly lower for most of them."""
    model = outlier_model()
    assert NUM_CALIBRATION <= MAX_SEARCH_ROWS
    names = linear_names(model)
    inputs = collect_linear_inputs(model, calibration_ids(), names)
    modules = dict(model.named_modules())
    ratios = {}
    for name in names:
        w, x = modules[name].weight.detach().float(), inputs[name]
        assert x.shape == (NUM_CALIBRATION, w.shape[1])
        s, alpha = search_scale(w, x, GROUP)
        awq, rtn = _rtn_error(w, x, s), _rtn_error(w, x, torch.ones(w.shape[1]))
        assert awq <= rtn * (1 + 1e-6), name
        ratios[name] = awq / rtn
    assert sum(r < 0.8 for r in ratios.values()) >= len(ratios) // 2, ratios


def test_awq_int4_beats_rtn_int4_end_to_end():
    """Whole-model logits error against the float model: AWQ+INT4 below RTN INT4 on the
    calibration tokens, and not worse on other tokens."""
    model = outlier_model()
    calib, held_out = calibration_ids(), calibration_ids(seed=9, n=96)
    ref = {k: prefill_logits(model, ids, chunk=len(ids)) for k, ids in (("calib", calib), ("held_out", held_out))}
    rtn, awq = copy.deepcopy(model), copy.deepcopy(model)
    quantize_model(rtn, "int4", GROUP)
    quantize_model(awq, "int4-awq", GROUP, calibration_ids=calib)
    assert all(isinstance(layer.mlp.down_proj.quant_method, Int4LinearMethod) for layer in awq.layers)

    def mse(m, key, ids):
        return float((prefill_logits(m, ids, chunk=len(ids)) - ref[key]).pow(2).mean())

    rtn_calib, awq_calib = mse(rtn, "calib", calib), mse(awq, "calib", calib)
    rtn_held, awq_held = mse(rtn, "held_out", held_out), mse(awq, "held_out", held_out)
    assert awq_calib < 0.8 * rtn_calib, (awq_calib, rtn_calib)
    assert awq_held <= rtn_held, (awq_held, rtn_held)


def test_awq_keeps_the_gemma3_float_model(tmp_path):
    """AWQ's rescaling is float-equivalent on Gemma 3 too, whose MLP input is
    pre_feedforward_layernorm(x), not post_attention_layernorm (which normalizes the
    attention output before the residual): folding the gate/up scales into the latter
    changed the float model (logits off by ~0.4 on this tiny one)."""
    import transformers

    from kvflow.model.loader import load_model

    config = transformers.Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=8, max_position_embeddings=128)
    torch.manual_seed(0)
    hf = transformers.Gemma3ForCausalLM(config)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(0.0, 0.1 if "norm" in name else 0.2)
    hf.save_pretrained(tmp_path)
    model, _ = load_model(tmp_path, torch.float32, torch.device("cpu"))
    prompt = calibration_ids(seed=5, n=20)
    before = prefill_logits(model, prompt, 64)
    apply_awq(model, calibration_ids(), GROUP)
    torch.testing.assert_close(prefill_logits(model, prompt, 64), before, atol=1e-4, rtol=1e-4)


def test_calibration_longer_than_the_context_uses_its_first_context_tokens():
    """The default calibration text is 512 tokens; on a model whose context is shorter the
    calibration prompt ran past the RoPE table (IndexError in RotaryEmbedding.cos_sin).
    apply_awq now calibrates on the first context_len tokens, as if given only those."""
    model = outlier_model(max_position_embeddings=64)
    ids = calibration_ids(n=200)
    clipped = copy.deepcopy(model)
    alphas = apply_awq(model, ids, GROUP)
    assert alphas == apply_awq(clipped, ids[:64], GROUP)
    for a, b in zip(model.parameters(), clipped.parameters()):
        assert torch.equal(a, b)
