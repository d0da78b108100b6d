"""Build-once loading of kvflow's C++ CPU kernels from their source files (``kvflow/ops/csrc``).

Each kernel is one ``.cpp`` file, shipped in the package, holding its functions and their
Python bindings (``PYBIND11_MODULE``); a :class:`CppKernel` compiles it on first use with
``torch.utils.cpp_extension.load`` (a C++ compiler and ninja are needed; tens of seconds
the first time, then cached in the torch extensions folder, ``TORCH_EXTENSIONS_DIR``). The
build targets the host CPU (``-march=native``; ``KVFLOW_CPU_MARCH`` names another target,
e.g. ``x86-64-v3`` for an AVX2 machine without AVX-512), and the extension's name hashes
the source together with the host CPU's feature flags, the compiler flags and everything
else torch's build depends on (torch, Python, include paths: ``build_inputs``): a cached
build never runs on a CPU that lacks an instruction it was compiled for, an edited source
builds again, and two environments sharing one extensions folder never rebuild each
other's build. A cached build is imported straight from its library file (the name says
it is this build), without ``torch.utils.cpp_extension``, which imports setuptools and runs
ninja (0.3-0.7 s of each start on a 2-core EPYC); ``load`` is for builds. Each kernel keys its vectorized passes on the compiler's feature
macros (``__AVX512F__``, ``__AVX512BW__``, ``__AVX512BF16__``) and compiles a portable loop
where they are absent, so a CPU without AVX-512 (or a non-x86 one) gets a working, slower
kernel, not a failed build.

A build that is needed logs ``building the C++ <kernel> (once, 15-90 s)`` at INFO level on
logger ``kvflow.ops.build`` first (the CLI prints it to stderr unless ``--quiet``); a load
of a cached build that torch turns into a rebuild is logged after ``SLOW_LOAD_S``. One
process builds a kernel in one extensions folder at a time (an ``flock`` in its build
folder; another waits, saying so), and a torch build lock left by a builder that died is
removed. If the
build fails (no compiler, no ninja, a compile error), or the kernel's switch or
``KVFLOW_CPU_KERNELS`` is ``0`` (``kvflow.envs``), :meth:`CppKernel.load` returns None once
and for all and callers keep their PyTorch path.

Background builds (``start_background_builds``, what an engine on the CPU does at start
unless ``KVFLOW_CPU_KERNEL_BUILD=wait``): the missing kernels compile one after the other in
a child process (``python -m kvflow.ops --nice 10 <source>``) while ``load()`` returns None
at once, so the callers' PyTorch paths serve; a finished build becomes what ``load()``
returns only when the engine publishes it between two steps (``publish_background_builds``),
so that a step never runs the kernel for some layers and the PyTorch path for others. A
kernel that only the loaded model shows to be needed (the GGUF kernel) joins them later
(``join_background_builds``: appended to the list the engine publishes from).

Why at run time, not at install time or prebuilt per instruction set: see
``kvflow/ops/__init__.py``.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kvflow import envs

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
"""The folder of the kernels' source files (package data)."""

IN_BUILDER_CHILD = False
"""True in the builder child (``python -m kvflow.ops --parent PID``): it compiles in its own
process rather than starting another child."""

PACKAGE_ROOT = CSRC.parents[2]
"""The folder that holds this copy of the ``kvflow`` package (what the builder child imports)."""

SLOW_LOAD_S = 2.0
"""A load of a cached build that takes longer than this is a rebuild: it is logged then."""


def build_cflags() -> list[str]:
    """The compiler flags of the kernels: ``-O3 -march=$KVFLOW_CPU_MARCH`` (default
    ``native``), 512-bit vectors preferred where the target has them (x86 only), OpenMP."""
    flags = ["-O3", f"-march={envs.KVFLOW_CPU_MARCH}"]
    if platform.machine().lower() in ("x86_64", "amd64", "i686", "i386"):
        flags.append("-mprefer-vector-width=512")
    return flags + ["-fopenmp"]


def build_inputs() -> list[str]:
    """What torch's build of an extension depends on besides the source and the compiler
    flags (what its ninja file names): torch's version and C++ ABI, its include and library
    folders, Python's version and include folder, the interpreter, and the C++ compiler. Two
    environments (venvs) sharing one extensions folder differ in some of these, so their
    builds get different names rather than rebuilding each other's."""
    torch_dir = os.path.dirname(torch.__file__)  # torch.utils.cpp_extension's include_paths() / library_paths()
    include = os.path.join(torch_dir, "include")
    return [
        torch.__version__, str(torch._C._GLIBCXX_USE_CXX11_ABI), include,
        os.path.join(include, "torch", "csrc", "api", "include"), os.path.join(torch_dir, "lib"), sys.version,
        sysconfig.get_paths()["include"], sys.executable, envs.read("CXX") or "",
    ]


