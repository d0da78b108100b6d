"""vLLM's offline API on kvflow: the vLLM-style script (``vllm_style_script.py``) runs on
``kvflow.LLM`` unchanged but for its import, and vLLM's keyword arguments are mapped,
accepted or refused as ``kvflow.entrypoints.vllm_compat`` says."""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch
import vllm_style_script

from conftest import tiny_hf_model_dir
from kvflow import LLM, SamplingParams
from kvflow.entrypoints import vllm_compat

COMMON = dict(dtype="float32", num_kv_blocks=64, block_size=4, attention_backend="torch")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny_hf_model_dir(tmp_path_factory.mktemp("compat") / "m")


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(model=str(tiny_dir), **COMMON)


def test_the_vllm_style_script_runs_on_kvflow(tiny_dir, caplog):
    with caplog.at_level(logging.INFO, logger="kvflow.entrypoints.vllm_compat"):
        out = vllm_style_script.run(str(tiny_dir), "kvflow")
    assert len(out["greedy_token_ids"]) == 6 and out["embedding_dim"] == 64
    assert out["prompt_logprobs"][0] is None
    # every logprob entry carries vLLM's rank and decoded token
    assert all(rank >= 1 and isinstance(text, str) for entry in out["logprobs"] for _, rank, text in entry.values())
    notes = caplog.text
    for name in ("trust_remote_code", "disable_log_stats", "tokenizer_mode", "runner"):
        assert f"vLLM option {name}=" in notes
    assert "gpu_memory_utilization=0.9: no effect: kv_cache_memory_bytes / num_kv_blocks is set" in notes


def test_reset_prefix_cache_drops_the_cached_prompt(llm):
    ids = list(range(3, 40))
    params = SamplingParams(temperature=0, max_tokens=2)
    first = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    cached = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    assert cached.num_cached_tokens >= 32
    assert llm.reset_prefix_cache() is True
    cold = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    assert cold.num_cached_tokens == 0
    assert cold.outputs[0].token_ids == cached.outputs[0].token_ids == first.outputs[0].token_ids
    with pytest.raises(ValueError, match="reset_running_requests"):
        llm.reset_prefix_cache(reset_running_requests=True)


def test_block_pool_reset_keeps_blocks_in_use_indexed():
    from kvflow.core.block_pool import BlockPool

    pool = BlockPool(4, enable_caching=True)
    a, b = pool.allocate(2)
    pool.publish(a, b"a")
    pool.publish(b, b"b")
    pool.free([a])
    assert pool.reset_prefix_cache() is False  # b is in use: still indexed
    assert pool.lookup(b"a") is None and pool.lookup(b"b") == b
    pool.free([b])
    assert pool.reset_prefix_cache() is True and pool.num_cached_blocks == 0 and pool.num_free_blocks == 4


def test_logprobs_are_vllm_objects_and_floats(llm):
    (out,) = llm.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=1),
                          use_tqdm=False)
    c = out.outputs[0]
    entry = c.logprobs[0][c.token_ids[0]]
    assert entry.rank == 1 and entry.logprob == float(entry) < 0 and entry.decoded_token is not None
    assert sum(e[t] for e, t in zip(c.logprobs, c.token_ids)) == pytest.approx(c.cumulative_logprob, abs=1e-5)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == 3
    # vLLM's order: the actual token first, then the top k
    assert [next(iter(e)) for e in out.prompt_logprobs[1:]] == [6, 7]
    assert all(len(e) == 2 for e in out.prompt_logprobs[1:])  # (neither is the top-1 token here)
    assert [next(iter(e)) for e in c.logprobs] == c.token_ids


