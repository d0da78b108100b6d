"""The ``Platform``: what an engine does differently per device kind, decided once.

After vLLM's ``vllm.platforms`` (``Platform``, ``CpuPlatform``, ``CudaPlatform``), at kvflow's
size. A platform is resolved once from the ``EngineConfig`` (``kvflow.platforms.
resolve_platform``) before the worker is built, and owns:

- what ``dtype="auto"`` means there (``auto_dtype``, ``resolve_dtype``);
- which attention backend runs (``select_attention_backend``: the eligibility rules live in
  ``kvflow.attention.selector``, asked once here);
- the C++ kernel builds started for this engine and their publishing between two steps (CPU);
- the thread governor (CPU: ``kvflow.cpu_threads``);
- whether decode CUDA graphs may be captured (``use_cuda_graphs``; CUDA);
- its chores between two steps (``between_steps``), which the engine loop calls once per step.

It reads the ``EngineConfig`` by duck typing (``config.device``, ``config.parallel``,
``config.load``, ``config.kernels``, ``config.cache``, ``config.model``,
``config.scheduler``) and imports no module above the attention package but the config's
dtype table.
"""

from __future__ import annotations

from typing import Any

import torch

from kvflow.attention.backend import AttentionBackend
from kvflow.attention.selector import select_attention_backend
from kvflow.config import resolve_dtype


class Platform:
    """One device kind's engine-wide decisions and chores (see the module docstring).

    Args:
        config: the engine's ``EngineConfig`` (duck-typed: any object with its fields).

    Attributes:
        device_type: "cpu" or "cuda".
        config: the config it was resolved from.
        kernel_builds: the C++ kernels building in the background, published between steps
            (``kvflow.ops.build``); empty where none build.
        thread_governor: the CPU thread governor (``kvflow.cpu_threads.ThreadGovernor``), or
            None.
    """

    device_type = ""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.kernel_builds: list = []
        self.thread_governor = None

    # ------------------------------------------------------------------ dtypes
    @classmethod
    def auto_dtype(cls) -> torch.dtype:
        """What ``dtype="auto"`` means on this platform."""
        raise NotImplementedError

    @classmethod
    def resolve_dtype(cls, dtype: str | torch.dtype) -> torch.dtype:
        """``dtype`` ("auto", a float name of ``kvflow.config.DTYPE_NAMES`` or a torch dtype)
        as a torch dtype on this platform.

        Raises:
            ValueError: naming ``dtype`` for an unknown name; ``KVFLOW_CPU_AUTO_DTYPE`` for a
                bad value of it (CPU, "auto").
        """
        if isinstance(dtype, str) and dtype == "auto":
            return cls.auto_dtype()
        return resolve_dtype(dtype)

    # ------------------------------------------------------------------ choices
    def select_attention_backend(self, log: bool = True) -> AttentionBackend:
        """The engine's attention backend for this config (``kvflow.attention.selector``;
        ``log``: log the choice at INFO).

        Raises:
            ValueError: naming ``attention_backend`` for a backend that cannot run here.
        """
        config = self.config
        return select_attention_backend(config.kernels.attention_backend, config.device.device, config.device.dtype,
                                        config.cache.dtype, log=log, sliding_window=any(config.model.sliding_windows))

    def use_cuda_graphs(self, backend: AttentionBackend) -> bool:
        """Whether the worker captures decode CUDA graphs (False on this platform)."""
        return False

    def model_loaded(self) -> None:
        """Called once the worker has loaded the model and allocated its KV cache, before
        the first step (nothing here)."""

    # ------------------------------------------------------------------ between steps
    def between_steps(self) -> None:
        """The platform's chores between two steps, on the thread that runs the forwards
        (none here)."""

    def get_stats(self) -> dict[str, float | int]:
        """Platform counters for ``LLMEngine.get_stats`` (none here)."""
        return {}
