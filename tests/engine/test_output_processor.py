"""The output processor (``kvflow/engine/output_processor.py``) and its joint with the core.

DELTA outputs hold only what is new and add up to the CUMULATIVE output; FINAL_ONLY gives
one output; ``cumulative_logprob`` is the running sum; a stop string found in the text ends
the request in the core (state gone, blocks free) within the same ``step``; the prefix-cache
hits of a request come back as ``num_cached_tokens``.
"""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_TEXT_VOCAB, tiny_engine, tiny_model_config, tiny_tokenizer
from kvflow.engine.async_engine import merge_delta
from kvflow.outputs import CompletionOutput, RequestOutput, RequestOutputKind
from kvflow.sampling_params import SamplingParams

PROMPT = list(b"The quick brown fox jumps")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def text_engine(tokenizer, **kwargs):
    return tiny_engine(config=tiny_model_config(vocab_size=TINY_TEXT_VOCAB), tokenizer=tokenizer, **kwargs)


def run(engine, kinds: dict[str, RequestOutputKind], params: SamplingParams) -> dict[str, list[RequestOutput]]:
    for request_id, kind in kinds.items():
        engine.add_request(request_id, PROMPT, params, output_kind=kind)
    seen: dict[str, list[RequestOutput]] = {k: [] for k in kinds}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    return seen


def test_delta_outputs_add_up_to_the_cumulative_output_and_final_only_gives_one(tokenizer):
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)
    seen = run(text_engine(tokenizer), {"c": RequestOutputKind.CUMULATIVE, "d": RequestOutputKind.DELTA,
                                        "f": RequestOutputKind.FINAL_ONLY}, params)
    full = seen["c"][-1].outputs[0]
    deltas = [o.outputs[0] for o in seen["d"]]
    assert len(full.token_ids) == 12 and full.finish_reason == "length"
    assert [len(d.token_ids) for d in deltas] == [1] * 12  # only the new token each step
    assert [t for d in deltas for t in d.token_ids] == full.token_ids
    assert "".join(d.text for d in deltas) == full.text == tokenizer.decode(full.token_ids)
    assert [e for d in deltas for e in d.logprobs] == full.logprobs
    assert [d.finish_reason for d in deltas] == [None] * 11 + ["length"]
    assert [o.finished for o in seen["d"]] == [False] * 11 + [True]
    # the running sum, kept as tokens arrive, is the sum of the sampled tokens' logprobs
    assert deltas[-1].cumulative_logprob == full.cumulative_logprob
    assert full.cumulative_logprob == pytest.approx(sum(e[t] for e, t in zip(full.logprobs, full.token_ids)))
    assert [o.outputs[0].cumulative_logprob for o in seen["c"]] == [d.cumulative_logprob for d in deltas]
    ((final,),) = [seen["f"]]
    got = final.outputs[0]
    assert final.finished and (got.text, got.token_ids, got.finish_reason) == (full.text, full.token_ids, "length")
    assert len(got.logprobs) == 12 and got.cumulative_logprob == pytest.approx(full.cumulative_logprob, abs=1e-4)