@pytest.mark.parametrize("kwargs,match", [
    ({"no_such_option": 1}, r"unknown LLM option\(s\) \['no_such_option'\]"),
    ({"pipeline_parallel_size": 2}, "pipeline_parallel_size=2 is not supported"),
    ({"cpu_offload_gb": 4}, "cpu_offload_gb=4 is not supported"),
    ({"tokenizer": "/elsewhere"}, "tokenizer='/elsewhere' is not supported"),
    ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization must be a fraction in \(0, 1\]"),
    ({"gpu_memory_utilization": 1e-9, "num_kv_blocks": None}, "gpu_memory_utilization=1e-09 leaves no KV cache"),
    ({"swap_space": -1}, "swap_space must be a finite non-negative number of GiB"),
    ({"swap_space": float("inf"), "preemption_mode": "swap"}, "swap_space must be a finite"),  # (an OverflowError)
    ({"swap_space": float("nan"), "preemption_mode": "swap"}, "swap_space must be a finite"),
    ({"pooler_config": "MEAN"}, "pooler_config must be an object"),  # (a TypeError from vars())
    ({"override_pooler_config": [1]}, "override_pooler_config must be an object"),
    ({"pooler_config": {"pooling_type": "MEAN", "normalize": False}}, "only pooling_type is supported"),
    ({"pooler_config": {"pooling_type": "CLS"}}, "pooling must be 'last' or 'mean'"),
    ({"logprobs_mode": "processed_logprobs"}, "logprobs_mode='processed_logprobs' is not supported"),
])  # fmt: skip
def test_vllm_keywords_kvflow_cannot_honour_are_value_errors(tiny_dir, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(model=str(tiny_dir), **{**COMMON, **kwargs})


def test_vllm_keywords_that_map(tiny_dir):
    fields = {"dtype", "seed", "preemption_mode", "kv_cache_memory_bytes", "pooling", "swap_space_bytes"}
    t = vllm_compat.translate_llm_kwargs
    assert t("m", {"dtype": "half", "seed": None}, fields) == {"dtype": "float16", "seed": 0}
    assert t("m", {"swap_space": 2, "preemption_mode": "swap"}, fields) == {"preemption_mode": "swap",
                                                                              "swap_space_bytes": 2 * 2**30}
    assert t("m", {"swap_space": 4}, fields) == {}  # no swap preemption: nothing to size
    assert t("m", {"override_pooler_config": {"pooling_type": "MEAN"}}, fields) == {"pooling": "mean"}
    assert t("m", {"trust_remote_code": True, "revision": "main", "enable_chunked_prefill": True}, fields) == {}
    assert t("m", {"bogus": 1}, fields) == {"bogus": 1}  # left for LLM to refuse by name
    with LLM(model=str(tiny_dir), **{**COMMON, "pooler_config": {"pooling_type": "MEAN"}}) as mean:
        assert mean.engine.default_pooling == "mean"


def test_gpu_memory_utilization_sizes_the_kv_cache_from_ram(tiny_dir, monkeypatch):
    """fraction x total RAM - this process's resident memory - the weight files."""
    import psutil

    weights = sum(f.stat().st_size for f in tiny_dir.iterdir() if f.name.endswith(".safetensors"))
    rss = psutil.Process().memory_info().rss
    total = 2 * (rss + weights + 2**30)  # half of it leaves 1 GiB, however large this process has grown
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("VM", (), {"total": total, "available": total})())
    budget = vllm_compat.kv_budget_from_utilization(0.5, str(tiny_dir), "cpu")
    assert abs(budget - (total // 2 - rss - weights)) < 64 * 2**20  # (the resident set moves a little)
    args = vllm_compat.translate_llm_kwargs(str(tiny_dir), {"gpu_memory_utilization": 0.5, "device": "cpu"},
                                            {"device", "kv_cache_memory_bytes"})
    assert abs(args["kv_cache_memory_bytes"] - budget) < 64 * 2**20
    with pytest.raises(ValueError, match="leaves no KV cache memory"):
        vllm_compat.kv_budget_from_utilization(0.01, str(tiny_dir), "cpu")
    # Other processes hold most of the RAM: the budget would not fit what is free.
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("VM", (), {"total": total, "available": 2**20})())
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.5 asks for a .* more than the 0.00 GiB"):
        vllm_compat.kv_budget_from_utilization(0.5, str(tiny_dir), "cpu")


def test_offline_chat_takes_vllms_arguments(llm):
    msgs = [{"role": "user", "content": "Hi"}]
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=2)
    (plain,) = llm.chat(msgs, params, use_tqdm=False)
    assert tok.decode(plain.prompt_token_ids) == "<user>Hi\n<assistant>"
    (cont,) = llm.chat([*msgs, {"role": "assistant", "content": "Hel"}], params, use_tqdm=False,
                       add_generation_prompt=False, continue_final_message=True)
    assert tok.decode(cont.prompt_token_ids).endswith("<assistant>Hel")
    (custom,) = llm.chat(msgs, params, use_tqdm=False, chat_template="{{ messages[0]['content'] }}!{{ x }}",
                         chat_template_kwargs={"x": "y"})
    assert tok.decode(custom.prompt_token_ids) == "Hi!y"
    (parts,) = llm.chat([{"role": "user", "content": [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]}],
                        params, use_tqdm=False)
    assert tok.decode(parts.prompt_token_ids) == "<user>H\ni\n<assistant>"  # parts one per line, as vLLM
    for kwargs, match in [({"lora_request": object()}, "lora_request"),
                          ({"add_generation_prompt": True, "continue_final_message": True}, "cannot both"),
                          ({"tokenization_kwargs": {"truncation": True}}, "tokenization_kwargs")]:
        with pytest.raises(ValueError, match=match):
            llm.chat(msgs, params, use_tqdm=False, **kwargs)
    with pytest.raises(ValueError, match=r"messages\[0\].content\[0\]: content parts of type 'image_url'"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}], params)
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate({"prompt": "x", "multi_modal_data": {"image": 1}}, params)


