"""kvflow.utils: byte sizes as users write them, handing the C heap's free memory back."""

from __future__ import annotations

import sys

import pytest

from kvflow import utils
from kvflow.utils import (
    freeze_gc_heap,
    hold_gc_freeze,
    human_bytes,
    parse_bytes,
    release_free_heap,
    release_gc_freeze,
    unfreeze_gc_heap,
)

KiB, MiB, GiB = 1024, 1024**2, 1024**3


@pytest.mark.parametrize(
    "text, value",
    [
        ("536870912", 512 * MiB),
        ("512MiB", 512 * MiB),
        ("512mib", 512 * MiB),
        ("8GiB", 8 * GiB),
        ("8 GiB", 8 * GiB),
        ("1.5G", 3 * GiB // 2),
        ("2GB", 2 * 10**9),
        ("64KiB", 64 * KiB),
        ("100B", 100),
        (4096, 4096),
    ],
)
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "lots", "8 GiBs", "-1", "1..5G", True, 1.5, -3, None])
def test_parse_bytes_rejects(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


def test_human_bytes():
    assert human_bytes(524288) == "512 KiB"
    assert human_bytes(46080) == "45 KiB"
    assert human_bytes(100) == "100 B"
    assert human_bytes(3.5 * GiB) == "3.5 GiB"




@pytest.mark.parametrize("text", ["1e400", "99999999999999999999999999999GiB", 2**63, "8388608TiB"])
def test_parse_bytes_refuses_sizes_past_2_63_naming_the_field(text):
    """``1e400`` was an OverflowError (float), a 29-digit GiB count a rounded float."""
    with pytest.raises(ValueError, match="kv_cache_memory_bytes must be less than"):
        parse_bytes(text, "kv_cache_memory_bytes")
    assert parse_bytes("8388607TiB") == 8388607 * 1024**4  # exact, below 2**63


def test_parse_bytes_names_the_field():
    with pytest.raises(ValueError, match="swap_space_bytes"):
        parse_bytes("much", "swap_space_bytes")


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


@pytest.mark.skipif(utils._glibc_malloc_trim() is None, reason="malloc_trim: Linux with glibc")
def test_release_free_heap_returns_freed_memory_inside_the_heap():
    """64 MiB of small malloc'd blocks, all freed but the last (which pins the heap's top, so
    free() cannot give it back): resident until release_free_heap, then returned."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(4000) for _ in range(16384)]  # below the mmap threshold: the heap
    for b in blocks:
        ctypes.memset(b, 1, 4000)
    for b in blocks[:-1]:
        libc.free(b)
    try:
        before = _rss_mib()
        assert release_free_heap()
        assert before - _rss_mib() > 40
    finally:
        libc.free(blocks[-1])


def test_release_free_heap_without_glibc_is_a_no_op(monkeypatch):
    monkeypatch.setattr(utils, "_glibc_malloc_trim", lambda: None)
    assert release_free_heap() is False


_REUSE_PROBE = r"""
import ctypes, resource, sys
from kvflow import utils

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]


def faults(rounds=4, size=48 << 20):  # a 48 MiB block written and freed, as a step's logits
    block = libc.malloc(size); ctypes.memset(block, 1, size); libc.free(block)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(rounds):
        block = libc.malloc(size); ctypes.memset(block, 1, size); libc.free(block)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


default = faults()
assert utils.reuse_large_allocations(256 << 20)
print(default, faults())
"""


@pytest.mark.skipif(utils._glibc() is None, reason="mallopt: Linux with glibc")
def test_reuse_large_allocations_stops_the_page_faults_of_a_block_made_every_step():
    """glibc maps a 48 MiB block afresh at each malloc (a page fault per page when written);
    once reuse_large_allocations covers it, the heap keeps it and the next ones fault no more.
    In a child process: the setting is process-wide."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", _REUSE_PROBE], capture_output=True, text=True, check=True).stdout
    default, reused = map(int, out.split())
    assert default > 0 and reused < 0.1 * default + 50, (default, reused)


def test_reuse_large_allocations_checks_its_limit(monkeypatch):
    with pytest.raises(ValueError, match="2 GiB"):
        utils.reuse_large_allocations(2**31)
    with pytest.raises(ValueError):
        utils.reuse_large_allocations(-1)
    assert utils.reuse_large_allocations(0) is False
    monkeypatch.setattr(utils, "_glibc", lambda: None)
    assert utils.reuse_large_allocations(1 << 20) is False


class _Cycle:
    """An object in a reference cycle: only the cyclic garbage collector can free it."""

    def __init__(self) -> None:
        self.me = self


def test_freeze_gc_heap_collects_first_freezes_the_rest_and_unfreeze_gives_it_back():
    import gc
    import weakref

    try:
        dropped, kept = _Cycle(), _Cycle()
        dropped_ref, kept_ref = weakref.ref(dropped), weakref.ref(kept)
        del dropped  # garbage before the freeze: collected by it, not frozen
        frozen = freeze_gc_heap()
        # the count it returns: another thread of the test process (a kernel build's, a
        # logger's) may free a few frozen objects between the two reads (2 did once in CI)
        assert 0 < gc.get_freeze_count() <= frozen < gc.get_freeze_count() + 1000
        assert dropped_ref() is None
        del kept  # frozen, then dropped: no collection sees it until unfrozen
        gc.collect()
        assert kept_ref() is not None
        unfreeze_gc_heap()
        assert gc.get_freeze_count() == 0
        gc.collect()
        assert kept_ref() is None
        # A second freeze undoes the first: what the first froze and was dropped since is
        # reclaimed by the second's collection.
        again = _Cycle()
        again_ref = weakref.ref(again)
        freeze_gc_heap()
        del again
        freeze_gc_heap()
        assert again_ref() is None
    finally:
        _release_every_hold()


def test_gc_freeze_holds_nest_and_the_last_release_unfreezes():
    """Holds nest: the first freezes (no collection), the last release unfreezes; the
    server's ``freeze_gc_heap`` is one of them, so an engine going idle under a server
    leaves the server's freeze in place."""
    import gc
    import weakref

    try:
        garbage = _Cycle()
        garbage_ref = weakref.ref(garbage)
        del garbage
        hold_gc_freeze()
        assert gc.get_freeze_count() > 0
        gc.collect()
        assert garbage_ref() is not None  # frozen without a collection first
        hold_gc_freeze()
        release_gc_freeze()
        assert gc.get_freeze_count() > 0  # one hold left
        release_gc_freeze()
        assert gc.get_freeze_count() == 0
        gc.collect()
        assert garbage_ref() is None
        release_gc_freeze()  # without a hold: nothing
        assert gc.get_freeze_count() == 0
        freeze_gc_heap()  # the server's
        hold_gc_freeze()  # an engine's busy period
        release_gc_freeze()
        assert gc.get_freeze_count() > 0
        unfreeze_gc_heap()
        assert gc.get_freeze_count() == 0
    finally:
        _release_every_hold()


def _release_every_hold() -> None:
    import gc

    import kvflow.utils

    while kvflow.utils._freeze_holds:
        release_gc_freeze()
    gc.unfreeze()
