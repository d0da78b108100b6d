"""Weight quantization schemes (``kvflow.quantization.schemes``) and the KV cache's per-token
quantization (``kvflow.attention.kv_cache.quantize_kv``): error bounds, shapes and dtypes,
group-size validation.

Bounds (per element, on random tensors with a spread of magnitudes and a few outliers):

- INT8 (symmetric, per output channel): |w - q s| <= s / 2 (round to nearest; the channel's
  max maps to exactly 127, so nothing is clipped).
- INT4 (asymmetric, per group of ``group_size`` inputs): |w - ((q - 8) s + z)| <= s / 2 with
  the group's own s = (max - min) / 15.
- FP8 E4M3 (per output channel scale, max -> 448): relative error <= 2^-4 (3 mantissa bits,
  half an ulp) where |w / s| is in the normal range (>= 2^-6); below it the absolute error is
  at most half the subnormal step, 2^-10 s.

A few float32 ulps are allowed on top of each bound (the dequantization itself rounds).
"""

from __future__ import annotations

import pytest
import torch

from kvflow.engine.arg_utils import EngineArgs
from kvflow.attention.kv_cache import quantize_kv
from kvflow.model.loader import quantize_model
from kvflow.quantization.int4 import group_size_for
from kvflow.quantization.registry import check_method
from kvflow.quantization.schemes import (
    FP8_MAX,
    dequantize_fp8,
    dequantize_int4,
    dequantize_int8,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
)

