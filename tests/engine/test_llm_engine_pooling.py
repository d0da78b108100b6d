"""Embedding (pooling) requests in ``LLMEngine`` on tiny random models (float32, CPU).

An embedding request is scheduled like a prompt (chunked prefill, batched with generation
requests), never samples, finishes when its prompt is computed and frees its blocks (which
stay published to the prefix cache). Its vector does not depend on chunking, batching,
preemption or prefix-cache hits (last pooling) beyond float32 rounding; mean pooling never
takes hits.
"""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_engine
from kvflow.engine.llm_engine import LLMEngine
from kvflow.outputs import EmbeddingRequestOutput
from kvflow.pooling_params import PoolingParams
from kvflow.sampling_params import SamplingParams

PROMPT = [(11 * i + 3) % 128 for i in range(30)]
OTHER = [(5 * i + 7) % 128 for i in range(13)]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def _step_all(engine: LLMEngine) -> dict[str, object]:
    done: dict[str, object] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.request_id not in done, "finished twice"
                done[out.request_id] = out
    return done


def _embed(engine: LLMEngine, prompts: dict[str, list[int]], params: PoolingParams) -> dict[str, torch.Tensor]:
    for request_id, ids in prompts.items():
        engine.add_request(request_id, ids, params)
    done = _step_all(engine)
    _assert_idle(engine)
    return {k: torch.tensor(done[k].outputs.embedding) for k in prompts}


def _assert_idle(engine: LLMEngine) -> None:
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
    assert not engine._states and not engine._sample_owner and not engine.scheduler.requests


def _direct(engine: LLMEngine, ids: list[int], pooling: str, normalize: bool = True) -> torch.Tensor:
    """The pooled final hidden states of ``ids`` from the model itself, in one chunk."""
    from conftest import prefill_logits

    model = engine.model_runner.model
    hidden = []
    original = model.compute_logits
    model.compute_logits = lambda h: hidden.append(h) or original(h)  # prefill_logits calls it once
    try:
        prefill_logits(model, ids, chunk=len(ids))
    finally:
        del model.compute_logits
    states = hidden[0].float()
    vector = states[-1] if pooling == "last" else states.mean(dim=0)
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("normalize", [True, False])
def test_embedding_equals_the_pooled_hidden_states(pooling, normalize):
    engine = tiny_engine()
    got = _embed(engine, {"a": PROMPT}, PoolingParams(pooling_type=pooling, normalize=normalize))["a"]
    want = _direct(engine, PROMPT, pooling, normalize)
    assert got.shape == (64,)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    if normalize:
        assert got.norm().item() == pytest.approx(1.0, abs=1e-5)
    else:
        assert abs(got.norm().item() - 1.0) > 1e-3


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_chunked_prefill_gives_the_same_vector(pooling, chunk):
    params = PoolingParams(pooling_type=pooling)
    whole = _embed(tiny_engine(max_num_batched_tokens=64), {"a": PROMPT}, params)["a"]
    chunked = _embed(tiny_engine(max_num_batched_tokens=chunk), {"a": PROMPT}, params)["a"]
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=0)


def test_mixed_batch_of_generation_and_embedding_requests():
    """Generation requests keep their exact greedy tokens; embeddings their vectors; they
    ran in the same steps."""
    alone = tiny_engine(max_num_batched_tokens=16)
    alone.add_request("g1", OTHER, GREEDY)
    alone.add_request("g2", PROMPT[:9], GREEDY)
    ref_tokens = {k: v.outputs[0].token_ids for k, v in _step_all(alone).items()}
    ref_vectors = {"e_last": _embed(tiny_engine(), {"x": PROMPT}, PoolingParams(pooling_type="last"))["x"],
                   "e_mean": _embed(tiny_engine(), {"x": PROMPT[3:]}, PoolingParams(pooling_type="mean"))["x"]}

    engine = tiny_engine(max_num_batched_tokens=16)
    mixed_steps = 0
    original = engine.model_runner.execute

    def execute(out):
        nonlocal mixed_steps
        kinds = {engine.scheduler.requests[rid].pooling_params is not None for rid in out.scheduled_req_ids}
        mixed_steps += kinds == {True, False}
        return original(out)

    engine.model_runner.execute = execute
    engine.add_request("g1", OTHER, GREEDY)
    engine.add_request("e_last", PROMPT, PoolingParams(pooling_type="last"))
    engine.add_request("g2", PROMPT[:9], GREEDY)
    engine.add_request("e_mean", PROMPT[3:], PoolingParams(pooling_type="mean"))
    done = _step_all(engine)
    _assert_idle(engine)
    assert mixed_steps >= 2
    for k in ("g1", "g2"):
        assert done[k].outputs[0].token_ids == ref_tokens[k]
    for k in ("e_last", "e_mean"):
        out = done[k]
        assert isinstance(out, EmbeddingRequestOutput) and out.finished and out.error is None
        assert out.prompt_token_ids == (PROMPT if k == "e_last" else PROMPT[3:])
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), ref_vectors[k], atol=1e-5, rtol=0)


