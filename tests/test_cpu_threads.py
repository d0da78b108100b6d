"""kvflow.cpu_threads: the OpenMP wait policy kvflow picks before torch loads libgomp."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

import kvflow.cpu_threads as cpu_threads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _spincount(code: str, **env: str) -> str:
    """GOMP_SPINCOUNT as libgomp itself reports it (OMP_DISPLAY_ENV=VERBOSE, printed when it
    loads) in a fresh interpreter running ``code``."""
    environ = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KVFLOW_OMP_DEFAULTS")}
    environ.update(env, OMP_DISPLAY_ENV="VERBOSE", PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = [line.split("=", 1)[1].strip().strip("'") for line in done.stderr.splitlines() if "GOMP_SPINCOUNT =" in line]
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_import_kvflow_makes_libgomp_threads_sleep():
    """`import kvflow` first: libgomp loads with OMP_WAIT_POLICY=PASSIVE (spin count 0)
    instead of its default of spinning 300000 rounds (a policy the user set is kept: next
    test)."""
    assert _spincount("import kvflow") == "0"
    assert _spincount("import kvflow", KVFLOW_OMP_DEFAULTS="0") == "300000"


def test_defaults_respect_the_user_and_the_import_order(monkeypatch):
    env: dict[str, str] = {}
    monkeypatch.delitem(sys.modules, "torch")  # as before torch is imported
    assert cpu_threads.set_openmp_defaults(env) and env == {"OMP_WAIT_POLICY": "PASSIVE"}
    for chosen in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "1"}, {"KVFLOW_OMP_DEFAULTS": "0"}):
        env = dict(chosen)
        assert not cpu_threads.set_openmp_defaults(env) and env == chosen
    monkeypatch.undo()
    env = {}
    assert "torch" in sys.modules and not cpu_threads.set_openmp_defaults(env) and env == {}  # too late


@pytest.mark.parametrize("load, warned", [(5.0, True), (0.2, False)])
def test_a_busy_machine_with_spinning_threads_gets_a_hint(monkeypatch, caplog, load, warned):
    monkeypatch.setattr(cpu_threads, "_state", {"applied": False, "too_late": True, "warned": False})
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    with caplog.at_level(logging.WARNING, logger="kvflow.cpu_threads"):
        cpu_threads.check_wait_policy()
        cpu_threads.check_wait_policy()
    hints = [r for r in caplog.records if "OMP_WAIT_POLICY=PASSIVE" in r.getMessage()]
    assert len(hints) == (1 if warned else 0)
