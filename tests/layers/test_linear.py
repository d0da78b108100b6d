"""oneDNN-prepacked linears (``kvflow.layers.linear``) and their use in the model.

The packed product must equal the ordinary bfloat16 product up to accumulation order: both
read the same bfloat16 weight and accumulate in float32, so the bound is a few bfloat16
ulps of the output. A model packed for the CPU must give the same logits as the same model
unpacked, and keep its weights reachable through ``state_dict``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kvflow.layers.linear as linear_mod
from kvflow.layers.linear import LinearBase, PackedLinear, UnquantizedLinearMethod, onednn_available, onednn_packs
from kvflow.model.loader import pack_for_cpu
from kvflow.quantization.int8 import Int8LinearMethod
from kvflow.quantization.registry import get_quantization_config
from tests.conftest import tiny_model, tiny_model_config

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this PyTorch build has no oneDNN linear ops")
# oneDNN packs bfloat16 only with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT: not on an AVX2-only
# x86 (nor under ONEDNN_MAX_CPU_ISA=AVX2), where the model keeps ATen's matmul instead.
needs_bf16 = pytest.mark.skipif(not onednn_packs(torch.bfloat16), reason="oneDNN cannot pack bfloat16 on this CPU")


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Elementwise error allowed between two float32-accumulated bf16 products: a bf16
    rounding of the output (2^-8 relative) plus float32 reassociation of the sum."""
    ref = (x.double() @ w.double().T).abs()
    return 2.0**-7 * ref + 1e-5 * (x.double().abs() @ w.double().abs().T)


