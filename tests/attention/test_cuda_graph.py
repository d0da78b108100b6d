"""DecodeGraphRunner: static buffers, padding to a captured batch size, replay.

On the CPU the graphs are "eager" stand-ins (replay re-runs the forward on the static
buffers), which checks everything but the CUDA capture itself; the CUDA test runs only
where a GPU is present.
"""

from __future__ import annotations

import pytest
import torch

from conftest import make_engine, run_to_completion, tiny_model, tiny_model_config
from kvflow.config import CacheConfig
from kvflow.attention.backend import BatchLayout
from kvflow.attention.triton_backend import TritonAttentionBackend
from kvflow.attention.cache_engine import CacheEngine
from kvflow.attention.cuda_graph import DecodeGraphRunner, default_batch_sizes

pytest.importorskip("triton")


def test_default_batch_sizes():
    assert default_batch_sizes(1) == [1]
    assert default_batch_sizes(6) == [1, 2, 4, 6]
    assert default_batch_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert default_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    big = default_batch_sizes(4096)  # larger decodes run eagerly: not 515 captures and buffers at start
    assert big[-1] == 512 and len(big) == 67 and default_batch_sizes(512) == big


TRITON = TritonAttentionBackend()


def _flat(slots, q_lens, contexts, tables, block_size=4):
    return TRITON.build_metadata(BatchLayout(slots, q_lens, contexts, tables, [len(q_lens)], block_size, torch.device("cpu")))


