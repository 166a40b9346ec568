"""Every relative link in the README and the docs leads somewhere: the file exists, and a ``#anchor``
names a heading of the page it points to (GitHub's heading slugs)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *ROOT.glob("docs/**/*.md"), *ROOT.glob("studies/**/*.md")])
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation other than - and _
    removed, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings, outside code blocks; a repeated heading gets -1, -2, ..."""
    found, seen, fenced = set(), {}, False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        heading = None if fenced else re.match(r"#{1,6} (.*)", line)
        if heading:
            base = slug(heading.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(page.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, fragment = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target} (no such file)")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            broken.append(f"{target} (no heading with that anchor)")
    return broken


def test_the_slug_is_githubs():
    assert slug("The gate at 2,048 tokens over three training runs (2026-11-28, session 55)") == \
        "the-gate-at-2048-tokens-over-three-training-runs-2026-11-28-session-55"
    assert slug("On the best recipe: `fix` vs `dof`") == "on-the-best-recipe-fix-vs-dof"


def test_a_broken_link_is_found(tmp_path):
    (tmp_path / "other.md").write_text("# A heading\n\n```bash\n# not a heading\n```\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#a-heading) [gone](missing.md) [bad](other.md#not-a-heading) [web](https://x.org/#y)")
    assert broken_links(page) == ["missing.md (no such file)", "other.md#not-a-heading (no heading with that anchor)"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = broken_links(page)
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"
