"""The fused decode step (kvflow.layers.fused_decode) against the PyTorch path.

A tiny random-weight Llama is quantized to GGUF block formats with the ``gguf`` package (mixed
types per linear, as Q4_K_M files mix them) and runs prefill + several decode steps over a
multi-block paged cache on the CPU attention backend, once with the fused C++ decoder and
once with the PyTorch path (the reference); both quantize the same activations to int8, so
they agree to float32 rounding (a flipped int8 rounding at most: the tolerance below). The
same tiny Llama with dense bfloat16 weights prepacked for oneDNN takes the fused step too
(the same oneDNN call per linear as the PyTorch path).
"""

from __future__ import annotations

import types

import gguf
import numpy as np
import pytest
import torch

from kvflow import ops
from kvflow.attention.backend import BatchLayout
from kvflow.attention.cpu_backend import CpuAttentionBackend, CpuQuantizedAttentionBackend
from kvflow.config import CacheConfig
from kvflow.layers import fused_decode
from kvflow.layers.gguf_kernels import GGUFWeight
from kvflow.layers.linear import onednn_packs
from kvflow.model.llama import LlamaForCausalLM
from kvflow.model.loader import process_weights_after_loading
from kvflow.quantization.gguf import GGUFConfig
from kvflow.attention.cache_engine import CacheEngine
from tests.conftest import requires_smollm2, tiny_model_config

QT = gguf.GGMLQuantizationType

needs_kernel = pytest.mark.skipif(ops.FUSED_DECODE.disabled() or ops.GGUF_MATMUL.disabled(),
                                  reason="the C++ kernels are switched off (the PyTorch path is what runs)")


def _gguf(values: torch.Tensor, qtype, seed: int = 0) -> GGUFWeight:
    """``values`` [n, k] quantized by the gguf package; for the K-quants, which it cannot
    quantize, valid random blocks with scales that give weights of about ``values``' size."""
    n, k = values.shape
    if qtype not in (QT.Q4_K, QT.Q6_K):
        raw = gguf.quants.quantize(values.numpy(), qtype)
        return GGUFWeight(torch.from_numpy(np.ascontiguousarray(raw)), qtype, n, k)
    rng = np.random.default_rng(seed)
    size, bpb = gguf.GGML_QUANT_SIZES[qtype]
    nb = n * k // size
    b = rng.integers(0, 256, (nb, bpb), dtype=np.uint8)
    amax = float(values.abs().max())

    def set_f16(offset: int, value: float) -> None:
        b[:, offset:offset + 2] = rng.uniform(0.5 * value, value, nb).astype(np.float16).view(np.uint8).reshape(nb, 2)

    if qtype == QT.Q4_K:  # w = d sc q - dmin mn: sc, mn < 64, q < 16
        set_f16(0, amax / 63 / 15)
        set_f16(2, amax / 63 / 15 / 2)
    else:  # Q6_K: w = d sc (q - 32), int8 sc
        set_f16(208, amax / 128 / 32)
    return GGUFWeight(torch.from_numpy(b.reshape(n, -1)), qtype, n, k)


def gguf_tiny_model(seed: int = 0, attention_bias: bool = False, dtype: torch.dtype = torch.float32,
                    **overrides) -> LlamaForCausalLM:
    """A 2-layer GQA Llama (hidden 256, 4 query / 2 KV heads of 64) whose decoder linears are
    GGUF blocks of several types (K-quants need 256-element rows); with ``attention_bias`` a
    Qwen2 (Q/K/V biases; a Llama's ``attention_bias`` biases ``o_proj`` too, as transformers')."""
    if attention_bias:
        overrides.setdefault("model_type", "qwen2")
    config = tiny_model_config(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=64, attention_bias=attention_bias, **overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config, quant_config=GGUFConfig())
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    with torch.no_grad():
        for p in model.parameters():
            if p.numel():
                p.normal_(0.0, 0.2)
        for norm in [model.norm] + [n for layer in model.layers
                                    for n in (layer.input_layernorm, layer.post_attention_layernorm)]:
            norm.weight.copy_(1.0 + 0.1 * torch.randn_like(norm.weight))

        def w(n, k):
            return torch.randn(n, k) * k**-0.5

        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for sid, n, qt in (("q", 4 * d, QT.Q4_K), ("k", 2 * d, QT.Q4_K), ("v", 2 * d, QT.Q6_K)):
                attn.qkv_proj.weight_loader(attn.qkv_proj.weight, _gguf(w(n, h), qt), sid)
                if attention_bias:
                    attn.qkv_proj.weight_loader(attn.qkv_proj.bias, 0.5 * torch.randn(n), sid)
            attn.o_proj.weight_loader(attn.o_proj.weight, _gguf(w(h, 4 * d), QT.Q8_0))
            mlp.gate_up_proj.weight_loader(mlp.gate_up_proj.weight, _gguf(w(i, h), QT.Q4_0), 0)
            mlp.gate_up_proj.weight_loader(mlp.gate_up_proj.weight, _gguf(w(i, h), QT.Q5_1), 1)
            mlp.down_proj.weight_loader(mlp.down_proj.weight, _gguf(w(h, i), QT.Q4_1), None)
    process_weights_after_loading(model)
    return model.to(dtype).eval()


