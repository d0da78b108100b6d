"""LLMEngine end to end on tiny random-weight models (float32, CPU).

Exactness: greedy outputs do not depend on batch composition, chunk size or preemption, and
a seeded sampled request does not depend on what else is batched with it. Bad input gets a
clear ValueError and leaves the engine serving the other requests.
"""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch

from conftest import make_engine, run_to_completion, tiny_engine, tiny_model_config
from kvflow.engine.llm_engine import LLMEngine
from kvflow.sampling_params import SamplingParams


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The tiny model is too small to gain from intra-op threads; on a shared 2-core machine
    extra OpenMP threads only spin and make each engine step far slower."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


PROMPTS = {
    "p1": [42],
    "p3": [7, 99, 3],
    "p9": [(13 * i + 5) % 128 for i in range(9)],
    "p17": [(29 * i + 11) % 128 for i in range(17)],
    "p30": [(7 * i + 100) % 128 for i in range(30)],
    "p45": [(31 * i + 1) % 128 for i in range(45)],
}
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


def generate(engine: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams = GREEDY) -> dict[str, list[int]]:
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    return run_to_completion(engine)


@functools.lru_cache(maxsize=None)
def _reference(config_name: str) -> dict[str, tuple[int, ...]]:
    config = CONFIGS[config_name]()
    return {k: tuple(generate(tiny_engine(config=config), {k: p})[k]) for k, p in PROMPTS.items()}


def reference(config_name: str = "llama") -> dict[str, list[int]]:
    """Each prompt alone on a roomy engine, greedy."""
    return {k: list(v) for k, v in _reference(config_name).items()}


CONFIGS = {
    "llama": lambda: tiny_model_config(),
    "mha_tied": lambda: tiny_model_config(num_key_value_heads=4, tie_word_embeddings=True),
}


class StepRecorder:
    """Wraps ``scheduler.schedule`` to record each step's {request_id: num_tokens}."""

    def __init__(self, engine: LLMEngine) -> None:
        self.steps: list[dict[str, int]] = []
        schedule = engine.scheduler.schedule

        def recording_schedule():
            out = schedule()
            self.steps.append(dict(out.num_scheduled_tokens))
            return out

        engine.scheduler.schedule = recording_schedule

    def mixed_steps(self) -> int:
        """Steps holding both a decode (1 token) and a prefill chunk (> 1 token)."""
        return sum(1 for s in self.steps if 1 in s.values() and any(n > 1 for n in s.values()))


def test_reference_outputs_are_full_length_and_not_degenerate():
    ref = reference()
    assert all(len(v) == MAX_TOKENS for v in ref.values())
    # Different prompts give different continuations: the comparisons below mean something.
    assert len({tuple(v) for v in ref.values()}) == len(ref)
    assert all(0 <= t < 128 for v in ref.values() for t in v)


@pytest.mark.parametrize("config_name", ["llama", "mha_tied"])
def test_prompt_alone_equals_prompt_in_mixed_batch(config_name):
    engine = tiny_engine(config=CONFIGS[config_name]())
    assert generate(engine, PROMPTS) == reference(config_name)
    assert engine.get_stats()["num_free_blocks"] == engine.get_stats()["num_total_blocks"]


def test_staggered_arrivals_mix_prefill_with_decodes():
    engine = tiny_engine(max_num_batched_tokens=16)
    rec = StepRecorder(engine)
    ref = reference()
    names = list(PROMPTS)
    outputs: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        engine.add_request(name, PROMPTS[name], GREEDY)
        for _ in range(i % 3 + 1):  # let the earlier ones reach decode
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out.outputs[0].token_ids
    outputs.update(run_to_completion(engine))
    assert outputs == ref
    assert rec.mixed_steps() > 0


@pytest.mark.parametrize("chunk", [1, 7, 16, 64, 4096])
def test_chunked_prefill_any_chunk_size(chunk):
    engine = tiny_engine(max_num_batched_tokens=chunk, max_num_seqs=8)
    rec = StepRecorder(engine)
    prompts = PROMPTS if chunk > 1 else {k: PROMPTS[k] for k in ("p1", "p9", "p30")}
    assert generate(engine, prompts) == {k: reference()[k] for k in prompts}
    assert max(sum(s.values()) for s in rec.steps) <= chunk
    longest = max(prompts, key=lambda k: len(prompts[k]))
    prefill_chunks = [s[longest] for s in rec.steps if longest in s][: -(MAX_TOKENS - 1)]
    assert sum(prefill_chunks) == len(prompts[longest])
    if chunk < len(prompts[longest]):
        assert len(prefill_chunks) > 1  # the longest prompt really was split across steps
    if chunk >= 64:
        assert max(sum(s.values()) for s in rec.steps) > 45  # several prompts in one step


@pytest.mark.parametrize(("num_blocks", "chunk"), [(14, 16), (16, 64), (14, 7), (14, 3)])
def test_preemption_does_not_change_outputs(num_blocks, chunk):
    engine = tiny_engine(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=chunk)
    assert generate(engine, PROMPTS) == reference()
    stats = engine.get_stats()
    assert stats["num_preemptions"] > 0
    assert stats["num_free_blocks"] == num_blocks
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0


def test_outputs_stream_cumulatively_and_finish_once():
    engine = tiny_engine(max_num_batched_tokens=8)
    engine.add_request("a", PROMPTS["p17"], GREEDY)
    seen = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == "a"
            assert out.prompt_token_ids == PROMPTS["p17"]
            seen.append((list(out.outputs[0].token_ids), out.finished, out.outputs[0].finish_reason))
    ref = reference()["p17"]
    assert [s[0] for s in seen] == [ref[: i + 1] for i in range(MAX_TOKENS)]
    assert [s[1] for s in seen] == [False] * (MAX_TOKENS - 1) + [True]
    assert seen[-1][2] == "length"
    assert engine.step() == []


def test_stop_token_ends_request_with_stop():
    ref = reference()["p9"]
    stop = ref[3]
    first = ref.index(stop)
    engine = tiny_engine()
    engine.add_request("a", PROMPTS["p9"], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[stop]))
    engine.add_request("b", PROMPTS["p30"], GREEDY)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0]
    assert finals["a"].token_ids == ref[: first + 1]
    assert finals["a"].finish_reason == "stop"
    assert finals["b"].token_ids == reference()["p30"]


def test_max_model_len_caps_output():
    engine = tiny_engine(max_model_len=32)
    engine.add_request("a", PROMPTS["p30"], GREEDY)
    out = run_to_completion(engine)
    assert out["a"] == reference()["p30"][:2]


