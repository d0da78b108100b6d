"""``kvflow serve --data-parallel-size N``: N engine replicas on this machine behind an
existing cache-aware router, started and stopped as one command.

Each replica is a whole ``kvflow serve`` process on 127.0.0.1 (its own engine, KV cache and
prefix cache), pinned with ``os.sched_setaffinity`` to its share of this process's CPUs
(``cpu_shares``; at most one replica per CPU) and running ``--num-threads`` threads (default: its share's size). The
router in front, on ``--host``/``--port``, is ``vllm-router`` (default) or ``sglang-router``,
both Rust routers from PyPI (``pip install 'kvflow[scale-out]'``) whose ``cache_aware``
policy keeps a radix tree of the prompts it sent to each worker and sends a request to the
worker whose tree shares its longest prefix, unless the load is unbalanced (SGLang's
cache-aware load balancing, Zheng et al. 2024, "SGLang: Efficient Execution of Structured
Language Model Programs", and the routers' docs). What the routers call on a worker
(``/health``, ``/v1/models``, ``/get_load``, ``/get_server_info``, ``/get_model_info``,
``/flush_cache``) ``kvflow serve`` answers from its engine (``kvflow.entrypoints.openai.server``).

Lifetime: every child gets ``PR_SET_PDEATHSIG`` (SIGTERM when this process dies, even by
SIGKILL); Ctrl-C or SIGTERM stops the router and the replicas (SIGTERM, then SIGKILL after
``STOP_TIMEOUT_S``); a replica that exits is reported on stderr and started again on the same
port (at most ``MAX_RESTARTS`` times each), which the router's health checks then see
rejoin; the command fails (exit 1) when the router exits or no replica is left.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("kvflow")

ROUTERS = ("vllm-router", "sglang-router")
ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")
# python -m modules of the routers' launchers (their console scripts run the same code)
_ROUTER_MODULES = {"vllm-router": "vllm_router.launch_router", "sglang-router": "sglang_router.launch_router"}
STARTUP_TIMEOUT_S = 900.0  # a replica loading a large model and building kernels on a busy CPU
STOP_TIMEOUT_S = 15.0
MAX_RESTARTS = 3
POLL_S = 0.5
_PR_SET_PDEATHSIG = 1


def _dp_option(default: Any, help: str, **cli: Any) -> Any:
    """A field documented like ``EngineArgs``'s (``help`` is the CLI flag's help)."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass
class DataParallelArgs:
    """Options of ``kvflow serve --data-parallel-size N`` (the CLI makes one flag per field).

    Raises (``validate``):
        ValueError: naming the field, for a size < 1, an unknown router or policy.
    """

    data_parallel_size: int = _dp_option(
        1, "run this many engine replicas on this machine, each on its share of the CPU cores, behind a "
        "cache-aware router on --port (docs/scale-out.md); 1: one engine, no router")
    router: str = _dp_option(
        "vllm-router", "the router in front of the replicas (a PyPI package: pip install 'kvflow[scale-out]')",
        choices=ROUTERS)
    router_policy: str = _dp_option(
        "cache_aware", "the router's policy: cache_aware sends a request to the replica whose cache most "
        "likely holds its prefix, unless the load is unbalanced", choices=ROUTER_POLICIES)

    def validate(self) -> None:
        if not isinstance(self.data_parallel_size, int) or self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be an integer >= 1, got {self.data_parallel_size!r}")
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {self.router!r}")
        if self.router_policy not in ROUTER_POLICIES:
            raise ValueError(f"router_policy must be one of {ROUTER_POLICIES}, got {self.router_policy!r}")


def cpu_shares(n: int, cpus: list[int] | None = None) -> list[list[int]]:
    """Split ``cpus`` (default: this process's affinity, ``os.sched_getaffinity``) into ``n``
    contiguous shares, as even as possible (the first ones one CPU larger).

    Raises:
        ValueError: for n < 1, no CPU, or more replicas than CPUs (each replica is pinned
            to a share of its own; replicas sharing a core would only slow each other down).
    """
    if n < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {n}")
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if not cpus:
        raise ValueError("no CPU to run the replicas on")
    if len(cpus) < n:
        raise ValueError(f"data_parallel_size {n} is more replicas than the {len(cpus)} CPUs this process may run on "
                         f"(its affinity: CPUs {_cpu_list(cpus)}); each replica is pinned to CPUs of its own: run at "
                         f"most {len(cpus)}")
    base, extra = divmod(len(cpus), n)
    shares, start = [], 0
    for i in range(n):
        size = base + (1 if i < extra else 0)
        shares.append(cpus[start:start + size])
        start += size
    return shares


def _cpu_list(cpus: list[int]) -> str:
    """``0-3,8`` for [0, 1, 2, 3, 8]."""
    runs: list[list[int]] = []
    for cpu in cpus:
        if runs and cpu == runs[-1][-1] + 1:
            runs[-1].append(cpu)
        else:
            runs.append([cpu])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def check_router_installed(router: str) -> str:
    """The ``python -m`` module of ``router``'s launcher, when its package is installed.

    Raises:
        ValueError: for an unknown router.
        ModuleNotFoundError: when its package is not installed (naming the pip command).
    """
    if router not in _ROUTER_MODULES:
        raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
    import importlib.util

    module = _ROUTER_MODULES[router]
    if importlib.util.find_spec(module.split(".")[0]) is None:
        raise ModuleNotFoundError(f"--router {router}: the {router} package is not installed "
                                  f"(pip install {router}, or pip install 'kvflow[scale-out]')")
    return module


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS's choice)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