def _decode_run(model, prompts: list[list[int]], steps: int, fused: bool, block_size: int = 4,
                kv_dtype: torch.dtype | None = None):
    """Prefill ``prompts`` (one step), then ``steps`` decode steps of all of them (fixed next
    tokens). Returns the hidden states of each decode step [R, hidden] and the final caches.
    ``kv_dtype``: an int8 / fp8 cache (the quantized attention backend) instead of one of the
    model dtype."""
    new = [[[(7 * step + 11 * r) % model.config.vocab_size] for r in range(len(prompts))] for step in range(steps)]
    return _run_steps(model, prompts, new, fused, block_size, kv_dtype)


def _run_steps(model, prompts: list[list[int]], steps: list[list[list[int]]], fused: bool, block_size: int = 4,
               kv_dtype: torch.dtype | None = None, prompt_lens: list[list[int]] | None = None):
    """Prefill ``prompts`` (one step of prompt tokens: the PyTorch path), then one step per
    entry of ``steps``: ``steps[s][r]`` are request r's new tokens in step s (one: a decode;
    several: a verification of drafts; none: not scheduled), the first ``prompt_lens[s][r]``
    of them prompt tokens (default none: all generated). Requests of one token are laid out
    first (the decode group), then the others (one group), as the model runner does. Returns
    each step's hidden states [tokens, hidden] in request order (float32) and the final caches."""
    if not fused:
        model.__dict__["fused_decode"] = None
    else:
        model.__dict__.pop("fused_decode", None)
    backend = CpuAttentionBackend() if kv_dtype is None else CpuQuantizedAttentionBackend()
    dtype = model.norm.weight.dtype if kv_dtype is None else kv_dtype
    max_len = max(len(p) + sum(len(s[r]) for s in steps) for r, p in enumerate(prompts))
    per_req = -(-max_len // block_size)
    num_blocks = per_req * len(prompts) + 2
    cache = CacheEngine(model.kv_cache_spec, CacheConfig(block_size, num_blocks, dtype), torch.device("cpu"))
    # Scrambled block tables: request r's logical block j -> a block far from j.
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(3)).tolist()
    tables = [order[r * per_req:(r + 1) * per_req] for r in range(len(prompts))]

    def run(new: list[list[int]], decode_group: bool, prompt: list[int] | None):
        reqs = [r for r in range(len(new)) if new[r]]
        if decode_group:
            reqs = [r for r in reqs if len(new[r]) == 1] + [r for r in reqs if len(new[r]) > 1]
        group_sizes = [n for n in ([sum(len(new[r]) == 1 for r in reqs), sum(len(new[r]) > 1 for r in reqs)]
                                   if decode_group else [len(reqs)]) if n]
        q_lens = [len(new[r]) for r in reqs]
        ctx = [lens[r] + len(new[r]) for r in reqs]
        flat = [t for r in reqs for t in new[r]]
        pos = [lens[r] + j for r in reqs for j in range(len(new[r]))]
        slot = [tables[r][(lens[r] + j) // block_size] * block_size + (lens[r] + j) % block_size
                for r in reqs for j in range(len(new[r]))]
        layout = BatchLayout(torch.tensor(slot), q_lens, ctx, [tables[r][: -(-c // block_size)] for r, c in zip(reqs, ctx)],
                             group_sizes, block_size, torch.device("cpu"),
                             prompt_lens=None if prompt is None else [prompt[r] for r in reqs])  # (None: all prompt)
        hidden = model(torch.tensor(flat), torch.tensor(pos), cache.kv_caches, backend.build_metadata(layout)).float()
        rows, at = {}, 0
        for r, n in zip(reqs, q_lens):
            rows[r], at = hidden[at : at + n], at + n
        for r in reqs:
            lens[r] += len(new[r])
        return torch.cat([rows[r] for r in range(len(new)) if new[r]])

    lens = [0] * len(prompts)
    with torch.inference_mode():
        run(prompts, decode_group=False, prompt=None)
        hidden_states = [run(new, decode_group=True, prompt=[0] * len(new) if prompt_lens is None else prompt_lens[s])
                         for s, new in enumerate(steps)]
    return hidden_states, cache.kv_caches


PROMPTS = [[1, 5, 9, 2, 7], [3, 3, 8, 1, 4, 4, 6, 2, 9, 10, 11], [12]]


@needs_kernel
@pytest.mark.parametrize("attention_bias", [False, True], ids=["llama", "qwen2-bias"])
def test_fused_decode_steps_match_the_pytorch_path(attention_bias: bool) -> None:
    model = gguf_tiny_model(attention_bias=attention_bias)
    ref, ref_caches = _decode_run(model, PROMPTS, steps=6, fused=False)
    out, caches = _decode_run(model, PROMPTS, steps=6, fused=True)
    assert isinstance(model.__dict__["fused_decode"], fused_decode.FusedDecodeStep)  # it ran
    for step, (a, b) in enumerate(zip(out, ref)):
        # Both paths quantize the same activations to int8; float32 sums in another order
        # may flip one int8 rounding (a step of amax / 127): a small fraction of the scale.
        err = (a - b).abs().max().item()
        assert err <= 2e-3 * b.abs().max().item(), f"step {step}: max |fused - reference| = {err}"
    for (k, v), (rk, rv) in zip(caches, ref_caches):  # the K/V written to the cache (rotated keys)
        assert (k - rk).abs().max() <= 2e-3 * rk.abs().max() and (v - rv).abs().max() <= 2e-3 * rv.abs().max()


@needs_kernel
@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("attention_bias", [False, True], ids=["llama", "qwen2-bias"])
def test_fused_decode_over_a_quantized_cache_matches_the_pytorch_path(kv_dtype, attention_bias: bool,
                                                                     monkeypatch) -> None:
    """An int8 / fp8 KV cache: the fused step quantizes the new K/V (the key offset of a k_proj
    bias subtracted first) and attends as the quantized backend does; its hidden states and
    stored codes follow the PyTorch path's (the same codes, but where float32 sums in another
    order moved a value across a rounding edge: one code step of that token's scale)."""
    model = gguf_tiny_model(attention_bias=attention_bias)
    ref, ref_caches = _decode_run(model, PROMPTS, steps=6, fused=False, kv_dtype=kv_dtype)
    answered = []
    call = fused_decode.FusedDecodeStep.__call__
    monkeypatch.setattr(fused_decode.FusedDecodeStep, "__call__",
                        lambda self, *a, **kw: answered.append(call(self, *a, **kw)) or answered[-1])
    out, caches = _decode_run(model, PROMPTS, steps=6, fused=True, kv_dtype=kv_dtype)
    assert [h is not None for h in answered] == [False] + [True] * 6  # the prefill not, every decode step fused
    for step, (a, b) in enumerate(zip(out, ref)):
        err = (a - b).abs().max().item()
        assert err <= 2e-3 * b.abs().max().item(), f"step {step}: max |fused - reference| = {err}"
    for cache, ref_cache in zip(caches, ref_caches):
        k, v, ks, vs = cache
        rk, rv, rks, rvs = ref_cache
        for codes, scales, ref_codes, ref_scales in ((k, ks, rk, rks), (v, vs, rv, rvs)):
            x, rx = codes.float() * scales.float()[..., None], ref_codes.float() * ref_scales.float()[..., None]
            assert (x - rx).abs().max() <= 0.02 * rx.abs().max()
            assert (codes.view(torch.uint8) == ref_codes.view(torch.uint8)).float().mean() > 0.97
            assert torch.equal(scales == 0, ref_scales == 0)  # the same slots written


# Request 0 verifies 4 tokens (a decode token and 3 drafts), request 1 decodes, request 2
# verifies 3: one step of the three, against the same tokens one decode step at a time.
VERIFY = [[11, 4, 9, 2], [6], [3, 8, 1]]


@needs_kernel
@pytest.mark.parametrize("kv_dtype", [None, torch.int8], ids=["float", "int8"])
def test_a_verification_step_computes_each_token_as_a_decode_step_would(kv_dtype) -> None:
    """Speculative decoding is exact only when the verification's logits of each token equal
    what plain decoding computes for it: in the fused step each query token attends as a decode
    row of its own (``per_token_rows``), so a step of several tokens per request gives each
    token's hidden state bit for bit as the decode steps of those tokens one at a time do."""
    model = gguf_tiny_model()
    (together,), _ = _run_steps(model, PROMPTS, [VERIFY], fused=True, kv_dtype=kv_dtype)
    one_at_a_time = [[toks[s : s + 1] for toks in VERIFY] for s in range(max(map(len, VERIFY)))]
    single, _ = _run_steps(model, PROMPTS, one_at_a_time, fused=True, kv_dtype=kv_dtype)
    # request r's token s: its row of step s, after the requests before it that had a token s
    want = torch.stack([single[s][sum(len(q) > s for q in VERIFY[:r])]
                        for r, toks in enumerate(VERIFY) for s in range(len(toks))])
    assert torch.equal(together, want)


@needs_kernel
@pytest.mark.parametrize("kv_dtype", [None, torch.int8], ids=["float", "int8"])
def test_a_verification_step_follows_the_pytorch_path(kv_dtype) -> None:
    model = gguf_tiny_model()
    steps = [[[5], [7], [2]], VERIFY, [[1, 2], [], [4]]]  # a decode, a verification, a partial step
    ref, _ = _run_steps(model, PROMPTS, steps, fused=False, kv_dtype=kv_dtype)
    out, _ = _run_steps(model, PROMPTS, steps, fused=True, kv_dtype=kv_dtype)
    assert isinstance(model.__dict__["fused_decode"], fused_decode.FusedDecodeStep)
    for step, (a, b) in enumerate(zip(out, ref)):
        err = (a - b).abs().max().item()
        tolerance = (2e-3 if kv_dtype is None else 2e-2) * b.abs().max().item()
        assert err <= tolerance, f"step {step}: max |fused - reference| = {err}"


def test_per_token_rows_give_each_query_token_its_causal_length() -> None:
    tables = torch.tensor([[4, 5, 6], [7, 8, 0]])
    t, ctx = fused_decode.per_token_rows(tables, torch.tensor([9, 5], dtype=torch.int32),
                                         torch.tensor([0, 3, 4], dtype=torch.int32))
    assert ctx.tolist() == [7, 8, 9, 5] and ctx.dtype == torch.int32
    assert t.tolist() == [[4, 5, 6]] * 3 + [[7, 8, 0]]


@needs_kernel
def test_fused_decode_in_bfloat16_follows_the_pytorch_path() -> None:
    model = gguf_tiny_model(dtype=torch.bfloat16)
    ref, _ = _decode_run(model, PROMPTS, steps=3, fused=False)
    out, _ = _decode_run(model, PROMPTS, steps=3, fused=True)
    assert isinstance(model.__dict__["fused_decode"], fused_decode.FusedDecodeStep)
    for a, b in zip(out, ref):  # bfloat16 roundings of every intermediate (8 bits of mantissa)
        assert (a - b).abs().max() <= 0.01 * b.abs().max()


def dense_tiny_model(attention_bias: bool = False) -> LlamaForCausalLM:
    """``gguf_tiny_model``'s shape with dense bfloat16 weights, prepacked for oneDNN where this CPU
    packs bfloat16 (``process_weights_after_loading``, as the loader does)."""
    from tests.conftest import tiny_model

    config = tiny_model_config(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=64, attention_bias=attention_bias,
                               model_type="qwen2" if attention_bias else "llama")  # (as gguf_tiny_model)
    model = tiny_model(config)
    with torch.no_grad():
        for layer in model.layers:  # weights of the size a trained layer has (k^-1/2)
            for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                lin.weight.mul_(5.0 * lin.weight.shape[1] ** -0.5)
    model = model.to(torch.bfloat16)
    process_weights_after_loading(model)
    return model


@needs_kernel
@pytest.mark.skipif(not onednn_packs(torch.bfloat16), reason="oneDNN does not pack bfloat16 weights on this CPU")
@pytest.mark.parametrize("attention_bias", [False, True], ids=["llama", "qwen2-bias"])
def test_fused_decode_over_dense_bfloat16_weights_follows_the_pytorch_path(attention_bias: bool) -> None:
    model = dense_tiny_model(attention_bias)
    assert fused_decode.refusal(model) is None
    ref, ref_caches = _decode_run(model, PROMPTS, steps=4, fused=False)
    out, caches = _decode_run(model, PROMPTS, steps=4, fused=True)
    assert isinstance(model.__dict__["fused_decode"], fused_decode.FusedDecodeStep)  # it ran
    for step, (a, b) in enumerate(zip(out, ref)):
        # the same oneDNN products; norms, rotary, SiLU rounded to bfloat16 as the PyTorch path
        # does, their float32 sums in another order (and the vector e^x): a last-bit change
        assert (a - b).abs().max() <= 0.01 * b.abs().max(), f"step {step}"
    for (k, v), (rk, rv) in zip(caches, ref_caches):
        assert (k - rk).abs().max() <= 0.01 * rk.abs().max() and (v - rv).abs().max() <= 0.01 * rv.abs().max()


@needs_kernel
@pytest.mark.skipif(not onednn_packs(torch.bfloat16), reason="oneDNN does not pack bfloat16 weights on this CPU")
def test_a_dense_weight_must_be_the_prepacked_one() -> None:
    model = dense_tiny_model()
    layer = model.layers[0]
    decoder = ops.FUSED_DECODE.load().FusedDecoder(256, 4, 2, 64, 512, 1e-6, 0.125, model.norm.weight.detach())
    attn, mlp = layer.self_attn, layer.mlp
    packed = {name: lin.__dict__["packed"] for name, lin in (("qkv_proj", attn.qkv_proj), ("o_proj", attn.o_proj),
                                                              ("gate_up_proj", mlp.gate_up_proj),
                                                              ("down_proj", mlp.down_proj))}
    norms = (layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach())
    decoder.add_layer(norms[0], packed["qkv_proj"], None, packed["o_proj"], norms[1], packed["gate_up_proj"],
                      packed["down_proj"])
    assert decoder.num_layers() == 1
    with pytest.raises(RuntimeError, match="qkv: a prepacked bfloat16 weight"):  # a plain tensor of the right shape
        decoder.add_layer(norms[0], torch.zeros(512, 256, dtype=torch.bfloat16), None, packed["o_proj"], norms[1],
                          packed["gate_up_proj"], packed["down_proj"])


def test_models_and_steps_it_does_not_cover_keep_the_pytorch_path() -> None:
    windowed = gguf_tiny_model(hf_config=types.SimpleNamespace(sliding_window=8))  # Mistral-style, every layer
    assert "sliding-window" in fused_decode.refusal(windowed)
    from tests.conftest import tiny_model
    # dense weights only in bfloat16 prepacked for oneDNN (float32 is the exactness reference)
    assert "dense torch.float32 weight" in fused_decode.refusal(tiny_model(tiny_model_config()))
    model = gguf_tiny_model()
    assert fused_decode.refusal(model) is None
    if not needs_kernel.args[0]:
        step = fused_decode.bind(model)
        assert isinstance(step, fused_decode.FusedDecodeStep)
        # Prompt tokens only (a 3-token prefill; the 1-token rest of a prefix-cache hit): None.
        backend = CpuAttentionBackend()
        cache = CacheEngine(model.kv_cache_spec, CacheConfig(4, 160, torch.float32), torch.device("cpu"))
        cpu = torch.device("cpu")
        layout = BatchLayout(torch.arange(3), [3], [3], [[0]], [1], 4, cpu, prompt_lens=[3])
        assert step(torch.tensor([1, 2, 3]), torch.arange(3), cache.kv_caches, backend.build_metadata(layout)) is None
        layout = BatchLayout(torch.tensor([4]), [1], [5], [[0, 1]], [1], 4, cpu, prompt_lens=[1])
        assert step(torch.tensor([1]), torch.tensor([4]), cache.kv_caches, backend.build_metadata(layout)) is None
        assert step(torch.tensor([1]), torch.tensor([4]), cache.kv_caches, backend.build_metadata(
            BatchLayout(torch.tensor([4]), [1], [5], [[0, 1]], [1], 4, cpu, prompt_lens=[0]))) is not None  # (a decode)
        # A layout that does not say which tokens are prompt tokens: all of them, None.
        assert step(torch.tensor([1]), torch.tensor([4]), cache.kv_caches, backend.build_metadata(
            BatchLayout(torch.tensor([4]), [1], [5], [[0, 1]], [1], 4, cpu))) is None
        # Generated tokens and prompt tokens in one step: split only where the PyTorch path is given.
        layout = BatchLayout(torch.arange(9), [1, 8], [9, 8], [[0, 1, 2], [3, 4]], [1, 1], 4, cpu, prompt_lens=[0, 8])
        assert step(torch.arange(9), torch.arange(9), cache.kv_caches, backend.build_metadata(layout)) is None
        # Generated tokens past MAX_DECODE_TOKENS: in slices.
        n = fused_decode.MAX_DECODE_TOKENS + 1
        layout = BatchLayout(torch.arange(n) * 4, [1] * n, [1] * n, [[b] for b in range(n)], [n], 4, cpu,
                             prompt_lens=[0] * n)
        assert step(torch.ones(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64), cache.kv_caches,
                    backend.build_metadata(layout)).shape == (n, model.config.hidden_size)


@pytest.mark.integration
@requires_smollm2
@needs_kernel
def test_smollm2_greedy_tokens_equal_with_and_without_the_fused_step(smollm2_dir, monkeypatch) -> None:
    """The real SmolLM2-135M Q4_1 file served as stored: 16 greedy tokens of two prompts (decode
    steps of two tokens) equal with the fused step and with the PyTorch path (measured: all
    equal with the AVX-512 build). A split is allowed only at a near tie of the reference,
    within 0.25 nat as in the GGUF tests (tests/quantization/test_gguf_native.py): the two
    paths sum in other orders, so an activation can round to the neighbouring int8 code, and
    over 30 layers and several tokens such flips moved a logprob by 0.085 nat with the AVX2
    build. The tests above hold the fused step to the PyTorch path within 2e-3 per step."""
    from kvflow import LLM, SamplingParams

    monkeypatch.setenv("KVFLOW_CPU_KERNEL_BUILD", "wait")  # the kernels now, not in the background
    llm = LLM(model=str(smollm2_dir), dtype="float32", quantization="gguf", num_kv_blocks=64)
    model = llm.engine.model_runner.model
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)
    prompts = ["The capital of France is", "def fibonacci(n):\n    "]
    calls = []
    fused = llm.generate(prompts, params)
    step = model.__dict__["fused_decode"]
    assert isinstance(step, fused_decode.FusedDecodeStep)
    forward = step.decoder.forward
    step.decoder = type("Counted", (), {"forward": lambda self, *a: calls.append(1) or forward(*a)})()
    again = llm.generate(prompts[:1], params)
    assert len(calls) == 15 and again[0].outputs[0].token_ids == fused[0].outputs[0].token_ids
    model.__dict__["fused_decode"] = None  # the PyTorch path, the reference
    ref = llm.generate(prompts, params)
    for a, b in zip(fused, ref):
        got, want = a.outputs[0].token_ids, b.outputs[0].token_ids
        d = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), len(want))
        if d < len(want):  # parted: only where the reference stood at a near tie (float32 sum order)
            top = sorted((lp.logprob for lp in b.outputs[0].logprobs[d].values()), reverse=True)
            assert top[0] - top[1] < 0.25, (a.prompt, d, top)


@pytest.mark.integration
@requires_smollm2
@needs_kernel
@pytest.mark.skipif(not onednn_packs(torch.bfloat16), reason="oneDNN does not pack bfloat16 weights on this CPU")
def test_smollm2_dense_bfloat16_greedy_tokens_follow_the_pytorch_path(smollm2_dir, monkeypatch) -> None:
    """The real SmolLM2-135M dequantized to dense bfloat16 (vLLM's precision): its decode steps
    take the fused step (oneDNN's linears called from C++) and 16 greedy tokens of two prompts
    equal the PyTorch path's, a split allowed only at a near tie of the reference (bfloat16
    norms summed in another order can move a last bit)."""
    from kvflow import LLM, SamplingParams

    monkeypatch.setenv("KVFLOW_CPU_KERNEL_BUILD", "wait")
    llm = LLM(model=str(smollm2_dir), dtype="bfloat16", quantization="none", num_kv_blocks=64)
    model = llm.engine.model_runner.model
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)
    prompts = ["The capital of France is", "def fibonacci(n):\n    "]
    fused = llm.generate(prompts, params)
    assert isinstance(model.__dict__["fused_decode"], fused_decode.FusedDecodeStep)
    model.__dict__["fused_decode"] = None  # the PyTorch path, the reference
    ref = llm.generate(prompts, params)
    for a, b in zip(fused, ref):
        got, want = a.outputs[0].token_ids, b.outputs[0].token_ids
        d = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), len(want))
        if d < len(want):
            top = sorted((lp.logprob for lp in b.outputs[0].logprobs[d].values()), reverse=True)
            assert top[0] - top[1] < 0.25, (a.prompt, d, top)


