"""The C++ paged decode-attention kernel against the PyTorch path (gather + SDPA)."""

from __future__ import annotations

import pytest
import torch

from conftest import random_paged_step
from conftest import attend, flat_metadata
from kvflow.attention.cpu_backend import CpuAttentionBackend, CpuQuantizedAttentionBackend
from kvflow.attention.torch_backend import AttentionGroup, GroupedMetadata
from kvflow.attention.cpu_attention import cpu_kernel_available, paged_decode_attention

pytestmark = pytest.mark.skipif(not cpu_kernel_available(), reason="the C++ kernel could not be built here")


def _decode_step(num_heads, num_kv_heads, head_dim, block_size, ctx_lens, dtype, seed=0):
    q, k, v, tables = random_paged_step(num_heads, num_kv_heads, head_dim, block_size, [1] * len(ctx_lens), ctx_lens,
                                        dtype, seed)
    group = AttentionGroup.build(0, [1] * len(ctx_lens), ctx_lens, tables, block_size, torch.device("cpu"))
    return q, k, v, group


def _reference(q, k, v, group, scale):
    meta = GroupedMetadata(torch.zeros(q.shape[0], dtype=torch.int64), [group])
    return attend(q.float(), (k.float(), v.float()), meta, scale)


@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, block_size",
    [
        (9, 3, 64, 16),  # SmolLM2 (compiled-in head dim 64, group 3)
        (8, 8, 64, 4),  # MHA
        (16, 4, 128, 16),  # group 4, head dim 128
        (14, 2, 64, 32),  # Qwen2.5-0.5B's group 7
        (14, 2, 128, 16),  # group 7, head dim 128 (Qwen2.5-7B)
        (32, 4, 64, 16),  # group 8
        (12, 2, 128, 1),  # Qwen2.5-1.5B's group 6, one-token blocks
        (6, 3, 32, 8),  # head dim 32, group 3 read at run time
        (6, 3, 48, 8),  # a head dim not compiled in: the portable loops
        (3, 1, 40, 4),  # nor a multiple of 16
        (4, 1, 80, 16),  # MQA, head dim not a power of two
        (4, 2, 16, 16),  # head dim 16 (the host-overhead benchmark's tiny model), group 2
        (8, 1, 16, 16),  # head dim 16, group 8 (two chunks of 4 in the value pass)
        (6, 2, 32, 16),  # head dim 32, group 3 (chunks of 2 and 1)
        (7, 1, 96, 16),  # Phi-3's head dim, group 7 (4 + 2 + 1)
        (32, 32, 96, 16),  # Phi-3 MHA
        (4, 1, 256, 16),  # Gemma 3 270M / 1B: head dim 256, MQA group 4
        (8, 4, 256, 8),  # Gemma 3 4B: group 2
        (10, 2, 64, 16),  # compiled-in head dim, a group read at run time (5: 4 + 1)
    ],
)
@pytest.mark.parametrize("num_reqs", [1, 7])  # per-(request, head) items, then whole requests
def test_matches_torch_path_float32(num_heads, num_kv_heads, head_dim, block_size, num_reqs):
    ctx = [1, 37, 300, 16, 17, 250, 2][:num_reqs] if num_reqs > 1 else [129]
    q, k, v, group = _decode_step(num_heads, num_kv_heads, head_dim, block_size, ctx, torch.float32)
    out = paged_decode_attention(q, k, v, group.block_tables, group.context_lens, head_dim**-0.5)
    torch.testing.assert_close(out, _reference(q, k, v, group, head_dim**-0.5), atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, block_size",
    [(9, 3, 64, 16), (14, 2, 64, 32), (14, 2, 128, 32), (12, 2, 128, 1), (32, 4, 64, 16), (8, 8, 64, 4), (6, 3, 32, 8),
     (4, 2, 16, 16), (8, 1, 16, 16), (7, 1, 96, 16), (4, 1, 256, 16), (8, 4, 256, 8), (4, 1, 80, 16), (6, 3, 48, 8)],
)
def test_matches_torch_path_half_precision(dtype, tol, num_heads, num_kv_heads, head_dim, block_size):
    """bfloat16 takes the vectorized passes (AVX512-BF16 dot products where the CPU has them and
    the head dim is a multiple of 32) for the compiled-in head dims; float16 and a head dim
    that is not compiled in take the portable loops."""
    q, k, v, group = _decode_step(num_heads, num_kv_heads, head_dim, block_size, [5, 700, 64, 65, 16, 33], dtype)
    scale = head_dim**-0.5
    out = paged_decode_attention(q, k, v, group.block_tables, group.context_lens, scale)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), _reference(q, k, v, group, scale), atol=tol, rtol=tol)


