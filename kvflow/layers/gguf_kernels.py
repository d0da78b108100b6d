"""GGUF-quantized weights computed as stored: dequantization in PyTorch and a C++ kernel.

A GGUF file (ggml's format) stores a quantized weight [N, K] row by row, each row a run of
blocks; a block holds the quantized values of ``block_size`` consecutive elements and their
scales (layouts: ggml's ``ggml-common.h`` / ``ggml-quants.c``, the ``gguf`` package's
``gguf/quants.py``, whose ``gguf.quants.dequantize`` is the reference of the tests):

======  ========  =====  =====================================================================
type    elements  bytes  layout (fp16 = IEEE half; value of element i)
======  ========  =====  =====================================================================
Q4_0    32        18     fp16 d, 16 B nibbles (i < 16: low nibble of byte i, else high of i-16); d (q - 8)
Q4_1    32        20     fp16 d, fp16 m, nibbles as Q4_0; d q + m
Q5_0    32        22     fp16 d, u32 qh (bit i = 5th bit of element i), nibbles; d (q - 16)
Q5_1    32        24     fp16 d, fp16 m, qh, nibbles; d q + m
Q8_0    32        34     fp16 d, 32 int8; d q
Q4_K    256       144    fp16 d, fp16 dmin, 12 B of 6-bit scales/mins for 8 sub-blocks of 32, 128 B
                         nibbles (sub-block 2j: low nibbles of bytes 32j.., 2j+1: high); d sc q - dmin m
Q5_K    256       176    as Q4_K plus 32 B qh before the nibbles (bit j of byte l: sub-block j, element l)
Q6_K    256       210    128 B low nibbles, 64 B 2-bit highs, 16 int8 scales (sub-blocks of 16), fp16 d;
                         d sc (q - 32)
======  ========  =====  =====================================================================

:func:`dequantize` expands such rows in PyTorch (vectorized, bit-exact against ``gguf``);
:func:`gguf_linear` computes ``x W^T`` from the stored blocks with llama.cpp's method
(``ggml-cpu``'s ``ggml_vec_dot_q*_q8_*``): each activation row is quantized once per call to
int8 blocks of 32 with a float32 scale (Q8_0 style: ``d = amax / 127``, ``q = round(x / d)``;
the block sums are kept for the formats with an offset or minimum), then each weight block's
quantized values are multiplied with the activation block's in integers (AVX-512 VNNI
``vpdpbusd``, AVX2 ``vpmaddubsw`` + ``vpmaddwd``, or a portable loop) and accumulated in float32
with the product of the two scales. Unlike llama.cpp, the K-quants also use the 32-element
activation blocks (ggml uses Q8_K: one scale per 256), which is at least as accurate and
lets every format share one activation layout. (``gguf_linear`` in C++ also reads the
stored row-major blocks directly: the benchmark's baseline.)

Repacked at load (llama.cpp's ``ggml-cpu`` ``repack.cpp`` interleaves rows the same way for
``block_q4_0x8`` / ``block_q4_Kx8``; the layout here is kvflow's own, one for all formats):
:meth:`GGUFWeight.pack` (C++ ``gguf_pack_fast``) regroups the rows 16 at a time (``gguf_pack_rows()``)
so that, per 32-element block, one 64-byte vector holds 4 consecutive quantized values of each
of the 16 rows (eight such vectors per block), and the rows' fp16 scales (and sub-block scales)
sit side by side. Each vector meets one 4-byte group of the activation block broadcast to all
lanes, which AVX-512 takes as the embedded-broadcast memory operand of ``vpdpbusd`` (64
products per instruction, no shuffle; AVX2: ``vpmaddubsw`` + ``vpmaddwd`` against a
``vpbroadcastd``, per 8 rows), about 0.5 dot-product instructions per block and row (the stored rows take ~19
instructions per block and row), the scales of 16 rows converted together. A
format's constant offset (Q4_0's 8, Q5_0's 16, Q6_K's 32; Q8_0's 128 on the VNNI path, which
reads it as unsigned w + 128) is subtracted in integers from the block's product (its
activation sums kept as integers), exactly. Each thread of the intra-op pool owns one contiguous
range of the row groups and reads it front to back in chunks of >= 32 KB of weight (one stream
for the hardware prefetchers); a thread done with its range takes the next chunks of the
others', so a thread that starts late (descheduled on a busy machine) does not hold the call. The packed weight has the stored size (Q4_K /
Q5_K: + 4 bytes per 256 elements) and computes exactly the stored blocks' fields; the decoder
linears drop their stored rows once packed (``pack(release_raw=True)``: ``raw`` then
rebuilds them, byte-exact, from the packed layout where asked for: ``dequantize``,
``narrow_*``, embedding rows). A weight is packed where it is first computed
with the kernel, or at load when the kernel is built already, so tensor-parallel narrowing (at
load) happens before packing.

Prefill and decode batches of 16 rows or more (AVX-512 VNNI; Q6_K from 24, AVX2 and portable
from 32: ``gemm_min_rows`` in the C++ source, measured) run the same packed weights
through a register-blocked GEMM (the oneDNN / llama.cpp ``repack.cpp`` GEMM method: a micro-kernel
keeps an MR x NR tile of accumulators in registers, decodes each weight block once per MR
activation rows and streams the activation tile from cache). AVX-512 VNNI: two 16-row groups
(32 weight rows) against 4 activation rows, 8 zmm integer chains advanced together and 8 zmm
float accumulators; each 4-byte activation broadcast feeds two ``vpdpbusd`` (on Zen 4 a
broadcast costs a vector-pipe slot like a ``vpdpbusd``, so the one-group loop was bound by its
broadcasts: one per product; an odd last group runs 8 rows at a time; the small-M path takes
such pairs from 8 rows too). AVX2: both 8-row halves of a group against 4 activation rows,
each broadcast feeding both halves' ``vpmaddubsw``, the 8 rows' scales converted together (F16C), and
``vpmaddubsw``'s 16-bit pair sums added in 16 bits before one ``vpmaddwd`` where they cannot
overflow (``|a| <= 127``: eight for 4-bit values, four for 5-bit, two for Q6_K's 6-bit; Q8_0
keeps the small-M loop). The threads split (weight chunk of >= 32 KB x 128 activation rows)
work items, N-major, with the same contiguous ranges and stealing as the GEMV. For the formats
whose values take more than a mask and a shift to unpack (Q5_*: a masked add per vector; Q6_K:
a shift and a ternary-logic op), a work item first decodes its chunk's values once into a
per-thread buffer of bytes (``decode_groups``, the B-packing step of a GEMM; kept while the
thread's next items share the chunk), and the 4-row tiles load them instead of decoding them
again: Q5_0 1.04-1.21x, Q6_K 1.02-1.12x at 64-512 rows (Q4_* decode in about what the extra
stores and loads cost, and keep decoding per tile). Every output
element goes through the same float operations in the same order as in the small-M path, so
the GEMM equals it bit for bit (tests/layers/test_gguf_kernels.py checks that for every
format, both ISAs, M remainders, N not a multiple of 16, bias, bfloat16, strided ``out``).

Speed: ``python -m benchmarks.gguf_kernels`` (packed against stored rows and dense bfloat16 in
one run; ``--baseline-repo PATH`` adds another checkout's packed kernel, interleaved, and
``--prefill MODEL --baseline-repo PATH`` the end-to-end prefill with each; docs/benchmarks.md).

Every row count takes the packed kernel, so a row's result does not depend on the other rows
of the call (a prompt's on what the scheduler batched with it). Until session 37 calls of 4096
rows and more expanded exact dequantized tiles for PyTorch's GEMM, which round differently
(two 2,100-token prompts of a tiny Q8_0 model batched against one at a time: prompt logprobs
0.042 nat apart) and were slower anyway: one thread, 4096 rows, the tiles took 1.3-3.5x the
packed kernel's time on AVX-512 VNNI and 1.2-6.4x with the AVX2 build (Q5_0 896 x 896, Q8_0
4864 x 896, Q4_K 1536 x 1536; float32 and bfloat16; docs/benchmarks.md, session 37).

The C++ source is ``kvflow/ops/csrc/gguf_matmul.cpp`` (built by ``kvflow.ops.build``, switch
``KVFLOW_CPU_GGUF``); until it is built, or with it off, :func:`gguf_linear` dequantizes to
float32 and calls ``F.linear`` (the reference path).
"""

