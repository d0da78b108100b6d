"""Multi-LoRA serving against transformers + PEFT on tiny random models (Llama, Qwen2 with
rsLoRA, Qwen3): float32 logits of one adapter and of a mixed forward vs PEFT's merged
models, a mixed batch through the engine vs each request alone, prefix-cache isolation,
loading and unloading while requests run, and the refusals."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvflow import LLM, LoRARequest, SamplingParams
from kvflow.lora.manager import LoRAManager
from kvflow.lora.punica import LoRAMapping
from kvflow.model.loader import load_model
from lora_helpers import lora_logits, save_adapter, save_base

pytestmark = pytest.mark.usefixtures("one_thread")
CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama folder with three adapters (a: every projection, r 8; b: q/v only, r 4;
    c: MLP only, r 16 with rsLoRA)."""
    root = tmp_path_factory.mktemp("lora")
    hf = save_base(root / "base", "llama")
    merged = {
        "a": save_adapter(root / "base", root / "a", seed=1),
        "b": save_adapter(root / "base", root / "b", seed=2, r=4, alpha=8, targets=["q_proj", "v_proj"]),
        "c": save_adapter(root / "base", root / "c", seed=3, r=16, alpha=4, targets=["gate_proj", "up_proj", "down_proj"],
                          use_rslora=True),
    }
    loras = {name: LoRARequest(name, i + 1, str(root / name)) for i, name in enumerate("abc")}
    return root, hf, merged, loras


@pytest.mark.parametrize("arch,rslora", [("llama", False), ("qwen2", True), ("qwen3", False)])
def test_logits_match_peft_merged(arch, rslora, tmp_path):
    hf = save_base(tmp_path / "base", arch, attention_bias=True) if arch == "qwen2" else save_base(tmp_path / "base", arch)
    merged_a = save_adapter(tmp_path / "base", tmp_path / "a", seed=1, use_rslora=rslora)
    merged_b = save_adapter(tmp_path / "base", tmp_path / "b", seed=2, r=4, targets=["q_proj", "v_proj", "down_proj"])
    model, _ = load_model(tmp_path / "base", torch.float32, CPU)
    manager = LoRAManager(model, max_loras=2, max_lora_rank=8, max_cpu_loras=2)
    slots = manager.activate([LoRARequest("a", 1, str(tmp_path / "a")), LoRARequest("b", 2, str(tmp_path / "b"))])
    sa, sb = slots[1], slots[2]
    ids = _ids(37, seed=4)
    with torch.inference_mode():
        want = {name: m(torch.tensor([ids])).logits[0] for name, m in (("a", merged_a), ("b", merged_b), ("base", hf))}
    assert (want["a"] - want["base"]).abs().max() > 0.5  # the adapters change the logits
    assert (want["b"] - want["base"]).abs().max() > 0.5
    tol = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lora_logits(model, ids, [(sa, len(ids))]), want["a"], **tol)
    # One forward of four requests: a, the base model, b, a again (a's rows are gathered)
    cuts = [ids[:11], ids[:20], ids[:37], ids[:5]]
    got = lora_logits(model, sum(cuts, []), [(sa, 11), (-1, 20), (sb, 37), (sa, 5)]).split([11, 20, 37, 5])
    torch.testing.assert_close(got[0], want["a"][:11], **tol)
    torch.testing.assert_close(got[1], want["base"][:20], **tol)
    torch.testing.assert_close(got[2], want["b"], **tol)
    torch.testing.assert_close(got[3], want["a"][:5], **tol)
    # One adapter whose requests are apart: its rows are gathered (no masked pass)
    got = lora_logits(model, cuts[0] + cuts[1] + cuts[3], [(sa, 11), (-1, 20), (sa, 5)]).split([11, 20, 5])
    torch.testing.assert_close(got[0], want["a"][:11], **tol)
    torch.testing.assert_close(got[1], want["base"][:20], **tol)
    torch.testing.assert_close(got[2], want["a"][:5], **tol)


