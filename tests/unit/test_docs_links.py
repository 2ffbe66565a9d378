"""Every relative link in README.md and docs/*.md points to a file of the repository, and every #anchor to a
heading of the page it names (GitHub's heading ids). No network, no shardtune import."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Pages other helpers write on their own branches, merged beside this one (issue 19): a link to them is checked
# once the page exists. Empty this set when they are on main.
WRITTEN_ELSEWHERE = {"docs/security.md", "docs/data-formats.md"}

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*```")


def _prose(text: str) -> str:
    """The page without its fenced code blocks (a shell line like `[ -f x ](y)` is not a link)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return "\n".join(lines)


def _anchor(heading: str) -> str:
    """GitHub's id for a heading: lowercase, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_anchor(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", _prose(page.read_text()), re.M)}


def _links(page: Path) -> list[str]:
    return [t for t in LINK.findall(_prose(page.read_text())) if not re.match(r"[a-z]+:", t)]


def test_the_pages_exist_and_have_a_title_and_an_intro():
    assert len(PAGES) > 10
    for page in PAGES[1:]:
        lines = page.read_text().splitlines()
        assert lines[0].startswith("# "), f"{page.name}: first line is not a title"
        assert lines[1] == "" and lines[2] and not lines[2].startswith("#"), f"{page.name}: no intro paragraph"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        rel = dest.relative_to(ROOT).as_posix() if dest.is_relative_to(ROOT) else str(dest)
        if not dest.exists():
            if rel not in WRITTEN_ELSEWHERE:
                broken.append(f"{target}: no such file")
            continue
        if anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with id {anchor!r} in {rel}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_anchor_rule_is_githubs():
    assert (
        _anchor("Many nodes: time limits and preemption, no hangs") == "many-nodes-time-limits-and-preemption-no-hangs"
    )
    assert _anchor("`shardtune doctor`") == "shardtune-doctor"
    assert (
        _anchor("Sharding, precision and the effective batch: DDP, FSDP2")
        == "sharding-precision-and-the-effective-batch-ddp-fsdp2"
    )
