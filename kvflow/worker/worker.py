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

from kvflow import envs, ops
from kvflow.attention.backend import AttentionBackend
from kvflow.attention.selector import select_attention_backend
from kvflow.config import EngineConfig
from kvflow.distributed.parallel_state import TensorParallel
from kvflow.model.loader import load_model
from kvflow.ops.build import CppKernel
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


def start_cpu_kernel_builds(config: EngineConfig) -> list[CppKernel]:
    """Start building, in the background, the C++ CPU kernels this engine would use that are
    not built yet (``kvflow.ops.build.start_background_builds``): paged attention, RMSNorm,
    rotary, and the INT8 linear for an INT8-quantized model, in that order. Only on the CPU,
    without tensor parallelism (ranks must switch at the same step) and with
    ``KVFLOW_CPU_KERNEL_BUILD=background`` (the default); elsewhere nothing starts and each
    kernel is built on its first use, as before.

    Returns:
        The kernels building in the background; the engine publishes each between two steps
        once it is built (``kvflow.ops.publish_background_builds``).
    """
    if (config.device.device.type != "cpu" or config.parallel.tensor_parallel_size > 1
            or envs.KVFLOW_CPU_KERNEL_BUILD != "background"):
        return []
    kernels = [ops.PAGED_ATTENTION, ops.RMS_NORM, ops.ROTARY]
    if config.load is not None and "int8" in (config.load.quantization, config.load.quantize_lm_head):
        kernels.append(ops.INT8_LINEAR)
    return ops.start_background_builds(kernels)


def attention_backend_for(config: EngineConfig, log: bool = True) -> AttentionBackend:
    """The engine's attention backend (``kvflow.attention.selector``)."""
    return select_attention_backend(config.kernels.attention_backend, config.device.device, config.device.dtype,
                                    config.cache.dtype, log=log, sliding_window=any(config.model.sliding_windows))


def build_rank(config: EngineConfig, rank: int) -> ModelRunner:
    """A tensor-parallel worker's model runner (it samples nothing)."""
    model = build_shard(config, rank)
    device = config.device.device
    cache = CacheEngine(model.kv_cache_spec, config.cache, device)
    return ModelRunner(model, cache, config.cache.block_size, Sampler(torch.Generator(device=device)), device,
                       is_driver=False, attention_backend=attention_backend_for(config, log=False))
