"""The worker side of an engine, built in one place from the whole ``EngineConfig``.

``Worker`` (rank 0, the driver) builds, in this order: the attention backend (asked of the
engine's ``Platform``, ``kvflow.platforms``), the tensor-parallel worker processes, its model
shard (``kvflow.model.loader.build_model``) with its LoRA slots, the KV cache and model runner
(``build_runner``), the decode CUDA graphs where the platform allows them, and the
speculative proposer (``build_proposer``: n-gram prompt lookup, or a draft model with a
runner of its own built by the same ``build_runner``). A tensor-parallel rank builds its
shard and runner with ``build_rank``, which the driver hands to the worker processes
(``kvflow.distributed.worker.TPWorkers``; that layer stands below this one).

Every rank loads its shard of the model (``TensorParallel`` place) and a KV block pool of
the same number of blocks (sized once by ``EngineArgs.create_config`` for the rank holding the
most KV heads, so that one block table serves every rank), and runs the attention backend
the selector picks from the same config (the same on every rank).
"""

from __future__ import annotations

import torch

from kvflow.attention.backend import AttentionBackend
from kvflow.config import CacheConfig, EngineConfig
from kvflow.distributed.parallel_state import TensorParallel
from kvflow.distributed.worker import TPWorkers, torchrun_rank
from kvflow.layers.invariant_linear import make_batch_invariant
from kvflow.model.loader import build_model
from kvflow.platforms import Platform, resolve_platform
from kvflow.sample.sampler import Sampler
from kvflow.spec_decode.draft_model import DraftModelProposer
from kvflow.spec_decode.ngram import NgramProposer
from kvflow.worker.cache_engine import CacheEngine
from kvflow.worker.model_runner import ModelRunner


def build_shard(config: EngineConfig, rank: int = 0):
    """Rank ``rank``'s model shard (the whole model without tensor parallelism), loaded as
    ``config.load`` resolved it.

    Raises:
        ValueError: see ``build_model``.
    """
    world = config.parallel.tensor_parallel_size
    tp = TensorParallel(rank, world) if world > 1 else None
    return build_model(config.model, config.load, config.device.dtype, config.device.device, tp)


def build_runner(model, cache_config: CacheConfig, device: torch.device, backend: AttentionBackend, seed: int = 0,
                 *, is_driver: bool = True, broadcast=None, lora_manager=None) -> ModelRunner:
    """A ``ModelRunner`` over ``model`` and a fresh KV cache of ``cache_config``'s blocks: the
    one way every runner of an engine is made (the driver's, a tensor-parallel rank's, a
    draft model's). A backend that needs batch-invariant linears (over a quantized KV
    cache) has the model's dense CPU linears switched first, in place
    (``kvflow.layers.invariant_linear.make_batch_invariant``), so that a token's stored
    (rounded) K/V never depends on how its step was batched or chunked.

    Args:
        model: a loaded ``CausalLM`` (this rank's shard).
        cache_config: the KV block pool (``config.cache``, or the draft's).
        device: where the model and cache live.
        backend: the attention backend (``Platform.select_attention_backend``).
        seed: the seed of its sampler's generator (rows without a seed of their own).
        is_driver, broadcast, lora_manager: as ``ModelRunner``.
    """
    if backend.needs_batch_invariant_linears:
        make_batch_invariant(model)  # (CUDA linears stay; idempotent)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    cache = CacheEngine(model.kv_cache_spec, cache_config, device)  # this rank's shard of heads
    return ModelRunner(model, cache, cache_config.block_size, Sampler(generator), device, is_driver=is_driver,
                       broadcast=broadcast, attention_backend=backend, lora_manager=lora_manager)


def build_rank(config: EngineConfig, rank: int) -> ModelRunner:
    """A tensor-parallel worker's model runner (it samples nothing): what each worker process
    builds (``kvflow.distributed.worker.worker_main`` gets this function passed in)."""
    backend = resolve_platform(config).select_attention_backend(log=False)
    return build_runner(build_shard(config, rank), config.cache, config.device.device, backend, is_driver=False)