def test_mean_pooling_takes_no_prefix_hits_and_last_pooling_does():
    engine = tiny_engine()
    reference = {p: _embed(tiny_engine(enable_prefix_caching=False), {"x": PROMPT}, PoolingParams(pooling_type=p))["x"]
                 for p in ("last", "mean")}
    engine.add_request("warm", PROMPT, GREEDY)  # publishes PROMPT's full blocks
    _step_all(engine)
    hits = engine.get_stats()["prefix_cache_hits"]
    engine.add_request("mean", PROMPT, PoolingParams(pooling_type="mean"))
    (mean,) = _step_all(engine).values()
    assert engine.get_stats()["prefix_cache_hits"] == hits and mean.num_cached_tokens == 0
    engine.add_request("last", PROMPT, PoolingParams(pooling_type="last"))
    (last,) = _step_all(engine).values()
    assert last.num_cached_tokens == 28 and engine.get_stats()["prefix_cache_hits"] == hits + 28  # 7 blocks of 4
    torch.testing.assert_close(torch.tensor(mean.outputs.embedding), reference["mean"], atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.tensor(last.outputs.embedding), reference["last"], atol=1e-5, rtol=0)
    _assert_idle(engine)


def test_an_embeddings_blocks_are_published_for_later_generation():
    engine = tiny_engine()
    _embed(engine, {"e": PROMPT}, PoolingParams(pooling_type="mean"))
    hits = engine.get_stats()["prefix_cache_hits"]
    engine.add_request("g", PROMPT + [1, 2], GREEDY)
    (out,) = _step_all(engine).values()
    assert engine.get_stats()["prefix_cache_hits"] == hits + 28
    fresh = tiny_engine(enable_prefix_caching=False)
    fresh.add_request("g", PROMPT + [1, 2], GREEDY)
    assert out.outputs[0].token_ids == next(iter(_step_all(fresh).values())).outputs[0].token_ids


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_preempted_embedding_keeps_its_vector(pooling):
    """A small cache: a decoding request grows and preempts the (later admitted) chunked
    embedding, which is recomputed from its first token; its vector is unchanged."""
    params = PoolingParams(pooling_type=pooling)
    reference = _embed(tiny_engine(), {"e": PROMPT}, params)["e"]
    engine = tiny_engine(num_blocks=10, max_num_batched_tokens=5)
    engine.add_request("g", OTHER[:4], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    engine.add_request("e", PROMPT[:24], params)  # 6 blocks
    engine.add_request("e2", PROMPT, params)
    done = _step_all(engine)
    assert engine.get_stats()["num_preemptions"] > 0
    assert len(done["g"].outputs[0].token_ids) == 30
    torch.testing.assert_close(torch.tensor(done["e2"].outputs.embedding), reference, atol=1e-5, rtol=0)
    _assert_idle(engine)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embedding_preempted_by_swap_keeps_its_vector(pooling):
    """Swap preemption keeps the computed tokens' K/V (on the host) but the runner drops its
    state of the request; the request comes back as new-request data carrying mean pooling's
    running sum, so its vector is unchanged."""
    from conftest import make_engine, tiny_model, tiny_model_config

    from kvflow.config import CacheConfig, SchedulerConfig

    params = PoolingParams(pooling_type=pooling)
    reference = _embed(tiny_engine(), {"e": PROMPT}, params)["e"]
    config = tiny_model_config()
    engine = make_engine(tiny_model(config), config, CacheConfig(4, 10, torch.float32, True, 32),
                         SchedulerConfig(5, 16, 256, preemption_mode="swap"))
    engine.add_request("g", OTHER[:4], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    engine.add_request("e", PROMPT[:24], params)
    engine.add_request("e2", PROMPT, params)
    done = _step_all(engine)
    assert engine.get_stats()["num_preemptions"] > 0
    assert len(done["g"].outputs[0].token_ids) == 30
    torch.testing.assert_close(torch.tensor(done["e2"].outputs.embedding), reference, atol=1e-5, rtol=0)
    _assert_idle(engine)


def test_a_batch_rerun_after_a_fault_does_not_add_a_chunk_twice():
    """The LM head raises once in a step that holds a middle chunk of a mean-pooled prompt:
    the runner re-runs the batch one request at a time; the chunk's hidden states are summed
    once (the running sum is kept only after the step succeeded)."""
    reference = _embed(tiny_engine(max_num_batched_tokens=8), {"e": PROMPT}, PoolingParams(pooling_type="mean"))["e"]
    engine = tiny_engine(max_num_batched_tokens=8)
    model = engine.model_runner.model
    original = model.compute_logits
    calls = 0

    def compute_logits(hidden):
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("injected LM head fault")
        return original(hidden)

    model.compute_logits = compute_logits
    engine.add_request("g", [5], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    engine.add_request("e", PROMPT, PoolingParams(pooling_type="mean"))
    done = _step_all(engine)
    assert calls > 2 and done["g"].error is None and done["e"].error is None
    torch.testing.assert_close(torch.tensor(done["e"].outputs.embedding), reference, atol=1e-5, rtol=0)
    _assert_idle(engine)


def test_a_failing_embedding_fails_alone(monkeypatch):
    from kvflow.worker.model_runner import ModelRunner

    original = ModelRunner._pool

    def pool(hidden, rows, result):
        if any(r.request_id == "bad" for r, _, _ in rows):
            raise RuntimeError("injected pooling fault")
        return original(hidden, rows, result)

    monkeypatch.setattr(ModelRunner, "_pool", staticmethod(pool))
    engine = tiny_engine()
    engine.add_request("g", OTHER, GREEDY)
    engine.add_request("bad", PROMPT, PoolingParams())
    engine.add_request("ok", OTHER, PoolingParams())
    done = _step_all(engine)
    assert isinstance(done["bad"], EmbeddingRequestOutput) and "injected" in done["bad"].error.message
    assert done["bad"].outputs.embedding == [] and done["ok"].error is None and done["g"].error is None
    _assert_idle(engine)


@pytest.mark.parametrize(
    "prompt,params,match",
    [
        ([], PoolingParams(), "prompt"),
        ([1, 128], PoolingParams(), "prompt_token_ids"),
        (list(range(100)) * 3, PoolingParams(), "prompt is 300 tokens, more than max_model_len=256"),
        ([1, 2], PoolingParams(dimensions=32), "dimensions"),
    ],
    ids=["empty", "out_of_vocab", "too_long", "dimensions"],
)
def test_bad_embedding_requests_raise_value_error(prompt, params, match):
    engine = tiny_engine()
    with pytest.raises(ValueError, match=match):
        engine.add_request("x", prompt, params)
    _assert_idle(engine)


def test_prompt_of_max_model_len_is_accepted_and_default_pooling_applies():
    """Unlike generation, an embedding may fill the whole context; ``default_pooling``
    decides for requests that do not choose."""
    engine = tiny_engine(max_model_len=32)
    ids = (PROMPT + PROMPT)[:32]
    mean = LLMEngine(engine.config, model=engine.model_runner.model, default_pooling="mean")
    got = {"default": _embed(engine, {"x": ids}, PoolingParams())["x"],
           "mean_default": _embed(mean, {"x": ids}, PoolingParams())["x"],
           "last_explicit": _embed(mean, {"x": ids}, PoolingParams(pooling_type="last"))["x"]}
    torch.testing.assert_close(got["default"], _direct(engine, ids, "last"), atol=1e-5, rtol=0)
    torch.testing.assert_close(got["mean_default"], _direct(engine, ids, "mean"), atol=1e-5, rtol=0)
    torch.testing.assert_close(got["last_explicit"], got["default"], atol=1e-5, rtol=0)


def test_priority_needs_the_priority_policy():
    engine = tiny_engine()
    with pytest.raises(ValueError, match="priority=1 needs the priority scheduling policy"):
        engine.add_request("x", [1, 2], PoolingParams(), priority=1)
    with pytest.raises(ValueError, match="priority=-2 needs"):
        engine.add_request("y", [1, 2], GREEDY, priority=-2)
    engine.add_request("z", [1, 2], GREEDY, priority=0)
    _step_all(engine)
    _assert_idle(engine)
