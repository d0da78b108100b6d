"""The CPU attention backends: kvflow's C++ kernels (``kvflow.attention.cpu_attention``).

- ``CpuAttentionBackend`` (a float cache of the model's dtype): decodes read K/V straight
  from the paged cache through the block tables (no gather, no padding, so all decodes form
  one group); prefill chunks (float32 / bfloat16) run the same extension's tiled
  flash-attention pass over the paged cache (``paged_prefill_attention``; causal with the
  chunk's offset, sliding windows included), or gather + SDPA with
  ``KVFLOW_CPU_PREFILL_ATTENTION=0``. Sliding-window layers (the C++ decode kernel attends
  from position 0) take the PyTorch path with the window's mask for their decodes; full-attention
  layers keep the kernel. While the kernel is being built in the background
  (``KVFLOW_CPU_KERNEL_BUILD=background``) decodes and prefills take the PyTorch path, until
  the engine switches to the kernel between two steps.
- ``CpuQuantizedAttentionBackend`` (an int8 / fp8 cache): every token, prefill ones too, is
  attended as a one-token decode over its own dequantized context
  (``paged_attention_quantized``): batch-invariant, so together with batch-invariant linears
  (``needs_batch_invariant_linears``) a token's stored K/V never depend on how its step was
  batched or chunked, and a request's output is the same with or without prefix-cache hits.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from kvflow.attention.backend import AttentionBackend, BatchLayout, FlatMetadata
from kvflow.attention.kv_cache import KVCache, write_kv_cache
from kvflow.attention.torch_backend import AttentionGroup, GroupedMetadata, grouped_attention, grouped_metadata
from kvflow.attention.cpu_attention import (cpu_kernel_available, paged_attention_quantized, paged_decode_attention,
                                               paged_prefill_attention, prefill_kernel_enabled, takes_prefill_input)


@dataclass
class CpuGroupedMetadata(GroupedMetadata):
    """``GroupedMetadata`` plus, per group, its requests' query row starts for the prefill
    kernel.

    Attributes:
        query_start_locs: per group, int32 [B + 1] (request b's query rows are
            ``[b] : [b + 1]`` of the group's rows), or None for a decode group.
        layout: the ``BatchLayout`` it was built from (None: built by hand), which says
            which tokens are prompt tokens (``kvflow.layers.fused_decode`` splits a step by it).
    """

    query_start_locs: list = field(default_factory=list)
    layout: BatchLayout | None = None


def _query_start_loc(metadata: GroupedMetadata, index: int, group: AttentionGroup) -> torch.Tensor:
    """int32 [B + 1]: where each request's query rows start in ``group``'s rows (built with the
    metadata when it is a ``CpuGroupedMetadata``, else from ``group.query_index``)."""
    starts = getattr(metadata, "query_start_locs", None)
    if starts and starts[index] is not None:
        return starts[index]
    lens = torch.bincount(group.query_index // group.max_query_len, minlength=group.num_requests)
    return torch.cat([lens.new_zeros(1), lens.cumsum(0)]).to(torch.int32)


def _attend_with_prefill_kernel(q, kv_cache, metadata: GroupedMetadata, scale, sliding_window, decode_kernel):
    """Prefill groups through ``paged_prefill_attention`` (written into the step's output),
    decode groups as ``grouped_attention`` runs them."""
    out = torch.empty_like(q)
    for i, g in enumerate(metadata.groups):
        rows = slice(g.token_start, g.token_end)
        if g.max_query_len > 1:
            paged_prefill_attention(q[rows], kv_cache[0], kv_cache[1], g.block_tables, _query_start_loc(metadata, i, g),
                                    g.context_lens, scale, sliding_window, out=out[rows])
        else:
            one = GroupedMetadata(metadata.slot_mapping, [replace(g, token_start=0, token_end=g.token_end - g.token_start)],
                                  metadata.backend)
            out[rows] = grouped_attention(q[rows], kv_cache, one, scale, decode_kernel=decode_kernel,
                                          sliding_window=sliding_window)
    return out


def _decode_kernel(q: torch.Tensor, kv_cache: KVCache, group: AttentionGroup, scale: float) -> torch.Tensor:
    return paged_decode_attention(q, kv_cache[0], kv_cache[1], group.block_tables, group.context_lens, scale)


class CpuAttentionBackend(AttentionBackend):
    """Decodes and (float32 / bfloat16) prefill chunks in the C++ kernels over a float cache of the
    model's dtype; the rest as "torch"."""

    name = "cpu"

    def build_metadata(self, layout: BatchLayout) -> CpuGroupedMetadata:
        metadata = grouped_metadata(self, layout)
        starts, first = [], 0
        for size in layout.group_sizes:
            q_lens = layout.query_lens[first : first + size]
            first += size
            if size and int(q_lens.max()) > 1:  # (query_lens: an int64 tensor, see BatchLayout)
                loc = torch.zeros(size + 1, dtype=torch.int32)
                loc[1:] = q_lens.cumsum(0)
                starts.append(loc)
            else:
                starts.append(None)
        return CpuGroupedMetadata(metadata.slot_mapping, metadata.groups, metadata.backend, starts, layout)

    def write_kv(self, k, v, kv_cache, metadata) -> None:
        write_kv_cache(k, v, kv_cache, metadata.slot_mapping)

    supports_sliding_window = True

    def attend(self, q, kv_cache, metadata, scale, sliding_window=None) -> torch.Tensor:
        # While the kernel builds in the background (kvflow.ops.build.start_background_builds)
        # decodes and prefills gather + SDPA; it is published between steps only, so a step never mixes.
        available = cpu_kernel_available()
        # The C++ decode kernel has no window: windowed decodes gather + SDPA with its mask.
        kernel = _decode_kernel if available and sliding_window is None else None
        if (available and any(g.max_query_len > 1 for g in metadata.groups) and len(kv_cache) == 2
                and takes_prefill_input(q, kv_cache[0]) and prefill_kernel_enabled()):
            return _attend_with_prefill_kernel(q, kv_cache, metadata, scale, sliding_window, kernel)
        return grouped_attention(q, kv_cache, metadata, scale, decode_kernel=kernel, sliding_window=sliding_window)


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
