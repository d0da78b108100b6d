"""The one place that chooses the attention backend: by device, model and cache dtypes, and
the user's ``attention_backend`` ("auto", "torch", "cpu", "triton").

"auto" takes Triton on CUDA (when ``triton`` is installed and the GPU can load the cache
dtype) and the C++ kernels on the CPU (when they build), else the PyTorch backend. The choice
is logged once per engine. No other module tests backend names. A model with sliding-window
layers gets a backend that implements the window (``supports_sliding_window``): "auto" moves
to the PyTorch backend, logged, where its first choice lacks it; a requested one that lacks it
is refused.
"""

from __future__ import annotations

import logging

import torch

from kvflow.attention.backend import AttentionBackend
from kvflow.attention.torch_backend import TORCH_BACKEND

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
_QUANTIZED = (torch.int8, torch.float8_e4m3fn)


def check_attention_backend_name(name: str) -> None:
    """Raises ValueError naming ``attention_backend`` for an unknown name."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(repr(b) for b in ATTENTION_BACKENDS)}, got {name!r}")


def select_attention_backend(
    requested: str,
    device: torch.device,
    model_dtype: torch.dtype,
    kv_cache_dtype: torch.dtype,
    log: bool = True,
    sliding_window: bool = False,
) -> AttentionBackend:
    """The backend that runs paged attention for this engine.

    Args:
        requested: ``EngineArgs.attention_backend``.
        device: the model's device.
        model_dtype: the activations' dtype.
        kv_cache_dtype: the KV cache's element dtype (int8 / fp8 for a quantized cache).
        log: log the choice at INFO (the engine's own choice; a draft model's is quiet).
        sliding_window: the model has layers with an acting sliding window
            (``ModelConfig.sliding_windows``).

    Raises:
        ValueError: naming ``attention_backend`` for an unknown name, or a backend that cannot
            run here: "cpu" on CUDA or without its C++ kernel; "triton" without the package,
            on a CPU without ``TRITON_INTERPRET=1`` (tests only), in bfloat16 in the
            interpreter, or over an fp8 cache below compute capability 8.9, or a requested
            backend without sliding-window attention for a model with windowed layers.
    """
    from kvflow.attention.cpu_attention import cpu_kernel_available, cpu_kernel_pending, wait_for_cpu_kernel

    def triton_available() -> bool:  # imported only where asked: triton is ~64 MiB of RSS
        from kvflow.attention.triton_attention import triton_available

        return triton_available()

    def interpreter_enabled() -> bool:
        from kvflow.attention.triton_attention import interpreter_enabled

        return interpreter_enabled()

    check_attention_backend_name(requested)
    on_cuda = device.type == "cuda"
    quantized = kv_cache_dtype in _QUANTIZED
    # The Triton kernel loads float8 K/V, which Triton supports from compute capability 8.9 on.
    fp8_unsupported = on_cuda and kv_cache_dtype == torch.float8_e4m3fn and torch.cuda.get_device_capability(device) < (8, 9)
    name, reason = requested, "requested"
    if requested == "auto":
        if on_cuda:
            name = "triton" if triton_available() and not fp8_unsupported else "torch"
            reason = "CUDA" if name == "triton" else "CUDA without a usable triton"
        elif cpu_kernel_pending() and not quantized:
            name, reason = "cpu", "CPU; its C++ kernel is building in the background, PyTorch's decode until then"
        else:  # a quantized cache has no PyTorch path in this backend: wait for a build under way
            wait_for_cpu_kernel()
            name = "cpu" if cpu_kernel_available() else "torch"
            reason = "CPU" if name == "cpu" else "CPU, C++ kernels unavailable"
    if requested == "cpu" and not on_cuda:
        wait_for_cpu_kernel()  # the kernel was asked for by name: wait for a build under way
    if name == "cpu":
        if on_cuda:
            raise ValueError("attention_backend='cpu' runs on the CPU only (device is CUDA)")
        if not cpu_kernel_available() and not cpu_kernel_pending():
            raise ValueError("attention_backend='cpu' needs kvflow's C++ kernel, which could not be built "
                             "(a C++ compiler and ninja are needed; see the log) or KVFLOW_CPU_ATTENTION=0")
    if name == "triton":
        if not triton_available():
            raise ValueError("attention_backend='triton' needs the triton package (pip install triton)")
        if fp8_unsupported:
            raise ValueError("attention_backend='triton' with kv_cache_dtype='fp8' needs compute capability 8.9+")
        if not on_cuda and not interpreter_enabled():
            raise ValueError("attention_backend='triton' needs a CUDA device (on the CPU only Triton's "
                             "interpreter runs it: TRITON_INTERPRET=1 set before kvflow starts; tests only)")
        if not on_cuda and model_dtype == torch.bfloat16:
            raise ValueError("attention_backend='triton' on the CPU (Triton's interpreter) cannot run dtype "
                             "'bfloat16'; use float32 / float16 or attention_backend='torch'")
    backend = _instantiate(name, quantized, kv_cache_dtype, model_dtype)
    if sliding_window and not backend.supports_sliding_window:
        if requested != "auto":
            raise ValueError(f"attention_backend={requested!r} ({backend!r}) does not implement sliding-window "
                             "attention, which this model's layers use; use attention_backend='torch'")
        logger.info("attention backend: %r has no sliding-window attention, which this model uses: PyTorch's", backend)
        backend, reason = TORCH_BACKEND, f"{reason}; sliding-window layers"
    if log:
        logger.info("attention backend: %r (%s; %s, model %s, KV cache %s)", backend, reason, device,
                    str(model_dtype).replace("torch.", ""), str(kv_cache_dtype).replace("torch.", ""))
    return backend


def _instantiate(name: str, quantized: bool, kv_cache_dtype: torch.dtype, model_dtype: torch.dtype) -> AttentionBackend:
    if name == "triton":
        from kvflow.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(quantized_kv=quantized)
    if name == "cpu":
        from kvflow.attention.cpu_backend import CpuAttentionBackend, CpuQuantizedAttentionBackend

        if quantized:
            return CpuQuantizedAttentionBackend()
        if kv_cache_dtype == model_dtype:
            return CpuAttentionBackend()
        # The C++ decode kernel reads float caches of the model's dtype only.
        logger.info("attention backend: the C++ decode kernel reads caches of the model's dtype only "
                    "(model %s, cache %s): PyTorch's path", model_dtype, kv_cache_dtype)
    return TORCH_BACKEND
