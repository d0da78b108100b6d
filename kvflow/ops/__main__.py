"""``python -m kvflow.ops [SOURCE ...]``: build (or load from the cache) kvflow's C++ CPU
kernels now, all of them or those named by source file (``rms_norm.cpp``), and print one line
per kernel as it becomes available: its source, its switch, whether it is available, and the
seconds from the start. Exit status 1 when one is unavailable (switched off, refused for the
CPU, or failed to build: the log says which). ``--jobs N`` builds up to N kernels at once
(default: the CPUs this process may use), the largest sources first. ``--nice N`` lowers this
process's priority first (the background builds of an engine run it so, one source at a time:
``kvflow.ops.build.start_background_builds``). ``--parent PID`` ends this process, and the
compilers of its process group, when process PID is gone."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from kvflow.ops import KERNELS
from kvflow.ops import build as build_module
from kvflow.ops.build import CppKernel


def _usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS has one, e.g. not macOS)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def main(argv: list[str] | None = None) -> int:
    names = {kernel.source_path.name for kernel in KERNELS}
    parser = argparse.ArgumentParser(prog="python -m kvflow.ops", description=__doc__.split("\n\n")[0])
    parser.add_argument("sources", nargs="*", metavar="SOURCE", help=f"kernels to build (default: all): {sorted(names)}")
    parser.add_argument("--jobs", type=int, default=_usable_cpus(), metavar="N",
                        help="build up to N kernels at once (default: the CPUs this process may use)")
    parser.add_argument("--nice", type=int, default=0, help="add this to the process's niceness first")
    parser.add_argument("--parent", type=int, default=None, metavar="PID",
                        help="end (with the compilers of this process group) when process PID is gone")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.sources) - names)
    if unknown:
        parser.error(f"unknown kernel source(s) {unknown}; choose from {sorted(names)}")
    if args.nice:
        os.nice(args.nice)
    if args.parent is not None:
        from kvflow.ops.build import end_with_parent

        end_with_parent(args.parent)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # One job per extension (kernels sharing one, same prefix and source, would build it in one
    # job: the first builds it, the next loads it), the largest sources with what they include
    # (the longest compiles) first, so that the small ones fill the other jobs.
    jobs: dict[tuple[str, str], list[CppKernel]] = {}
    for kernel in KERNELS:
        if not args.sources or kernel.source_path.name in args.sources:
            jobs.setdefault((kernel.prefix, str(kernel.source_path)), []).append(kernel)
    order = sorted(jobs.values(), key=lambda ks: -sum(p.stat().st_size for p in (ks[0].source_path, *ks[0].include_paths)))
    start, printing = time.perf_counter(), threading.Lock()

    def build(kernels: list[CppKernel]) -> bool:
        ok = True
        for kernel in kernels:
            available = kernel.load() is not None
            ok &= available
            with printing:
                print(f"{kernel.source_path.name:20s} {kernel.switch:30s} {'ok' if available else 'unavailable':12s} "
                      f"{time.perf_counter() - start:7.2f} s", flush=True)
        return ok

    # This command compiles in its own process (at its own --nice), not in builder children.
    outer, build_module.IN_BUILDER_CHILD = build_module.IN_BUILDER_CHILD, True
    try:
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            results = list(pool.map(build, order))
    finally:
        build_module.IN_BUILDER_CHILD = outer
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