@pytest.mark.parametrize("targets", [["model.layers.0.self_attn.q_proj", "layers.1.mlp.down_proj"], "all-linear",
                                     r"model\.layers\.1\.self_attn\.(k|v)_proj"])
def test_target_modules_matched_as_peft_does(targets, tmp_path):
    """target_modules entries that are module paths (what PEFT 0.21 writes for "all-linear"),
    matched by suffix, or a regex: accepted, and a target of one layer changes that layer only
    (the logits are PEFT's)."""
    save_base(tmp_path / "base", "llama")
    merged = save_adapter(tmp_path / "base", tmp_path / "a", seed=1, targets=targets)
    model, _ = load_model(tmp_path / "base", torch.float32, CPU)
    manager = LoRAManager(model, max_loras=1, max_lora_rank=8, max_cpu_loras=1)
    (slot,) = manager.activate([LoRARequest("a", 1, str(tmp_path / "a"))]).values()
    ids = _ids(19, seed=4)
    with torch.inference_mode():
        want = merged(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(lora_logits(model, ids, [(slot, len(ids))]), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("max_loras,max_cpu_loras", [(3, 3), (2, 2)], ids=["all-in-slots", "evicting"])
def test_mixed_batch_equals_each_alone(llama, max_loras, max_cpu_loras):
    """3 adapters and the base model in one batch; with 2 slots the scheduler holds back the
    third adapter's requests and slots / host copies are evicted and re-read."""
    root, _, _, loras = llama
    llm = LLM(str(root / "base"), device="cpu", dtype="float32", block_size=4, num_kv_blocks=256,
              max_num_batched_tokens=64, enable_lora=True, max_loras=max_loras, max_lora_rank=16,
              max_cpu_loras=max_cpu_loras, enable_prefix_caching=False)
    manager = llm.engine.lora_manager
    per_step, activate = [], manager.activate
    manager.activate = lambda requests: (per_step.append(len({r.lora_int_id for r in requests})), activate(requests))[1]
    prompts = [_ids(5 + 3 * i, seed=10 + i) for i in range(8)]
    choice = [loras["a"], None, loras["b"], loras["c"], loras["a"], loras["c"], None, loras["b"]]
    mixed = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=choice)
    assert max(per_step) == max_loras  # never more adapters in a step than slots
    for prompt, lora, out in zip(prompts, choice, mixed):
        (alone,) = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    base = llm.generate(prompts, GREEDY, use_tqdm=False)
    changed = [m.outputs[0].token_ids != b.outputs[0].token_ids for m, b, lora in zip(mixed, base, choice) if lora]
    assert sum(changed) >= 4  # the adapters do change the continuations
    if max_loras == 2:
        assert len(llm.engine.lora_manager.cpu_cache) == 2


def test_outputs_carry_their_lora_request(llama):
    """RequestOutput.lora_request and CompletionOutput.lora_request are the request's
    LoRARequest (None for the base model), as vLLM's; they were AttributeErrors."""
    root, _, _, loras = llama
    llm = LLM(str(root / "base"), device="cpu", dtype="float32", block_size=4, num_kv_blocks=64,
              enable_lora=True, max_lora_rank=16)
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=2, n=2)
    with_a, base = llm.generate([_ids(5, seed=1)] * 2, params, use_tqdm=False, lora_request=[loras["a"], None])
    assert with_a.lora_request is loras["a"] and all(c.lora_request is loras["a"] for c in with_a.outputs)
    assert base.lora_request is None and all(c.lora_request is None for c in base.outputs)
    streamed = list(llm.generate_stream(_ids(5, seed=1), GREEDY, lora_request=loras["a"]))
    assert all(o.lora_request is loras["a"] and o.outputs[0].lora_request is loras["a"] for o in streamed)


