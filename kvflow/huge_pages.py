"""Host memory for what a decode step streams, on transparent huge pages: the packed weights
and the paged KV cache (``kvflow.attention.kv_cache.allocate_kv_cache``).

A single-stream decode step reads every weight once, so its matrix products are bound by
how fast the CPU streams them from memory. With the ordinary 4 KiB pages, each 4 KiB of a
weight needs its own TLB entry (a page walk, two-dimensional in a virtual machine) and the
hardware prefetchers stop at each page boundary; a 2 MiB transparent huge page covers 512 of
them. Measured in one process on a 2-core AMD EPYC (Zen 4) VM, the same packed
Qwen2.5-Coder-1.5B matrices of one decode step (951 MiB, M = 1, 2 threads), alternated: 32.2 ms
from 4 KiB pages, 22.9 ms from huge pages; the whole decode step 43.1 -> 29.1 ms
(``benchmarks/huge_pages.py``, docs/benchmarks.md).

``empty(shape, dtype)`` places a tensor in an arena of large anonymous mappings advised
``madvise(MADV_HUGEPAGE)`` (Linux; the kernel then backs their 2 MiB-aligned parts with huge
pages when it has them, with ordinary pages otherwise: the advice never fails an
allocation). Tensors are carved one after another from the current mapping (a bump
allocator: a weight is allocated once at load and lives as long as the model); a mapping is
unmapped when the last tensor in it is gone. Pages no tensor has touched are not resident,
so the arena costs at most part of one huge page per mapping. Elsewhere (not Linux, the
switch ``KVFLOW_HUGE_PAGES=0``, or a tensor smaller than ``MIN_BYTES``) ``empty`` is
``torch.empty``.
"""

from __future__ import annotations

import math
import mmap
import sys
import threading

import torch

from kvflow import envs

#: Bytes of one transparent huge page on x86-64 and most arm64 kernels.
HUGE_PAGE = 2 << 20
#: Bytes of address space one arena mapping reserves (only touched pages become resident).
CHUNK_BYTES = 256 << 20
#: Tensors smaller than this take an ordinary allocation.
MIN_BYTES = 64 << 10
_ALIGN = 64  # each tensor starts on a cache line

_lock = threading.Lock()
_chunk: torch.Tensor | None = None  # uint8 view of the current mapping
_used = 0


def supported() -> bool:
    """Whether this platform can advise huge pages (Linux with ``mmap.MADV_HUGEPAGE``)."""
    return sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")


def enabled() -> bool:
    """``supported()`` and the switch ``KVFLOW_HUGE_PAGES`` on (the default)."""
    return supported() and envs.KVFLOW_HUGE_PAGES


def _mapping(nbytes: int) -> torch.Tensor:
    """A fresh anonymous private mapping of ``nbytes``, advised for huge pages, as a uint8
    tensor that keeps the mapping alive (``torch.frombuffer`` holds a reference to it)."""
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without transparent huge pages (EINVAL): ordinary pages
        pass
    return torch.frombuffer(mm, dtype=torch.uint8)


def empty(shape: tuple[int, ...] | list[int], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """An uninitialized contiguous CPU tensor of ``shape`` and ``dtype``, on huge pages where
    ``enabled()`` and it holds at least ``MIN_BYTES`` (see the module docstring), else
    ``torch.empty``.

    Args:
        shape: the tensor's sizes (each >= 0).
        dtype: its element type.

    Returns:
        A tensor that owns (a share of) its memory: it stays valid while it lives.
    """
    global _chunk, _used
    shape = tuple(int(s) for s in shape)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < MIN_BYTES or not enabled():
        return torch.empty(shape, dtype=dtype)
    try:
        if nbytes > CHUNK_BYTES // 4:  # a large tensor takes a mapping of its own
            flat = _mapping(-(-nbytes // HUGE_PAGE) * HUGE_PAGE)[:nbytes]
        else:
            with _lock:
                if _chunk is None or _used + nbytes > _chunk.numel():
                    _chunk, _used = _mapping(CHUNK_BYTES), 0
                flat = _chunk[_used:_used + nbytes]
                _used = -(-(_used + nbytes) // _ALIGN) * _ALIGN
    except OSError:  # no address space for a mapping (e.g. ulimit -v): an ordinary allocation
        return torch.empty(shape, dtype=dtype)
    return flat.view(dtype).view(shape)
