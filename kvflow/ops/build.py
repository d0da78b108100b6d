"""Build-once loading of kvflow's C++ CPU kernels from their source files (``kvflow/ops/csrc``).

Each kernel is one ``.cpp`` file, shipped in the package, holding its functions and their
Python bindings (``PYBIND11_MODULE``); a :class:`CppKernel` compiles it on first use with
``torch.utils.cpp_extension.load`` (a C++ compiler and ninja are needed; tens of seconds
the first time, then cached in the torch extensions folder, ``TORCH_EXTENSIONS_DIR``). The
build targets the host CPU (``-march=native``; ``KVFLOW_CPU_MARCH`` names another target,
e.g. ``x86-64-v3`` for an AVX2 machine without AVX-512), and the extension's name hashes
the source together with the host CPU's feature flags and the compiler flags: a cached
build never runs on a CPU that lacks an instruction it was compiled for, and an edited
source builds again. Each kernel keys its vectorized passes on the compiler's feature
macros (``__AVX512F__``, ``__AVX512BW__``, ``__AVX512BF16__``) and compiles a portable loop
where they are absent, so a CPU without AVX-512 (or a non-x86 one) gets a working, slower
kernel, not a failed build.

A build that is needed logs ``building the C++ <kernel> (once, ~20 s)`` at INFO level on
logger ``kvflow.ops.build`` first (the CLI prints it to stderr unless ``--quiet``). If the
build fails (no compiler, no ninja, a compile error), or the kernel's switch or
``KVFLOW_CPU_KERNELS`` is ``0`` (``kvflow.envs``), :meth:`CppKernel.load` returns None once
and for all and callers keep their PyTorch path.

Background builds (``start_background_builds``, what an engine on the CPU does at start
unless ``KVFLOW_CPU_KERNEL_BUILD=wait``): the missing kernels compile one after the other in
a child process (``python -m kvflow.ops --nice 10 <source>``) while ``load()`` returns None
at once, so the callers' PyTorch paths serve; a finished build becomes what ``load()``
returns only when the engine publishes it between two steps (``publish_background_builds``),
so that a step never runs the kernel for some layers and the PyTorch path for others.

Why at run time, not at install time or prebuilt per instruction set: see
``kvflow/ops/__init__.py``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kvflow import envs

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
"""The folder of the kernels' source files (package data)."""


def build_cflags() -> list[str]:
    """The compiler flags of the kernels: ``-O3 -march=$KVFLOW_CPU_MARCH`` (default
    ``native``), 512-bit vectors preferred where the target has them (x86 only), OpenMP."""
    flags = ["-O3", f"-march={envs.KVFLOW_CPU_MARCH}"]
    if platform.machine().lower() in ("x86_64", "amd64", "i686", "i386"):
        flags.append("-mprefer-vector-width=512")
    return flags + ["-fopenmp"]


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


# Compiler macros of the x86 features the kernels key on -> the /proc/cpuinfo flag.
_X86_FEATURE_MACROS = {
    "__AVX__": "avx", "__AVX2__": "avx2", "__FMA__": "fma", "__F16C__": "f16c",
    "__AVX512F__": "avx512f", "__AVX512BW__": "avx512bw", "__AVX512VL__": "avx512vl",
    "__AVX512DQ__": "avx512dq", "__AVX512BF16__": "avx512_bf16", "__AVX512FP16__": "avx512_fp16",
}


