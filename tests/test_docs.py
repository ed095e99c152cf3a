"""The README and docs/ stay a short entrance with working links.

README.md is what a newcomer reads first: it stays short, keeps the set-up and test commands that
.ci/run copies, and maps every folder README. Every relative link in README.md, docs/ and the
folder READMEs resolves to a file or folder of the checkout (anchors are not checked).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINES = 250
SKIP_DIRS = {".venv", ".git", "build", "dist", "__pycache__", ".hypothesis", ".pytest_cache"}
# [text](target) or [text](target "title"); images too. Code spans are removed first.
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"`[^`\n]*`")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def markdown_files() -> list[Path]:
    """README.md, every page under docs/ and every folder README of the tree."""
    found = {README, *(ROOT / "docs").rglob("*.md")}
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
        found.update(Path(folder) / name for name in files if name == "README.md")
    return sorted(found)


def links(text: str) -> Iterator[str]:
    """Link targets outside code blocks and code spans."""
    text = CODE_SPAN.sub("", FENCE.sub("", text))
    for match in LINK.finditer(text):
        yield match.group(1)


def is_relative(target: str) -> bool:
    return not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) and not target.startswith("#")


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in links(path.read_text()):
        if not is_relative(target):
            continue
        file_part = target.split("#", 1)[0]
        resolved = (ROOT if file_part.startswith("/") else path.parent) / file_part.lstrip("/")
        if not resolved.exists():
            broken.append(f"{path.relative_to(ROOT)}: {target}")
    return broken


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path) -> None:
    assert broken_links(path) == []


def test_readme_stays_short() -> None:
    lines = README.read_text().count("\n")
    assert lines < MAX_README_LINES, f"README.md has {lines} lines: move detail into docs/"


def test_readme_maps_every_folder_readme() -> None:
    linked = {
        (ROOT / target.split("#", 1)[0]).resolve()
        for target in links(README.read_text())
        if is_relative(target)
    }
    folder_readmes = [p for p in markdown_files() if p.name == "README.md" and p != README]
    assert [str(p.relative_to(ROOT)) for p in folder_readmes if p.resolve() not in linked] == []


def _ci_commands() -> tuple[str, str]:
    """The set-up and test commands .ci/run copies from the README."""
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    setup = lines[lines.index("# --- README: set-up ---") + 1]
    test = lines[lines.index("# --- README: tests ---") + 1]
    return setup, test


def test_ci_runs_the_readme_commands() -> None:
    setup, test = _ci_commands()
    readme_lines = README.read_text().splitlines()
    assert any(line.endswith("&& " + setup) for line in readme_lines), setup
    assert test in readme_lines


def test_the_link_checker_finds_a_broken_link(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("x")
    page = tmp_path / "docs" / "p.md"
    page.write_text(
        "[ok](a.md#part) [web](https://example.com) [here](#x) `[code](nope.md)`\n"
        "```\n[fenced](nope.md)\n```\n[up](../missing/) [gone](b.md)\n"
    )
    assert broken_links(page) == ["docs/p.md: ../missing/", "docs/p.md: b.md"]
