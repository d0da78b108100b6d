"""The one builder of the worker side (``ModelRunner.from_config``: model, LoRA slots, KV
cache, runner, drafter; ``kvflow.worker.worker.Worker`` over it) and the loader's LoadConfig
resolved before loading."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_hf_model_dir, tiny_model, tiny_model_config
from kvflow.attention.torch_backend import TorchAttentionBackend
from kvflow.config import CacheConfig, EngineConfig, SchedulerConfig
from kvflow.engine.arg_utils import EngineArgs
from kvflow.engine.llm_engine import LLMEngine
from kvflow.model.loader import resolve_load_config
from kvflow.spec_decode.draft_model import DraftModelProposer
from kvflow.worker import model_runner
from kvflow.worker.model_runner import ModelRunner

CPU = torch.device("cpu")


class _InvariantTorchBackend(TorchAttentionBackend):
    """The PyTorch backend, asking for batch-invariant linears as a quantized cache's does."""

    needs_batch_invariant_linears = True


def test_every_runner_gets_batch_invariant_linears_when_its_backend_asks(monkeypatch):
    """``ModelRunner.from_config`` (the driver's, a rank's and a draft's runner) switches the
    model's linears before the runner is made, only for a backend that asks for it."""
    switched = []
    monkeypatch.setattr(model_runner, "make_batch_invariant", lambda model: switched.append(model) or 0)
    model_config = tiny_model_config()
    model = tiny_model(model_config)
    cache = CacheConfig(4, 16, torch.float32, enable_prefix_caching=False)
    config = EngineConfig(model_config, cache, SchedulerConfig(64, 4, 64), seed=5)
    plain = ModelRunner.from_config(config, TorchAttentionBackend(), model=model)
    assert switched == [] and plain.model is model and plain.drafter is None
    runner = ModelRunner.from_config(config, _InvariantTorchBackend(), model=model, is_driver=False)
    assert switched == [model] and runner.is_driver is False
    assert runner.cache_engine.kv_caches[0][0].shape[0] == 16  # its own cache of the given blocks
    # the sampler's generator is seeded with the config's seed
    expected = torch.Generator().manual_seed(5).initial_seed()
    assert runner.sampler.generator.initial_seed() == expected


def test_the_worker_builds_the_draft_proposer_with_the_engines_backend(tmp_path):
    """``speculative_config`` with a draft model: the worker's builder loads the draft and
    makes its runner (own cache of the target's block count, the engine's backend, the
    engine's seed); the core schedules with that proposer."""
    target = str(tiny_hf_model_dir(tmp_path / "target"))
    draft = target  # (its own copy of the weights, loaded by the builder)
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=target, device="cpu", dtype="float32", num_kv_blocks=24, block_size=4, seed=7, attention_backend="torch",
        speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 2},
    ))
    proposer = engine.worker.proposer
    assert isinstance(proposer, DraftModelProposer) and engine.engine_core.proposer is proposer
    assert proposer.runner.attention_backend is engine.worker.attention_backend
    assert proposer.runner.model is not engine.model_runner.model
    assert proposer.kv.block_pool.num_blocks == engine.config.cache.num_blocks
    assert proposer.generator.initial_seed() == 7 and proposer.k == 2
    engine.shutdown()


def test_a_saved_quantized_checkpoint_is_resolved_before_loading(tmp_path):
    """A folder written by ``kvflow quantize`` loads with its own scheme whatever was asked
    (``LoadConfig.serialized``); any other folder with the scheme asked for."""
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "config.json").write_text(json.dumps({"model_type": "llama",
                                                   "kvflow_quantization": {"method": "int4", "group_size": 64}}))
    load = resolve_load_config("mine", saved, quantization="int8", group_size=32, quantize_lm_head="int8")
    assert (load.quantization, load.group_size, load.serialized) == ("int4", 64, True)
    assert load.model == "mine" and load.model_dir == str(saved) and load.quantize_lm_head == "int8"
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"model_type": "llama"}))
    load = resolve_load_config("p", plain, quantization="int8", group_size=32)
    assert (load.quantization, load.group_size, load.serialized) == ("int8", 32, False)


