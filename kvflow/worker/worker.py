"""One rank's model and cache: what a tensor-parallel worker builds for itself (and the
driver, rank 0, for its own shard).

Every rank loads its shard of the model (``kvflow.model.loader.load_model`` with its
``TensorParallel`` place) and a KV block pool of the same number of blocks: the count is
sized for the rank holding the most KV heads, so that one block table serves every rank.
"""

from __future__ import annotations

import os

import torch

from kvflow.config import EngineArgs, resolve_dtype
from kvflow.distributed.parallel_state import TensorParallel
from kvflow.model.loader import load_model
from kvflow.model.resolve import resolve_model
from kvflow.sample.sampler import Sampler
from kvflow.worker.cache_engine import CacheEngine
from kvflow.worker.model_runner import ModelRunner


def build_shard(args: EngineArgs, model_dir: str | os.PathLike, rank: int):
    """Rank ``rank``'s model shard, the full model's config, and the cache layout every rank
    shares.

    Returns:
        (model, model_config, cache_config).
    """
    device = args.torch_device()
    dtype = resolve_dtype(args.dtype, device)
    world = args.tensor_parallel_size
    model, model_config = load_model(model_dir, dtype, device, args.quantization, args.quantization_group_size,
                                     TensorParallel(rank, world), args.quantize_lm_head,
                                     max_model_len=args.max_model_len)
    widest = max((model_config.kv_cache_spec(world, r) for r in range(world)), key=lambda spec: spec.num_kv_heads)
    cache_config = args.cache_config(widest, dtype)
    return model, model_config, cache_config


def build_rank(args: EngineArgs, rank: int, world_size: int) -> ModelRunner:
    """A tensor-parallel worker's model runner (it samples nothing)."""
    model_dir = resolve_model(args.model, cache_dir=args.model_cache_dir)
    model, _, cache_config = build_shard(args, model_dir, rank)
    device = args.torch_device()
    cache = CacheEngine(model.kv_cache_spec, cache_config, device)
    return ModelRunner(model, cache, cache_config.block_size, Sampler(torch.Generator(device=device)), device,
                       is_driver=False, attention_backend=args.resolved_attention_backend())
