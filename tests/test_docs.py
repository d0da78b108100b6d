"""The README and docs/ as a user of the repository reads them."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _ci_command() -> str:
    lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("pip install")]
    assert len(lines) == 1
    return lines[0]


def test_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    commands = [line for line in re.findall(r"```bash\n(.*?)\n```", readme, re.S) if "pytest" in line]
    assert commands == [_ci_command()]


def test_ci_installs_the_browser_the_readme_names():
    """The browser test's Chromium: .ci/run installs the packages the README names."""
    packages = "chromium chromium-driver"
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(rf"apt-get install -y (-qq )?{packages}", ci)
    assert f"apt-get install -y {packages}" in (ROOT / "README.md").read_text()


def test_ci_runs_the_fallback_passes():
    command = _ci_command()
    assert "KVFLOW_CPU_KERNELS=0 python -m pytest" in command
    assert "KVFLOW_CPU_MARCH=x86-64-v3" in command and "ONEDNN_MAX_CPU_ISA=AVX2" in command



def test_docs_link_nothing_outside_the_repository():
    """Users have the repository only: no ../shared, and every relative link resolves."""
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        assert "../shared" not in text, path
        for target in re.findall(r"\]\(([^)#\s]+)", text):
            if "://" in target or target.startswith("mailto:"):
                continue
            assert (path.parent / target).exists(), f"{path.name} links {target}, which does not exist"