def build_proposer(config: EngineConfig, backend: AttentionBackend):
    """The speculative proposer of ``config.speculative`` (None without one): n-gram prompt
    lookup, or a draft model (loaded as ``config.draft`` resolved it) with its own runner and
    KV cache of as many blocks as the target's (prefix caching off).

    Raises:
        ValueError: a draft model that cannot be loaded as configured (``build_model``).
    """
    spec = config.speculative
    if spec is None:
        return None
    k, max_len = spec.num_speculative_tokens, config.scheduler.max_model_len
    if spec.method == "ngram":
        return NgramProposer(k, spec.prompt_lookup_min, spec.prompt_lookup_max, max_len)
    draft = build_model(config.draft_model, config.draft, config.device.dtype, config.device.device)
    cache = config.cache
    draft_cache = CacheConfig(cache.block_size, cache.num_blocks, cache.dtype, enable_prefix_caching=False)
    runner = build_runner(draft, draft_cache, config.device.device, backend, config.seed)
    return DraftModelProposer(runner, config.draft_model.vocab_size, draft_cache, k, max_len)


class Worker:
    """Rank 0's device side, built from the whole ``EngineConfig`` in one place (see the
    module docstring; vLLM's ``Worker`` + executor, at kvflow's size): attention backend,
    tensor-parallel workers, model shard, LoRA slots, KV cache, model runner, decode CUDA
    graphs, speculative proposer.

    Args:
        config: the engine's ``EngineConfig``.
        platform: the engine's ``Platform`` (``kvflow.platforms.resolve_platform(config)``),
            resolved before: it chooses the backend and allows CUDA graphs.
        model: a loaded model to run instead of loading ``config.load`` (tests; no
            tensor-parallel workers are started then).
        proposer: a speculative proposer to use instead of the one ``config.speculative``
            names (tests).

    Attributes:
        attention_backend, tp_workers (or None), model, cache_engine, lora_manager (or
        None), model_runner, proposer (or None).

    Raises:
        ValueError: a model that cannot be loaded as configured, an attention backend that
            cannot run here (``kvflow.attention.selector``).
    """

    def __init__(self, config: EngineConfig, platform: Platform, model=None, proposer=None) -> None:
        self.config = config
        # The platform's choices first, from the config alone (before anything loads).
        backend = platform.select_attention_backend()
        self.attention_backend = backend
        use_cuda_graphs = platform.use_cuda_graphs(backend)
        self.tp_workers = None
        if model is None and config.parallel.tensor_parallel_size > 1:
            # (they load their shards while this rank loads its own)
            self.tp_workers = TPWorkers(config, spawn=torchrun_rank() is None, build_rank=build_rank)
        try:
            if model is None:
                model = build_shard(config, 0)
            self.model = model
            self.lora_manager = None
            if config.lora is not None:
                from kvflow.lora.manager import LoRAManager

                lora = config.lora
                self.lora_manager = LoRAManager(model, lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras)
            broadcast = self.tp_workers.broadcast if self.tp_workers is not None else None
            self.model_runner = build_runner(model, config.cache, config.device.device, backend, config.seed,
                                             broadcast=broadcast, lora_manager=self.lora_manager)
            self.cache_engine = self.model_runner.cache_engine
            if use_cuda_graphs and self.tp_workers is None:
                from kvflow.worker.cuda_graph import DecodeGraphRunner, default_batch_sizes

                self.model_runner.graph_runner = DecodeGraphRunner(
                    model, self.cache_engine.kv_caches, -(-config.scheduler.max_model_len // config.cache.block_size),
                    default_batch_sizes(config.scheduler.max_num_seqs), config.device.device, backend,
                )
            self.proposer = proposer if proposer is not None else build_proposer(config, backend)
        except BaseException:
            self.shutdown()
            raise

    def execute_model(self, scheduler_output):
        """Run one batch (``ModelRunner.execute``; the TP workers get it by broadcast)."""
        return self.model_runner.execute(scheduler_output)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (a no-op without them)."""
        if self.tp_workers is not None:
            self.tp_workers.shutdown()
