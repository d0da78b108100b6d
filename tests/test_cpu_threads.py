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
    environ = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KVFLOW_OMP_DEFAULTS",
                                                             "KVFLOW_CPU_ADAPTIVE_THREADS")}
    environ.update(env, OMP_DISPLAY_ENV="VERBOSE", PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = [line.split("=", 1)[1].strip().strip("'") for line in done.stderr.splitlines() if "GOMP_SPINCOUNT =" in line]
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_import_kvflow_sets_a_short_spin_for_the_thread_governor():
    """`import kvflow` first: libgomp loads spinning 10000 rounds (the governor lowers the
    thread count when other processes need the cores); with the governor off, workers sleep
    (spin count 0); with kvflow's defaults off, libgomp's own 300000."""
    assert _spincount("import kvflow") == "10000"
    assert _spincount("import kvflow", KVFLOW_CPU_ADAPTIVE_THREADS="0") == "0"
    assert _spincount("import kvflow", KVFLOW_OMP_DEFAULTS="0") == "300000"


def test_defaults_respect_the_user_and_the_import_order(monkeypatch):
    env: dict[str, str] = {}
    monkeypatch.delitem(sys.modules, "torch")  # as before torch is imported
    assert cpu_threads.set_openmp_defaults(env) and env == {"GOMP_SPINCOUNT": "10000"}
    env = {"KVFLOW_CPU_ADAPTIVE_THREADS": "0"}
    assert cpu_threads.set_openmp_defaults(env) and env["OMP_WAIT_POLICY"] == "PASSIVE" and "GOMP_SPINCOUNT" not in env
    for chosen in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "1"}, {"KVFLOW_OMP_DEFAULTS": "0"}):
        env = dict(chosen)
        assert not cpu_threads.set_openmp_defaults(env) and env == chosen
    monkeypatch.undo()
    env = {}
    assert "torch" in sys.modules and not cpu_threads.set_openmp_defaults(env) and env == {}  # too late


@pytest.mark.parametrize("load, adaptive, warned", [(5.0, "0", True), (0.2, "0", False), (5.0, "1", False)])
def test_a_busy_machine_with_spinning_threads_gets_a_hint(monkeypatch, caplog, load, adaptive, warned):
    """The hint is for a busy machine with libgomp's spinning and no governor (the governor
    lowers the thread count itself)."""
    monkeypatch.setattr(cpu_threads, "_state", {"applied": False, "too_late": True, "warned": False})
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setenv("KVFLOW_CPU_ADAPTIVE_THREADS", adaptive)
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    with caplog.at_level(logging.WARNING, logger="kvflow.cpu_threads"):
        cpu_threads.check_wait_policy()
        cpu_threads.check_wait_policy()
    hints = [r for r in caplog.records if "OMP_WAIT_POLICY=PASSIVE" in r.getMessage()]
    assert len(hints) == (1 if warned else 0)


# ---------------------------------------------------------------------------- the governor
def test_read_cpu_times_counts_the_chosen_cpus_busy_columns(tmp_path):
    """user + nice + system + irq + softirq + steal of the CPUs asked for (nice left out on
    request); the aggregate "cpu " line and idle / iowait never."""
    hz = os.sysconf("SC_CLK_TCK")
    stat = tmp_path / "stat"
    stat.write_text(
        "cpu  9999 9999 9999 9999 9999 9999 9999 9999 0 0\n"
        "cpu0 100 7 20 5000 50 1 2 3 0 0\n"
        "cpu1 200 11 40 5000 50 4 5 6 0 0\n"
        "cpu2 1000 0 0 0 0 0 0 0 0 0\n"
        "intr 12345\n")
    assert cpu_threads.read_cpu_times({0, 1}, nice_is_busy=False, path=str(stat)) == pytest.approx((126 + 255) / hz)
    assert cpu_threads.read_cpu_times({1}, path=str(stat)) == pytest.approx(266 / hz)
    assert cpu_threads.read_cpu_times(None, path=str(stat)) == pytest.approx((133 + 266 + 1000) / hz)
    assert cpu_threads.read_cpu_times({0}, path=str(tmp_path / "missing")) is None
    assert cpu_threads.read_cpu_times({7}, path=str(stat)) is None  # none of the CPUs listed (renumbered)


