"""Paged attention in plain PyTorch, batched over requests.

K/V of every request live in per-layer cache tensors of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``; a request's block table lists its
physical blocks in logical order (Kwon et al. 2023, PagedAttention, section 4.1). Each step:

1. the new tokens' K/V are written to their slots (``slot_mapping``: flat index
   ``block_id * block_size + offset`` per token);
2. each request's queries attend to all its cached tokens up to their own position.

Step 2 gathers K/V through the block tables for a whole group of requests at once and runs
one ``scaled_dot_product_attention`` call for the group, with GQA handled by folding the
query heads that share a KV head into the query-length axis (no copy of K/V per query head).
Requests are split into groups so that padding stays small: decodes (one query token each)
in groups of similar context length (``split_by_context``), and prefills (several query
tokens each, padded to the longest chunk). There is no Python loop over requests inside a
layer, only over the step's few groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.layers.cpu_attention import paged_attention_quantized, paged_decode_attention


def padded_block_tables(block_tables: list[list[int]], dtype: torch.dtype) -> torch.Tensor:
    """Block tables as one [R, max(len, 1)] tensor of ``dtype``, short rows padded with block 0
    (never read past a request's context)."""
    width = max((len(t) for t in block_tables), default=1) or 1
    table = torch.zeros(len(block_tables), width, dtype=dtype)
    for i, t in enumerate(block_tables):
        table[i, : len(t)] = torch.tensor(t, dtype=dtype)
    return table


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
    """

    token_start: int
    token_end: int
    block_tables: torch.Tensor
    query_index: torch.Tensor
    max_query_len: int
    attn_mask: torch.Tensor
    context_lens: torch.Tensor | None = None
    _folded_masks: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_requests(self) -> int:
        return self.block_tables.shape[0]

    def folded_mask(self, group_size: int) -> torch.Tensor:
        """``attn_mask`` repeated for the ``group_size`` query heads that share a KV head,
        in the folded layout of ``paged_attention``: bool [B, 1, group_size * max_query_len,
        max_blocks * block_size]. Built once per step and shared by every layer."""
        mask = self._folded_masks.get(group_size)
        if mask is None:
            b, _, max_q, keys = self.attn_mask.shape
            mask = self.attn_mask
            if group_size > 1:
                mask = mask.unsqueeze(2).expand(b, 1, group_size, max_q, keys).reshape(b, 1, group_size * max_q, keys)
            self._folded_masks[group_size] = mask
        return mask

    @classmethod
    def build(
        cls,
        token_start: int,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device,
    ) -> "AttentionGroup":
        """Build the metadata of a group.

        Args:
            token_start: index of the group's first token in the step's flat token axis.
            query_lens: new tokens per request this step.
            context_lens: tokens in the cache per request after this step's writes
                (``num_computed_tokens + query_len``).
            block_tables: physical block ids per request, covering ``context_lens``.
            block_size: tokens per block.
            device: where the tensors go.
        """
        num_reqs = len(query_lens)
        max_q = max(query_lens)
        table = padded_block_tables(block_tables, torch.int64)
        max_blocks = table.shape[1]
        q_lens = torch.tensor(query_lens, dtype=torch.int64)
        ctx_lens = torch.tensor(context_lens, dtype=torch.int64)
        # Position of padded query row (b, i) is ctx_len[b] - q_len[b] + i.
        rows = torch.arange(max_q, dtype=torch.int64)
        q_pos = (ctx_lens - q_lens).unsqueeze(1) + rows.unsqueeze(0)  # [B, max_q]
        key_pos = torch.arange(max_blocks * block_size, dtype=torch.int64)
        mask = (key_pos.view(1, 1, -1) <= q_pos.unsqueeze(-1)) & (
            key_pos.view(1, 1, -1) < ctx_lens.view(-1, 1, 1)
        )
        valid = rows.unsqueeze(0) < q_lens.unsqueeze(1)  # [B, max_q]
        query_index = (torch.arange(num_reqs).unsqueeze(1) * max_q + rows.unsqueeze(0))[valid]
        return cls(
            token_start=token_start,
            token_end=token_start + int(q_lens.sum()),
            block_tables=table.to(device),
            query_index=query_index.to(device),
            max_query_len=max_q,
            attn_mask=mask.unsqueeze(1).to(device),
            context_lens=ctx_lens.to(torch.int32).to(device),
        )


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
    """
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
class AttentionMetadata:
    """Everything attention needs for one step, shared by all layers.

    Attributes:
        slot_mapping: int64 [T]; flat cache slot of each new token (negative: not stored,
            Triton backend only).
        groups: token groups (decodes, prefills) covering the step's tokens (PyTorch
            backend; empty for the Triton backend).
        backend: "torch" (this module: gather + ``scaled_dot_product_attention`` per group),
            "cpu" (as "torch", but decode groups run ``kvflow.layers.cpu_attention``'s C++
            kernel over the block tables: no gather, no padding; over an int8 / fp8 cache
            every token, prefill ones too, runs ``paged_attention_quantized``, with the flat
            fields below and no groups) or "triton" (``kvflow.layers.triton_attention``: one
            kernel over the block tables).
        block_tables: flat metadata (``flat``): [R, max_blocks], physical blocks per
            request (int32 for Triton, int64 for the quantized CPU kernel).
        query_start_loc: flat metadata: int32 [R + 1], request r's tokens are flat rows
            ``query_start_loc[r] : query_start_loc[r + 1]``.
        context_lens: flat metadata: int32 [R], tokens in the cache after this step's writes.
        max_query_len: flat metadata: longest query chunk of the step, in tokens.
    """

    slot_mapping: torch.Tensor
    groups: list[AttentionGroup]
    backend: str = "torch"
    block_tables: torch.Tensor | None = None
    query_start_loc: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    max_query_len: int = 0

    @classmethod
    def for_triton(
        cls,
        slot_mapping: torch.Tensor,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        device: torch.device,
    ) -> "AttentionMetadata":
        """Flat per-request metadata of the Triton backend, requests in flat token order.

        Args:
            slot_mapping: int64 [T] flat cache slot per token.
            query_lens: new tokens per request this step.
            context_lens: tokens in the cache per request after this step's writes.
            block_tables: physical block ids per request, covering ``context_lens``.
            device: where the tensors go.
        """
        return cls.flat(slot_mapping, query_lens, context_lens, block_tables, device, "triton")

    @classmethod
    def flat(
        cls,
        slot_mapping: torch.Tensor,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        device: torch.device,
        backend: str,
    ) -> "AttentionMetadata":
        """Flat per-request metadata (no groups), requests in flat token order, for the
        kernels that read the block tables themselves: ``backend`` "triton" (int32 block
        tables) or "cpu" over a quantized cache (``paged_attention_quantized``, int64).
        Arguments as ``for_triton``."""
        table = padded_block_tables(block_tables, torch.int32 if backend == "triton" else torch.int64)
        starts = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
        starts[1:] = torch.tensor(query_lens, dtype=torch.int32).cumsum(0)
        return cls(
            slot_mapping=slot_mapping,
            groups=[],
            backend=backend,
            block_tables=table.to(device),
            query_start_loc=starts.to(device),
            context_lens=torch.tensor(context_lens, dtype=torch.int32).to(device),
            max_query_len=max(query_lens, default=0),
        )


KVCache = tuple  # (k, v) or, for a quantized cache, (k, v, k_scale, v_scale)
"""One layer's paged cache: k, v [num_blocks, block_size, num_kv_heads, head_dim] in the
cache dtype; for int8 / fp8 caches also k_scale, v_scale float16
[num_blocks, block_size, num_kv_heads] (one scale per token and head)."""

_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-head symmetric quantization of x [T, heads, head_dim].

    Returns:
        values [T, heads, head_dim] in ``dtype`` (int8 or float8_e4m3fn) and scales float16
        [T, heads] with x ~= values * scale.
    """
    qmax = _QMAX[dtype]
    scale = (x.abs().amax(dim=-1).float() / qmax).clamp(min=1e-8)
    y = (x.float() / scale[..., None]).clamp(-qmax, qmax)
    values = torch.round(y).to(dtype) if dtype == torch.int8 else y.to(dtype)
    return values, scale.to(torch.float16)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: KVCache,
    metadata: AttentionMetadata,
    key_offset: torch.Tensor | None = None,
) -> None:
    """Write this step's K/V [T, num_kv_heads, head_dim] (model dtype) into the layer's cache
    at ``metadata.slot_mapping`` with the step's backend: ``write_kv_cache`` (index_copy_),
    or the Triton kernel, which also skips negative slots (padded CUDA-graph rows).

    ``key_offset`` [num_kv_heads, head_dim], if given, is subtracted from the keys going into
    a quantized (int8 / fp8) cache. Attention is unchanged by it: a query's scores all move
    by the same q . offset, and softmax ignores a common shift. What changes is the
    quantization: per-token scales follow the keys' largest entries, and when every key
    carries a large common vector (Qwen2's k_proj bias: in Qwen2.5-Coder-0.5B's first layer
    keys have entries up to ~140 around a token-dependent part of ~30) that vector, not the
    part that tells tokens apart, sets the step. The model passes its k_proj bias on the
    slowly rotating RoPE pairs (``LlamaAttention._key_offset``).
    """
    if key_offset is not None and len(kv_cache) == 4:
        k = k - key_offset
    if metadata.backend == "triton":
        from kvflow.layers.triton_attention import triton_write_kv_cache

        triton_write_kv_cache(k, v, kv_cache, metadata.slot_mapping)
    else:
        write_kv_cache(k, v, kv_cache, metadata.slot_mapping)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor) -> None:
    """Store new K/V [T, num_kv_heads, head_dim] at the flat slots ``slot_mapping`` [T]
    (quantizing them for an int8 / fp8 cache)."""
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if len(kv_cache) == 4:
        (k, k_scale), (v, v_scale) = quantize_kv(k, k_cache.dtype), quantize_kv(v, v_cache.dtype)
        kv_cache[2].view(-1, num_kv_heads).index_copy_(0, slot_mapping, k_scale)
        kv_cache[3].view(-1, num_kv_heads).index_copy_(0, slot_mapping, v_scale)
    for cache, new in ((k_cache, k), (v_cache, v)):
        if new.dtype != cache.dtype:
            new = new.to(cache.dtype)
        if cache.dtype == torch.float8_e4m3fn:  # no CPU index_copy for float8: copy the bytes
            cache, new = cache.view(torch.uint8), new.view(torch.uint8)
        cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, new)


def _gather(kv_cache: KVCache, index: int, block_tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K (index 0) or V (1) of a group: [B, num_kv_heads, max_blocks * block_size, head_dim].

    ``index_select`` over the flattened block tables (about twice as fast as advanced
    indexing on the CPU), then a transposed view (no copy) for the attention kernel.
    """
    b, max_blocks = block_tables.shape
    flat = block_tables.reshape(-1)
    cache = kv_cache[index]
    if cache.dtype == torch.float8_e4m3fn:  # no CPU index ops for float8: gather the bytes
        values = cache.view(torch.uint8).index_select(0, flat).view(torch.float8_e4m3fn)
    else:
        values = cache.index_select(0, flat)
    values = values.view(b, max_blocks * cache.shape[1], *cache.shape[2:])
    if len(kv_cache) == 4:
        scales = kv_cache[2 + index].index_select(0, flat).view(b, max_blocks * cache.shape[1], -1)
        values = values.to(dtype) * scales.to(dtype)[..., None]
    elif values.dtype != dtype:
        values = values.to(dtype)
    return values.transpose(1, 2)


def paged_attention(
    q: torch.Tensor,
    kv_cache: KVCache,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of the step's queries over their requests' cached K/V.

    Args:
        q: [T, num_heads, head_dim], the step's queries (RoPE applied).
        kv_cache: the layer's cache, already holding this step's K/V (``write_kv_cache``);
            a quantized cache is dequantized after the gather.
        metadata: the step's groups and slot mapping.
        scale: softmax scale, usually head_dim ** -0.5.

    Returns:
        [T, num_heads, head_dim] attention output, dtype of q.
    """
    if metadata.backend == "triton":
        from kvflow.layers.triton_attention import triton_paged_attention

        return triton_paged_attention(q, kv_cache, metadata, scale)
    if metadata.backend == "cpu" and len(kv_cache) == 4:
        return paged_attention_quantized(
            q, kv_cache, metadata.block_tables, metadata.query_start_loc, metadata.context_lens, scale
        )
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache[0].shape[2]
    group_size = num_heads // num_kv_heads
    single = len(metadata.groups) == 1
    out = None if single else torch.empty_like(q)
    kernel = metadata.backend == "cpu" and len(kv_cache) == 2 and kv_cache[0].dtype == q.dtype
    for g in metadata.groups:
        b, max_q = g.num_requests, g.max_query_len
        q_g = q if single else q[g.token_start : g.token_end]
        if kernel and max_q == 1:
            o = paged_decode_attention(q_g, kv_cache[0], kv_cache[1], g.block_tables, g.context_lens, scale)
            if single:
                return o
            out[g.token_start : g.token_end] = o
            continue
        # Gather K/V through the block tables: [B, kv_heads, max_blocks * block_size, head_dim].
        k = _gather(kv_cache, 0, g.block_tables, q.dtype)
        v = _gather(kv_cache, 1, g.block_tables, q.dtype)
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
        o = F.scaled_dot_product_attention(q_fold, k, v, attn_mask=g.folded_mask(group_size), scale=scale)
        if max_q == 1:
            o = o.reshape(b, num_heads, head_dim)  # [B, kv, group, D] is already token-major
        else:
            o = o.view(b, num_kv_heads, group_size, max_q, head_dim).permute(0, 3, 1, 2, 4)
            o = o.reshape(b * max_q, num_heads, head_dim)[g.query_index]
        if single:
            return o
        out[g.token_start : g.token_end] = o
    return out


class Attention(nn.Module):
    """One layer's paged attention: write the step's K/V into the layer's cache, then attend
    every query over its request's cached K/V (causal).

    Args:
        num_heads, num_kv_heads: this rank's query and KV heads.
        head_dim: elements per head.
        scale: softmax scale (usually head_dim ** -0.5).

    Shapes: q [T, num_heads, head_dim]; k, v [T, num_kv_heads, head_dim] or None (a layer
    that reads another layer's K/V, cross-layer attention) -> [T, num_heads, head_dim].
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        key_offset: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if k is not None:
            store_kv(k, v, kv_cache, metadata, key_offset)
        return paged_attention(q, kv_cache, metadata, self.scale)
