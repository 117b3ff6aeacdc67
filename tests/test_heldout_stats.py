"""The held-out and shifting-traffic studies' own code (issue 43 items 5 and 6) on tiny inputs: arrival
processes, thinning one request set to every rate, steady-state goodput, paired ratio intervals, the shifting
trace. No simulation runs here (the studies' runs are archived under bench/results/)."""

from __future__ import annotations

import math
import statistics

import pytest

from bench.studies.heldout import request_pool, requests_at
from bench.studies.seed_stats import ratio_interval, steady_metrics, t_quantile
from bench.studies.shifting import good_by_segment, summarize
from bench.traffic.arrivals import gamma_gaps, rescaled, spread_buckets, thin, thin_by, with_arrivals
from bench.traffic.metrics import RequestRecord
from bench.traffic.shifting import diurnal, segment_of, shifting_trace
from bench.traffic.traces import TraceRequest

pytestmark = pytest.mark.quick


def _rows(n: int, gap: float = 1.0) -> list[TraceRequest]:
    return [TraceRequest(i * gap, 100 + i, 10 + i) for i in range(n)]


def test_gamma_gaps_have_mean_one_and_the_asked_cv():
    g = gamma_gaps(40_000, 3.0, seed=1)
    mean = statistics.fmean(g)
    assert mean == pytest.approx(1.0, rel=0.06)
    assert statistics.pstdev(g) / mean == pytest.approx(3.0, rel=0.08)
    assert g[:5] == gamma_gaps(5, 3.0, seed=1) and g[:5] != gamma_gaps(5, 3.0, seed=2)
    poisson = gamma_gaps(40_000, 1.0, seed=1)
    assert statistics.pstdev(poisson) / statistics.fmean(poisson) == pytest.approx(1.0, rel=0.05)
    with pytest.raises(ValueError):
        gamma_gaps(3, 0.0, seed=0)


def test_with_arrivals_and_rescaling_keep_the_requests():
    rows = with_arrivals(_rows(3), [1.0, 3.0], rate_rps=2.0)
    assert [r.arrival_s for r in rows] == [0.0, 0.5, 2.0]
    assert [r.prompt_tokens for r in rows] == [100, 101, 102]
    assert [r.arrival_s for r in rescaled(rows, 2.0)] == [0.0, 1.0, 4.0]
    with pytest.raises(ValueError):
        with_arrivals(_rows(3), [1.0], 1.0)


def test_thinning_keeps_nested_subsets_of_one_request_set():
    rows = _rows(5000)
    half, most = thin(rows, 0.5, seed=3), thin(rows, 0.8, seed=3)
    assert set(map(id, half)) <= set(map(id, most))  # the same requests: a lower rate is a subset
    assert len(half) / len(rows) == pytest.approx(0.5, abs=0.03) and len(most) / len(rows) == pytest.approx(0.8, abs=0.03)
    assert thin(rows, 1.0, seed=3) == rows and thin(rows, 0.0, seed=3) == []
    kept = [r.arrival_s for r in half]
    assert kept[0] < 100 and kept[-1] > 4900  # spread over the whole window, not its first rows
    early = thin_by(rows, lambda t: 1.0 if t < 2500 else 0.0, seed=3)
    assert len(early) == 2500 and max(r.arrival_s for r in early) < 2500
    with pytest.raises(ValueError):
        thin(rows, 1.5, seed=0)


def test_spread_buckets_moves_each_request_inside_its_bucket():
    rows = [TraceRequest(0.0, 1, 1)] * 50 + [TraceRequest(3.0, 2, 2)] * 50
    out = spread_buckets(rows, 3.0, seed=0)
    assert all(0.0 <= r.arrival_s < 3.0 for r in out if r.prompt_tokens == 1)
    assert all(3.0 <= r.arrival_s < 6.0 for r in out if r.prompt_tokens == 2)
    assert [r.arrival_s for r in out] == sorted(r.arrival_s for r in out) and len({r.arrival_s for r in out}) == 100