class FakeMachine:
    """A clock, the busy CPU seconds of the governor's CPUs and this process's CPU seconds:
    ``run(seconds, others=cores, own=cores)`` advances them (the cores each side *got*)."""

    def __init__(self):
        self.now = self.busy = self.own = 0.0

    def run(self, seconds, others=0.0, own=0.0):
        self.now += seconds
        self.busy += (others + own) * seconds
        self.own += own * seconds

    def governor(self, max_threads=2, cpus=(0, 1), **kw):
        kw.setdefault("interval_s", 0.5)
        return cpu_threads.ThreadGovernor(max_threads, cpus=set(cpus), read_busy=lambda: self.busy,
                                          read_self=lambda: self.own, clock=lambda: self.now, **kw)


def test_governor_drops_a_thread_when_another_process_takes_a_core_and_comes_back():
    m = FakeMachine()
    g = m.governor()
    m.run(0.3, others=1.0, own=0.5)
    assert g.update() == 2 and g.num_changes == 0  # not before interval_s
    m.run(0.3, others=1.0, own=0.5)
    assert g.update() == 1 and g.others == pytest.approx(1.0)  # at once
    m.run(0.6, others=1.0, own=1.0)
    assert g.update() == 1
    m.run(0.6, others=0.5, own=1.0)  # inside the dead band (0.35-0.65 on 2 CPUs): no change
    assert g.update() == 1
    m.run(0.6, others=0.1, own=1.0)
    assert g.update() == 1  # one quiet interval is not enough to go up
    m.run(0.6, others=0.5, own=1.0)
    assert g.update() == 1  # the quiet run is broken
    m.run(0.6, others=0.1, own=1.0)
    assert g.update() == 1
    m.run(0.6, others=0.2, own=1.0)
    assert g.update() == 2 and g.num_changes == 2


def test_governor_reads_what_others_wanted_from_their_share_of_saturated_cpus():
    """Two spinning threads against one busy-looping process on 2 CPUs: CFS gives each of the
    three 2/3 of a core, so the other process *got* 0.67 cores; it wanted 1 (2 threads x
    0.67 / (2 - 0.67)). With idle time left, what it got is what it wanted."""
    m = FakeMachine()
    g = m.governor()
    m.run(0.6, others=2 / 3, own=4 / 3)
    assert g.update() == 1 and g.others == pytest.approx(1.0)
    m.run(0.6, others=1.0, own=1.0)  # one thread each now: still saturated, still 1 core wanted
    assert g.update() == 1 and g.others == pytest.approx(1.0)
    m = FakeMachine()
    g = m.governor()
    m.run(0.6, others=0.3, own=1.0)  # idle time left: 0.3 wanted, nothing to give up
    assert g.update() == 2 and g.others == pytest.approx(0.3)
    m.run(0.6, others=0.3, own=1.7)  # saturated: 0.3 x 2 / 1.7 = 0.35 wanted, in the dead band
    assert g.update() == 2 and g.others == pytest.approx(0.6 / 1.7)


