"""How kvflow's CPU threads wait and how many run: OpenMP's wait policy, chosen before
PyTorch loads libgomp, and a governor that fits the thread count to the free CPUs.

PyTorch's CPU operators, oneDNN, MKL and kvflow's C++ kernels run their parallel loops on
one OpenMP thread team (libgomp in the PyTorch wheels). Between two parallel regions the
team's worker threads wait: they spin on a core for ``GOMP_SPINCOUNT`` rounds (libgomp's
default 300,000, milliseconds), then sleep. A decode step of a small model is a few hundred
short regions, so how the workers wait decides its speed:

- on a machine to itself, spinning is what makes two threads fast: a sleeping worker takes a
  futex wake-up per region. SmolLM2-135M bfloat16 single-stream decode on the 2-core
  development machine: 33 tok/s with spinning workers, 20 with sleeping ones
  (``OMP_WAIT_POLICY=PASSIVE``), 22 with one thread;
- when another process holds a core, a spinning worker takes CPU time from the thread with
  real work (kvflow's main thread, or the team member the next region waits for): with one
  busy-looping process, 7.7 tok/s spinning, 19 sleeping, 21 with one thread.

So kvflow (a) sets a short spin, ``GOMP_SPINCOUNT=10000`` (about 0.1 ms; 31 tok/s quiet),
when neither ``OMP_WAIT_POLICY`` nor ``GOMP_SPINCOUNT`` is set, and (b) runs a
``ThreadGovernor`` between engine steps that measures the CPU time other processes take on
this process's CPUs and lowers ``torch.set_num_threads`` when they leave fewer cores free
than it has threads (back up once they are free again): 31 tok/s quiet and 21 under one
busy core, the better of both columns above. ``KVFLOW_CPU_ADAPTIVE_THREADS=0`` turns the
governor off; the wait policy is then ``OMP_WAIT_POLICY=PASSIVE`` (sleeping workers: never
the slow case, never the fast one). Measured with ``python -m benchmarks.throughput
--contention`` (README, "On a shared machine").

libgomp reads the wait variables once, when it is loaded, i.e. when ``torch`` is first
imported: ``import kvflow`` sets them first (the ``kvflow`` command always does). A program
that imports torch before kvflow keeps libgomp's default; the governor still lowers the
thread count under load (an idle worker spins its 300,000 rounds, then sleeps), and with the
governor off ``check_wait_policy`` logs how to change it when the machine is busy. A policy
the user set is kept; ``KVFLOW_OMP_DEFAULTS=0`` leaves the environment alone.

This module must not import torch.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Callable

from kvflow import envs

logger = logging.getLogger(__name__)

# The variables that decide how libgomp's threads wait (read once, when it loads).
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
# What kvflow sets: with the thread governor, a short spin; without it, sleeping workers.
ADAPTIVE_WAIT = ("GOMP_SPINCOUNT", "10000")
FIXED_WAIT = ("OMP_WAIT_POLICY", "PASSIVE")
_state = {"applied": False, "too_late": False, "warned": False}


def set_openmp_defaults(environ: dict[str, str] | None = None) -> bool:
    """Set kvflow's wait policy unless the user chose one, kvflow's defaults are switched off
    (``KVFLOW_OMP_DEFAULTS=0``) or torch is already imported (too late): ``GOMP_SPINCOUNT=10000``
    with the thread governor (``KVFLOW_CPU_ADAPTIVE_THREADS``, on by default), else
    ``OMP_WAIT_POLICY=PASSIVE``.

    Args:
        environ: the environment to change (default ``os.environ``).

    Returns:
        Whether the default was set now.
    """
    env = os.environ if environ is None else environ
    if not envs.read("KVFLOW_OMP_DEFAULTS", env) or any(envs.read(v, env) for v in WAIT_VARIABLES):
        return False
    if "torch" in sys.modules:  # libgomp already read its environment
        if environ is None:
            _state["too_late"] = True
        return False
    name, value = ADAPTIVE_WAIT if envs.read("KVFLOW_CPU_ADAPTIVE_THREADS", env) else FIXED_WAIT
    env[name] = value
    if environ is None:
        _state["applied"] = True
    return True


def check_wait_policy() -> None:
    """Log once, as a warning, when libgomp's spinning default is in force (torch was
    imported before kvflow, nothing set the policy) and the machine is busy (1-minute load
    average above the number of CPUs this process may use minus one) and the thread governor
    is off (``KVFLOW_CPU_ADAPTIVE_THREADS=0``): the slowdown can be 10x. On a quiet machine,
    with a policy chosen, or with the governor on (it lowers the thread count under load),
    says nothing."""
    if not _state["too_late"] or _state["warned"] or any(envs.read(v) for v in WAIT_VARIABLES):
        return
    if envs.read("KVFLOW_CPU_ADAPTIVE_THREADS"):
        return
    try:
        load = os.getloadavg()[0]
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    except OSError:
        return
    if load > cpus - 1:
        _state["warned"] = True
        logger.warning(
            "the machine is busy (load %.1f on %d CPUs) and PyTorch's OpenMP threads spin-wait, which can make "
            "kvflow 10x slower under contention: set OMP_WAIT_POLICY=PASSIVE before starting Python, or import "
            "kvflow before torch (it sets that default), or leave KVFLOW_CPU_ADAPTIVE_THREADS on", load, cpus)


# ------------------------------------------------------------------ one OpenMP master thread
_libgomp: list = []  # [ctypes.CDLL | None], once looked up


def _openmp_runtime():
    """The process's OpenMP runtime (the libgomp PyTorch loaded, found in /proc/self/maps),
    as a ctypes library, or None."""
    if not _libgomp:
        import ctypes

        lib = None
        try:
            with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
                paths = sorted({line.split()[-1] for line in f if "libgomp" in line and "/" in line})
            for path in paths:
                candidate = ctypes.CDLL(path)
                if hasattr(candidate, "omp_pause_resource_all"):
                    lib = candidate
                    break
        except OSError:
            lib = None
        _libgomp.append(lib)
    return _libgomp[0]


def release_openmp_threads() -> bool:
    """Let go of the calling thread's OpenMP worker threads (OpenMP 5.0
    ``omp_pause_resource_all(omp_pause_soft)``, section 3.2.44: libgomp ends them and stops
    counting them), for a caller that hands its forwards to another thread.

    Why: each thread that starts a parallel region owns a team of workers, and once libgomp
    manages more threads than there are CPUs it cuts every spin to 100 rounds (libgomp
    manual, ``GOMP_SPINCOUNT``), which is nearly as slow as sleeping. The server loads the
    model on the main thread (one team) and steps on its engine thread (a second one): 2
    CPUs, 4 threads. Measured on the 2-core machine, SmolLM2-135M bfloat16 single stream:
    stepping on a second thread 18-20 tok/s, the same after releasing the loading thread's
    workers 27-28, stepping on the loading thread 27-28. A later parallel region on the
    calling thread makes a new team (correct, and throttled again while both live).

    Returns:
        Whether the workers were released (False where no libgomp with OpenMP 5.0 is loaded,
        e.g. PyTorch built with another OpenMP runtime, or not Linux).
    """
    lib = _openmp_runtime()
    if lib is None:
        return False
    omp_pause_soft = 1
    return lib.omp_pause_resource_all(omp_pause_soft) == 0


# ---------------------------------------------------------------------------- the governor
def read_cpu_times(cpus: set[int] | None = None, nice_is_busy: bool = False, path: str = "/proc/stat") -> float | None:
    """CPU time spent busy since boot on ``cpus`` (all CPUs when None), in seconds, from the
    per-CPU lines of ``/proc/stat`` (proc(5): user, nice, system, idle, iowait, irq, softirq,
    steal, ...; in ``USER_HZ`` ticks). Busy is user + system + irq + softirq + steal (time the
    hypervisor gave to someone else is not ours either); ``nice`` (time of niced processes,
    which yield to a normal-priority thread) counts only with ``nice_is_busy``.

    Args:
        cpus: CPU numbers to count.
        nice_is_busy: count the nice column too.
        path: the file to read (a test's fake).

    Returns:
        Seconds, or None where ``/proc/stat`` cannot be read (not Linux).
    """
    try:
        with open(path, encoding="ascii") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    ticks = 0
    for line in lines:
        if not line.startswith("cpu") or line.startswith("cpu "):
            continue
        fields = line.split()
        try:
            cpu = int(fields[0][3:])
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
        except (ValueError, IndexError):
            continue
        if cpus is None or cpu in cpus:
            ticks += user + system + irq + softirq + steal + (nice if nice_is_busy else 0)
    return ticks / os.sysconf("SC_CLK_TCK")


class ThreadGovernor:
    """Fits the number of intra-op threads to the CPUs that other processes leave free.

    Every ``interval_s`` (0.25 s; checked by ``update``, which the engine calls between two steps,
    never inside a forward) it measures the other processes' CPU use on this process's CPUs:
    ``others = (busy CPU time on those CPUs - this process's CPU time) / wall time``, in
    cores (``read_cpu_times`` and ``time.process_time``). The cores left to kvflow are
    ``free = len(cpus) - others``; the thread count goes down to ``round(free)`` at once when
    ``free`` falls more than ``hysteresis`` below the current count's rounding threshold, and
    back up (never above ``max_threads``) once ``free`` has been ``hysteresis`` above the
    next count's threshold for two intervals in a row. On 2 CPUs with 2 threads: one thread
    while others take more than 0.65 cores, two again below 0.35. Why: a spinning OpenMP
    worker on a core another process wants slows every parallel region (``kvflow.cpu_threads``'
    docstring has the numbers); one thread less costs less than that.

    Args:
        max_threads: the most threads to run (the configured count); >= 1.
        set_threads: called with the new count (the engine passes ``torch.set_num_threads``;
            OpenMP keeps the count per calling thread, so call ``update`` on the thread that
            runs the forwards).
        cpus: the CPUs this process may run on (default: its affinity).
        interval_s: seconds between two measurements.
        hysteresis: cores, the dead band around each rounding threshold.
        read_busy: () -> busy CPU seconds on ``cpus`` (default ``read_cpu_times``; None from
            it disables the governor).
        read_self: () -> this process's CPU seconds (default ``time.process_time``).
        clock: () -> wall seconds (default ``time.monotonic``).

    Raises:
        ValueError: ``max_threads`` < 1, ``interval_s`` <= 0, or ``hysteresis`` outside
            [0, 0.5).
    """

    def __init__(self, max_threads: int, set_threads: Callable[[int], None], *, cpus: set[int] | None = None,
                 interval_s: float = 0.25, hysteresis: float = 0.15,
                 read_busy: Callable[[], float | None] | None = None,
                 read_self: Callable[[], float] | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {max_threads}")
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        if not 0 <= hysteresis < 0.5:
            raise ValueError(f"hysteresis must be in [0, 0.5), got {hysteresis}")
        if cpus is None:
            cpus = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
        self.cpus = cpus
        self.max_threads = max_threads
        self.threads = max_threads
        self.set_threads = set_threads
        self.interval_s = interval_s
        self.hysteresis = hysteresis
        if read_busy is None:
            niced = _niced()
            read_busy = lambda: read_cpu_times(cpus, nice_is_busy=niced)  # noqa: E731
        self.read_busy = read_busy
        self.read_self = read_self or time.process_time
        self.clock = clock or time.monotonic
        self.others = 0.0  # cores, the last measurement
        self.num_changes = 0
        self._up_votes = 0
        self._last: tuple[float, float, float] | None = None
        self.enabled = self._sample() is not None

    def _sample(self) -> tuple[float, float, float] | None:
        busy = self.read_busy()
        if busy is None:
            return None
        self._last = (self.clock(), busy, self.read_self())
        return self._last

    def set_max_threads(self, max_threads: int) -> None:
        """A new configured count (an engine with an explicit ``num_threads``): run it now."""
        if max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {max_threads}")
        self.max_threads = self.threads = max_threads
        self._up_votes = 0
        self.set_threads(max_threads)

    def update(self) -> int | None:
        """Measure if ``interval_s`` has passed and change the thread count if it should.

        Returns:
            The new thread count when it changed, else None.
        """
        if not self.enabled or self._last is None:
            return None
        now = self.clock()
        then, busy_then, self_then = self._last
        if now - then < self.interval_s:
            return None
        sample = self._sample()
        if sample is None:
            self.enabled = False
            return None
        _, busy, own = sample
        self.others = max(0.0, (busy - busy_then) - (own - self_then)) / (now - then)
        free = len(self.cpus) - self.others
        h = self.hysteresis
        down = max(1, min(self.max_threads, math.floor(free + 0.5 + h)))
        up = max(1, min(self.max_threads, math.floor(free + 0.5 - h)))
        if down < self.threads:
            target = down
            self._up_votes = 0
        elif up > self.threads:
            self._up_votes += 1
            if self._up_votes < 2:
                return None
            target = up
            self._up_votes = 0
        else:
            self._up_votes = 0
            return None
        self.threads = target
        self.num_changes += 1
        self.set_threads(target)
        logger.debug("other processes take %.2f of %d CPUs: %d intra-op threads", self.others, len(self.cpus), target)
        return target


def _niced() -> bool:
    """Whether this process runs niced (its own CPU time is then in /proc/stat's nice column)."""
    try:
        return os.getpriority(os.PRIO_PROCESS, 0) > 0
    except (AttributeError, OSError):
        return False


_governor: list[ThreadGovernor] = []  # the process's one governor, once made


def thread_governor(max_threads: int, set_threads: Callable[[int], None], explicit: bool) -> ThreadGovernor | None:
    """The process's thread governor (one: ``torch.set_num_threads`` is process-wide state),
    made on the first call; None when ``KVFLOW_CPU_ADAPTIVE_THREADS=0`` or the CPU times
    cannot be read.

    Args:
        max_threads: the thread count to start from (the configured count, or torch's).
        set_threads: ``torch.set_num_threads``.
        explicit: ``max_threads`` is a configured count (an engine's ``num_threads``): an
            existing governor takes it as its new maximum; else the existing maximum stays
            (torch's count may be the governor's own lowered one).
    """
    if not envs.read("KVFLOW_CPU_ADAPTIVE_THREADS"):
        return None
    if _governor:
        governor = _governor[0]
        if explicit and max_threads != governor.max_threads:
            governor.set_max_threads(max_threads)
        return governor if governor.enabled else None
    governor = ThreadGovernor(max_threads, set_threads)
    _governor.append(governor)
    return governor if governor.enabled else None
