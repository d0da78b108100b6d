"""Small helpers shared across kvflow: byte sizes as users write them, handing the C heap's
free memory back to the OS, and keeping the long-lived heap out of Python's garbage collector
(frozen while a server runs, or while an engine has requests in flight)."""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import functools
import gc
import math
import re
import sys
import threading
from fractions import Fraction

_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gib": 1024**3, "gb": 1000**3,
    "t": 1024**4, "tib": 1024**4, "tb": 1000**4,
}


def is_positive_finite(value: object) -> bool:
    """True for an int or float (not a bool) that is finite and > 0: what a model size, norm
    epsilon or rotary base / scaling factor must be. Raises nothing."""
    return (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
            and value > 0)


#: Byte sizes ``parse_bytes`` takes are below this (a signed 64-bit count: 8 EiB).
MAX_BYTES = 2**63


def parse_bytes(text: str | int, name: str = "byte size") -> int:
    """A byte count from an int or a string such as "536870912", "512MiB", "8GiB", "1.5G",
    "2GB" (KiB/MiB/GiB/TiB and bare K/M/G/T are powers of 1024, KB/MB/GB/TB powers of
    1000; case-insensitive). Used by ``EngineArgs`` (``kv_cache_memory_bytes``,
    ``swap_space_bytes``), their CLI flags and ``kvflow memory --budget``.

    Args:
        text: the size.
        name: what the size is, for the error message (e.g. "kv_cache_memory_bytes").

    Raises:
        ValueError: naming ``name``, for an unparsable or negative size, a bool or a float,
            or one of ``MAX_BYTES`` or more (computed exactly: no float rounding).
    """
    if isinstance(text, bool) or not isinstance(text, (int, str)):
        raise ValueError(f"{name} must be a byte count (an int, or a string like '512MiB'), got {text!r}")
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)(?:[eE]([+-]?[0-9]{1,4}))?\s*([A-Za-z]*)\s*", text)
        unit = m.group(3).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(f"{name}: cannot parse a byte size from {text!r} (examples: 536870912, 512MiB, 8GiB, 2GB)")
        exponent = int(m.group(2) or 0)
        if exponent > 30:  # (past any memory: refused below without making a huge number)
            raise ValueError(f"{name} must be less than {MAX_BYTES} bytes, got {text!r}")
        value = int(Fraction(m.group(1)) * Fraction(10) ** exponent * _UNITS[unit])
    if value < 0:
        raise ValueError(f"{name} must be non-negative, got {text!r}")
    if value >= MAX_BYTES:
        raise ValueError(f"{name} must be less than {MAX_BYTES} bytes (2**63), got {text!r}")
    return value


def human_bytes(n: float) -> str:
    """1024-based: 524288 -> "512 KiB", 46080 -> "45 KiB", 3.5 * 2**30 -> "3.5 GiB"."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" or float(n).is_integer() else f"{n:.3g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


@functools.cache
def _glibc():
    """The C library where it is glibc (it has ``malloc_trim``; musl has not), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc_trim.restype = ctypes.c_int
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


def _glibc_malloc_trim():
    libc = _glibc()
    return libc.malloc_trim if libc is not None else None


#: glibc's mallopt(3) parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def reuse_large_allocations(limit: int) -> bool:
    """Let the C heap reuse blocks of up to ``limit`` bytes instead of mapping each afresh:
    glibc's ``mallopt(M_MMAP_THRESHOLD, limit)`` and ``mallopt(M_TRIM_THRESHOLD, limit)``
    (mallopt(3)). Process-wide; call it once the model is loaded, so that the load's one-off
    temporaries still go back to the OS.

    What it is for: glibc serves every block above its mmap threshold (adjusted as blocks
    are freed, never above 32 MiB on 64-bit Linux) with a fresh ``mmap`` and unmaps it when
    freed, so a tensor that large made every engine step is paid for with a page fault per
    4 KiB page on its first touch, every step. The decode step's logits are one: [N, V]
    float32, 64 x 151,936 (Qwen2.5's vocabulary) = 37 MiB, and the sampler's [N, V]
    temporaries beside them. Measured on a 2-core Zen 4 (``torch.empty`` + ``fill_``): 39 MB
    17.2 -> 1.5 ms, 80 MB 35.6 -> 3.6 ms; the LM head of ``benchmarks/host_overhead.py`` at
    256 sequences ([256, 64] x [64, 49152]) 42.7 -> 28.7 ms. The trim threshold keeps up to
    ``limit`` bytes free at the heap's top for the next step instead of handing them back
    (what a caching allocator does: PyTorch's on GPUs; vLLM's CPU docs preload tcmalloc for
    the same reason). A thread other than the main one allocates from its own arena, whose
    heaps glibc caps at 64 MiB: there, larger blocks are still mapped afresh.

    Args:
        limit: bytes; blocks up to this size come from the heap, and up to this much free
            memory stays in it. 0 leaves glibc's defaults.

    Returns:
        True where applied (Linux with glibc and ``limit`` > 0).

    Raises:
        ValueError: for a negative ``limit`` or one above 2 GiB - 1 (mallopt takes an int).
    """
    if not 0 <= limit < 2**31:
        raise ValueError(f"the reuse limit must be in [0, 2 GiB), got {limit} bytes")
    libc = _glibc()
    if limit == 0 or libc is None:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, limit)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, limit))


