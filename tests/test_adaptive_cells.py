"""bench.studies.adaptive_cells: the bracket read from probes, and the heat map from the recorded cells."""

from __future__ import annotations

import json

import pytest

from bench.studies.adaptive_cells import CELLS, bracket, plot


@pytest.mark.quick
def test_bracket_is_the_largest_passed_and_the_next_failed_factor():
    probes = [{"factor": 0.9, "attainment": 0.94}, {"factor": 0.95, "attainment": 0.89},
              {"factor": 1.1, "attainment": 0.78}]
    assert bracket(probes) == (0.9, 0.95)
    assert bracket([{"factor": 0.95, "attainment": 1.0}, {"factor": 1.1, "attainment": 0.9}]) == (1.1, None)
    assert bracket([{"factor": 0.95, "attainment": 0.5}]) == (0.0, 0.95)


def test_the_recorded_cells_draw_a_heat_map(tmp_path):
    cells = json.loads(CELLS.read_text())["cells"]
    assert all(c["baseline"]["capacity_rps"] > 0 and ("probes" in c or "adaptive_capacity_rps" in c) for c in cells)
    png = plot(CELLS, tmp_path / "h.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
