"""How kvflow's CPU threads wait: OpenMP's wait policy, chosen before PyTorch loads libgomp.

PyTorch's CPU operators, oneDNN, MKL and kvflow's C++ kernels run their parallel loops on
one OpenMP thread team (libgomp in the PyTorch wheels). Between two parallel regions the
team's worker threads wait; libgomp's default is to spin on a core for up to 300,000 rounds
(milliseconds) before sleeping. On a machine to itself that only burns idle cores, but when
another process holds a core, a spinning worker takes CPU time from the thread that has
real work (kvflow's own main thread, or the team member the next region waits for). On the
2-core development machine, shared with other jobs (about 1.5 cores of their load) plus one
busy-looping process, 8 requests of the throughput benchmark in bfloat16 took 126 s with
libgomp's default and 8.8 s with sleeping workers; spinning 10,000 rounds took 19-26 s,
1,000 rounds 8-11 s, one thread 9 s (``python -m benchmarks.throughput --contention``;
README, "On a shared machine").

kvflow therefore sets ``OMP_WAIT_POLICY=PASSIVE`` (workers sleep as soon as a region ends)
when neither ``OMP_WAIT_POLICY`` nor ``GOMP_SPINCOUNT`` is set. libgomp reads these once,
when it is loaded, i.e. when ``torch`` is first imported: ``import kvflow`` does it first
(the ``kvflow`` command always does). A program that imports torch before kvflow keeps
libgomp's default; ``check_wait_policy`` then logs how to change it when the machine is
busy. To keep spinning (a machine with cores to spare), set ``OMP_WAIT_POLICY=ACTIVE`` or a
``GOMP_SPINCOUNT`` before starting Python; ``KVFLOW_OMP_DEFAULTS=0`` leaves the
environment alone.

This module must not import torch.
"""

from __future__ import annotations

import logging
import os
import sys

from kvflow import envs

logger = logging.getLogger(__name__)

# The variables that decide how libgomp's threads wait (read once, when it loads).
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
DEFAULT_WAIT_POLICY = "PASSIVE"
_state = {"applied": False, "too_late": False, "warned": False}


def set_openmp_defaults(environ: dict[str, str] | None = None) -> bool:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` unless the user chose a wait policy, kvflow's defaults
    are switched off (``KVFLOW_OMP_DEFAULTS=0``) or torch is already imported (too late).

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
    env["OMP_WAIT_POLICY"] = DEFAULT_WAIT_POLICY
    if environ is None:
        _state["applied"] = True
    return True


def check_wait_policy() -> None:
    """Log once, as a warning, when libgomp's spinning default is in force (torch was
    imported before kvflow, nothing set the policy) and the machine is busy (1-minute load
    average above the number of CPUs this process may use minus one): the slowdown can be
    10x. On a quiet machine, or with a policy chosen, says nothing."""
    if not _state["too_late"] or _state["warned"] or any(envs.read(v) for v in WAIT_VARIABLES):
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
            "kvflow before torch (it sets that default)", load, cpus)
