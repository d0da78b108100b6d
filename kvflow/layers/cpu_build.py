"""Build-once loading of kvflow's small C++ CPU kernels (``torch.utils.cpp_extension``).

Each kernel module (``cpu_attention``, ``cpu_linear``) holds its C++ source as a string and
an :class:`InlineExtension` that compiles it on first use with ``load_inline`` (a C++
compiler and ninja are needed; tens of seconds the first time, then cached in the torch
extensions folder, ``TORCH_EXTENSIONS_DIR``). The build uses ``-march=native``, so the
extension's name hashes the source together with the host CPU's feature flags: a cached
build never runs on a CPU that lacks an instruction it was compiled for.

If the build fails (no compiler, no ninja, a compile error), or the extension's environment
variable is ``0``, :meth:`InlineExtension.load` returns None once and for all and callers
keep their PyTorch path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
from typing import Any

import torch

logger = logging.getLogger(__name__)

CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp"]


def host_cpu_flags() -> str:
    """The ``flags`` (x86) or ``Features`` (Arm) line of /proc/cpuinfo, '' if unreadable."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def takes_kernel_input(x: torch.Tensor, ndim: int) -> bool:
    """Whether x suits kvflow's float CPU kernels: a CPU tensor of ``ndim`` dimensions with a
    contiguous last dimension, float32 or bfloat16, not recording autograd (the kernels
    have no backward)."""
    return (
        x.device.type == "cpu"
        and x.dim() == ndim
        and x.stride(-1) == 1
        and x.dtype in (torch.float32, torch.bfloat16)
        and not (torch.is_grad_enabled() and x.requires_grad)
    )


class InlineExtension:
    """A C++ extension compiled from ``source`` on first :meth:`load` (thread-safe).

    Args:
        prefix: the extension name's stem (a hash of source and CPU flags is appended).
        source: C++ source including ``<torch/extension.h>``.
        functions: the functions to bind.
        disable_env: an environment variable that, set to "0", keeps the extension unbuilt.
        what: the kernel's name in log messages.
    """

    def __init__(self, prefix: str, source: str, functions: list[str], disable_env: str, what: str) -> None:
        self.prefix, self.source, self.functions = prefix, source, functions
        self.disable_env, self.what = disable_env, what
        self._lock = threading.Lock()
        self._module: Any = None
        self._failed = False

    def build_name(self) -> str:
        tag = hashlib.sha1((platform.machine() + host_cpu_flags() + self.source).encode()).hexdigest()[:12]
        return f"{self.prefix}_{tag}"

    def load(self) -> Any:
        """The compiled module, or None when it is disabled or could not be built."""
        if self._module is not None or self._failed:
            return self._module
        with self._lock:
            if self._module is not None or self._failed:
                return self._module
            if os.environ.get(self.disable_env, "1") == "0":
                self._failed = True
                return None
            try:
                from torch.utils.cpp_extension import load_inline

                logger.info("building kvflow's %s (once; cached afterwards)", self.what)
                self._module = load_inline(
                    name=self.build_name(),
                    cpp_sources=self.source,
                    functions=self.functions,
                    extra_cflags=CFLAGS,
                    extra_ldflags=["-fopenmp"],
                    verbose=False,
                )
            except Exception as exc:  # no compiler, no ninja, a build error: keep the PyTorch path
                logger.warning("kvflow's %s could not be built (%s: %.300s); using the PyTorch path",
                               self.what, type(exc).__name__, str(exc))
                self._failed = True
        return self._module

    def require(self) -> Any:
        """The compiled module (building it if needed).

        Raises:
            RuntimeError: when it is disabled or could not be built.
        """
        module = self.load()
        if module is None:
            raise RuntimeError(f"kvflow's {self.what} is not available")
        return module