def extensions_dir() -> Path:
    """The folder under which torch builds extensions (``torch.utils.cpp_extension``'s
    ``_get_build_directory`` less the extension's name: ``$TORCH_EXTENSIONS_DIR``, else
    ``<user cache>/torch_extensions/py<version>_<accelerator>``), found without importing
    ``cpp_extension``: that module imports setuptools, 0.3-0.7 s of a start that only loads
    cached builds (``tests/ops/test_build.py`` checks the two agree)."""
    root = envs.read("TORCH_EXTENSIONS_DIR")
    if root is not None:
        return Path(root)
    if torch.version.hip is not None:
        accelerator = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        accelerator = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    from torch import _appdirs

    return Path(os.path.realpath(_appdirs.user_cache_dir(appname="torch_extensions"))) / f"{python}_{accelerator}"


@functools.cache
def host_cpu_flags() -> str:
    """The ``flags`` (x86) or ``Features`` (Arm) line of /proc/cpuinfo, '' if unreadable; read
    once a process (every build name hashes it, and a read of /proc/cpuinfo took ~8 ms in a
    VM: 0.4 s of a start's 54 reads)."""
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


def target_refused(cflags: list[str]) -> str:
    """The C++ compiler's complaint about the ``-m`` flags of ``cflags`` (an unknown
    ``KVFLOW_CPU_MARCH`` target, say ``znver99``): its first error line, '' when it takes
    them, for ``-march=native``, or when the compiler cannot be run.

    Without this check every kernel's build ran the compiler and failed, each with a warning
    that showed the start of the compiler's command line, not the variable to fix.
    """
    if "-march=native" in cflags:
        return ""
    try:
        done = subprocess.run([envs.read("CXX"), *[f for f in cflags if f.startswith("-m")], "-dM", "-E", "-x", "c++",
                               "-"], input="", capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return ""
    if done.returncode == 0:
        return ""
    lines = [line.strip() for line in done.stderr.splitlines() if "error" in line.lower()]
    return (lines or [done.stderr.strip() or f"exit status {done.returncode}"])[0]


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
        includes: other sources of ``kvflow/ops/csrc`` that ``source`` includes (``#include
            "gguf_matmul.cpp"``): their text joins the build's name, so an edit there builds
            this kernel again too.
    """

    def __init__(self, prefix: str, source: str | os.PathLike[str], switch: str, what: str,
                 includes: Sequence[str] = ()) -> None:
        if switch not in envs.SWITCHES:
            raise ValueError(f"{switch!r} is not a switch of kvflow.envs")
        self.prefix, self.switch, self.what = prefix, switch, what
        self.source_path = CSRC / source if isinstance(source, str) and os.sep not in source else Path(source)
        self.include_paths = tuple(self.source_path.parent / name for name in includes)
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
        the compiler flags, the source and its path (and the sources it includes), and ``build_inputs()`` (torch, Python,
        include paths, compiler): everything the build's ninja file names, so that two
        copies of kvflow or two environments sharing one extensions folder never find each
        other's build and have torch rebuild it in the foreground."""
        key = "\n".join([platform.machine(), host_cpu_flags(), " ".join(build_cflags()), self.source,
                         str(self.source_path), *build_inputs(), *(p.read_text() for p in self.include_paths)])
        return f"{self.prefix}_{hashlib.sha1(key.encode()).hexdigest()[:12]}"

    def _build_directory(self) -> Path:
        folder = extensions_dir() / self.build_name()
        folder.mkdir(parents=True, exist_ok=True)  # (as torch's _get_build_directory)
        return folder

    @contextlib.contextmanager
    def _sole_builder(self) -> Any:
        """Hold this kernel's builder lock in its build folder (``kvflow-builder.lock``, an
        ``flock``: the system releases it when its process dies, whatever the way): one
        builder per kernel per extensions folder; another waits (saying so) and then finds
        the build cached. Holding it, a torch build lock (``lock``) left in the folder is
        stale (its builder died mid-build: torch would wait on it forever) and is removed."""
        folder = self._build_directory()
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "kvflow-builder.lock", "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                logger.info("another process is building the C++ %s (%s); waiting for it", self.what, folder)
                fcntl.flock(f, fcntl.LOCK_EX)
            try:
                stale = folder / "lock"
                if stale.exists():
                    logger.warning("removing a stale build lock of the C++ %s (%s): its builder died", self.what, stale)
                    stale.unlink(missing_ok=True)
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _library(self) -> Path:
        """Where torch's build leaves the compiled module."""
        return extensions_dir() / self.build_name() / f"{self.build_name()}{'.pyd' if os.name == 'nt' else '.so'}"

    def is_built(self) -> bool:
        """Whether a compiled copy is in the extensions folder (loading it is then quick)."""
        return self._library().is_file()

    def _import_built(self) -> Any:
        """The compiled module imported straight from the extensions folder, or None where
        that fails (then torch's ``load`` builds it again). The build's name hashes the
        source, the flags and everything torch's build reads (``build_name``), so a library
        of that name is this build; torch's ``load`` would import the same file after running
        ninja to check it, and importing it needs no setuptools."""
        library = self._library()
        try:
            spec = importlib.util.spec_from_file_location(self.build_name(), library)
            module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
            spec.loader.exec_module(module)  # type: ignore[union-attr]
        except Exception as exc:  # noqa: BLE001 - a truncated or foreign file: torch's load rebuilds it
            logger.info("the cached build of the C++ %s did not load (%s: %.200s); building it again", self.what,
                        type(exc).__name__, str(exc))
            return None
        return module

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
        refused = target_refused(build_cflags())
        if refused:
            logger.warning("kvflow's %s is not built: the C++ compiler (%s) refuses KVFLOW_CPU_MARCH=%s (%s); "
                           "using the PyTorch path", self.what, envs.read("CXX"), envs.KVFLOW_CPU_MARCH, refused)
            return None
        missing = missing_cpu_features(build_cflags())
        if missing:
            logger.warning("kvflow's %s is not built: KVFLOW_CPU_MARCH=%s needs %s, which this CPU lacks; "
                           "using the PyTorch path", self.what, envs.KVFLOW_CPU_MARCH, ", ".join(missing))
            return None
        announced = False
        if not self.is_built() and not IN_BUILDER_CHILD:
            # Compile in the builder child (its compilers end with this process) rather than
            # under torch's load here: a build on first use (KVFLOW_CPU_KERNEL_BUILD=wait) of
            # a server stopped by SIGTERM left its ninja and compiler running, orphaned, and
            # the next start took their lock for stale and built beside them.
            if self._background is None and self.source_path.parent == CSRC:  # (background ones: announced at their start)
                logger.info("building the C++ %s (once, 15-90 s; cached afterwards)", self.what)
                announced = True
            self._compile_in_subprocess()
        if self.is_built():
            try:
                with self._sole_builder():  # (not while another process writes it)
                    module = self._import_built()
                    if module is None:  # torch's ninja finds the library newer than its object: it would
                        with contextlib.suppress(OSError):  # import the same file, not link it again
                            self._library().unlink()  # (unlinked, never overwritten: a process that maps it keeps it)
            except OSError as exc:  # a folder this process cannot write (a shared, read-only one): no builder there
                logger.info("the build folder of the C++ %s cannot be locked (%s); importing its cached build unlocked",
                            self.what, exc)
                module = self._import_built()
            if module is not None:
                return module
        try:
            from torch.utils.cpp_extension import load

            with self._sole_builder():
                announce = None
                if not self.is_built():
                    if not announced:
                        logger.info("building the C++ %s (once, 15-90 s; cached afterwards)", self.what)
                else:  # torch's load may still find the cached build out of date and rebuild it
                    announce = threading.Timer(SLOW_LOAD_S, logger.info, args=(
                        "building the C++ %s again (torch found its cached build out of date; 15-90 s)", self.what))
                    announce.daemon = True
                    announce.start()
                try:
                    return load(
                        name=self.build_name(),
                        sources=[str(self.source_path)],
                        extra_cflags=build_cflags(),
                        extra_ldflags=["-fopenmp"],
                        verbose=False,
                    )
                finally:
                    if announce is not None:
                        announce.cancel()
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
            self._built = self._build()  # (compiled in the builder child: _compile_in_subprocess)
        finally:
            if done is not None:
                done.set()

    def _compile_in_subprocess(self) -> None:
        """Compile one of the package's kernels in a child process (``python -m kvflow.ops
        --nice 10 --parent <this pid> <source>``, its own session, output discarded) and
        wait for it; the in-process ``load`` that follows then finds the build cached (about
        a second). The child ends, with its compilers, when this process does (``--parent``);
        the build lock torch leaves then is recovered by the next builder
        (``_sole_builder``)."""
        if self.source_path.parent != CSRC:
            return
        # The child imports this copy of kvflow, whatever its working directory and sys.path
        # (a script that put this checkout on sys.path, another kvflow installed): else it
        # built the other copy's kernels and this one's build ran here, unniced, afterwards.
        # An installed copy (site-packages) is left to the interpreter's own order: that folder
        # ahead of the standard library would let a backport installed there shadow it.
        env = dict(os.environ)
        if PACKAGE_ROOT.name not in ("site-packages", "dist-packages"):
            env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_ROOT), *filter(None, [env.get("PYTHONPATH")])])
        try:
            subprocess.run([sys.executable, "-m", "kvflow.ops", "--nice", "10", "--parent", str(os.getpid()),
                            self.source_path.name],
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True, check=False, env=env)
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