from __future__ import annotations

import gguf
import torch
import torch.nn.functional as F

from kvflow import huge_pages, ops

Q = gguf.GGMLQuantizationType

SUPPORTED_QTYPES: frozenset[gguf.GGMLQuantizationType] = frozenset(
    (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K))
"""The GGUF block formats this module computes as stored."""

_EXTENSION = ops.GGUF_MATMUL



def _qtype(qtype) -> gguf.GGMLQuantizationType:
    try:
        qt = Q(qtype)
    except ValueError:
        raise ValueError(f"qtype: {qtype!r} is not a GGML quantization type") from None
    if qt not in SUPPORTED_QTYPES:
        raise ValueError(f"qtype: {qt.name} is not supported (supported: "
                         f"{', '.join(sorted(t.name for t in SUPPORTED_QTYPES))})")
    return qt


def block_layout(qtype) -> tuple[int, int]:
    """(elements per block, bytes per block) of a supported format.

    Raises:
        ValueError: naming an unsupported or unknown type.
    """
    return gguf.GGML_QUANT_SIZES[_qtype(qtype)]


def row_bytes(qtype, k: int) -> int:
    """Bytes of one stored row of ``k`` elements.

    Raises:
        ValueError: for an unsupported type, or when k is not a positive multiple of the block.
    """
    size, nbytes = block_layout(qtype)
    if k <= 0 or k % size:
        raise ValueError(f"k: {k} is not a positive multiple of {Q(qtype).name}'s block of {size} elements")
    return k // size * nbytes


