"""CppKernel (kvflow.ops.build): build a source file once, or fall back (None) when disabled
or when the build fails; compiler flags follow KVFLOW_CPU_MARCH and the CPU."""

from __future__ import annotations

import logging
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import kvflow.ops.build as build
from kvflow import ops
from kvflow.ops.build import CppKernel

_GOOD = """
#include <torch/extension.h>
int64_t twice(int64_t x) { return 2 * x; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("twice", &twice); }
"""

# A switch of kvflow.envs that the tests may set freely (CppKernel takes only real switches).
SWITCH = "KVFLOW_CPU_NORM"


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "twice.cpp"
    path.write_text(_GOOD)
    return path


@pytest.fixture(autouse=True)
def _kernels_on(monkeypatch):
    monkeypatch.delenv("KVFLOW_CPU_KERNELS", raising=False)  # (the CI's kernels-off pass sets it)
    monkeypatch.delenv(SWITCH, raising=False)


def test_unknown_switch_is_refused(source):
    with pytest.raises(ValueError, match="'KVFLOW_NO_SUCH' is not a switch of kvflow.envs"):
        CppKernel("kvflow_x", source, "KVFLOW_NO_SUCH", "k")


def test_disabled_by_its_switch(monkeypatch, source):
    monkeypatch.setenv(SWITCH, "0")
    ext = CppKernel("kvflow_test_disabled", source, SWITCH, "test kernel")
    assert ext.load() is None
    monkeypatch.setenv(SWITCH, "1")
    assert ext.load() is None  # decided once


