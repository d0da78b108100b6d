"""Paged decode attention for the CPU as a small C++ kernel (built once, on first use).

The PyTorch path (``kvflow.layers.attention``) gathers each group's K/V through the block
tables into a padded copy and runs ``scaled_dot_product_attention`` on it: the K/V bytes
cross memory three times (gather read, gather write, attention read), and at batch 32 that
traffic is about half of a bfloat16 decode step on the development machine. This kernel
reads K and V once, straight from the paged cache ``[num_blocks, block_size, num_kv_heads,
head_dim]`` through the block table (PagedAttention, Kwon et al. 2023, section 4.1): for
each (request, KV head) it scores the request's keys against the ``group`` query heads that
share the KV head (GQA), takes a float32 softmax, and accumulates the values.

With AVX-512 (and head dims 64 / 128 with the group sizes compiled in below) the three
steps are vectorized by hand: keys are scored 16 tokens at a time, the 16 dot products
reduced together by a transpose-and-add tree instead of one horizontal sum each (bfloat16
keys and queries multiply exactly in ``vdpbf16ps`` where the CPU has AVX512-BF16); the
softmax uses a 16-lane exp; values are accumulated in registers with the next block
prefetched (the bfloat16 scores are scale * (q . k) from exact bfloat16 products; the
portable loops used elsewhere compute (q * scale) . k in float32). On the development
machine (2 cores) this took a batch-32, 400-token, 30-layer bfloat16 decode step's
attention from 39 ms to 20 ms.

Decode (one query token per request): float32, bfloat16 and float16 caches. Prefill chunks
(``paged_prefill_attention``, float32 and bfloat16 caches) run a tiled flash-attention pass
of the same extension over the paged cache: causal with the chunk's offset, GQA / MQA,
sliding windows (FlashAttention-2, Dao 2023, arXiv 2307.08691, section 3.1; the tiling is
described in the C++ source); ``KVFLOW_CPU_PREFILL_ATTENTION=0`` keeps gather + SDPA for them.
Quantized (int8 / fp8) caches have their own pass (``paged_attention_quantized``).

The C++ source is ``kvflow/ops/csrc/paged_attention.cpp``, compiled on first use by
``kvflow.ops.build`` (a C++ compiler and ninja are needed; about half a minute the first
time, then cached in the torch extensions folder). If the build fails,
``cpu_kernel_available()`` is False and callers use the PyTorch path; set
``KVFLOW_CPU_ATTENTION=0`` to never build it.
"""

from __future__ import annotations

import torch

from kvflow import envs, ops

_EXTENSION = ops.PAGED_ATTENTION


def _load():
    return _EXTENSION.load()


def cpu_kernel_available() -> bool:
    """True when the kernel is built (building it now if needed) and usable; False at once
    while a background build is under way (``cpu_kernel_pending``)."""
    return _load() is not None


def wait_for_cpu_kernel() -> None:
    """Wait for a background build of the kernel, if one is under way, and publish it (call
    it only where no forward runs: an engine's start)."""
    _EXTENSION.publish(wait=True)