def test_while_the_kernel_builds_the_model_is_checked_once(monkeypatch) -> None:
    """``bind`` answers PENDING at every step of a background build; the model's layers are
    walked once, not at each of those steps."""
    model = gguf_tiny_model()
    calls = []
    check = fused_decode.refusal
    monkeypatch.setattr(fused_decode, "refusal", lambda m: calls.append(1) or check(m))
    monkeypatch.setattr(fused_decode._EXTENSION, "pending", lambda: True)
    assert fused_decode.bind(model) is fused_decode.PENDING
    assert fused_decode.bind(model) is fused_decode.PENDING
    assert len(calls) == 1


@pytest.mark.integration
@requires_smollm2
@needs_kernel
def test_smollm2_a_prefix_cache_hit_computes_its_rest_as_a_miss(smollm2_dir, monkeypatch) -> None:
    """The GGUF file served as stored, float32: a prompt computed from scratch and again after
    a prefix-cache hit (its uncached rest of 1-16 tokens) give the same greedy tokens with
    logprobs within 1e-5: prompt tokens take the PyTorch path, a hit's rest too (the fused
    step would round its activations to int8 after sums in another order: a near tie of a
    reply regenerated in the chat page split that way)."""
    from kvflow import LLM, SamplingParams

    monkeypatch.setenv("KVFLOW_CPU_KERNEL_BUILD", "wait")
    llm = LLM(model=str(smollm2_dir), dtype="float32", quantization="gguf", num_kv_blocks=128,
              enable_prefix_caching=True)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=1)
    base = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg, a "
            "goldsmith from Mainz, combined movable metal type with an oil-based ink and a screw press")  # 37 tokens
    for rest in (".", ". Within fifty years printing spread"):  # 1 and about 8 tokens past its 2 full blocks
        miss = llm.generate([base + rest], params, use_tqdm=False)[0]
        llm.reset_prefix_cache()
        llm.generate([base], SamplingParams(max_tokens=1), use_tqdm=False)  # caches the prompt's full blocks
        hit = llm.generate([base + rest], params, use_tqdm=False)[0]
        llm.reset_prefix_cache()
        assert hit.num_cached_tokens > 0 and len(hit.prompt_token_ids) - hit.num_cached_tokens <= 16
        assert hit.outputs[0].token_ids == miss.outputs[0].token_ids
        for token, a, b in zip(hit.outputs[0].token_ids, hit.outputs[0].logprobs, miss.outputs[0].logprobs):
            assert abs(a[token].logprob - b[token].logprob) <= 1e-5