@pytest.mark.parametrize(("chunk", "max_num_seqs"), [(8, 2), (12, 2), (12, 3), (5, 8), (64, 3)])
def test_parallel_samples_fork_after_chunked_prefill(chunk, max_num_seqs):
    """Regression: a leader whose prompt completed in the running loop used to have its forked
    children scheduled again in the same step (IndexError in update), and children of a
    still-prefilling leader were not counted against max_num_seqs."""
    engine = tiny_engine(max_num_batched_tokens=chunk, max_num_seqs=max_num_seqs)
    engine.add_request("L", PROMPTS["p30"], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, n=2))
    engine.add_request("X", PROMPTS["p3"], GREEDY)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = [c.token_ids for c in out.outputs]
        assert engine.scheduler.num_running <= max_num_seqs
    ref = reference()
    assert finals == {"L": [ref["p30"], ref["p30"]], "X": [ref["p3"]]}
    assert engine.get_stats()["num_free_blocks"] == engine.get_stats()["num_total_blocks"]


# ---------------------------------------------------------------------------- seeded sampling
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=12)


def test_seeded_request_same_alone_and_in_batch():
    alone = generate(tiny_engine(seed=0), {"s": PROMPTS["p9"]}, SEEDED)["s"]

    engine = tiny_engine(seed=99, max_num_batched_tokens=7)
    unseeded = SamplingParams(temperature=1.0, top_k=20, max_tokens=12)
    engine.add_request("u1", PROMPTS["p17"], unseeded)
    engine.add_request("u2", PROMPTS["p1"], unseeded)
    engine.step()
    engine.add_request("s", PROMPTS["p9"], SEEDED)
    engine.add_request("u3", PROMPTS["p30"], unseeded)
    engine.add_request("g", PROMPTS["p3"], GREEDY)
    batched = run_to_completion(engine)

    assert batched["s"] == alone
    assert batched["g"] == reference()["p3"]
    assert len(alone) == 12
    # The seed matters (so the equality above is not trivially greedy) ...
    other_seed = SamplingParams(temperature=0.8, top_p=0.9, seed=4321, max_tokens=12)
    assert generate(tiny_engine(), {"s": PROMPTS["p9"]}, other_seed)["s"] != alone
    # ... and it is not simply the greedy continuation.
    assert alone[:MAX_TOKENS] != reference()["p9"]


def test_seeded_request_survives_preemption():
    alone = generate(tiny_engine(), {"s": PROMPTS["p17"]}, SEEDED)["s"]
    engine = tiny_engine(num_blocks=12, max_num_batched_tokens=16)
    for k in ("p30", "p9", "p3"):
        engine.add_request(k, PROMPTS[k], GREEDY)
    engine.add_request("s", PROMPTS["p17"], SEEDED)
    out = run_to_completion(engine)
    assert engine.get_stats()["num_preemptions"] > 0
    assert out["s"] == alone
    assert out["p30"] == reference()["p30"]


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_seeded_parallel_samples_survive_preemption(preemption_mode):
    """n=3 seeded samples (forked, copy-on-write) give the same tokens alone and in a tight
    cache that preempts them. (With speculative decoding a seeded sample reads its generator
    once per verified draft or once per plain step, so a cache that drops drafts another
    engine verifies changes its tokens: seeds reproduce a run, not across schedules.)"""
    from conftest import make_engine, tiny_model, tiny_model_config
    from kvflow.config import CacheConfig, SchedulerConfig

    params = SamplingParams(temperature=1.0, top_p=0.95, n=3, seed=5, max_tokens=12)

    def samples(engine):
        engine.add_request("s", PROMPTS["p9"], params)
        for k in ("p30", "p17"):
            engine.add_request(k, PROMPTS[k], GREEDY)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = [o.token_ids for o in out.outputs]
        return done

    alone = samples(tiny_engine())
    config = tiny_model_config()
    tight = make_engine(model=tiny_model(config), model_config=config,
                        cache_config=CacheConfig(4, 12, torch.float32, num_cpu_blocks=64),
                        scheduler_config=SchedulerConfig(16, 8, 256, preemption_mode=preemption_mode))
    out = samples(tight)
    assert tight.get_stats()["num_preemptions"] > 0
    assert out["s"] == alone["s"] and len({tuple(t) for t in alone["s"]}) == 3


def test_swap_preempting_a_sample_copied_on_write_in_the_same_step_keeps_its_kv():
    """Under the priority policy a request already in the batch may be preempted; with swap,
    one whose shared partial block was copied on write earlier in that step (the copy is
    made after the swap-outs) must reach the host with the source's K/V, not the empty
    copy's: here "p"'s first sample is swapped out in its first decode step, right after
    copy-on-write, and its greedy tokens stay those of a run alone (they diverged)."""
    from conftest import tiny_model
    from kvflow.config import CacheConfig, SchedulerConfig

    prompt, high = [5, 17, 33, 2, 90, 41, 7, 8, 9, 10], list(range(20, 38))

    def run(num_blocks, budget):
        config = tiny_model_config()
        engine = make_engine(model=tiny_model(config), model_config=config,
                             cache_config=CacheConfig(4, num_blocks, torch.float32, num_cpu_blocks=64),
                             scheduler_config=SchedulerConfig(budget, 8, 128, policy="priority",
                                                              preemption_mode="swap"))
        engine.add_request("p", prompt, SamplingParams(temperature=0, n=2, max_tokens=6), priority=1)
        engine.step()  # "p"'s first prompt chunk; "h" arrives behind it, then it forks
        engine.add_request("h", high, SamplingParams(temperature=0, max_tokens=2), priority=0)
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: [c.token_ids for c in o.outputs] for o in engine.step() if o.finished})
        return done, engine.get_stats()

    alone, _ = run(64, 64)
    out, stats = run(5, 7)
    assert stats["num_preemptions"] >= 2 and stats["num_free_blocks"] == stats["num_total_blocks"]
    assert out == alone


def test_unseeded_sampling_follows_engine_seed():
    params = SamplingParams(temperature=1.0, max_tokens=12)
    a = generate(tiny_engine(seed=5), {"x": PROMPTS["p9"]}, params)["x"]
    b = generate(tiny_engine(seed=5), {"x": PROMPTS["p9"]}, params)["x"]
    c = generate(tiny_engine(seed=6), {"x": PROMPTS["p9"]}, params)["x"]
    assert a == b
    assert a != c


