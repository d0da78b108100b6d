"""The CPU attention backends: kvflow's C++ kernels (``kvflow.attention.cpu_attention``).

- ``CpuAttentionBackend`` (a float cache of the model's dtype): decodes read K/V straight
  from the paged cache through the block tables (no gather, no padding, so all decodes form
  one group); prefill chunks take the PyTorch path of ``torch_backend``. Sliding-window
  layers (the C++ decode kernel attends from position 0) take the PyTorch path with the
  window's mask for their decodes too; full-attention layers keep the kernel. While the
  kernel is being built in the background (``KVFLOW_CPU_KERNEL_BUILD=background``) decodes
  take the PyTorch path too, until the engine switches to the kernel between two steps.
- ``CpuQuantizedAttentionBackend`` (an int8 / fp8 cache): every token, prefill ones too, is
  attended as a one-token decode over its own dequantized context
  (``paged_attention_quantized``): batch-invariant, so together with batch-invariant linears
  (``needs_batch_invariant_linears``) a token's stored K/V never depend on how its step was
  batched or chunked, and a request's output is the same with or without prefix-cache hits.
"""

from __future__ import annotations

import torch

from kvflow.attention.backend import AttentionBackend, BatchLayout, FlatMetadata
from kvflow.attention.kv_cache import KVCache, write_kv_cache
from kvflow.attention.torch_backend import AttentionGroup, GroupedMetadata, grouped_attention, grouped_metadata
from kvflow.attention.cpu_attention import cpu_kernel_available, paged_attention_quantized, paged_decode_attention


def _decode_kernel(q: torch.Tensor, kv_cache: KVCache, group: AttentionGroup, scale: float) -> torch.Tensor:
    return paged_decode_attention(q, kv_cache[0], kv_cache[1], group.block_tables, group.context_lens, scale)


class CpuAttentionBackend(AttentionBackend):
    """Decodes in the C++ kernel over a float cache of the model's dtype; prefills as "torch"."""

    name = "cpu"

    def build_metadata(self, layout: BatchLayout) -> GroupedMetadata:
        return grouped_metadata(self, layout)

    def write_kv(self, k, v, kv_cache, metadata) -> None:
        write_kv_cache(k, v, kv_cache, metadata.slot_mapping)

    supports_sliding_window = True

    def attend(self, q, kv_cache, metadata, scale, sliding_window=None) -> torch.Tensor:
        if sliding_window is not None:  # the C++ kernel has no window: gather + SDPA with its mask
            return grouped_attention(q, kv_cache, metadata, scale, sliding_window=sliding_window)
        # While the kernel builds in the background (kvflow.ops.build.start_background_builds)
        # decodes gather + SDPA; it is published between steps only, so a step never mixes.
        kernel = _decode_kernel if cpu_kernel_available() else None
        return grouped_attention(q, kv_cache, metadata, scale, decode_kernel=kernel)


class CpuQuantizedAttentionBackend(AttentionBackend):
    """Every token through ``paged_attention_quantized`` over an int8 / fp8 cache (flat
    metadata, int64 block tables)."""

    name = "cpu"
    needs_batch_invariant_linears = True

    def build_metadata(self, layout: BatchLayout) -> FlatMetadata:
        return FlatMetadata.build(self, layout, torch.int64)

    def write_kv(self, k, v, kv_cache, metadata) -> None:
        write_kv_cache(k, v, kv_cache, metadata.slot_mapping)

    def attend(self, q, kv_cache, metadata, scale) -> torch.Tensor:
        return paged_attention_quantized(
            q, kv_cache, metadata.block_tables, metadata.query_start_loc, metadata.context_lens, scale
        )

    def __repr__(self) -> str:
        return "CpuQuantizedAttentionBackend()"