def missing_cpu_features(cflags: list[str]) -> list[str]:
    """The x86 features that ``cflags`` compile for but this CPU lacks ([] when none, for
    ``-march=native``, off x86, or when the compiler or /proc/cpuinfo cannot be asked).

    A ``KVFLOW_CPU_MARCH`` beyond the host (say ``x86-64-v4`` on an AVX2 machine) would
    build a kernel that dies on its first illegal instruction; this names what is missing
    instead.
    """
    host = set(host_cpu_flags().split(":", 1)[-1].split())
    if "-march=native" in cflags or not host or platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    try:
        done = subprocess.run([envs.read("CXX"), *[f for f in cflags if f.startswith("-m")], "-dM", "-E", "-x", "c++",
                               "-"], input="", capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return []
    macros = {line.split()[1] for line in done.stdout.splitlines() if line.startswith("#define ")}
    return sorted(flag for macro, flag in _X86_FEATURE_MACROS.items() if macro in macros and flag not in host)


class CppKernel:
    """A C++ extension compiled from one source file on first :meth:`load` (thread-safe).

    Args:
        prefix: the extension name's stem (a hash of source, flags and CPU is appended).
        source: the ``.cpp`` file: a name in ``kvflow/ops/csrc`` or a path. It includes
            ``<torch/extension.h>`` and binds its functions in
            ``PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)``.
        switch: the ``kvflow.envs`` switch that, set to ``0``, keeps the kernel unbuilt (as
            ``KVFLOW_CPU_KERNELS=0`` does for all of them).
        what: the kernel's name in log messages.
    """

    def __init__(self, prefix: str, source: str | os.PathLike[str], switch: str, what: str) -> None:
        if switch not in envs.SWITCHES:
            raise ValueError(f"{switch!r} is not a switch of kvflow.envs")
        self.prefix, self.switch, self.what = prefix, switch, what
        self.source_path = CSRC / source if isinstance(source, str) and os.sep not in source else Path(source)
        self._lock = threading.Lock()
        self._module: Any = None
        self._failed = False
        self._background: threading.Event | None = None
        self._built: Any = None

    @property
    def source(self) -> str:
        """The C++ source text."""
        return self.source_path.read_text()

    def build_name(self) -> str:
        """``<prefix>_<12 hex digits>``: the digits hash the machine, this CPU's feature flags,
        the compiler flags, the source and its path (the build's ninja file names the path:
        two copies of kvflow sharing one extensions folder, a checkout and an installed
        wheel say, would otherwise rebuild each other's build on every switch)."""
        key = platform.machine() + host_cpu_flags() + " ".join(build_cflags()) + self.source + str(self.source_path)
        return f"{self.prefix}_{hashlib.sha1(key.encode()).hexdigest()[:12]}"

    def is_built(self) -> bool:
        """Whether a compiled copy is in the extensions folder (loading it is then quick)."""
        try:
            from torch.utils.cpp_extension import _get_build_directory

            folder = _get_build_directory(self.build_name(), verbose=False)
        except Exception:  # noqa: BLE001 - a private helper of torch: assume a build is due
            return False
        return any(name.endswith((".so", ".pyd", ".dylib")) for name in os.listdir(folder)) if os.path.isdir(folder) else False

    def disabled(self) -> bool:
        """Whether the kernel's switch or ``KVFLOW_CPU_KERNELS`` is ``0``."""
        return not envs.cpu_kernel_enabled(self.switch)

    def load(self) -> Any:
        """The compiled module, or None when it is disabled or could not be built, or while
        a background build (:func:`start_background_builds`) is under way or done but not yet
        published (:func:`publish_background_builds`): None then, at once, never a wait."""
        if self._module is not None or self._failed or self._background is not None:
            return self._module
        with self._lock:
            if self._module is not None or self._failed or self._background is not None:
                return self._module
            self._module = self._build()
            self._failed = self._module is None
        return self._module

    def _build(self) -> Any:
        """Build (or load from the cache) the extension; None when disabled, refused for this
        CPU or failed (logged)."""
        if self.disabled():
            return None
        missing = missing_cpu_features(build_cflags())
        if missing:
            logger.warning("kvflow's %s is not built: KVFLOW_CPU_MARCH=%s needs %s, which this CPU lacks; "
                           "using the PyTorch path", self.what, envs.KVFLOW_CPU_MARCH, ", ".join(missing))
            return None
        try:
            from torch.utils.cpp_extension import load

            if not self.is_built():
                logger.info("building the C++ %s (once, ~20 s; cached afterwards)", self.what)
            return load(
                name=self.build_name(),
                sources=[str(self.source_path)],
                extra_cflags=build_cflags(),
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
        except Exception as exc:  # no compiler, no ninja, a build error: keep the PyTorch path
            logger.warning("kvflow's %s could not be built (%s: %.300s); using the PyTorch path",
                           self.what, type(exc).__name__, str(exc))
            return None

    def _claim_background(self) -> bool:
        """Mark the kernel as built in the background when it is enabled, not loaded and not
        in the extensions folder yet (a cached one is loaded now: well under a second)."""
        with self._lock:
            if self._background is not None:
                return True
            if self._module is not None or self._failed:
                return False
            if self.disabled() or self.is_built():
                self._module = self._build()
                self._failed = self._module is None
                return False
            self._background = threading.Event()
        return True

    def _build_in_background(self) -> None:
        done = self._background
        try:
            self._compile_in_subprocess()
            self._built = self._build()
        finally:
            if done is not None:
                done.set()

    def _compile_in_subprocess(self) -> None:
        """Compile one of the package's kernels in a child process (``python -m kvflow.ops
        --nice 10 <source>``, its own session, output discarded) and wait for it. The child
        finishes the build even if this process exits first (a build thread killed at exit
        would leave torch's build lock behind, and the next start would wait on it); the
        in-process ``load`` that follows then finds the build cached (about a second)."""
        if self.source_path.parent != CSRC:
            return
        try:
            subprocess.run([sys.executable, "-m", "kvflow.ops", "--nice", "10", self.source_path.name],
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True, check=False)
        except OSError:  # no child process: build in this one
            pass

    def pending(self) -> bool:
        """Whether a background build of this kernel is under way or not yet published."""
        return self._background is not None

    def publish(self, wait: bool = False) -> bool:
        """Make a finished background build what :meth:`load` returns (or, if it failed, make
        ``load`` return None for good). Call it only where no forward is running (between two
        steps), so that one step never mixes the kernel and the PyTorch path.

        Args:
            wait: wait for the build to finish first.

        Returns:
            True when this call made the kernel available.
        """
        done = self._background
        if done is None:
            return False
        if wait:
            done.wait()
        elif not done.is_set():
            return False
        with self._lock:
            self._module, self._built = self._built, None
            self._failed = self._module is None
            self._background = None
        if self._module is not None:
            logger.info("the C++ %s is built; switching to it from the next step", self.what)
        return self._module is not None

    def require(self) -> Any:
        """The compiled module (building it if needed).

        Raises:
            RuntimeError: when it is disabled or could not be built.
        """
        module = self.load()
        if module is None:
            raise RuntimeError(f"kvflow's {self.what} is not available")
        return module


def start_background_builds(kernels: Sequence[CppKernel]) -> list[CppKernel]:
    """Build those of ``kernels`` that are enabled and not in the extensions folder one after
    the other, from one daemon thread, in the order given (one compiler at a time, in a
    child process at nice 10, so that serving keeps the cores); load the cached ones now. Until an engine publishes a
    finished one between two steps (:func:`publish_background_builds`), its ``load()``
    returns None and callers run their PyTorch paths.

    Returns:
        The kernels being built in the background (already under way ones included).
    """
    pending = [k for k in kernels if k._claim_background()]
    fresh = [k for k in pending if not k._background.is_set() and k not in _QUEUED]  # type: ignore[union-attr]
    if fresh:
        _QUEUED.update(fresh)
        logger.info("building kvflow's C++ %s in the background (about 20-60 s each); PyTorch's operators "
                    "serve meanwhile", ", ".join(k.what for k in fresh))
        threading.Thread(target=_build_all, args=(fresh,), daemon=True, name="kvflow-kernel-build").start()
    return pending


_QUEUED: set[CppKernel] = set()


def _build_all(kernels: list[CppKernel]) -> None:
    for kernel in kernels:
        try:
            kernel._build_in_background()
        finally:
            _QUEUED.discard(kernel)


def publish_background_builds(kernels: Sequence[CppKernel]) -> list[CppKernel]:
    """Publish the finished background builds of ``kernels`` (``CppKernel.publish``); call it
    between two steps only. Returns the kernels that became available."""
    return [k for k in kernels if k._background is not None and k.publish()]