def test_a_stop_string_ends_the_request_in_the_core_in_the_same_step(tokenizer):
    free = run(text_engine(tokenizer), {"a": RequestOutputKind.CUMULATIVE},
               SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))["a"][-1].outputs[0]
    stop = free.text[5:8]
    assert len(stop) == 3 and free.text.find(stop) >= 4
    engine = text_engine(tokenizer)
    engine.add_request("a", PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop]),
                       output_kind=RequestOutputKind.DELTA)
    engine.add_request("b", PROMPT[:9], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    texts = []
    while True:
        outs = {o.request_id: o for o in engine.step()}
        if "a" in outs:
            texts.append(outs["a"].outputs[0].text)
            if outs["a"].finished:
                break
    final = outs["a"].outputs[0]
    assert (final.finish_reason, final.stop_reason) == ("stop", stop)
    assert "".join(texts) == free.text[: free.text.find(stop)]
    # finished in the core before step() returned: no state left, blocks back, the runner
    # told to drop it at the next step; "b" runs on
    assert "a" not in engine.scheduler.requests
    assert [r.request_id for r in engine.scheduler.running] == ["b"]
    held = sum(len(ids) for ids in engine.scheduler.requests["b"].block_ids)
    assert engine.get_stats()["num_free_blocks"] == engine.get_stats()["num_total_blocks"] - held
    engine.step()
    assert "a" in engine.last_scheduler_output.finished_req_ids and "a" not in engine.model_runner.requests
    # its core tokens were cut at the stop too: the cache holds nothing past it
    n = sum(len(tokenizer.encode(t, add_special_tokens=False)) for t in texts)
    assert n <= len(free.token_ids)


@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA])
def test_the_token_that_stops_the_output_is_not_text_unless_asked(tokenizer, kind):
    """vLLM's rule: an output ended by a ``stop_token_ids`` entry or EOS keeps the token's id
    but not its text, unless ``include_stop_str_in_output``."""
    steps = run(text_engine(tokenizer), {"a": RequestOutputKind.CUMULATIVE},
                SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, skip_special_tokens=False))["a"]
    free = steps[-1].outputs[0]

    def text_of(n):  # the text of the first n tokens, as an output cut there by max_tokens has it
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, skip_special_tokens=False)
        return run(text_engine(tokenizer), {"a": RequestOutputKind.CUMULATIVE}, params)["a"][-1].outputs[0].text

    # a token that adds text (not a part of a character), the first of its id
    k = next(i for i, t in enumerate(free.token_ids) if i >= 2 and t not in free.token_ids[:i]
             and steps[i].outputs[0].text != steps[i - 1].outputs[0].text)
    stop_id = free.token_ids[k]
    assert text_of(k + 1) != text_of(k)
    for include in (False, True):
        engine = text_engine(tokenizer)
        # EOS: the model's EOS made to stop at the same place, its text kept visible
        engine.eos_token_id = engine.output_processor.eos_token_id = stop_id
        for request_id, params in (("id", dict(stop_token_ids=[stop_id], ignore_eos=True)), ("eos", {})):
            engine.add_request(request_id, PROMPT, SamplingParams(temperature=0, max_tokens=16, skip_special_tokens=False,
                                                                  include_stop_str_in_output=include, **params),
                               output_kind=kind)
        seen = {"id": [], "eos": []}
        while engine.has_unfinished_requests():
            for out in engine.step():
                seen[out.request_id].append(out.outputs[0])
        for outs in seen.values():
            token_ids = [t for o in outs for t in o.token_ids] if kind is RequestOutputKind.DELTA else outs[-1].token_ids
            text = "".join(o.text for o in outs) if kind is RequestOutputKind.DELTA else outs[-1].text
            assert token_ids == free.token_ids[: k + 1] and outs[-1].finish_reason == "stop"
            assert text == text_of(k + 1 if include else k), (include, text)


