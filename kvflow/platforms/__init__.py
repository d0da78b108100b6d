"""Platforms: what an engine does differently on the CPU and on CUDA, decided once
(``kvflow.platforms.interface.Platform``; after vLLM's ``vllm.platforms``).

``resolve_platform(config)`` resolves the engine's platform from its ``EngineConfig`` (once,
before the worker is built); ``platform_for(device)`` is the platform class of a device, for
what needs no engine (``dtype="auto"``: ``platform_for(device).resolve_dtype("auto")``).
"""

from __future__ import annotations

from typing import Any

import torch

from kvflow.platforms.cpu import CpuPlatform
from kvflow.platforms.cuda import CudaPlatform
from kvflow.platforms.interface import Platform

__all__ = ["CpuPlatform", "CudaPlatform", "Platform", "resolve_platform", "platform_for"]


def platform_for(device: torch.device | str) -> type[Platform]:
    """The platform class of ``device`` ("cpu", "cuda", "cuda:N" or a ``torch.device``).

    Raises:
        ValueError: naming ``device`` for another device type.
    """
    kind = torch.device(device).type
    if kind == "cpu":
        return CpuPlatform
    if kind == "cuda":
        return CudaPlatform
    raise ValueError(f"device must be 'cpu' or 'cuda', got {str(device)!r}")


def resolve_platform(config: Any) -> Platform:
    """The engine's platform, resolved from its ``EngineConfig`` (``config.device.device``):
    on the CPU this applies ``num_threads``, starts the background kernel builds and takes the
    thread governor (``CpuPlatform``). Call it once per engine, before the worker is built.

    Raises:
        ValueError: naming ``device`` for a device type kvflow does not run on.
    """
    return platform_for(config.device.device)(config)