# ---------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ([], GREEDY, "empty"),
        ([1, 128, 2], GREEDY, "prompt_token_ids"),
        ([1, -1, 2], GREEDY, "prompt_token_ids"),
        ([1, 2.0, 3], GREEDY, "prompt_token_ids"),
        (list(range(32)), GREEDY, "max_model_len"),
        (list(range(40)), GREEDY, "max_model_len"),
        (list(range(10)), SamplingParams(max_tokens=20), "KV blocks"),
        ([1, True, 3], GREEDY, "prompt_token_ids"),
        ([1, 2], SamplingParams(max_tokens=4, logit_bias={128: 1.0}), "logit_bias"),
        ([1, 2], SamplingParams(max_tokens=4, logit_bias={10**20: 1.0}), "logit_bias"),
        ([1, 2], SamplingParams(max_tokens=4, logprobs=129), "logprobs"),
        ([1, 2], SamplingParams(max_tokens=4, prompt_logprobs=10**9), "prompt_logprobs"),
    ],
    ids=["empty", "id_too_big", "negative_id", "float_id", "prompt_eq_max_len", "prompt_gt_max_len", "cache_too_small",
         "bool_id", "logit_bias_past_vocab", "logit_bias_huge_id", "logprobs_past_vocab", "prompt_logprobs_huge"],
)
def test_bad_request_raises_value_error_and_engine_keeps_serving(prompt, params, match):
    # 6 blocks x 4 tokens = 24 tokens of cache; max_model_len 32.
    engine = tiny_engine(num_blocks=6, block_size=4, max_model_len=32)
    engine.add_request("ok1", PROMPTS["p3"], GREEDY)
    engine.step()
    with pytest.raises(ValueError, match=match):
        engine.add_request("bad", prompt, params)
    assert "bad" not in engine.scheduler.requests
    assert "bad" not in engine._states
    # The same id is free to use, and everyone is served correctly.
    engine.add_request("bad", PROMPTS["p9"], GREEDY)
    out = run_to_completion(engine)
    assert out == {"ok1": reference()["p3"], "bad": reference()["p9"]}
    assert engine.get_stats()["num_free_blocks"] == 6


def test_top_k_above_the_vocabulary_samples_as_top_k_off():
    """top_k = 2**63 used to crash the sampler's tensor build (int64 overflow) and with it the
    engine; it now keeps every token, exactly as top_k = 0."""
    outs = {}
    for top_k in (0, 128, 2**63, 10**20):
        engine = tiny_engine(seed=3)
        engine.add_request("x", PROMPTS["p9"], SamplingParams(temperature=1.0, top_k=top_k, seed=11, max_tokens=8))
        outs[top_k] = run_to_completion(engine)["x"]
    assert outs[2**63] == outs[10**20] == outs[128] == outs[0] and len(outs[0]) == 8


def test_request_that_just_fits_the_cache_is_accepted():
    engine = tiny_engine(num_blocks=6, block_size=4, max_model_len=64)
    engine.add_request("a", PROMPTS["p9"], SamplingParams(temperature=0, max_tokens=15))  # 24 tokens = 6 blocks
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request("b", PROMPTS["p9"], SamplingParams(temperature=0, max_tokens=16))  # 25 tokens
    out = run_to_completion(engine)
    assert len(out["a"]) == 15 and out["a"][:MAX_TOKENS] == reference()["p9"]


def test_context_limit_bounds_the_cache_check():
    # prompt + max_tokens exceeds the cache, but max_model_len caps the request at 24 tokens.
    engine = tiny_engine(num_blocks=6, block_size=4, max_model_len=24)
    engine.add_request("a", PROMPTS["p17"], SamplingParams(temperature=0, max_tokens=100))
    out = run_to_completion(engine)
    assert len(out["a"]) == 24 - 17


def test_duplicate_request_id_raises_and_keeps_the_original():
    engine = tiny_engine()
    engine.add_request("a", PROMPTS["p9"], GREEDY)
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("a", PROMPTS["p30"], GREEDY)
    engine.step()
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("a", PROMPTS["p3"], GREEDY)
    assert run_to_completion(engine) == {"a": reference()["p9"]}
    # Once finished, the id can be reused.
    engine.add_request("a", PROMPTS["p3"], GREEDY)
    assert run_to_completion(engine) == {"a": reference()["p3"]}


# ---------------------------------------------------------------------------- the collector
class _Cycle:
    """An object in a reference cycle: only the cyclic garbage collector can free it."""

    def __init__(self) -> None:
        self.me = self


def test_the_heap_is_frozen_while_requests_are_in_flight(monkeypatch):
    """KVFLOW_GC_FREEZE (conftest.py turns it off for the other tests): an engine holds the
    heap frozen from its first request to its last one's end (finished or aborted), so the
    collections of its steps skip the startup heap; garbage made meanwhile is still
    collected, and what the freeze held is collected once it ends. Off, the collector is
    left alone."""
    import gc
    import weakref

    try:
        monkeypatch.setenv("KVFLOW_GC_FREEZE", "1")
        engine = tiny_engine()
        assert gc.get_freeze_count() == 0  # idle: nothing frozen
        before = _Cycle()
        before_ref = weakref.ref(before)
        engine.add_request("a", PROMPTS["p9"], GREEDY)
        engine.add_request("b", PROMPTS["p17"], GREEDY)
        assert gc.get_freeze_count() > 0
        del before  # frozen garbage: waits for the end of the busy period
        during = _Cycle()
        during_ref = weakref.ref(during)
        del during  # made while frozen: collected as usual
        gc.collect()
        assert before_ref() is not None and during_ref() is None
        engine.step()
        assert engine.abort_request("a") is True
        assert gc.get_freeze_count() > 0  # "b" still runs
        assert run_to_completion(engine) == {"b": reference()["p17"]}
        assert gc.get_freeze_count() == 0
        gc.collect()
        assert before_ref() is None
        engine.add_request("c", PROMPTS["p3"], GREEDY)  # a second busy period
        assert gc.get_freeze_count() > 0
        assert engine.abort_request("c") is True
        assert gc.get_freeze_count() == 0
        engine.add_request("d", PROMPTS["p3"], GREEDY)
        engine.shutdown()  # lets go too
        assert gc.get_freeze_count() == 0
        monkeypatch.setenv("KVFLOW_GC_FREEZE", "0")
        engine = tiny_engine()
        engine.add_request("a", PROMPTS["p3"], GREEDY)
        assert gc.get_freeze_count() == 0
        assert run_to_completion(engine) == {"a": reference()["p3"]}
    finally:
        import kvflow.utils

        while kvflow.utils._freeze_holds:
            kvflow.utils.release_gc_freeze()
        gc.unfreeze()