def test_tensor_parallelism_refuses_a_saved_checkpoint_before_building(tmp_path):
    from kvflow.config import LoadConfig
    from kvflow.distributed.parallel_state import TensorParallel
    from kvflow.model.loader import build_model

    load = LoadConfig("x", str(tmp_path), "int8", 32, serialized=True)
    with pytest.raises(ValueError, match="saved quantized checkpoint cannot be sharded"):
        build_model(tiny_model_config(), load, torch.float32, CPU, TensorParallel(0, 2))


def _engine_config(**fields) -> EngineConfig:
    from kvflow.config import DeviceConfig, KernelConfig

    return EngineConfig(tiny_model_config(), CacheConfig(4, 16, torch.float32), SchedulerConfig(64, 4, 64),
                        device=DeviceConfig(CPU, torch.float32), kernels=KernelConfig("torch", True), **fields)


def test_the_draft_engine_config_is_the_targets_with_the_drafts_model_and_its_own_pool():
    """``EngineConfig.with_draft``: the draft's own config, what its runner is built from (its
    model and load settings, a pool of the target's block count without prefix caching, one
    rank, no speculation or LoRA, the target's device and seed); None without a draft model."""
    from kvflow.config import LoadConfig, LoRAConfig, ParallelConfig, SpeculativeConfig

    assert _engine_config().draft is None
    draft_model = tiny_model_config(num_hidden_layers=1)
    draft_load = LoadConfig("d", "/nowhere", None, 32)
    target = _engine_config(
        speculative=SpeculativeConfig("draft_model", 3, model="d"),
        parallel=ParallelConfig(tensor_parallel_size=2), lora=LoRAConfig(1, 8, 1), seed=11,
    )
    config = target.with_draft(draft_model, draft_load)
    assert config.model is target.model and config.cache == target.cache and config.lora == target.lora
    draft = config.draft
    assert draft.model is draft_model and draft.load is draft_load
    assert draft.cache == CacheConfig(4, 16, torch.float32, enable_prefix_caching=False)
    assert draft.parallel.tensor_parallel_size == 1
    assert draft.speculative is None and draft.lora is None and draft.draft is None
    assert draft.device == config.device and draft.seed == 11 and draft.scheduler == config.scheduler


def test_a_failed_build_stops_the_workers_it_started(monkeypatch):
    """A runner that fails to build after the tensor-parallel workers started stops them (the
    ``Worker``); a core that fails after its worker was built stops the worker (the
    ``EngineCore``); the error reaches the caller."""
    from kvflow.config import ParallelConfig
    from kvflow.engine import core
    from kvflow.worker import worker

    stopped = []

    class FakeTPWorkers:
        def __init__(self, config, spawn, build_rank):
            assert build_rank is worker.build_rank

        broadcast = None

        def shutdown(self):
            stopped.append("tp")

    def fail(*args, **kwargs):
        raise ValueError("the model cannot be loaded")

    monkeypatch.setattr(worker, "TPWorkers", FakeTPWorkers)
    monkeypatch.setattr(ModelRunner, "from_config", fail)
    config = _engine_config(parallel=ParallelConfig(tensor_parallel_size=2))
    with pytest.raises(ValueError, match="cannot be loaded"):
        worker.Worker(config)
    assert stopped == ["tp"]

    monkeypatch.undo()
    monkeypatch.setattr(worker.Worker, "shutdown", lambda self: stopped.append("worker"))

    def bad_scheduler(*args, **kwargs):
        raise ValueError("bad scheduler")

    monkeypatch.setattr(core, "Scheduler", bad_scheduler)
    with pytest.raises(ValueError, match="bad scheduler"):
        core.EngineCore(_engine_config(), model=tiny_model(tiny_model_config()))
    assert stopped == ["tp", "worker"]
