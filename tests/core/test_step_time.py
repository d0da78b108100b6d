"""The time bound of a step (``max_step_seconds``) on a real engine: it cuts a long prompt's
prefill into chunks and does not change the greedy tokens (float32)."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_hf_model_dir
from kvflow import LLM, SamplingParams
from kvflow.core.scheduler import MIN_STEP_TOKENS


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
        bounded.engine.scheduler.tokens_per_second = 1.0
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