@needs_kernel
@pytest.mark.parametrize("kv_dtype", [None, torch.int8], ids=["float", "int8"])
def test_prompt_tokens_in_the_step_leave_the_generated_tokens_fused(kv_dtype) -> None:
    """A prompt chunk (long, or as short as a decode) sharing a step with decodes and a
    verification: the step is split by token (``FusedDecodeStep.__call__``'s ``rest``), the
    generated tokens computed bit for bit as in a step without the chunk, the chunk on the
    PyTorch path. (The whole step took the PyTorch path: a request's greedy tokens depended on
    whether a prompt arrived while it decoded, and n-gram output on when.)"""
    model = gguf_tiny_model()
    prompts = PROMPTS + [[5]]
    long = [(3 * j + 1) % model.config.vocab_size for j in range(20)]
    for chunk in (long, long[:3], long[:1]):
        for others in ([[5], [7], [2]], [[5], [7, 3, 1], [2]]):  # decodes only; a verification in the chunk's group
            (alone,), _ = _run_steps(model, prompts, [others + [[]]], fused=True, kv_dtype=kv_dtype)
            lens = [[0, 0, 0, len(chunk)]]
            (mixed,), _ = _run_steps(model, prompts, [others + [chunk]], fused=True, kv_dtype=kv_dtype, prompt_lens=lens)
            n = sum(map(len, others))
            assert torch.equal(mixed[:n], alone)
            (ref,), _ = _run_steps(model, prompts, [others + [chunk]], fused=False, kv_dtype=kv_dtype, prompt_lens=lens)
            assert torch.equal(mixed[n:], ref[n:])  # the chunk: the PyTorch path's own rows
            tolerance = (2e-3 if kv_dtype is None else 2e-2) * ref.abs().max().item()
            assert (mixed - ref).abs().max().item() <= tolerance


