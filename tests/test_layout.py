"""The test tree's own rule: test modules are imported by their basename (pytest's default
``prepend`` import mode, no ``__init__.py`` in the test folders), so two test files with one
basename stop the whole collection ("import file mismatch")."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path


def test_no_two_test_files_share_a_basename():
    root = Path(__file__).parent
    seen: dict[str, list[str]] = defaultdict(list)
    for path in root.rglob("*.py"):
        if "__pycache__" not in path.parts:
            seen[path.name].append(str(path.relative_to(root)))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1 and name not in ("__init__.py", "conftest.py")}
    assert not clashes, clashes
