"""``python -m kvflow.ops [SOURCE ...]``: build (or load from the cache) kvflow's C++ CPU
kernels now, all of them or those named by source file (``rms_norm.cpp``), and print one line
per kernel: its name, whether it is available, and the seconds it took. Exit status 1 when
one is unavailable (switched off, refused for the CPU, or failed to build: the log says
which). ``--nice N`` lowers this process's priority first (the background builds of an
engine run it so: ``kvflow.ops.build.start_background_builds``). ``--parent PID`` ends this
process, and the compilers of its process group, when process PID is gone."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from kvflow.ops import KERNELS


def main(argv: list[str] | None = None) -> int:
    names = {kernel.source_path.name for kernel in KERNELS}
    parser = argparse.ArgumentParser(prog="python -m kvflow.ops", description=__doc__.split("\n\n")[0])
    parser.add_argument("sources", nargs="*", metavar="SOURCE", help=f"kernels to build (default: all): {sorted(names)}")
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
    failed = 0
    for kernel in KERNELS:
        if args.sources and kernel.source_path.name not in args.sources:
            continue
        start = time.perf_counter()
        ok = kernel.load() is not None
        failed += not ok
        print(f"{kernel.source_path.name:24s} {'ok' if ok else 'unavailable':12s} {time.perf_counter() - start:7.2f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