# ---------------------------------------------------------------------------- abort
def test_abort_frees_blocks_at_once():
    engine = tiny_engine(num_blocks=32, block_size=4, max_num_seqs=1)
    engine.add_request("a", PROMPTS["p17"], GREEDY)
    engine.add_request("b", PROMPTS["p30"], GREEDY)  # waits (max_num_seqs=1)
    engine.step()
    engine.step()
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == 32 - 5  # 18 tokens computed -> 5 blocks
    assert stats["num_running"] == 1 and stats["num_waiting"] == 1
    assert engine.abort_request("a") is True
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == 32
    assert stats["kv_cache_usage"] == 0.0
    assert stats["num_running"] == 0 and stats["num_waiting"] == 1
    assert engine.abort_request("a") is False
    assert engine.abort_request("missing") is False
    outs = run_to_completion(engine)
    assert outs == {"b": reference()["p30"]}  # no further output for "a"
    assert engine.get_stats()["num_free_blocks"] == 32


def test_abort_preempted_request():
    engine = tiny_engine(num_blocks=12, block_size=4, max_num_batched_tokens=16)
    names = ("p30", "p17", "p9", "p3")
    for k in names:
        engine.add_request(k, PROMPTS[k], GREEDY)
    outputs: dict[str, list[int]] = {}
    preempted = None
    for _ in range(200):
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        victims = [r for r in engine.scheduler.waiting if r.num_preemptions > 0]
        if victims:
            preempted = victims[0].request_id
            break
    assert preempted is not None
    assert engine.abort_request(preempted) is True
    assert preempted not in engine.scheduler.requests
    outputs.update(run_to_completion(engine))
    assert outputs == {k: reference()[k] for k in names if k != preempted}
    assert engine.get_stats()["num_free_blocks"] == 12


# ---------------------------------------------------------------------------- fault isolation
MARK = [127, 127]  # the first tokens of the request the injected faults aim at
MARKED = MARK + [3, 4, 5, 6]
FAULT_PROMPTS = {k: PROMPTS[k] for k in ("p3", "p9", "p45")}  # none starts with MARK


def _is_marked(request) -> bool:
    return request.prompt_token_ids[:2] == MARK


def _run_with_fault(engine: LLMEngine, extra: dict[str, list[int]] | None = None,
                    params: SamplingParams = GREEDY) -> dict[str, object]:
    """Add FAULT_PROMPTS (+ ``extra``) and the marked request together; step to the end.

    Returns: request_id -> token ids, or the ``RequestFailure`` of a failed request."""
    for request_id, prompt in {**FAULT_PROMPTS, **(extra or {})}.items():
        engine.add_request(request_id, prompt, params)
    engine.add_request("marked", MARKED, params)
    done: dict[str, object] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.request_id not in done, "a request finished twice"
                done[out.request_id] = out.error if out.error is not None else out.outputs[0].token_ids
                if out.error is not None:
                    assert all(c.finish_reason == "error" for c in out.outputs)
    return done


def _assert_only_marked_failed(engine: LLMEngine, done: dict[str, object], invalid_request: bool) -> None:
    failure = done.pop("marked")
    assert failure is not None and not isinstance(failure, list), failure
    assert failure.is_invalid_request is invalid_request and "injected" in failure.message, failure
    assert done == {k: reference()[k] for k in FAULT_PROMPTS}
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"] and stats["num_running"] == stats["num_waiting"] == 0
    assert not engine._states and not engine._sample_owner and not engine.scheduler.requests
    # and the engine keeps serving
    assert generate(engine, {"later": PROMPTS["p17"]}) == {"later": reference()["p17"]}


def test_fault_while_preparing_one_request_fails_it_alone(monkeypatch):
    from kvflow.worker.model_runner import ModelRunner

    original = ModelRunner.prepare_inputs

    def prepare(self, out):
        if any(_is_marked(r) for r in map(self.requests.get, out.scheduled_req_ids)):
            raise RuntimeError("injected prepare fault")
        return original(self, out)

    monkeypatch.setattr(ModelRunner, "prepare_inputs", prepare)
    engine = tiny_engine()
    _assert_only_marked_failed(engine, _run_with_fault(engine), invalid_request=False)


@pytest.mark.parametrize("chunk", [64, 8])
def test_fault_in_the_forward_of_a_batch_fails_only_its_culprit(monkeypatch, chunk):
    """The marked request's batch gets token ids outside the embedding, so the whole batch's
    forward raises (IndexError); re-run one request at a time, only the marked one fails,
    with its prefill chunked over several steps too (its earlier chunks' blocks were written
    by good steps). The others' outputs are exactly the reference."""
    from kvflow.worker.model_runner import ModelRunner

    original = ModelRunner.prepare_inputs

    def prepare(self, out):
        inputs = original(self, out)
        if any(_is_marked(r) for r in map(self.requests.get, out.scheduled_req_ids)) and any(
            r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] >= 5 for r in map(self.requests.get, out.scheduled_req_ids)
            if _is_marked(r)
        ):
            inputs.input_ids = inputs.input_ids + 10_000  # injected: out of the embedding's range
        return inputs

    monkeypatch.setattr(ModelRunner, "prepare_inputs", prepare)
    engine = tiny_engine(max_num_batched_tokens=chunk)
    done = _run_with_fault(engine)
    failure = done["marked"]
    assert "IndexError" in failure.message or "index" in failure.message.lower(), failure
    done["marked"] = type(failure)(failure.message + " (injected)", failure.is_invalid_request)
    _assert_only_marked_failed(engine, done, invalid_request=False)
    # Nothing of the failed prefill was published to the prefix cache: the same prompt,
    # now without the fault, gives the output of a fresh engine.
    monkeypatch.setattr(ModelRunner, "prepare_inputs", original)
    fresh = generate(tiny_engine(), {"m": MARKED})
    assert generate(engine, {"m": MARKED}) == fresh


def test_fault_while_sampling_one_row_fails_it_alone_and_keeps_seeded_rows_exact(monkeypatch):
    """The batched sampler draws its noise and then raises (a ValueError: the request's own
    fault). Each row is then sampled alone after the generators are restored, so a seeded
    request batched with the culprit samples exactly what it samples alone."""
    from kvflow.sample.sampler import Sampler

    original = Sampler.__call__
    marked: list[torch.Generator] = []

    def call(self, logits, st):
        tokens = original(self, logits, st)
        if any(g is m for g in st.generators for m in marked):
            raise ValueError("injected sampling fault")
        return tokens

    monkeypatch.setattr(Sampler, "__call__", call)
    params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=7)
    alone = generate(tiny_engine(), {"s": PROMPTS["p17"]}, params)["s"]
    engine = tiny_engine()
    engine.add_request("s", PROMPTS["p17"], params)
    engine.add_request("marked", MARKED, params)
    marked.append(engine.engine_core.samples("marked")[0].generator)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done["marked"].error.is_invalid_request and "injected" in done["marked"].error.message
    assert done["s"].error is None and done["s"].outputs[0].token_ids == alone
    assert engine.get_stats()["num_free_blocks"] == 64


