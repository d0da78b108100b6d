"""The paged KV cache's storage: one layer's K/V tensors, quantized K/V, writes and reads.

K/V of every request live in per-layer cache tensors of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``; a request's block table lists its
physical blocks in logical order (Kwon et al. 2023, PagedAttention, section 4.1). A token's
flat slot is ``block_id * block_size + offset`` (``slot_mapping``).
"""

from __future__ import annotations

import torch

from kvflow import huge_pages as _huge_pages

KVCache = tuple  # (k, v) or, for a quantized cache, (k, v, k_scale, v_scale)
"""One layer's paged cache: k, v [num_blocks, block_size, num_kv_heads, head_dim] in the
cache dtype; for int8 / fp8 caches also k_scale, v_scale float16
[num_blocks, block_size, num_kv_heads] (one scale per token and head)."""

_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def allocate_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                      device: torch.device, pin_memory: bool = False, huge_pages: bool = False) -> KVCache:
    """One layer's paged cache, zeroed: k, v [num_blocks, block_size, num_kv_heads, head_dim]
    in ``dtype``, plus float16 k_scale, v_scale [num_blocks, block_size, num_kv_heads] for an
    int8 / fp8 ``dtype`` (the ``KVCache`` layout). ``pin_memory`` pins host tensors (a
    swap space's). What ``kvflow.attention.cache_engine.CacheEngine`` allocates per layer, and
    ``CausalLM.forward_prompt`` for its throwaway cache.

    ``huge_pages`` (host tensors, not pinned): place them on transparent huge pages
    (``kvflow.huge_pages.empty``; for a cache that lives as long as the engine: its arena
    never reuses memory). A decode step reads each running request's blocks, scattered over
    the pool, so with 4 KiB pages nearly every block costs TLB misses; 2 MiB pages cover 512
    of them. The tensors are still zeroed here, so the whole pool is resident from the start,
    as with ``torch.zeros``: left to fill lazily, its first touches (the kernel finding and
    zeroing huge pages) cost the first requests, not the start (a served SmolLM2 single
    stream measured ~60 ms more TTFT on average, ~230 ms on the first request; 2026-12-07)."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)

    def zeros(size: tuple[int, ...], dt: torch.dtype) -> torch.Tensor:
        if huge_pages and device.type == "cpu" and not pin_memory:
            return _huge_pages.empty(size, dt).zero_()
        return torch.zeros(size, dtype=dt, device=device, pin_memory=pin_memory)

    tensors = [zeros(shape, dtype) for _ in range(2)]
    if dtype in _QMAX:
        tensors += [zeros(shape[:-1], torch.float16) for _ in range(2)]
    return tuple(tensors)


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


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor) -> None:
    """Store new K/V [T, num_kv_heads, head_dim] at the flat slots ``slot_mapping`` [T]
    (quantizing them for an int8 / fp8 cache)."""
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if is_quantized(kv_cache):
        (k, k_scale), (v, v_scale) = quantize_kv(k, k_cache.dtype), quantize_kv(v, v_cache.dtype)
        kv_cache[2].view(-1, num_kv_heads).index_copy_(0, slot_mapping, k_scale)
        kv_cache[3].view(-1, num_kv_heads).index_copy_(0, slot_mapping, v_scale)
    for cache, new in ((k_cache, k), (v_cache, v)):
        if new.dtype != cache.dtype:
            new = new.to(cache.dtype)
        if cache.dtype == torch.float8_e4m3fn:  # no CPU index_copy for float8: copy the bytes
            cache, new = cache.view(torch.uint8), new.view(torch.uint8)
        cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, new)


def is_quantized(kv_cache: KVCache) -> bool:
    """True for an int8 / fp8 cache (values plus per-token scales)."""
    return len(kv_cache) == 4


def subtract_key_offset(k: torch.Tensor, kv_cache: KVCache, key_offset: torch.Tensor | None) -> torch.Tensor:
    """Keys [T, num_kv_heads, head_dim] as stored: minus ``key_offset`` [num_kv_heads,
    head_dim] for a quantized cache (attention is unchanged by it: a query's scores all move
    by the same q . offset, and softmax ignores a common shift; what changes is the
    quantization: per-token scales follow the keys' largest entries, and when every key
    carries a large common vector — Qwen2's k_proj bias: in Qwen2.5-Coder-0.5B's first layer
    keys have entries up to ~140 around a token-dependent part of ~30 — that vector, not the
    part that tells tokens apart, sets the step; the model passes its k_proj bias on the
    slowly rotating RoPE pairs, ``LlamaAttention._key_offset``). Unchanged otherwise."""
    if key_offset is not None and is_quantized(kv_cache):
        return k - key_offset
    return k


def gather_kv(kv_cache: KVCache, index: int, block_tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
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