def end_with_parent(pid: int, interval_s: float = 1.0) -> threading.Thread:
    """End this process when process ``pid`` (the one that started it) is gone: a daemon
    thread checks every ``interval_s`` seconds, then, when this process leads its own
    process group (a builder started with ``start_new_session``), sends SIGTERM to the group
    (the compiler and ninja of a build under way), and exits with status 1.

    Returns:
        The watching thread (started).
    """

    is_parent = os.getppid() == pid

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            except PermissionError:
                pass
            if is_parent and os.getppid() != pid:  # reparented: the parent is gone (or a zombie)
                break
        logger.warning("the process that started this build (pid %d) is gone; ending the build", pid)
        try:
            if os.getpgrp() == os.getpid():
                os.killpg(os.getpgrp(), signal.SIGTERM)
        finally:
            os._exit(1)

    thread = threading.Thread(target=watch, daemon=True, name="kvflow-end-with-parent")
    thread.start()
    return thread


def start_background_builds(kernels: Sequence[CppKernel]) -> list[CppKernel]:
    """Build those of ``kernels`` that are enabled and not in the extensions folder one after
    the other, from one daemon thread, in the order given (one compiler at a time, in a
    child process at nice 10, so that serving keeps the cores); load the cached ones now. Until an engine publishes a
    finished one between two steps (:func:`publish_background_builds`), its ``load()``
    returns None and callers run their PyTorch paths.

    Returns:
        The kernels being built in the background (already under way ones included).
    """
    global _SESSION
    _SESSION = _start(kernels)
    return _SESSION