def test_build_failure_falls_back_with_a_warning(caplog, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    broken = tmp_path / "broken.cpp"
    broken.write_text(_GOOD + "this is not C++;")
    ext = CppKernel("kvflow_test_broken", broken, SWITCH, "test kernel")
    with caplog.at_level(logging.WARNING, logger="kvflow.ops.build"):
        assert ext.load() is None
    assert "test kernel could not be built" in caplog.text
    assert ext.load() is None


def test_a_source_file_builds_and_loads(tmp_path, monkeypatch, source):
    """The real mechanism, end to end (one small build into a fresh extensions folder)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    ext = CppKernel("kvflow_test_twice", source, SWITCH, "test kernel")
    assert not ext.is_built()
    assert ext.require().twice(21) == 42
    assert ext.is_built()
    # The next process imports the cached library itself: torch's load (setuptools, ninja) is
    # for builds only. A library that does not import is built again by torch's load.
    import torch.utils.cpp_extension as cpp

    calls = []
    monkeypatch.setattr(cpp, "load", lambda **kw: calls.append(kw) or _FakeModule())
    again = CppKernel("kvflow_test_twice", source, SWITCH, "test kernel")
    assert again.require().twice(4) == 8 and calls == []
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "other"))  # (never the loaded file: SIGBUS)
    broken = CppKernel("kvflow_test_twice", source, SWITCH, "test kernel")
    broken._library().parent.mkdir(parents=True)
    broken._library().write_bytes(b"not a library")
    assert broken.is_built() and broken.require().twice(4) == 8 and len(calls) == 1


def test_the_extensions_folder_and_build_inputs_are_torchs(monkeypatch, tmp_path):
    """build.extensions_dir / build_inputs compute what torch.utils.cpp_extension would (so a
    start need not import it), with and without TORCH_EXTENSIONS_DIR."""
    import torch.utils.cpp_extension as cpp

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    name = "kvflow_test_folder_probe"
    try:
        assert build.extensions_dir() / name == Path(cpp._get_build_directory(name, verbose=False))
    finally:
        (build.extensions_dir() / name).rmdir()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert build.extensions_dir() / name == Path(cpp._get_build_directory(name, verbose=False))
    assert build.build_inputs()[2:5] == [*cpp.include_paths(), *cpp.library_paths()]


def test_name_hashes_source_and_cpu(tmp_path, source):
    a = CppKernel("kvflow_x", source, SWITCH, "k")
    edited = tmp_path / "edited.cpp"
    edited.write_text(_GOOD + "\n")
    b = CppKernel("kvflow_x", edited, SWITCH, "k")
    assert a.build_name().startswith("kvflow_x_") and a.build_name() != b.build_name()
    assert a.build_name() == CppKernel("kvflow_x", source, SWITCH, "k").build_name()
    copy = tmp_path / "copy" / "twice.cpp"  # the same text elsewhere (another install)
    copy.parent.mkdir()
    copy.write_text(_GOOD)
    assert CppKernel("kvflow_x", copy, SWITCH, "k").build_name() != a.build_name()


def test_name_hashes_the_sources_it_includes(tmp_path, source):
    """A kernel that includes another source (fused_decode.cpp includes gguf_matmul.cpp)
    builds again when that source is edited."""
    (tmp_path / "shared.cpp").write_text("// shared routines\n")
    a = CppKernel("kvflow_x", source, SWITCH, "k", includes=("shared.cpp",)).build_name()
    (tmp_path / "shared.cpp").write_text("// shared routines, edited\n")
    assert CppKernel("kvflow_x", source, SWITCH, "k", includes=("shared.cpp",)).build_name() != a
    assert ops.FUSED_DECODE.include_paths == (build.CSRC / "gguf_matmul.cpp", build.CSRC / "paged_attention.cpp",
                                              build.CSRC / "vec_exp.h")


def test_name_changes_with_the_cpu(monkeypatch, source):
    """A build for one CPU's instruction set is never loaded on another."""
    ext = CppKernel("kvflow_x", source, SWITCH, "k")
    monkeypatch.setattr(build, "host_cpu_flags", lambda: "flags : fpu sse2 avx2")
    avx2 = ext.build_name()
    monkeypatch.setattr(build, "host_cpu_flags", lambda: "flags : fpu sse2 avx2 avx512f")
    assert ext.build_name() != avx2


def test_require_raises_when_unavailable(monkeypatch, source):
    monkeypatch.setenv(SWITCH, "0")
    ext = CppKernel("kvflow_test_required", source, SWITCH, "test kernel")
    with pytest.raises(RuntimeError, match="kvflow's test kernel is not available"):
        ext.require()


def test_all_kernels_switch(monkeypatch, source):
    """KVFLOW_CPU_KERNELS=0 keeps every kernel unbuilt, whatever its own variable says."""
    monkeypatch.setenv("KVFLOW_CPU_KERNELS", "0")
    monkeypatch.setenv(SWITCH, "1")
    ext = CppKernel("kvflow_test_all_off", source, SWITCH, "test kernel")
    assert ext.disabled() and ext.load() is None


def test_cflags_follow_the_target(monkeypatch, source):
    """-march names the host by default or KVFLOW_CPU_MARCH's target (a build for an
    AVX2-only x86 is x86-64-v3); the name of the build follows the flags; the x86-only
    vector-width flag is not given to another architecture's compiler."""
    ext = CppKernel("kvflow_x", source, SWITCH, "k")
    monkeypatch.delenv("KVFLOW_CPU_MARCH", raising=False)
    monkeypatch.setattr(build.platform, "machine", lambda: "x86_64")
    assert "-march=native" in build.build_cflags() and "-mprefer-vector-width=512" in build.build_cflags()
    native = ext.build_name()
    monkeypatch.setenv("KVFLOW_CPU_MARCH", "x86-64-v3")
    assert "-march=x86-64-v3" in build.build_cflags() and ext.build_name() != native
    monkeypatch.setattr(build.platform, "machine", lambda: "aarch64")
    monkeypatch.delenv("KVFLOW_CPU_MARCH")
    assert "-march=native" in build.build_cflags()
    assert not any(f.startswith("-mprefer-vector-width") for f in build.build_cflags())


class _FakeModule:
    def twice(self, x):
        return 2 * x


def test_a_build_that_is_due_is_announced(monkeypatch, caplog, source):
    """A cold start says what it is doing (the build itself is replaced by a stub here: a
    real one takes 15-90 s); a cached build loads without the message; the source file and
    the target's flags are what reach torch's ``load``."""
    import torch.utils.cpp_extension as cpp

    calls = []
    monkeypatch.setattr(cpp, "load", lambda **kw: calls.append(kw) or _FakeModule())
    for built in (False, True):
        ext = CppKernel("kvflow_test_announce", source, SWITCH, "test kernel")
        monkeypatch.setattr(ext, "is_built", lambda: built)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="kvflow.ops.build"):
            assert ext.load().twice(3) == 6
        announced = "building the C++ test kernel (once, 15-90 s" in caplog.text
        assert announced is not built
    assert len(calls) == 2 and calls[0]["sources"] == [str(source)]
    assert calls[0]["extra_cflags"] == build.build_cflags() and calls[0]["extra_cflags"][-1] == "-fopenmp"
    assert calls[0]["name"] == ext.build_name()


