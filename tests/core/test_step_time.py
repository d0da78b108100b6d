"""The time bound of a step (``max_step_seconds``) on a real engine: it cuts a long prompt's
prefill into chunks and does not change the greedy tokens (float32)."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_hf_model_dir
from kvflow import LLM, SamplingParams
from kvflow.core.scheduler import MIN_STEP_TOKENS
from kvflow.core.step_time import StepTimeModel


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny_hf_model_dir(tmp_path_factory.mktemp("steptime") / "m")


def test_time_bounded_chunks_keep_the_greedy_tokens(tiny_dir):
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        prompt = [(7 * i + 3) % 200 + 10 for i in range(200)]
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        common = dict(dtype="float32", num_kv_blocks=128, block_size=4, attention_backend="torch",
                      max_num_batched_tokens=256)
        whole = LLM(model=str(tiny_dir), max_step_seconds=0, **common)
        (ref,) = whole.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        bounded = LLM(model=str(tiny_dir), max_step_seconds=1e-9, **common)  # every step is "too slow"
        bounded.engine.scheduler.step_time = StepTimeModel.fixed(0.0, 1.0)
        sizes = []
        bounded.engine.add_request("r", prompt, params)
        while bounded.engine.has_unfinished_requests():
            for out in bounded.engine.step():
                tokens = out.outputs[0].token_ids
            sizes.append(bounded.engine.last_scheduler_output.total_num_scheduled_tokens)
        assert sizes[:6] == [MIN_STEP_TOKENS] * 6  # the 200-token prompt in chunks of 32, not at once
        assert tokens == ref.outputs[0].token_ids
    finally:
        torch.set_num_threads(saved)


# ---------------------------------------------------------------- the step-time model
def test_the_fit_separates_the_fixed_part_from_the_per_token_part():
    model = StepTimeModel()
    assert model.predict(100) is None and model.tokens_within(1.0) is None  # nothing observed
    for n in (16, 300, 32, 17, 512):
        model.observe(n, 0.1 + 0.001 * n)
    assert model.fixed_seconds == pytest.approx(0.1)
    assert model.seconds_per_token == pytest.approx(0.001)
    assert model.predict(250) == pytest.approx(0.35)
    assert model.tokens_within(1.0) == 900
    assert model.tokens_within(0.05) == 0  # the fixed part alone is longer


def test_steps_of_one_size_charge_every_second_to_the_tokens():
    model = StepTimeModel()
    for _ in range(3):
        model.observe(16, 0.116)
    assert model.fixed_seconds == 0.0
    assert model.seconds_per_token == pytest.approx(0.116 / 16)
    # larger steps measured no slower (a negative slope) are no reason to invent a fixed part
    model = StepTimeModel()
    model.observe(100, 0.3)
    model.observe(400, 0.2)
    assert model.fixed_seconds == 0.0 and model.seconds_per_token > 0


def test_the_fit_follows_a_machine_that_becomes_slower():
    model = StepTimeModel(decay=0.8)
    sizes = [16, 300, 64, 17, 200]
    for i in range(20):
        n = sizes[i % len(sizes)]
        model.observe(n, 0.05 + 0.001 * n)
    for i in range(40):  # another process takes half of the machine
        n = sizes[i % len(sizes)]
        model.observe(n, 0.1 + 0.002 * n)
    assert model.seconds_per_token == pytest.approx(0.002, rel=0.02)
    assert model.fixed_seconds == pytest.approx(0.1, rel=0.05)


def test_bad_values_are_refused_or_ignored():
    with pytest.raises(ValueError, match="decay"):
        StepTimeModel(decay=1.0)
    with pytest.raises(ValueError, match="seconds_per_token"):
        StepTimeModel.fixed(0.0, 0.0)
    model = StepTimeModel()
    for n, t in ((0, 1.0), (10, 0.0), (10, float("nan")), (10, float("inf")), (10, -1.0)):
        model.observe(n, t)
    assert model.seconds_per_token is None
