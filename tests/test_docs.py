"""The README and docs/: short enough to read, and every relative link lands on a file and heading that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.processes import ROOT

README_MAX_LINES = 150
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_BLOCK = re.compile(r"^```.*?^```", re.M | re.S)


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = CODE_BLOCK.sub("", page.read_text())
    return {_anchor(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


def _relative_links(page: Path) -> list[str]:
    text = CODE_BLOCK.sub("", page.read_text())
    return [target for target in LINK.findall(text) if not re.match(r"[a-z]+:", target)]


def test_the_readme_is_short_enough_to_read_in_one_go():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move detail into docs/"


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / target.split("#")[0]).resolve() for target in _relative_links(ROOT / "README.md")}
    assert {page.resolve() for page in PAGES[1:]} <= linked


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves_to_a_file_and_heading(page: Path):
    broken = []
    for target in _relative_links(page):
        path, _, anchor = target.partition("#")
        destination = (page.parent / path).resolve() if path else page
        if not destination.exists():
            broken.append(f"{target}: no such file")
        elif anchor and destination.suffix == ".md" and anchor not in _anchors(destination):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"