def test_is_built_sees_the_compiled_library(monkeypatch, tmp_path, source):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    ext = CppKernel("kvflow_test_isbuilt", source, SWITCH, "test kernel")
    assert not ext.is_built()
    (tmp_path / ext.build_name()).mkdir(exist_ok=True)  # (torch's helper may have made it)
    assert not ext.is_built()
    (tmp_path / ext.build_name() / f"{ext.build_name()}.so").write_bytes(b"")
    assert ext.is_built()


def test_a_target_beyond_this_cpu_is_refused_naming_the_features(monkeypatch, caplog, source):
    """KVFLOW_CPU_MARCH=x86-64-v4 on a CPU without AVX-512 (simulated: its flags without
    avx512*) would build a kernel that dies on an illegal instruction: refused, named."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("x86 only")
    monkeypatch.setattr(build, "host_cpu_flags", lambda: "flags : fpu sse4_2 avx avx2 fma f16c")
    assert build.missing_cpu_features(["-O3", "-march=native"]) == []
    assert build.missing_cpu_features(["-O3", "-march=x86-64-v3"]) == []
    assert build.missing_cpu_features(["-O3", "-march=x86-64-v4"]) == ["avx512bw", "avx512dq", "avx512f", "avx512vl"]
    monkeypatch.setenv("KVFLOW_CPU_MARCH", "x86-64-v4")
    ext = CppKernel("kvflow_test_beyond", source, SWITCH, "test kernel")
    with caplog.at_level(logging.WARNING, logger="kvflow.ops.build"):
        assert ext.load() is None
    assert "KVFLOW_CPU_MARCH=x86-64-v4 needs avx512bw, avx512dq, avx512f, avx512vl" in caplog.text


def test_a_target_the_compiler_refuses_is_named_and_not_built(monkeypatch, caplog, source):
    """KVFLOW_CPU_MARCH=znver99 (no such target): each kernel's build ran the compiler and
    failed with a warning holding the start of its command line, never the variable; now it
    is refused before any build, naming KVFLOW_CPU_MARCH and the compiler's complaint."""
    import torch.utils.cpp_extension as cpp

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("x86 only")
    assert build.target_refused(["-O3", "-march=native"]) == ""
    assert build.target_refused(["-O3", "-march=x86-64-v3", "-mprefer-vector-width=512"]) == ""
    assert "znver99" in build.target_refused(["-O3", "-march=znver99"])
    monkeypatch.setenv("KVFLOW_CPU_MARCH", "znver99")
    monkeypatch.setattr(cpp, "load", lambda **kw: pytest.fail("the build ran"))
    ext = CppKernel("kvflow_test_refused_target", source, SWITCH, "test kernel")
    with caplog.at_level(logging.WARNING, logger="kvflow.ops.build"):
        assert ext.load() is None
    assert "refuses KVFLOW_CPU_MARCH=znver99" in caplog.text and "znver99" in caplog.text.split("(", 2)[-1]


def test_every_kernel_source_is_in_the_package_and_bound():
    """Each kernel's .cpp file is in kvflow/ops/csrc and binds its module (PYBIND11_MODULE),
    and every .cpp there belongs to a kernel (none is left unbuilt)."""
    sources = {k.source_path for k in ops.KERNELS}
    assert sources == set(build.CSRC.glob("*.cpp"))
    for kernel in ops.KERNELS:
        assert "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)" in kernel.source, kernel.what