def test_fault_while_advancing_one_request_fails_it_alone(monkeypatch):
    from kvflow.request import Request

    original = Request.append_output_token

    def append(self, token_id):
        original(self, token_id)
        if _is_marked(self) and self.num_output_tokens == 3:
            raise RuntimeError("injected update fault")  # half-way: the token is already appended

    monkeypatch.setattr(Request, "append_output_token", append)
    engine = tiny_engine()
    _assert_only_marked_failed(engine, _run_with_fault(engine), invalid_request=False)


def test_fault_while_detokenizing_one_request_fails_it_alone(monkeypatch):
    from kvflow.engine.output_processor import OutputProcessor

    original = OutputProcessor._append

    def append_output(self, state, sample, out):
        if _is_marked(state) and len(sample.token_ids) >= 1:  # at its second token
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return original(self, state, sample, out)

    monkeypatch.setattr(OutputProcessor, "_append", append_output)
    engine = tiny_engine()
    _assert_only_marked_failed(engine, _run_with_fault(engine), invalid_request=True)  # UnicodeDecodeError is a ValueError


def test_parallel_samples_of_a_failing_request_all_fail_and_free_their_blocks(monkeypatch):
    from kvflow.worker.model_runner import ModelRunner

    original = ModelRunner.prepare_inputs

    def prepare(self, out):
        if any(_is_marked(r) and r.num_output_tokens >= 2 for r in map(self.requests.get, out.scheduled_req_ids)):
            raise RuntimeError("injected prepare fault")
        return original(self, out)

    monkeypatch.setattr(ModelRunner, "prepare_inputs", prepare)
    engine = tiny_engine()
    engine.add_request("p9", PROMPTS["p9"], GREEDY)
    engine.add_request("marked", MARKED, SamplingParams(temperature=1.0, n=3, seed=1, max_tokens=MAX_TOKENS))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done["marked"].error is not None and len(done["marked"].outputs) == 3
    assert done["p9"].outputs[0].token_ids == reference()["p9"]
    assert engine.get_stats()["num_free_blocks"] == 64 and not engine.scheduler.requests


def test_fault_while_drafting_one_request_fails_it_alone(monkeypatch):
    from kvflow.config import CacheConfig, SchedulerConfig
    from kvflow.spec_decode.ngram import NgramProposer
    from conftest import tiny_model

    original = NgramProposer.propose

    def propose(self, requests):
        if any(_is_marked(r) and r.num_output_tokens >= 2 for r in requests):
            raise RuntimeError("injected drafting fault")
        return original(self, requests)

    monkeypatch.setattr(NgramProposer, "propose", propose)
    config = tiny_model_config()

    def engine_with_ngram():
        return make_engine(
            model=tiny_model(config), model_config=config,
            cache_config=CacheConfig(block_size=4, num_blocks=64, dtype=torch.float32),
            scheduler_config=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=16, max_model_len=256),
            tokenizer=None, device=torch.device("cpu"), proposer=NgramProposer(3, 1, 3, 256),
        )

    engine = engine_with_ngram()
    _assert_only_marked_failed(engine, _run_with_fault(engine), invalid_request=False)


def test_a_lone_failing_request_is_failed_and_the_engine_goes_on(monkeypatch):
    """A step whose only request fails: the probe forward succeeds, so the fault is the
    request's, not the engine's."""
    from kvflow.worker.model_runner import ModelRunner

    original = ModelRunner.prepare_inputs

    def prepare(self, out):
        if any(_is_marked(r) for r in map(self.requests.get, out.scheduled_req_ids)):
            raise RuntimeError("injected prepare fault")
        return original(self, out)

    monkeypatch.setattr(ModelRunner, "prepare_inputs", prepare)
    engine = tiny_engine()
    engine.add_request("marked", MARKED, GREEDY)
    (out,) = engine.step()
    assert out.finished and out.error is not None and "injected" in out.error.message
    assert generate(engine, {"next": PROMPTS["p9"]}) == {"next": reference()["p9"]}


def test_a_fault_in_every_forward_stops_the_engine(monkeypatch):
    """Every request fails alone and so does the probe: the engine is unusable, and says so."""
    from kvflow.model.llama import LlamaForCausalLM

    def forward(self, *args, **kwargs):
        raise RuntimeError("injected: the device is gone")

    engine = tiny_engine()
    for k, p in FAULT_PROMPTS.items():
        engine.add_request(k, p, GREEDY)
    monkeypatch.setattr(LlamaForCausalLM, "forward", forward)
    with pytest.raises(RuntimeError, match="engine is unusable") as exc:
        engine.step()
    assert "device is gone" in str(exc.value.__cause__)


# ---------------------------------------------------------------------------- generation defaults
def test_offline_defaults_come_from_the_model_folders_generation_config(tmp_path):
    """LLM.generate without sampling_params uses the folder's generation_config.json (here
    greedy, top_k 3, 5 new tokens), as vLLM; without the file, SamplingParams()."""
    from conftest import tiny_hf_model_dir
    from kvflow import LLM

    folder = tiny_hf_model_dir(tmp_path / "m", {"temperature": 0.0, "top_k": 3, "max_new_tokens": 5})
    llm = LLM(model=str(folder), dtype="float32", num_kv_blocks=32)
    assert llm.engine.generation_defaults == {"temperature": 0.0, "top_k": 3, "max_tokens": 5}
    default = llm.generate("Hello", use_tqdm=False)[0].outputs[0].token_ids
    explicit = llm.generate("Hello", SamplingParams(temperature=0.0, top_k=3, max_tokens=5), use_tqdm=False)
    assert len(default) == 5 and default == explicit[0].outputs[0].token_ids
    (folder / "generation_config.json").unlink()
    assert LLM(model=str(folder), dtype="float32", num_kv_blocks=32).get_default_sampling_params() == SamplingParams()


