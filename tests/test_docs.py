"""The README stays a short first page, and the links of the README and of docs/ lead somewhere: every relative
link names a file of the repository and, with a ``#fragment``, a heading of that page (GitHub's anchors)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import List, Set, Tuple

REPO = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def pages() -> List[Path]:
    """The hand-written pages (the generated reports under docs/results/ are not among them)."""
    return [REPO / "README.md", REPO / "examples" / "pile" / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def anchors(page: Path) -> Set[str]:
    """GitHub's heading anchors of ``page``: lower case, punctuation dropped, spaces as hyphens, a repeat
    numbered (``-1``, ``-2``)."""
    seen: dict = {}
    out = set()
    for title in re.findall(r"^#+ +(.+?) *#*$", FENCE.sub("", page.read_text(encoding="utf-8")), re.M):
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(page: Path) -> List[Tuple[str, str]]:
    """(link, what is wrong) for each relative link of ``page`` that leads nowhere."""
    bad = []
    for target in LINK.findall(FENCE.sub("", page.read_text(encoding="utf-8"))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append((target, "no such file"))
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            bad.append((target, f"no heading #{fragment} in {dest.name}"))
    return bad


def test_the_readme_is_at_most_250_lines():
    lines = (REPO / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move reference material to docs/"


def test_every_relative_link_of_the_readme_and_docs_leads_to_a_file_and_heading():
    bad = {str(p.relative_to(REPO)): broken_links(p) for p in pages()}
    assert {k: v for k, v in bad.items() if v} == {}


def test_the_readme_links_every_docs_page():
    linked = {(REPO / t.partition("#")[0]).resolve() for t in LINK.findall((REPO / "README.md").read_text())}
    assert sorted(p.name for p in (REPO / "docs").glob("*.md") if p.resolve() not in linked) == []


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "a.md").write_text("# A page\n\n## Two words\n\n## Two words\n")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md#two-words-1) [file](c.md) [head](a.md#three) [here](#gone) [web](https://x.org/y)\n"
                    "```\n[in code](nowhere.md)\n```\n# B\n")
    assert [t for t, _ in broken_links(page)] == ["c.md", "a.md#three", "#gone"]