def test_the_sources_are_package_data():
    """pyproject ships kvflow/ops/csrc/*.cpp and the headers they include in the wheel (the
    kernels build from them)."""
    import tomllib
    from fnmatch import fnmatch

    pyproject = tomllib.loads((build.CSRC.parents[2] / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["kvflow"]
    for path in [*build.CSRC.glob("*.cpp"), *build.CSRC.glob("*.h")]:
        rel = path.relative_to(build.CSRC.parents[1]).as_posix()  # ops/csrc/x.cpp
        assert any(fnmatch(rel, p) for p in patterns), rel


def test_every_local_include_is_in_the_build_name():
    """A kernel's build name hashes the files it names in ``includes``: every ``#include
    "x"`` of its source, and of those files in turn, must be among them, or an edit of x
    would load the stale build."""
    import re

    def local_includes(path):
        return set(re.findall(r'^#include "([^"]+)"', path.read_text(), re.MULTILINE))

    for kernel in ops.KERNELS:
        declared = {p.name for p in kernel.include_paths}
        seen, todo = set(), [kernel.source_path]
        while todo:
            for name in local_includes(todo.pop()) - seen:
                seen.add(name)
                todo.append(build.CSRC / name)
        assert seen <= declared, (kernel.what, seen - declared)


class _GatedBuild:
    """Stands in for ``CppKernel._build``: the background build blocks until ``release``."""

    def __init__(self, result):
        self.release, self.result, self.calls = threading.Event(), result, 0

    def __call__(self):
        self.calls += 1
        assert self.release.wait(30)
        return self.result


def test_a_background_build_is_published_between_steps_only(monkeypatch, source):
    """While a background build runs (a fake slow build here), ``load`` returns None at once
    (the PyTorch paths serve); a finished build stays unseen until ``publish``."""
    ext = CppKernel("kvflow_test_background", source, SWITCH, "test kernel")
    monkeypatch.setattr(ext, "is_built", lambda: False)
    fake = _GatedBuild(_FakeModule())
    monkeypatch.setattr(ext, "_build", fake)
    assert build.start_background_builds([ext]) == [ext]
    assert ext.pending() and ext.load() is None and not ext.publish()
    assert build.start_background_builds([ext]) == [ext]  # no second build
    fake.release.set()
    ext._background.wait(30)
    assert ext.load() is None  # built, but not published yet
    assert build.publish_background_builds([ext]) == [ext]
    assert ext.load().twice(4) == 8 and not ext.pending() and fake.calls == 1


def test_a_failed_background_build_keeps_the_pytorch_path(monkeypatch, source):
    ext = CppKernel("kvflow_test_background_fail", source, SWITCH, "test kernel")
    monkeypatch.setattr(ext, "is_built", lambda: False)
    fake = _GatedBuild(None)
    monkeypatch.setattr(ext, "_build", fake)
    build.start_background_builds([ext])
    fake.release.set()
    assert not ext.publish(wait=True)
    assert ext.load() is None and not ext.pending()
    assert fake.calls == 1  # decided once: load() does not try again


def test_a_cached_or_disabled_kernel_is_not_built_in_the_background(monkeypatch, source):
    cached = CppKernel("kvflow_test_cached", source, SWITCH, "test kernel")
    monkeypatch.setattr(cached, "is_built", lambda: True)
    monkeypatch.setattr(cached, "_build", lambda: _FakeModule())
    assert build.start_background_builds([cached]) == []
    assert cached.load().twice(1) == 2  # loaded at once
    monkeypatch.setenv(SWITCH, "0")
    off = CppKernel("kvflow_test_off", source, SWITCH, "test kernel")
    assert build.start_background_builds([off]) == [] and off.load() is None


def test_background_builds_run_one_at_a_time_in_order(monkeypatch, source):
    order, kernels = [], []
    for name in ("first", "second"):
        ext = CppKernel(f"kvflow_test_{name}", source, SWITCH, name)
        monkeypatch.setattr(ext, "is_built", lambda: False)
        fake = _GatedBuild(_FakeModule())
        monkeypatch.setattr(ext, "_build", lambda fake=fake, name=name: order.append(name) or fake())
        kernels.append((ext, fake))
    build.start_background_builds([k for k, _ in kernels])
    (first, first_fake), (second, second_fake) = kernels
    for _ in range(100):
        if order:
            break
        threading.Event().wait(0.05)
    assert order == ["first"]  # the second waits for the first
    first_fake.release.set()
    second_fake.release.set()
    assert second.publish(wait=True) and first.publish(wait=True)
    assert order == ["first", "second"]


def test_a_package_kernel_is_compiled_in_a_child_process(monkeypatch):
    """A background build of one of the package's kernels compiles in ``python -m kvflow.ops
    --nice 10 <source>`` (so that an engine exiting mid-build leaves no stale build lock),
    then loads the cached build in this process."""
    ext = CppKernel("kvflow_test_child", ops.RMS_NORM.source_path, SWITCH, "test kernel")
    runs = []
    monkeypatch.setattr(ext, "is_built", lambda: bool(runs))  # (built once the child ran)
    # (the compiler probes of a KVFLOW_CPU_MARCH other than native run subprocess.run too)
    monkeypatch.setattr(build, "target_refused", lambda cflags: "")
    monkeypatch.setattr(build, "missing_cpu_features", lambda cflags: [])
    monkeypatch.setattr(build.subprocess, "run", lambda cmd, **kw: runs.append((cmd, kw)))
    monkeypatch.setattr(ext, "_import_built", lambda: _FakeModule())
    build.start_background_builds([ext])
    assert ext.publish(wait=True) and ext.load().twice(2) == 4
    (cmd, kw), = runs
    assert cmd[1:] == ["-m", "kvflow.ops", "--nice", "10", "--parent", str(os.getpid()), "rms_norm.cpp"]
    assert kw["start_new_session"]


def test_ops_main_builds_the_named_kernels_only(monkeypatch, capsys):
    from kvflow.ops.__main__ import main

    loaded = []
    for kernel in ops.KERNELS:
        monkeypatch.setattr(kernel, "load", lambda kernel=kernel: loaded.append(kernel) or _FakeModule())
    assert main(["rotary.cpp"]) == 0
    assert loaded == [ops.ROTARY] and "rotary.cpp" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["nope.cpp"])


def test_ops_main_builds_in_parallel_the_largest_first(monkeypatch, capsys):
    """``python -m kvflow.ops --jobs 2``: two builds at once, the largest sources first (the fused
    decode step, which includes the GGUF and attention sources, and the GGUF matmul), so that the
    small ones fill the other job."""
    from kvflow.ops.__main__ import main

    both_running, lock, events = threading.Barrier(2, timeout=30), threading.Lock(), []

    def fake_load(kernel):
        with lock:
            events.append((kernel, threading.get_ident()))
        if kernel in (ops.FUSED_DECODE, ops.GGUF_MATMUL):  # the first two jobs overlap
            both_running.wait()
        return _FakeModule()

    for kernel in ops.KERNELS:
        monkeypatch.setattr(kernel, "load", lambda kernel=kernel: fake_load(kernel))
    assert main(["--jobs", "2"]) == 0
    order, thread = [k for k, _ in events], dict(events)
    assert sorted(order, key=ops.KERNELS.index) == list(ops.KERNELS)
    assert set(order[:2]) == {ops.FUSED_DECODE, ops.GGUF_MATMUL}
    assert thread[ops.FUSED_DECODE] != thread[ops.GGUF_MATMUL]
    assert len(capsys.readouterr().out.splitlines()) == len(ops.KERNELS)


# ---------------------------------------------------------------- issue #31: shared caches
def test_name_covers_torch_python_and_include_paths(monkeypatch, source):
    """Two venvs sharing ~/.cache/torch_extensions: the name covered the source path but not
    torch / Python / include paths, so is_built() said yes and torch rebuilt in the
    foreground. Every input of torch's ninja file is now in the name."""
    import sysconfig

    import torch

    ext = CppKernel("kvflow_x", source, SWITCH, "k")
    base = ext.build_name()
    for target, name, value in [
        (torch, "__version__", "9.9.9"),
        (torch, "__file__", "/other/venv/torch/__init__.py"),  # its include and library paths
        (sys, "version", "3.99.0"),
        (sys, "executable", "/other/venv/bin/python"),
        (sysconfig, "get_paths", lambda *a, **k: {"include": "/other/include/python3.99"}),
    ]:
        with monkeypatch.context() as m:
            m.setattr(target, name, value)
            assert ext.build_name() != base, name
    monkeypatch.setenv("CXX", "clang++")
    assert ext.build_name() != base
    monkeypatch.delenv("CXX")
    assert ext.build_name() == base


def test_a_rebuild_torch_decides_is_announced(monkeypatch, caplog, tmp_path, source):
    """is_built() true, yet torch's load takes long (it found the build out of date): said."""
    import torch.utils.cpp_extension as cpp

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(build, "SLOW_LOAD_S", 0.05)
    for delay, said in ((0.5, True), (0.0, False)):
        monkeypatch.setattr(cpp, "load", lambda delay=delay, **kw: time.sleep(delay) or _FakeModule())
        ext = CppKernel("kvflow_test_rebuild", source, SWITCH, "test kernel")
        monkeypatch.setattr(ext, "is_built", lambda: True)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="kvflow.ops.build"):
            assert ext.load().twice(1) == 2
            time.sleep(0.1)
        assert ("building the C++ test kernel again" in caplog.text) is said, caplog.text


