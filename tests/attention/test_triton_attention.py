"""The Triton paged-attention and cache-write kernels against the PyTorch backend.

Without CUDA the kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``, set by
tests/conftest.py), which checks the kernel logic (indexing, masking, online softmax) in
float32 / float16; bfloat16 ``tl.dot`` and float8 loads are not supported there and are
covered by the GPU tests only.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from conftest import random_paged_step  # noqa: E402
from conftest import attend, flat_metadata, store_kv  # noqa: E402
from kvflow.attention.kv_cache import quantize_kv, write_kv_cache  # noqa: E402
from kvflow.attention.torch_backend import AttentionGroup, GroupedMetadata  # noqa: E402
from kvflow.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from kvflow.attention.triton_attention import triton_paged_attention  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


TRITON = TritonAttentionBackend()


def _random_step(num_heads, num_kv_heads, head_dim, block_size, q_lens, ctx_lens, dtype, seed=0):
    return random_paged_step(num_heads, num_kv_heads, head_dim, block_size, q_lens, ctx_lens, dtype, seed, num_blocks=96)


def _torch_reference(q, kv_cache, q_lens, ctx_lens, tables, block_size, scale):
    groups, start = [], 0
    for n, c, t in zip(q_lens, ctx_lens, tables):  # one group per request: no padding at all
        groups.append(AttentionGroup.build(start, [n], [c], [t], block_size, torch.device("cpu")))
        start += n
    return attend(q, kv_cache, GroupedMetadata(torch.zeros(start, dtype=torch.int64), groups), scale)


def _triton(q, kv_cache, q_lens, ctx_lens, tables, scale):
    meta = flat_metadata(TRITON, torch.zeros(q.shape[0], dtype=torch.int64, device=DEVICE), q_lens, ctx_lens,
                         tables, DEVICE)
    out = attend(q.to(DEVICE), tuple(t.to(DEVICE) for t in kv_cache), meta, scale)
    return out.cpu()


# decodes (one query token) next to a full prefill, a chunk after a cached prefix, a chunk
# that ends mid-block and a one-token context
STEP = ([1, 1, 23, 9, 5, 1], [1, 40, 23, 30, 37, 17])


@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, block_size",
    [
        (9, 3, 64, 16),  # SmolLM2's GQA 9:3 (group of 3: padded to 4 rows per token)
        (4, 2, 16, 4),  # block smaller than a key tile
        (8, 8, 32, 32),  # MHA, block larger than a tile
        (8, 1, 16, 16),  # MQA
        (6, 2, 24, 8),  # head_dim not a power of two (masked lanes)
    ],
)
def test_matches_torch_backend_float32(num_heads, num_kv_heads, head_dim, block_size):
    q_lens, ctx_lens = STEP
    q, k, v, tables = _random_step(num_heads, num_kv_heads, head_dim, block_size, q_lens, ctx_lens, torch.float32)
    scale = head_dim**-0.5
    ref = _torch_reference(q, (k, v), q_lens, ctx_lens, tables, block_size, scale)
    out = _triton(q, (k, v), q_lens, ctx_lens, tables, scale)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-5)


def test_matches_torch_backend_float16():
    q_lens, ctx_lens = STEP
    q, k, v, tables = _random_step(4, 2, 32, 16, q_lens, ctx_lens, torch.float16)
    ref = _torch_reference(q.float(), (k.float(), v.float()), q_lens, ctx_lens, tables, 16, 32**-0.5)
    out = _triton(q, (k, v), q_lens, ctx_lens, tables, 32**-0.5)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), ref, atol=3e-3, rtol=3e-3)


def test_decode_only_step_and_long_context():
    """Decode steps take the 16-row program shape; contexts span many key tiles."""
    q_lens, ctx_lens = [1, 1, 1], [200, 3, 129]
    q, k, v, tables = _random_step(9, 3, 64, 16, q_lens, ctx_lens, torch.float32)
    ref = _torch_reference(q, (k, v), q_lens, ctx_lens, tables, 16, 0.125)
    torch.testing.assert_close(_triton(q, (k, v), q_lens, ctx_lens, tables, 0.125), ref, atol=2e-6, rtol=2e-5)


def test_int8_kv_cache_matches_torch_backend():
    q_lens, ctx_lens = STEP
    q, k, v, tables = _random_step(9, 3, 64, 16, q_lens, ctx_lens, torch.float32)
    kq, ks = quantize_kv(k.view(-1, 3, 64), torch.int8)
    vq, vs = quantize_kv(v.view(-1, 3, 64), torch.int8)
    cache = (kq.view(k.shape), vq.view(v.shape), ks.view(k.shape[:3]), vs.view(v.shape[:3]))
    ref = _torch_reference(q, cache, q_lens, ctx_lens, tables, 16, 0.125)
    torch.testing.assert_close(_triton(q, cache, q_lens, ctx_lens, tables, 0.125), ref, atol=1e-5, rtol=1e-4)


def test_request_without_query_tokens_is_skipped():
    """A padded CUDA-graph row (no query tokens, empty context) neither fails nor writes."""
    q, k, v, tables = _random_step(4, 2, 16, 4, [3, 2], [10, 6], torch.float32)
    meta = flat_metadata(TRITON, torch.zeros(5, dtype=torch.int64, device=DEVICE), [3, 0, 2], [10, 0, 6],
                         [tables[0], [0], tables[1]], DEVICE)
    out = triton_paged_attention(q.to(DEVICE), (k.to(DEVICE), v.to(DEVICE)), meta, 0.25).cpu()
    ref = _torch_reference(q, (k, v), [3, 2], [10, 6], tables, 4, 0.25)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.int8])
def test_write_skips_negative_slots(cache_dtype):
    g = torch.Generator().manual_seed(1)
    num_blocks, block_size = 6, 4
    k = torch.randn(5, 2, 8, generator=g)
    v = torch.randn(5, 2, 8, generator=g)
    slots = torch.tensor([3, -1, 17, 0, -1])

    def empty_cache():
        shape = (num_blocks, block_size, 2, 8)
        if cache_dtype == torch.int8:
            return (torch.zeros(shape, dtype=torch.int8), torch.zeros(shape, dtype=torch.int8),
                    torch.zeros(shape[:3], dtype=torch.float16), torch.zeros(shape[:3], dtype=torch.float16))
        return torch.zeros(shape), torch.zeros(shape)

    ref = empty_cache()
    keep = slots >= 0
    write_kv_cache(k[keep], v[keep], ref, slots[keep])
    cache = tuple(t.to(DEVICE) for t in empty_cache())
    store_kv(k.to(DEVICE), v.to(DEVICE), cache, slots.to(DEVICE), backend=TRITON)
    for got, want in zip(cache, ref):
        assert torch.equal(got.cpu(), want)
    assert cache[0].abs().sum() > 0  # something was written


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU interpreter's refusal")
def test_bfloat16_is_refused_in_the_interpreter():
    q, k, v, tables = _random_step(4, 2, 16, 4, [1], [5], torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16"):
        _triton(q, (k, v), [1], [5], tables, 0.25)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bfloat16 tl.dot needs a CUDA device (not in the interpreter)")
def test_bfloat16_on_cuda():
    q_lens, ctx_lens = STEP
    q, k, v, tables = _random_step(9, 3, 64, 16, q_lens, ctx_lens, torch.bfloat16)
    ref = _torch_reference(q.float(), (k.float(), v.float()), q_lens, ctx_lens, tables, 16, 0.125)
    out = _triton(q, (k, v), q_lens, ctx_lens, tables, 0.125)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
