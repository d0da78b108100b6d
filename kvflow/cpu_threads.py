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
--contention`` (docs/benchmarks.md, "On a shared machine").

libgomp reads the wait variables once, when it is loaded, i.e. when ``torch`` is first
imported: ``import kvflow`` sets them first (the ``kvflow`` command always does). A program
that imports torch before kvflow keeps libgomp's default; the governor still lowers the
thread count under load (an idle worker spins its 300,000 rounds, then sleeps), and with the
governor off ``check_wait_policy`` logs how to change it when the machine is busy. A policy
the user set is kept; ``KVFLOW_OMP_DEFAULTS=0`` leaves the environment alone.

This module must not import torch.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterator

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
    with the thread governor (``KVFLOW_CPU_ADAPTIVE_THREADS``, on by default), else (and in a
    torchrun rank of a world larger than 1) ``OMP_WAIT_POLICY=PASSIVE``.

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
    # (Tensor-parallel ranks run no governor: under torchrun every rank is started with
    # WORLD_SIZE > 1 and sleeps; spawned ranks get it from sleeping_workers_for_children.)
    governed = envs.read("KVFLOW_CPU_ADAPTIVE_THREADS", env) and _world_size(env) <= 1
    name, value = ADAPTIVE_WAIT if governed else FIXED_WAIT
    env[name] = value
    if environ is None:
        _state["applied"] = True
    return True


def _world_size(env) -> int:
    try:
        return int(envs.read("WORLD_SIZE", env) or 1)
    except ValueError:
        return 1


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
                paths = sorted({line.split()[5] for line in f if len(line.split()) == 6 and "libgomp" in line})
        except OSError:
            paths = []
        for path in paths:
            try:
                candidate = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)  # the loaded copy, never a new one
            except OSError:
                continue
            if hasattr(candidate, "omp_pause_resource_all"):
                lib = candidate
                break
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
def read_cpu_times(cpus: set[int] | None = None, nice_is_busy: bool = True, path: str = "/proc/stat") -> float | None:
    """CPU time spent busy since boot on ``cpus`` (all CPUs when None), in seconds, from the
    per-CPU lines of ``/proc/stat`` (proc(5): user, nice, system, idle, iowait, irq, softirq,
    steal, ...; in ``USER_HZ`` ticks). Busy is user + system + irq + softirq + steal (time the
    hypervisor gave to someone else is not ours either) and ``nice`` (time of niced processes),
    unless ``nice_is_busy`` is False. A niced process yields only to threads of its own
    session or cgroup: with the scheduler's autogroups (``/proc/sys/kernel/sched_autogroup_enabled``,
    one group per session) a busy loop started with ``setsid nice -n 10`` took its core from
    a 2-thread OpenMP team like any process (SmolLM2 single stream 0.8-1.6 tok/s, one thread
    150-167; session 36).

    Args:
        cpus: CPU numbers to count.
        nice_is_busy: count the nice column too (the default).
        path: the file to read (a test's fake).

    Returns:
        Seconds, or None where ``/proc/stat`` cannot be read (not Linux) or lists none of
        ``cpus`` (a container whose ``/proc/stat`` numbers its CPUs differently).
    """
    try:
        with open(path, encoding="ascii") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    ticks, seen = 0, False
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
            seen = True
            ticks += user + system + irq + softirq + steal + (nice if nice_is_busy else 0)
    return ticks / os.sysconf("SC_CLK_TCK") if seen else None


