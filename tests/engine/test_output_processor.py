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
