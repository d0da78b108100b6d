"""The header of a GGUF file (metadata values and tensor table), read without the vocabulary.

``gguf.GGUFReader`` turns every metadata value into numpy views; a model whose tokenizer
sits in the file (Qwen2.5: 151,936 tokens and 151,387 merges) costs ~0.4 GiB of Python
objects and ~20 s to parse that way on a loaded 2-core machine, before the first weight is
read. Loading needs only the tensor infos and the scalar metadata (the config), so
``read_header`` walks the header once, keeps every scalar, string and numeric array, and
skips the string arrays (the vocabulary and merges: the tokenizer reads them itself) by
their lengths; ``read_tensor_infos`` is its tensor table alone. The tensors' bytes are then
read with ``pread`` one at a time (``GGUFTensorInfo.read``).

Layout (the GGUF spec, ggml's ``docs/gguf.md``, versions 2 and 3, little-endian): magic
``GGUF``, u32 version, u64 tensor count, u64 metadata count; each metadata pair is a string
key (u64 length + UTF-8), a u32 value type and the value (arrays: u32 item type, u64 count,
items); each tensor info is a string name, u32 n_dims, u64 dims (ne[0] first: the
contiguous dimension), u32 ``ggml_type``, u64 offset relative to the data section, which
starts at the next multiple of ``general.alignment`` (default 32) after the infos.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np

# value type -> byte size of a scalar (GGUFValueType: UINT8 0 ... FLOAT64 12; STRING 8 and
# ARRAY 9 are sized as they are read)
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
# scalar value type -> struct format (the GGUF spec's GGUFValueType)
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                   12: "<d"}
_NUMPY_FORMATS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
                  12: "<f8"}
_FLOAT_DTYPES = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16}


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor of a GGUF file, as its tensor info says.

    Attributes:
        name: the GGUF name (``blk.0.attn_q.weight``).
        shape: ggml order, ``ne[0]`` (the contiguous dimension) first, like
            ``gguf.ReaderTensor.shape``.
        tensor_type: its ``gguf.GGMLQuantizationType``.
        data_offset: absolute byte offset of its data in the file.
        n_elements: element count.
        n_bytes: stored bytes (``n_elements / block size x type size``).
    """

    name: str
    shape: tuple[int, ...]
    tensor_type: gguf.GGMLQuantizationType
    data_offset: int
    n_elements: int
    n_bytes: int

    def read(self, file) -> np.ndarray:
        """The tensor's bytes read from ``file`` (an unbuffered binary file of this GGUF) with
        one positioned read, in ``gguf.GGUFReader``'s array form: float32/float16 values in
        [ne[-1], ..., ne[0]] for F32/F16, else uint8 [rows..., bytes per row].

        Raises:
            ValueError: the file ends inside the tensor's data (truncated).
        """
        raw = np.empty(self.n_bytes, dtype=np.uint8)
        if os.preadv(file.fileno(), [memoryview(raw)], self.data_offset) != self.n_bytes:
            raise ValueError("the file ends inside the tensor's data (truncated)")
        dims = [int(d) for d in reversed(self.shape)]
        dtype = _FLOAT_DTYPES.get(self.tensor_type)
        if dtype is not None:
            return raw.view(dtype).reshape(dims)
        block, size = gguf.GGML_QUANT_SIZES[self.tensor_type]
        return raw.reshape([*dims[:-1], dims[-1] // block * size])

    def map(self, file) -> np.ndarray:
        """The tensor's bytes as a private (copy-on-write) memory map of ``file``, in
        ``read``'s form, without copying them: pages come from the page cache when first
        touched (by a repack or a dequantize), and the mapping, of this tensor's range only, is
        unmapped when the last array or tensor viewing it is freed. So a weight repacked at
        load and then released holds no second copy, and no whole-file mapping keeps every
        page resident (mapped pages count in the process's RSS).

        Raises:
            ValueError: the file ends inside the tensor's data (truncated).
        """
        start = self.data_offset - self.data_offset % mmap.ALLOCATIONGRANULARITY
        length = self.data_offset + self.n_bytes - start
        if os.fstat(file.fileno()).st_size < start + length:
            raise ValueError("the file ends inside the tensor's data (truncated)")
        mapping = mmap.mmap(file.fileno(), length, access=mmap.ACCESS_COPY, offset=start)
        if hasattr(mapping, "madvise"):
            mapping.madvise(mmap.MADV_WILLNEED)  # read ahead: the repack reads it all, in order
        raw = np.frombuffer(mapping, np.uint8, self.n_bytes, self.data_offset - start)
        dims = [int(d) for d in reversed(self.shape)]
        block, size = gguf.GGML_QUANT_SIZES[self.tensor_type]
        return raw.reshape([*dims[:-1], dims[-1] // block * size])


@dataclass(frozen=True)
class GGUFHeader:
    """What a GGUF file says before its tensor data (``read_header``).

    Attributes:
        path: the file.
        metadata: key -> value, as ``gguf.ReaderField.contents()`` gives it (int, float,
            bool, str; numeric arrays as lists) for every key except string arrays.
        string_arrays: key -> item count of each string array (``tokenizer.ggml.tokens``,
            ``tokenizer.ggml.merges``), whose items are not read.
        tensors: the tensor infos in file order.
    """

    path: Path
    metadata: dict[str, Any]
    string_arrays: dict[str, int] = field(default_factory=dict)
    tensors: list[GGUFTensorInfo] = field(default_factory=list)


def read_header(path: str | os.PathLike[str]) -> GGUFHeader:
    """The metadata (string arrays skipped) and tensor infos of the GGUF file at ``path``;
    no tensor data is read.

    Raises:
        ValueError: not a GGUF file, a big-endian or unknown version, an unknown metadata
            or tensor type, a tensor with a shape its type cannot hold, or a table or tensor
            data past the end of the file (truncated) — naming the file.
    """
    path = Path(path)
    metadata: dict[str, Any] = {}
    string_arrays: dict[str, int] = {}
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
            tensors = _parse(view, len(view), metadata, string_arrays)
    except (struct.error, IndexError, KeyError, UnicodeDecodeError, OverflowError, ValueError) as exc:
        raise ValueError(f"{path} is not a readable GGUF file (truncated or corrupt?): {exc}") from None
    return GGUFHeader(path, metadata, string_arrays, tensors)


def read_tensor_infos(path: str | os.PathLike[str]) -> list[GGUFTensorInfo]:
    """The tensor infos of the GGUF file at ``path``, in file order (no value is read).

    Raises:
        ValueError: not a GGUF file, a big-endian or unknown version, an unknown metadata
            or tensor type, a tensor with a shape its type cannot hold, or a table or tensor
            data past the end of the file (truncated) — naming the file.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
            return _parse(view, len(view))
    except (struct.error, IndexError, KeyError, UnicodeDecodeError, OverflowError, ValueError) as exc:
        raise ValueError(f"{path} is not a readable GGUF file (truncated or corrupt?): {exc}") from None


def _parse(buf: mmap.mmap, size: int, values: dict[str, Any] | None = None,
           string_arrays: dict[str, int] | None = None) -> list[GGUFTensorInfo]:
    """The tensor infos; with ``values`` also every metadata value but string arrays (their
    counts into ``string_arrays``)."""
    if buf[:4] != b"GGUF":
        raise ValueError("no GGUF magic")
    if size < 24:
        raise ValueError(f"{size} bytes, shorter than a GGUF header (24 bytes)")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (byte order or version not supported here)")
    pos = 24
    alignment = 32
    unpack_q, unpack_i = struct.Struct("<Q").unpack_from, struct.Struct("<I").unpack_from

    def skip_value(kind: int, pos: int) -> int:
        if kind == _STRING:
            return pos + 8 + unpack_q(buf, pos)[0]
        if kind == _ARRAY:
            item, count = unpack_i(buf, pos)[0], unpack_q(buf, pos + 4)[0]
            pos += 12
            if item in _SCALAR_SIZES:
                return pos + count * _SCALAR_SIZES[item]
            for _ in range(count):
                pos = skip_value(item, pos)
            return pos
        return pos + _SCALAR_SIZES[kind]

    def read_value(kind: int, pos: int) -> Any:
        if kind == _STRING:
            length = unpack_q(buf, pos)[0]
            if pos + 8 + length > size:
                raise ValueError("a string runs past the end of the file")
            return bytes(buf[pos + 8 : pos + 8 + length]).decode()
        if kind == _ARRAY:
            item, count = unpack_i(buf, pos)[0], unpack_q(buf, pos + 4)[0]
            if item in _NUMPY_FORMATS:
                if pos + 12 + count * _SCALAR_SIZES[item] > size:
                    raise ValueError("an array runs past the end of the file")
                return np.frombuffer(buf, _NUMPY_FORMATS[item], count, pos + 12).tolist()
            raise ValueError(f"array of value type {item}")  # arrays of arrays: not in any GGUF model
        return struct.unpack_from(_SCALAR_FORMATS[kind], buf, pos)[0]

    for _ in range(n_kv):
        key_len = unpack_q(buf, pos)[0]
        key = bytes(buf[pos + 8 : pos + 8 + key_len])
        pos += 8 + key_len
        kind = unpack_i(buf, pos)[0]
        pos += 4
        if kind not in _SCALAR_SIZES and kind not in (_STRING, _ARRAY):
            raise ValueError(f"metadata {key.decode(errors='replace')!r} has unknown value type {kind}")
        if key == b"general.alignment" and kind == _UINT32:
            alignment = unpack_i(buf, pos)[0]
        if values is not None:
            name = key.decode()
            if kind == _ARRAY and unpack_i(buf, pos)[0] == _STRING:
                string_arrays[name] = unpack_q(buf, pos + 4)[0]  # type: ignore[index]
            else:
                values[name] = read_value(kind, pos)
        pos = skip_value(kind, pos)
        if pos > size:
            raise ValueError("the metadata runs past the end of the file")
    raw_infos = []
    for _ in range(n_tensors):
        name_len = unpack_q(buf, pos)[0]
        name = bytes(buf[pos + 8 : pos + 8 + name_len]).decode()
        pos += 8 + name_len
        n_dims = unpack_i(buf, pos)[0]
        shape = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        pos += 4 + 8 * n_dims
        kind, offset = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        raw_infos.append((name, shape, gguf.GGMLQuantizationType(kind), offset))
    if alignment < 1:
        raise ValueError(f"general.alignment {alignment}")
    data_start = -(-pos // alignment) * alignment
    infos = []
    for name, shape, qtype, offset in raw_infos:
        n_elements = int(np.prod(shape, dtype=np.int64)) if shape else 1
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        if shape and shape[0] % block:
            raise ValueError(f"tensor {name!r} ({qtype.name}): ne[0]={shape[0]} is not a multiple of its block of {block}")
        n_bytes = n_elements // block * type_size
        if data_start + offset + n_bytes > size:
            raise ValueError(f"tensor {name!r} ({qtype.name}, shape {list(shape)}) ends past the end of the file")
        infos.append(GGUFTensorInfo(name, tuple(int(d) for d in shape), qtype, data_start + offset, n_elements, n_bytes))
    return infos
