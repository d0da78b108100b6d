"""The model forward against Hugging Face transformers on tiny random-weight models."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from conftest import prefill_logits, tiny_model, tiny_model_config
from kvflow.config import CacheConfig
from kvflow.model.llama import LlamaForCausalLM
from kvflow.attention.cache_engine import CacheEngine


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


def explicit_forward(model: LlamaForCausalLM, token_ids: list[int]) -> torch.Tensor:
    """The model written out without a KV cache: full causal attention per layer, with each
    cross-layer-attention group reading the K/V projected by its first layer."""
    cfg = model.config
    n, hd = len(token_ids), cfg.head_dim
    pos = torch.arange(n)
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2).float() / hd))
    freqs = torch.outer(pos.float(), inv_freq)
    cos, sin = torch.cat([freqs, freqs], -1).cos()[:, None], torch.cat([freqs, freqs], -1).sin()[:, None]

    def rope(x):
        return x * cos + torch.cat([-x[..., hd // 2 :], x[..., : hd // 2]], -1) * sin

    def rms(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)

    x = model.embed_tokens.weight[torch.tensor(token_ids)]
    q_size, kv_size = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    group_kv = None
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        h = rms(x, layer.input_layernorm.weight)
        proj = h @ attn.qkv_proj.weight.T + (attn.qkv_proj.bias if attn.qkv_proj.bias is not None else 0)
        q = rope(proj[:, :q_size].view(n, -1, hd))
        if i % cfg.cla_share_factor == 0:
            k = rope(proj[:, q_size : q_size + kv_size].view(n, -1, hd))
            v = proj[:, q_size + kv_size :].view(n, -1, hd)
            group_kv = (k, v)
        k, v = group_kv
        rep = cfg.num_attention_heads // cfg.num_key_value_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / hd**0.5
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        o = torch.einsum("hqk,khd->qhd", probs, v).reshape(n, q_size)
        x = x + o @ attn.o_proj.weight.T
        h = rms(x, layer.post_attention_layernorm.weight)
        gate, up = (h @ layer.mlp.gate_up_proj.weight.T).split(cfg.intermediate_size, -1)
        x = x + (torch.nn.functional.silu(gate) * up) @ layer.mlp.down_proj.weight.T
    return rms(x, model.norm.weight) @ model.lm_head_weight.T


@pytest.mark.parametrize("share", [1, 2, 3])
def test_cross_layer_kv_sharing_equals_explicit_computation(share):
    cfg = tiny_model_config(num_hidden_layers=4, cla_share_factor=share)
    model = tiny_model(cfg)
    assert sum(layer.self_attn.owns_kv for layer in model.layers) == cfg.num_kv_layers == -(-4 // share)
    ids = torch.randint(0, 128, (19,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.inference_mode():
        ref = explicit_forward(model, ids)
    for chunk in (1, 6, 64):
        torch.testing.assert_close(prefill_logits(model, ids, chunk), ref, atol=1e-4, rtol=1e-4)


def test_cross_layer_kv_sharing_divides_kv_memory():
    base = tiny_model_config(num_hidden_layers=6)
    for share in (2, 3):
        cfg = tiny_model_config(num_hidden_layers=6, cla_share_factor=share)
        assert cfg.kv_bytes_per_token(torch.float32) * share == base.kv_bytes_per_token(torch.float32)
        full = CacheEngine(base.kv_cache_spec(), CacheConfig(4, 10, torch.float32), torch.device("cpu"))
        shared = CacheEngine(cfg.kv_cache_spec(), CacheConfig(4, 10, torch.float32), torch.device("cpu"))
        assert len(shared.kv_caches) == 6 // share
        assert shared.num_bytes * share == full.num_bytes
    # The non-first layers of a group have no K/V projection weights.
    model = tiny_model(tiny_model_config(num_hidden_layers=4, cla_share_factor=2))
    q_size = model.config.num_attention_heads * model.config.head_dim
    assert model.layers[1].self_attn.qkv_proj.weight.shape[0] == q_size
    with pytest.raises(ValueError, match="unexpected"):
        model.load_weights([("model.layers.1.self_attn.k_proj.weight", torch.zeros(32, 64))])


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("method, bound", [("int8", 0.02), ("int4", 0.25), ("fp8", 0.1)])
def test_quantize_lm_head(tied, method, bound):
    """The head's logits stay within the scheme's error of the dense head; the embedding
    lookup is untouched; untied, state_dict still yields an lm_head (dequantized)."""
    model = tiny_model(tiny_model_config(tie_word_embeddings=tied, hidden_size=64))
    embed = model.embed_tokens.weight.detach().clone()
    dense = model.lm_head_weight.detach().clone()
    hidden = torch.randn(5, 64)
    want = hidden @ dense.T
    model.lm_head.quantize(method, group_size=32)
    assert model.lm_head.packed is not None
    got = model.compute_logits(hidden)
    err = (got - want).abs().max() / want.abs().max()
    assert 0 < err < bound, err
    assert torch.equal(model.embed_tokens.weight, embed)
    if not tied:
        assert "weight" not in model.lm_head._parameters
        sd = model.state_dict()
        assert torch.allclose(sd["lm_head.weight"], dense, atol=bound * dense.abs().max())


def test_quantize_lm_head_int4_group_falls_back_like_the_decoder():
    """A group size that does not divide hidden_size (128 for 64 here; 128 for SmolLM2's
    576) takes the largest halving that does, as the decoder linears do."""
    from kvflow.quantization.int4 import Int4LinearMethod

    model = tiny_model(tiny_model_config())
    model.lm_head.quantize("int4", group_size=128)
    head = model.lm_head.packed
    assert isinstance(head.quant_method, Int4LinearMethod) and head.group_size == 64


def test_quantize_lm_head_rejects_unknown_method():
    model = tiny_model(tiny_model_config())
    with pytest.raises(ValueError, match="LM head quantization"):
        model.lm_head.quantize("int2")


def _prefill_logits_with_cache(model, token_ids, cache_dtype, chunk=8, block_size=4):
    from kvflow.config import CacheConfig
    from kvflow.attention.torch_backend import AttentionGroup, GroupedMetadata
    from kvflow.attention.cache_engine import CacheEngine

    n = len(token_ids)
    num_blocks = -(-n // block_size)
    cache = CacheEngine(model.kv_cache_spec, CacheConfig(block_size, num_blocks, cache_dtype), torch.device("cpu"))
    table = list(range(num_blocks))
    logits = []
    with torch.inference_mode():
        for start in range(0, n, chunk):
            end = min(n, start + chunk)
            pos = torch.arange(start, end)
            group = AttentionGroup.build(0, [end - start], [end], [table[: -(-end // block_size)]], block_size,
                                         torch.device("cpu"))
            hidden = model(torch.tensor(token_ids[start:end]), pos, cache.kv_caches, GroupedMetadata(pos.clone(), [group]))
            logits.append(model.compute_logits(hidden))
    return torch.cat(logits)


def test_int8_kv_cache_stores_keys_minus_the_k_bias(monkeypatch):
    """With a large k_proj bias on the slowly rotating RoPE pairs (every key carries it, as in
    Qwen2), an int8 KV cache stays close to the float cache because keys are stored minus
    that bias (which attention does not see); without that, the bias sets each key's int8
    scale and the logits drift."""
    from kvflow.model.llama import LlamaAttention

    config = tiny_model_config(attention_bias=True)
    model = tiny_model(config)
    slow = model.rotary.slow_mask  # head_dim 16, theta 1e4, 512 positions: pairs 6 and 7
    assert slow.tolist() == [0.0] * 6 + [1.0] * 2 + [0.0] * 6 + [1.0] * 2
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in model.layers:
            attn = layer.self_attn
            big = 40.0 * torch.randn(attn.num_kv_heads, attn.head_dim, generator=g) * slow
            attn.qkv_proj.bias[attn.q_size : attn.q_size + attn.kv_size] += big.reshape(-1)
    ids = list(range(3, 43))
    want = _prefill_logits_with_cache(model, ids, torch.float32)
    err = float((_prefill_logits_with_cache(model, ids, torch.int8) - want).abs().max())
    monkeypatch.setattr(LlamaAttention, "_key_offset", lambda self, cache: None)
    err_without = float((_prefill_logits_with_cache(model, ids, torch.int8) - want).abs().max())
    assert err < 0.2 * err_without, (err, err_without)  # observed 0.16 vs 2.84


@pytest.mark.usefixtures("one_thread")
def test_dynamic_ntk_matches_transformers_at_the_scaled_context(tmp_path):
    """Dynamic NTK: kvflow fixes the base for factor x max_position_embeddings (as vLLM), the
    model's context in kvflow (64 here). transformers recomputes it for each sequence longer
    than 32: the two agree on a 64-token sequence, and differ on shorter ones."""
    from conftest import randomize_hf_model
    from kvflow.model.loader import load_model

    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-6,
        rope_scaling={"rope_type": "dynamic", "factor": 2.0},
    )
    hf = randomize_hf_model(transformers.LlamaForCausalLM(config))
    hf.save_pretrained(tmp_path)
    model, model_config = load_model(tmp_path, torch.float32, torch.device("cpu"))
    assert model_config.max_position_embeddings == 64
    ids = torch.randint(0, 128, (64,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.inference_mode():
        shorter = hf(torch.tensor([ids[:40]])).logits[0]  # first: transformers keeps a longer length's base
        full = hf(torch.tensor([ids])).logits[0]
    for chunk in (5, 64):
        torch.testing.assert_close(prefill_logits(model, ids, chunk), full, atol=1e-4, rtol=1e-4)
    assert (prefill_logits(model, ids[:40], 8) - shorter).abs().max() > 1e-2


@pytest.mark.parametrize("tied", [False, True])
def test_make_batch_invariant_keeps_the_model(tied):
    """make_batch_invariant swaps the dense linears and the LM head for InvariantLinear:
    logits agree with the original to float32 rounding, the k_proj bias (key offset) and
    the state_dict keys and values are kept, and a second call changes nothing."""
    from kvflow.layers.invariant_linear import InvariantLinearMethod, invariant_linear_available, make_batch_invariant

    if not invariant_linear_available():
        pytest.skip("the C++ kernel could not be built here")
    config = tiny_model_config(attention_bias=True, tie_word_embeddings=tied)
    model = tiny_model(config)
    tokens = [(11 * i + 3) % 128 for i in range(13)]
    before = prefill_logits(model, tokens, chunk=5)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    bias = model.layers[0].self_attn.qkv_proj.bias.clone()
    assert make_batch_invariant(model) == 2 * 4 + 1  # 4 linears per layer, and the head
    assert make_batch_invariant(model) == 0
    assert isinstance(model.layers[1].self_attn.o_proj.quant_method, InvariantLinearMethod)
    assert torch.equal(model.layers[0].self_attn.qkv_proj.bias, bias)
    torch.testing.assert_close(prefill_logits(model, tokens, chunk=5), before, atol=2e-5, rtol=1e-5)
    after = model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], state[k]) for k in state)


def _tiny_hf(cls, config_cls, path, seed=0, **fields):
    from conftest import randomize_hf_model

    base = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
                attn_implementation="eager")
    hf = randomize_hf_model(cls(config_cls(**{**base, **fields})), seed)
    hf.save_pretrained(path)
    return hf


SLIDING = {
    # every layer windowed (Mistral): blocks behind the window may be freed
    "mistral": (transformers.MistralForCausalLM, transformers.MistralConfig, {"sliding_window": 8}, [8, 8, 8]),
    # Qwen2's use_sliding_window from layer max_window_layers on: layer 0 keeps full attention
    "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config,
              {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}, [None, 8, 8]),
}


def _assert_prefill_matches_hf(model, hf, ids: list[int], chunks: tuple[int, ...]) -> None:
    """kvflow's prefill logits of ``ids`` at each chunk size equal transformers' (float32, 1e-4)."""
    with torch.inference_mode():
        want = hf(torch.tensor([ids])).logits[0]
    for chunk in chunks:
        torch.testing.assert_close(prefill_logits(model, ids, chunk), want, atol=1e-4, rtol=1e-4)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("arch", sorted(SLIDING))
def test_sliding_window_matches_transformers(arch, tmp_path):
    """Mistral / Qwen2 with an 8-token window over a 40-token prompt: logits through the paged
    path with chunked prefill, and 32 greedy tokens through the engine (mixed batch, prefix
    cache), as transformers (eager attention with its sliding-window mask)."""
    from conftest import engine_greedy_matches_hf
    from kvflow.model.loader import load_model

    cls, config_cls, fields, windows = SLIDING[arch]
    hf = _tiny_hf(cls, config_cls, tmp_path, **fields)
    model, config = load_model(tmp_path, torch.float32, torch.device("cpu"))
    assert config.sliding_windows == windows
    assert config.kv_free_window == (8 if all(windows) else None)
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    _assert_prefill_matches_hf(model, hf, ids, (1, 7, 64))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (21, 9, 30)]
    stats = engine_greedy_matches_hf(tmp_path, hf, prompts, prompts[0][:12] + [5, 6, 7, 8, 9, 10, 11])
    assert stats["min_margin"] > 1e-4


def test_window_at_least_the_context_never_acts(tmp_path):
    """A window as long as the engine's context reads as none (no mask, no block freeing)."""
    from kvflow.model.loader import load_model

    _tiny_hf(transformers.MistralForCausalLM, transformers.MistralConfig, tmp_path, sliding_window=64)
    _, config = load_model(tmp_path, torch.float32, torch.device("cpu"), max_model_len=64)
    assert config.sliding_windows == [None, None, None] and config.kv_free_window is None
    _, config = load_model(tmp_path, torch.float32, torch.device("cpu"), max_model_len=65)
    assert config.sliding_windows == [64, 64, 64] and config.kv_free_window == 64


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_window_frees_blocks_in_the_engine_with_exact_outputs(preemption_mode, tmp_path):
    """Mistral, window 8, blocks of 4, a 12-block pool: three requests of 40 + 32 tokens (18
    blocks each, more than the pool, without freeing) run to transformers' greedy tokens; each
    holds at most ``max_blocks_held`` = 7 blocks, blocks behind the window go back to the pool
    (``num_window_freed_blocks``), requests are preempted and resumed on the way, and at the
    end every block is free again."""
    from conftest import hf_greedy
    from kvflow.engine.arg_utils import EngineArgs
    from kvflow.engine.llm_engine import LLMEngine
    from kvflow.sampling_params import SamplingParams

    hf = _tiny_hf(transformers.MistralForCausalLM, transformers.MistralConfig, tmp_path, sliding_window=8)
    swap = {"preemption_mode": "swap", "swap_space_bytes": 1 << 20} if preemption_mode == "swap" else {}
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(tmp_path), dtype="float32", device="cpu", block_size=4, num_kv_blocks=12,
        max_num_batched_tokens=16, max_num_seqs=8, enable_prefix_caching=True, **swap))
    kv = engine.kv_cache_manager
    assert kv.sliding_window == 8 and kv.max_blocks_held(72, 16) == 7 and kv.num_blocks_for(72) == 18
    gen = torch.Generator().manual_seed(4)
    prompts = {f"r{i}": torch.randint(0, 128, (40,), generator=gen).tolist() for i in range(3)}
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    done, peak = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        peak = max([peak, *(kv.num_held_blocks(r) for r in engine.scheduler.running)])
    for rid, prompt in prompts.items():
        assert done[rid] == hf_greedy(hf, prompt, 32)[0], rid
    stats = engine.get_stats()
    assert 0 < peak <= 7 and stats["num_window_freed_blocks"] >= 3 * (18 - 7)
    assert stats["num_preemptions"] > 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"] == 11