def test_num_cached_tokens_are_the_prefix_cache_hits_at_first_schedule(tokenizer):
    engine = text_engine(tokenizer, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    (first,) = [o for o in run(engine, {"a": RequestOutputKind.FINAL_ONLY}, params)["a"]]
    (second,) = [o for o in run(engine, {"b": RequestOutputKind.FINAL_ONLY}, params)["b"]]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == (len(PROMPT) - 1) // 4 * 4 == 24
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_merged_deltas_are_one_delta():
    def delta(text, ids, finished=False):
        return RequestOutput("r", None, [1], [CompletionOutput(0, text, ids, "stop" if finished else None,
                                                               logprobs=[{i: -1.0} for i in ids],
                                                               cumulative_logprob=-float(len(ids)))], finished)

    merged = merge_delta(delta("ab", [1, 2]), delta("c", [3], finished=True))
    (c,) = merged.outputs
    assert (c.text, c.token_ids, c.finish_reason, merged.finished) == ("abc", [1, 2, 3], "stop", True)
    assert c.logprobs == [{1: -1.0}, {2: -1.0}, {3: -1.0}] and c.cumulative_logprob == -1.0


def test_output_kind_is_checked(tokenizer):
    engine = text_engine(tokenizer)
    with pytest.raises(ValueError, match="output_kind"):
        engine.add_request("a", PROMPT, SamplingParams(max_tokens=2), output_kind="delta")
    assert not engine.has_unfinished_requests()


def test_the_sampling_params_output_kind_applies_unless_the_caller_names_one(tokenizer):
    """vLLM's ``SamplingParams.output_kind``: the request's kind where ``add_request`` is not
    given one; a kind given to ``add_request`` wins; a bad one is refused by name."""
    engine = text_engine(tokenizer)
    delta = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    final = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    engine.add_request("d", PROMPT, delta)
    engine.add_request("f", PROMPT, final)
    engine.add_request("c", PROMPT, final, output_kind=RequestOutputKind.CUMULATIVE)
    seen: dict[str, list[RequestOutput]] = {"d": [], "f": [], "c": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    assert [len(o.outputs[0].token_ids) for o in seen["d"]] == [1, 1, 1]
    assert [len(o.outputs[0].token_ids) for o in seen["f"]] == [3]
    assert [len(o.outputs[0].token_ids) for o in seen["c"]] == [1, 2, 3]
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="delta")
    bad = SamplingParams(max_tokens=2)
    bad.output_kind = 1
    with pytest.raises(ValueError, match="output_kind"):
        engine.add_request("x", PROMPT, bad)
    assert not engine.has_unfinished_requests()


def test_vllm_style_llm_engine_honours_the_params_output_kind(tokenizer):
    """``LLM.llm_engine.add_request`` has vLLM's signature (no output kind): the params' kind."""
    from kvflow.entrypoints.llm import VLLMStyleEngine

    engine = text_engine(tokenizer)
    llm = type("FakeLLM", (), {"engine": engine, "_to_token_ids": staticmethod(lambda p: (list(p), None))})()
    vllm_engine = VLLMStyleEngine(llm)
    vllm_engine.add_request("d", PROMPT, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True,
                                                        output_kind=RequestOutputKind.DELTA))
    seen = []
    while vllm_engine.has_unfinished_requests():
        seen += [len(o.outputs[0].token_ids) for o in vllm_engine.step()]
    assert seen == [1, 1, 1]


def test_outputs_come_in_first_sample_order_and_a_failed_request_gives_none(tokenizer, monkeypatch):
    """A request of one sample has its output made as soon as its token is appended, one of
    n samples after all of them: the step's outputs still come in the order of each request's
    first sample, and a request one of whose samples failed gives no output."""
    from kvflow.engine.core import EngineCoreOutput, EngineCoreOutputs
    from kvflow.engine.output_processor import OutputProcessor

    processor = OutputProcessor(tokenizer)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    processor.add_request("a", ["a#0", "a#1"], None, PROMPT, params, 0.0)
    processor.add_request("b", ["b"], None, PROMPT, params, 0.0)
    processor.add_request("c", ["c"], None, PROMPT, params, 0.0)
    processor.add_request("d", ["d#0", "d#1"], None, PROMPT, params, 0.0)

    def step(order: list[str], finish: str | None = None):
        core = EngineCoreOutputs()
        core.outputs = [EngineCoreOutput(s, [ord("x")], finish_reason=finish) for s in order]
        return processor.process_outputs(core, 1.0)

    outputs, stops, failures = step(["b", "a#0", "c", "d#0", "a#1", "d#1"])
    assert [o.request_id for o in outputs] == ["b", "a", "c", "d"] and not stops and not failures
    assert [len(o.outputs) for o in outputs] == [1, 2, 1, 2]
    assert all(c.token_ids == [ord("x")] for o in outputs for c in o.outputs)

    original = OutputProcessor._append

    def append(self, state, sample, out):
        if out.request_id == "a#1":
            raise ValueError("bad token")
        return original(self, state, sample, out)

    monkeypatch.setattr(OutputProcessor, "_append", append)
    outputs, _, failures = step(["a#0", "b", "a#1", "c"])
    assert [o.request_id for o in outputs] == ["b", "c"] and list(failures) == ["a"]
    monkeypatch.undo()
    outputs, _, failures = step(["d#0", "d#1", "c"], finish="length")
    assert [(o.request_id, o.finished) for o in outputs] == [("d", True), ("c", True)] and not failures
    assert set(processor.request_states) == {"a", "b"}  # the finished ones are no longer tracked


# ------------------------------------------------------------------ prompt logprobs
PLP = SamplingParams(temperature=0, max_tokens=6, logprobs=1, prompt_logprobs=2, ignore_eos=True)
PLP_PROMPTS = [PROMPT, list(b"Pack my box with five dozen liquor jugs"), list(b"Sphinx of black quartz"), list(b"Hi")]