def cpu_kernel_pending() -> bool:
    """True while the kernel is being built in the background (or built, not yet published)."""
    return _EXTENSION.pending()


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of one query token per request over its paged K/V.

    Args:
        q: [R, num_heads, head_dim] (float32, bfloat16 or float16; last dim contiguous).
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], q's dtype,
            contiguous, holding each request's keys at positions 0 .. context_lens[r] - 1.
        block_tables: int64 [R, max_blocks], physical blocks per request in logical order.
        context_lens: int32 [R], tokens to attend to per request (>= 1).
        scale: softmax scale.

    Returns:
        [R, num_heads, head_dim] in q's dtype (float32 accumulation).

    Raises:
        RuntimeError: if the kernel is not available, or the inputs break the layout above
            (including a context longer than its block table or a block id outside the cache).
    """
    return _EXTENSION.require().paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)


PREFILL_HEAD_DIM_MULTIPLE = 16
"""head_dim must be a multiple of this for ``paged_prefill_attention`` (every vector width
it is built for divides it)."""


def prefill_kernel_enabled() -> bool:
    """Whether prefill chunks may take ``paged_prefill_attention``: ``KVFLOW_CPU_PREFILL_ATTENTION``
    and ``KVFLOW_CPU_KERNELS`` are not ``0`` (read at each call) and the extension is built
    and published (``cpu_kernel_available``)."""
    return envs.cpu_kernel_enabled("KVFLOW_CPU_PREFILL_ATTENTION") and cpu_kernel_available()


def takes_prefill_input(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether ``paged_prefill_attention`` takes these: q float32 / bfloat16 on the CPU with
    contiguous rows, a cache of q's dtype, head_dim a multiple of ``PREFILL_HEAD_DIM_MULTIPLE``."""
    return (
        q.device.type == "cpu" and q.dim() == 3 and q.stride(-1) == 1 and q.dtype in (torch.float32, torch.bfloat16)
        and k_cache.dtype == q.dtype and k_cache.dim() == 4 and k_cache.is_contiguous()
        and q.shape[-1] % PREFILL_HEAD_DIM_MULTIPLE == 0 and not (torch.is_grad_enabled() and q.requires_grad)
    )


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of every query token of one or more requests (prefill chunks, and any
    number of query tokens per request) straight over the paged K/V cache, in tiles with an
    online softmax (FlashAttention-2, Dao 2023, arXiv 2307.08691, section 3.1): no gathered
    copy of K/V and no [queries, keys] score matrix is ever materialized.

    Request r's query tokens are rows ``query_start_loc[r] : query_start_loc[r + 1]`` of q,
    the last ``q_len`` of its ``context_lens[r]`` cached tokens: query i sits at position
    ``context_lens[r] - q_len + i`` and attends to keys ``j <= position`` (and, with
    ``sliding_window`` W, ``j > position - W``, transformers' sliding-window rule). Query head
    h reads KV head ``h // (num_heads // num_kv_heads)`` (GQA / MQA).

    Args:
        q: [T, num_heads, head_dim] float32 or bfloat16 (RoPE applied; rows contiguous);
            head_dim a multiple of ``PREFILL_HEAD_DIM_MULTIPLE``.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], q's dtype,
            contiguous, already holding this step's K/V.
        block_tables: int64 [R, max_blocks], physical blocks per request in logical order.
        query_start_loc: int32 [R + 1], starting at 0, ending at most at T.
        context_lens: int32 [R], tokens in each request's cache after this step's writes
            (>= its query tokens).
        scale: softmax scale (usually head_dim ** -0.5).
        sliding_window: W in tokens, or None (0 too) for full causal attention.
        out: [T, num_heads, head_dim] of q's dtype with contiguous rows to write into (e.g. a
            slice of a step's output), or None for a new tensor.

    Returns:
        ``out`` (rows not covered by ``query_start_loc`` are left as they were), float32
        accumulation, rounded to q's dtype once. bfloat16 on a CPU with AVX512-BF16: the
        value product takes the softmax weights rounded to bfloat16 (as FlashAttention-2's
        P, algorithm 1), which moves an output by at most 2^-8 times the attention of |V|.

    Raises:
        RuntimeError: if the kernel is not available, or the inputs break the layout above
            (including a context longer than its block table or a block id outside the cache).
    """
    if out is None:
        out = torch.empty_like(q)
    window = int(sliding_window) if sliding_window else 0
    if window < 0:
        raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")
    return _EXTENSION.require().paged_prefill_attention(
        q, k_cache, v_cache, block_tables, query_start_loc, context_lens, float(scale), window, out)


def _code_table(dtype: torch.dtype) -> torch.Tensor:
    """float32 [256]: the value of each byte as a code of ``dtype`` (int8 or float8_e4m3fn)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()


_CODE_TABLES: dict[torch.dtype, torch.Tensor] = {}

_CODE_FORMATS = {torch.int8: 1, torch.float8_e4m3fn: 2}
"""The kernel's ``code_format`` per cache dtype: codes it converts in vectors (to the table's
values exactly); any other dtype reads the table (0)."""


def code_table(dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """How the C++ kernels read a quantized cache of ``dtype``: the code table (float32 [256],
    each byte's value as a code of ``dtype``; made once per dtype) and the kernel's
    ``code_format`` (1 int8, 2 float8_e4m3fn: converted in vectors; 0: read through the table)."""
    lut = _CODE_TABLES.get(dtype)
    if lut is None:
        lut = _CODE_TABLES[dtype] = _code_table(dtype)
    return lut, _CODE_FORMATS.get(dtype, 0)


def paged_attention_quantized(
    q: torch.Tensor,
    kv_cache: tuple,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of every query token of a step (decodes and prefill chunks alike) over an
    int8 / fp8 paged cache, each token computed as a one-token decode over its own context
    (keys ``0 .. position``): batch-invariant, the result of a token depends only on its
    query and the stored K/V of its context, not on how the step was batched or chunked.

    Args:
        q: [T, num_heads, head_dim] queries (RoPE applied), float32 / bfloat16 / float16.
        kv_cache: (k, v, k_scale, v_scale): codes [num_blocks, block_size, num_kv_heads,
            head_dim] int8 or float8_e4m3fn, scales float16 [num_blocks, block_size,
            num_kv_heads]; K/V = code * scale.
        block_tables: int64 [R, max_blocks], physical blocks per request.
        query_start_loc: int32 [R + 1]; request r's query tokens are rows
            ``query_start_loc[r] : query_start_loc[r + 1]`` of q, at its last positions.
        context_lens: int32 [R], tokens in each request's cache after this step's writes.
        scale: softmax scale.

    Returns:
        [T, num_heads, head_dim] in q's dtype (float32 throughout, rounded once).

    Raises:
        RuntimeError: if the kernel is not available or the inputs break the layout above.
    """
    k, v, k_scale, v_scale = kv_cache
    lut, code_format = code_table(k.dtype)
    out = _EXTENSION.require().paged_attention_quantized(
        q.float().contiguous(), k.view(torch.uint8), v.view(torch.uint8), k_scale, v_scale, lut,
        block_tables, query_start_loc, context_lens, scale, code_format,
    )
    return out.to(q.dtype)