def test_a_stale_torch_build_lock_is_removed(monkeypatch, caplog, tmp_path, source):
    """A builder that died mid-build leaves torch's ``lock``; torch's load would wait on it
    forever. With no live builder (the kvflow builder lock is free) it is removed."""
    import torch.utils.cpp_extension as cpp

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    ext = CppKernel("kvflow_test_stale", source, SWITCH, "test kernel")
    folder = tmp_path / ext.build_name()
    folder.mkdir()
    (folder / "lock").write_text("")
    seen = []
    monkeypatch.setattr(cpp, "load", lambda **kw: seen.append((folder / "lock").exists()) or _FakeModule())
    with caplog.at_level(logging.WARNING, logger="kvflow.ops.build"):
        assert ext.load() is not None
    assert seen == [False] and "stale build lock" in caplog.text


def test_one_builder_per_kernel_per_cache(monkeypatch, caplog, tmp_path, source):
    """While another process holds the kernel's builder lock, a second build waits (saying
    so) instead of starting a second compiler, and never treats the live build's torch lock
    as stale."""
    import fcntl

    import torch.utils.cpp_extension as cpp

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    ext = CppKernel("kvflow_test_sole", source, SWITCH, "test kernel")
    folder = tmp_path / ext.build_name()
    folder.mkdir()
    (folder / "lock").write_text("")  # the live builder's torch lock
    calls = []
    monkeypatch.setattr(cpp, "load", lambda **kw: calls.append(time.monotonic()) or _FakeModule())
    holder = open(folder / "kvflow-builder.lock", "a")
    fcntl.flock(holder, fcntl.LOCK_EX)
    result = []
    with caplog.at_level(logging.INFO, logger="kvflow.ops.build"):
        thread = threading.Thread(target=lambda: result.append(ext.load()))
        thread.start()
        time.sleep(0.5)
        assert not calls and (folder / "lock").exists()  # waiting, the live lock kept
        assert "another process is building the C++ test kernel" in caplog.text
        (folder / "lock").unlink()  # the other builder finishes
        fcntl.flock(holder, fcntl.LOCK_UN)
        holder.close()
        thread.join(10)
    assert result and result[0] is not None and len(calls) == 1