def _plp(entries):
    """Prompt logprobs as plain values (a ``Logprob`` is a float: its rank and text too)."""
    if entries is None:
        return None
    return [None if e is None else {t: (float(lp), lp.rank, lp.decoded_token) for t, lp in e.items()} for e in entries]


def _steps(engine):
    while engine.has_unfinished_requests():
        yield from engine.step()


def _runs(tokenizer, prompts, params, **engine_kwargs):
    """The prompts on one engine per output kind (the same batches step by step: the kind
    changes no schedule): {kind: {request id: its outputs}}, and the FINAL_ONLY engine's stats."""
    got = {}
    for kind in RequestOutputKind:
        engine = text_engine(tokenizer, **engine_kwargs)
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params, output_kind=kind)
        seen: dict[str, list[RequestOutput]] = {}
        for out in _steps(engine):
            seen.setdefault(out.request_id, []).append(out)
        got[kind] = seen
    return got, engine.get_stats()


@pytest.fixture(scope="module")
def alone(tokenizer):
    """Each prompt alone on a roomy engine (one prefill chunk): its prompt logprobs."""
    got = {}
    for prompt in PLP_PROMPTS:
        engine = text_engine(tokenizer)
        engine.add_request("r", prompt, PLP, output_kind=RequestOutputKind.FINAL_ONLY)
        (final,) = [o for o in _steps(engine) if o.finished]
        got[bytes(prompt)] = _plp(final.prompt_logprobs)
    return got


def _check_prompt_logprobs(got, prompts, alone):
    """Every request: the prompt logprobs come with its first output (its first token's),
    on every CUMULATIVE output, on the first DELTA output only, and are the FINAL_ONLY
    output's (the list the finished output alone used to carry), exactly; a recomputation
    after a preemption does not change them."""
    for i, prompt in enumerate(prompts):
        (f,) = got[RequestOutputKind.FINAL_ONLY][str(i)]
        c, d = got[RequestOutputKind.CUMULATIVE][str(i)], got[RequestOutputKind.DELTA][str(i)]
        want = _plp(f.prompt_logprobs)
        assert len(want) == len(prompt) and want[0] is None and all(want[1:])
        assert len(c[0].outputs[0].token_ids) == len(d[0].outputs[0].token_ids) >= 1 and not c[0].finished
        assert _plp(c[0].prompt_logprobs) == _plp(d[0].prompt_logprobs) == want
        assert [_plp(o.prompt_logprobs) for o in d if o.prompt_logprobs is not None] == [want]
        assert all(_plp(o.prompt_logprobs) == want for o in c)
        for entry, ref in zip(want[1:], alone[bytes(prompt)][1:]):  # (other batches: float noise)
            assert entry.keys() == ref.keys()
            assert [v[0] for v in entry.values()] == pytest.approx([v[0] for v in ref.values()], abs=1e-5)


@pytest.mark.parametrize("chunk", [5, 7, 64])
def test_prompt_logprobs_come_with_the_first_output_after_the_prompt(tokenizer, alone, chunk):
    """As vLLM's output processor: once the prompt's last chunk is computed, its first
    token's output carries the prompt logprobs (the finished output only, before)."""
    got, _ = _runs(tokenizer, PLP_PROMPTS, PLP, max_num_batched_tokens=chunk)
    _check_prompt_logprobs(got, PLP_PROMPTS, alone)


@pytest.mark.parametrize(("num_blocks", "chunk"), [(14, 16), (14, 5)])
def test_prompt_logprobs_with_preemption_are_given_once(tokenizer, alone, num_blocks, chunk):
    """A request preempted after its prompt recomputes it: the prompt logprobs already given
    stay (a DELTA output gives them once), whatever the recomputation's float noise."""
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=1, prompt_logprobs=2, ignore_eos=True)
    got, stats = _runs(tokenizer, PLP_PROMPTS, params, num_blocks=num_blocks, block_size=4,
                       max_num_batched_tokens=chunk)
    assert stats["num_preemptions"] > 0
    _check_prompt_logprobs(got, PLP_PROMPTS, alone)


