"""The mixture-of-experts layer: routing against transformers' routers, the expert
implementations against a per-token reference, weight loading, tensor-parallel shards and
quantized experts."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock, MixtralTopKRouter
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock, Qwen3MoeTopKRouter

from kvflow.distributed.parallel_state import TensorParallel
from kvflow.layers.moe import EXPERT_IMPLS, FusedMoE, SparseMoeBlock, map_expert_weight, select_experts
from kvflow.quantization.registry import get_quantization_config

E, K, H, I = 8, 2, 64, 32  # experts, top-k, hidden, moe intermediate


def _qwen3_config(**overrides) -> transformers.Qwen3MoeConfig:
    fields = dict(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K, norm_topk_prob=True)
    return transformers.Qwen3MoeConfig(**{**fields, **overrides})


def _random(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return module.eval()


def _per_expert(w13: torch.Tensor, w2: torch.Tensor) -> dict[int, dict[str, torch.Tensor]]:
    """Stacked [E, 2I, H] / [E, H, I] -> per-expert gate / up / down tensors (checkpoint layout)."""
    inter = w2.shape[2]
    return {e: {"w1": w13[e, :inter], "w3": w13[e, inter:], "w2": w2[e]} for e in range(w13.shape[0])}


def _load(layer: FusedMoE, w13: torch.Tensor, w2: torch.Tensor) -> FusedMoE:
    for e, parts in _per_expert(w13, w2).items():
        for part, tensor in parts.items():
            param = layer.w2_weight if part == "w2" else layer.w13_weight
            layer.weight_loader(param, tensor, (e, part))
    return layer


def _per_token_reference(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """The MoE sum written out token by token (float64)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            h = w13[e].double() @ x[t].double()
            out[t] += topk_weights[t, j].double() * (w2[e].double() @ (torch.nn.functional.silu(h[:inter]) * h[inter:]))
    return out


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_select_experts_matches_qwen3_moe_router(norm_topk_prob):
    router = _random(Qwen3MoeTopKRouter(_qwen3_config(norm_topk_prob=norm_topk_prob)))
    x = torch.randn(37, H, generator=torch.Generator().manual_seed(1))
    logits, ref_weights, ref_ids = router(x)
    weights, ids = select_experts(x @ router.weight.T, K, renormalize=norm_topk_prob)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, atol=1e-7, rtol=0)
    assert torch.allclose(weights.sum(-1), torch.ones(37)) == norm_topk_prob


def test_select_experts_matches_mixtral_router_and_is_a_softmax_over_the_top_k_logits():
    cfg = transformers.MixtralConfig(hidden_size=H, num_local_experts=E, num_experts_per_tok=K)
    router = _random(MixtralTopKRouter(cfg))
    x = torch.randn(37, H, generator=torch.Generator().manual_seed(2))
    logits, ref_weights, ref_ids = router(x)
    weights, ids = select_experts(logits, K, renormalize=True)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, atol=1e-7, rtol=0)
    # Mixtral paper, eq. 2: softmax over the top-k logits.
    torch.testing.assert_close(weights, torch.softmax(logits.gather(1, ids), -1), atol=1e-6, rtol=0)


