"""bench/RESULTS.md stays a page of standing results: every entry (a ``###`` heading) opens with its date,
device and commit (``*Date ... · device: ... · ... commit ...*``) and has a row in the page's Index, so a new
entry cannot be added beside the table of contents without being found from it."""
from __future__ import annotations

import re
from pathlib import Path

from test_doc_links import slug

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