@needs_kernel
@pytest.mark.parametrize("kv_dtype", [None, torch.int8], ids=["float", "int8"])
def test_a_recomputed_request_computes_its_output_as_its_decode_steps_did(kv_dtype) -> None:
    """A request preempted by recompute brings its prompt and its output tokens back in one
    query: the prompt tokens through the PyTorch path first, then the output tokens as decode
    rows through the fused call, each computed bit for bit as its decode step computed it.
    (Recomputed on the PyTorch path, the re-written K/V differed from the first ones by float
    summation order, and the request's later tokens could part from an unpreempted run's.)"""
    model = gguf_tiny_model()
    prompts = PROMPTS + [[4]]
    rest_of_prompt, output, others = [9, 3, 6, 1, 8, 2, 7], [11, 5, 13, 2, 6], [[5], [7], [2]]
    steps = [others + [rest_of_prompt]] + [others + [[t]] for t in output]
    lens = [[0, 0, 0, len(rest_of_prompt)]] + [[0] * 4] * len(output)
    served, _ = _run_steps(model, prompts, steps, fused=True, kv_dtype=kv_dtype, prompt_lens=lens)
    (again,), _ = _run_steps(model, prompts, [others + [rest_of_prompt + output]], fused=True, kv_dtype=kv_dtype,
                             prompt_lens=[[0, 0, 0, len(rest_of_prompt)]])
    assert torch.equal(again[-len(output):], torch.cat([h[-1:] for h in served[1:]]))