def test_governor_counts_only_other_processes_and_keeps_its_bounds():
    m = FakeMachine()
    g = m.governor()
    for _ in range(5):  # this process keeps both cores busy: nothing to give up
        m.run(0.6, own=2.0)
        assert g.update() == 2
    m.run(0.6, others=0.5, own=1.0)  # half a core with idle time left: within the dead band
    assert g.update() == 2
    m.run(0.6, others=2.0)  # every core taken: never below one thread
    assert g.update() == 1
    for _ in range(4):  # quiet again: up to max_threads, no further
        m.run(0.6)
        g.update()
    assert g.threads == 2 and g.num_changes == 2
    m = FakeMachine()
    g = m.governor(max_threads=4, cpus=range(8))
    m.run(0.6, others=5.2)  # 2.8 cores left: 3 threads
    assert g.update() == 3
    m = FakeMachine()
    g = m.governor(max_threads=1)
    for others in (2.0, 0.0, 0.0, 0.0):
        m.run(0.6, others=others)
        assert g.update() == 1
    m = FakeMachine()
    g = m.governor(max_threads=8)  # more threads than CPUs: never above the CPUs
    assert g.update() == 2 and g.threads == 2
    for _ in range(4):
        m.run(0.6)
        assert g.update() == 2


def test_governor_leaves_reserved_cores_to_the_process_children():
    """A core reserved for the kernels compiling in the background: one thread less at once,
    without waiting for a measurement; the thread back two votes after the reservation ends;
    never below one thread; a floor under what others want, not added to it (the next
    measurement counts the compiler too)."""
    m = FakeMachine()
    g = m.governor()
    assert g.update(reserved=1) == 1 and g.num_changes == 1 and g.reserved == 1  # at once
    m.run(0.6, own=1.0)
    assert g.update(reserved=1) == 1  # a quiet machine, the core still reserved
    assert g.update(reserved=0) == 1  # the builds ended: one vote
    m.run(0.6, own=1.0)
    assert g.update(reserved=0) == 2 and g.num_changes == 2
    m.run(0.6, others=1.0, own=1.0)
    assert g.update(reserved=1) == 1  # others' core, the reserved one: never below one thread
    m = FakeMachine()
    g = m.governor(max_threads=8, cpus=range(8))
    assert g.update(reserved=1) == 7
    m.run(0.6, others=1.0, own=7.0)  # the compiler measured: the same core, not a second one
    assert g.update(reserved=1) == 7
    m.run(0.6, others=3.0, own=4.0)  # others want more than the reservation: theirs counts
    assert g.update(reserved=1) == 5


def test_governor_set_max_threads_and_bad_arguments():
    m = FakeMachine()
    g = m.governor()
    m.run(0.6, others=1.0)
    assert g.update() == 1
    g.set_max_threads(2)  # an explicit count, even the old maximum, is run again
    assert g.threads == 2 and g.update() == 2
    for kw, match in (({"max_threads": 0}, "max_threads"), ({"interval_s": 0}, "interval_s"),
                      ({"hysteresis": 0.5}, "hysteresis")):
        with pytest.raises(ValueError, match=match):
            m.governor(**kw)
    with pytest.raises(ValueError, match="max_threads"):
        g.set_max_threads(0)
    unreadable = cpu_threads.ThreadGovernor(2, cpus={0, 1}, read_busy=lambda: None)
    assert not unreadable.enabled and unreadable.update() == 2


def test_thread_governor_is_one_per_process_and_off_when_asked_or_bound(monkeypatch):
    monkeypatch.setattr(cpu_threads, "_governor", [])
    monkeypatch.setenv("KVFLOW_CPU_ADAPTIVE_THREADS", "1")
    for name in cpu_threads.BINDING_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    g = cpu_threads.thread_governor(2, explicit=False)
    assert g is not None and g.max_threads == 2
    assert cpu_threads.thread_governor(1, explicit=False) is g and g.max_threads == 2  # torch's count: kept
    assert cpu_threads.thread_governor(1, explicit=True) is g and g.max_threads == 1 and g.threads == 1
    monkeypatch.setenv("OMP_PROC_BIND", "false")
    assert cpu_threads.thread_governor(2, explicit=True) is g
    for name, value in (("OMP_PROC_BIND", "true"), ("OMP_PLACES", "cores"), ("GOMP_CPU_AFFINITY", "0-1")):
        monkeypatch.delenv("OMP_PROC_BIND", raising=False)
        monkeypatch.setenv(name, value)
        assert cpu_threads.thread_governor(2, explicit=False) is None, name
        monkeypatch.delenv(name)
    monkeypatch.setenv("KVFLOW_CPU_ADAPTIVE_THREADS", "0")
    assert cpu_threads.thread_governor(2, explicit=False) is None


