"""Every third-party package kvflow imports is a declared runtime dependency (issue #31:
``LLM(gpu_memory_utilization=...)`` failed with ``ModuleNotFoundError: psutil`` on a fresh
install because psutil was only in the ``bench`` extra).

The imports are read from the source with ``ast`` (module level and inside functions, since a
lazy import fails the same way when its function runs); each top-level module is mapped to
its distribution with ``importlib.metadata.packages_distributions`` and looked up in
``[project].dependencies`` of pyproject.toml.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Imported only behind a check that it is installed, with a fallback when it is not.
OPTIONAL = {
    "triton": "the CUDA attention kernels; kvflow.attention.triton_attention checks find_spec('triton') first",
    "ray": "kvflow.entrypoints.ray_serve only (the Ray Serve deployment, the `ray` extra); nothing imports it",
}


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_dependencies() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {_normalize(re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0]) for req in project["dependencies"]}


def imported_modules() -> dict[str, str]:
    """Top-level third-party module -> one file of kvflow that imports it."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / "kvflow").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top != "kvflow" and top not in sys.stdlib_module_names:
                    found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def test_every_import_is_a_declared_dependency():
    declared = declared_dependencies()
    distributions = importlib.metadata.packages_distributions()
    missing = []
    for module, where in imported_modules().items():
        if module in OPTIONAL:
            continue
        dists = {_normalize(d) for d in distributions.get(module, [module])}
        if not dists & declared:
            missing.append(f"{module} (imported by {where}; distribution {sorted(dists)})")
    assert not missing, f"imported but not in [project].dependencies: {missing}"