@needs_bf16
@pytest.mark.parametrize("rows", [1, 2, 5, 16, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_equals_dense_product(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 80, bias=bias).to(torch.bfloat16)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    packed = PackedLinear.from_linear(linear)
    out = packed(x)
    assert out.shape == (rows, 80) and out.dtype == torch.bfloat16
    ref = F.linear(x.double(), linear.weight.double(), None if not bias else linear.bias.double())
    assert ((out.double() - ref).abs() <= _bound(x, linear.weight) + (2.0**-8 if bias else 0)).all()


@needs_bf16
def test_packed_accepts_non_contiguous_input():
    linear = nn.Linear(32, 16, bias=False).to(torch.bfloat16)
    x = torch.randn(4, 64, dtype=torch.bfloat16)[:, :32]
    torch.testing.assert_close(PackedLinear.from_linear(linear)(x), PackedLinear.from_linear(linear)(x.contiguous()))


@needs_bf16
def test_state_dict_gives_the_dense_weight_back():
    linear = nn.Linear(48, 32, bias=True).to(torch.bfloat16)
    state = PackedLinear.from_linear(linear).state_dict()
    assert set(state) == {"weight", "bias"}
    assert torch.equal(state["weight"], linear.weight.data)
    assert torch.equal(state["bias"], linear.bias.data)


def test_rejects_float32_weights_and_mismatched_inputs():
    with pytest.raises(ValueError, match="bfloat16"):
        PackedLinear(torch.randn(8, 8))
    if not onednn_packs(torch.bfloat16):
        return
    packed = PackedLinear(torch.randn(8, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="float32 input"):
        packed(torch.randn(2, 8))


def test_unquantized_method_packs_only_16_bit_dense_weights():
    linear = nn.Linear(16, 16)

    def layer(dtype, quant=None):
        return LinearBase.from_weights(linear.weight.data.to(dtype), linear.bias.data.to(dtype), quant)

    bf16, fp16, fp32 = layer(torch.bfloat16), layer(torch.float16), layer(torch.float32)  # fp32: left to ATen
    int8 = layer(torch.float32, get_quantization_config("int8"))  # quantized: has its own kernels
    # 16-bit types pack only where the CPU converts them natively (float16: avx512_fp16 or
    # avx_ne_convert, absent on an AMD Zen 4, where oneDNN raised): otherwise ATen's matmul.
    assert UnquantizedLinearMethod.is_packed(bf16) == onednn_packs(torch.bfloat16)
    assert UnquantizedLinearMethod.is_packed(fp16) == onednn_packs(torch.float16)
    assert not UnquantizedLinearMethod.is_packed(fp32) and "weight" in fp32._parameters
    assert isinstance(int8.quant_method, Int8LinearMethod) and int8.weight.dtype == torch.int8
    x = torch.randn(3, 16)
    torch.testing.assert_close(bf16(x.bfloat16()).float(), fp32(x), atol=0.05, rtol=0.05)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_cpu_without_the_16_bit_instructions_keeps_aten(dtype, monkeypatch, caplog):
    """As on a CPU without the instructions (AVX2-only for bfloat16; no avx512_fp16 for
    float16): the layers stay dense and compute the same thing, with one warning."""
    monkeypatch.setattr(linear_mod, "onednn_packs", lambda d: False)
    monkeypatch.setattr(linear_mod, "_warned", set())
    torch.manual_seed(0)
    dense = [nn.Linear(32, 16).to(dtype), nn.Linear(16, 8).to(dtype)]
    x = torch.randn(3, 32, dtype=dtype)
    want = dense[1](dense[0](x))
    with caplog.at_level("WARNING", logger="kvflow.layers.linear"):
        layers = [LinearBase.from_weights(m.weight.data, m.bias.data) for m in dense]
    assert not any(UnquantizedLinearMethod.is_packed(m) for m in layers)
    assert torch.equal(layers[1](layers[0](x)), want)
    warnings = [r for r in caplog.records if r.name == "kvflow.layers.linear"]
    assert len(warnings) == 1 and linear_mod.CPU_FEATURES_NEEDED[dtype] in warnings[0].getMessage()
    with pytest.raises(RuntimeError, match=linear_mod.CPU_FEATURES_NEEDED[dtype]):
        PackedLinear(dense[0].weight.data)


@pytest.mark.skipif(onednn_packs(torch.float16), reason="this CPU packs float16 weights")
def test_float16_weight_is_refused_naming_the_missing_feature():
    """On this CPU (no avx512_fp16 / avx_ne_convert) oneDNN's own error was a raw traceback
    from deep inside the reorder; the refusal names what is missing before calling it."""
    with pytest.raises(RuntimeError, match="avx512_fp16 or avx_ne_convert"):
        PackedLinear(torch.randn(8, 8, dtype=torch.float16))


@needs_bf16
@pytest.mark.parametrize("tied", [False, True])
def test_packed_model_matches_unpacked(tied):
    from kvflow.attention.torch_backend import AttentionGroup, GroupedMetadata
    from kvflow.attention.cache_engine import CacheEngine
    from kvflow.config import CacheConfig

    config = tiny_model_config(tie_word_embeddings=tied, attention_bias=True)
    model = tiny_model(config).to(torch.bfloat16)
    reference = tiny_model(config).to(torch.bfloat16)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    extra = pack_for_cpu(model)
    assert UnquantizedLinearMethod.is_packed(model.layers[0].self_attn.qkv_proj)
    assert extra == (config.vocab_size * config.hidden_size * 2 if tied else 0)
    # state_dict (weight counting, checkpoint saving) still sees every dense weight.
    packed_state = model.state_dict()
    assert set(packed_state) == set(state)
    for name, tensor in state.items():
        assert torch.equal(packed_state[name], tensor), name
    assert torch.equal(model.lm_head_weight, reference.lm_head_weight)

    n = 11
    logits = []
    for m in (model, reference):
        cache = CacheEngine(config.kv_cache_spec(), CacheConfig(block_size=4, num_blocks=4, dtype=torch.bfloat16), torch.device("cpu"))
        group = AttentionGroup.build(0, [n], [n], [[0, 1, 2]], 4, torch.device("cpu"))
        meta = GroupedMetadata(slot_mapping=torch.arange(n), groups=[group])
        with torch.inference_mode():
            hidden = m(torch.arange(n) % config.vocab_size, torch.arange(n), cache.kv_caches, meta)
            logits.append(m.compute_logits(hidden))
    assert logits[0].dtype == torch.float32
    # Same bf16 weights, different accumulation order: agree to bf16 precision.
    torch.testing.assert_close(logits[0], logits[1], atol=0.1, rtol=0.05)
    assert (logits[0].argmax(-1) == logits[1].argmax(-1)).float().mean() >= 0.9


@torch.inference_mode()
def test_float16_model_packs_what_this_cpu_can_and_runs():
    """``pack_for_cpu`` on a float16 model (``--dtype float16``) never raises: where the CPU
    cannot pack float16 the linears and the LM head stay dense; the logits equal the
    unpacked model's up to accumulation order either way."""
    from kvflow.config import CacheConfig
    from kvflow.attention.torch_backend import AttentionGroup, GroupedMetadata
    from kvflow.attention.cache_engine import CacheEngine

    config = tiny_model_config(tie_word_embeddings=True)
    model, reference = tiny_model(config).to(torch.float16), tiny_model(config).to(torch.float16)
    pack_for_cpu(model)
    packs = onednn_packs(torch.float16)
    assert UnquantizedLinearMethod.is_packed(model.layers[0].mlp.down_proj) == packs
    assert (model.lm_head.packed is not None) == packs
    n, logits = 7, []
    for m in (model, reference):
        cache = CacheEngine(config.kv_cache_spec(), CacheConfig(block_size=4, num_blocks=2, dtype=torch.float16), torch.device("cpu"))
        meta = GroupedMetadata(slot_mapping=torch.arange(n),
                                 groups=[AttentionGroup.build(0, [n], [n], [[0, 1]], 4, torch.device("cpu"))])
        logits.append(m.compute_logits(m(torch.arange(n), torch.arange(n), cache.kv_caches, meta)))
    torch.testing.assert_close(logits[0], logits[1], atol=1e-2, rtol=1e-2)


def test_float32_model_is_not_packed():
    model = tiny_model(tiny_model_config())
    assert pack_for_cpu(model) == 0
    assert not UnquantizedLinearMethod.is_packed(model.layers[0].mlp.down_proj) and model.lm_head.packed is None


def test_a_fused_tensor_of_the_wrong_row_count_is_a_value_error_naming_the_shape():
    """A fused Q/K/V or gate/up checkpoint tensor whose rows do not add up (Phi-3's fused
    qkv_proj on a cross-layer-attention layer that takes the query rows only, or a config
    that disagrees with the checkpoint) raised Tensor.split's RuntimeError, which names no
    weight, where every other shape mismatch is a ValueError the loader names the weight in."""
    from kvflow.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

    q_only = QKVParallelLinear(64, 16, 4, 2, bias=False, with_kv=False)
    with pytest.raises(ValueError, match=r"shape \(128, 64\), expected 64 rows"):
        q_only.weight_loader(q_only.weight, torch.randn(128, 64))
    q_only.weight_loader(q_only.weight, torch.randn(64, 64))  # the query rows alone load
    qkv = QKVParallelLinear(64, 16, 4, 2, bias=False)
    with pytest.raises(ValueError, match=r"shape \(96, 64\), expected 128 rows"):
        qkv.weight_loader(qkv.weight, torch.randn(96, 64))
    gate_up = MergedColumnParallelLinear(64, [96, 96], bias=False)
    with pytest.raises(ValueError, match=r"shape \(190, 64\), expected 192 rows"):
        gate_up.weight_loader(gate_up.weight, torch.randn(190, 64))
