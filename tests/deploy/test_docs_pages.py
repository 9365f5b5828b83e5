"""Issue 34.11 and 34.16: the README stays a ten-minute page, and its Markdown renders as meant.

The README keeps what a newcomer needs first (what it is, the quick start, the test command,
the cluster install, asking for a device, where to read on); references live in ``docs/``,
reached by links that resolve. Every Markdown table is one block of rows: a paragraph between
two rows ends the table, and the rows after it render as plain text.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.paths import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1\s*$", re.M | re.S)


def prose(text: str) -> str:
    """The page without its fenced code blocks (their lines are not Markdown)."""
    return FENCE.sub("", text)


def github_anchor(heading: str) -> str:
    """The fragment GitHub gives a heading: lower case, punctuation dropped, spaces as '-'."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    for line in prose(path.read_text()).splitlines():
        heading = re.match(r"#{1,6} (.*)", line)
        if heading:
            slug = github_anchor(heading.group(1))
            n = 1
            unique = slug
            while unique in found:
                unique = f"{slug}-{n}"
                n += 1
            found.add(unique)
    return found


def test_the_readme_is_a_first_ten_minutes_page() -> None:
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 200, "README.md: move reference text into docs/"
    headings = re.findall(r"^## (.*)$", prose(text), re.M)
    for needed in ("Quick start", "Running the tests", "In a cluster", "Asking for a device",
                   "Where to read on"):  # fmt: skip
        assert any(h.startswith(needed) for h in headings), needed
    for page in ("commands", "configuration", "handlers", "troubleshooting", "install"):
        assert f"(docs/{page}.md)" in text, f"README.md does not link docs/{page}.md"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # http(s):, mailto:
        file_part, _, fragment = target.partition("#")
        linked = (page.parent / file_part).resolve() if file_part else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
            broken.append(f"{target}: no heading #{fragment} in {linked.name}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


def table_breaks(text: str) -> list[str]:
    """Lines that look like table rows but are not in a table (a paragraph split the table)."""
    lines = prose(text).splitlines()
    breaks = []
    in_table = False
    for i, line in enumerate(lines):
        row = line.startswith("|") and line.rstrip().endswith("|")
        if row and not in_table:
            delimiter = lines[i + 1] if i + 1 < len(lines) else ""
            if re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", delimiter.strip()):
                in_table = True
            else:
                breaks.append(line[:80])
        elif not row:
            in_table = False
    return breaks


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_table_is_one_block(page: Path) -> None:
    assert table_breaks(page.read_text()) == []


def test_a_split_table_is_found() -> None:
    split = "| a | b |\n|---|---|\n| 1 | 2 |\n\nA paragraph.\n| 3 | 4 |\n"
    assert table_breaks(split) == ["| 3 | 4 |"]
    assert table_breaks("| a | b |\n|---|---|\n| 1 | 2 |\n| 3 | 4 |\n") == []
