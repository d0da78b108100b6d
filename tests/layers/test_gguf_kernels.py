"""GGUF blocks computed as stored (kvflow.layers.gguf_kernels) against the gguf package.

``dequantize`` must equal ``gguf.quants.dequantize`` bit for bit; ``gguf_linear`` (the C++
integer kernel where built, else the PyTorch path) must stay within the error bound of its
int8 activation rounding of a float64 product with the reference weight. The README's test
command runs this file three times: with the kernel at -march=native (AVX-512 VNNI here),
with KVFLOW_CPU_KERNELS=0 (the PyTorch path), and at x86-64-v3 (the AVX2 path).
"""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from kvflow.layers import gguf_kernels as gk
from kvflow.layers.gguf_kernels import GGUFWeight, dequantize, gguf_linear

Q = gguf.GGMLQuantizationType
QTYPES = sorted(gk.SUPPORTED_QTYPES)
# The formats gguf.quants can quantize (the others get valid random bytes).
QUANTIZABLE = {Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0}


def _random_raw(qt, n: int, k: int, seed: int = 0) -> np.ndarray:
    """uint8 [n, row_bytes] of valid blocks: gguf.quants.quantize of Gaussian weights where the
    package implements it, else random quant bits with fp16 scales in a sane range."""
    rng = np.random.default_rng(seed)
    if qt in QUANTIZABLE:
        return quants.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, qt)
    size, bpb = gguf.GGML_QUANT_SIZES[qt]
    nb = n * k // size
    b = rng.integers(0, 256, (nb, bpb), dtype=np.uint8)

    def set_f16(offset: int, lo: float, hi: float) -> None:
        b[:, offset:offset + 2] = rng.uniform(lo, hi, nb).astype(np.float16).view(np.uint8).reshape(nb, 2)

    if qt in (Q.Q4_K, Q.Q5_K):
        set_f16(0, 1e-4, 2e-3)  # d (times 6-bit scales)
        set_f16(2, 1e-4, 2e-3)  # dmin (times 6-bit mins)
    else:  # Q6_K: d at the end, int8 scales
        set_f16(208, 1e-5, 2e-4)
    return b.reshape(n, -1)


def _weight(qt, n: int, k: int, seed: int = 0) -> tuple[GGUFWeight, torch.Tensor]:
    raw = _random_raw(qt, n, k, seed)
    ref = torch.from_numpy(quants.dequantize(raw, qt).astype(np.float64))
    return GGUFWeight(torch.from_numpy(raw), qt, n, k), ref