def test_a_builder_ends_with_the_process_that_started_it(tmp_path):
    """``python -m kvflow.ops --parent PID`` outlived its parent (reparented to 1, still
    compiling); now it ends with it, and so does its process group (the compilers)."""
    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    marker = tmp_path / "grandchild.pid"
    code = (
        "import os, subprocess, sys, time\n"
        "from kvflow.ops.build import end_with_parent\n"
        f"end_with_parent({parent.pid}, interval_s=0.1)\n"
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(marker)!r}, 'w').write(str(g.pid))\n"
        "time.sleep(60)\n"
    )
    # (`parent` is not the builder's parent here: it is watched by pid, os.kill(pid, 0))
    builder = subprocess.Popen([sys.executable, "-c", code], start_new_session=True, cwd=os.getcwd())
    try:
        deadline = time.monotonic() + 30
        while not marker.exists() or not marker.read_text():
            assert time.monotonic() < deadline and builder.poll() is None
            time.sleep(0.05)
        grandchild = int(marker.read_text())
        parent.kill()
        parent.wait()
        assert builder.wait(timeout=10) != 0
        deadline = time.monotonic() + 10
        while _alive(grandchild):
            assert time.monotonic() < deadline, "the builder's compiler outlived it"
            time.sleep(0.05)
    finally:
        for p in (parent, builder):
            if p.poll() is None:
                p.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_cpu_flags_are_read_once_a_process(monkeypatch, source):
    """Every build name hashes the CPU's flags; /proc/cpuinfo (~8 ms a read in a VM) is read
    once, not at each of a start's ~50 names."""
    import builtins

    real_open, reads = builtins.open, []

    def counting_open(path, *args, **kwargs):
        if str(path) == "/proc/cpuinfo":
            reads.append(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting_open)
    getattr(build.host_cpu_flags, "cache_clear", lambda: None)()
    ext = CppKernel("kvflow_test_flags", source, SWITCH, "test kernel")
    names = {ext.build_name() for _ in range(5)}
    assert len(names) == 1 and build.host_cpu_flags() == build.host_cpu_flags()
    assert len(reads) == (1 if os.path.exists("/proc/cpuinfo") else 0)