def release_free_heap() -> bool:
    """Hand the C heap's free pages back to the OS: glibc's ``malloc_trim(0)``, which walks
    every malloc arena (each thread's too) and releases the free pages inside them, not only
    at their tops.

    What it is for: a one-off load leaves freed memory behind that glibc keeps for reuse, so
    it stays in the process's RSS. Parsing Qwen2.5's 11 MB ``tokenizer.json`` (Rust
    ``tokenizers``) allocates ~100 MB and keeps ~40 MB; the other ~60 MB stay resident until
    trimmed (measured: peak RSS of ``LLM("qwen2.5-coder-0.5b")`` + 8 tokens 799 -> 763 MiB).
    Safe from any thread at any time (glibc locks each arena); it costs a walk of the heap
    (milliseconds), so call it after a load, not per step.

    Returns:
        True where ``malloc_trim`` ran (Linux with glibc) and released memory; False where it
        is not available or found nothing to release.
    """
    trim = _glibc_malloc_trim()
    return bool(trim(0)) if trim is not None else False


def freeze_gc_heap() -> int:
    """Collect, then move every object the cyclic garbage collector tracks into its permanent
    generation (``gc.freeze()``), so that no later collection scans them again; a hold of
    the freeze (see ``hold_gc_freeze``) until ``unfreeze_gc_heap``.

    What it is for: once ``kvflow serve`` has started, its process holds hundreds of thousands
    of long-lived tracked objects (PyTorch's and transformers' modules, the model, the
    tokenizer, the server's routes) that never become garbage; every full (oldest-generation)
    collection walks all of them. Measured with the 2-layer model of
    ``benchmarks/host_overhead.py`` at 256 sequences (337k tracked objects): one full
    collection took 162-173 ms, one in every ~48 decode steps, i.e. ~3.5 ms a step amortized
    and a 170 ms stall in one of them; frozen, none happened. vLLM does the same in its
    server and engine-core processes (``freeze_gc_heap`` in ``vllm/utils/gc_utils.py``).
    Objects frozen here are still freed by reference counting; only garbage held in reference
    cycles among them (a dropped model's parameters, a user's own cyclic data) waits for
    the unfreeze.

    Any earlier freeze is undone first (the holds stay counted), so that the collection also
    reclaims what was dropped in cycles since then.

    Returns:
        The number of objects now frozen.
    """
    with _freeze_lock:
        gc.unfreeze()
        gc.collect()
        gc.freeze()
        _hold_locked()
    return gc.get_freeze_count()


def unfreeze_gc_heap() -> None:
    """Undo ``freeze_gc_heap``: release its hold (``release_gc_freeze``); with no other hold
    left the frozen objects go back to the oldest generation, so that the next full
    collection can reclaim those a shut-down engine left in reference cycles."""
    release_gc_freeze()


def hold_gc_freeze() -> None:
    """Freeze the heap (``gc.freeze()``, no collection: O(1)) for as long as a hold is kept.

    Holds nest across the process: the first freezes, ``release_gc_freeze`` of the last
    unfreezes (``gc.unfreeze()``, O(1)). An engine holds one while it has requests in
    flight (``LLMEngine``, ``KVFLOW_GC_FREEZE``), so that the full collections its steps
    trigger scan only what was made since its first request, not the whole startup heap
    (see ``freeze_gc_heap`` for the cost), and lets go once its last request finishes, so
    that the objects a caller drops in reference cycles between runs (a whole model) are
    reclaimed as usual. Garbage made while a hold is kept is collected as usual; what was
    garbage when the freeze began waits for the unfreeze. Thread-safe. The heap is
    unfrozen at the interpreter's exit (``atexit``), so that its final collection still
    finalizes every object (extension modules such as nanobind's report instances that
    never were).
    """
    with _freeze_lock:
        if _freeze_holds == 0:
            gc.freeze()
        _hold_locked()


def release_gc_freeze() -> None:
    """Give back one ``hold_gc_freeze`` (or ``freeze_gc_heap``); the last unfreezes the heap.
    A release without a hold does nothing."""
    global _freeze_holds
    with _freeze_lock:
        if _freeze_holds == 0:
            return
        _freeze_holds -= 1
        if _freeze_holds == 0:
            gc.unfreeze()


def _hold_locked() -> None:
    global _freeze_holds, _unfreeze_at_exit
    if not _unfreeze_at_exit:
        atexit.register(gc.unfreeze)
        _unfreeze_at_exit = True
    _freeze_holds += 1


_freeze_lock = threading.Lock()
_freeze_holds = 0
_unfreeze_at_exit = False