def test_a_pool_thinned_to_each_rate_is_the_same_requests_over_the_same_window():
    pool = request_pool("mooncake-synth", seed=1, size=400, seeds=5)
    assert len(pool) == 400 and pool[0].arrival_s == 0.0
    assert pool[-1].arrival_s == pytest.approx(400.0 * 399 / 400, rel=0.01)  # 1 req/s mean
    assert max(r.prompt_tokens + r.output_tokens for r in pool) <= 32768
    low, end_low = requests_at(pool, "mooncake-synth", 10.0, 20.0, seed=1)
    high, end_high = requests_at(pool, "mooncake-synth", 20.0, 20.0, seed=1)
    assert end_low == end_high == pytest.approx(20.0)  # thinning keeps the window
    assert len(high) == 400 and {(r.prompt_tokens, r.output_tokens) for r in low} <= {(r.prompt_tokens, r.output_tokens) for r in high}
    assert len(low) == pytest.approx(200, abs=35)
    assert request_pool("mooncake-synth", seed=2, size=400, seeds=5)[0] != pool[0]  # seeds: other trace windows
    bursty = request_pool("azure-conv-gamma", seed=0, size=2000, seeds=5)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(bursty, bursty[1:])]
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(3.0, rel=0.25)
    slow, end = requests_at(bursty, "azure-conv-gamma", 50.0, 100.0, seed=0)
    assert len(slow) == 2000 and end == pytest.approx(40.0)  # bursty cells rescale time: CV kept


def _rec(start: float, ttft: float, tokens: int = 11, e2e: float | None = None) -> RequestRecord:
    e2e = ttft + 0.01 * (tokens - 1) if e2e is None else e2e
    return RequestRecord(ttft, [0.01] * (tokens - 1), e2e, tokens, 10, None, start)


def test_steady_metrics_drop_the_warm_up_and_count_failures_as_misses():
    recs = [_rec(0.5, 0.1), _rec(1.0, 0.2), _rec(2.0, 2.0), _rec(3.0, 0.3, e2e=0.3 + 0.2 * 10),
            RequestRecord(None, [], None, 0, 10, "not finished", 4.0), _rec(9.0, 0.1)]
    m = steady_metrics(recs, warmup_s=1.0, end_s=5.0, ttft_slo_ms=1000.0, tpot_slo_ms=50.0)
    # window [1, 5): the 1.0 request (good), 2.0 (TTFT 2 s: late), 3.0 (TPOT 200 ms: slow), 4.0 (failed)
    assert m["requests"] == 4 and m["good"] == 1
    assert m["goodput"] == pytest.approx(1 / 4.0) and m["attainment"] == pytest.approx(0.25)
    assert m["p50_ttft_ms"] == pytest.approx(300.0)  # finished ones: 200, 2000, 300 ms
    with pytest.raises(ValueError):
        steady_metrics(recs, warmup_s=5.0, end_s=5.0, ttft_slo_ms=1.0, tpot_slo_ms=1.0)


def test_ratio_interval_is_a_t_interval_on_log_ratios():
    r = ratio_interval([2.0, 4.0], [2.0, 2.0])  # per-seed ratios 1 and 2
    half = t_quantile(1) * (math.log(2) / math.sqrt(2)) / math.sqrt(2)
    assert r["ratio"] == pytest.approx(math.sqrt(2))
    assert r["low"] == pytest.approx(math.exp(math.log(2) / 2 - half))
    assert r["high"] == pytest.approx(math.exp(math.log(2) / 2 + half)) and r["t_interval"]
    same = ratio_interval([3.0] * 5, [3.0] * 5)
    assert same["ratio"] == same["low"] == same["high"] == pytest.approx(1.0)
    five = ratio_interval([1.0, 1.1, 0.9, 1.05, 0.95], [1.0] * 5)
    assert five["low"] < 1.0 < five["high"] and five["high"] / five["low"] < 1.3
    assert t_quantile(4) == 2.776 and t_quantile(100) == 1.96
    zero = ratio_interval([0.0, 1.0], [1.0, 1.0])
    assert not zero["t_interval"] and zero["low"] == 0.0
    assert ratio_interval([0.0, 2.0], [0.0, 1.0])["n"] == 1  # both zero: left out
    with pytest.raises(ValueError):
        ratio_interval([1.0], [1.0, 2.0])


def test_the_shifting_trace_follows_its_segments_and_the_diurnal_curve():
    assert diurnal(0.0, 100.0) == pytest.approx(0.4) and diurnal(50.0, 100.0) == pytest.approx(1.0)
    assert segment_of(25.0, 10.0, 3) == 2 and segment_of(35.0, 10.0, 3) == 2 and segment_of(0.0, 10.0, 3) == 0
    rates = {"azure-conv": 40.0, "azure-code": 20.0, "mooncake-long": 4.0, "burst": 30.0}
    segs = ("azure-conv", "mooncake-long", "azure-code", "burst")
    reqs = shifting_trace(rates, segments=segs, segment_s=20.0, seed=0)
    assert reqs == shifting_trace(rates, segments=segs, segment_s=20.0, seed=0)
    assert reqs != shifting_trace(rates, segments=segs, segment_s=20.0, seed=1)
    per = [[r for r in reqs if segment_of(r.arrival_s, 20.0, 4) == i] for i in range(4)]
    expect = [rates[k] * statistics.fmean(diurnal(i * 20 + t / 10, 80.0) for t in range(200)) * 20
              for i, k in enumerate(segs)]
    for kind, got, want in zip(segs, per, expect):  # the code trace keeps its bursts (CV 13): a wide spread
        assert 0.3 * want < len(got) < 1.3 * want if kind == "azure-code" else len(got) == pytest.approx(want, rel=0.3)
    assert statistics.fmean(r.prompt_tokens for r in per[1]) > 3 * statistics.fmean(r.prompt_tokens for r in per[0])
    assert statistics.median(r.output_tokens for r in per[2]) < statistics.median(r.output_tokens for r in per[0])
    assert max(r.prompt_tokens + r.output_tokens for r in per[1]) <= 32768
    with pytest.raises(ValueError):
        shifting_trace({"azure-conv": 1.0}, segments=("azure-code",))