def join_background_builds(kernel: CppKernel) -> bool:
    """Add ``kernel`` to the background builds this process started last
    (:func:`start_background_builds`): for a kernel that only the loaded model shows to be
    needed (the GGUF kernel of a GGUF model, whose weights load after the engine started its
    builds). It builds the same way (child process, after the kernels queued before it) and
    is appended to the list that call returned, which the engine publishes between steps.

    Returns:
        True when the kernel builds in the background (``load()`` returns None until it is
        published); False when no background builds were started in this process
        (``KVFLOW_CPU_KERNEL_BUILD=wait``, tensor parallelism, not on the CPU: the kernel then
        builds on its first use), or when it is cached (loaded now) or disabled.
    """
    session = _SESSION
    if session is None or envs.KVFLOW_CPU_KERNEL_BUILD != "background":
        return False
    if kernel not in session:
        session.extend(_start([kernel]))
    return kernel in session


_QUEUED: set[CppKernel] = set()
_SESSION: list[CppKernel] | None = None  # what the last start_background_builds returned
_ONE_AT_A_TIME = threading.Lock()  # one compiler at a time across the builder threads


def _start(kernels: Sequence[CppKernel]) -> list[CppKernel]:
    pending = [k for k in kernels if k._claim_background()]
    fresh = [k for k in pending if not k._background.is_set() and k not in _QUEUED]  # type: ignore[union-attr]
    if fresh:
        _QUEUED.update(fresh)
        logger.info("building kvflow's C++ %s in the background (about 15-90 s each on 2 cores); PyTorch's operators "
                    "serve meanwhile", ", ".join(k.what for k in fresh))
        threading.Thread(target=_build_all, args=(fresh,), daemon=True, name="kvflow-kernel-build").start()
    return pending


def _build_all(kernels: list[CppKernel]) -> None:
    for kernel in kernels:
        try:
            with _ONE_AT_A_TIME:
                kernel._build_in_background()
        finally:
            _QUEUED.discard(kernel)


def publish_background_builds(kernels: Sequence[CppKernel]) -> list[CppKernel]:
    """Publish the finished background builds of ``kernels`` (``CppKernel.publish``); call it
    between two steps only. Returns the kernels that became available."""
    return [k for k in kernels if k._background is not None and k.publish()]
