"""The house rule on size: no Python file of ``node/`` is over 400 lines (one concept per file; a file that
grows past it is split by concept, not cut in half), and ``DeviceEngine`` is composed of parts rather than
mixed in from other files (issue 47, item 5)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 400


def _lines(path: Path) -> int:
    """Lines as ``wc -l`` counts them (newlines; a last line without one counts too)."""
    data = path.read_bytes()
    return data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)


def test_no_file_of_node_is_over_400_lines():
    files = sorted((ROOT / "node").rglob("*.py"))
    assert len(files) > 100  # the package is there (a wrong root would pass vacuously)
    over = {str(f.relative_to(ROOT)): n for f in files if (n := _lines(f)) > MAX_LINES}
    assert over == {}, f"split these by concept: {over}"


def test_the_line_count_matches_wc(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\ny = 2\n")
    (tmp_path / "b.py").write_text("x = 1\ny = 2")
    assert _lines(tmp_path / "a.py") == 2 and _lines(tmp_path / "b.py") == 2


def test_the_engine_and_the_adaptive_policy_have_no_mixins():
    """Each concern is an attribute the class builds (its state owned there), not a base class whose methods
    read state another file defines."""
    from node.core.adaptive import AdaptiveScheduler
    from node.core.mixed_placement import MixedPlacement
    from node.runtime.engine import DeviceEngine

    assert DeviceEngine.__mro__ == (DeviceEngine, object)
    assert MixedPlacement not in AdaptiveScheduler.__mro__
