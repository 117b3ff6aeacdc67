"""bench/RESULTS.md stays a page of standing results: every entry (a ``###`` heading) opens with its date,
device and commit (``*Date ... · device: ... · ... commit ...*``) and has a row in the page's Index, so a new
entry cannot be added beside the table of contents without being found from it."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from test_doc_links import slug

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "RESULTS.md"


def entries(text: str) -> list[tuple[str, str]]:
    """(heading, first paragraph after it, its lines joined) of every ``###`` entry outside code fences."""
    lines = re.sub(r"^```.*?^```\s*$", "", text, flags=re.S | re.M).splitlines()
    found = []
    for i, line in enumerate(lines):
        if line.startswith("### "):
            rest = "\n".join(lines[i + 1:]).strip()
            found.append((line[4:].strip(), " ".join(rest.split("\n\n", 1)[0].split())))
    return found


def test_every_entry_has_date_device_commit_and_an_index_row():
    text = RESULTS.read_text()
    index = text[text.index("## Index"):]
    index = index[:index.index("\n## ", 1)]
    found = entries(text)
    assert len(found) > 5
    undated = [h for h, first in found if not re.match(r"^\*Date \d{4}-\d\d-\d\d · device: .+ · .*commit", first)]
    assert not undated, "entries without a '*Date YYYY-MM-DD · device: ... · ... commit `...`' line:\n" + "\n".join(undated)
    missing = [h for h, _ in found if f"(#{slug(h)})" not in index]
    assert not missing, "entries without a row in the Index of bench/RESULTS.md:\n" + "\n".join(missing)


PAGE_LINES = 400  # issue 47: the standing results stay one page; history lives in bench/results/archive-*.md


def test_the_page_stays_a_page_and_each_entry_names_its_command():
    text = RESULTS.read_text()
    assert len(text.splitlines()) <= PAGE_LINES, (
        f"bench/RESULTS.md has {len(text.splitlines())} lines (at most {PAGE_LINES}): move superseded entries to "
        "bench/results/archive-YYYY-MM.md, unchanged, with the reason above each")
    body = re.sub(r"^```.*?^```\s*$", "", text, flags=re.S | re.M)
    sections = re.split(r"^### ", body, flags=re.M)[1:]
    assert len(sections) > 5
    nameless = [s.splitlines()[0] for s in sections
                if not re.search(r"^Command: `[^`]*(python|bash)[^`]*`", s, re.M)]
    assert not nameless, "standing entries without a 'Command: `...`' line:\n" + "\n".join(nameless)


def test_archived_entries_say_why_they_moved():
    """Every entry moved to an archive page carries an italic line above it saying why it no longer stands (or
    that it is the full text of a standing result)."""
    for page in sorted(RESULTS.parent.joinpath("results").glob("archive-*.md")):
        text = re.sub(r"^```.*?^```\s*$", "", page.read_text(), flags=re.S | re.M)
        blocks = re.split(r"^#{2,3} \d{4}-\d\d-\d\d", text, flags=re.M)
        unexplained = [i for i, before in enumerate(blocks[:-1])
                       if not re.search(r"^\*(Archived|Moved)[^\n]*\*\s*$", before.rstrip().rsplit("\n\n", 1)[-1], re.M)]
        assert not unexplained, f"{page.name}: entries {unexplained} have no '*Archived: why*' line above them"