@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, block_size",
    [(9, 3, 64, 16), (14, 2, 64, 32), (14, 2, 128, 16), (12, 2, 128, 1), (32, 4, 64, 16), (8, 8, 64, 4),
     (6, 3, 32, 8), (4, 1, 256, 16), (8, 4, 256, 8), (10, 2, 64, 16), (7, 1, 96, 16)],
)
def test_bfloat16_within_one_rounding(num_heads, num_kv_heads, head_dim, block_size):
    """Sums and softmax in float32, one rounding to bfloat16 at the end (unit roundoff u = 2^-8
    of |ref|); where the CPU has AVX512-BF16 the value pass also takes each softmax weight
    rounded to bfloat16 (two tokens per vdpbf16ps), p_t (1 + d_t) with |d_t| <= u, which moves
    the output by at most u sum_t p_t |v_t| / l: the attention of |v| (the prefill kernel's
    bound). Odd contexts end in a token with no partner (its pair's weight is 0)."""
    ctx = [1, 5, 700, 64, 65, 16, 33, 2]
    q, k, v, group = _decode_step(num_heads, num_kv_heads, head_dim, block_size, ctx, torch.bfloat16, seed=3)
    scale = head_dim**-0.5
    out = paged_decode_attention(q, k, v, group.block_tables, group.context_lens, scale)
    assert out.dtype == torch.bfloat16
    ref = _reference(q, k, v, group, scale).double()
    ref_abs = _reference(q, k, v.abs(), group, scale).double()
    bound = 2**-8 * (ref.abs() + ref_abs) + 1e-5
    excess = (out.double() - ref).abs() - bound
    assert excess.max() <= 0, f"{(excess > 0).sum()} outputs beyond the bound, worst by {excess.max():.2e}"


def test_long_context_softmax_is_stable():
    """Large logits (scale 1) over 3000 keys: the running max keeps exp in range."""
    q, k, v, group = _decode_step(4, 2, 64, 16, [3000], torch.float32)
    out = paged_decode_attention(q * 8, k, v, group.block_tables, group.context_lens, 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, _reference(q * 8, k, v, group, 1.0), atol=1e-5, rtol=1e-4)


def test_backend_dispatch_mixes_kernel_decodes_with_sdpa_prefills():
    """The cpu backend: decode groups through the kernel, a prefill group through SDPA, in one
    step; equal to the torch backend."""
    g = torch.Generator().manual_seed(3)
    k = torch.randn(40, 4, 2, 16, generator=g)
    v = torch.randn(40, 4, 2, 16, generator=g)
    q = torch.randn(2 + 5, 4, 16, generator=g)
    decode = AttentionGroup.build(0, [1, 1], [9, 14], [[1, 2, 3], [4, 5, 6, 7]], 4, torch.device("cpu"))
    prefill = AttentionGroup.build(2, [5], [11], [[8, 9, 10]], 4, torch.device("cpu"))
    slots = torch.zeros(7, dtype=torch.int64)
    want = attend(q, (k, v), GroupedMetadata(slots, [decode, prefill]), 0.25)
    got = attend(q, (k, v), GroupedMetadata(slots, [decode, prefill], CpuAttentionBackend()), 0.25)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5)