def test_greedy_tokens_follow_peft(llama):
    """The engine's greedy tokens under adapter a are transformers + PEFT's (merged)."""
    from conftest import hf_greedy
    from model.hf_parity import assert_greedy_matches

    root, _, merged, loras = llama
    llm = LLM(str(root / "base"), device="cpu", dtype="float32", block_size=4, num_kv_blocks=64,
              max_num_batched_tokens=8, enable_lora=True, max_lora_rank=16)
    prompt = _ids(13, seed=5)
    (out,) = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=loras["a"])
    ref, margins = hf_greedy(merged["a"], prompt, 8)
    assert_greedy_matches(list(out.outputs[0].token_ids), ref, margins)


def test_prefix_cache_keys_blocks_by_adapter(llama):
    root, _, _, loras = llama
    llm = LLM(str(root / "base"), device="cpu", dtype="float32", block_size=4, num_kv_blocks=128,
              enable_lora=True, max_loras=2, max_lora_rank=16)
    prompt = _ids(17, seed=6)

    def run(lora):
        (out,) = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)
        return out.num_cached_tokens, out.outputs[0].token_ids

    cached_a, tokens_a = run(loras["a"])
    assert cached_a == 0
    cached_b, tokens_b = run(loras["b"])
    assert cached_b == 0  # the same prompt under another adapter shares nothing
    assert run(None)[0] == 0  # nor with the base model
    again_cached, again_tokens = run(loras["a"])
    assert again_cached == 16 and again_tokens == tokens_a  # the same adapter does hit
    fresh = LLM(str(root / "base"), device="cpu", dtype="float32", block_size=4, num_kv_blocks=128,
                enable_lora=True, max_lora_rank=16, enable_prefix_caching=False)
    (ref_b,) = fresh.generate([prompt], GREEDY, use_tqdm=False, lora_request=loras["b"])
    assert ref_b.outputs[0].token_ids == tokens_b


def test_load_and_unload_while_requests_run(llama):
    root, _, _, loras = llama
    llm = LLM(str(root / "base"), device="cpu", dtype="float32", block_size=4, num_kv_blocks=128,
              max_num_batched_tokens=16, enable_lora=True, max_loras=2, max_lora_rank=16)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompt = _ids(9, seed=7)
    (alone_a,) = llm.generate([prompt], params, use_tqdm=False, lora_request=loras["a"])
    assert engine.remove_lora(1) and 1 not in engine.list_loras()
    engine.add_request("x", prompt, params, lora_request=loras["a"])
    for _ in range(3):
        engine.step()
    assert engine.add_lora(loras["b"])  # loading while "x" runs
    engine.add_request("y", prompt, params, lora_request=loras["b"])
    with pytest.raises(ValueError, match="adapter 'a' is in use by 1 unfinished request"):
        engine.remove_lora(1)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert done["x"] == alone_a.outputs[0].token_ids
    (alone_b,) = llm.generate([prompt], params, use_tqdm=False, lora_request=loras["b"])
    assert done["y"] == alone_b.outputs[0].token_ids
    assert engine.remove_lora(1) and engine.remove_lora(2) and engine.list_loras() == set()
    assert not engine.remove_lora(1)


