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
    monkeypatch.delenv("KVFLOW_CPU_KERNELS", raising=False)  # (the CI's kernels-off pass sets it)
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


def test_all_kernels_switch(monkeypatch):
    """KVFLOW_CPU_KERNELS=0 keeps every kernel unbuilt, whatever its own variable says."""
    monkeypatch.setenv("KVFLOW_CPU_KERNELS", "0")
    monkeypatch.setenv("KVFLOW_TEST_EXT", "1")
    ext = InlineExtension("kvflow_test_all_off", _GOOD, ["twice"], "KVFLOW_TEST_EXT", "test kernel")
    assert ext.disabled() and ext.load() is None


def test_cflags_follow_the_target(monkeypatch):
    """-march names the host by default or KVFLOW_CPU_MARCH's target (a build for an
    AVX2-only x86 is x86-64-v3); the name of the build follows the flags; the x86-only
    vector-width flag is not given to another architecture's compiler."""
    import kvflow.layers.cpu_build as cb

    ext = InlineExtension("kvflow_x", _GOOD, ["twice"], "E", "k")
    monkeypatch.delenv("KVFLOW_CPU_MARCH", raising=False)
    monkeypatch.setattr(cb.platform, "machine", lambda: "x86_64")
    assert "-march=native" in cb.build_cflags() and "-mprefer-vector-width=512" in cb.build_cflags()
    native = ext.build_name()
    monkeypatch.setenv("KVFLOW_CPU_MARCH", "x86-64-v3")
    assert "-march=x86-64-v3" in cb.build_cflags() and ext.build_name() != native
    monkeypatch.setattr(cb.platform, "machine", lambda: "aarch64")
    monkeypatch.delenv("KVFLOW_CPU_MARCH")
    assert "-march=native" in cb.build_cflags()
    assert not any(f.startswith("-mprefer-vector-width") for f in cb.build_cflags())


class _FakeModule:
    def twice(self, x):
        return 2 * x


def test_a_build_that_is_due_is_announced(monkeypatch, caplog):
    """A cold start says what it is doing (the build itself is replaced by a stub here: a
    real one takes ~20 s); a cached build loads without the message."""
    import torch.utils.cpp_extension as cpp

    monkeypatch.delenv("KVFLOW_CPU_KERNELS", raising=False)
    calls = []
    monkeypatch.setattr(cpp, "load_inline", lambda **kw: calls.append(kw) or _FakeModule())
    for built in (False, True):
        ext = InlineExtension("kvflow_test_announce", _GOOD, ["twice"], "KVFLOW_TEST_EXT", "test kernel")
        monkeypatch.setattr(ext, "is_built", lambda: built)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="kvflow.layers.cpu_build"):
            assert ext.load().twice(3) == 6
        announced = "building the C++ test kernel (once, ~20 s" in caplog.text
        assert announced is not built
    assert len(calls) == 2 and calls[0]["extra_cflags"][-1] == "-fopenmp"


def test_is_built_sees_the_compiled_library(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    ext = InlineExtension("kvflow_test_isbuilt", _GOOD, ["twice"], "KVFLOW_TEST_EXT", "test kernel")
    assert not ext.is_built()
    (tmp_path / ext.build_name()).mkdir(exist_ok=True)  # (torch's helper may have made it)
    assert not ext.is_built()
    (tmp_path / ext.build_name() / f"{ext.build_name()}.so").write_bytes(b"")
    assert ext.is_built()


def test_a_target_beyond_this_cpu_is_refused_naming_the_features(monkeypatch, caplog):
    """KVFLOW_CPU_MARCH=x86-64-v4 on a CPU without AVX-512 (simulated: its flags without
    avx512*) would build a kernel that dies on an illegal instruction: refused, named."""
    import platform as plat

    import kvflow.layers.cpu_build as cb

    if plat.machine().lower() not in ("x86_64", "amd64"):
        import pytest

        pytest.skip("x86 only")
    monkeypatch.setattr(cb, "host_cpu_flags", lambda: "flags : fpu sse4_2 avx avx2 fma f16c")
    assert cb.missing_cpu_features(["-O3", "-march=native"]) == []
    assert cb.missing_cpu_features(["-O3", "-march=x86-64-v3"]) == []
    assert cb.missing_cpu_features(["-O3", "-march=x86-64-v4"]) == ["avx512bw", "avx512dq", "avx512f", "avx512vl"]
    monkeypatch.setenv("KVFLOW_CPU_MARCH", "x86-64-v4")
    monkeypatch.delenv("KVFLOW_CPU_KERNELS", raising=False)
    ext = InlineExtension("kvflow_test_beyond", _GOOD, ["twice"], "KVFLOW_TEST_EXT", "test kernel")
    with caplog.at_level(logging.WARNING, logger="kvflow.layers.cpu_build"):
        assert ext.load() is None
    assert "KVFLOW_CPU_MARCH=x86-64-v4 needs avx512bw, avx512dq, avx512f, avx512vl" in caplog.text