class ThreadGovernor:
    """Fits the number of intra-op threads to the CPUs that other processes leave free.

    Every ``interval_s`` (checked by ``update``, which the engine calls between two steps on
    the thread that runs its forwards) it measures, over the CPUs this process may use
    (``n`` of them): ``busy``, their busy CPU time (``read_cpu_times``), and ``got``, the part
    other processes received (``busy`` minus this process's CPU time, ``time.process_time``),
    both in cores. What other processes *wanted* (``others``) is ``got`` while the CPUs had
    idle time; when they were saturated (``busy >= n - 0.1``) the fair share CFS gives
    ``t`` runnable threads of kvflow and ``k`` of theirs (``got = n k / (t + k)``) gives
    ``others = k = got t / (n - got)``, at most ``n``: one busy-looping process against two
    spinning threads on 2 CPUs gets 0.67 of a core and reads as 1.0. With ``free = n - others``
    the thread count drops at once to ``floor(free + 0.5 + hysteresis)`` when that is below
    it, and rises to ``floor(free + 0.5 - hysteresis)`` (never above ``max_threads``) once
    that has been above it for two intervals in a row. On 2 CPUs with 2 threads: one thread
    while others want more than 0.65 of a core, two again below 0.35. The count is never above
    ``n``. Why: a spinning OpenMP worker on a core another process wants slows every parallel
    region (this module's docstring has the numbers); one thread less costs less than that.

    Args:
        max_threads: the most threads to run (the configured count); >= 1.
        cpus: the CPUs this process may use (default: its affinity, ``sched_getaffinity``).
        interval_s: seconds between two measurements.
        hysteresis: cores, the dead band around each rounding threshold.
        read_busy: () -> busy CPU seconds on ``cpus`` (default ``read_cpu_times``, niced
            processes counted); None from it disables the governor.
        read_self: () -> this process's CPU seconds (default ``time.process_time``).
        clock: () -> wall seconds (default ``time.monotonic``).

    Raises:
        ValueError: ``max_threads`` < 1, ``interval_s`` <= 0, or ``hysteresis`` outside
            [0, 0.5).
    """

    SATURATED = 0.1  # cores of idle time below which the CPUs count as saturated

    def __init__(self, max_threads: int, *, cpus: set[int] | None = None, interval_s: float = 0.25,
                 hysteresis: float = 0.15, read_busy: Callable[[], float | None] | None = None,
                 read_self: Callable[[], float] | None = None, clock: Callable[[], float] | None = None) -> None:
        if not 0 < interval_s < float("inf"):
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        if not 0 <= hysteresis < 0.5:
            raise ValueError(f"hysteresis must be in [0, 0.5), got {hysteresis}")
        if cpus is None:
            cpus = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
        self.cpus = set(cpus)
        self.interval_s = interval_s
        self.hysteresis = hysteresis
        if read_busy is None:
            read_busy = lambda: read_cpu_times(self.cpus)  # noqa: E731
        self.read_busy = read_busy
        self.read_self = read_self or time.process_time
        self.clock = clock or time.monotonic
        self.others = 0.0  # cores other processes wanted, the last measurement
        self.reserved = 0  # cores kept free for this process's own children (update's argument)
        self.num_changes = 0
        self.set_max_threads(max_threads)
        self._last: tuple[float, float, float] | None = None
        self.enabled = self._sample() is not None

    def _sample(self) -> tuple[float, float, float] | None:
        busy = self.read_busy()
        if busy is None:
            return None
        self._last = (self.clock(), busy, self.read_self())
        return self._last

    def set_max_threads(self, max_threads: int) -> None:
        """A new configured count (an engine with an explicit ``num_threads``): run it from
        the next ``update`` on (at most the number of CPUs).

        Raises:
            ValueError: ``max_threads`` < 1.
        """
        if max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {max_threads}")
        self.max_threads = max_threads
        self.threads = min(max_threads, len(self.cpus))
        self._up_votes = 0

    def update(self, reserved: int = 0) -> int:
        """Measure if ``interval_s`` has passed and change the thread count if it should.

        Args:
            reserved: cores other processes want at least, whatever the last measurement
                read: this process's children that it knows are busy (the C++ kernels
                compiling in the background: ``CpuPlatform.between_steps``), at once rather
                than from the next measurement (which counts them too). A change of it
                applies at once: lowering at once, raising after the usual two intervals.

        Returns:
            The thread count to run now (the caller applies it on its own thread:
            ``torch.set_num_threads`` is per OS thread under OpenMP).
        """
        if not self.enabled:
            return self.threads
        now = self.clock()
        then, busy_then, self_then = self._last
        if now - then >= self.interval_s:
            sample = self._sample()
            if sample is None:
                self.enabled = False
                return self.threads
            _, busy, own = sample
            n, seconds = len(self.cpus), now - then
            total = max(0.0, busy - busy_then) / seconds
            got = min(float(n), max(0.0, (busy - busy_then) - (own - self_then)) / seconds)
            if total >= n - self.SATURATED and got > 0:
                self.others = min(float(n), got * self.threads / max(n - got, 1e-3))
            else:
                self.others = got
        elif reserved == self.reserved:
            return self.threads
        self.reserved = reserved
        n = len(self.cpus)
        free = n - min(float(n), max(self.others, float(reserved)))
        h = self.hysteresis
        cap = min(self.max_threads, n)
        down = max(1, min(cap, math.floor(free + 0.5 + h)))
        up = max(1, min(cap, math.floor(free + 0.5 - h)))
        if down < self.threads:
            target = down
            self._up_votes = 0
        elif up > self.threads:
            self._up_votes += 1
            if self._up_votes < 2:
                return self.threads
            target = up
            self._up_votes = 0
        else:
            self._up_votes = 0
            return self.threads
        logger.debug("other processes want %.2f of %d CPUs, %d reserved: %d -> %d intra-op threads",
                     self.others, n, reserved, self.threads, target)
        self.threads = target
        self.num_changes += 1
        return target