# The packed layout's super-block per format (kvflow/ops/csrc/gguf_matmul.cpp's PFmt):
# (elements, bits of a value, has a minimum, scale kind: 0 none, 1 K-quant u8 scale + min, 2 Q6_K int8).
_PACKED_FORMAT = {
    Q.Q4_0: (32, 4, False, 0), Q.Q4_1: (32, 4, True, 0), Q.Q5_0: (32, 5, False, 0), Q.Q5_1: (32, 5, True, 0),
    Q.Q8_0: (32, 8, False, 0), Q.Q4_K: (256, 4, True, 1), Q.Q5_K: (256, 5, True, 1), Q.Q6_K: (256, 6, False, 2),
}


def packed_shape(qtype, n: int, k: int) -> tuple[int, int]:
    """The shape of ``GGUFWeight.pack``'s result for an [n, k] weight of ``qtype``: (row groups
    of 16, bytes of one group's row of super-blocks), as the C++ layout
    (``kvflow/ops/csrc/gguf_matmul.cpp``, "The interleaved layout") makes it.

    Raises:
        ValueError: for an unsupported type, or when k is not a positive multiple of the block.
    """
    qt = _qtype(qtype)
    row_bytes(qt, k)  # checks k
    sb, bits, has_m, scales = _PACKED_FORMAT[qt]
    if k % sb:
        raise ValueError(f"k: {k} is not a multiple of {qt.name}'s super-block of {sb} elements")
    sub = (32 if scales else 0) + (512 if bits == 8 else 256 + {5: 64, 6: 128}.get(bits, 0))
    return -(-n // 16), k // sb * ((64 if has_m else 32) + sb // 32 * sub)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 (little-endian IEEE half) -> [..., 1] float32."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., B] uint8 -> [..., 2B]: the B low nibbles, then the B high nibbles."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _bits(b: torch.Tensor, count: int) -> torch.Tensor:
    """[..., B] uint8 -> [..., count, B] uint8: bit j of each byte at index j."""
    shifts = torch.arange(count, dtype=torch.uint8).view(count, 1)
    return (b.unsqueeze(-2) >> shifts) & 1


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 packed bytes [..., 12] -> 6-bit scales and mins [..., 8] (uint8)."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mn


def _dequantize_blocks(b: torch.Tensor, qt: gguf.GGMLQuantizationType) -> torch.Tensor:
    """b: uint8 [..., bytes per block] -> float32 [..., elements per block], the operations
    (and their float32 rounding) of ``gguf.quants``."""
    if qt == Q.Q8_0:
        return _f16(b[..., 0:2]) * b[..., 2:34].view(torch.int8).float()
    if qt in (Q.Q4_0, Q.Q4_1):
        off = 2 if qt == Q.Q4_0 else 4
        q = _nibbles(b[..., off:off + 16])
        if qt == Q.Q4_0:
            return _f16(b[..., 0:2]) * (q.to(torch.int8) - 8).float()
        return _f16(b[..., 0:2]) * q.float() + _f16(b[..., 2:4])
    if qt in (Q.Q5_0, Q.Q5_1):
        off = 2 if qt == Q.Q5_0 else 4
        qh = _bits(b[..., off:off + 4], 8).transpose(-1, -2).reshape(*b.shape[:-1], 32)
        q = _nibbles(b[..., off + 4:off + 20]) | (qh << 4)
        if qt == Q.Q5_0:
            return _f16(b[..., 0:2]) * (q.to(torch.int8) - 16).float()
        return _f16(b[..., 0:2]) * q.float() + _f16(b[..., 2:4])
    lead = b.shape[:-1]
    if qt in (Q.Q4_K, Q.Q5_K):
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, mn = _k_scale_min(b[..., 4:16])
        ds = (d * sc.float()).unsqueeze(-1)  # [..., 8, 1]
        dm = (dmin * mn.float()).unsqueeze(-1)
        qs = b[..., 48:176] if qt == Q.Q5_K else b[..., 16:144]
        ql = qs.reshape(*lead, 4, 1, 32) >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)
        q = (ql & 0x0F).reshape(*lead, 8, 32)
        if qt == Q.Q5_K:
            q = q | (_bits(b[..., 16:48], 8) << 4)
        return (ds * q.float() - dm).reshape(*lead, 256)
    if qt == Q.Q6_K:
        ql = b[..., 0:128].reshape(*lead, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)
        ql = (ql & 0x0F).reshape(*lead, 8, 32)
        qh = b[..., 128:192].reshape(*lead, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)
        qh = (qh & 0x03).reshape(*lead, 8, 32)
        q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(*lead, 16, 16).float()
        scales = b[..., 192:208].view(torch.int8).float()
        d = (_f16(b[..., 208:210]) * scales).unsqueeze(-1)  # [..., 16, 1]
        return (d * q).reshape(*lead, 256)
    raise ValueError(f"qtype: {qt.name} is not supported")  # unreachable: _qtype checked it