# ---------------------------------------------------------------- vLLM's names (issue #31)
def test_vllm_prompt_types_and_unknown_prompt_keys(llm):
    from kvflow.inputs import TextPrompt, TokensPrompt

    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    ids = llm.tokenizer.encode("hello world")
    by_text, by_ids = llm.generate([TextPrompt(prompt="hello world"), TokensPrompt(prompt_token_ids=ids)], greedy,
                                   use_tqdm=False)
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids and by_text.prompt_token_ids == ids
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate(TokensPrompt(prompt_token_ids=ids, cache_salt="x"), greedy)


def test_guided_choice_grammar_and_vllms_structured_outputs(llm):
    from kvflow.sampling_params import GuidedDecodingParams, StructuredOutputsParams

    choices = ["red", "green", 'say "blue"']
    forms = [
        dict(guided_choice=choices),
        dict(structured_outputs=StructuredOutputsParams(choice=choices)),
        dict(guided_decoding=GuidedDecodingParams(choice=choices, backend="auto")),
    ]
    for seed in range(3):
        for form in forms:
            (out,) = llm.generate("x", SamplingParams(temperature=1.0, seed=seed, max_tokens=16, **form), use_tqdm=False)
            assert out.outputs[0].text in choices, form
    lark = 'start: "ab" | "cd" "e"*'
    gbnf = 'root ::= "ab" | "cd"'
    for grammar, pattern in ((lark, r"ab|cde*"), (gbnf, r"ab|cd")):
        for seed in range(3):
            params = SamplingParams(temperature=1.0, seed=seed, max_tokens=8,
                                    structured_outputs=StructuredOutputsParams(grammar=grammar))
            assert params.guided_grammar == grammar
            (out,) = llm.generate("x", params, use_tqdm=False)
            assert re.fullmatch(pattern, out.outputs[0].text), (grammar, out.outputs[0].text)
    (out,) = llm.generate("x", SamplingParams(temperature=1.0, seed=0, max_tokens=64,
                                              structured_outputs=StructuredOutputsParams(json_object=True)),
                          use_tqdm=False)
    assert out.outputs[0].finish_reason != "stop" or isinstance(json.loads(out.outputs[0].text), dict)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(guided_grammar="start: ("), "guided_grammar"),
        (dict(guided_choice=[]), "guided_choice"),
        (dict(guided_choice="red"), "guided_choice"),
        (dict(guided_choice=["a"], guided_regex="a"), "mutually exclusive"),
        (dict(structured_outputs={"regex": "a", "choice": ["a"]}), "exactly one"),
        (dict(structured_outputs={"regex": "a", "structural_tag": "{}"}), "structural_tag"),
    ],
)
def test_bad_structured_outputs_are_value_errors(llm, kwargs, match):
    with pytest.raises(ValueError, match=match):
        llm.generate("x", SamplingParams(max_tokens=4, **kwargs), use_tqdm=False)


def test_guided_decoding_params_backend_and_from_optional():
    from kvflow.sampling_params import GuidedDecodingParams

    assert GuidedDecodingParams.from_optional() is None
    assert GuidedDecodingParams.from_optional(regex="a+").regex == "a+"
    with pytest.raises(ValueError, match="backend"):
        GuidedDecodingParams(regex="a", backend="xgrammar")


def test_vllm_beam_search_params_and_llm_engine(llm):
    from kvflow.sampling_params import BeamSearchParams

    (by_params,) = llm.beam_search([{"prompt": "hello"}], BeamSearchParams(beam_width=2, max_tokens=3))
    (by_keywords,) = llm.beam_search(["hello"], beam_width=2, max_tokens=3)
    assert [s.tokens for s in by_params.sequences] == [s.token_ids for s in by_keywords.sequences]
    assert len(by_params.sequences) == 2 and by_params.sequences[0].cum_logprob <= 0
    with pytest.raises(ValueError, match="temperature"):
        BeamSearchParams(beam_width=2, max_tokens=3, temperature=0.7)
    with pytest.raises(ValueError, match="not both"):
        llm.beam_search(["hello"], BeamSearchParams(beam_width=2, max_tokens=3), beam_width=3)

    # llm.llm_engine: vLLM's add_request(request_id, prompt, params) / step() loop
    engine = llm.llm_engine
    engine.add_request("a", "hello world", SamplingParams(temperature=0.0, max_tokens=3))
    engine.add_request("b", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0.0, max_tokens=2))
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert len(finished["a"].outputs[0].token_ids) == 3 and finished["b"].prompt_token_ids == [5, 6, 7]
    assert engine.get_tokenizer() is llm.tokenizer

    # RequestOutput.metrics: an object with vLLM's fields (and still readable as the old dict)
    m = finished["a"].metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert m.time_in_queue >= 0 and m.first_token_latency >= m.time_in_queue
    assert m["finished_time"] == m.finished_time and m.get("nothing") is None


