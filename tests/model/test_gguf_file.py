"""kvflow.model.gguf_file: the header (metadata without the vocabulary, tensor table) and the tensors' bytes, against gguf.GGUFReader."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from kvflow.model.gguf_file import read_header, read_tensor_infos
from model.test_resolve import write_tiny_gguf
from tests.conftest import requires_smollm2


def _same_as_reader(path) -> int:
    infos = read_tensor_infos(path)
    reader = gguf.GGUFReader(path)
    assert [i.name for i in infos] == [t.name for t in reader.tensors]
    with open(path, "rb", buffering=0) as file:
        for info, tensor in zip(infos, reader.tensors):
            assert info.shape == tuple(int(d) for d in tensor.shape), info.name
            assert info.tensor_type == tensor.tensor_type, info.name
            assert (info.data_offset, info.n_elements, info.n_bytes) == (
                int(tensor.data_offset), int(tensor.n_elements), int(tensor.n_bytes)), info.name
            data = info.read(file)
            assert data.dtype == tensor.data.dtype and data.shape == tensor.data.shape, info.name
            assert np.array_equal(data, tensor.data), info.name
    return len(infos)


def test_tensor_infos_and_bytes_equal_the_readers(tmp_path):
    path = tmp_path / "tiny.gguf"
    expected = write_tiny_gguf(path, "qwen2")  # F32 and Q8_0 tensors, a tokenizer in the metadata
    assert _same_as_reader(path) == len(expected)


@requires_smollm2
def test_smollm2_file_equals_the_readers():
    from kvflow.model import packages

    assert _same_as_reader(packages.locate_parts(packages.lookup("smollm2-135m"))[0]) == 272


def test_truncated_and_corrupt_files_name_the_file(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "llama")
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 100])  # the last tensor's data is cut
    with pytest.raises(ValueError, match=r"cut.gguf is not a readable GGUF file .*ends past the end of the file"):
        read_tensor_infos(cut)
    cut.write_bytes(data[:200])  # inside the metadata
    with pytest.raises(ValueError, match="cut.gguf is not a readable GGUF file"):
        read_tensor_infos(cut)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + data[4:])
    with pytest.raises(ValueError, match="no GGUF magic"):
        read_tensor_infos(bad)
    bad.write_bytes(data[:4])  # the magic alone: it said "no GGUF magic"
    with pytest.raises(ValueError, match="bad.gguf is not a readable GGUF file .*4 bytes, shorter than a GGUF header"):
        read_tensor_infos(bad)


def _header_same_as_reader(path) -> None:
    header = read_header(path)
    reader = gguf.GGUFReader(path)
    string_arrays = {key for key, f in reader.fields.items()
                     if f.types and f.types[0] == gguf.GGUFValueType.ARRAY and f.types[-1] == gguf.GGUFValueType.STRING}
    assert string_arrays and set(header.string_arrays) == string_arrays  # the vocabulary is skipped...
    for key in string_arrays:
        assert header.string_arrays[key] == len(reader.fields[key].data), key  # ...and counted
    header_fields = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}  # the reader's own
    assert set(header.metadata) == set(reader.fields) - string_arrays - header_fields
    for key, value in header.metadata.items():
        expected = reader.fields[key].contents()
        assert value == expected and type(value) is type(expected), key
    assert [i.name for i in header.tensors] == [t.name for t in reader.tensors]


def test_header_values_equal_the_readers(tmp_path):
    path = tmp_path / "tiny.gguf"

    def more(writer: gguf.GGUFWriter) -> None:  # one of each value kind the vocabulary lacks
        writer.add_bool("test.flag", True)
        writer.add_float64("test.f64", 0.1)
        writer.add_int8("test.i8", -3)
        writer.add_array("test.ints", [1, -2, 3])
        writer.add_array("test.floats", [0.5, 0.25])

    write_tiny_gguf(path, "qwen2", configure=more)
    _header_same_as_reader(path)


@requires_smollm2
def test_smollm2_header_equals_the_readers():
    from kvflow.model import packages

    _header_same_as_reader(packages.locate_parts(packages.lookup("smollm2-135m"))[0])


def _mapping_of(address: int) -> str:
    """The path /proc/self/maps gives for the mapping holding ``address`` ('' for anonymous)."""
    for line in open("/proc/self/maps"):
        fields = line.split()
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= address < hi:
            return fields[5] if len(fields) > 5 else ""
    raise AssertionError(f"{address:#x} is not mapped")


def test_map_views_the_file_without_copying_it(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "llama")
    infos = [i for i in read_tensor_infos(path) if i.tensor_type == gguf.GGMLQuantizationType.Q8_0]
    assert infos
    with open(path, "rb", buffering=0) as file:
        for info in infos:
            mapped = info.map(file)
            assert np.array_equal(mapped, info.read(file)) and mapped.flags.writeable, info.name
            assert _mapping_of(mapped.ctypes.data) == str(path), info.name  # the file's pages, not a copy
            mapped[0, 0] ^= 0xFF  # private: the file is not written
        assert np.array_equal(infos[0].map(file), infos[0].read(file))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: infos[-1].data_offset + 10])
    with open(cut, "rb", buffering=0) as file, pytest.raises(ValueError, match="truncated"):
        infos[-1].map(file)