EPS = 4 * torch.finfo(torch.float32).eps  # slack for the float32 arithmetic of dequantization


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Small tensors: on a shared 2-core machine extra intra-op threads only spin."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def random_weight(n: int, k: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Gaussian weights whose rows span several orders of magnitude, with a few outliers and
    an all-zero row (the degenerate scale)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 1, n)[:, None]
    w.view(-1)[torch.randint(0, n * k, (max(1, n * k // 500),), generator=g)] *= 30.0
    w[n // 2] = 0.0
    return w.to(dtype)


# ---------------------------------------------------------------------------- INT8


@pytest.mark.parametrize("shape", [(1, 1), (7, 33), (64, 576), (256, 1024)])
def test_int8_error_at_most_half_a_step_per_element(shape):
    w = random_weight(*shape)
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (shape[0],)
    assert int(q.abs().max()) <= 127
    err = (dequantize_int8(q, scale) - w).abs()
    bound = scale[:, None] / 2 + EPS * w.abs()
    assert bool((err <= bound).all()), float((err / scale[:, None]).max())
    # each channel's max magnitude is represented exactly up to float rounding: full range used
    nonzero = w.abs().amax(dim=1) > 0
    assert bool((q[nonzero].abs().amax(dim=1) == 127).all())


def test_int8_zero_row_and_low_precision_inputs():
    w = random_weight(16, 64, dtype=torch.bfloat16)
    q, scale = quantize_int8(w)
    assert scale.dtype == torch.float32
    assert bool((q[8] == 0).all())  # the all-zero row stays zero (scale clamped, no NaN)
    w_hat = dequantize_int8(q, scale)
    assert w_hat.dtype == torch.float32 and bool(torch.isfinite(w_hat).all())
    assert bool(((w_hat - w.float()).abs() <= scale[:, None] / 2 + EPS * w.float().abs()).all())


# ---------------------------------------------------------------------------- INT4


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("shape", [(16, 128), (48, 768), (96, 1536)])
def test_int4_error_at_most_half_a_step_per_group(shape, group_size):
    n, k = shape
    if k % group_size:
        pytest.skip("shape not divisible by the group size")
    w = random_weight(n, k, seed=group_size)
    q, scale, zero = quantize_int4(w, group_size)
    assert q.dtype == torch.uint8 and q.shape == (n, k)
    assert int(q.max()) <= 15
    groups = k // group_size
    assert scale.shape == zero.shape == (n, groups)
    assert scale.dtype == zero.dtype == torch.float32
    w_hat = dequantize_int4(q, scale, zero)
    assert w_hat.dtype == torch.float32 and w_hat.shape == (n, k)
    err = (w_hat - w).abs().view(n, groups, group_size)
    per_group_step = scale[..., None]
    slack = EPS * (w.abs().view(n, groups, group_size) + zero.abs()[..., None] + 8 * per_group_step)
    assert bool((err <= per_group_step / 2 + slack).all()), float((err / per_group_step).max())
    # the step really is the group's range / 15 (a larger one would pass the bound trivially)
    g = w.view(n, groups, group_size)
    expected = ((g.amax(-1) - g.amin(-1)) / 15).clamp(min=1e-12)
    torch.testing.assert_close(scale, expected)


def test_int4_group_endpoints_are_exact():
    """Round-to-nearest over [min, max]: the group's min and max land on codes 0 and 15."""
    w = random_weight(8, 64, seed=3)
    q, scale, zero = quantize_int4(w, 32)
    g = q.view(8, 2, 32)
    nonconstant = scale > 1e-9
    assert bool((g.amin(-1)[nonconstant] == 0).all()) and bool((g.amax(-1)[nonconstant] == 15).all())


def test_int4_constant_group_is_exact():
    w = torch.full((4, 64), 0.37)
    q, scale, zero = quantize_int4(w, 32)
    torch.testing.assert_close(dequantize_int4(q, scale, zero), w, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------- FP8


@pytest.mark.parametrize("shape", [(3, 8), (33, 257), (128, 576)])
def test_fp8_relative_error_in_normal_range(shape):
    w = random_weight(*shape, seed=7)
    q, scale = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (shape[0],)
    assert float(q.float().abs().max()) <= FP8_MAX
    w_hat = dequantize_fp8(q, scale)
    assert w_hat.dtype == torch.float32 and bool(torch.isfinite(w_hat).all())
    scaled = w.abs() / scale[:, None]
    err = (w_hat - w).abs()
    normal = scaled >= 2.0**-6
    rel = err[normal] / w.abs()[normal]
    assert float(rel.max()) <= 2.0**-4 * (1 + 1e-5), float(rel.max())
    # subnormal range: absolute error at most half the subnormal step 2^-9 (times the scale)
    sub = ~normal
    assert bool((err[sub] <= 2.0**-10 * scale[:, None].expand_as(w)[sub] * (1 + 1e-5)).all())


def test_fp8_bound_is_tight_enough_to_mean_something():
    """The 2^-4 bound must not be loose: on many values the worst relative error is close
    to it (3 mantissa bits), and clearly above INT8-like precision."""
    w = torch.linspace(1.0, 2.0, 4097)[None, :]
    q, scale = quantize_fp8(w)
    rel = ((dequantize_fp8(q, scale) - w).abs() / w).max()
    assert 2.0**-5 < float(rel) <= 2.0**-4 * (1 + 1e-5)


# ---------------------------------------------------------------------------- KV cache


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_quantize_kv_error(dtype):
    """Per token and head: INT8 within half a step (plus the float16 rounding of the stored
    scale, at most 127 * 2^-11 of a step), FP8 within 2^-4 relative (plus the same)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 3, 64, generator=g) * torch.logspace(-1, 1, 37)[:, None, None]
    x[5, 1] = 0.0
    values, scales = quantize_kv(x, dtype)
    assert values.dtype == dtype and values.shape == x.shape
    assert scales.dtype == torch.float16 and scales.shape == (37, 3)
    s = scales.float()[..., None]
    x_hat = values.float() * s
    err = (x_hat - x).abs()
    if dtype == torch.int8:
        assert bool((err <= s * (0.5 + 130 * 2.0**-11)).all()), float((err / s).max())
    else:
        normal = x.abs() / s >= 2.0**-6
        rel = err[normal] / x.abs()[normal]
        assert float(rel.max()) <= 2.0**-4 + 2.0**-10
    assert bool((x_hat[5, 1] == 0).all())


# ---------------------------------------------------------------------------- validation


def test_int4_rejects_indivisible_group():
    with pytest.raises(ValueError, match="divisible by group_size"):
        quantize_int4(torch.randn(4, 96), 64)


@pytest.mark.parametrize("bad", [0, 16, 48, 256, -32])
def test_engine_args_group_size_must_be_32_64_or_128(bad):
    with pytest.raises(ValueError, match="quantization_group_size"):
        EngineArgs(quantization="int4", quantization_group_size=bad).verify()


@pytest.mark.parametrize("good", [32, 64, 128])
def test_engine_args_accepts_group_sizes(good):
    EngineArgs(quantization="int4", quantization_group_size=good).verify()


@pytest.mark.parametrize("method", ["int8", "fp8", "gguf", None])
def test_a_group_size_is_refused_where_no_int4_method_reads_it(method):
    """It was taken and changed nothing (``kvflow quantize`` already refused it)."""
    with pytest.raises(ValueError, match=f"quantization_group_size=64 is for the INT4 methods .*{method!r}"):
        EngineArgs(quantization=method, quantization_group_size=64).verify()
    EngineArgs(quantization=method).verify()


def test_gguf_quantization_of_a_float_folder_is_refused(tmp_path):
    """``quantization="gguf"`` on a Hugging Face float folder loaded the float weights."""
    from conftest import tiny_hf_model_dir

    folder = tiny_hf_model_dir(tmp_path / "m")
    with pytest.raises(ValueError, match="quantization='gguf' computes a GGUF file's quantized tensors as stored"):
        EngineArgs(model=str(folder), device="cpu", quantization="gguf").create_config()


def test_unknown_method_rejected():
    with pytest.raises(ValueError, match="quantization must be one of"):
        check_method("int3")
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineArgs(quantization="nf4").verify()
    check_method(None)


def test_quantize_model_refuses_gguf_and_awq_without_data():
    from conftest import tiny_model, tiny_model_config

    model = tiny_model(tiny_model_config())
    with pytest.raises(ValueError, match="gguf"):
        quantize_model(model, "gguf")
    with pytest.raises(ValueError, match="calibration"):
        quantize_model(model, "int4-awq", 32, calibration_ids=None)


@pytest.mark.parametrize(
    "in_features, requested, expected",
    [(576, 128, 64), (1536, 128, 128), (896, 128, 128), (4864, 64, 64), (96, 128, 32), (40, 32, 8)],
)
def test_group_size_for_halves_until_it_divides(in_features, requested, expected):
    assert group_size_for(in_features, requested) == expected


def test_group_size_for_gives_up_below_8():
    with pytest.raises(ValueError, match="no INT4 group size"):
        group_size_for(100, 128)


@pytest.mark.parametrize("good", [False, True, "int8", "int4", "fp8"])
def test_engine_args_quantize_lm_head_values(good):
    EngineArgs(quantization="int4", quantize_lm_head=good).verify()


@pytest.mark.parametrize("bad", ["int2", "yes", 1, "INT8"])
def test_engine_args_quantize_lm_head_rejects_others(bad):
    with pytest.raises(ValueError, match="quantize_lm_head"):
        EngineArgs(quantization="int4", quantize_lm_head=bad).verify()


def test_awq_without_a_tokenizer_says_it_needs_one(tmp_path):
    """A folder without tokenizer files (it runs on token ids) met transformers' unrelated
    "Couldn't instantiate the backend tokenizer" under int4-awq."""
    from conftest import tiny_hf_model_dir
    from kvflow import LLM

    folder = tiny_hf_model_dir(tmp_path / "m")
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json"):
        (folder / name).unlink(missing_ok=True)
    with pytest.raises(ValueError, match="int4-awq calibrates on real text, which needs the model's tokenizer"):
        LLM(str(folder), device="cpu", dtype="float32", quantization="int4-awq", num_kv_blocks=16)


@pytest.mark.parametrize("arch", ["qwen2", "gemma3_text"])
def test_awq_with_a_vocabulary_less_tokenizer_says_it_needs_one(arch, tmp_path):
    """A Qwen2 or Gemma 3 folder without tokenizer files: transformers builds a tokenizer with
    no vocabulary for it, so the calibration text encoded to [] (Qwen2: a RuntimeError from
    the embedding on an empty float tensor) or to one unknown token (Gemma: AWQ silently
    calibrated on a single meaningless token)."""
    import transformers

    from kvflow import LLM

    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    if arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    else:
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**common, head_dim=16))
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="int4-awq calibrates on real text.*has no vocabulary"):
        LLM(str(tmp_path), device="cpu", dtype="float32", quantization="int4-awq", num_kv_blocks=16)