def test_the_generation_configs_other_end_tokens_stop_a_request_as_eos_does(tmp_path):
    """generation_config.json's ``eos_token_id`` list (Llama 3's ``<|eot_id|>``, Gemma's
    ``<end_of_turn>``; a GGUF's ``eot_token_id``, which the conversion writes there) ended
    nothing: only the tokenizer's EOS did, so a chat ran past the end of its turn. Each ends a
    request as vLLM and llama.cpp end it, unless it ignores EOS."""
    from conftest import tiny_hf_model_dir
    from kvflow import LLM

    folder = tiny_hf_model_dir(tmp_path / "m", {"eos_token_id": [256, 7]})
    llm = LLM(model=str(folder), dtype="float32", num_kv_blocks=32)
    assert llm.engine.extra_eos_token_ids == [7]
    forced = {"temperature": 0.0, "max_tokens": 6, "logit_bias": {7: 100.0}}
    out = llm.generate("Hello", SamplingParams(**forced), use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == ([7], "stop", 7)
    out = llm.generate("Hello", SamplingParams(**forced, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason) == ([7] * 6, "length")
    params = SamplingParams(**forced, stop_token_ids=[9])
    llm.generate("Hello", params, use_tqdm=False)
    assert params.stop_token_ids == [9]  # the caller's params are left as they were


def test_the_tokenizer_loads_on_a_thread_while_the_model_builds_and_its_error_is_raised(tmp_path, monkeypatch):
    """from_engine_args loads the tokenizer on its own thread (kvflow-tokenizer) while the
    worker builds the model, and the engine holds that tokenizer; a tokenizer that fails to
    load fails the engine's construction with its own error."""
    import threading

    from conftest import tiny_hf_model_dir
    from kvflow.engine import llm_engine
    from kvflow.engine.arg_utils import EngineArgs

    folder = tiny_hf_model_dir(tmp_path / "m")
    loaded = {}
    real = llm_engine.load_tokenizer

    def load(model_dir):
        loaded["thread"] = threading.current_thread().name
        loaded["tokenizer"] = real(model_dir)
        return loaded["tokenizer"]

    def trim():  # the parse's freed heap handed back, on the same thread, after the load
        loaded["trimmed on"] = threading.current_thread().name if "tokenizer" in loaded else "before the load"
        return True

    monkeypatch.setattr(llm_engine, "load_tokenizer", load)
    monkeypatch.setattr(llm_engine, "release_free_heap", trim)
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(folder), dtype="float32", num_kv_blocks=32))
    assert loaded["thread"].startswith("kvflow-tokenizer") and engine.tokenizer is loaded["tokenizer"]
    assert loaded["trimmed on"] == loaded["thread"]
    assert engine.output_processor.tokenizer is loaded["tokenizer"]

    def broken(model_dir):
        raise OSError("injected: no usable tokenizer files")

    monkeypatch.setattr(llm_engine, "load_tokenizer", broken)
    with pytest.raises(OSError, match="injected"):
        LLMEngine.from_engine_args(EngineArgs(model=str(folder), dtype="float32", num_kv_blocks=32))


# ------------------------------------------------------------- quantized KV cache exactness
def _kernels_or_skip():
    from kvflow.attention.cpu_attention import cpu_kernel_available
    from kvflow.layers.invariant_linear import invariant_linear_available

    if not (cpu_kernel_available() and invariant_linear_available()):
        pytest.skip("the batch-invariant path needs kvflow's C++ kernels (a C++ compiler)")


def _quantized_engine(kv_dtype, block_size, max_num_batched_tokens, config, dtype=torch.float32, backend="cpu"):
    from conftest import tiny_model
    from kvflow.config import CacheConfig, SchedulerConfig

    from kvflow.model.loader import pack_for_cpu

    model = tiny_model(config).to(dtype)
    pack_for_cpu(model)  # bfloat16: oneDNN-packed linears, as the engine loads them
    return make_engine(
        model=model, model_config=config,
        cache_config=CacheConfig(block_size, 160, kv_dtype, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_batched_tokens, 8, 256),
        tokenizer=None, device=torch.device("cpu"), attention_backend=backend,
    )  # fmt: skip


def _greedy_with_logprobs(engine: LLMEngine, prompts: dict[str, list[int]]) -> dict[str, tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=0, ignore_eos=True)
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                done[out.request_id] = (c.token_ids, [lp[t] for lp, t in zip(c.logprobs, c.token_ids)])
    return done


# A Qwen2-like variant too: its k_proj bias makes store_kv subtract the key offset
# (LlamaAttention._key_offset) on every path.
QUANT_CONFIGS = {"llama": lambda: tiny_model_config(), "qkv_bias": lambda: tiny_model_config(attention_bias=True)}


@pytest.mark.parametrize("config_name", sorted(QUANT_CONFIGS))
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
def test_quantized_kv_output_independent_of_chunking_and_prefix_hits(kv_dtype, block_size, config_name):
    """With an int8 / fp8 KV cache a request's greedy tokens and logprobs are the same,
    bit for bit, whatever its prefill chunk size (max_num_batched_tokens 3, 7, 64), whether
    its prompt blocks came from the prefix cache (fully, or a shared prefix only), and
    whether another request shared its steps. The "cpu" backend is batch-invariant by
    construction (every token's K/V and logits are computed the same way), so the
    tolerance is 0; before it, stored codes depended on the batch's shapes through
    last-bit float differences."""
    _kernels_or_skip()
    config = QUANT_CONFIGS[config_name]()
    prompt = PROMPTS["p45"]
    sibling = prompt[:21] + PROMPTS["p17"]  # shares 21 tokens (5 blocks of 4, 1 of 16, 21 of 1)
    ref = _greedy_with_logprobs(_quantized_engine(kv_dtype, block_size, 64, config), {"a": prompt})["a"]
    ref_sibling = _greedy_with_logprobs(_quantized_engine(kv_dtype, block_size, 64, config), {"s": sibling})["s"]
    assert len(set(ref[0])) > 3  # not degenerate
    for chunk in (3, 7, 64):
        engine = _quantized_engine(kv_dtype, block_size, chunk, config)
        assert _greedy_with_logprobs(engine, {"miss": prompt})["miss"] == ref, chunk
        assert _greedy_with_logprobs(engine, {"hit": prompt})["hit"] == ref, chunk  # all full blocks cached
        hits = engine.get_stats()["prefix_cache_hits"]
        assert hits == (len(prompt) - 1) // block_size * block_size
        assert _greedy_with_logprobs(engine, {"s": sibling})["s"] == ref_sibling, chunk  # a partial hit
        assert engine.get_stats()["prefix_cache_hits"] > hits
        both = _greedy_with_logprobs(_quantized_engine(kv_dtype, block_size, chunk, config), {"a": prompt, "s": sibling})
        assert both == {"a": ref, "s": ref_sibling}, chunk


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
def test_quantized_kv_bfloat16_model_independent_of_chunking_and_prefix_hits(kv_dtype):
    """The same for a bfloat16 model (its oneDNN-packed linears become batch-invariant too)."""
    _kernels_or_skip()
    config = tiny_model_config()
    prompt = PROMPTS["p45"]
    ref = _greedy_with_logprobs(_quantized_engine(kv_dtype, 4, 64, config, torch.bfloat16), {"a": prompt})["a"]
    for chunk in (3, 7):
        engine = _quantized_engine(kv_dtype, 4, chunk, config, torch.bfloat16)
        assert _greedy_with_logprobs(engine, {"miss": prompt})["miss"] == ref, chunk
        assert _greedy_with_logprobs(engine, {"hit": prompt})["hit"] == ref, chunk


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="no triton")
def test_quantized_kv_triton_backend_independent_of_chunking_and_prefix_hits():
    """The Triton backend (in Triton's CPU interpreter here) over an int8 cache, with the
    CPU linears made batch-invariant: chunk sizes and a prefix hit give the same output."""
    from kvflow.layers.invariant_linear import invariant_linear_available
    from kvflow.attention.triton_attention import interpreter_enabled

    if not (interpreter_enabled() and invariant_linear_available()):
        pytest.skip("needs Triton's CPU interpreter and the batch-invariant linear kernel")
    config = tiny_model_config()
    prompt = PROMPTS["p30"]
    ref = _greedy_with_logprobs(_quantized_engine(torch.int8, 4, 64, config, backend="triton"), {"a": prompt})["a"]
    engine = _quantized_engine(torch.int8, 4, 3, config, backend="triton")
    assert _greedy_with_logprobs(engine, {"miss": prompt})["miss"] == ref
    assert _greedy_with_logprobs(engine, {"hit": prompt})["hit"] == ref


