"""Paged attention and KV-cache writes as Triton kernels (the GPU attention backend).

One kernel serves decode, prefill and chunked prefill with a cached prefix: every program
takes ``BLOCK_Q`` query tokens of one request and the ``group`` query heads that share one
KV head (GQA folded into the rows, as in ``kvflow.attention.torch_backend``), walks the request's
block table over its cached keys and keeps a running softmax (FlashAttention-2, Dao 2023,
algorithm 1: running max ``m``, running sum ``l``, rescaled accumulator), so no K/V is
gathered into a padded copy and there is no mask tensor: causality and context length come
from the positions. The paged layout is the one of PagedAttention (Kwon et al. 2023,
section 4.1): cache ``[num_blocks, block_size, num_kv_heads, head_dim]``, a block table per
request listing its physical blocks in logical order.

Metadata (``AttentionMetadata`` with ``backend == "triton"``), all on the model's device:

* ``block_tables`` int32 [R, max_blocks] (rows padded with any valid block id),
* ``query_start_loc`` int32 [R + 1]: request r's query tokens are rows
  ``query_start_loc[r] : query_start_loc[r + 1]`` of the flat token axis,
* ``context_lens`` int32 [R]: tokens in the cache after this step's writes; request r's
  query tokens are its last ``q_len`` positions ``context_lens[r] - q_len ...``.

A request with no query tokens (``q_len == 0``) is skipped, and a negative slot in
``slot_mapping`` writes nothing: that is how padded rows of a CUDA-graph batch are inert.

Runs on CUDA; on a machine without one, the kernels run in Triton's interpreter when
``TRITON_INTERPRET=1`` is set before this module is first imported (how the tests check them
on the CPU in float32 / float16; slow, for correctness only; bfloat16 is refused there).
"""

from __future__ import annotations

import importlib.util

import torch

from kvflow.attention.kv_cache import quantize_kv

_TRITON = importlib.util.find_spec("triton") is not None