# Variables with which the user places OpenMP threads on CPUs: the governor then stays off
# (libgomp pins the loading thread, and the affinity it reads would be one CPU).
BINDING_VARIABLES = ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY")
_governor: list[ThreadGovernor] = []  # the process's one governor, once made


def thread_governor(max_threads: int, explicit: bool) -> ThreadGovernor | None:
    """The process's thread governor (one for all engines in the process), made on the first
    call; None when ``KVFLOW_CPU_ADAPTIVE_THREADS=0``, when OpenMP threads are bound to CPUs
    (``OMP_PROC_BIND`` other than ``false``, ``OMP_PLACES`` or ``GOMP_CPU_AFFINITY`` set), or
    when the CPU times cannot be read.

    Args:
        max_threads: the thread count to start from (the configured count, or torch's).
        explicit: ``max_threads`` is a configured count (an engine's ``num_threads``): an
            existing governor takes it as its new maximum; else the existing maximum stays
            (torch's count may be the governor's own lowered one).
    """
    if not envs.read("KVFLOW_CPU_ADAPTIVE_THREADS"):
        return None
    bind = envs.read("OMP_PROC_BIND")
    if (bind and bind.lower() != "false") or envs.read("OMP_PLACES") or envs.read("GOMP_CPU_AFFINITY"):
        return None
    if _governor:
        governor = _governor[0]
        if explicit:
            governor.set_max_threads(max_threads)
        return governor if governor.enabled else None
    governor = ThreadGovernor(max_threads)
    _governor.append(governor)
    return governor if governor.enabled else None


@contextlib.contextmanager
def sleeping_workers_for_children() -> Iterator[None]:
    """While open, processes started from here (tensor-parallel ranks, which run no governor)
    inherit ``OMP_WAIT_POLICY=PASSIVE`` instead of the short spin ``import kvflow`` set for
    this process; a policy the user chose is inherited unchanged."""
    if not _state["applied"] or envs.read(ADAPTIVE_WAIT[0]) != ADAPTIVE_WAIT[1]:
        yield
        return
    os.environ.pop(ADAPTIVE_WAIT[0])
    os.environ[FIXED_WAIT[0]] = FIXED_WAIT[1]
    try:
        yield
    finally:
        os.environ.pop(FIXED_WAIT[0], None)
        os.environ[ADAPTIVE_WAIT[0]] = ADAPTIVE_WAIT[1]