def test_bad_inputs_raise():
    with pytest.raises(RuntimeError, match="heads"):  # no KV heads: an error, not a division by 0
        empty = torch.randn(2, 16, 0, 64)
        paged_decode_attention(torch.randn(1, 4, 64), empty, empty, torch.tensor([[0]]), torch.tensor([3], dtype=torch.int32), 0.1)
    q, k, v, group = _decode_step(4, 2, 16, 4, [5], torch.float32)
    with pytest.raises(RuntimeError, match="dtype"):
        paged_decode_attention(q.double(), k, v, group.block_tables, group.context_lens, 0.25)
    with pytest.raises(RuntimeError, match="index dtypes"):
        paged_decode_attention(q, k, v, group.block_tables.int(), group.context_lens, 0.25)
    with pytest.raises(RuntimeError, match="context_lens"):  # longer than its block table
        paged_decode_attention(q, k, v, group.block_tables, torch.tensor([100], dtype=torch.int32), 0.25)
    with pytest.raises(RuntimeError, match="is not a block"):
        paged_decode_attention(q, k, v, torch.tensor([[0, 10**9]]), group.context_lens, 0.25)
    with pytest.raises(RuntimeError, match="fewer rows"):
        paged_decode_attention(torch.randn(3, 4, 16), k, v, group.block_tables, group.context_lens, 0.25)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nan_key_poisons_its_request_only(dtype):
    """A NaN in one request's keys gives NaN for that request (as the PyTorch path does),
    not a silently dropped token; the other requests are untouched."""
    q, k, v, group = _decode_step(9, 3, 64, 16, [40, 33], dtype)
    row = group.block_tables[0, 1] * 16 + 3  # request 0's token 19
    k.view(-1, 3, 64)[row, 1, 5] = float("nan")
    out = paged_decode_attention(q, k, v, group.block_tables, group.context_lens, 0.125)
    assert torch.isnan(out[0, 3:6]).all()  # the query heads of KV head 1
    assert torch.isfinite(out[0, :3]).all() and torch.isfinite(out[1]).all()


# --------------------------------------------------- every token over an int8 / fp8 cache
def _quantized_step(num_heads, num_kv_heads, head_dim, block_size, q_lens, ctx_lens, dtype, seed=0):
    from kvflow.attention.kv_cache import quantize_kv

    q, k, v, tables = random_paged_step(num_heads, num_kv_heads, head_dim, block_size, q_lens, ctx_lens,
                                        torch.float32, seed)
    (kq, ks), (vq, vs) = (quantize_kv(x.view(-1, num_kv_heads, head_dim), dtype) for x in (k, v))
    cache = (kq.view(k.shape), vq.view(v.shape), ks.view(k.shape[:3]), vs.view(k.shape[:3]))
    return q, cache, tables