def test_a_recomputed_prompt_does_not_change_the_logprobs_given():
    """The processor fed by hand: the prompt logprobs of a prompt computed in two chunks come
    with the first token's output (every CUMULATIVE output, the first DELTA one); a
    recomputation after a preemption, with other values, changes nothing."""
    from kvflow.engine.core import EngineCoreOutput, EngineCoreOutputs
    from kvflow.engine.output_processor import OutputProcessor
    from kvflow.logprobs import Logprob

    processor = OutputProcessor(None)
    params = SamplingParams(temperature=0, max_tokens=9, prompt_logprobs=0, ignore_eos=True)
    processor.add_request("d", ["d"], None, [1, 2, 3], params, 0.0, RequestOutputKind.DELTA)
    processor.add_request("c", ["c"], None, [1, 2, 3], params, 0.0, RequestOutputKind.CUMULATIVE)
    a, b = {2: Logprob(-1.0, 1)}, {3: Logprob(-2.0, 1)}

    def step(positions: dict[int, dict], token: int | None = None):
        core = EngineCoreOutputs()
        core.prompt_logprobs = {r: dict(positions) for r in ("d", "c")} if positions else {}
        core.outputs = [EngineCoreOutput(r, [token]) for r in ("d", "c")] if token is not None else []
        outputs, _, _ = processor.process_outputs(core, 1.0)
        return {o.request_id: o.prompt_logprobs for o in outputs}

    assert step({1: a}) == {}  # the first chunk: no token, no output
    assert step({2: b}, 7) == {"d": [None, a, b], "c": [None, a, b]}  # the last chunk, the first token
    assert step({}, 8) == {"d": None, "c": [None, a, b]}
    # preempted, recomputed with other values
    assert step({1: {2: Logprob(-9.0, 5)}}) == {} and step({2: {3: Logprob(-2.0000002, 1)}}) == {}
    assert step({}, 9) == {"d": None, "c": [None, a, b]}


@pytest.mark.parametrize("chunk", [7, 64])
def test_prompt_logprobs_of_parallel_samples_come_with_the_first_output(tokenizer, alone, chunk):
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=1, prompt_logprobs=2, ignore_eos=True, n=3)
    got, _ = _runs(tokenizer, PLP_PROMPTS[:2], params, max_num_batched_tokens=chunk)
    _check_prompt_logprobs(got, PLP_PROMPTS[:2], alone)
    (f,) = got[RequestOutputKind.FINAL_ONLY]["0"]
    assert len(f.outputs) == 3 and len({tuple(s.token_ids) for s in f.outputs}) == 1


def test_prompt_logprobs_of_a_one_token_prompt_come_first_too(tokenizer):
    engine = text_engine(tokenizer)
    engine.add_request("a", [72], PLP, output_kind=RequestOutputKind.DELTA)
    outs = list(_steps(engine))
    assert outs[0].prompt_logprobs == [None] and all(o.prompt_logprobs is None for o in outs[1:])


def test_prompt_logprobs_next_to_a_cached_prefix_are_the_same(tokenizer, alone):
    """A prompt whose blocks are in the prefix cache still has every position computed (no
    hits for a prompt_logprobs request): the same first output as the prompt alone."""
    engine = text_engine(tokenizer, block_size=4)
    run(engine, {"warm": RequestOutputKind.FINAL_ONLY}, SamplingParams(temperature=0, max_tokens=3))
    first = run(engine, {"a": RequestOutputKind.DELTA}, PLP)["a"]
    again = run(engine, {"b": RequestOutputKind.DELTA}, PLP)["b"]
    assert _plp(first[0].prompt_logprobs) == _plp(again[0].prompt_logprobs) == alone[bytes(PROMPT)]
    assert first[0].num_cached_tokens == again[0].num_cached_tokens == 0
    assert all(o.prompt_logprobs is None for o in first[1:] + again[1:])


def test_merged_deltas_keep_the_prompt_logprobs_of_the_first():
    plp = [None, {2: -0.5}]
    first = RequestOutput("r", None, [1, 2], [CompletionOutput(0, "a", [3])], False, prompt_logprobs=plp)
    merged = merge_delta(first, RequestOutput("r", None, [1, 2], [CompletionOutput(0, "b", [4], "length")], True))
    assert merged.prompt_logprobs is plp and merged.outputs[0].token_ids == [3, 4]