def test_vllm_llm_engine_runs_adapters(llama):
    """vLLM's examples/offline_inference/multilora_inference.py on kvflow: ``from kvflow import
    EngineArgs, LLMEngine``, ``LLMEngine.from_engine_args(EngineArgs(enable_lora=True,
    max_loras=1, ...))``, ``add_request(id, prompt, params, lora_request=...)`` and ``step()``
    until done; each request's tokens are its adapter's alone. ``kvflow.LLMEngine`` did not
    exist, and ``LLM.llm_engine.add_request`` refused every lora_request."""
    from kvflow import EngineArgs, LLMEngine

    root, _, _, loras = llama
    common = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=128, enable_lora=True, max_loras=1,
                  max_lora_rank=16, max_cpu_loras=2)
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(root / "base"), **common))
    prompts = [_ids(6 + i, seed=20 + i) for i in range(4)]
    choice = [None, loras["a"], loras["b"], loras["a"]]
    queue = list(enumerate(zip(prompts, choice)))
    done = {}
    while queue or engine.has_unfinished_requests():
        if queue:
            i, (prompt, lora) = queue.pop(0)
            engine.add_request(str(i), {"prompt_token_ids": prompt}, GREEDY, lora_request=lora)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    llm = LLM(str(root / "base"), **common)
    for i, (prompt, lora) in enumerate(zip(prompts, choice)):
        (alone,) = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)
        assert done[str(i)].outputs[0].token_ids == alone.outputs[0].token_ids
        assert done[str(i)].lora_request is lora
    (base_1,) = llm.generate([prompts[1]], GREEDY, use_tqdm=False)
    assert done["1"].outputs[0].token_ids != base_1.outputs[0].token_ids  # the adapter did run
    assert llm.llm_engine.add_lora(loras["c"]) and 3 in llm.llm_engine.list_loras()
    with pytest.raises(ValueError, match="lora_request must be a LoRARequest or None, got str"):
        engine.add_request("x", [1, 2], GREEDY, lora_request="a")


