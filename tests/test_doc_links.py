"""Every relative link of the README, docs/ and the results pages points to a file that exists, and every
``#anchor`` to a heading (or ``<a id>``) of its target page, so a move or a renamed heading cannot leave a
dead link. Anchors are GitHub's: the heading's text lower-cased, punctuation other than ``-`` and ``_``
dropped, spaces turned into ``-``, repeats suffixed ``-1``, ``-2``..."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "bench" / "RESULTS.md",
         *sorted((REPO / "bench" / "results").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1\s*$", re.S | re.M)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s.*)?$", re.M)
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)
HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: markup and punctuation out, lower case, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text only
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors a page defines: its headings' slugs (outside code fences) and its ``<a id>`` names."""
    text = page.read_text()
    found, seen = set(HTML_ANCHOR.findall(text)), {}
    for heading in HEADING.findall(FENCE.sub("", text)):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(page: Path) -> list[str]:
    """Relative link targets of a page, code fences and code spans left out."""
    text = CODE_SPAN.sub("", FENCE.sub("", page.read_text()))
    targets = INLINE.findall(text) + REFERENCE.findall(text)
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]  # http:, https:, mailto: ...


def dead_links(page: Path, root: Path = REPO) -> list[str]:
    """``page: target (why)`` for each link of ``page`` whose file or anchor does not exist (``page`` shown
    relative to ``root``)."""
    dead = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            dead.append(f"{page.relative_to(root)}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            dead.append(f"{page.relative_to(root)}: {target} (no such heading)")
    return dead


def test_slug_follows_github():
    assert slug("2026-11-30 00:30 — kernels on NVIDIA H200") == "2026-11-30-0030--kernels-on-nvidia-h200"
    assert slug("The tuned split (`bench.studies.crossover`)") == "the-tuned-split-benchstudiescrossover"
    assert slug("[Modes](modes.md) and groups") == "modes-and-groups"


def test_checker_sees_dead_links(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Real heading\n")
    page.write_text("[ok](other.md#real-heading) [gone](missing.md) [bad](other.md#nope) `[code](x.md)`\n"
                    "[self](#top)\n# Top\n```\n[fenced](y.md)\n```\n[web](https://example.com)\n")
    assert dead_links(page, tmp_path) == ["page.md: missing.md (no such file)",
                                          "page.md: other.md#nope (no such heading)"]


def test_every_relative_link_resolves():
    assert (REPO / "README.md").exists() and len(PAGES) > 3
    dead = [d for page in PAGES for d in dead_links(page)]
    assert not dead, "dead links:\n" + "\n".join(dead)