def dequantize(raw: torch.Tensor, qtype, k: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Expand stored GGUF rows to floats (pure PyTorch, vectorized).

    Args:
        raw: uint8 [N, row_bytes(qtype, k)] on the CPU, each row contiguous (the row stride
            may be larger: a column slice).
        qtype: a type of ``SUPPORTED_QTYPES``.
        k: elements per row.
        dtype: the result's dtype (computed in float32, rounded once).

    Returns:
        [N, k] in dtype, bit-exact against ``gguf.quants.dequantize`` in float32.

    Raises:
        ValueError: naming an unsupported qtype, a k that is not a multiple of the block, or
            a raw of another dtype or shape.
    """
    qt = _qtype(qtype)
    nbytes = row_bytes(qt, k)
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != nbytes:
        raise ValueError(f"raw: expected uint8 [N, {nbytes}] for {qt.name} rows of {k} elements, "
                         f"got {raw.dtype} {list(raw.shape)}")
    size, bpb = gguf.GGML_QUANT_SIZES[qt]
    n = raw.shape[0]
    if n == 0:
        return torch.empty(0, k, dtype=dtype)
    blocks = raw.reshape(n, k // size, bpb)
    return _dequantize_blocks(blocks, qt).reshape(n, k).to(dtype)


class GGUFWeight:
    """A GGUF-quantized weight [n, k] as stored (rows = output features).

    Holds ``raw``, uint8 [n, row_bytes(qtype, k)] with contiguous rows: the caller's tensor
    (for instance memory-mapped file data) or a view of it, never a copy. The C++ kernel
    reads this layout directly (it is not repacked), so every method works at any time,
    before and after the kernel becomes available.

    Args:
        raw: uint8 [n, row_bytes(qtype, k)], rows contiguous (stride(1) == 1).
        qtype: a type of ``SUPPORTED_QTYPES``.
        n: output features (rows).
        k: input features (elements per row), a multiple of the format's block.

    Raises:
        ValueError: naming the field: an unsupported qtype, a k that is not a multiple of
            the block, n < 1, or a raw whose dtype, shape or strides disagree.
    """

    def __init__(self, raw: torch.Tensor, qtype, n: int, k: int) -> None:
        qt = _qtype(qtype)
        nbytes = row_bytes(qt, k)
        if n < 1:
            raise ValueError(f"n: {n} output rows; at least 1")
        if not isinstance(raw, torch.Tensor) or raw.dtype != torch.uint8 or raw.device.type != "cpu":
            raise ValueError(f"raw: expected a uint8 CPU tensor, got "
                             f"{getattr(raw, 'dtype', type(raw).__name__)} on {getattr(raw, 'device', '?')}")
        if raw.dim() != 2 or tuple(raw.shape) != (n, nbytes):
            raise ValueError(f"raw: expected shape [{n}, {nbytes}] ({qt.name}, n={n}, k={k}), got {list(raw.shape)}")
        if raw.stride(1) != 1 or (n > 1 and raw.stride(0) < nbytes):
            raise ValueError(f"raw: rows must be contiguous (strides {raw.stride()})")
        self._raw: torch.Tensor | None = raw
        self.qtype, self.n, self.k = qt, n, k
        #: The rows in the kernel's interleaved layout (``pack``), or None.
        self.packed: torch.Tensor | None = None
        #: Whether the kernel's lazy ``pack`` drops ``raw`` (the weight is then held once; a
        #: caller that needs the stored rows often, not just their product, clears it).
        self.release_raw_on_pack = True

    @property
    def raw(self) -> torch.Tensor:
        """uint8 [n, row_bytes]: the stored rows (after ``pack(release_raw=True)``, a fresh
        byte-exact copy rebuilt from the packed layout at each access)."""
        if self._raw is not None:
            return self._raw
        return _EXTENSION.require().gguf_unpack(self.packed, int(self.qtype), self.n, self.k)

    def pack(self, release_raw: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
        """Build ``packed`` once: the rows interleaved 16 at a time for the C++ kernel's GEMV and
        small-M GEMM (layout: ``kvflow/ops/csrc/gguf_matmul.cpp``; same bytes as stored, K-quants
        + 4 bytes per 256 elements), in huge-page memory (``kvflow.huge_pages``: a decode step
        streams every weight) unless ``out`` is given. ``release_raw`` drops the stored rows
        afterwards (``raw`` then unpacks on access), so the weight is held once.

        Args:
            release_raw: drop the stored rows once packed.
            out: where to write the packed rows (uint8 ``packed_shape(qtype, n, k)``,
                contiguous), e.g. a slice of a larger packed weight.

        Returns:
            The packed uint8 tensor [ceil(n / 16), group bytes].

        Raises:
            RuntimeError: when the C++ kernel is not available.
        """
        if self.packed is None:
            if out is None:
                out = huge_pages.empty(packed_shape(self.qtype, self.n, self.k))
            self.packed = _EXTENSION.require().gguf_pack_fast(self._raw, int(self.qtype), self.n, self.k, out)
        if release_raw:
            self._raw = None
        return self.packed

    def __repr__(self) -> str:
        return f"GGUFWeight({self.qtype.name}, n={self.n}, k={self.k})"

    @property
    def block_size(self) -> int:
        """Elements per block of the format."""
        return gguf.GGML_QUANT_SIZES[self.qtype][0]

    @property
    def nbytes(self) -> int:
        """Bytes this weight holds: the stored blocks it spans (n * row_bytes) unless
        released, plus the packed layout where built."""
        held = 0 if self._raw is None else self._raw.shape[0] * self._raw.shape[1]
        return held + (0 if self.packed is None else self.packed.numel())

    @property
    def shape(self) -> tuple[int, int]:
        """(n, k)."""
        return (self.n, self.k)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as floats, [n, k] in dtype (see :func:`dequantize`)."""
        return dequantize(self.raw, self.qtype, self.k, dtype)

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` (int64 [T], values in [0, n)) dequantized: [T, k] in dtype.

        Raises:
            ValueError: ids not a 1-D integer tensor; IndexError: an id out of range.
        """
        if ids.dim() != 1 or ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"ids: expected int64 [T], got {ids.dtype} {list(ids.shape)}")
        module = _EXTENSION.load() if self._raw is not None else _EXTENSION.require()
        if module is None:
            return dequantize(self._raw[ids], self.qtype, self.k, dtype)
        # The C++ kernel: float32 or bfloat16 from one rounding of the float32 values, as
        # dequantize (its pure-PyTorch expansion of one Q4_K row took ~0.13 ms a decode step).
        out = torch.empty(ids.numel(), self.k, dtype=dtype if dtype == torch.bfloat16 else torch.float32)
        if self._raw is not None:
            rows = self._raw[ids]  # (IndexError out of range)
            module.gguf_dequantize(rows, int(self.qtype), rows.shape[0], self.k, out)
        else:  # packed only: each id's row gathered from its group (IndexError out of range)
            module.gguf_embedding(self.packed, ids.long().contiguous(), int(self.qtype), self.n, self.k, out)
        return out if out.dtype == dtype else out.to(dtype)

    def narrow_rows(self, start: int, length: int) -> GGUFWeight:
        """Rows [start, start + length) as a weight sharing this one's storage.

        Raises:
            ValueError: naming start/length when the range is empty or outside [0, n).
        """
        if length < 1 or start < 0 or start + length > self.n:
            raise ValueError(f"narrow_rows: start={start}, length={length} outside the {self.n} rows")
        return GGUFWeight(self.raw[start:start + length], self.qtype, length, self.k)

    def narrow_cols(self, start: int, length: int) -> GGUFWeight:
        """Columns [start, start + length) in whole blocks, sharing this one's storage (the
        rows of the result are strided).

        Raises:
            ValueError: naming the sizes when start or length is not a multiple of the
                block, or the range is empty or outside [0, k).
        """
        size, bpb = gguf.GGML_QUANT_SIZES[self.qtype]
        if start % size or length % size:
            raise ValueError(f"narrow_cols: start={start} and length={length} must be multiples of "
                             f"{self.qtype.name}'s block of {size} elements (k={self.k})")
        if length < 1 or start < 0 or start + length > self.k:
            raise ValueError(f"narrow_cols: start={start}, length={length} outside the {self.k} columns")
        raw = self.raw[:, start // size * bpb:(start + length) // size * bpb]
        return GGUFWeight(raw, self.qtype, self.n, length)

    @staticmethod
    def cat_rows(parts: list[GGUFWeight]) -> GGUFWeight:
        """The parts' rows one after the other (a copy), e.g. a fused QKV from Q, K and V.

        Raises:
            ValueError: for no parts, or parts that differ in qtype or k.
        """
        if not parts:
            raise ValueError("parts: at least one weight")
        qt, k = parts[0].qtype, parts[0].k
        for p in parts:
            if p.qtype != qt or p.k != k:
                raise ValueError(f"parts: all must share qtype and k; got {p.qtype.name} k={p.k} "
                                 f"after {qt.name} k={k}")
        raw = torch.cat([p.raw for p in parts], dim=0)
        return GGUFWeight(raw, qt, raw.shape[0], k)

    @classmethod
    def packed_cat_rows(cls, parts: list[GGUFWeight]) -> GGUFWeight:
        """``cat_rows(parts)`` packed (``pack(release_raw=True)``) without the joined copy of
        the stored rows: each part is packed straight into its row groups of one buffer and
        its stored rows dropped (parts before the last must hold whole groups of
        ``gguf_pack_rows()`` rows, else this falls back to ``cat_rows`` and one pack). The
        same bytes as the pack of the joined rows; a 1.5B model's QKV and gate/up were
        copied once more at every start for the join.

        Args:
            parts: weights of one qtype and one k (e.g. Q, K, V), in row order.

        Returns:
            A weight of ``sum(p.n)`` rows x ``k`` whose ``packed`` is uint8
            ``packed_shape(qtype, n, k)`` on huge pages (layout: ``kvflow/ops/csrc/gguf_matmul.cpp``)
            and whose stored rows are not held (``raw`` unpacks on access); the parts are left
            packed into slices of it, their stored rows dropped.

        Raises:
            ValueError: as ``cat_rows``; RuntimeError: when the C++ kernel is not available.
        """
        group = int(_EXTENSION.require().gguf_pack_rows())
        if len(parts) == 1:
            return parts[0].pack_and_get(release_raw=True)
        if any(p.n % group for p in parts[:-1]) or any(p.packed is not None for p in parts):
            return cls.cat_rows(parts).pack_and_get(release_raw=True)
        qt, k = parts[0].qtype, parts[0].k
        if any(p.qtype != qt or p.k != k for p in parts):
            cls.cat_rows(parts)  # raises, naming the mismatch
        n = sum(p.n for p in parts)
        packed = huge_pages.empty(packed_shape(qt, n, k))
        start = 0
        for p in parts:
            p.pack(release_raw=True, out=packed[start:start + -(-p.n // group)])
            start += -(-p.n // group)
        joined = cls.__new__(cls)  # (no stored rows to validate: ``raw`` unpacks on access)
        joined._raw, joined.qtype, joined.n, joined.k = None, qt, n, k
        joined.packed, joined.release_raw_on_pack = packed, True
        return joined

    def pack_and_get(self, release_raw: bool = False) -> GGUFWeight:
        """``pack(release_raw)``, returning the weight itself."""
        self.pack(release_raw=release_raw)
        return self


def kernel_available(qtype=None) -> bool:
    """Whether the C++ kernel is built and published (without starting a build when a
    background build is pending) and computes ``qtype`` (any supported type when None)."""
    if qtype is not None:
        try:
            _qtype(qtype)
        except ValueError:
            return False
    return _EXTENSION.load() is not None


def kernel_isa() -> str | None:
    """The instruction set of the built kernel's integer products (``"avx512_vnni"``,
    ``"avx2"`` or ``"scalar"``), None when it is not available."""
    module = _EXTENSION.load()
    return None if module is None else module.gguf_isa()


def gguf_linear(x: torch.Tensor, w: GGUFWeight, bias: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) with W the stored GGUF weight.

    Args:
        x: [M, k] float32 or bfloat16 on the CPU, rows contiguous (stride(1) == 1).
        w: the weight [n, k].
        bias: optional [n] (any float dtype; added in float32).
        out: optional [M, n] of x's dtype with contiguous rows (it may be a column slice of
            a wider buffer); the result is written into it and returned.

    Returns:
        [M, n] in x's dtype. With the kernel: int8-quantized activations (blocks of 32),
        integer block products, float32 accumulation (see the module docstring). Without it:
        float32 dequantized weight and ``F.linear`` in float32.

    Raises:
        ValueError: naming x, bias or out when their shape, dtype or layout disagree.
    """
    if x.dim() != 2 or x.shape[1] != w.k or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"x: expected float32/bfloat16 [M, {w.k}], got {x.dtype} {list(x.shape)}")
    m = x.shape[0]
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != w.n):
        raise ValueError(f"bias: expected [{w.n}], got {list(bias.shape)}")
    if out is not None and (tuple(out.shape) != (m, w.n) or out.dtype != x.dtype or (m and out.stride(1) != 1)):
        raise ValueError(f"out: expected {x.dtype} [{m}, {w.n}] with contiguous rows, got "
                         f"{out.dtype} {list(out.shape)} strides {out.stride()}")
    module = _EXTENSION.load()
    if (module is not None and m > 0 and x.device.type == "cpu"
            and not (torch.is_grad_enabled() and x.requires_grad)):
        xc = x if x.stride(1) == 1 else x.contiguous()
        y = out if out is not None else torch.empty(m, w.n, dtype=x.dtype)
        packed = w.packed if w.packed is not None else w.pack(release_raw=w.release_raw_on_pack)
        module.gguf_linear_packed(xc, packed, int(w.qtype), w.n, w.k,
                                  None if bias is None else bias.float().contiguous(), y)
        return y
    y = F.linear(x.float(), w.dequantize(torch.float32), None if bias is None else bias.float())
    if out is not None:
        out.copy_(y)
        return out
    return y.to(x.dtype)