_ROUTER_FLAGS = ("--router", "--router-policy")


def replica_argv(serve_argv: list[str], port: int, num_threads: int) -> list[str]:
    """The ``kvflow serve`` arguments of one replica: the command's own without the router's
    flags (a replica has no router: ``kvflow serve`` refuses them with one engine), then the
    overrides (argparse keeps the last value of a repeated flag): one engine on
    127.0.0.1:``port`` with ``num_threads`` threads."""
    own, skip = [], False
    for arg in serve_argv:
        if skip:
            skip = False
        elif arg in _ROUTER_FLAGS:
            skip = True  # (and its value)
        elif not arg.startswith(tuple(flag + "=" for flag in _ROUTER_FLAGS)):
            own.append(arg)
    return [*own, "--data-parallel-size", "1", "--host", "127.0.0.1", "--port", str(port),
            "--num-threads", str(num_threads)]


def router_argv(router: str, host: str, port: int, worker_urls: list[str], policy: str,
                prometheus_port: int, api_key: str | None = None) -> list[str]:
    """The command line of ``router`` (``python -m`` its launcher) in front of ``worker_urls``.

    Raises:
        ValueError: for an unknown router.
        ModuleNotFoundError: when its package is not installed (naming the pip command).
    """
    module = check_router_installed(router)
    argv = [sys.executable, "-m", module, "--host", host, "--port", str(port), "--policy", policy,
            "--worker-urls", *worker_urls, "--prometheus-port", str(prometheus_port),
            # the replicas are healthy before the router starts; then a dead one is noticed by
            # the next request's failure and by the health check every few seconds
            "--worker-startup-timeout-secs", "60", "--worker-startup-check-interval", "1",
            "--health-check-interval-secs", "2", "--health-failure-threshold", "2",
            "--health-success-threshold", "1", "--health-check-timeout-secs", "5"]
    if api_key is not None:
        argv += ["--api-key", api_key]
    return argv


def _child_setup(cpus: list[int] | None):
    """``preexec_fn`` of a child: SIGTERM when the parent dies, and its CPU share."""
    parent = os.getpid()

    def setup() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)
        if cpus:
            os.sched_setaffinity(0, cpus)

    return setup