def test_shifting_summary_picks_one_static_setting_and_a_per_segment_oracle():
    recs = [_rec(0.5, 0.1), _rec(5.0, 0.1), _rec(15.0, 3.0)]
    assert good_by_segment(recs, segment_s=10.0, segments=2, warmup_s=1.0, ttft_slo_ms=1000.0,
                           tpot_slo_ms=50.0) == [1, 0]
    runs = [{"seed": s, "label": "adaptive", "setting": "-", "good": [9, 9]} for s in (0, 1)]
    runs += [{"seed": s, "label": "colocated", "setting": "A", "good": [10, 2]} for s in (0, 1)]
    runs += [{"seed": s, "label": "colocated", "setting": "B", "good": [3, 10]} for s in (0, 1)]
    runs += [{"seed": s, "label": "pooled", "setting": "P", "good": [5, 5]} for s in (0, 1)]
    out = summarize(runs)
    assert out["best_static"] == "colocated" and out["baselines"]["colocated"]["setting"] == "B"  # 13 > 12
    assert out["oracle_good"] == [20, 20]  # A's first segment, B's second
    assert out["vs_best_static"]["ratio"] == pytest.approx(18 / 13)
    assert out["vs_oracle"]["ratio"] == pytest.approx(18 / 20)


def test_a_cell_summary_pairs_seeds_and_reports_tuning_only_baselines_from_seed_zero():
    from bench.studies.heldout import summarize_cell
    runs = [{"label": lab, "seed": s, "rate": 10.0, "goodput": g, "p90_ttft_ms": t}
            for s in range(3) for lab, g, t in (("adaptive", 9.0 + s, 400.0), ("colocated", 10.0 + s, 200.0))]
    cell = {"cell": "8b:x:50:8", "rates": [10.0], "best": {"colocated": "budget", "time-shared": "w"},
            "tuning_only": {"time-shared": 4.5},
            "tuning": [{"label": "time-shared", "setting": "w", "goodput": 4.5, "p90_ttft_ms": 800.0}], "runs": runs}
    rows = {r["baseline"]: r for r in summarize_cell(cell)}
    col = rows["colocated"]
    assert col["seeds"] == 3 and col["adaptive_goodput"] == pytest.approx(10.0) and col["baseline_goodput"] == pytest.approx(11.0)
    want = math.exp(statistics.fmean(math.log((9.0 + s) / (10.0 + s)) for s in range(3)))
    assert col["goodput_ratio"]["ratio"] == pytest.approx(want) and col["goodput_ratio"]["high"] < 1.0
    assert col["ttft_p90_ratio"]["ratio"] == pytest.approx(2.0)
    ts = rows["time-shared (tuning run only)"]
    assert ts["seeds"] == 1 and ts["goodput_ratio"]["ratio"] == pytest.approx(9.0 / 4.5)
    assert ts["ttft_p90_ratio"]["ratio"] == pytest.approx(0.5)


def test_the_table_marks_a_seed_range_that_is_not_a_t_interval():
    """A seed where adaptive served nothing (goodput 0) makes the ratio a median with the seeds' range; the
    table must not print that range in the brackets of a 95 % interval."""
    from bench.studies.heldout import format_table
    runs = [{"label": lab, "seed": s, "rate": 10.0, "goodput": g, "p90_ttft_ms": 500.0}
            for s, ad in enumerate((10.0, 0.0, 11.0)) for lab, g in (("adaptive", ad), ("colocated", 10.0))]
    cell = {"cell": "8b:x:50:8", "rates": [10.0], "best": {"colocated": "budget"}, "tuning_only": {},
            "tuning": [], "runs": runs}
    row = format_table([cell]).splitlines()[-1]
    assert "1.00 (median; range 0.00-1.10)" in row and "[0.00" not in row
    assert "1.00 [1.00, 1.00]" in row  # the TTFT ratio, every seed positive: a t interval as before
