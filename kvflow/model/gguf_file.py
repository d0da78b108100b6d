"""The tensor table of a GGUF file, read without building its metadata.

``gguf.GGUFReader`` turns every metadata value into numpy views; a model whose tokenizer
sits in the file (Qwen2.5: 151,936 tokens and 151,387 merges) costs ~0.4 GiB of Python
objects and seconds to parse that way, before the first weight is read. Loading the weights
needs only the tensor infos, so ``read_tensor_infos`` walks the header (skipping every
metadata value by its length) and returns them; the tensors' bytes are then read with
``pread`` one at a time (``GGUFTensorInfo.read``).

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
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

# value type -> byte size of a scalar (GGUFValueType: UINT8 0 ... FLOAT64 12; STRING 8 and
# ARRAY 9 are sized as they are read)
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
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


def _parse(buf: mmap.mmap, size: int) -> list[GGUFTensorInfo]:
    if buf[:4] != b"GGUF":
        raise ValueError("no GGUF magic")
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

    for _ in range(n_kv):
        key_len = unpack_q(buf, pos)[0]
        key = bytes(buf[pos + 8 : pos + 8 + key_len])
        pos += 8 + key_len
        kind = unpack_i(buf, pos)[0]
        pos += 4
        if key == b"general.alignment" and kind == _UINT32:
            alignment = unpack_i(buf, pos)[0]
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
