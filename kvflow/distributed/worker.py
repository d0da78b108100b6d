"""Tensor-parallel execution: the driver (rank 0) schedules and samples; workers mirror its
forward passes on their shards.

Each step the driver broadcasts the scheduler's diff (``SchedulerOutput.for_workers``: the
new requests' data once, then per request the tokens appended and block-table changes, the
copies and swaps) with ``torch.distributed.broadcast_object_list``; every rank's runner
keeps the same per-request state, builds the same inputs and runs its shard, the
all-reduces and all-gathers inside the model keeping them in step. Workers
are started by the engine with ``torch.multiprocessing`` (spawn) on one machine, or by
``torchrun`` across machines (``init_method="env://"``). A broadcast of None stops them.
"""

from __future__ import annotations

import atexit
import socket
import threading
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvflow import envs
from kvflow.cpu_threads import sleeping_workers_for_children
from kvflow.core.sched_output import SchedulerOutput


def timeout_advice(timeout_s: float) -> str:
    """What to do when a rank missed the rendezvous or a collective."""
    return (f"a tensor-parallel rank did not answer within {timeout_s:.0f} s (a loaded machine or a slow model "
            "load can take longer; a rank that was never started never answers): raise the limit with "
            "collective_timeout_s / --collective-timeout-s / KVFLOW_COLLECTIVE_TIMEOUT_S, and check that "
            "every rank runs (under torchrun: all --nproc-per-node x --nnodes of them)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process_group(rank: int, world_size: int, init_method: str, device: torch.device, timeout_s: float) -> None:
    """Join the group: gloo on the CPU, NCCL on CUDA; the rendezvous and every collective
    time out after ``timeout_s`` seconds (``EngineArgs.resolved_collective_timeout_s``) so
    that a hung peer makes the others fail, not hang.

    Raises:
        RuntimeError: the rendezvous timed out; the message says what to do.
    """
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    # torch names the default group by a per-process counter that a failed start-up still
    # advances; the next start-up in this process (a fresh engine after a timeout) would then
    # publish its gloo address under a name its freshly spawned peers never read, and both
    # would wait out the whole timeout. A failed start-up puts the counter back.
    world = getattr(dist.distributed_c10d, "_world", None)
    group_count = getattr(world, "group_count", None)
    try:
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
        )
    except BaseException as exc:
        if group_count is not None and not dist.is_initialized():
            world.group_count = group_count
        if not isinstance(exc, (RuntimeError, TimeoutError)):  # DistStoreError / DistBackendError are RuntimeErrors
            raise
        if "timeout" not in str(exc).lower() and "timed out" not in str(exc).lower():
            raise
        raise RuntimeError(f"tensor-parallel start-up (rank {rank} of {world_size}): {timeout_advice(timeout_s)}") from exc


def worker_main(rank: int, world_size: int, init_method: str, config, build_rank) -> None:
    """Entry point of a worker process (spawned, or a non-zero torchrun rank): join the group,
    build this rank's shard from the engine's ``EngineConfig`` with ``build_rank(config,
    rank)`` (``kvflow.worker.worker.build_rank``: passed in by the worker's builder, as this
    layer stands below the worker's) and mirror the driver's steps."""
    if config.device.num_threads is not None:
        torch.set_num_threads(config.device.num_threads)
    init_process_group(rank, world_size, init_method, config.device.device, config.parallel.collective_timeout_s)
    try:
        runner = build_rank(config, rank)
        while True:
            message = [None]
            dist.broadcast_object_list(message, src=0)
            if message[0] is None:
                break
            runner.execute(message[0])
    finally:
        dist.destroy_process_group()


class TPWorkers:
    """The driver's handle on its workers: broadcast steps, detect deaths, shut down.

    Args:
        config: the ``EngineConfig`` every rank builds its shard from (sent whole).
        spawn: start local worker processes (False under torchrun, where they exist).
        build_rank: a module-level function ``(config, rank) -> ModelRunner`` each spawned
            rank builds its runner with (``kvflow.worker.worker.build_rank``).
    """

    def __init__(self, config, spawn: bool = True, build_rank=None) -> None:
        world_size = config.parallel.tensor_parallel_size
        self.world_size = world_size
        self.timeout_s = config.parallel.collective_timeout_s
        self.procs: list[mp.Process] = []
        self._closed = False
        if spawn:
            init_method = f"tcp://127.0.0.1:{free_port()}"
            ctx = mp.get_context("spawn")
            with sleeping_workers_for_children():  # (the ranks run no thread governor)
                for rank in range(1, world_size):
                    proc = ctx.Process(target=worker_main, args=(rank, world_size, init_method, config, build_rank),
                                       daemon=True)
                    proc.start()
                    self.procs.append(proc)
        else:
            init_method = "env://"
        atexit.register(self.shutdown)
        # Join in a thread so that a worker dying during start-up fails the driver at once
        # instead of after the rendezvous timeout.
        errors: list[BaseException] = []

        def join() -> None:
            try:
                init_process_group(0, world_size, init_method, config.device.device, self.timeout_s)
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)

        joiner = threading.Thread(target=join, daemon=True)
        joiner.start()
        while joiner.is_alive():
            joiner.join(timeout=0.2)
            dead = [(rank, p.exitcode) for rank, p in enumerate(self.procs, start=1) if not p.is_alive()]
            if dead and joiner.is_alive():
                self.shutdown()
                raise RuntimeError(
                    f"tensor-parallel worker rank {dead[0][0]} exited during start-up (exit code {dead[0][1]}); "
                    "with the spawn start method the main script must be guarded by if __name__ == '__main__'"
                )
        if errors:
            self.shutdown()
            raise errors[0]

    def check_alive(self) -> None:
        """Raises RuntimeError (after cleaning up) if a worker process has died."""
        for rank, proc in enumerate(self.procs, start=1):
            if not proc.is_alive():
                code = proc.exitcode
                self.shutdown()
                raise RuntimeError(f"tensor-parallel worker rank {rank} died (exit code {code}); engine stopped")

    def broadcast(self, out: SchedulerOutput) -> None:
        """Send one step to the workers.

        Raises:
            RuntimeError: a worker died, or did not take the step within the timeout (the
                message says what to do).
        """
        self.check_alive()
        try:
            dist.broadcast_object_list([out.for_workers()], src=0)
        except RuntimeError as exc:
            if "timeout" not in str(exc).lower() and "timed out" not in str(exc).lower():
                raise
            self.check_alive()
            raise RuntimeError(timeout_advice(self.timeout_s)) from exc

    def shutdown(self) -> None:
        """Stop the workers and leave no process behind."""
        if self._closed:
            return
        self._closed = True
        if dist.is_initialized():
            try:
                if all(p.is_alive() for p in self.procs):
                    dist.broadcast_object_list([None], src=0)
            except Exception:  # noqa: BLE001 - a dead peer: terminate below
                pass
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        if dist.is_initialized():
            dist.destroy_process_group()


def torchrun_rank() -> tuple[int, int] | None:
    """(rank, world_size) when started by torchrun with more than one process, else None."""
    if envs.is_set("TORCHELASTIC_RUN_ID") or (envs.is_set("RANK") and envs.is_set("WORLD_SIZE")):
        world_size = int(envs.read("WORLD_SIZE") or "1")
        if world_size > 1:
            return int(envs.read("RANK")), world_size
    return None