def _bound(x: torch.Tensor, ref_w: torch.Tensor) -> torch.Tensor:
    """|gguf_linear - x W^T| bound [M, n] for the integer kernel (the PyTorch path is far inside).

    Each activation row is quantized in blocks of 32 with d = amax / 127 and q = round(x / d),
    so per element |x - d q| <= d / 2 (+ |x| * 2^-22 for the float32 rounding of d and 1/d),
    and the activation rounding costs at most sum_blocks (d_b / 2) * sum_{i in b} |w_i|.
    Float32 accumulation adds at most (K / 32 + 32) * 2^-23 times the magnitude of the summed
    terms; a block's integer product and its offset/minimum term are each at most twice its
    largest |w| times sum |x| (w = d q + m: |d q| = |w - m| <= 2 max|w|), hence the factor 4.
    """
    m, k = x.shape
    xb = x.double().view(m, k // 32, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127  # [M, nb, 1]
    wb = ref_w.abs().view(-1, k // 32, 32)  # [n, nb, 32]
    rounding = torch.einsum("mb,nb->mn", d[..., 0] / 2, wb.sum(-1)) + (x.double().abs() * 2**-22) @ ref_w.abs().t()
    wmax = wb.amax(-1)  # [n, nb]
    accumulation = (k / 32 + 32) * 2**-23 * 4 * torch.einsum("mb,nb->mn", xb.abs().sum(-1), wmax)
    return rounding + accumulation


@pytest.mark.parametrize("qt", QTYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_matches_gguf(qt, dtype):
    """Bit-exact with gguf.quants.dequantize in float32 (rounded once to bfloat16), also for
    rows read through a strided view (a column slice)."""
    k = 512
    raw = _random_raw(qt, 7, k)
    want = torch.from_numpy(quants.dequantize(raw, qt).astype(np.float32))
    got = dequantize(torch.from_numpy(raw), qt, k, dtype)
    assert got.dtype == dtype and got.shape == (7, k)
    assert torch.equal(got, want.to(dtype))
    w = GGUFWeight(torch.from_numpy(raw), qt, 7, k).narrow_cols(256, 256)
    assert torch.equal(w.dequantize(), want[:, 256:])


@pytest.mark.parametrize("qt", QTYPES, ids=lambda t: t.name)
def test_kernel_dequantize_is_exact(qt):
    """The kernel's expansion (the prefill path's weight tiles) equals gguf's, also through a
    strided column slice, in float32 and (rounded once) bfloat16."""
    from kvflow import ops

    if not gk.kernel_available():
        pytest.skip("the GGUF kernel is not built here (KVFLOW_CPU_KERNELS=0 or no compiler)")
    k = 768
    raw = torch.from_numpy(_random_raw(qt, 9, k, seed=2))
    want = torch.from_numpy(quants.dequantize(raw.numpy(), qt).astype(np.float32))
    for dtype in (torch.float32, torch.bfloat16):
        got = torch.empty(9, k, dtype=dtype)
        ops.GGUF_MATMUL.load().gguf_dequantize(raw, int(qt), 9, k, got)
        assert torch.equal(got, want.to(dtype))
    w = GGUFWeight(raw, qt, 9, k).narrow_cols(256, 512)
    got = torch.empty(9, 512)
    ops.GGUF_MATMUL.load().gguf_dequantize(w.raw, int(qt), 9, 512, got)
    assert torch.equal(got, want[:, 256:768])


# M: decode (1), speculative verification / batched decode (2..64, groups of four rows and
# their remainders), prefill (512), a step of more than 4096 rows (4100). Shapes: N not a multiple of the packed layout's 16-row
# group (13: one partial group; 49; 333: 21 groups, several chunks of the shared work counter
# for the threads); K a multiple of 32 but not of 256 for the 32-element formats.
CASES = [(1, 13), (2, 13), (3, 49), (4, 13), (5, 49), (9, 49), (12, 13), (17, 13), (64, 49), (512, 13), (1, 333), (6, 333), (37, 333),
         (130, 21), (4100, 13)]


@pytest.mark.parametrize("qt", QTYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m, n", CASES)
def test_linear_within_int8_activation_bound(qt, m, n):
    k = 256 * 3 if qt in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else 96 * 3
    w, ref_w = _weight(qt, n, k, seed=m)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g) * torch.rand(m, k, generator=g) * 3  # uneven magnitudes per block
    y = gguf_linear(x, w)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    ref = x.double() @ ref_w.t()
    assert bool(((y.double() - ref).abs() <= _bound(x, ref_w)).all()), (y.double() - ref).abs().max()


@pytest.mark.skipif(not gk.kernel_available(), reason="the packed kernel is not built here (the PyTorch path's GEMM "
                    "blocks by M)")
@pytest.mark.parametrize("qt", [Q.Q4_1, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_a_rows_result_does_not_depend_on_the_other_rows(qt):
    """Batch invariance: each row of a 4100-row call (a prefill step past 4096 rows) equals
    the same row computed alone, in 5, 12 (the VNNI small-M path's pairs of groups) and 40 rows,
    bit for bit, so a prompt's results do
    not depend on what the scheduler batched with it (a 4096-row switch to dequantized tiles
    made them 0.042 nat apart)."""
    k = 256 if qt in (Q.Q4_K, Q.Q6_K) else 96
    w, _ = _weight(qt, 21, k, seed=7)
    x = torch.randn(4100, k, generator=torch.Generator().manual_seed(7))
    y = gguf_linear(x, w)
    for lo, hi in ((0, 1), (0, 5), (100, 112), (2000, 2040), (4095, 4100)):
        assert torch.equal(gguf_linear(x[lo:hi], w), y[lo:hi]), (lo, hi)


# The quant bytes of one block (start, end) per format, and the byte that sets every value in
# them to its largest (Q8_0: int8 127); the scale fields stay _random_raw's.
_QUANT_BYTES = {
    Q.Q4_0: ((2, 18),), Q.Q4_1: ((4, 20),), Q.Q5_0: ((2, 22),), Q.Q5_1: ((4, 24),), Q.Q8_0: ((2, 34),),
    Q.Q4_K: ((16, 144),), Q.Q5_K: ((16, 176),), Q.Q6_K: ((0, 192),),
}


@pytest.mark.parametrize("qt", QTYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [3, 40])
def test_linear_at_the_integer_sums_bounds(qt, m):
    """Every weight value at its format's largest and activations at +-127 after rounding: the
    kernels' 16-bit partial sums (AVX2 vpmaddubsw pairs added before vpmaddwd) are at their
    bound here, so a sum that overflows or saturates shows as a wrong result. M = 3 takes the
    small-M path, 40 the GEMM."""
    k = 512 if qt in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else 128
    n = 24
    raw = _random_raw(qt, n, k, seed=11)
    size, bpb = gguf.GGML_QUANT_SIZES[qt]
    blocks = raw.reshape(-1, bpb)
    for lo, hi in _QUANT_BYTES[qt]:
        blocks[:, lo:hi] = 0x7F if qt == Q.Q8_0 else 0xFF
    ref_w = torch.from_numpy(quants.dequantize(raw, qt).astype(np.float64))
    w = GGUFWeight(torch.from_numpy(raw), qt, n, k)
    rows = [torch.ones(k), -torch.ones(k), torch.tensor([1.0, -1.0]).repeat(k // 2),
            torch.tensor([1.0, 1.0, -1.0, -1.0]).repeat(k // 4)]
    x = torch.stack([rows[i % len(rows)] * (1 + i % 3) for i in range(m)])
    y = gguf_linear(x, w)
    ref = x.double() @ ref_w.t()
    assert bool(((y.double() - ref).abs() <= _bound(x, ref_w)).all()), (y.double() - ref).abs().max()


@pytest.mark.parametrize("qt", [Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_bias_and_out_column_slice(qt, dtype):
    """bias is added; ``out`` may be a column slice of a wider buffer (row stride != n): the
    result lands there, the buffer's other columns are untouched; bfloat16 in, bfloat16 out."""
    m, n = 5, 49
    k = 576 if qt in (Q.Q4_0, Q.Q8_0) else 512
    w, ref_w = _weight(qt, n, k, seed=3)
    x = torch.randn(m, k).to(dtype)
    bias = torch.randn(n)
    buf = torch.full((m, n + 10), 7.0, dtype=dtype)
    out = buf[:, 4:4 + n]
    y = gguf_linear(x, w, bias, out=out)
    assert y.data_ptr() == out.data_ptr() and y.dtype == dtype
    ref = x.double() @ ref_w.t() + bias.double()
    bound = _bound(x.float(), ref_w)
    if dtype == torch.bfloat16:
        bound = bound + ref.abs() * 2**-8 + 1e-30  # one rounding of the float32 result to bfloat16
    assert bool(((y.double() - ref).abs() <= bound).all())
    assert bool((buf[:, :4] == 7).all() and (buf[:, 4 + n:] == 7).all())
    no_out = gguf_linear(x, w, bias)
    assert no_out.dtype == dtype and torch.equal(no_out, y)


def test_linear_on_slices_and_concatenation():
    """Row and column slices share the stored bytes and compute the slice of the product;
    cat_rows stacks parts (a fused QKV) and computes the stacked product."""
    w, ref_w = _weight(Q.Q4_K, 40, 1024, seed=5)
    x = torch.randn(3, 1024)
    rows = w.narrow_rows(8, 13)
    assert rows.raw.data_ptr() == w.raw[8].data_ptr() and rows.shape == (13, 1024)
    torch.testing.assert_close(gguf_linear(x, rows), gguf_linear(x, w)[:, 8:21])
    cols = w.narrow_cols(256, 512)
    assert cols.shape == (40, 512) and cols.nbytes == 40 * 2 * 144
    ref = x[:, 256:768].double() @ ref_w[:, 256:768].t()
    assert bool(((gguf_linear(x[:, 256:768], cols).double() - ref).abs() <= _bound(x[:, 256:768], ref_w[:, 256:768])).all())
    fused = GGUFWeight.cat_rows([w.narrow_rows(0, 5), w.narrow_rows(30, 10)])
    assert fused.shape == (15, 1024) and torch.equal(fused.dequantize(), torch.cat([ref_w[:5], ref_w[30:]]).float())


def test_embedding_rows():
    w, ref_w = _weight(Q.Q6_K, 50, 256, seed=6)
    ids = torch.tensor([3, 0, 49, 3])
    got = w.embedding(ids, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, ref_w[ids].float().bfloat16())


def test_bad_input_names_the_field():
    raw = torch.from_numpy(_random_raw(Q.Q4_0, 4, 64))
    with pytest.raises(ValueError, match="qtype: Q2_K is not supported"):
        GGUFWeight(raw, Q.Q2_K, 4, 64)
    with pytest.raises(ValueError, match="qtype"):
        gk.block_layout(12345)
    with pytest.raises(ValueError, match=r"raw: expected shape \[4, 36\]"):
        GGUFWeight(raw[:, :30], Q.Q4_0, 4, 64)
    with pytest.raises(ValueError, match="raw: expected a uint8"):
        GGUFWeight(raw.float(), Q.Q4_0, 4, 64)
    with pytest.raises(ValueError, match="k: 48 is not a positive multiple of Q4_0's block of 32"):
        gk.row_bytes(Q.Q4_0, 48)
    w = GGUFWeight(raw, Q.Q4_0, 4, 64)
    with pytest.raises(ValueError, match="narrow_cols: start=16 and length=32 must be multiples"):
        w.narrow_cols(16, 32)
    with pytest.raises(ValueError, match="narrow_rows"):
        w.narrow_rows(3, 2)
    with pytest.raises(ValueError, match="parts"):
        GGUFWeight.cat_rows([w, GGUFWeight(torch.from_numpy(_random_raw(Q.Q8_0, 4, 64)), Q.Q8_0, 4, 64)])
    with pytest.raises(ValueError, match="x: expected"):
        gguf_linear(torch.randn(2, 32), w)
    with pytest.raises(ValueError, match="out: expected"):
        gguf_linear(torch.randn(2, 64), w, out=torch.empty(2, 5))
    assert gk.block_layout(Q.Q6_K) == (256, 210) and gk.row_bytes(Q.Q4_K, 512) == 288


def test_kernel_runs_the_expected_instruction_set():
    """Which path ran: none with KVFLOW_CPU_KERNELS=0; the AVX2 products under the test
    command's x86-64-v3 pass; VNNI where the build targets a CPU that has it."""
    if os.environ.get("KVFLOW_CPU_KERNELS") == "0" or os.environ.get("KVFLOW_CPU_GGUF") == "0":
        assert not gk.kernel_available() and gk.kernel_isa() is None
        return
    if not gk.kernel_available():
        pytest.skip("the GGUF kernel could not be built here")
    march = os.environ.get("KVFLOW_CPU_MARCH", "native")
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    if march == "x86-64-v3":
        assert gk.kernel_isa() == "avx2"
    elif march == "native" and " avx512_vnni" in flags and " avx512vl" in flags:
        assert gk.kernel_isa() == "avx512_vnni"
    assert gk.kernel_available(Q.Q6_K) and not gk.kernel_available(Q.Q2_K)


@pytest.mark.parametrize("qt", QTYPES, ids=lambda t: t.name)
def test_packed_layout_round_trips_and_computes_as_stored(qt):
    """pack (rows interleaved 16 at a time) and unpack are exact inverses, also for N not a
    multiple of 16; the packed size is the stored one (Q4_K / Q5_K: + 4 bytes per 256 elements
    for the unpacked 6-bit scales); a weight whose stored rows were released rebuilds them byte-exact
    (dequantize, narrow_rows, embedding work), and the packed kernel computes what the
    stored-row kernel computes (same quantized products; float32 summation order only)."""
    if not gk.kernel_available():
        pytest.skip("the GGUF kernel is not built here (KVFLOW_CPU_KERNELS=0 or no compiler)")
    from kvflow import ops

    module = ops.GGUF_MATMUL.load()
    k = 512 if qt in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else 96
    n = 21
    raw = torch.from_numpy(_random_raw(qt, n, k, seed=7))
    w = GGUFWeight(raw.clone(), qt, n, k)
    packed = w.pack(release_raw=True)
    extra = 4 * k // 256 if qt in (Q.Q4_K, Q.Q5_K) else 0  # 4 bytes per super-block and row
    assert module.gguf_pack_rows() == 16
    assert packed.shape[0] == 2 and packed.numel() == 32 * (gk.row_bytes(qt, k) + extra)  # 2 groups of 16 rows
    assert w.nbytes == packed.numel()  # held once
    assert torch.equal(w.raw, raw)
    assert torch.equal(w.dequantize(), dequantize(raw, qt, k))
    assert torch.equal(w.narrow_rows(5, 9).raw, raw[5:14])
    assert torch.equal(w.embedding(torch.tensor([20, 0]), torch.float32), dequantize(raw[[20, 0]], qt, k))
    # the lookup reads each id's row from its group (gguf_embedding): every row, repeated ids,
    # the padded last group, both dtypes, the same floats as the stored rows dequantized
    ids = torch.tensor([*range(n), 17, 3, 17])
    for dtype in (torch.float32, torch.bfloat16):
        got = w.embedding(ids, dtype)
        assert got.dtype == dtype and torch.equal(got, dequantize(raw[ids], qt, k, dtype))
    assert w.embedding(torch.tensor([], dtype=torch.int64), torch.float32).shape == (0, k)
    for bad in (n, -1):
        with pytest.raises(IndexError, match=rf"ids: values must lie in \[0, {n}\), got {bad}"):
            w.embedding(torch.tensor([0, bad]), torch.float32)
    for m in (1, 4, 7):
        x = torch.randn(m, k)
        stored = torch.empty(m, n)
        module.gguf_linear(x, raw, int(qt), n, k, None, stored)
        torch.testing.assert_close(gguf_linear(x, w), stored, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qt", QTYPES, ids=lambda t: t.name)
def test_fast_pack_is_byte_exact_with_reference_pack(qt):
    """gguf_pack_fast (the load-time repack: whole words, each packed byte written once) gives
    exactly gguf_pack's bytes (one element at a time, the layout's reference): arbitrary
    bytes (every bit moved), N a multiple of 16 or not (zero padding rows), one row, and rows
    with a stride (a column slice of a wider weight)."""
    if not gk.kernel_available():
        pytest.skip("the GGUF kernel is not built here (KVFLOW_CPU_KERNELS=0 or no compiler)")
    from kvflow import ops

    module = ops.GGUF_MATMUL.load()
    size = gguf.GGML_QUANT_SIZES[qt][0]
    gen = torch.Generator().manual_seed(int(qt))
    for n, blocks in ((1, 1), (21, 3), (48, 2)):
        k = blocks * size
        wide = torch.randint(0, 256, (n, gk.row_bytes(qt, k + size)), dtype=torch.uint8, generator=gen)
        for raw in (wide[:, : gk.row_bytes(qt, k)].contiguous(), wide[:, gk.row_bytes(qt, size):]):
            fast = module.gguf_pack_fast(raw, int(qt), n, k)
            assert torch.equal(fast, module.gguf_pack(raw, int(qt), n, k)), (qt.name, n, k, raw.stride())
            assert torch.equal(module.gguf_unpack(fast, int(qt), n, k), raw)
            assert tuple(fast.shape) == gk.packed_shape(qt, n, k)
            out = torch.full(gk.packed_shape(qt, n, k), 7, dtype=torch.uint8)
            assert module.gguf_pack_fast(raw, int(qt), n, k, out).data_ptr() == out.data_ptr()
            assert torch.equal(out, fast)
            with pytest.raises(RuntimeError, match="out: contiguous uint8"):  # a buffer of the wrong shape
                module.gguf_pack_fast(raw, int(qt), n, k, out[:, 1:])


@pytest.mark.parametrize("qt", [Q.Q4_K, Q.Q8_0], ids=lambda t: t.name)
def test_parts_are_packed_in_place_of_their_join(qt):
    """packed_cat_rows (a fused QKV / gate-up at load) gives the packed bytes of cat_rows's
    joined rows, packing each part straight into its row groups (no joined copy); parts that
    do not end on a 16-row group fall back to the join, with the same result."""
    if not gk.kernel_available():
        pytest.skip("the GGUF kernel is not built here (KVFLOW_CPU_KERNELS=0 or no compiler)")
    k = 512
    for sizes in ((32, 16, 7), (48, 21), (7, 16), (16,)):
        raws = [torch.from_numpy(_random_raw(qt, n, k, seed=n)) for n in sizes]
        parts = [GGUFWeight(r.clone(), qt, n, k) for r, n in zip(raws, sizes)]
        joined = GGUFWeight.packed_cat_rows(parts)
        reference = GGUFWeight.cat_rows([GGUFWeight(r, qt, n, k) for r, n in zip(raws, sizes)])
        assert joined.shape == (sum(sizes), k) and joined._raw is None
        assert torch.equal(joined.packed, reference.pack()), sizes
        assert torch.equal(joined.raw, torch.cat(raws)) and joined.nbytes == joined.packed.numel()
        if all(n % 16 == 0 for n in sizes[:-1]):  # packed in place: the parts hold no stored rows
            assert all(p._raw is None for p in parts)
        x = torch.randn(3, k)
        torch.testing.assert_close(gguf_linear(x, joined), gguf_linear(x, reference))
    with pytest.raises(ValueError, match="parts"):
        GGUFWeight.packed_cat_rows([GGUFWeight(torch.from_numpy(_random_raw(qt, 16, k)), qt, 16, k),
                                    GGUFWeight(torch.from_numpy(_random_raw(Q.Q5_0, 16, k)), Q.Q5_0, 16, k)])


def test_linear_packs_once_at_first_use():
    """gguf_linear packs a weight at its first kernel call and reuses the packed layout; the
    stored rows are dropped (held once) unless the owner keeps them (release_raw_on_pack)."""
    if not gk.kernel_available():
        pytest.skip("the GGUF kernel is not built here (KVFLOW_CPU_KERNELS=0 or no compiler)")
    w, ref_w = _weight(Q.Q4_1, 19, 64)
    x = torch.randn(2, 64)
    y = gguf_linear(x, w)
    packed = w.packed
    assert packed is not None and w._raw is None and w.nbytes == packed.numel()
    assert torch.equal(gguf_linear(x, w), y) and w.packed is packed
    assert bool(((y.double() - x.double() @ ref_w.t()).abs() <= _bound(x, ref_w)).all())
    ids = torch.tensor([18, 3, 18, 9])  # rows of the last (partial) group, and repeats
    assert torch.equal(w.embedding(ids, torch.float32), ref_w[ids].float())
    with pytest.raises(IndexError):
        w.embedding(torch.tensor([19]), torch.float32)
    kept, _ = _weight(Q.Q4_1, 19, 64)
    kept.release_raw_on_pack = False
    gguf_linear(x, kept)
    assert kept._raw is not None and kept.packed is not None


# The prefill GEMM (from GEMM_MIN_ROWS = 32 rows: pairs of 16-row groups against 4 activation
# rows on AVX-512 VNNI, one group against 8 for an odd group; 8-row halves against 4 on AVX2;
# work items of 128 rows) against the small-M path (under 32 rows: one group against 4 rows),
# which computes each output with the same operations in the same order: equal bit for bit.
# M: 32 (the switch), 39 / 45 (remainders of 3 and 1 after the 4-row tiles, 7 and 5 after the
# 8-row ones), 130 (two work items of rows, the second of 2); N: 13 (one partial group), 49 (a
# pair and a partial odd group), 333 (21 groups: chunks of a pair count, an odd group at a
# chunk's end).
@pytest.mark.parametrize("qt", QTYPES, ids=lambda t: t.name)
def test_prefill_gemm_equals_small_m_path(qt):
    if not gk.kernel_available():
        pytest.skip("the GGUF kernel is not built here (KVFLOW_CPU_KERNELS=0 or no compiler)")
    from kvflow import ops

    module = ops.GGUF_MATMUL.load()
    k = 512 if qt in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else 96 * 3
    gen = torch.Generator().manual_seed(int(qt))
    # (16-31 rows: the GEMM where VNNI takes it from 16 rows, Q6_K from 24; AVX2 the small-M path)
    for m, n, dtype in ((16, 40, torch.float32), (19, 49, torch.bfloat16), (24, 13, torch.float32),
                        (32, 13, torch.float32), (39, 49, torch.bfloat16), (45, 333, torch.float32),
                        (130, 49, torch.float32)):
        w, ref_w = _weight(qt, n, k, seed=m + n)
        packed = w.pack()
        x = (torch.randn(m, k, generator=gen) * torch.rand(m, k, generator=gen) * 3).to(dtype)
        bias = torch.randn(n, generator=gen)
        buf = torch.full((m, n + 7), 5.0, dtype=dtype)
        out = buf[:, 3:3 + n]  # a column slice: row stride n + 7
        module.gguf_linear_packed(x, packed, int(qt), n, k, bias, out)
        small = torch.empty(m, n, dtype=dtype)
        for i in range(0, m, 4):  # 4 rows a call: the small-M path
            module.gguf_linear_packed(x[i:i + 4], packed, int(qt), n, k, bias, small[i:i + 4])
        assert torch.equal(out, small), (qt.name, m, n, dtype, (out.float() - small.float()).abs().max())
        assert bool((buf[:, :3] == 5).all() and (buf[:, 3 + n:] == 5).all())
        ref = x.double() @ ref_w.t() + bias.double()
        bound = _bound(x.float(), ref_w)
        if dtype == torch.bfloat16:
            bound = bound + ref.abs() * 2**-8 + 1e-30
        assert bool(((out.double() - ref).abs() <= bound).all()), qt.name