def http_ok(url: str, timeout: float = 2.0) -> bool:
    """True when GET ``url`` answers 2xx within ``timeout`` seconds."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - loopback URLs we built
            return 200 <= r.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


@dataclass
class Replica:
    """One ``kvflow serve`` child: its index, port, CPU share and process."""

    index: int
    port: int
    cpus: list[int]
    process: subprocess.Popen | None = None
    restarts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class DataParallelServer:
    """N ``kvflow serve`` replicas plus a router, as one unit (see the module docstring).

    Args:
        serve_argv: the ``kvflow serve`` arguments (model and engine flags) every replica gets.
        size: number of replicas.
        host, port: where the router listens.
        router, policy: see ``DataParallelArgs``.
        num_threads: threads per replica (default: the size of its CPU share).
        api_key: passed to the router (it sends it to the workers).
        cpus: the CPUs to share out (default: this process's affinity).
        restart: start a replica that exited again (at most ``MAX_RESTARTS`` times).
        env: the children's environment (default: this process's).

    Raises:
        ValueError: for a bad size, router or policy (``DataParallelArgs.validate``),
            ``num_threads`` < 1, or more replicas than ``cpus`` (``cpu_shares``).
        ModuleNotFoundError: when the router's package is not installed (checked here,
            before any replica starts and loads the model).
    """

    def __init__(self, serve_argv: list[str], size: int, host: str = "127.0.0.1", port: int = 8000,
                 router: str = "vllm-router", policy: str = "cache_aware", num_threads: int | None = None,
                 api_key: str | None = None, cpus: list[int] | None = None, restart: bool = True,
                 env: dict[str, str] | None = None) -> None:
        DataParallelArgs(size, router, policy).validate()
        if num_threads is not None and num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        self.serve_argv, self.host, self.port = list(serve_argv), host, port
        self.router, self.policy, self.api_key = router, policy, api_key
        self.restart, self.env = restart, env
        self.num_threads = num_threads
        shares = cpu_shares(size, cpus)
        check_router_installed(router)
        self.replicas = [Replica(i, free_port(), share) for i, share in enumerate(shares)]
        self.router_process: subprocess.Popen | None = None
        self._stopping = False

    @property
    def url(self) -> str:
        return _http_url(self.host, self.port)

    def _spawn(self, argv: list[str], cpus: list[int] | None) -> subprocess.Popen:
        return subprocess.Popen(argv, env=self.env, preexec_fn=_child_setup(cpus), stdin=subprocess.DEVNULL)

    def _start_replica(self, r: Replica) -> None:
        threads = self.num_threads or len(r.cpus)
        argv = [sys.executable, "-m", "kvflow.entrypoints.cli", *replica_argv(self.serve_argv, r.port, threads)]
        r.process = self._spawn(argv, r.cpus)
        logger.info("replica %d: pid %d on %s, CPUs %s, %d threads", r.index, r.process.pid, r.url, r.cpus, threads)

    def start(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Start the replicas, wait until each answers /health, then start the router and
        wait until it answers /health.

        Raises:
            RuntimeError: when a child exits during start-up or is not healthy within
                ``timeout_s`` seconds (everything started is stopped first).
        """
        try:
            for r in self.replicas:
                self._start_replica(r)
            deadline = time.monotonic() + timeout_s
            pending = list(self.replicas)
            while pending:
                for r in list(pending):
                    if r.process.poll() is not None:
                        raise RuntimeError(f"replica {r.index} ({r.url}) exited with status {r.process.returncode} "
                                           "while starting (its error is above)")
                    if http_ok(r.url + "/health"):
                        pending.remove(r)
                if pending and time.monotonic() > deadline:
                    raise RuntimeError(f"replicas {[r.index for r in pending]} were not healthy after {timeout_s:.0f} s")
                if pending:
                    time.sleep(POLL_S)
            argv = router_argv(self.router, self.host, self.port, [r.url for r in self.replicas], self.policy,
                               free_port(), self.api_key)
            self.router_process = self._spawn(argv, None)
            deadline = time.monotonic() + 120
            while not http_ok(_http_url(_connect_host(self.host), self.port) + "/health"):
                if self.router_process.poll() is not None:
                    raise RuntimeError(f"the router ({self.router}) exited with status {self.router_process.returncode} "
                                       "while starting (its error is above)")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the router ({self.router}) did not answer /health within 120 s")
                time.sleep(POLL_S)
        except BaseException:
            self.stop()
            raise

    def check(self) -> str | None:
        """One supervision pass: report (stderr) and restart each replica that exited; the
        reason to stop everything (the router exited, no replica left), or None."""
        if self.router_process is not None and self.router_process.poll() is not None:
            return f"the router ({self.router}) exited with status {self.router_process.returncode}"
        for r in self.replicas:
            if r.process is None or r.process.poll() is None:
                continue
            code = r.process.returncode
            if self.restart and r.restarts < MAX_RESTARTS:
                r.restarts += 1
                print(f"kvflow: replica {r.index} ({r.url}, pid {r.process.pid}) exited with status {code}; "
                      f"starting it again (restart {r.restarts} of {MAX_RESTARTS}); the router sends it requests "
                      "again once its health check passes", file=sys.stderr, flush=True)
                self._start_replica(r)
            else:
                print(f"kvflow: replica {r.index} ({r.url}, pid {r.process.pid}) exited with status {code}; the "
                      "router sends its requests to the others", file=sys.stderr, flush=True)
                r.process = None
        if all(r.process is None for r in self.replicas):
            return "no replica is left"
        return None

    def run(self) -> int:
        """Supervise until Ctrl-C / SIGTERM (exit 0) or a fatal fault (exit 1); stops all."""
        previous = signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            print(f"kvflow: {len(self.replicas)} replicas behind {self.router} ({self.policy}) on {self.url}",
                  file=sys.stderr, flush=True)
            while True:
                reason = self.check()
                if reason is not None:
                    print(f"kvflow: error: {reason}; stopping", file=sys.stderr, flush=True)
                    return 1
                time.sleep(POLL_S)
        except KeyboardInterrupt:
            return 0
        finally:
            signal.signal(signal.SIGTERM, previous)
            self.stop()

    def stop(self) -> None:
        """SIGTERM the router and the replicas, SIGKILL what is left after ``STOP_TIMEOUT_S``."""
        self._stopping = True
        processes = [p for p in [self.router_process, *(r.process for r in self.replicas)] if p is not None]
        for p in processes:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for p in processes:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def _http_url(host: str, port: int) -> str:
    """``http://host:port``, an IPv6 address in brackets (``http://[::1]:8000``)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def serve_data_parallel(args, serve_argv: list[str]) -> int:
    """``kvflow serve`` with ``--data-parallel-size`` > 1 (``args``: the parsed flags,
    ``serve_argv``: the command's arguments after ``serve``, handed to every replica).

    Raises:
        ValueError: before any replica starts, for options a replica set cannot take
            (``--tensor-parallel-size`` > 1, more replicas than this process's CPUs).
        ModuleNotFoundError: before any replica starts, when the router's package is not
            installed.
        RuntimeError: when start-up fails.
    """
    if args.tensor_parallel_size > 1:
        raise ValueError("--data-parallel-size with --tensor-parallel-size > 1 is not supported: run the replicas "
                         "of a sharded model on separate machines (docs/scale-out.md)")
    server = DataParallelServer(serve_argv, args.data_parallel_size, args.host, args.port, args.router,
                                args.router_policy, args.num_threads, args.api_key)
    try:
        server.start()
    except KeyboardInterrupt:
        return 130
    return server.run()
