"""The Triton attention backend (``kvflow.attention.triton_attention``): one kernel serves decode,
prefill and chunked prefill over the block tables (flat per-request metadata, int32), a
second writes the cache and skips negative slots (the padding rows of a CUDA graph). Runs on
CUDA, or in Triton's CPU interpreter with ``TRITON_INTERPRET=1`` (tests only)."""

from __future__ import annotations

import torch

from kvflow.attention.backend import AttentionBackend, BatchLayout, FlatMetadata
from kvflow.attention.triton_attention import triton_paged_attention, triton_write_kv_cache


class TritonAttentionBackend(AttentionBackend):
    """Triton kernels over the block tables. Its metadata is graph-safe: ``graph_metadata``
    wraps a CUDA graph's static buffers, rows past the real batch inert (slot -1, no query
    tokens). On a quantized cache its query rows are treated alike whatever the chunk, so
    it asks for batch-invariant CPU linears (in Triton's CPU interpreter; cuBLAS linears on
    CUDA are not batch-invariant)."""

    name = "triton"
    supports_cuda_graphs = True

    def __init__(self, quantized_kv: bool = False) -> None:
        self.needs_batch_invariant_linears = quantized_kv

    def build_metadata(self, layout: BatchLayout) -> FlatMetadata:
        return FlatMetadata.build(self, layout, torch.int32)

    def graph_metadata(self, slot_mapping: torch.Tensor, block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                       context_lens: torch.Tensor) -> FlatMetadata:
        """Decode metadata over static buffers (one query token per row): slot_mapping int64
        [B], block_tables int32 [B, max_blocks], query_start_loc int32 [B + 1], context_lens
        int32 [B]."""
        return FlatMetadata(self, slot_mapping, block_tables, query_start_loc, context_lens, max_query_len=1)

    def write_kv(self, k, v, kv_cache, metadata) -> None:
        triton_write_kv_cache(k, v, kv_cache, metadata.slot_mapping)

    def attend(self, q, kv_cache, metadata, scale) -> torch.Tensor:
        return triton_paged_attention(q, kv_cache, metadata, scale)

    def __repr__(self) -> str:
        return f"TritonAttentionBackend(quantized_kv={self.needs_batch_invariant_linears})"