def test_speculative_decoding_with_an_adapter_is_exact(llama):
    """Drafts are verified by the adapted model, so n-gram speculation keeps its tokens."""
    root, _, _, loras = llama
    common = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=128, enable_lora=True,
                  max_lora_rank=16)
    prompt = _ids(6, seed=8) * 3  # repeats: the n-gram proposer finds drafts
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = LLM(str(root / "base"), **common).generate([prompt], params, use_tqdm=False, lora_request=loras["c"])
    spec_llm = LLM(str(root / "base"), speculative_config={"method": "ngram", "num_speculative_tokens": 3}, **common)
    spec = spec_llm.generate([prompt], params, use_tqdm=False, lora_request=loras["c"])
    assert spec[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert spec_llm.get_stats()["spec_num_draft_tokens"] > 0


def _copy_adapter(src, dst, config_update=None, tensors_update=None):
    dst.mkdir()
    config = json.loads((src / "adapter_config.json").read_text())
    config.update(config_update or {})
    (dst / "adapter_config.json").write_text(json.dumps(config))
    tensors = load_file(str(src / "adapter_model.safetensors"))
    if tensors_update is not None:
        tensors = tensors_update(tensors)
    save_file(tensors, str(dst / "adapter_model.safetensors"))
    return str(dst)


def test_bad_adapters_are_refused_by_name(llama, tmp_path):
    root, _, _, loras = llama
    llm = LLM(str(root / "base"), device="cpu", dtype="float32", num_kv_blocks=64, enable_lora=True,
              max_lora_rank=8)
    prompt = _ids(5, seed=9)

    def refused(lora, match):
        with pytest.raises(ValueError, match=match):
            llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)

    refused(loras["c"], r"LoRA adapter 'c': rank r=16 is more than max_lora_rank=8")
    refused(LoRARequest("nowhere", 7, str(tmp_path / "missing")), r"LoRA adapter 'nowhere': no adapter_config.json")
    lacks = _copy_adapter(root / "a", tmp_path / "lacks", {"target_modules": ["q_proj", "c_attn"]})
    refused(LoRARequest("lacks", 8, lacks), r"target module\(s\) \['c_attn'\] do not exist")

    def rename(t):
        return {k.replace("layers.1.", "layers.9."): v for k, v in t.items()}

    layer9 = _copy_adapter(root / "a", tmp_path / "layer9", tensors_update=rename)
    refused(LoRARequest("layer9", 9, layer9), r"target module 'base_model.model.model.layers.9.mlp.down_proj' does not exist")

    def shrink(t):
        key = "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"
        return {**t, key: t[key][:50]}

    shapes = _copy_adapter(root / "a", tmp_path / "shapes", tensors_update=shrink)
    refused(LoRARequest("shapes", 10, shapes),
            r"module 'base_model.model.model.layers.0.mlp.up_proj' has lora_A \(8, 64\) and lora_B \(50, 8\); "
            r"the base layer needs lora_A \[r, 64\] and lora_B \[96, r\]")
    dora = _copy_adapter(root / "a", tmp_path / "dora", {"use_dora": True})
    refused(LoRARequest("dora", 11, dora), "use_dora=True is not supported")
    alora = _copy_adapter(root / "a", tmp_path / "alora", {"alora_invocation_tokens": [5, 6]})
    refused(LoRARequest("alora", 12, alora), r"alora_invocation_tokens=\[5, 6\] is not supported")
    for i, (field, value) in enumerate([("exclude_modules", ["q_proj"]), ("target_parameters", ["mlp.experts.gate_up_proj"]),
                                        ("trainable_token_indices", [5, 6]), ("lora_ga_config", {"x": 1}),
                                        ("arrow_config", {"top_k": 3}), ("use_bdlora", {"nblocks": 2}),
                                        ("kasa_config", {"x": 1})]):
        other = _copy_adapter(root / "a", tmp_path / field, {field: value})
        refused(LoRARequest(field, 20 + i, other), rf"{field}=.* is not supported by kvflow's LoRA")
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    ints = _copy_adapter(root / "a", tmp_path / "ints", tensors_update=lambda t: {**t, key: t[key].to(torch.int32)})
    refused(LoRARequest("ints", 19, ints), rf"tensor '{key}' is int32; LoRA weights are floating point")
    nan = _copy_adapter(root / "a", tmp_path / "nan", tensors_update=lambda t: {**t, key: t[key].index_fill(0, torch.tensor([3]), float("nan"))})
    refused(LoRARequest("nan", 13, nan), rf"tensor '{key}' has NaN or Inf values")
    over = _copy_adapter(root / "a", tmp_path / "over", {"lora_alpha": 1e308})
    refused(LoRARequest("over", 14, over), r"lora_B has values beyond torch.float32 once cast .*: NaN or Inf")
    r2 = _copy_adapter(root / "a", tmp_path / "r2", {"r": 2})
    refused(LoRARequest("r2", 15, r2), r"has rank 8 \(lora_A \(8, \d+\)\) but the config's r is 2")
    only_q = _copy_adapter(root / "a", tmp_path / "only_q", {"target_modules": ["model.layers.0.self_attn.q_proj"]})
    refused(LoRARequest("only_q", 16, only_q), r"module 'base_model.model.model.layers.0.mlp.down_proj' has LoRA "
            r"tensors but target_modules=\['model.layers.0.self_attn.q_proj'\] does not select it")
    assert llm.engine.add_lora(LoRARequest("a2", 1, str(root / "b")))
    refused(LoRARequest("a", 1, str(root / "a")), r"lora_int_id 1 is adapter 'a2'")
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids  # the engine still serves
    with pytest.raises(ValueError, match="lora_request has 2 entries for 1 prompts"):
        llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=[None, None])
    plain = LLM(str(root / "base"), device="cpu", dtype="float32", num_kv_blocks=64)
    with pytest.raises(ValueError, match=r"lora_request 'a': this engine serves no LoRA adapters"):
        plain.generate([prompt], GREEDY, use_tqdm=False, lora_request=loras["a"])
    with pytest.raises(ValueError, match="lora_int_id must be a positive integer"):
        LoRARequest("x", 0, "p")
    with pytest.raises(ValueError, match="enable_lora is not supported with tensor_parallel_size > 1"):
        LLM(str(root / "base"), device="cpu", enable_lora=True, tensor_parallel_size=2)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_adapter_over_quantized_base_linears(method, tmp_path):
    """The delta is added to the quantized base layer's output, exactly: for each projection,
    layer(x, lora) - layer(x) is s (x A^T) B^T of the PEFT tensors; and the int8 model's logits
    move as the float model's do (up to the quantization's effect on the activations)."""
    hf = save_base(tmp_path / "base", "llama")
    merged = save_adapter(tmp_path / "base", tmp_path / "a", seed=1, r=8, alpha=16)
    model, _ = load_model(tmp_path / "base", torch.float32, CPU, quantization=method)
    manager = LoRAManager(model, max_loras=1, max_lora_rank=8, max_cpu_loras=1)
    slot = manager.activate([LoRARequest("a", 1, str(tmp_path / "a"))])[1]
    tensors = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    mapping = LoRAMapping.from_runs([(slot, 5)], CPU)
    layer = model.layers[1].self_attn.qkv_proj
    assert type(layer.quant_method).__name__ != "UnquantizedLinearMethod"
    with torch.inference_mode():
        got = layer(x, mapping) - layer(x)
    key = "base_model.model.model.layers.1.self_attn.{}_proj.lora_{}.weight"
    want = torch.cat([2.0 * (x @ tensors[key.format(p, "A")].T) @ tensors[key.format(p, "B")].T for p in "qkv"], dim=1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if method == "int8":
        ids = _ids(21, seed=4)
        with torch.inference_mode():
            moved = merged(torch.tensor([ids])).logits[0] - hf(torch.tensor([ids])).logits[0]
        ours = lora_logits(model, ids, [(slot, len(ids))]) - lora_logits(model, ids, [(-1, len(ids))])
        assert float((ours - moved).abs().max()) < 0.1 * float(moved.abs().max())


def test_padding_rows_never_touch_another_requests_row():
    """Several adapters in a step: the shorter groups' padding rows are dropped, not added to
    row 0, so an adapter whose products are not finite (0 x Inf = NaN) leaves the base
    model's row 0 and the other adapter's rows exact."""
    from kvflow.lora.punica import LoRALayerWeights

    weights = LoRALayerWeights(8, 6, [(0, 6)], max_loras=2, max_rank=2, dtype=torch.float32, device=CPU)
    g = torch.Generator().manual_seed(0)
    weights.set_slot(0, [(None, torch.randn(2, 8, generator=g), torch.randn(6, 2, generator=g))])
    weights.set_slot(1, [(None, torch.randn(2, 8, generator=g), torch.full((6, 2), float("inf")))])
    layer = torch.nn.Module()
    layer.lora_weights = weights
    x, base = torch.randn(5, 8, generator=g), torch.randn(5, 6, generator=g)
    # row 0 the base model, rows 1-3 slot 0, row 4 slot 1 (its group padded with 2 rows)
    mapping = LoRAMapping.from_runs([(-1, 1), (0, 3), (1, 1)], CPU)
    out = mapping.apply(layer, x, base.clone())
    torch.testing.assert_close(out[0], base[0], rtol=0, atol=0)
    torch.testing.assert_close(out[1:4], base[1:4] + weights.delta(0, x[1:4]))
    assert not out[4].isfinite().all()


def test_unreadable_weight_files_are_refused_by_name(llama, tmp_path):
    """A truncated safetensors file, a corrupt .bin and a .bin that holds no tensor mapping are
    the adapter's fault: a ValueError naming the adapter and the file (the server's 400), not
    the loader's own exception (which the server answered 500); the engine still serves."""
    root, _, _, _ = llama
    llm = LLM(str(root / "base"), device="cpu", dtype="float32", num_kv_blocks=64, enable_lora=True,
              max_lora_rank=8)
    prompt = _ids(5, seed=9)
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    (truncated / "adapter_config.json").write_text((root / "a" / "adapter_config.json").read_text())
    (truncated / "adapter_model.safetensors").write_bytes((root / "a" / "adapter_model.safetensors").read_bytes()[:100])
    corrupt_bin = tmp_path / "corrupt_bin"
    corrupt_bin.mkdir()
    (corrupt_bin / "adapter_config.json").write_text((root / "a" / "adapter_config.json").read_text())
    (corrupt_bin / "adapter_model.bin").write_bytes(b"not a checkpoint")
    list_bin = tmp_path / "list_bin"
    list_bin.mkdir()
    (list_bin / "adapter_config.json").write_text((root / "a" / "adapter_config.json").read_text())
    torch.save([torch.zeros(2)], str(list_bin / "adapter_model.bin"))
    for i, (folder, match) in enumerate([
            (truncated, r"LoRA adapter 'truncated': cannot read adapter_model.safetensors: "),
            (corrupt_bin, r"LoRA adapter 'corrupt_bin': cannot read adapter_model.bin: "),
            (list_bin, r"LoRA adapter 'list_bin': adapter_model.bin must hold a mapping of tensor names to tensors")]):
        with pytest.raises(ValueError, match=match):
            llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=LoRARequest(folder.name, 30 + i, str(folder)))
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.get_stats()["num_free_blocks"] == llm.get_stats()["num_total_blocks"]