def _flat(q_lens, ctx_lens, tables):
    meta = flat_metadata(CpuQuantizedAttentionBackend(), torch.zeros(sum(q_lens), dtype=torch.int64), q_lens, ctx_lens,
                         tables, torch.device("cpu"))
    return meta.block_tables, meta.query_start_loc, meta.context_lens


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, block_size",
    [(9, 3, 64, 16), (8, 8, 64, 1), (12, 2, 128, 16), (6, 3, 32, 4), (4, 1, 80, 16), (4, 2, 16, 16),
     (4, 1, 256, 16)],
)
def test_quantized_every_token_matches_torch_path_and_is_batch_invariant(kv_dtype, num_heads, num_kv_heads,
                                                                          head_dim, block_size):
    """paged_attention_quantized over decodes and prefill chunks (with a cached prefix) agrees
    with the PyTorch path to float32 rounding, and each token's result equals, bit for bit,
    that token computed alone as a decode over its own context."""
    from kvflow.attention.cpu_attention import paged_attention_quantized

    q_lens, ctx_lens = [1, 5, 20, 1, 40], [9, 5, 30, 1, 70]
    q, cache, tables = _quantized_step(num_heads, num_kv_heads, head_dim, block_size, q_lens, ctx_lens, kv_dtype)
    scale = head_dim**-0.5
    out = paged_attention_quantized(q, cache, *_flat(q_lens, ctx_lens, tables), scale)
    start, alone, refs = 0, [], []
    for q_len, ctx, table in zip(q_lens, ctx_lens, tables):
        group = AttentionGroup.build(0, [q_len], [ctx], [table], block_size, torch.device("cpu"))
        meta = GroupedMetadata(torch.zeros(q_len, dtype=torch.int64), [group])
        refs.append(attend(q[start : start + q_len], cache, meta, scale))
        for i in range(q_len):
            one = paged_attention_quantized(q[start + i : start + i + 1], cache, *_flat([1], [ctx - q_len + i + 1], [table]), scale)
            alone.append(one)
        start += q_len
    torch.testing.assert_close(out, torch.cat(refs), atol=3e-6, rtol=2e-5)
    assert torch.equal(torch.cat(alone), out)


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("head_dim", [16, 64, 80, 128])
def test_quantized_codes_convert_in_vectors_to_the_tables_values(kv_dtype, head_dim):
    """The kernel's vector conversion of int8 / e4m3fn codes (code_format 1 / 2) gives, bit for
    bit, the outputs of its table path (code_format 0) over caches holding every code (fp8:
    but its NaN codes), subnormal fp8 codes and scales across float16's range included."""
    from kvflow.attention.cpu_attention import _CODE_FORMATS, _EXTENSION, _code_table

    gen = torch.Generator().manual_seed(head_dim)
    blocks, block_size, kv_heads, heads = 12, 16, 2, 6
    shape = (blocks, block_size, kv_heads, head_dim)
    codes = [torch.randint(0, 256, shape, generator=gen, dtype=torch.int32).to(torch.uint8) for _ in range(2)]
    codes[0].view(-1)[:256] = torch.arange(256, dtype=torch.int32).to(torch.uint8)  # every code
    if kv_dtype == torch.float8_e4m3fn:
        for c in codes:
            c[(c == 0x7F) | (c == 0xFF)] = 0x01  # (NaN codes: never written)
    scales = [torch.exp2(torch.randint(-20, 12, shape[:3], generator=gen).float()) * (1 + torch.rand(shape[:3], generator=gen))
              for _ in range(2)]
    scales = [s.half() for s in scales]
    q = torch.randn(3, heads, head_dim, generator=gen)
    tables = torch.tensor([[0, 5, 3, 7, 11, 1], [2, 4, 6, 8, 9, 10]], dtype=torch.int64)
    starts = torch.tensor([0, 1, 3], dtype=torch.int32)
    ctx = torch.tensor([90, 37], dtype=torch.int32)
    lut = _code_table(kv_dtype)
    kernel = _EXTENSION.require()
    args = (q, codes[0], codes[1], scales[0], scales[1], lut, tables, starts, ctx, head_dim**-0.5)
    table_out = kernel.paged_attention_quantized(*args, 0)
    vector_out = kernel.paged_attention_quantized(*args, _CODE_FORMATS[kv_dtype])
    assert torch.isfinite(table_out).all()
    assert torch.equal(vector_out, table_out)
    with pytest.raises(RuntimeError, match="code_format"):
        kernel.paged_attention_quantized(*args, 3)


def test_quantized_kernel_keeps_the_query_dtype_and_checks_metadata():
    from kvflow.attention.cpu_attention import paged_attention_quantized

    q, cache, tables = _quantized_step(9, 3, 64, 16, [3], [20], torch.int8)
    tables_t, starts, ctx = _flat([3], [20], tables)
    out16 = paged_attention_quantized(q.bfloat16(), cache, tables_t, starts, ctx, 0.125)
    assert out16.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="context_lens"):
        paged_attention_quantized(q, cache, tables_t, starts, torch.tensor([2], dtype=torch.int32), 0.125)
    with pytest.raises(RuntimeError, match="not a block of the cache"):
        paged_attention_quantized(q, cache, torch.full_like(tables_t, 999), starts, ctx, 0.125)
