"""One rank's model, KV cache and runner: what a tensor-parallel worker builds for itself from
the engine's ``EngineConfig`` (and the driver, rank 0, for its own shard).

Every rank loads its shard of the model (``kvflow.model.loader.load_model`` with its
``TensorParallel`` place) and a KV block pool of the same number of blocks (sized once by
``EngineArgs.create_config`` for the rank holding the most KV heads, so that one block
table serves every rank), and runs the attention backend the selector picks from the same
config (the same on every rank).
"""

from __future__ import annotations

import torch

from kvflow.attention.backend import AttentionBackend
from kvflow.attention.selector import select_attention_backend
from kvflow.config import EngineConfig
from kvflow.distributed.parallel_state import TensorParallel
from kvflow.model.loader import load_model
from kvflow.sample.sampler import Sampler
from kvflow.worker.cache_engine import CacheEngine
from kvflow.worker.model_runner import ModelRunner


def build_shard(config: EngineConfig, rank: int = 0):
    """Rank ``rank``'s model shard (the whole model without tensor parallelism).

    Raises:
        ValueError: see ``load_model``.
    """
    load, device = config.load, config.device
    world = config.parallel.tensor_parallel_size
    tp = TensorParallel(rank, world) if world > 1 else None
    model, _ = load_model(load.model_dir, device.dtype, device.device, load.quantization, load.group_size, tp,
                          load.quantize_lm_head, model_config=config.model)
    return model


def attention_backend_for(config: EngineConfig, log: bool = True) -> AttentionBackend:
    """The engine's attention backend (``kvflow.attention.selector``)."""
    return select_attention_backend(config.kernels.attention_backend, config.device.device, config.device.dtype,
                                    config.cache.dtype, log=log)


def build_rank(config: EngineConfig, rank: int) -> ModelRunner:
    """A tensor-parallel worker's model runner (it samples nothing)."""
    model = build_shard(config, rank)
    device = config.device.device
    cache = CacheEngine(model.kv_cache_spec, config.cache, device)
    return ModelRunner(model, cache, config.cache.block_size, Sampler(torch.Generator(device=device)), device,
                       is_driver=False, attention_backend=attention_backend_for(config, log=False))
