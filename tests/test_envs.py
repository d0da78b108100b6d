"""kvflow.envs: every KVFLOW_* switch is read there (name, type, default, effect), parsed the
way each has always been, and docs/envs.md is the page generated from the module."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from kvflow import envs

ROOT = Path(__file__).resolve().parents[1]


def _environ_reads(tree: ast.AST) -> list[int]:
    """Lines reading the process environment directly: ``os.environ.get(...)``,
    ``os.environ[...]`` (load), ``... in os.environ``, ``os.getenv(...)``."""
    def is_environ(node):
        return isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name) \
            and node.value.id == "os"

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if (f.attr == "get" and is_environ(f.value)) or (
                    f.attr == "getenv" and isinstance(f.value, ast.Name) and f.value.id == "os"):
                lines.append(node.lineno)
        elif isinstance(node, ast.Subscript) and is_environ(node.value) and isinstance(node.ctx, ast.Load):
            lines.append(node.lineno)
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) \
                and any(is_environ(c) for c in node.comparators):
            lines.append(node.lineno)
    return lines


def test_only_envs_reads_the_environment():
    offenders = []
    for path in sorted((ROOT / "kvflow").rglob("*.py")):
        if path.name == "envs.py" and path.parent.name == "kvflow":
            continue
        offenders += [f"{path.relative_to(ROOT)}:{n}" for n in _environ_reads(ast.parse(path.read_text()))]
    assert not offenders, "read the environment through kvflow.envs: " + ", ".join(offenders)


def test_checker_sees_each_form_of_read():
    code = ("import os\na = os.environ.get('X')\nb = os.environ['X']\nc = 'X' in os.environ\n"
            "d = os.getenv('X')\nos.environ['Y'] = '1'\n")
    assert _environ_reads(ast.parse(code)) == [2, 3, 4, 5]


def test_every_switch_named_in_the_package_is_in_the_table():
    """A KVFLOW_* name in kvflow's Python code or docstrings (envs.py aside) is a switch of
    kvflow.envs (none documented that does not exist), and every switch is used there."""
    names = set()
    for path in (ROOT / "kvflow").rglob("*"):
        if path.suffix == ".py" and path != ROOT / "kvflow" / "envs.py":
            names |= set(re.findall(r"\bKVFLOW_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    assert names - set(envs.SWITCHES) == set()
    assert set(envs.SWITCHES) - names == set()


def test_docs_envs_md_is_generated_from_envs():
    """docs/envs.md is ``envs.markdown()`` exactly: a switch added, changed or removed in
    envs.py without regenerating the page fails here."""
    regenerate = "python -c 'from kvflow.envs import markdown; print(markdown(), end=\"\")' > docs/envs.md"
    assert (ROOT / "docs" / "envs.md").read_text() == envs.markdown(), f"docs/envs.md is stale; run: {regenerate}"


def test_envs_markdown_lists_every_variable():
    page = envs.markdown()
    for name in [*envs.SWITCHES, *envs.EXTERNAL]:
        assert f"| `{name}` |" in page, name
    assert "from kvflow.envs import markdown; print(markdown(), end=" in page  # how to regenerate it


def test_switches_are_read_when_asked(monkeypatch):
    monkeypatch.delenv("KVFLOW_CPU_MARCH", raising=False)
    assert envs.KVFLOW_CPU_MARCH == "native"
    monkeypatch.setenv("KVFLOW_CPU_MARCH", "x86-64-v3")
    assert envs.KVFLOW_CPU_MARCH == "x86-64-v3"
    monkeypatch.setenv("KVFLOW_CPU_MARCH", "")
    assert envs.KVFLOW_CPU_MARCH == "native"
    with pytest.raises(AttributeError):
        envs.KVFLOW_NO_SUCH_SWITCH  # noqa: B018


@pytest.mark.parametrize("text, on_by_default, off_by_default", [
    (None, True, False), ("0", False, False), ("1", True, True), ("", True, False), ("yes", True, False),
])
def test_booleans_keep_their_meaning(text, on_by_default, off_by_default):
    """On by default: only "0" turns it off. Off by default: only "1" turns it on."""
    environ = {} if text is None else {"KVFLOW_CPU_KERNELS": text, "KVFLOW_QUIET": text}
    assert envs.read("KVFLOW_CPU_KERNELS", environ) is on_by_default
    assert envs.read("KVFLOW_QUIET", environ) is off_by_default


def test_kernel_switch_and_the_all_kernels_switch(monkeypatch):
    monkeypatch.delenv("KVFLOW_CPU_KERNELS", raising=False)
    monkeypatch.delenv("KVFLOW_CPU_NORM", raising=False)
    assert envs.cpu_kernel_enabled("KVFLOW_CPU_NORM")
    monkeypatch.setenv("KVFLOW_CPU_NORM", "0")
    assert not envs.cpu_kernel_enabled("KVFLOW_CPU_NORM") and envs.cpu_kernel_enabled("KVFLOW_CPU_ROTARY")
    monkeypatch.setenv("KVFLOW_CPU_KERNELS", "0")
    assert not envs.cpu_kernel_enabled("KVFLOW_CPU_ROTARY")


@pytest.mark.parametrize("text", ["0", "-3", "inf", "nan", "soon"])
def test_collective_timeout_refuses_what_it_cannot_use(text):
    with pytest.raises(ValueError, match=f"KVFLOW_COLLECTIVE_TIMEOUT_S must be a positive number of seconds, got '{text}'"):
        envs.read("KVFLOW_COLLECTIVE_TIMEOUT_S", {"KVFLOW_COLLECTIVE_TIMEOUT_S": text})
    assert envs.read("KVFLOW_COLLECTIVE_TIMEOUT_S", {"KVFLOW_COLLECTIVE_TIMEOUT_S": "2.5"}) == 2.5
    assert envs.read("KVFLOW_COLLECTIVE_TIMEOUT_S", {}) is None


def test_unknown_names_are_refused():
    with pytest.raises(KeyError):
        envs.read("KVFLOW_NO_SUCH_SWITCH")
    with pytest.raises(KeyError):
        envs.is_set("HOME")
    assert envs.is_set("RANK", {"RANK": "0"}) and not envs.is_set("RANK", {})
    assert envs.read("CXX", {}) == "c++" and envs.read("CXX", {"CXX": "clang++"}) == "clang++"


def test_envs_does_not_import_torch():
    """kvflow.cpu_threads reads envs before torch loads (OpenMP's wait policy)."""
    assert not any(isinstance(n, (ast.Import, ast.ImportFrom)) and "torch" in ast.dump(n)
                   for n in ast.walk(ast.parse((ROOT / "kvflow" / "envs.py").read_text())))
