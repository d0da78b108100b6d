"""ModelRunner with the Triton attention backend against the PyTorch backend (tiny model,
float32; without CUDA the Triton kernels run in Triton's CPU interpreter)."""

from __future__ import annotations

import pytest
import torch

from conftest import run_to_completion, tiny_engine, tiny_model_config
from kvflow.sampling_params import SamplingParams

pytest.importorskip("triton")

PROMPTS = {
    "p1": [42],
    "p9": [(13 * i + 5) % 128 for i in range(9)],
    "p30": [(7 * i + 100) % 128 for i in range(30)],
    "p45": [(31 * i + 1) % 128 for i in range(45)],
    "p45_shared": [(31 * i + 1) % 128 for i in range(40)] + [1, 2, 3],  # prefix-cache hit on p45
}


def _generate(backend: str, **engine_kwargs) -> dict[str, list[int]]:
    engine = tiny_engine(attention_backend=backend, **engine_kwargs)
    params = SamplingParams(temperature=0, max_tokens=8)
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, params)
        engine.step()  # staggered: later prompts prefill while earlier ones decode
    return run_to_completion(engine)


@pytest.mark.parametrize("block_size, chunk", [(4, 16), (16, 64)])
def test_triton_backend_greedy_equals_torch_backend(block_size, chunk):
    """Chunked prefill mixed with decodes, a prefix-cache hit, block sizes below and at a
    key tile: the same greedy tokens on both backends."""
    kwargs = dict(block_size=block_size, max_num_batched_tokens=chunk, num_blocks=256 // block_size * 4)
    torch_out = _generate("torch", **kwargs)
    assert all(len(v) == 8 for v in torch_out.values())
    assert _generate("triton", **kwargs) == torch_out


def test_triton_backend_metadata_is_flat_per_request():
    engine = tiny_engine(attention_backend="triton", block_size=4)
    engine.add_request("a", PROMPTS["p9"], SamplingParams(temperature=0, max_tokens=4))
    engine.add_request("b", PROMPTS["p30"], SamplingParams(temperature=0, max_tokens=4))
    engine.step()  # both prefills
    out = engine.scheduler.schedule()
    inputs = engine.model_runner.prepare_inputs(out)
    meta = inputs.metadata
    assert meta.backend == "triton" and meta.groups == []
    assert meta.max_query_len == 1
    assert meta.query_start_loc.tolist() == [0, 1, 2]
    assert sorted(meta.context_lens.tolist()) == [10, 31]
    assert meta.block_tables.dtype == torch.int32 and meta.block_tables.shape == (2, 8)


def test_triton_backend_logits_match_torch_backend():
    """Prefill logits of a 45-token prompt in 3 chunks agree to float32 rounding."""
    logits = {}
    for backend in ("torch", "triton"):
        engine = tiny_engine(attention_backend=backend, max_num_batched_tokens=16)
        runner = engine.model_runner
        captured = []
        original = runner.model.compute_logits
        runner.model.compute_logits = lambda h, original=original: captured.append(original(h)) or captured[-1]
        engine.add_request("x", PROMPTS["p45"], SamplingParams(temperature=0, max_tokens=3))
        run_to_completion(engine)
        runner.model.compute_logits = original
        logits[backend] = torch.cat(captured)
    torch.testing.assert_close(logits["triton"], logits["torch"], atol=1e-5, rtol=1e-5)


def test_unknown_backend_raises():
    with pytest.raises(ValueError, match="attention_backend"):
        tiny_engine(attention_backend="flash")
