"""The tuning protocol (bench.sim.tuning): each mode's knob grid, the choice of the best setting, and
``bench.sim --tune`` naming the winner."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.sim import SimConfig
from bench.sim.__main__ import main as sim_main
from bench.sim.tuning import candidates, pick_best, score, setting_of

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here

REPO = Path(__file__).resolve().parents[1]


def test_each_mode_searches_its_own_knobs():
    col = candidates(SimConfig(mode="colocated", devices=2))
    assert [c.max_num_batched_tokens for c in col] == [512, 1024, 2048, 4096, 8192]
    pooled = candidates(SimConfig(mode="pooled", devices=5))
    assert [c.num_prefill_devices for c in pooled] == [1, 2, 3, 4]
    cluster = candidates(SimConfig(mode="pooled", devices=2, nodes=4, pool_scope="cluster"))
    assert [c.num_prefill_nodes for c in cluster] == [1, 2, 3]
    ts = candidates(SimConfig(mode="time-shared", devices=2, max_num_batched_tokens=4096))
    assert len(ts) == 8 and {c.imbalance_threshold for c in ts} == {0.0, 1.0}
    assert {c.max_window_ms for c in ts} == {100.0, 250.0, 500.0, 1000.0}
    assert all(c.max_num_batched_tokens == 4096 and c.devices == 2 for c in ts)  # the rest is the base's
    assert setting_of(col[1]) == "max_num_batched_tokens=1024"
    with pytest.raises(ValueError, match="not SimConfig fields"):
        candidates(SimConfig(mode="colocated"), {"colocated": {"budget": (1,)}})


def _res(goodput, attain, p90):
    return SimpleNamespace(summary=SimpleNamespace(goodput=goodput, slo_attainment=attain,
                                                   ttft_ms=SimpleNamespace(p90=p90)))


def test_the_best_setting_has_the_most_goodput_then_attainment_then_ttft():
    a, b, c, d = (SimConfig(mode="colocated", max_num_batched_tokens=n) for n in (512, 1024, 2048, 4096))
    got = pick_best([(a, _res(5.0, 0.9, 100)), (b, _res(6.0, 0.8, 900)), (c, _res(6.0, 0.9, 500)),
                     (d, _res(6.0, 0.9, 400))])
    assert got[0] is d
    assert score(_res(None, None, float("nan")).summary) == (0.0, 0.0, float("-inf"))
    with pytest.raises(ValueError):
        pick_best([])


def test_sim_cli_tune_reports_one_row_per_mode_with_its_setting(capsys):
    rc = sim_main(["--mode", "colocated,pooled", "--devices", "2", "--trace", "azure-code", "--rate", "2",
                   "--duration", "3", "--cost-model", str(REPO / "bench/cost_models/h200_llama3_8b.json"),
                   "--model-config", str(REPO / "bench/configs/llama3-8b"), "--device-memory-gib", "141",
                   "--max-model-len", "8192", "--tpot-slo-ms", "50", "--table", "--tune"])
    assert rc == 0
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| azure-code")]
    assert len(rows) == 2
    assert "max_num_batched_tokens=" in rows[0] and "(of 5)" in rows[0]
    assert "pooled 1P:1D" in rows[1] and "prefill_devices=1 (of 1)" in rows[1]