if _TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _paged_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, o_ptr,
        block_tables_ptr, query_start_ptr, context_lens_ptr,
        scale,
        stride_q_t, stride_q_h, stride_o_t, stride_o_h,
        stride_c_b, stride_c_s, stride_c_h,
        stride_s_b, stride_s_s,
        stride_bt,
        GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_Q: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        KV_QUANT: tl.constexpr, IEEE: tl.constexpr,
    ):
        q_block = tl.program_id(0)  # axis 0: up to 2**31 - 1 programs (axes 1, 2: 65535)
        kv_head = tl.program_id(1)
        req = tl.program_id(2)
        q_start = tl.load(query_start_ptr + req)
        q_len = tl.load(query_start_ptr + req + 1) - q_start
        if q_block * BLOCK_Q < q_len:
            ctx = tl.load(context_lens_ptr + req)
            rows = tl.arange(0, BLOCK_Q * BLOCK_G)
            tok = q_block * BLOCK_Q + rows // BLOCK_G  # query token within the request
            g = rows % BLOCK_G
            head = kv_head * GROUP + g
            row_ok = (tok < q_len) & (g < GROUP)
            d = tl.arange(0, BLOCK_D)
            d_ok = d < HEAD_DIM
            q_off = (q_start + tok).to(tl.int64)[:, None] * stride_q_t + head[:, None] * stride_q_h + d[None, :]
            q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            if KV_QUANT:
                q = q.to(tl.float32)
            q_pos = ctx - q_len + tok
            m_i = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_Q * BLOCK_G], tl.float32)
            acc = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_D], tl.float32)
            # Keys up to the last query position of this program (causal), in tiles of BLOCK_N.
            kv_end = tl.minimum(ctx - q_len + (q_block + 1) * BLOCK_Q, ctx)
            n = tl.arange(0, BLOCK_N)
            for start in range(0, kv_end, BLOCK_N):
                k_pos = start + n
                k_ok = k_pos < kv_end
                block = tl.load(block_tables_ptr + req * stride_bt + k_pos // BLOCK_SIZE, mask=k_ok, other=0)
                slot = block.to(tl.int64) * stride_c_b + (k_pos % BLOCK_SIZE) * stride_c_s
                kv_off = slot[:, None] + kv_head * stride_c_h + d[None, :]
                kv_mask = k_ok[:, None] & d_ok[None, :]
                k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
                v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
                if KV_QUANT:
                    s_off = block.to(tl.int64) * stride_s_b + (k_pos % BLOCK_SIZE) * stride_s_s + kv_head
                    k = k.to(tl.float32) * tl.load(k_scale_ptr + s_off, mask=k_ok, other=0.0).to(tl.float32)[:, None]
                    v = v.to(tl.float32) * tl.load(v_scale_ptr + s_off, mask=k_ok, other=0.0).to(tl.float32)[:, None]
                else:  # a float cache of another dtype than the model's (kv_cache_dtype)
                    k = k.to(q.dtype)
                    v = v.to(q.dtype)
                if IEEE:
                    s = tl.dot(q, tl.trans(k), input_precision="ieee")
                else:
                    s = tl.dot(q, tl.trans(k))
                s = s * scale
                allowed = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
                s = tl.where(allowed, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
                alpha = tl.exp(m_i - m_safe)
                p = tl.exp(s - m_safe[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                if IEEE:
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
                else:
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m_i = m_new
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            o_off = (q_start + tok).to(tl.int64)[:, None] * stride_o_t + head[:, None] * stride_o_h + d[None, :]
            tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])

    @triton.jit
    def _write_rows_kernel(src_ptr, dst_ptr, slot_ptr, stride_src, ROW: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t)
        if slot >= 0:
            offs = tl.arange(0, BLOCK)
            ok = offs < ROW
            values = tl.load(src_ptr + t.to(tl.int64) * stride_src + offs, mask=ok)
            tl.store(dst_ptr + slot.to(tl.int64) * ROW + offs, values, mask=ok)


def triton_available() -> bool:
    """True when ``triton`` is importable."""
    return _TRITON


def interpreter_enabled() -> bool:
    """True when this module's kernels run in Triton's CPU interpreter: ``TRITON_INTERPRET=1``
    was set when the module was first imported (Triton decides per kernel at that moment)."""
    return _TRITON and type(_paged_attention_kernel).__name__ == "InterpretedFunction"


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _write_rows(src: torch.Tensor, dst: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """dst.view(-1, row)[slot_mapping[t]] = src[t] for every t with slot_mapping[t] >= 0.

    src [T, ...] and dst [num_blocks, block_size, ...] with the same trailing shape; float8
    travels as bytes (no float8 loads needed).
    """
    if dst.dtype == torch.float8_e4m3fn:
        src, dst = src.view(torch.uint8), dst.view(torch.uint8)
    num_tokens = src.shape[0]
    if num_tokens == 0:
        return
    row = dst[0, 0].numel()
    src = src.reshape(num_tokens, row)
    if src.stride(-1) != 1:
        src = src.contiguous()
    _write_rows_kernel[(num_tokens,)](src, dst, slot_mapping, src.stride(0), ROW=row, BLOCK=_next_pow2(row))


def triton_write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: tuple, slot_mapping: torch.Tensor) -> None:
    """Store new K/V [T, num_kv_heads, head_dim] at the flat slots ``slot_mapping`` int64 [T]
    (``block_id * block_size + offset``; negative: skip the token), quantizing them first for
    an int8 / fp8 cache (per-token, per-head scales, ``kvflow.attention.kv_cache.quantize_kv``)."""
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    if len(kv_cache) == 4:
        (k, k_scale), (v, v_scale) = quantize_kv(k, k_cache.dtype), quantize_kv(v, v_cache.dtype)
        _write_rows(k_scale, kv_cache[2], slot_mapping)
        _write_rows(v_scale, kv_cache[3], slot_mapping)
    _write_rows(k.to(k_cache.dtype), k_cache, slot_mapping)
    _write_rows(v.to(v_cache.dtype), v_cache, slot_mapping)


def triton_paged_attention(q: torch.Tensor, kv_cache: tuple, metadata, scale: float) -> torch.Tensor:
    """Causal attention of the step's queries over their requests' paged K/V.

    Args:
        q: [T, num_heads, head_dim] queries (RoPE applied), float32 / float16 / bfloat16.
        kv_cache: the layer's (k, v) cache [num_blocks, block_size, num_kv_heads, head_dim],
            or (k, v, k_scale, v_scale) for an int8 / fp8 cache with float16 scales
            [num_blocks, block_size, num_kv_heads]; already holding this step's K/V.
        metadata: ``kvflow.attention.backend.FlatMetadata`` (``block_tables`` int32,
            ``query_start_loc``, ``context_lens``, ``max_query_len``; see the module docstring).
        scale: softmax scale, usually head_dim ** -0.5.

    Returns:
        [T, num_heads, head_dim] in q's dtype. Rows of tokens outside every request's query
        range are left uninitialized.
    """
    num_tokens, num_heads, head_dim = q.shape
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    if q.device.type != "cuda" and q.dtype == torch.bfloat16:
        raise ValueError("the Triton attention backend runs bfloat16 on CUDA only (Triton's CPU interpreter "
                         "computes bfloat16 dot products wrongly); use dtype float32/float16 or the torch backend")
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    block_g = _next_pow2(group)
    # tl.dot needs at least 16 rows: decode programs take 16 / block_g tokens (masked).
    # tl.dot needs 16 rows or more: a program holds block_q tokens x block_g heads, 16 rows
    # for decode-only steps (tokens past a request's one query are masked), 64 otherwise.
    block_q = max(1, (16 if metadata.max_query_len == 1 else 64) // block_g)
    block_n = max(16, min(64, _next_pow2(block_size)))
    quant = len(kv_cache) == 4
    k_scale, v_scale = (kv_cache[2], kv_cache[3]) if quant else (k_cache, v_cache)  # unused unless quant
    out = torch.empty_like(q)
    num_reqs = metadata.context_lens.shape[0]
    if num_reqs == 0 or num_tokens == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    grid = (triton.cdiv(max(1, metadata.max_query_len), block_q), num_kv_heads, num_reqs)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, k_scale, v_scale, out,
        metadata.block_tables, metadata.query_start_loc, metadata.context_lens,
        scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_scale.stride(0), k_scale.stride(1),
        metadata.block_tables.stride(0),
        GROUP=group, BLOCK_G=block_g, BLOCK_Q=block_q,
        BLOCK_SIZE=block_size, BLOCK_N=block_n,
        HEAD_DIM=head_dim, BLOCK_D=max(16, _next_pow2(head_dim)),
        KV_QUANT=quant, IEEE=q.dtype == torch.float32,
    )
    return out