@needs_kernel
def test_a_verification_step_of_more_than_max_decode_tokens_computes_each_token_as_a_decode_step_would() -> None:
    """Nine requests verifying 16 tokens each (144 > MAX_DECODE_TOKENS): the fused call takes
    the step in slices of at most MAX_DECODE_TOKENS rows (a request's earlier tokens first), so
    each token is still computed as its plain decode step computes it. (Such a step took the
    PyTorch path: with speculation on, 9 streams at k = 15 or 32 at k = 3, greedy output then
    differed from plain decoding, whose steps of one token per request were fused.)"""
    model = gguf_tiny_model()
    n, q = 9, 16
    assert n * q > fused_decode.MAX_DECODE_TOKENS
    prompts = [[r + 1] for r in range(n)]
    new = [[(7 * j + 3 * r) % model.config.vocab_size for j in range(q)] for r in range(n)]
    (together,), _ = _run_steps(model, prompts, [new], fused=True)
    single, _ = _run_steps(model, prompts, [[toks[s : s + 1] for toks in new] for s in range(q)], fused=True)
    want = torch.stack([single[s][r] for r in range(n) for s in range(q)])
    assert torch.equal(together, want)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_last_prompt_token_before_drafts_is_computed_as_its_one_token_chunk(dtype) -> None:
    """A prompt chunked so that one token is left (a chunk budget), then scheduled with the
    drafts a proposer made meanwhile: a query of one prompt token and three drafts, beside
    another request's prompt chunk. The prompt token takes the PyTorch path in a group of its
    own, as a decode row, so it is computed bit for bit as the same one-token chunk without
    drafts is. (In the prefill group beside the other chunk its attention summed in another
    order: 0.039 apart in bfloat16, and a fuzzed schedule of 149 requests with draft-model
    speculation then gave one request other greedy tokens than it had alone.)"""
    model = gguf_tiny_model(dtype=dtype)
    long = [(3 * j + 1) % model.config.vocab_size for j in range(20)]
    prompts = [[122, 34, 122], [5, 6, 7], [9]]
    (alone,), _ = _run_steps(model, prompts, [[[34], [], []]], fused=True, prompt_lens=[[1, 0, 0]])
    for new, lens in (([[34, 50, 85, 61], long, []], [1, 20, 0]), ([[34, 50], long[:2], [3]], [1, 2, 0])):
        (mixed,), _ = _run_steps(model, prompts, [new], fused=True, prompt_lens=[lens])
        assert torch.equal(mixed[0], alone[0])
