"""``python -m kvflow.ops``: build (or load from the cache) every C++ CPU kernel now, and print
one line per kernel: its name, whether it is available, and the seconds it took. Exit
status 1 when one is unavailable (switched off, refused for the CPU, or failed to build:
the log says which)."""

from __future__ import annotations

import logging
import sys
import time

from kvflow.ops import KERNELS


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    failed = 0
    for kernel in KERNELS:
        start = time.perf_counter()
        ok = kernel.load() is not None
        failed += not ok
        print(f"{kernel.source_path.name:24s} {'ok' if ok else 'unavailable':12s} {time.perf_counter() - start:7.2f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
