"""kvflow.huge_pages: the arena of huge-page-advised mappings for packed weights and the KV cache."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from kvflow import huge_pages
from tests.conftest import vm_flags


# (a kernel built without transparent huge pages refuses the advice: nothing to see in VmFlags)
needs_linux = pytest.mark.skipif(not huge_pages.supported() or not os.path.exists("/sys/kernel/mm/transparent_hugepage"),
                                 reason="madvise(MADV_HUGEPAGE): Linux with transparent huge pages")


@needs_linux
def test_large_tensors_are_advised_small_ones_are_not(monkeypatch):
    monkeypatch.setenv("KVFLOW_HUGE_PAGES", "1")
    big = huge_pages.empty((300, 1000), torch.bfloat16)
    assert big.shape == (300, 1000) and big.dtype == torch.bfloat16 and big.is_contiguous()
    assert big.data_ptr() % 64 == 0
    assert "hg" in vm_flags(big.data_ptr())  # advised MADV_HUGEPAGE
    chunk = huge_pages._chunk
    small = huge_pages.empty((16,), torch.float32)  # below MIN_BYTES: torch.empty
    lo, hi = chunk.data_ptr(), chunk.data_ptr() + chunk.numel()
    assert huge_pages._chunk is chunk and not lo <= small.data_ptr() < hi


@needs_linux
def test_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv("KVFLOW_HUGE_PAGES", "0")
    assert not huge_pages.enabled()
    mapped = []

    def record(nbytes):
        mapped.append(nbytes)
        raise OSError("recorded")  # empty() then falls back to torch.empty

    monkeypatch.setattr(huge_pages, "_mapping", record)
    monkeypatch.setattr(huge_pages, "_chunk", None)
    t = huge_pages.empty((1 << 20,), torch.uint8)
    assert t.numel() == 1 << 20 and mapped == []  # torch.empty's memory: no arena mapping asked for
    monkeypatch.setenv("KVFLOW_HUGE_PAGES", "1")
    huge_pages.empty((1 << 20,), torch.uint8)
    assert mapped == [huge_pages.CHUNK_BYTES]  # on again: the arena maps


@needs_linux
def test_tensors_share_a_mapping_and_keep_it_alive(monkeypatch):
    monkeypatch.setenv("KVFLOW_HUGE_PAGES", "1")
    monkeypatch.setattr(huge_pages, "_chunk", None)
    a = huge_pages.empty((1000, 100), torch.uint8)
    b = huge_pages.empty((999, 100), torch.float32)
    assert b.data_ptr() == a.data_ptr() + 100_032  # carved after a, on the next cache line
    a.fill_(3)
    b.fill_(0.5)
    monkeypatch.setattr(huge_pages, "_chunk", None)  # the arena moves on: the tensors still own their memory
    del a
    gc.collect()
    assert b.sum().item() == 0.5 * 999 * 100
    big = huge_pages.empty((huge_pages.CHUNK_BYTES // 2,), torch.uint8)  # a mapping of its own
    assert big.data_ptr() != b.data_ptr() + b.numel() * 4 and "hg" in vm_flags(big.data_ptr())


def test_off_linux_it_is_torch_empty(monkeypatch):
    monkeypatch.setattr(huge_pages, "supported", lambda: False)
    t = huge_pages.empty((512, 512), torch.float32)
    assert t.shape == (512, 512) and t.dtype == torch.float32


@needs_linux
def test_a_refused_mapping_or_advice_falls_back(monkeypatch):
    monkeypatch.setenv("KVFLOW_HUGE_PAGES", "1")
    monkeypatch.setattr(huge_pages, "_chunk", None)

    asked = []

    def refuse(nbytes):
        asked.append(nbytes)
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(huge_pages, "_mapping", refuse)
    t = huge_pages.empty((1 << 20,), torch.uint8)
    t.fill_(2)
    # the arena asked for a mapping, was refused, and fell back to torch.empty (whose heap may
    # itself be advised by the allocator, e.g. glibc.malloc.hugetlb, so VmFlags tell nothing here)
    assert asked == [huge_pages.CHUNK_BYTES] and huge_pages._chunk is None
    assert t.shape == (1 << 20,) and t.sum().item() == 2 << 20
    monkeypatch.undo()
    monkeypatch.setenv("KVFLOW_HUGE_PAGES", "1")
    monkeypatch.setattr(huge_pages, "_chunk", None)

    # an advice the kernel refuses (EINVAL), as a kernel without transparent huge pages does
    monkeypatch.setattr(huge_pages.mmap, "MADV_HUGEPAGE", 12345)
    u = huge_pages.empty((1 << 20,), torch.uint8)
    u.fill_(1)
    assert u.sum().item() == 1 << 20 and "hg" not in vm_flags(u.data_ptr())