def test_a_config_without_lora_alpha_scales_as_peft_does(llama, tmp_path):
    """PEFT reads a config without lora_alpha with its default, 8 (scaling 8 / r), not r
    (scaling 1; kvflow's old reading): adapter b has r 4, so the two differ."""
    from conftest import hf_greedy
    from model.hf_parity import assert_greedy_matches

    import peft
    import transformers

    root, _, _, _ = llama
    config = json.loads((root / "b" / "adapter_config.json").read_text())
    assert config["r"] == 4
    del config["lora_alpha"]
    no_alpha = _copy_adapter(root / "b", tmp_path / "no_alpha")
    (tmp_path / "no_alpha" / "adapter_config.json").write_text(json.dumps(config))
    hf = transformers.AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32)
    merged = peft.PeftModel.from_pretrained(hf, no_alpha).merge_and_unload().eval()
    llm = LLM(str(root / "base"), device="cpu", dtype="float32", block_size=4, num_kv_blocks=64, enable_lora=True,
              max_lora_rank=8)
    prompt = _ids(9, seed=4)
    (out,) = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=LoRARequest("no_alpha", 40, no_alpha))
    ref, margins = hf_greedy(merged, prompt, 8)
    assert_greedy_matches(list(out.outputs[0].token_ids), ref, margins)


