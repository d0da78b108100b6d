"""The CUDA platform: bfloat16 for ``dtype="auto"``, decode CUDA graphs where eligible."""

from __future__ import annotations

import torch

from kvflow.attention.backend import AttentionBackend
from kvflow.platforms.interface import Platform


class CudaPlatform(Platform):
    """An engine on a CUDA device (see ``kvflow.platforms.interface.Platform``). No kernels
    build at start-up (Triton compiles its own at first use) and no thread governor runs."""

    device_type = "cuda"

    @classmethod
    def auto_dtype(cls) -> torch.dtype:
        """bfloat16."""
        return torch.bfloat16

    def use_cuda_graphs(self, backend: AttentionBackend) -> bool:
        """Decode CUDA graphs are captured with a backend whose metadata is graph-safe
        (``supports_cuda_graphs``), unless ``enforce_eager``, without tensor parallelism (the
        ranks run eagerly: their collectives would not match a replay) and for one KV cache
        group (a hybrid cache builds per-group metadata each step)."""
        config = self.config
        return (backend.supports_cuda_graphs and not config.kernels.enforce_eager
                and config.parallel.tensor_parallel_size == 1 and config.cache.kv_cache_groups is None)
