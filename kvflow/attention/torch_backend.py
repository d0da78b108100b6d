"""The PyTorch attention backend: gather + ``scaled_dot_product_attention``, batched over requests.

Each step gathers K/V through the block tables for a whole group of requests at once and
runs one ``scaled_dot_product_attention`` call for the group, with GQA handled by folding
the query heads that share a KV head into the query-length axis (no copy of K/V per query
head). Requests are split into groups so that padding stays small: decodes (one query token
each) in groups of similar context length (``split_by_context``), and prefills (several
query tokens each, padded to the longest chunk). There is no Python loop over requests
inside a layer, only over the step's few groups. Runs on any device and cache dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import numpy as np

from kvflow.attention.backend import AttentionBackend, BatchLayout, padded_block_tables
from kvflow.attention.kv_cache import KVCache, gather_kv, write_kv_cache


@dataclass
class AttentionGroup:
    """Requests of one step whose queries are padded to the same length.

    Attributes:
        token_start, token_end: the group's token range in the step's flat token axis.
        block_tables: int64 [B, max_blocks], padded with block 0 (masked out).
        query_index: int64 [T_g], position of each flat token in the padded
            [B * max_query_len] layout.
        max_query_len: longest query chunk in the group, in tokens.
        attn_mask: bool [B, 1, max_query_len, max_blocks * block_size]; True where the
            query may attend (key position <= query position, inside the context).
        context_lens: int32 [B], tokens in each request's cache after this step's writes.
        query_positions: int64 [B, max_query_len], the position of each padded query row
            (for sliding-window masks, ``window_mask``).
    """

    token_start: int
    token_end: int
    block_tables: torch.Tensor
    query_index: torch.Tensor
    max_query_len: int
    attn_mask: torch.Tensor
    context_lens: torch.Tensor | None = None
    query_positions: torch.Tensor | None = None
    _window_masks: dict = field(default_factory=dict, repr=False, compare=False)
    _folded_masks: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_requests(self) -> int:
        return self.block_tables.shape[0]

    def window_mask(self, sliding_window: int | None) -> torch.Tensor:
        """``attn_mask`` restricted to a sliding window of ``sliding_window`` tokens: key j is
        visible from the query at position i when ``i - sliding_window < j <= i``
        (transformers' ``sliding_window_overlay``); None: ``attn_mask``. Same shape; built
        once per step and window, shared by the layers of that window."""
        if sliding_window is None:
            return self.attn_mask
        mask = self._window_masks.get(sliding_window)
        if mask is None:
            keys = torch.arange(self.attn_mask.shape[-1], device=self.attn_mask.device)
            # [B, 1, max_q, keys]
            inside = keys.view(1, 1, 1, -1) > (self.query_positions - sliding_window).unsqueeze(1).unsqueeze(-1)
            mask = self._window_masks[sliding_window] = self.attn_mask & inside
        return mask

    def folded_mask(self, group_size: int, sliding_window: int | None = None) -> torch.Tensor:
        """``window_mask(sliding_window)`` repeated for the ``group_size`` query heads that
        share a KV head, in the folded layout of ``grouped_attention``: bool [B, 1,
        group_size * max_query_len, max_blocks * block_size]. Built once per step and shared
        by every layer."""
        mask = self._folded_masks.get((group_size, sliding_window))
        if mask is None:
            b, _, max_q, keys = self.attn_mask.shape
            mask = self.window_mask(sliding_window)
            if group_size > 1:
                mask = mask.unsqueeze(2).expand(b, 1, group_size, max_q, keys).reshape(b, 1, group_size * max_q, keys)
            self._folded_masks[(group_size, sliding_window)] = mask
        return mask

    @classmethod
    def build(
        cls,
        token_start: int,
        query_lens: torch.Tensor | list[int],
        context_lens: torch.Tensor | list[int],
        block_tables: torch.Tensor | list[list[int]],
        block_size: int,
        device: torch.device,
    ) -> "AttentionGroup":
        """Build the metadata of a group.

        Args:
            token_start: index of the group's first token in the step's flat token axis.
            query_lens: new tokens per request this step (int64 [B] or a list).
            context_lens: tokens in the cache per request after this step's writes
                (``num_computed_tokens + query_len``; int64 [B] or a list).
            block_tables: physical block ids per request, covering ``context_lens``: int64
                [B, max_blocks] padded with block 0, or a list of lists.
            block_size: tokens per block.
            device: where the tensors go.
        """
        table = block_tables if isinstance(block_tables, torch.Tensor) else padded_block_tables(block_tables, torch.int64)
        # The index arithmetic in numpy on the host (a few us per op against ~8 for a small
        # torch op: this runs every step), then one copy of each result to ``device``.
        q_lens = _host_int64(query_lens)
        ctx_lens = _host_int64(context_lens)
        num_reqs = len(q_lens)
        max_q = int(q_lens.max())
        max_blocks = table.shape[1]
        # Position of padded query row (b, i) is ctx_len[b] - q_len[b] + i.
        rows = np.arange(max_q, dtype=np.int64)
        q_pos = (ctx_lens - q_lens)[:, None] + rows[None, :]  # [B, max_q]
        key_pos = np.arange(max_blocks * block_size, dtype=np.int64)[None, None, :]
        mask = (key_pos <= q_pos[:, :, None]) & (key_pos < ctx_lens[:, None, None])
        valid = rows[None, :] < q_lens[:, None]  # [B, max_q]
        query_index = (np.arange(num_reqs, dtype=np.int64)[:, None] * max_q + rows[None, :])[valid]
        return cls(
            token_start=token_start,
            token_end=token_start + int(q_lens.sum()),
            block_tables=table.to(device),
            query_index=torch.from_numpy(query_index).to(device),
            max_query_len=max_q,
            attn_mask=torch.from_numpy(mask).unsqueeze(1).to(device),
            context_lens=torch.from_numpy(ctx_lens.astype(np.int32)).to(device),
            query_positions=torch.from_numpy(q_pos).to(device),
        )


def _host_int64(values: torch.Tensor | list[int]) -> np.ndarray:
    """int64 [N] numpy array of a 1-D tensor (any device, copied to the host) or a list."""
    if isinstance(values, torch.Tensor):
        return values.detach().cpu().numpy().astype(np.int64, copy=False)
    return np.asarray(values, dtype=np.int64)


GROUP_OVERHEAD_TOKENS = 512
"""Cost of one more attention group (its per-layer ops: gather, SDPA, reshapes), in key
tokens gathered: about 40 us per layer on this project's CPU against ~0.08 us per bfloat16
key token (K and V of 3 heads x 64)."""


def split_by_context(context_blocks: list[int], block_size: int, overhead_tokens: int = GROUP_OVERHEAD_TOKENS) -> list[list[int]]:
    """Partition decode requests into attention groups so that padding stays small.

    A group gathers ``len(group) * max(context_blocks in group) * block_size`` key slots per
    layer; every group also costs a fixed ``overhead_tokens``. Sorting by context and cutting
    the sorted list into runs minimizes that total exactly (an O(n^2) dynamic program over
    cut points; a cheaper group never needs a request longer than one in a later group).

    Args:
        context_blocks: blocks in each request's context (after this step's writes).
        block_size: tokens per block.
        overhead_tokens: fixed cost of a group, in key tokens.

    Returns:
        Groups of indices into ``context_blocks``, each sorted by context, in ascending
        order of context; together a permutation of ``range(len(context_blocks))``.

    The dynamic program runs over runs of equal context (a cut inside a run never costs
    less than one at its end), vectorized over the candidate cuts with numpy: one pass of
    a few array operations per distinct context length, instead of the O(n^2) Python loop
    over requests (28 ms at 256 decodes; ``_split_by_context_reference`` keeps that form
    for the tests). Ties go to the earliest cut, as in the reference.
    """
    n = len(context_blocks)
    if n <= 1:
        return [[0]] if n else []
    blocks = np.asarray(context_blocks, dtype=np.int64)
    order = np.argsort(blocks, kind="stable")
    lengths = (blocks[order] * block_size).astype(np.float64)
    # Candidate cuts: 0 and every run end; with overhead >= 0 a cut inside a run of equal
    # lengths is never strictly better (moving the run's rest into the earlier group costs
    # no more). Ties between an inner cut and an earlier one are kept by the reference,
    # so inner cuts are candidates too when the overhead is 0 (all cuts, the plain DP).
    if overhead_tokens > 0:
        ends = np.flatnonzero(np.diff(lengths)) + 1
        cuts = np.concatenate(([0], ends, [n])) if len(ends) else np.array([0, n])
    else:
        cuts = np.arange(n + 1)
    m = len(cuts)
    best = np.full(m, np.inf)
    best[0] = 0.0
    prev = np.zeros(m, dtype=np.int64)
    for j in range(1, m):
        longest = lengths[cuts[j] - 1]
        costs = best[:j] + (cuts[j] - cuts[:j]) * longest + overhead_tokens
        i = int(np.argmin(costs))
        best[j], prev[j] = costs[i], i
    groups = []
    j = m - 1
    while j > 0:
        groups.append(order[cuts[prev[j]] : cuts[j]].tolist())
        j = int(prev[j])
    return groups[::-1]


def _split_by_context_reference(context_blocks: list[int], block_size: int,
                                overhead_tokens: int = GROUP_OVERHEAD_TOKENS) -> list[list[int]]:
    """``split_by_context`` as the plain O(n^2) dynamic program over every cut (the
    reference the tests compare the vectorized form with)."""
    order = sorted(range(len(context_blocks)), key=context_blocks.__getitem__)
    lengths = [context_blocks[i] * block_size for i in order]
    n = len(order)
    best = [0.0] + [float("inf")] * n
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        longest = lengths[j - 1]
        for i in range(j):
            cost = best[i] + (j - i) * longest + overhead_tokens
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups = []
    j = n
    while j > 0:
        groups.append(order[cut[j] : j])
        j = cut[j]
    return groups[::-1]


@dataclass
class GroupedMetadata:
    """Everything the grouped backends need for one step, shared by all layers.

    Attributes:
        slot_mapping: int64 [T]; flat cache slot of each new token.
        groups: token groups (decodes, prefills) covering the step's tokens, in order.
        backend: the backend that runs it (default: ``TorchAttentionBackend``).
    """

    slot_mapping: torch.Tensor
    groups: list[AttentionGroup]
    backend: AttentionBackend = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.backend is None:
            self.backend = TORCH_BACKEND


def grouped_metadata(backend: AttentionBackend, layout: BatchLayout) -> GroupedMetadata:
    """One ``AttentionGroup`` per entry of ``layout.group_sizes``."""
    groups, token, first = [], 0, 0
    for size in layout.group_sizes:
        last = first + size
        q_lens = layout.query_lens[first:last]
        group = AttentionGroup.build(token, q_lens, layout.context_lens[first:last], layout.tables(first, last),
                                     layout.block_size, layout.device)
        groups.append(group)
        token = group.token_end
        first = last
    return GroupedMetadata(layout.slot_mapping, groups, backend)


DecodeKernel = Callable[[torch.Tensor, KVCache, AttentionGroup, float], torch.Tensor]


def grouped_attention(q: torch.Tensor, kv_cache: KVCache, metadata: GroupedMetadata, scale: float,
                      decode_kernel: DecodeKernel | None = None, sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention of the step's queries over their requests' cached K/V, group by group.

    Args:
        q: [T, num_heads, head_dim], the step's queries (RoPE applied).
        kv_cache: the layer's cache, already holding this step's K/V; a quantized cache is
            dequantized after the gather.
        metadata: the step's groups.
        scale: softmax scale, usually head_dim ** -0.5.
        decode_kernel: runs a decode group (one query token per request) instead of gather +
            SDPA, or None.
        sliding_window: the layer's window in tokens (``AttentionGroup.window_mask``), or
            None for full causal attention.

    Returns:
        [T, num_heads, head_dim] attention output, dtype of q.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache[0].shape[2]
    group_size = num_heads // num_kv_heads
    single = len(metadata.groups) == 1
    out = None if single else torch.empty_like(q)
    for g in metadata.groups:
        b, max_q = g.num_requests, g.max_query_len
        q_g = q if single else q[g.token_start : g.token_end]
        if max_q == 1 and decode_kernel is not None:
            o = decode_kernel(q_g, kv_cache, g, scale)
            if single:
                return o
            out[g.token_start : g.token_end] = o
            continue
        # Gather K/V through the block tables: [B, kv_heads, max_blocks * block_size, head_dim].
        k = gather_kv(kv_cache, 0, g.block_tables, q.dtype)
        v = gather_kv(kv_cache, 1, g.block_tables, q.dtype)
        if max_q == 1:
            # Decode: fold the query heads sharing a KV head into the query axis by a view:
            # [B, 1, kv * group, D] -> [B, kv, group, D].
            q_fold = q_g.view(b, num_kv_heads, group_size, head_dim)
        else:
            q_pad = q.new_zeros(b * max_q, num_heads, head_dim)
            q_pad.index_copy_(0, g.query_index, q_g)
            q_pad = q_pad.view(b, max_q, num_kv_heads, group_size, head_dim)
            # [B, kv, group * max_q, D]
            q_fold = q_pad.permute(0, 2, 3, 1, 4).reshape(b, num_kv_heads, group_size * max_q, head_dim)
        o = F.scaled_dot_product_attention(q_fold, k, v, attn_mask=g.folded_mask(group_size, sliding_window),
                                           scale=scale)
        if max_q == 1:
            o = o.reshape(b, num_heads, head_dim)  # [B, kv, group, D] is already token-major
        else:
            o = o.view(b, num_kv_heads, group_size, max_q, head_dim).permute(0, 3, 1, 2, 4)
            o = o.reshape(b * max_q, num_heads, head_dim)[g.query_index]
        if single:
            return o
        out[g.token_start : g.token_end] = o
    return out


class TorchAttentionBackend(AttentionBackend):
    """Gather + ``scaled_dot_product_attention`` per group of requests (any device, any cache
    dtype); decodes grouped by context length (``split_by_context``)."""

    name = "torch"

    def decode_groups(self, context_blocks: list[int], block_size: int) -> list[list[int]]:
        return split_by_context(context_blocks, block_size)

    def build_metadata(self, layout: BatchLayout) -> GroupedMetadata:
        return grouped_metadata(self, layout)

    def write_kv(self, k, v, kv_cache, metadata) -> None:
        write_kv_cache(k, v, kv_cache, metadata.slot_mapping)

    supports_sliding_window = True

    def attend(self, q, kv_cache, metadata, scale, sliding_window=None) -> torch.Tensor:
        return grouped_attention(q, kv_cache, metadata, scale, sliding_window=sliding_window)


TORCH_BACKEND = TorchAttentionBackend()
