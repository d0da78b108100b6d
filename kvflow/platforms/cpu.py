"""The CPU platform: ``dtype="auto"`` by the CPU's native bfloat16, the C++ kernels built in
the background and published between steps, the thread governor."""

from __future__ import annotations

import logging
from typing import Any

import torch

from kvflow import envs, ops
from kvflow.cpu_threads import check_wait_policy, thread_governor
from kvflow.ops.build import CppKernel
from kvflow.platforms.interface import Platform
from kvflow.utils import reuse_large_allocations

logger = logging.getLogger(__name__)

_DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # KVFLOW_CPU_AUTO_DTYPE's values
_auto_logged: set[torch.dtype] = set()


class CpuPlatform(Platform):
    """An engine on the CPU (see ``kvflow.platforms.interface.Platform``).

    At its resolution (once per engine, before the worker is built) it applies
    ``num_threads`` (``torch.set_num_threads``), warns about a spinning OpenMP wait policy on a
    busy machine (``kvflow.cpu_threads.check_wait_policy``), starts the background builds of
    the C++ kernels this engine uses (``start_kernel_builds``) and takes the process's thread
    governor; once the model is loaded (``model_loaded``) it lets glibc's heap keep the steps'
    large tensors for reuse; ``between_steps`` then fits the thread count to the free cores
    and publishes the kernels built since. With tensor parallelism neither of the last two
    runs (the ranks must switch kernels at the same step, and each rank would count the
    others as load).
    """

    device_type = "cpu"

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        check_wait_policy()  # (a hint when torch came first and the machine is busy)
        num_threads = config.device.num_threads
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        # C++ CPU kernels not built yet build in the background while PyTorch's paths serve;
        # between_steps() switches to each between two steps (never inside one). Started
        # before the attention backend is selected: the selector takes the CPU backend while
        # its kernel builds.
        self.kernel_builds = start_kernel_builds(config)
        if config.parallel.tensor_parallel_size == 1:
            self.thread_governor = thread_governor(num_threads or torch.get_num_threads(),
                                                   explicit=num_threads is not None)

    @classmethod
    def auto_dtype(cls) -> torch.dtype:
        """bfloat16 where oneDNN runs bfloat16 natively (AVX512-BF16 or AMX-BF16:
        ``kvflow.layers.linear.onednn_bf16_native``), float32 elsewhere (there bfloat16 is
        emulated and float32 is as fast or faster); ``KVFLOW_CPU_AUTO_DTYPE`` fixes the
        choice. Logged at INFO once per process and outcome.

        Raises:
            ValueError: naming ``KVFLOW_CPU_AUTO_DTYPE`` for a value other than float32 or
                bfloat16.
        """
        from kvflow.layers import linear  # (oneDNN's packing rules live with the packed linears)

        forced = envs.KVFLOW_CPU_AUTO_DTYPE
        if forced is not None:
            dtype, reason = _DTYPE_NAMES[forced], f"KVFLOW_CPU_AUTO_DTYPE={forced}"
        elif linear.onednn_bf16_native():
            dtype, reason = torch.bfloat16, "this CPU's oneDNN runs bfloat16 natively (AVX512-BF16 / AMX-BF16)"
        else:
            dtype, reason = torch.float32, "no native bfloat16 in this CPU's oneDNN (AVX512-BF16 / AMX-BF16)"
        if dtype not in _auto_logged:
            _auto_logged.add(dtype)
            logger.info("dtype auto: %s on the CPU (%s; dtype='float32' is the exactness reference)",
                        str(dtype).replace("torch.", ""), reason)
        return dtype

    def model_loaded(self) -> None:
        """Let glibc's heap keep the steps' large tensors for reuse (``KVFLOW_CPU_MALLOC_REUSE``,
        ``kvflow.utils.reuse_large_allocations``): set after the load, so that the load's
        one-off temporaries are still handed back to the OS."""
        reuse_large_allocations(envs.KVFLOW_CPU_MALLOC_REUSE)

    def between_steps(self) -> None:
        """Publish the C++ kernels built since the last step
        (``kvflow.ops.publish_background_builds``), then fit the CPU thread count to the free
        cores (the governor), one core left to the compiler while kernels still build. Call
        it between two steps only, on the thread that runs the forwards (OpenMP's count is
        per OS thread).

        Why the core: the compiler runs niced, but in a session of its own (the scheduler's
        autogroup), where its nice does not yield to this process; a team of OpenMP threads
        as large as the CPUs then waits in every parallel region for the thread the compiler
        holds off its core. SmolLM2-135M's first generations on 2 cores ran at 0.4-1.0
        tok/s during the builds with 2 threads, 4-105 with one (docs/benchmarks.md, session
        36). The governor's measurements count the compiler too (as niced load); the
        reservation holds from the first step, before a measurement."""
        if self.kernel_builds:  # between two steps: no forward of this engine is running
            ops.publish_background_builds(self.kernel_builds)
            self.kernel_builds = [k for k in self.kernel_builds if k.pending()]
        if self.thread_governor is not None:
            threads = self.thread_governor.update(reserved=1 if self.kernel_builds else 0)
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)

    def get_stats(self) -> dict[str, float | int]:
        """With a thread governor: num_cpu_threads, cpu_other_load, num_cpu_thread_changes."""
        governor = self.thread_governor
        if governor is None:
            return {}
        return {"num_cpu_threads": governor.threads, "cpu_other_load": governor.others,
                "num_cpu_thread_changes": governor.num_changes}


def start_kernel_builds(config: Any) -> list[CppKernel]:
    """Start building, in the background, the C++ CPU kernels this engine would use that are
    not built yet (``kvflow.ops.build.start_background_builds``): the GGUF matmul for a model
    computed as stored, paged attention, RMSNorm, rotary, SiLU-and-mul, the INT8 linear for
    an INT8-quantized model and the fused decode step of a GGUF or dense bfloat16 model, in
    that order (a kernel left out would build on its first use, in the middle of a step). Only on the
    CPU, without tensor parallelism (ranks must switch at the same step) and with
    ``KVFLOW_CPU_KERNEL_BUILD=background`` (the default); elsewhere nothing starts and each
    kernel is built on its first use.

    Args:
        config: the ``EngineConfig`` (``device``, ``parallel``, ``load`` are read).

    Returns:
        The kernels building in the background; ``CpuPlatform.between_steps`` publishes each
        once it is built.
    """
    if (config.device.device.type != "cpu" or config.parallel.tensor_parallel_size > 1
            or envs.KVFLOW_CPU_KERNEL_BUILD != "background"):
        return []
    load = config.load
    kernels = [ops.PAGED_ATTENTION, ops.RMS_NORM, ops.ROTARY, ops.ACTIVATION]
    if load is not None and load.quantization == "gguf":
        kernels.insert(0, ops.GGUF_MATMUL)  # a GGUF model's linears: most of its step
    if load is not None and "int8" in (load.quantization, load.quantize_lm_head):
        kernels.append(ops.INT8_LINEAR)
    if load is not None and (load.quantization == "gguf"
                             or (load.quantization is None and config.device.dtype == torch.bfloat16)):
        kernels.append(ops.FUSED_DECODE)  # decode steps in one call (kvflow.layers.fused_decode)
    return ops.start_background_builds(kernels)