# ---------------------------------------------------------------- vLLM's other fields (s30)
def test_detokenize_false_gives_token_ids_only(llm):
    """vLLM's detokenize=False: the same tokens, no text, no decoded_token (it was a
    TypeError)."""
    ids = [5, 6, 7, 8]
    letters = llm.tokenizer.encode("abc", add_special_tokens=False)  # (so that the text is not empty)
    kwargs = dict(temperature=0.0, max_tokens=4, logprobs=1, prompt_logprobs=1, allowed_token_ids=letters)
    (text,) = llm.generate({"prompt_token_ids": ids}, SamplingParams(**kwargs), use_tqdm=False)
    (bare,) = llm.generate({"prompt_token_ids": ids}, SamplingParams(detokenize=False, **kwargs), use_tqdm=False)
    assert len(text.outputs[0].text) == 4 and bare.outputs[0].text == ""
    assert bare.outputs[0].token_ids == text.outputs[0].token_ids
    assert all(e.decoded_token is None for entry in bare.outputs[0].logprobs for e in entry.values())
    assert all(e.decoded_token is None for entry in bare.prompt_logprobs[1:] for e in entry.values())
    assert bare.outputs[0].cumulative_logprob == pytest.approx(text.outputs[0].cumulative_logprob)
    (streamed, *_) = list(llm.generate_stream({"prompt_token_ids": ids}, SamplingParams(detokenize=False, **kwargs)))
    assert streamed.outputs[0].text == ""


def test_request_outputs_have_vllms_attributes(llm):
    """RequestOutput.lora_request / encoder_prompt / encoder_prompt_token_ids /
    kv_transfer_params and CompletionOutput.lora_request, read by vLLM scripts, were
    AttributeErrors (the LoRA case: tests/lora/test_lora.py)."""
    params = SamplingParams(temperature=0.0, max_tokens=2, extra_args={"tag": "x"})
    (out,) = llm.generate("hi", params, use_tqdm=False)
    assert (out.lora_request, out.encoder_prompt, out.encoder_prompt_token_ids, out.kv_transfer_params) == (None,) * 4
    assert out.outputs[0].lora_request is None
    assert params.extra_args == {"tag": "x"}  # carried along, unchanged


def test_llm_engine_abort_request_takes_vllms_list_of_ids(llm):
    """vLLM's LLMEngine.abort_request takes a list of ids: llm.llm_engine.abort_request(["a"])
    raised TypeError ("unhashable type: 'list'"); an int id that add_request stored as "5"
    was not found (False). Both abort now, and their blocks are free at once."""
    engine = llm.llm_engine
    free = engine.get_stats()["num_free_blocks"]
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    for request_id in ("a", "b", 5):
        engine.add_request(request_id, "hello world", params)
    engine.step()
    assert engine.abort_request(["a", "b"]) is None
    assert engine.abort_request(5) is True and engine.abort_request("a") is False
    assert not engine.has_unfinished_requests() and engine.get_stats()["num_free_blocks"] == free


@pytest.mark.parametrize("method, instead", [
    ("encode", "LLM.embed gives the embeddings"), ("classify", "no classification models"),
    ("score", "no cross-encoder or scoring models"), ("reward", "no reward models"),
    ("get_metrics", "LLM.get_stats()"), ("sleep", "resident"), ("wake_up", "resident"),
])  # fmt: skip
def test_vllms_llm_methods_kvflow_lacks_are_refused_by_name(method, instead):
    """vLLM's LLM.encode / classify / score / reward / get_metrics / sleep / wake_up were
    AttributeErrors ("'LLM' object has no attribute 'classify'"): now each names itself and
    what kvflow has instead (no model is loaded: the refusal needs none)."""
    llm = LLM.__new__(LLM)
    with pytest.raises(NotImplementedError, match=rf"^LLM\.{method} \(vLLM's\) is not supported by kvflow: .*{re.escape(instead)}"):
        getattr(llm, method)(["x"])