def test_the_probe_never_takes_the_runner_state_of_a_live_request():
    """The one-token probe runs through the runner's per-request state like any request; a
    user request that happens to be called "kvflow-probe" keeps its own state (and output)."""
    engine = tiny_engine()
    engine.add_request("kvflow-probe", PROMPTS["p9"], GREEDY)
    engine.step()  # prefilled: the runner holds it
    engine._probe()
    assert engine.model_runner.requests["kvflow-probe"].prompt_token_ids == PROMPTS["p9"]
    assert run_to_completion(engine) == {"kvflow-probe": reference()["p9"]}


# ------------------------------------------------------------------ vLLM's logprob shapes
def test_logprobs_are_vllm_logprob_objects():
    """Generated and prompt logprobs are ``Logprob`` objects with vLLM's rank and decoded
    token, and ``prompt_logprobs`` starts with None (vLLM's shape)."""
    from conftest import TINY_TEXT_VOCAB, prefill_logits, tiny_tokenizer
    from kvflow.logprobs import Logprob

    tok = tiny_tokenizer()
    engine = tiny_engine(tokenizer=tok, config=tiny_model_config(vocab_size=TINY_TEXT_VOCAB))
    prompt = tok.encode("Hello, paged world")
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    engine.add_request("a", prompt, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out if out.finished else final
    generated = final.outputs[0].token_ids
    ref = torch.log_softmax(prefill_logits(engine.model_runner.model, prompt + generated, chunk=64), dim=-1)

    def check(entry, row, actual, top):
        assert actual in entry and len(entry) <= top + 1
        for t, lp in entry.items():
            assert type(lp) is Logprob and lp.decoded_token == tok.decode([t])
            assert lp.logprob == pytest.approx(ref[row, t].item(), abs=1e-5)
            assert lp.rank == int((ref[row] >= ref[row, t]).sum())
        assert set(ref[row].topk(top).indices.tolist()) <= set(entry)

    assert len(final.prompt_logprobs) == len(prompt) and final.prompt_logprobs[0] is None
    for p in range(1, len(prompt)):
        check(final.prompt_logprobs[p], p - 1, prompt[p], 2)
    logprobs = final.outputs[0].logprobs
    assert len(logprobs) == len(generated)
    for i, t in enumerate(generated):
        check(logprobs[i], len(prompt) - 1 + i, t, 3)
        assert logprobs[i][t].rank == 1  # greedy
    assert final.outputs[0].cumulative_logprob == pytest.approx(sum(lp[t] for lp, t in zip(logprobs, generated)))


def test_priority_policy_runs_the_lowest_priority_value_first_under_load():
    """One request at a time (max_num_seqs=1): queued together, they finish in priority
    order (lower first; ties by arrival), not in arrival order; fcfs keeps arrival order."""

    def finish_order(policy: str, priorities: dict[str, int]) -> list[str]:
        engine = tiny_engine(max_num_seqs=1, scheduling_policy=policy)
        for i, (request_id, prio) in enumerate(priorities.items()):
            engine.add_request(request_id, [(7 * i + 1) % 128] * 5, SamplingParams(temperature=0, max_tokens=3,
                                                                              ignore_eos=True), priority=prio)
        order = []
        while engine.has_unfinished_requests():
            order += [o.request_id for o in engine.step() if o.finished]
        return order

    assert finish_order("priority", {"a": 5, "b": 0, "c": -1, "d": 0}) == ["c", "b", "d", "a"]
    assert finish_order("fcfs", {"a": 0, "b": 0, "c": 0, "d": 0}) == ["a", "b", "c", "d"]


def test_a_kernel_built_in_the_background_is_switched_to_between_steps_only(monkeypatch):
    """With ``KVFLOW_CPU_KERNEL_BUILD=background`` the engine starts the missing C++ kernels'
    builds and serves on the PyTorch paths meanwhile. A build that finishes in the middle of
    a step (here a fake RMSNorm kernel whose build is released from inside the forward) is
    not used by the rest of that step; every RMSNorm of the next step runs it."""
    import threading

    import torch.nn.functional as F

    import kvflow.layers.norm as norm
    from kvflow import ops
    from kvflow.ops.build import CppKernel

    monkeypatch.setenv("KVFLOW_CPU_KERNEL_BUILD", "background")
    monkeypatch.delenv("KVFLOW_CPU_KERNELS", raising=False)
    monkeypatch.delenv("KVFLOW_CPU_NORM", raising=False)
    calls, release = [], threading.Event()

    class FakeNormModule:
        def rms_norm(self, x, w, eps):
            calls.append(x.shape)
            return F.rms_norm(x, w.shape, w, eps)

        def add_rms_norm(self, x, residual, w, eps):  # a layer's second norm, the residual add fused in
            calls.append(x.shape)
            s = residual + x
            return s, F.rms_norm(s, w.shape, w, eps)

    def slow_build():
        assert release.wait(30)
        return FakeNormModule()

    fake = CppKernel("kvflow_test_fake_norm", ops.RMS_NORM.source_path, "KVFLOW_CPU_NORM", "fake RMSNorm kernel")
    monkeypatch.setattr(fake, "is_built", lambda: False)
    monkeypatch.setattr(fake, "_build", slow_build)
    monkeypatch.setattr(fake, "_compile_in_subprocess", lambda: None)
    monkeypatch.setattr(norm, "_EXTENSION", fake)
    monkeypatch.setattr(ops, "RMS_NORM", fake)
    for name in ("PAGED_ATTENTION", "ROTARY", "ACTIVATION"):  # no real compiler runs in this test
        off = CppKernel(f"kvflow_test_off_{name}", ops.RMS_NORM.source_path, "KVFLOW_CPU_NORM", name)
        monkeypatch.setattr(off, "disabled", lambda: True)
        monkeypatch.setattr(ops, name, off)

    engine = tiny_engine()
    assert engine.kernel_builds == [fake] and fake.pending()
    model = engine.model_runner.model
    norms = [m for m in model.modules() if isinstance(m, norm.RMSNorm)]

    def finish_build_mid_step(module, args):
        if not release.is_set():
            release.set()
            assert fake._background.wait(30)  # built now, in the middle of this forward

    hook = norms[0].register_forward_pre_hook(finish_build_mid_step)
    engine.add_request("a", [1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    engine.step()
    assert release.is_set() and calls == []  # the whole first step ran PyTorch's RMSNorm
    hook.remove()
    engine.step()
    assert len(calls) == len(norms)  # the next step ran the kernel for every norm
    assert engine.kernel_builds == [] and not fake.pending()


# ---------------------------------------------------------------------------- CPU thread governor
def test_the_thread_governor_runs_between_steps_and_a_change_keeps_the_output(monkeypatch):
    """The governor (kvflow.cpu_threads) is asked once per step, before the step's forward,
    and its count is applied on the stepping thread: here another process takes a core
    during steps 1-3 (a fake clock of one second per step), so the forwards run on 2, 2, 1,
    1, 1, 1 (two quiet intervals to go back up), then 2 threads; the greedy tokens are those
    of a fixed count."""
    from kvflow.cpu_threads import ThreadGovernor

    prompts = {k: PROMPTS[k] for k in ("p9", "p30", "p45")}
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = generate(tiny_engine(), prompts, params)
    clock = {"now": 0.0, "busy": 0.0}
    engine = tiny_engine()
    engine.thread_governor = ThreadGovernor(2, cpus={0, 1}, read_busy=lambda: clock["busy"], read_self=lambda: 0.0,
                                            clock=lambda: clock["now"])
    real_execute = engine.model_runner.execute
    seen_threads: list[int] = []

    def execute(sched_out):
        step = len(seen_threads)
        seen_threads.append(torch.get_num_threads())
        clock["now"] += 1.0
        clock["busy"] += 1.0 if 1 <= step <= 3 else 0.0
        return real_execute(sched_out)

    monkeypatch.setattr(engine.model_runner, "execute", execute)
    try:
        assert generate(engine, prompts, params) == expected
    finally:
        torch.set_num_threads(1)
    assert seen_threads[:8] == [2, 2, 1, 1, 1, 1, 2, 2]
    stats = engine.get_stats()
    assert stats["num_cpu_threads"] == 2 and stats["num_cpu_thread_changes"] == 2 and stats["cpu_other_load"] == 0


def test_engines_on_the_cpu_share_one_governor_unless_switched_off(monkeypatch):
    import kvflow.cpu_threads as cpu_threads

    monkeypatch.setattr(cpu_threads, "_governor", [])
    monkeypatch.setenv("KVFLOW_CPU_ADAPTIVE_THREADS", "1")
    for name in cpu_threads.BINDING_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    engine = tiny_engine()
    governor = engine.thread_governor
    assert governor is not None and governor.max_threads == torch.get_num_threads()
    assert "num_cpu_threads" in engine.get_stats()
    assert tiny_engine().thread_governor is governor
    monkeypatch.setenv("KVFLOW_CPU_ADAPTIVE_THREADS", "0")
    off = tiny_engine()
    assert off.thread_governor is None and "num_cpu_threads" not in off.get_stats()


def test_max_tokens_none_runs_until_the_context_is_full():
    engine = tiny_engine(max_model_len=32)
    prompt = [1, 2, 3, 4, 5]
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True, n=2)
    engine.add_request("a", prompt, params)
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    assert [len(o.token_ids) for o in outs["a"].outputs] == [32 - len(prompt)] * 2
    assert {o.finish_reason for o in outs["a"].outputs} == {"length"}
    assert params.max_tokens is None  # the caller's params are not changed
    # the server's path: prepare off the engine thread, then add the prepared request
    prepared = engine.prepare_request(list(range(1, 11)), params)
    assert prepared.params.max_tokens == 22 and params.max_tokens is None
    engine.add_request("b", prepared.prompt_token_ids, prepared.params, prepared=prepared)
    assert len(run_to_completion(engine)["b"]) == 22


def test_truncate_prompt_tokens_runs_the_prompts_last_tokens():
    """vLLM's ``truncate_prompt_tokens``: the request runs (and reports) its prompt's last k
    tokens; -1 keeps what leaves room for one token; k past max_model_len is refused."""
    from kvflow.pooling_params import PoolingParams

    engine = tiny_engine(max_model_len=64, num_blocks=64)
    prompt = [(7 * i) % 97 + 3 for i in range(100)]  # longer than the context
    greedy = dict(temperature=0.0, max_tokens=5, ignore_eos=True)
    engine.add_request("cut", prompt, SamplingParams(**greedy, truncate_prompt_tokens=12))
    engine.add_request("ref", prompt[-12:], SamplingParams(**greedy))
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    assert outputs["cut"].prompt_token_ids == prompt[-12:]
    assert outputs["cut"].outputs[0].token_ids == outputs["ref"].outputs[0].token_ids
    engine.add_request("all", prompt, SamplingParams(temperature=0.0, max_tokens=1, truncate_prompt_tokens=-1))
    engine.add_request("emb", prompt, PoolingParams(truncate_prompt_tokens=-1))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    assert len(done["all"].prompt_token_ids) == 63 and len(done["emb"].prompt_token_ids) == 64
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        engine.add_request("long", prompt, SamplingParams(truncate_prompt_tokens=65))
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("whole", prompt, SamplingParams(max_tokens=1))
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_request_whose_settings_mask_every_token_fails_alone(temperature):
    """allowed_token_ids holding only a stop token that min_tokens masks leaves no token to
    sample: the request fails alone with a ValueError naming both fields (it used to get
    token 0, which allowed_token_ids forbids, greedily, or another forbidden token sampled);
    the request beside it is untouched and every block comes back."""
    engine = tiny_engine()
    alone = generate(tiny_engine(), {"ok": PROMPTS["p9"]})["ok"]
    dead = SamplingParams(temperature=temperature, max_tokens=4, allowed_token_ids=[5], stop_token_ids=[5], min_tokens=2)
    engine.add_request("dead", [3, 4, 5, 6], dead)
    engine.add_request("ok", PROMPTS["p9"], GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done["dead"].error is not None and done["dead"].outputs[0].finish_reason == "error"
    assert done["dead"].error.is_invalid_request and "allowed_token_ids, min_tokens" in done["dead"].error.message
    assert list(done["dead"].outputs[0].token_ids) == []
    assert list(done["ok"].outputs[0].token_ids) == list(alone)
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
