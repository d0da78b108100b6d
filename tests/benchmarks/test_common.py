"""benchmarks.common: what every benchmark records about the machine."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import common


def test_isa_caps_are_recorded_only_when_set(monkeypatch):
    for k in common.ISA_CAPS:
        monkeypatch.delenv(k, raising=False)
    assert common.isa_caps() == {} and common.machine_info()["isa_caps"] == {}
    monkeypatch.setenv("KVFLOW_CPU_MARCH", "x86-64-v3")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert common.machine_info()["isa_caps"] == {"KVFLOW_CPU_MARCH": "x86-64-v3", "ONEDNN_MAX_CPU_ISA": "AVX2"}


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="Linux /proc/cpuinfo")
def test_cpu_isa_lists_the_cpuinfo_flags_in_order():
    flags = set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags")).split(":", 1)[1].split())
    assert common.cpu_isa() == [f for f in common.ISA_FLAGS if f in flags]


def test_cpu_isa_reads_the_flags_line(monkeypatch, tmp_path):
    fake = tmp_path / "cpuinfo"
    fake.write_text("processor\t: 0\nmodel name\t: Test CPU\nflags\t\t: fpu sse2 avx2 fma avx512f\n")
    real_path = common.Path
    monkeypatch.setattr(common, "Path", lambda p: real_path(fake) if p == "/proc/cpuinfo" else real_path(p))
    assert common.cpu_isa() == ["avx2", "fma", "avx512f"] and common.cpu_model() == "Test CPU"
