"""kvflow.attention.cache_engine / kv_cache: where the paged KV pool's tensors live."""

from __future__ import annotations

import os

import pytest
import torch

from kvflow import huge_pages
from tests.conftest import vm_flags
from kvflow.attention.cache_engine import CacheEngine
from kvflow.attention.kv_cache import allocate_kv_cache
from kvflow.config import CacheConfig, KVCacheSpec


needs_thp = pytest.mark.skipif(not huge_pages.supported() or not os.path.exists("/sys/kernel/mm/transparent_hugepage"),
                               reason="madvise(MADV_HUGEPAGE): Linux with transparent huge pages")


@needs_thp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_the_cpu_pool_is_zeroed_on_huge_pages(monkeypatch, dtype):
    monkeypatch.setenv("KVFLOW_HUGE_PAGES", "1")
    # 2 layers x 64 blocks x 16 tokens x 4 heads x 64 = 256 KiB a tensor (over MIN_BYTES)
    engine = CacheEngine(KVCacheSpec(2, 4, 64), CacheConfig(16, 64, dtype), torch.device("cpu"))
    for cache in engine.kv_caches:
        assert len(cache) == (4 if dtype == torch.int8 else 2)
        for t in cache[:2]:
            assert t.shape == (64, 16, 4, 64) and t.dtype == dtype and t.is_contiguous()
            assert not t.any()
            assert "hg" in vm_flags(t.data_ptr())  # advised MADV_HUGEPAGE
    k = engine.kv_caches[0][0]
    k.view(-1)[:5] = 1  # the tensors are distinct memory
    assert not engine.kv_caches[0][1].any() and not engine.kv_caches[1][0].any()


@needs_thp
def test_the_switch_and_the_throwaway_cache_keep_ordinary_pages(monkeypatch):
    monkeypatch.setenv("KVFLOW_HUGE_PAGES", "0")
    engine = CacheEngine(KVCacheSpec(1, 4, 64), CacheConfig(16, 64, torch.float32), torch.device("cpu"))
    assert "hg" not in vm_flags(engine.kv_caches[0][0].data_ptr())
    monkeypatch.setenv("KVFLOW_HUGE_PAGES", "1")
    # forward_prompt's cache (dropped after one call) is not carved from the arena
    k, v = allocate_kv_cache(64, 16, 4, 64, torch.float32, torch.device("cpu"))
    assert "hg" not in vm_flags(k.data_ptr()) and not k.any() and not v.any()
