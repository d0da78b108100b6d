"""benchmarks/hybrid_kv.py on the Gemma 3 1B shape (config only) with a small budget: the
allocator's numbers agree with ``kvflow memory``'s and the window-aware cache fits more."""

from __future__ import annotations

from benchmarks import hybrid_kv

MiB = 1024**2


def test_allocator_agrees_with_the_formula_and_fits_more(tmp_path):
    hybrid_kv.gemma3_1b_config().save_pretrained(tmp_path)
    keep, window = hybrid_kv.measure("1b", tmp_path, 256 * MiB, 4096, 1024, "bfloat16")
    assert (keep["mode"], window["mode"]) == ("keep-all", "window")
    # keep-all: 256 blocks of 26 layers x 1 KV head x 256 x 2 (K, V) x 2 bytes x 16 tokens
    assert keep["bytes_per_block"] == 26 * 256 * 2 * 2 * 16 and keep["blocks_per_request"] == 256
    assert keep["kv_bytes_per_request"] == keep["formula_bytes_per_request"]
    assert keep["concurrent_requests"] == keep["formula_concurrent"] == 256 * MiB // (256 * keep["bytes_per_block"])
    # window: pages of 4 layers; at 4,096 tokens 256 global + 6 x 32 local pages (the formula's
    # decode bound is 33 per local group); the prefill peak of the last request costs at most one
    assert window["groups"]["group_size"] == 4 and window["blocks_per_request"] == 256 + 6 * 32
    assert window["kv_bytes_per_request"] <= window["formula_bytes_per_request"]
    assert window["formula_concurrent"] - 1 <= window["concurrent_requests"] <= window["formula_concurrent"]
    assert window["concurrent_requests"] >= 3 * keep["concurrent_requests"]