@pytest.mark.usefixtures("one_thread")
def test_llama_attention_bias_includes_the_output_projection(tmp_path):
    """transformers' Llama with ``attention_bias=True`` has biases on Q/K/V and on o_proj;
    kvflow refused the folder ("unexpected weight ...o_proj.bias"). Logits with chunked
    prefill and greedy tokens through the engine match transformers."""
    from conftest import engine_greedy_matches_hf
    from kvflow.model.loader import load_model

    hf = _tiny_hf(transformers.LlamaForCausalLM, transformers.LlamaConfig, tmp_path, attention_bias=True)
    model, _ = load_model(tmp_path, torch.float32, torch.device("cpu"))
    assert model.layers[0].self_attn.o_proj.bias is not None
    ids = torch.randint(0, 128, (23,), generator=torch.Generator().manual_seed(1)).tolist()
    _assert_prefill_matches_hf(model, hf, ids, (1, 5, 64))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (21, 9)]
    engine_greedy_matches_hf(tmp_path, hf, prompts, prompts[0][:12] + [5, 6, 7])


def _llama_gguf_tensors(hf: transformers.LlamaForCausalLM) -> dict[str, np.ndarray]:
    """The HF state dict under llama.cpp's llama names, Q/K rows permuted as its converter does."""
    from model.test_resolve import _llama_permute

    layer = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    heads = {"attn_q": hf.config.num_attention_heads, "attn_k": hf.config.num_key_value_heads}
    out = {}
    for name, t in hf.state_dict().items():
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            value = t.numpy()
            if layer[module] in heads:
                value = _llama_permute(value, heads[layer[module]])
            out[f"blk.{i}.{layer[module]}.{kind}"] = value
        else:
            out[{"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}[name]] = t.numpy()
    return out


def _write_llama3_gguf(path, hf, rope_freqs: np.ndarray) -> None:
    """``hf`` as llama.cpp's converter writes a Llama 3.1+ checkpoint: its "llama3" RoPE
    scaling as the tensor ``rope_freqs.weight``, no ``rope.scaling.*`` keys."""
    from model.test_resolve import add_llama_hparams, write_gguf

    write_gguf(path, "llama", {**_llama_gguf_tensors(hf), "rope_freqs.weight": rope_freqs},
               lambda w: add_llama_hparams(w, hf.config))


LLAMA3_ROPE = {
    # Llama 3.2's parameters (Meta's): read back as the same "llama3" scaling
    "llama-3.2": ({"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}, "llama3"),
    # any other divisors: kept as stored (a LongRoPE schedule of equal factors)
    "other": ({"factor": 4.0, "low_freq_factor": 2.0, "high_freq_factor": 16.0,
               "original_max_position_embeddings": 256}, "longrope"),
}


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("case", sorted(LLAMA3_ROPE))
def test_llama3_gguf_rope_freqs_matches_transformers(case, tmp_path):
    """A Llama 3.1+ GGUF (its RoPE scaling only in ``rope_freqs.weight``, as llama.cpp's
    converter writes it) loads with that scaling: its logits equal transformers' on the
    original checkpoint (float32), and differ from the unscaled RoPE's."""
    from kvflow.layers.rotary import _default_inv_freq
    from kvflow.model import resolve
    from kvflow.model.llama import llama3_rope_freqs
    from kvflow.model.loader import load_model

    params, rope_type = LLAMA3_ROPE[case]
    hf = _tiny_hf(transformers.LlamaForCausalLM, transformers.LlamaConfig, tmp_path / "hf", seed=5, vocab_size=261,
                  num_hidden_layers=2, max_position_embeddings=32768, rms_norm_eps=1e-6,
                  rope_scaling={"rope_type": "llama3", "rope_theta": 10000.0, **params})
    rope_freqs = llama3_rope_freqs(_default_inv_freq(16, 10000.0), **params).numpy()
    assert rope_freqs[0] == 1.0 and rope_freqs[-1] == params["factor"]
    _write_llama3_gguf(tmp_path / "tiny-llama3.gguf", hf, rope_freqs)
    out = resolve.resolve_model(str(tmp_path / "tiny-llama3.gguf"), cache_dir=tmp_path / "cache")
    rope = resolve.load_config(out).rope_parameters
    assert rope["rope_type"] == rope_type
    if rope_type == "llama3":
        assert rope == {"rope_type": "llama3", "rope_theta": 10000.0, **params}
    model, _ = load_model(out, torch.float32, torch.device("cpu"))
    ids = torch.randint(0, 261, (96,), generator=torch.Generator().manual_seed(4)).tolist()
    _assert_prefill_matches_hf(model, hf, ids, (7, 96))
    unscaled = _tiny_hf(transformers.LlamaForCausalLM, transformers.LlamaConfig, tmp_path / "unscaled", seed=5,
                        vocab_size=261, num_hidden_layers=2, max_position_embeddings=32768, rms_norm_eps=1e-6,
                        rope_theta=10000.0)
    with torch.inference_mode():
        assert (prefill_logits(model, ids, 96) - unscaled(torch.tensor([ids])).logits[0]).abs().max() > 1e-2


def test_llama_gguf_rope_freqs_of_the_wrong_length_is_refused(tmp_path):
    from kvflow.model import resolve

    hf = _tiny_hf(transformers.LlamaForCausalLM, transformers.LlamaConfig, tmp_path / "hf", vocab_size=261,
                  num_hidden_layers=1)
    _write_llama3_gguf(tmp_path / "bad.gguf", hf, np.ones(5, np.float32))
    with pytest.raises(ValueError, match=r"bad.gguf: rope_freqs.weight must hold 8 finite positive numbers"):
        resolve.resolve_model(str(tmp_path / "bad.gguf"), cache_dir=tmp_path / "cache")