def test_a_cached_build_in_a_folder_that_cannot_be_locked_is_imported(monkeypatch, tmp_path, source):
    """A shared extensions folder this process cannot write (read-only: its builder lock
    cannot be opened) still serves its cached build, as torch's load did; the OSError of the
    lock escaped load() and ended the start."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    ext = CppKernel("kvflow_test_unlockable", source, SWITCH, "test kernel")
    ext._library().parent.mkdir(parents=True)
    ext._library().write_bytes(b"")  # the cached build (imported by the stand-in below)
    # The lock file cannot be opened, as in a read-only folder (the tests may run as root,
    # who writes anywhere): a folder in its place.
    (ext._library().parent / "kvflow-builder.lock").mkdir()
    monkeypatch.setattr(ext, "_import_built", lambda: _FakeModule())
    assert ext.load().twice(4) == 8


def test_a_cached_library_that_does_not_import_is_linked_again(monkeypatch, tmp_path, source):
    """A truncated or foreign library in a build folder is removed before torch's load:
    its ninja finds the library newer than the object file, does nothing, and imports the
    same file again (the kernel was then left on the PyTorch path at every start, the log
    saying it was being built again)."""
    import torch.utils.cpp_extension as cpp

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    ext = CppKernel("kvflow_test_relink", source, SWITCH, "test kernel")
    ext._library().parent.mkdir(parents=True)
    ext._library().write_bytes(b"")  # a zero-byte library: it does not import
    present = []
    monkeypatch.setattr(cpp, "load", lambda **kw: present.append(ext._library().exists()) or _FakeModule())
    assert ext.load().twice(4) == 8 and present == [False]


def test_an_extensions_folder_that_is_a_file_keeps_the_pytorch_path(monkeypatch, caplog, tmp_path, source):
    """TORCH_EXTENSIONS_DIR naming a regular file (a hostile or mistyped value): no build, a
    warning naming the kernel, ``load()`` None (callers keep their PyTorch path), no exception."""
    path = tmp_path / "not-a-folder"
    path.write_text("x")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(path))
    ext = CppKernel("kvflow_test_filedir", source, SWITCH, "test kernel")
    with caplog.at_level(logging.WARNING, logger="kvflow.ops.build"):
        assert not ext.is_built() and ext.load() is None
    assert "test kernel could not be built" in caplog.text


def test_the_child_builder_imports_this_copy_of_kvflow(monkeypatch, tmp_path):
    """The child ``python -m kvflow.ops`` imports the kvflow this process runs, not another
    copy its working directory or environment would find (a script that put a checkout on
    sys.path while another kvflow is installed): else it built the other copy's kernels,
    and this one's build then ran in the engine's process, unniced."""
    import kvflow

    ext = CppKernel("kvflow_test_child", ops.RMS_NORM.source_path, SWITCH, "test kernel")
    runs, run = [], subprocess.run
    # (the compiler probes of a KVFLOW_CPU_MARCH other than native run subprocess.run too)
    monkeypatch.setattr(build, "target_refused", lambda cflags: "")
    monkeypatch.setattr(build, "missing_cpu_features", lambda cflags: [])
    monkeypatch.setattr(build.subprocess, "run", lambda cmd, **kw: runs.append((cmd, kw)))
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.chdir(tmp_path)
    ext._compile_in_subprocess()
    (cmd, kw), = runs
    child = run([sys.executable, "-c", "import kvflow; print(kvflow.__file__)"], env=kw.get("env"), cwd=tmp_path,
                capture_output=True, text=True)
    assert Path(child.stdout.strip()).resolve() == Path(kvflow.__file__).resolve(), child.stderr


def test_a_build_on_first_use_compiles_in_the_child_process(monkeypatch):
    """A package kernel built on its first use (``KVFLOW_CPU_KERNEL_BUILD=wait``, or outside
    an engine) compiles in the builder child too, whose compilers end with this process:
    under torch's load in this process, a server stopped by SIGTERM mid-build left its ninja
    and compiler running, orphaned, and the next start built beside them."""
    import torch.utils.cpp_extension

    ext = CppKernel("kvflow_test_child", ops.RMS_NORM.source_path, SWITCH, "test kernel")
    runs, loads = [], []
    monkeypatch.setattr(ext, "is_built", lambda: bool(runs))
    # (the compiler probes of a KVFLOW_CPU_MARCH other than native run subprocess.run too)
    monkeypatch.setattr(build, "target_refused", lambda cflags: "")
    monkeypatch.setattr(build, "missing_cpu_features", lambda cflags: [])
    monkeypatch.setattr(build.subprocess, "run", lambda cmd, **kw: runs.append((cmd, kw)))
    monkeypatch.setattr(ext, "_import_built", lambda: _FakeModule())
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kw: loads.append(kw) or _FakeModule())
    monkeypatch.setattr(build, "target_refused", lambda cflags: "")
    monkeypatch.setattr(build, "missing_cpu_features", lambda cflags: [])
    assert ext.load().twice(2) == 4
    (cmd, kw), = runs
    assert cmd[1:4] == ["-m", "kvflow.ops", "--nice"] and "--parent" in cmd and kw["start_new_session"]
    assert loads == []  # (no compile in this process)


def test_the_builder_child_compiles_in_its_own_process(monkeypatch):
    """In the builder child (``python -m kvflow.ops --parent PID``) a build runs there, never
    in yet another child."""
    import torch.utils.cpp_extension

    ext = CppKernel("kvflow_test_child", ops.RMS_NORM.source_path, SWITCH, "test kernel")
    runs, loads = [], []
    monkeypatch.setattr(build, "IN_BUILDER_CHILD", True)
    monkeypatch.setattr(ext, "is_built", lambda: False)
    # (the compiler probes of a KVFLOW_CPU_MARCH other than native run subprocess.run too)
    monkeypatch.setattr(build, "target_refused", lambda cflags: "")
    monkeypatch.setattr(build, "missing_cpu_features", lambda cflags: [])
    monkeypatch.setattr(build.subprocess, "run", lambda cmd, **kw: runs.append((cmd, kw)))
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kw: loads.append(kw) or _FakeModule())
    monkeypatch.setattr(build, "target_refused", lambda cflags: "")
    monkeypatch.setattr(build, "missing_cpu_features", lambda cflags: [])
    assert ext.load().twice(2) == 4
    assert runs == [] and len(loads) == 1


def test_ops_main_compiles_in_its_own_process(monkeypatch, capsys):
    """``python -m kvflow.ops`` (with or without ``--parent``) builds in its own process, at
    its own ``--nice``: no builder child of its own, and the flag is restored after."""
    from kvflow.ops.__main__ import main

    seen = []
    for kernel in ops.KERNELS:
        monkeypatch.setattr(kernel, "load", lambda: seen.append(build.IN_BUILDER_CHILD) or _FakeModule())
    assert main(["rotary.cpp"]) == 0
    assert seen == [True] and build.IN_BUILDER_CHILD is False
