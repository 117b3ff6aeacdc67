"""``bench.device.e2e`` on the CPU (``--device cpu --quick``: a tiny model, no CUDA graphs but the same static
buffers): every section runs, a child that dies is replaced, and the report's arithmetic is right."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.device.e2e import compare_greedy, table_rows

REPO = Path(__file__).resolve().parents[1]


def test_quick_run_survives_a_crashed_child(tmp_path):
    out, md = tmp_path / "e2e.json", tmp_path / "RESULTS.md"
    md.write_text("# Benchmark results\n\nearlier section\n")
    # one intra-op thread: the checks are on the report, not the timings, and two spinning OpenMP threads on a
    # loaded 2-core machine stretched the run several times over (tests/conftest.py)
    env = {**os.environ, "BENCH_E2E_CRASH_IN": "switch", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "bench.device.e2e", "--device", "cpu", "--quick", "--deadline", "150",
                           "--json", str(out), "--markdown", str(md)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=200)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # the crash is a failure
    data = json.loads(out.read_text())
    by = {(r["section"], r["name"]): r for r in data["results"]}
    assert not by[("switch", "switch")]["ok"] and "died (exit 139)" in by[("switch", "switch")]["error"]
    assert data["failures"] == ["switch/switch"]
    # the sections after the crash ran in a new child (which captured its graphs for decode itself)
    assert by[("decode", "decode B=4 graph")]["ok"] and by[("decode", "decode B=4 graph")]["bucket"] == 4
    assert by[("decode", "decode B=1 eager")]["ms"] > 0
    assert all(by[("sanity", n)]["ok"] for s, n in by if s == "sanity")
    assert by[("prefill", "prefill 1 x 128 tokens")]["flops"] > 0
    # the compiled section (last): one bucket, prefill and mixed steps timed both ways and checked
    assert by[("compiled", "compile bucket 32")]["s"] > 0
    for kind in ("prefill", "mixed"):
        assert by[("compiled", f"{kind} 32 compiled")]["ok"] and by[("compiled", f"{kind} 32 eager")]["ms"] > 0
        check = by[("compiled", f"{kind} 32 check")]
        assert check["ok"] and check["rows_checked"] == 32 and check["rel_err"] < 1e-4
    assert {"copy", "matmul"} <= {n for s, n in by if s == "ceilings"} and data["ceilings"]["gbps"] > 0
    text = md.read_text()
    assert text.startswith("# Benchmark results\n\nearlier section\n\n## ") and "— end to end on cpu" in text
    assert "| decode | decode B=4 graph |" in text and "**Failures:**" in text


@pytest.mark.quick
def test_greedy_comparison_accepts_only_near_ties():
    eager = [[1, 2, 3], [4, 5, 6]]
    gaps = [[1.0, 0.05, 2.0], [1.0, 3.0, 1.0]]
    assert compare_greedy(eager, [[1, 2, 3], [4, 5, 6]], gaps) == {
        "exact": True, "ok": True, "tokens": 6, "matching": 6, "diverged_seqs": 0, "first_divergence": None,
        "worst_divergence": None, "gap_nats": None}
    near = compare_greedy(eager, [[1, 9, 9], [4, 5, 6]], gaps)  # diverges where eager's top-2 gap is 0.05
    assert near["ok"] and not near["exact"] and near["first_divergence"] == (1, 0) and near["matching"] == 4
    far = compare_greedy(eager, [[1, 9, 9], [4, 9, 6]], gaps)  # the second sequence diverges at a 3-nat gap
    assert not far["ok"] and far["worst_divergence"] == (1, 1) and far["gap_nats"] == 3.0 and far["diverged_seqs"] == 2


@pytest.mark.quick
def test_table_floors_use_the_measured_ceilings():
    recs = [
        {"section": "ceilings", "name": "copy", "ok": True, "ms": 2.0, "gbps": 4000.0, "shape": "4 GiB d2d"},
        {"section": "ceilings", "name": "matmul", "ok": True, "ms": 1.7, "tflops": 650.0, "shape": "8192^3"},
        {"section": "decode", "name": "decode B=1 eager", "ok": True, "mode": "eager", "batch": 1, "ms": 8.0,
         "floor_bytes": 16e9},
        {"section": "decode", "name": "decode B=1 graph", "ok": True, "mode": "graph", "batch": 1, "ms": 4.0,
         "floor_bytes": 16e9, "replay_ms": 3.9, "bucket": 1},
        {"section": "prefill", "name": "prefill", "ok": True, "ms": 100.0, "flops": 2 * 7e9 * 4096,
         "layer_params": 7e9, "attn_flops": 1e12},
        {"section": "sanity", "name": "greedy", "ok": False, "error": "tokens differ"},
    ]
    rows = {r[1]: r for r in table_rows(recs, {"gbps": 4000.0, "tflops": 650.0})}
    assert rows["decode B=1 graph"][2:6] == ["4.000 ms", "4.000 ms", "100%", "ok"]  # 16 GB at 4000 GB/s = 4 ms
    assert "2.00x vs eager" in rows["decode B=1 graph"][6] and rows["decode B=1 eager"][4] == "50%"
    ideal = 2 * 7e9 * 4096 / 650e12 * 1e3
    assert rows["prefill"][3] == f"{ideal:.2f} ms" and rows["prefill"][4] == f"{100 * ideal / 100:.0f}%"
    assert rows["greedy"][5] == "FAIL" and "tokens differ" in rows["greedy"][6]
    assert table_rows(recs[2:3], {})[0][3:5] == ["—", "—"]  # no ceiling measured: no floor
    base = {"section": "compiled", "ok": True, "kind": "mixed", "tokens": 512, "flops": 2 * 7e9 * 512,
            "floor_bytes": 16e9, "shape": "32 decode rows"}
    comp = [{**base, "name": "mixed 512 eager", "mode": "eager", "ms": 20.0},
            {**base, "name": "mixed 512 compiled", "mode": "compiled", "ms": 8.0},
            {"section": "compiled", "name": "mixed 512 check", "ok": False, "mode": "check", "rows_checked": 256,
             "matching": 255, "rel_err": 0.004, "first_diff_row": 7, "first_diff_gap_nats": 0.5, "error": "not a tie"}]
    rows = {r[1]: r for r in table_rows(comp, {"gbps": 4000.0, "tflops": 650.0})}
    floor = max(2 * 7e9 * 512 / 650e12 * 1e3, 4.0)  # compute 11.0 ms against 16 GB at 4000 GB/s
    assert rows["mixed 512 compiled"][2:5] == ["8.00 ms", f"{floor:.2f} ms", f"{100 * floor / 8:.0f}%"]
    assert "2.50x vs eager" in rows["mixed 512 compiled"][6]
    assert rows["mixed 512 check"][2] == "255/256 rows' tokens equal" and "first differing row 7" in rows["mixed 512 check"][6]
    assert rows["mixed 512 check"][5] == "FAIL"


def test_switch_section_switches_through_the_engine():
    """The ``switch`` section's three switches run through a :class:`DeviceEngine` (which drives an engine
    handle, not a bare runner) and the second decode switch reuses the graphs the first one captured."""
    from test_cuda_graphs import attach, make_runner

    from bench.device.e2e import _switches

    runner = make_runner(max_model_len=64, num_blocks=8)
    graphs = attach(runner, max_model_len=64, max_num_seqs=1)  # one bucket: a fast capture
    (first, cap1), (back, _), (again, cap3) = _switches(runner, "cpu:0")
    assert [(r.from_role, r.to_role) for r in (first, back, again)] == [("prefill", "decode"), ("decode", "prefill"),
                                                                        ("prefill", "decode")]
    assert graphs.captured and cap1 == cap3  # captured once, by the first switch
