"""The worker side of an engine, built in one place from the whole ``EngineConfig``.

``Worker`` (rank 0, the driver) resolves the engine's ``Platform`` (``kvflow.platforms``:
threads, kernel builds, the thread governor; after vLLM's ``Worker.init_device``) and asks
it for the attention backend and CUDA-graph eligibility, starts the tensor-parallel worker
processes, and builds its ``ModelRunner`` with ``ModelRunner.from_config``, which loads its
own model shard (with its LoRA slots), allocates its own KV cache, captures its decode CUDA
graphs and builds its drafter (n-gram prompt lookup, or a draft model with a runner of its
own built the same way). A tensor-parallel rank builds its runner with ``build_rank``, the
same ``ModelRunner.from_config`` in its own process, which the driver hands to the worker
processes (``kvflow.distributed.worker.TPWorkers``; that layer stands below this one).

Every rank loads its shard of the model (``TensorParallel`` place) and a KV block pool of
the same number of blocks (sized once by ``EngineArgs.create_config`` for the rank holding the
most KV heads, so that one block table serves every rank), and runs the attention backend
the selector picks from the same config (the same on every rank).
"""

from __future__ import annotations

import contextlib

from kvflow.config import EngineConfig
from kvflow.distributed.worker import TPWorkers, torchrun_rank
from kvflow.platforms import resolve_platform
from kvflow.worker.model_runner import ModelRunner


def build_rank(config: EngineConfig, rank: int) -> ModelRunner:
    """A tensor-parallel worker's model runner (it samples nothing, has no drafter): what
    each worker process builds (``kvflow.distributed.worker.worker_main`` gets this function
    passed in)."""
    backend = resolve_platform(config).select_attention_backend(log=False)
    return ModelRunner.from_config(config, backend, rank=rank, is_driver=False)


class Worker:
    """Rank 0's device side, built from the whole ``EngineConfig`` in one place (see the
    module docstring; vLLM's ``Worker`` + executor, at kvflow's size): platform, attention
    backend, tensor-parallel workers, and the model runner (model shard, LoRA slots, KV
    cache, decode CUDA graphs, speculative proposer).

    Args:
        config: the engine's ``EngineConfig``.
        model: a loaded model to run instead of loading ``config.load`` (tests; no
            tensor-parallel workers are started then).
        proposer: a speculative proposer to use instead of the one ``config.speculative``
            names (tests).

    Attributes:
        platform, attention_backend, tp_workers (or None), model_runner, and the runner's
        parts: model, cache_engine, lora_manager (or None), proposer (or None).

    Raises:
        ValueError: a model that cannot be loaded as configured, an attention backend that
            cannot run here (``kvflow.attention.selector``).
    """

    def __init__(self, config: EngineConfig, model=None, proposer=None) -> None:
        self.config = config
        # The platform's choices first, from the config alone (before anything loads).
        self.platform = resolve_platform(config)
        backend = self.platform.select_attention_backend()
        self.attention_backend = backend
        use_cuda_graphs = self.platform.use_cuda_graphs(backend)
        self.tp_workers = None
        with contextlib.ExitStack() as on_failure:  # a failed build stops the workers it started
            if model is None and config.parallel.tensor_parallel_size > 1:
                # (they load their shards while this rank loads its own)
                self.tp_workers = TPWorkers(config, spawn=torchrun_rank() is None, build_rank=build_rank)
                on_failure.callback(self.tp_workers.shutdown)
            broadcast = self.tp_workers.broadcast if self.tp_workers is not None else None
            self.model_runner = ModelRunner.from_config(
                config, backend, broadcast=broadcast, use_cuda_graphs=use_cuda_graphs and self.tp_workers is None,
                model=model, proposer=proposer,
            )
            on_failure.pop_all()
        self.platform.model_loaded()

    @property
    def model(self):
        """The model (rank 0's shard)."""
        return self.model_runner.model

    @property
    def cache_engine(self):
        """Rank 0's KV tensors."""
        return self.model_runner.cache_engine

    @property
    def lora_manager(self):
        """LoRA slots and host cache, or None."""
        return self.model_runner.lora_manager

    @property
    def proposer(self):
        """The speculative proposer (the runner's drafter), or None."""
        return self.model_runner.drafter

    def execute_model(self, scheduler_output):
        """Run one batch (``ModelRunner.execute``; the TP workers get it by broadcast)."""
        return self.model_runner.execute(scheduler_output)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (a no-op without them)."""
        if self.tp_workers is not None:
            self.tp_workers.shutdown()