def _decode_inputs(contexts, tables, block_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (len(contexts),), generator=g)
    positions = torch.tensor([c - 1 for c in contexts])
    slots = torch.tensor([t[(c - 1) // block_size] * block_size + (c - 1) % block_size for c, t in zip(contexts, tables)])
    meta = _flat(slots, [1] * len(contexts), contexts, tables, block_size)
    return ids, positions, meta


# float32 matmuls over a padded batch of 4 rows and over the 3 real rows may round
# differently (MKL / oneDNN pick their blocking by row count and by the CPU's ISA: equal on
# the development machine's Xeon, up to ~2e-6 apart on an AMD Zen 4): the two paths must
# agree to this tolerance, and write exactly the same slots.
ATOL, RTOL = 1e-5, 1e-5


def _snapshot(caches):
    return [(k.clone(), v.clone()) for k, v in caches]


def _written_slots(before, after, block_size):
    """The (layer, slot) pairs whose K or V changed between two snapshots of the caches."""
    slots = set()
    for layer, ((k0, v0), (k1, v1)) in enumerate(zip(before, after)):
        changed = ((k0 != k1).flatten(2).any(-1) | (v0 != v1).flatten(2).any(-1))  # [blocks, block_size]
        slots.update((layer, int(b) * block_size + int(o)) for b, o in changed.nonzero().tolist())
    return slots


def _assert_caches_close(a, b):
    for (ka, va), (kb, vb) in zip(a, b):
        torch.testing.assert_close(kb, ka, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(vb, va, atol=ATOL, rtol=RTOL)


@torch.inference_mode()
def test_padded_replay_equals_eager_forward_and_writes_only_real_slots():
    config = tiny_model_config()
    model = tiny_model(config)
    block_size, num_blocks = 4, 40
    caches = {name: CacheEngine(config.kv_cache_spec(), CacheConfig(block_size, num_blocks, torch.float32), torch.device("cpu"))
              for name in ("eager", "graph")}
    g = torch.Generator().manual_seed(3)
    for layer in range(len(caches["eager"].kv_caches)):  # same random history in both caches
        for i in range(2):
            caches["eager"].kv_caches[layer][i].copy_(torch.randn(caches["eager"].kv_caches[layer][i].shape, generator=g))
            caches["graph"].kv_caches[layer][i].copy_(caches["eager"].kv_caches[layer][i])
    runner = DecodeGraphRunner(model, caches["graph"].kv_caches, max_blocks_per_seq=8, batch_sizes=[1, 4, 8],
                               device=torch.device("cpu"), backend=TRITON, capture="eager")
    # capturing wrote nothing: every captured row was inert
    for a, b in zip(caches["eager"].kv_caches, caches["graph"].kv_caches):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    num_layers = len(caches["eager"].kv_caches)

    class Inputs:  # the fields DecodeGraphRunner reads from ModelInputs
        prompt_logprob_rows = []

    def step(contexts, tables, seed):
        """One decode step both ways; the two outputs agree and the two caches were written
        at exactly the real requests' slots (padded rows write nothing)."""
        ids, positions, meta = _decode_inputs(contexts, tables, block_size, seed=seed)
        Inputs.input_ids, Inputs.positions, Inputs.metadata = ids, positions, meta
        assert runner.can_run(Inputs)
        before = {name: _snapshot(c.kv_caches) for name, c in caches.items()}
        got = runner.run(Inputs).clone()
        want = model(ids, positions, caches["eager"].kv_caches, meta)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
        expected = {(layer, int(s)) for layer in range(num_layers) for s in meta.slot_mapping}
        for name, c in caches.items():
            assert _written_slots(before[name], c.kv_caches, block_size) == expected, name
        _assert_caches_close(caches["eager"].kv_caches, caches["graph"].kv_caches)

    contexts, tables = [9, 30, 2], [[5, 6, 7], [10, 11, 12, 13, 14, 15, 16, 17], [20]]
    step(contexts, tables, seed=0)  # 3 requests replay the graph of 4
    # a second, smaller step reuses the same graph with new padding
    step([10], [[5, 6, 7]], seed=1)
    # two requests in the graph of 4: row 2 still holds the first step's third request, whose
    # stale slot must not be written again
    step([11, 31], [[5, 6, 7], tables[1]], seed=2)


def test_prefill_and_oversized_batches_run_eagerly():
    model = tiny_model(tiny_model_config())
    cache = CacheEngine(model.kv_cache_spec, CacheConfig(4, 16, torch.float32), torch.device("cpu"))
    runner = DecodeGraphRunner(model, cache.kv_caches, 4, [2], torch.device("cpu"), TRITON, capture="eager")

    class Inputs:
        prompt_logprob_rows = []

    Inputs.input_ids, _, Inputs.metadata = _decode_inputs([3, 5, 6], [[0], [1, 2], [3, 4]], 4)
    assert not runner.can_run(Inputs)  # 3 > largest graph
    Inputs.metadata = _flat(torch.zeros(4, dtype=torch.int64), [4], [4], [[0]])
    Inputs.input_ids = torch.zeros(4, dtype=torch.int64)
    assert not runner.can_run(Inputs)  # a prefill chunk


def test_bad_arguments_raise():
    model = tiny_model(tiny_model_config())
    cache = CacheEngine(model.kv_cache_spec, CacheConfig(4, 16, torch.float32), torch.device("cpu"))
    with pytest.raises(ValueError, match="batch_sizes"):
        DecodeGraphRunner(model, cache.kv_caches, 4, [], torch.device("cpu"), TRITON, capture="eager")
    with pytest.raises(ValueError, match="capture"):
        DecodeGraphRunner(model, cache.kv_caches, 4, [1], torch.device("cpu"), TRITON, capture="cpu-graph")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graph_engine_matches_eager_engine():
    from kvflow.engine.llm_engine import LLMEngine
    from kvflow.config import SchedulerConfig
    from kvflow.sampling_params import SamplingParams

    config = tiny_model_config()
    outputs = {}
    for graphs in (None, [1, 2, 4, 8]):
        engine = make_engine(
            model=tiny_model(config).cuda(), model_config=config,
            cache_config=CacheConfig(16, 64, torch.float32), scheduler_config=SchedulerConfig(64, 8, 256),
            tokenizer=None, device=torch.device("cuda"), attention_backend="triton", enforce_eager=graphs is None,
        )
        for i in range(5):
            engine.add_request(f"r{i}", [(7 * i + j) % 128 for j in range(3 + 5 * i)], SamplingParams(temperature=0, max_tokens=12))
        outputs[graphs is None] = run_to_completion(engine)
    assert outputs[True] == outputs[False]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_cuda_engine_matches_cpu_engine_float32(graphs):
    """The whole GPU path (Triton attention, paged cache on the GPU, graphs or not) gives the
    CPU engine's greedy tokens in float32: chunked prefill (chunks of 16 tokens), a shared
    prefix served from the prefix cache, and decode batches of several sizes."""
    from kvflow.config import SchedulerConfig
    from kvflow.sampling_params import SamplingParams

    config = tiny_model_config()
    shared = [(11 * j) % 128 for j in range(40)]
    prompts = [shared + [(7 * i + j) % 128 for j in range(3 + 5 * i)] for i in range(6)] + [[5, 9, 13]]
    outputs = {}
    for device in ("cpu", "cuda"):
        model = tiny_model(config)
        engine = make_engine(
            model=model.to(device), model_config=config,
            cache_config=CacheConfig(16, 64, torch.float32, enable_prefix_caching=True),
            scheduler_config=SchedulerConfig(16, 8, 256), tokenizer=None, device=torch.device(device),
            attention_backend="torch" if device == "cpu" else "triton", enforce_eager=device == "cpu" or not graphs,
        )
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=20))
        outputs[device] = run_to_completion(engine)
    assert outputs["cuda"] == outputs["cpu"]