def test_tensor_parallel_ranks_get_sleeping_workers(monkeypatch):
    """Ranks run no governor: under torchrun (WORLD_SIZE > 1) ``import kvflow`` picks sleeping
    workers; ranks spawned by the driver inherit them through sleeping_workers_for_children."""
    monkeypatch.delitem(sys.modules, "torch")
    env = {"WORLD_SIZE": "2"}
    assert cpu_threads.set_openmp_defaults(env) and env["OMP_WAIT_POLICY"] == "PASSIVE"
    env = {"WORLD_SIZE": "1"}
    assert cpu_threads.set_openmp_defaults(env) and env["GOMP_SPINCOUNT"] == "10000"
    monkeypatch.undo()
    monkeypatch.setattr(cpu_threads, "_state", {"applied": True, "too_late": False, "warned": False})
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    with cpu_threads.sleeping_workers_for_children():
        assert os.environ.get("OMP_WAIT_POLICY") == "PASSIVE" and "GOMP_SPINCOUNT" not in os.environ
    assert os.environ.get("GOMP_SPINCOUNT") == "10000" and "OMP_WAIT_POLICY" not in os.environ
    monkeypatch.setenv("GOMP_SPINCOUNT", "500")  # the user's own choice is inherited as it is
    with cpu_threads.sleeping_workers_for_children():
        assert os.environ.get("GOMP_SPINCOUNT") == "500" and "OMP_WAIT_POLICY" not in os.environ


def test_governor_measures_a_real_busy_process():
    """/proc/stat and this process's CPU time on this machine: a busy-looping child pinned to
    one of two CPUs reads as about one core wanted by others and costs the governor a thread.
    Skipped where the two CPUs are already busy (the measurement would be someone else's)."""
    if not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs")
    cpus = set(sorted(os.sched_getaffinity(0))[:2])
    g = cpu_threads.ThreadGovernor(2, cpus=cpus, interval_s=0.5)
    if not g.enabled:
        pytest.skip("no /proc/stat")
    import time

    time.sleep(0.6)
    g.update()
    if g.others > 0.3:
        pytest.skip(f"the machine is busy already ({g.others:.2f} cores)")
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                           preexec_fn=lambda: os.sched_setaffinity(0, {min(cpus)}))
    try:
        time.sleep(0.3)  # the child is running; the next measurement covers it alone
        g._sample()
        time.sleep(1.0)
        assert g.update() == 1
        assert 0.7 < g.others < 1.4
    finally:
        hog.kill()
        hog.wait()


def test_release_openmp_threads_ends_the_calling_threads_workers():
    """After a parallel region on 2 threads the main thread owns one libgomp worker (an OS
    thread of this process); ``release_openmp_threads`` ends it, and a later region makes a
    new one. In a fresh interpreter, so that no other test's threads are counted."""
    code = """
import os, time
import kvflow, torch
from kvflow.cpu_threads import release_openmp_threads
torch.set_num_threads(2)
tasks = lambda: len(os.listdir("/proc/self/task"))
before = tasks()
x = torch.randn(512, 512)
(x @ x).sum()
during = tasks()
ok = release_openmp_threads()
for _ in range(100):
    if tasks() < during:
        break
    time.sleep(0.01)
after = tasks()
(x @ x).sum()
print(before, during, after, tasks(), ok)
"""
    environ = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run([sys.executable, "-c", code], env={**environ, "PYTHONPATH": ROOT}, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    before, during, after, again, ok = done.stdout.split()
    assert ok == "True"
    assert int(during) == int(before) + 1 and int(after) == int(before) and int(again) == int(during)