def test_lora_request_takes_vllms_fields():
    """vLLM's ``LoRARequest(name, id, path, base_model_name=..., load_inplace=...,
    is_3d_lora_weight=...)``: base_model_name is carried along, the other two only at False
    (refused by name); each keyword was a TypeError."""
    lora = LoRARequest("sql", 1, "/adapters/sql", base_model_name="meta-llama/Llama-3.2-3B-Instruct")
    assert lora.base_model_name == "meta-llama/Llama-3.2-3B-Instruct" and lora.cache_key == b"lora:1:/adapters/sql"
    assert LoRARequest("sql", 1, "/adapters/sql", "base").base_model_name == "base"  # vLLM's field order
    assert LoRARequest("sql", 1, "/adapters/sql", load_inplace=False, is_3d_lora_weight=False) == LoRARequest(
        "sql", 1, "/adapters/sql")
    with pytest.raises(ValueError, match="load_inplace=True is not supported by kvflow"):
        LoRARequest("sql", 1, "/adapters/sql", load_inplace=True)
    with pytest.raises(ValueError, match="is_3d_lora_weight=True is not supported by kvflow"):
        LoRARequest("sql", 1, "/adapters/sql", is_3d_lora_weight=True)
    with pytest.raises(ValueError, match="base_model_name must be a string or None, got 3"):
        LoRARequest("sql", 1, "/adapters/sql", base_model_name=3)