@pytest.mark.parametrize("impl", list(EXPERT_IMPLS))
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_expert_implementations_equal_the_per_token_sum(impl, tokens):
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, H, generator=g)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) * 0.2, torch.randn(E, I, H, generator=g).transpose(1, 2) * 0.2
    weights, ids = select_experts(torch.randn(tokens, E, generator=g), K, renormalize=False)
    got = EXPERT_IMPLS[impl](x, w13, w2.contiguous(), weights, ids)
    assert got.dtype == torch.float32 and got.shape == (tokens, H)
    torch.testing.assert_close(got.double(), _per_token_reference(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


def test_experts_without_tokens_are_skipped_and_bfloat16_accumulates_in_float32():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, H, generator=g).bfloat16()
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.2).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) * 0.2).bfloat16()
    ids = torch.tensor([[3, 5]] * 5)  # experts 0-2, 4, 6, 7 get no tokens
    weights = torch.full((5, 2), 0.5)
    ref = _per_token_reference(x.float(), w13.float(), w2.float(), weights, ids)
    for impl in EXPERT_IMPLS:
        got = EXPERT_IMPLS[impl](x, w13, w2, weights, ids)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), ref, atol=0.05, rtol=0.02)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_fused_moe_block_matches_transformers_block(kind):
    if kind == "qwen3_moe":
        ref = _random(Qwen3MoeSparseMoeBlock(_qwen3_config(norm_topk_prob=False)))
        renormalize = False
    else:
        ref = _random(MixtralSparseMoeBlock(transformers.MixtralConfig(
            hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K)))
        renormalize = True
    ours = SparseMoeBlock(H, E, K, I, renormalize, prefix="mlp")
    ours.gate.weight.data.copy_(ref.gate.weight)
    _load(ours.experts, ref.experts.gate_up_proj.data, ref.experts.down_proj.data)
    x = torch.randn(2, 9, H, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        torch.testing.assert_close(ours(x.view(-1, H)), ref(x).view(-1, H), atol=1e-5, rtol=1e-5)


def test_shared_expert_matches_qwen2_moe_block():
    cfg = transformers.Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=I, shared_expert_intermediate_size=48,
                                      num_experts=E, num_experts_per_tok=K, norm_topk_prob=False)
    ref = _random(Qwen2MoeSparseMoeBlock(cfg))
    ours = SparseMoeBlock(H, E, K, I, False, shared_expert_intermediate_size=48, prefix="mlp")
    ours.gate.weight.data.copy_(ref.gate.weight)
    _load(ours.experts, ref.experts.gate_up_proj.data, ref.experts.down_proj.data)
    se = ref.shared_expert
    ours.shared_expert.gate_up_proj.weight_loader(ours.shared_expert.gate_up_proj.weight, se.gate_proj.weight, 0)
    ours.shared_expert.gate_up_proj.weight_loader(ours.shared_expert.gate_up_proj.weight, se.up_proj.weight, 1)
    ours.shared_expert.down_proj.weight.data.copy_(se.down_proj.weight)
    ours.shared_expert_gate.weight.data.copy_(ref.shared_expert_gate.weight)
    x = torch.randn(1, 11, H, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        torch.testing.assert_close(ours(x.view(-1, H)), ref(x).view(-1, H), atol=1e-5, rtol=1e-5)


def test_weight_loader_takes_per_expert_and_stacked_tensors_and_checks_shapes():
    g = torch.Generator().manual_seed(5)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    a = _load(FusedMoE(E, K, H, I, True), w13, w2)
    b = FusedMoE(E, K, H, I, True)
    b.weight_loader(b.w13_weight, w13, None)  # the transformers-5 layout: all experts stacked
    b.weight_loader(b.w2_weight, w2, None)
    assert torch.equal(a.w13_weight, w13) and torch.equal(a.w2_weight, w2)
    assert torch.equal(b.w13_weight, w13) and torch.equal(b.w2_weight, w2)
    with pytest.raises(ValueError, match="shape"):
        a.weight_loader(a.w13_weight, torch.zeros(I + 1, H), (0, "w1"))
    with pytest.raises(ValueError, match="shape"):
        a.weight_loader(a.w2_weight, torch.zeros(I, H), (0, "w2"))
    with pytest.raises(ValueError, match="stacked"):
        a.weight_loader(a.w13_weight, torch.zeros(E - 1, 2 * I, H), None)
    assert a.param_shard_ids["w13_weight"][:2] == ((0, "w1"), (0, "w3"))
    assert a.param_shard_ids["w2_weight"][-1] == (E - 1, "w2")


def test_map_expert_weight_names():
    qwen = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    assert map_expert_weight("layers.3.mlp.experts.12.up_proj.weight", qwen) == (
        "layers.3.mlp.experts.w13_weight", (12, "w3"))
    assert map_expert_weight("layers.3.mlp.experts.0.down_proj.weight", qwen) == (
        "layers.3.mlp.experts.w2_weight", (0, "w2"))
    assert map_expert_weight("layers.0.mlp.experts.gate_up_proj", qwen) == ("layers.0.mlp.experts.w13_weight", None)
    assert map_expert_weight("layers.0.mlp.gate_proj.weight", qwen) is None  # a dense layer's MLP
    assert map_expert_weight("layers.0.mlp.shared_expert.gate_proj.weight", qwen) is None
    mixtral = {"w1": "w1", "w3": "w3", "w2": "w2"}
    assert map_expert_weight("layers.1.block_sparse_moe.experts.7.w2.weight", mixtral) == (
        "layers.1.block_sparse_moe.experts.w2_weight", (7, "w2"))


class _NoReduceTP(TensorParallel):
    """A rank's place whose all-reduce is the identity: each rank's partial sum stays visible."""

    def all_reduce(self, x):
        return x


@pytest.mark.parametrize("shared", [0, 48])
def test_tensor_parallel_shards_sum_to_the_unsharded_output(shared):
    """Every rank holds all experts' slices of the intermediate dim; the partial outputs of
    the two ranks' shards (loaded from the same full tensors) sum to the unsharded output."""
    g = torch.Generator().manual_seed(6)
    full_tensors = {"gate": torch.randn(E, H, generator=g) * 0.3, "w13": torch.randn(E, 2 * I, H, generator=g) * 0.3,
                    "w2": torch.randn(E, H, I, generator=g) * 0.3, "sgate": torch.randn(1, H, generator=g),
                    "s_gate": torch.randn(48, H, generator=g) * 0.3, "s_up": torch.randn(48, H, generator=g) * 0.3,
                    "s_down": torch.randn(H, 48, generator=g) * 0.3}

    def build(tp):
        block = SparseMoeBlock(H, E, K, I, True, shared_expert_intermediate_size=shared, prefix="mlp", tp=tp)
        block.gate.weight_loader(block.gate.weight, full_tensors["gate"])
        _load(block.experts, full_tensors["w13"], full_tensors["w2"])
        if shared:
            se = block.shared_expert
            se.gate_up_proj.weight_loader(se.gate_up_proj.weight, full_tensors["s_gate"], 0)
            se.gate_up_proj.weight_loader(se.gate_up_proj.weight, full_tensors["s_up"], 1)
            se.down_proj.weight_loader(se.down_proj.weight, full_tensors["s_down"])
            block.shared_expert_gate.weight_loader(block.shared_expert_gate.weight, full_tensors["sgate"])
        return block

    full = build(None)
    ranks = [build(_NoReduceTP(rank, 2)) for rank in (0, 1)]
    assert ranks[1].experts.w13_weight.shape == (E, I, H) and ranks[1].experts.intermediate_range == (I // 2, I)
    x = torch.randn(13, H, generator=g)
    with torch.inference_mode():
        want = full(x)
        parts = [r(x) for r in ranks]
    assert (parts[0] - want).abs().max() > 1e-2  # each rank alone is a partial sum
    torch.testing.assert_close(parts[0] + parts[1], want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        FusedMoE(E, K, H, 30, True, tp=_NoReduceTP(0, 4))


# Quantized experts: relative error of the MoE output to the float experts, per scheme
# (observed int8 ~0.006, int4 ~0.1, fp8 ~0.04 on these random weights), and the stored dtype.
QUANT_BOUNDS = {"int8": (0.02, torch.int8), "int4": (0.25, torch.uint8), "fp8": (0.1, torch.float8_e4m3fn)}


def _float_and_quantized(method: str):
    """The same random experts as a float layer and as a ``method``-quantized one."""
    g = torch.Generator().manual_seed(7)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) * 0.2, torch.randn(E, H, I, generator=g) * 0.2
    dense = _load(FusedMoE(E, K, H, I, True), w13, w2)
    quant = _load(FusedMoE(E, K, H, I, True, get_quantization_config(method, 32), prefix="l.experts"), w13, w2)
    quant.quant_method.process_weights_after_loading(quant)
    return dense, quant, g


@pytest.mark.parametrize("method", list(QUANT_BOUNDS))
@pytest.mark.parametrize("tokens", [1, 20])
def test_quantized_experts_stay_within_the_scheme_error(method, tokens):
    bound, storage = QUANT_BOUNDS[method]
    dense, quant, g = _float_and_quantized(method)
    assert "w13_weight" not in quant._parameters  # the float weights are gone
    if method == "int4":
        assert quant.w13_qweight.dtype == storage and quant.w13_qweight.shape == (E, 2 * I, H // 2)
    else:
        assert quant.w13_weight.dtype == storage and quant.w13_scale.shape == (E, 2 * I)
    x = torch.randn(tokens, H, generator=g)
    logits = torch.randn(tokens, E, generator=g)
    with torch.inference_mode():
        want = dense(x, logits)
        got = quant(x, logits)
    err = float((got - want).abs().max() / want.abs().max())
    assert 0 < err < bound, err
    # The dequantized stacked weights are within a scheme step of the float ones.
    w13, w2 = quant.dense_weights()
    assert w13.shape == dense.w13_weight.shape and w2.shape == dense.w2_weight.shape
    assert float((w13 - dense.w13_weight).abs().max()) < bound * float(dense.w13_weight.abs().max())


@pytest.mark.parametrize("method", list(QUANT_BOUNDS))
def test_quantized_experts_reload_from_a_state_dict_and_keep_their_dtype(method):
    """A saved quantized layer (``kvflow quantize``) reloads into the serialized method's
    buffers with identical outputs; ``Module.to(dtype)`` keeps the quantized storage."""
    _, quant, g = _float_and_quantized(method)
    saved = quant.to(torch.bfloat16).state_dict()
    assert all(t.dtype in (torch.int8, torch.uint8, torch.float8_e4m3fn, torch.float32) for t in saved.values())
    reloaded = FusedMoE(E, K, H, I, True, get_quantization_config(method, 32, serialized=True), prefix="l.experts")
    assert set(reloaded.state_dict()) == set(saved)
    reloaded.load_state_dict(saved)
    reloaded.quant_method.process_weights_after_loading(reloaded)
    x, logits = torch.randn(6, H, generator=g), torch.randn(6, E, generator=g)
    with torch.inference_mode():
        assert torch.equal(reloaded(x.bfloat16(), logits), quant(x.bfloat16(), logits))


def _gguf_experts(w13: torch.Tensor, w2: torch.Tensor, tp=None) -> FusedMoE:
    """A GGUF-method layer loaded with each expert's gate / up as Q8_0 and down as Q4_0 blocks."""
    import gguf
    import numpy as np

    from kvflow.layers.gguf_kernels import GGUFWeight
    from kvflow.quantization.gguf import GGUFConfig

    def stored(t: torch.Tensor, qtype) -> GGUFWeight:
        raw = np.ascontiguousarray(gguf.quants.quantize(t.numpy(), qtype))
        return GGUFWeight(torch.from_numpy(raw), qtype, t.shape[0], t.shape[1])

    qt = gguf.GGMLQuantizationType
    layer = FusedMoE(w13.shape[0], K, H, w2.shape[2], True, GGUFConfig(), prefix="l.experts", tp=tp)
    for e, parts in _per_expert(w13, w2).items():
        for part, tensor in parts.items():
            param = layer.w2_weight if part == "w2" else layer.w13_weight
            layer.weight_loader(param, stored(tensor, qt.Q4_0 if part == "w2" else qt.Q8_0), (e, part))
    layer.quant_method.process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("tokens", [1, 20])
def test_gguf_experts_compute_their_stored_blocks(tokens):
    """Experts kept as a GGUF file's blocks (``GGUFMoEMethod``) give the float layer's output
    over their dequantized weights, within the int8 activation rounding; two tensor-parallel
    ranks (down split along K in whole blocks) sum to the whole layer; a split that cuts a
    block is refused naming the sizes."""
    g = torch.Generator().manual_seed(8)
    inter = 64
    w13, w2 = torch.randn(E, 2 * inter, H, generator=g) * 0.2, torch.randn(E, H, inter, generator=g) * 0.2
    layer = _gguf_experts(w13, w2)
    dq13, dq2 = layer.dense_weights()
    assert dq13.shape == w13.shape and dq2.shape == w2.shape and layer.w13_weight.numel() == 0
    assert (dq13 - w13).abs().max() < 0.02 and (dq2 - w2).abs().max() < 0.1  # (Q8_0 / Q4_0 rounding)
    dense = _load(FusedMoE(E, K, H, inter, True), dq13, dq2)
    x, logits = torch.randn(tokens, H, generator=g), torch.randn(tokens, E, generator=g)
    with torch.inference_mode():
        want, got = dense(x, logits), layer(x, logits)
        parts = [_gguf_experts(w13, w2, _NoReduceTP(rank, 2))(x, logits) for rank in (0, 1)]
    assert float((got - want).norm() / want.norm()) < 0.02
    torch.testing.assert_close(parts[0] + parts[1], got, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="16"):  # I = 32 over 2 ranks: 16 columns of a 32-column block
        _gguf_experts(w13[:, :64], w2[:, :, :32], _NoReduceTP(1, 2))


@pytest.mark.parametrize("method, match", [("int4-awq", "int4-awq")])
def test_schemes_without_expert_support_refuse_by_name(method, match):
    with pytest.raises(ValueError, match=match):
        FusedMoE(E, K, H, I, True, get_quantization_config(method, 32), prefix="layers.0.mlp.experts")


def test_top_k_outside_the_experts_is_refused():
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        FusedMoE(E, E + 1, H, I, True)


def test_default_implementation_gathers_small_decode_batches_and_groups_the_rest():
    """The measured choice (kvflow.layers.moe.EXPERT_IMPLS): gather + bmm while the gathered
    experts fit GATHER_MAX_BYTES, the grouped GEMM beyond."""
    from kvflow.layers.moe import GATHER_MAX_BYTES, default_expert_impl

    w13, w2 = torch.empty(64, 512, 512), torch.empty(64, 512, 256)  # 1.5 MiB per expert in float32
    per_expert = (512 * 512 + 512 * 256) * 4
    x = torch.empty(1, 512)
    fits = GATHER_MAX_BYTES // per_expert
    assert default_expert_impl(x, w13, w2, torch.zeros(1, fits, dtype=torch.long)) == "gather_bmm"
    assert default_expert_impl(x, w13, w2, torch.zeros(1, fits + 1, dtype=torch.long)) == "grouped_mm"
    assert default_expert_impl(x, w13.bfloat16(), w2.bfloat16(), torch.zeros(1, fits + 1, dtype=torch.long)) == "gather_bmm"


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_qwen2_moe_shared_expert_gate_stays_float_and_its_checkpoint_reloads(method, tmp_path):
    """Quantizing in place (``quantize_model``, what ``kvflow quantize`` does) left the
    Qwen2-MoE ``shared_expert_gate`` float as loading with ``quantization=`` does: it
    quantized it, so the saved checkpoint held ``shared_expert_gate.scale`` and reloading it
    failed ("quantized checkpoint does not match the model")."""
    import transformers

    from conftest import prefill_logits
    from kvflow.model.loader import load_model, quantize_model
    from kvflow.quantization.checkpoint import save_quantized

    config = transformers.Qwen2MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=128)
    torch.manual_seed(0)
    transformers.Qwen2MoeForCausalLM(config).save_pretrained(tmp_path / "float")
    cpu = torch.device("cpu")
    at_load, _ = load_model(tmp_path / "float", torch.float32, cpu, quantization=method)
    in_place, _ = load_model(tmp_path / "float", torch.float32, cpu)
    quantize_model(in_place, method)
    assert in_place.state_dict().keys() == at_load.state_dict().keys()
    save_quantized(in_place, tmp_path / "float", tmp_path / "quantized", method, 32)
    reloaded, _ = load_model(tmp_path / "quantized", torch.float32, cpu)
    prompt = list(range(3, 20))
    torch.testing.assert_close(prefill_logits(reloaded, prompt, 5), prefill_logits(in_place, prompt, 5), rtol=0, atol=0)
