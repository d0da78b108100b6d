"""kvflow.model.gguf_file: the tensor table read without the metadata, against gguf.GGUFReader."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from kvflow.model.gguf_file import read_tensor_infos
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
