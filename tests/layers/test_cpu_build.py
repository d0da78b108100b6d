"""InlineExtension: build once, or fall back (None) when disabled or when the build fails."""

from __future__ import annotations

import logging

from kvflow.layers.cpu_build import InlineExtension

_GOOD = """
#include <torch/extension.h>
int64_t twice(int64_t x) { return 2 * x; }
"""


def test_disabled_by_environment_variable(monkeypatch):
    monkeypatch.setenv("KVFLOW_TEST_EXT", "0")
    ext = InlineExtension("kvflow_test_disabled", _GOOD, ["twice"], "KVFLOW_TEST_EXT", "test kernel")
    assert ext.load() is None
    monkeypatch.setenv("KVFLOW_TEST_EXT", "1")
    assert ext.load() is None  # decided once


def test_build_failure_falls_back_with_a_warning(caplog, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    ext = InlineExtension("kvflow_test_broken", _GOOD + "this is not C++;", ["twice"], "KVFLOW_TEST_EXT", "test kernel")
    with caplog.at_level(logging.WARNING, logger="kvflow.layers.cpu_build"):
        assert ext.load() is None
    assert "test kernel could not be built" in caplog.text
    assert ext.load() is None


def test_name_hashes_source_and_cpu():
    a = InlineExtension("kvflow_x", _GOOD, ["twice"], "E", "k")
    b = InlineExtension("kvflow_x", _GOOD + "\n", ["twice"], "E", "k")
    assert a.build_name().startswith("kvflow_x_") and a.build_name() != b.build_name()
    assert a.build_name() == InlineExtension("kvflow_x", _GOOD, ["twice"], "E", "k").build_name()


def test_name_changes_with_the_cpu(monkeypatch):
    """A build for one CPU's instruction set is never loaded on another."""
    import kvflow.layers.cpu_build as cb

    ext = InlineExtension("kvflow_x", _GOOD, ["twice"], "E", "k")
    monkeypatch.setattr(cb, "host_cpu_flags", lambda: "flags : fpu sse2 avx2")
    avx2 = ext.build_name()
    monkeypatch.setattr(cb, "host_cpu_flags", lambda: "flags : fpu sse2 avx2 avx512f")
    assert ext.build_name() != avx2


def test_require_raises_when_unavailable(monkeypatch):
    import pytest

    monkeypatch.setenv("KVFLOW_TEST_EXT", "0")
    ext = InlineExtension("kvflow_test_required", _GOOD, ["twice"], "KVFLOW_TEST_EXT", "test kernel")
    with pytest.raises(RuntimeError, match="kvflow's test kernel is not available"):
        ext.require()
