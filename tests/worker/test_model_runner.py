"""ModelRunner with the kernel attention backends against the PyTorch backend (tiny model,
float32): "cpu" (the C++ decode kernel) and "triton" (without CUDA the Triton kernels run in
Triton's CPU interpreter)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kvflow.attention.backend import FlatMetadata
from conftest import make_engine, run_to_completion, tiny_engine, tiny_model_config
from kvflow.config import CacheConfig
from kvflow.attention.cpu_attention import cpu_kernel_available
from kvflow.sampling_params import SamplingParams

BACKENDS = [
    pytest.param("cpu", marks=pytest.mark.skipif(not cpu_kernel_available(), reason="C++ kernel not built")),
    pytest.param("triton", marks=pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="no triton")),
]
requires_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="no triton")

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


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size, chunk", [(4, 16), (16, 64)])
def test_kernel_backend_greedy_equals_torch_backend(backend, block_size, chunk):
    """Chunked prefill mixed with decodes, a prefix-cache hit, block sizes below and at a
    key tile: the same greedy tokens on both backends."""
    kwargs = dict(block_size=block_size, max_num_batched_tokens=chunk, num_blocks=256 // block_size * 4)
    torch_out = _generate("torch", **kwargs)
    assert all(len(v) == 8 for v in torch_out.values())
    assert _generate(backend, **kwargs) == torch_out


@pytest.mark.skipif(not cpu_kernel_available(), reason="C++ kernel not built")
def test_cpu_backend_puts_all_decodes_in_one_group():
    engine = tiny_engine(attention_backend="cpu", block_size=4)
    for rid, prompt in {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8], "c": list(range(24))}.items():
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=4))
    engine.step()  # the three prefills
    out = engine.scheduler.schedule()
    engine.model_runner.update_states(out)
    inputs = engine.model_runner.prepare_inputs(out)
    assert inputs.metadata.backend.name == "cpu"
    assert len(inputs.metadata.groups) == 1  # contexts 5 and 25: one group, no padding concern
    assert inputs.metadata.groups[0].context_lens.tolist() == [5, 5, 25]


@pytest.mark.skipif(not cpu_kernel_available(), reason="the C++ kernel is off or could not be built")
def test_cpu_backend_over_int8_kv_is_flat_and_batch_invariant():
    """An int8 cache keeps the "cpu" backend: flat per-request metadata for
    ``paged_attention_quantized`` (prefill and decode tokens in one call) and the model's
    linears and LM head made batch-invariant."""
    from conftest import tiny_model
    from kvflow.config import SchedulerConfig
    from kvflow.engine.llm_engine import LLMEngine
    from kvflow.layers.invariant_linear import InvariantLinearMethod, invariant_linear_available

    config = tiny_model_config()
    engine = make_engine(model=tiny_model(config), model_config=config,
                       cache_config=CacheConfig(4, 64, torch.int8), scheduler_config=SchedulerConfig(64, 8, 256),
                       tokenizer=None, device=torch.device("cpu"), attention_backend="cpu")
    assert engine.model_runner.attention_backend.name == "cpu"
    engine.add_request("a", [1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=4))
    engine.step()
    engine.add_request("b", list(range(9)), SamplingParams(temperature=0, max_tokens=4))
    out = engine.scheduler.schedule()
    engine.model_runner.update_states(out)
    meta = engine.model_runner.prepare_inputs(out).metadata
    assert meta.backend.name == "cpu" and isinstance(meta, FlatMetadata)
    assert meta.query_start_loc.tolist() == [0, 1, 10]  # a's decode, then b's prefill
    assert meta.context_lens.tolist() == [6, 9] and meta.block_tables.dtype == torch.int64
    if invariant_linear_available():
        model = engine.model_runner.model
        assert isinstance(model.layers[0].self_attn.qkv_proj.quant_method, InvariantLinearMethod)
        assert isinstance(model.layers[1].mlp.down_proj.quant_method, InvariantLinearMethod)
        assert isinstance(model.lm_head.packed.quant_method, InvariantLinearMethod)


@requires_triton
def test_triton_backend_metadata_is_flat_per_request():
    engine = tiny_engine(attention_backend="triton", block_size=4)
    engine.add_request("a", PROMPTS["p9"], SamplingParams(temperature=0, max_tokens=4))
    engine.add_request("b", PROMPTS["p30"], SamplingParams(temperature=0, max_tokens=4))
    engine.step()  # both prefills
    out = engine.scheduler.schedule()
    engine.model_runner.update_states(out)
    inputs = engine.model_runner.prepare_inputs(out)
    meta = inputs.metadata
    assert meta.backend.name == "triton" and isinstance(meta, FlatMetadata)
    assert meta.max_query_len == 1
    assert meta.query_start_loc.tolist() == [0, 1, 2]
    assert sorted(meta.context_lens.tolist()) == [10, 31]
    assert meta.block_tables.dtype == torch.int32 and meta.block_tables.shape == (2, 8)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kernel_backend_logits_match_torch_backend(backend):
    """Logits of a 45-token prompt (3 prefill chunks) and its decodes agree to float32 rounding."""
    logits = {}
    for backend in ("torch", backend):
        engine = tiny_engine(attention_backend=backend, max_num_batched_tokens=16)
        runner = engine.model_runner
        captured = []
        original = runner.model.compute_logits
        runner.model.compute_logits = lambda h, original=original: captured.append(original(h)) or captured[-1]
        engine.add_request("x", PROMPTS["p45"], SamplingParams(temperature=0, max_tokens=3))
        run_to_completion(engine)
        runner.model.compute_logits = original
        logits[backend] = torch.cat(captured)
    torch.testing.assert_close(logits[backend], logits["torch"], atol=1e-5, rtol=1e-5)


def test_unknown_backend_raises():
    with pytest.raises(ValueError, match="attention_backend"):
        tiny_engine(attention_backend="flash")


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_runner_state_mirrors_the_scheduler_through_every_feature(monkeypatch, preemption_mode):
    """The runner builds its inputs from its own state, kept by the scheduler's diffs: at
    every step it holds exactly the running requests, each with the scheduler's tokens,
    block table and computed count when scheduled, through chunked prefill, prefix-cache hits, parallel
    samples (fork, copy-on-write), preemption (recompute or swap), speculative roll-backs
    (n-gram drafts) and aborts (a running request that is not scheduled gets its diff when it
    next is); and the outputs equal those of a roomy engine."""
    from conftest import tiny_model
    from kvflow.config import SchedulerConfig
    from kvflow.spec_decode.ngram import NgramProposer
    from kvflow.worker.model_runner import ModelRunner

    def engine(num_blocks: int):
        config = tiny_model_config()
        return make_engine(model=tiny_model(config), model_config=config,
                           cache_config=CacheConfig(4, num_blocks, torch.float32, num_cpu_blocks=64),
                           scheduler_config=SchedulerConfig(16, 8, 256, preemption_mode=preemption_mode),
                           proposer=NgramProposer(3, 1, 3, 256))

    requests = {
        "loop": ([1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(temperature=0, max_tokens=24)),
        # (greedy: a seeded sample's tokens are the same through preemption and chunking,
        # test_llm_engine.py, but with drafts its generator is read once per verified draft or
        # once per plain step, and a tight cache drops drafts the roomy one verifies)
        "n3": (PROMPTS["p9"], SamplingParams(temperature=0, n=3, max_tokens=12)),
        "long": (PROMPTS["p45"], SamplingParams(temperature=0, max_tokens=10)),
        "shared": (PROMPTS["p45_shared"], SamplingParams(temperature=0, max_tokens=10)),
        "gone": (PROMPTS["p30"], SamplingParams(temperature=0, max_tokens=20)),
    }

    def run(engine, abort_at=None):
        outputs, step = {}, 0
        for rid, (prompt, params) in requests.items():
            engine.add_request(rid, prompt, params)
        while engine.has_unfinished_requests():
            if step == abort_at:
                engine.abort_request("gone")
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = [o.token_ids for o in out.outputs]
            step += 1
        return outputs

    checked = {"steps": 0, "replaced": 0}
    mismatches = []  # (an assert inside prepare_inputs would be isolated as a request fault)
    original = ModelRunner.prepare_inputs

    def prepare(self, out):
        if self is tight.model_runner:
            running = tight.scheduler.running
            if set(self.requests) != {r.request_id for r in running}:
                mismatches.append((checked["steps"], sorted(self.requests), [r.request_id for r in running]))
            for r in map(tight.scheduler.requests.get, [*out.num_scheduled_tokens, *(c for c, _ in out.forked)]):
                state = self.requests.get(r.request_id)
                row = self.input_batch.req_id_to_index.get(r.request_id)
                held = None if state is None else (
                    state.all_token_ids, self.input_batch.token_ids[row, : self.input_batch.num_tokens[row]].tolist(),
                    tuple(self.input_batch.block_ids(row, g) for g in range(self.num_kv_cache_groups)),
                    state.num_computed_tokens,
                    int(self.input_batch.num_computed_tokens[row]))
                if held != (r.all_token_ids, r.all_token_ids, r.block_ids, r.num_computed_tokens,
                            r.num_computed_tokens):
                    mismatches.append((checked["steps"], r.request_id, held))
            checked["steps"] += 1
            checked["replaced"] += sum(out.scheduled_cached_reqs.replace_block_ids)
        return original(self, out)

    reference = run(engine(256))
    tight = engine(22)
    monkeypatch.setattr(ModelRunner, "prepare_inputs", prepare)
    outputs = run(tight, abort_at=6)
    assert not mismatches, mismatches[:3]
    assert tight.scheduler.num_preemptions > 0 and checked["replaced"] > 0 and checked["steps"] > 20
    assert tight.get_stats()["spec_num_draft_tokens"] > tight.get_stats()["spec_num_accepted_tokens"] > 0
    if preemption_mode == "swap":
        assert tight.scheduler.num_swapped_out > 0
    del reference["gone"]
    assert "gone" not in outputs and outputs == reference
    # States of the requests that finished in the last step are dropped at the next step.
    tight.add_request("after", [5, 6, 7], SamplingParams(temperature=0, max_tokens=2))
    tight.step()
    assert set(tight.model_runner.requests) == {"after"}


@pytest.mark.skipif(not cpu_kernel_available(), reason="the C++ kernel is off or could not be built")
def test_prompt_lens_mark_each_requests_prompt_tokens_through_chunking_and_recompute(monkeypatch):
    """``BatchLayout.prompt_lens`` (what the fused decode step splits a step by) counts, per
    request, the scheduled tokens at positions inside its prompt: a prompt's chunks, none for
    decodes, and for a request recomputed after a preemption its prompt part only (its output
    tokens come after them in the same query)."""
    prompt_len = 10
    engine = tiny_engine(attention_backend="cpu", block_size=4, num_blocks=12, max_num_batched_tokens=8)
    seen = []
    prepare = engine.model_runner.prepare_inputs

    def recording(out):
        inputs = prepare(out)
        seen.append((inputs.positions.clone(), inputs.metadata.layout))
        return inputs

    monkeypatch.setattr(engine.model_runner, "prepare_inputs", recording)
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    for i in range(4):
        engine.add_request(str(i), [(5 * i + j) % 100 + 1 for j in range(prompt_len)], params)
        engine.step()
    run_to_completion(engine)
    assert engine.get_stats()["num_preemptions"] > 0
    mixed = 0  # requests whose query held prompt and output tokens (a recompute)
    for positions, layout in seen:
        starts = [0] + layout.query_lens.cumsum(0).tolist()
        want = [int((positions[a:b] < prompt_len).sum()) for a, b in zip(starts, starts[1:])]
        assert layout.prompt_lens.tolist() == want
        mixed += sum(0 < p < q for p, q in zip(want, layout.query_lens.tolist()))
    assert mixed > 0
