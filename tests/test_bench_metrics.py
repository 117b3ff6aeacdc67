"""bench.traffic.metrics on a hand-made request log with hand-computed answers."""

from __future__ import annotations

import numpy as np
import pytest

from bench.traffic.metrics import RequestRecord, max_rate_meeting, meets_slo, percentile, request_tpot_s, summarize

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here

LOG = [
    RequestRecord(ttft_s=0.1, itls_s=[0.02, 0.03, 0.05], e2e_s=0.2, output_tokens=4, prompt_tokens=10),  # TPOT 33.3 ms
    RequestRecord(ttft_s=0.3, itls_s=[0.01], e2e_s=0.32, output_tokens=2, prompt_tokens=20),  # TPOT 20 ms
    RequestRecord(ttft_s=0.05, itls_s=[], e2e_s=0.05, output_tokens=1, prompt_tokens=30),  # no TPOT
    RequestRecord(ttft_s=None, itls_s=[], e2e_s=None, output_tokens=0, prompt_tokens=40, error="timeout"),
    RequestRecord(ttft_s=0.5, itls_s=[0.1, 0.1], e2e_s=0.7, output_tokens=3, prompt_tokens=50),  # TPOT 100 ms
]


def test_summary_hand_computed():
    s = summarize(LOG, duration_s=2.0, ttft_slo_ms=400, tpot_slo_ms=50)
    assert (s.completed, s.failed) == (4, 1)
    assert s.total_output_tokens == 10 and s.total_input_tokens == 110
    assert s.request_throughput == pytest.approx(2.0)
    assert s.output_throughput == pytest.approx(5.0)
    assert s.total_token_throughput == pytest.approx(60.0)
    # TTFT ms sorted [50, 100, 300, 500]: p90 at position 2.7 -> 300 + 0.7 * 200
    assert (s.ttft_ms.mean, s.ttft_ms.median, s.ttft_ms.p90, s.ttft_ms.p99) == pytest.approx((237.5, 200, 440, 494))
    # TPOT ms [20, 33.33, 100] (the 1-token request has none): p90 at 1.8 -> 33.33 + 0.8 * 66.67
    assert s.tpot_ms.count == 3
    assert (s.tpot_ms.mean, s.tpot_ms.median, s.tpot_ms.p90, s.tpot_ms.p99) == pytest.approx(
        (460 / 9, 100 / 3, 260 / 3, 296 / 3))
    # ITL pooled ms [10, 20, 30, 50, 100, 100]
    assert s.itl_ms.count == 6
    assert (s.itl_ms.mean, s.itl_ms.median, s.itl_ms.p90, s.itl_ms.p99) == pytest.approx((310 / 6, 40, 100, 100))
    # E2E ms sorted [50, 200, 320, 700]
    assert (s.e2el_ms.mean, s.e2el_ms.median, s.e2el_ms.p90, s.e2el_ms.p99) == pytest.approx((317.5, 260, 586, 688.6))
    assert s.ttft_ms.std == pytest.approx(np.std([100, 300, 50, 500]))
    # SLO: A, B, C (no TPOT) meet it; the failed one and E (TTFT 500 ms) do not
    assert s.slo_attainment == pytest.approx(3 / 5)
    assert s.goodput == pytest.approx(1.5)


def test_tpot_and_slo_rules():
    assert request_tpot_s(LOG[0]) == pytest.approx(0.1 / 3)
    assert request_tpot_s(LOG[2]) is None and request_tpot_s(LOG[3]) is None
    assert meets_slo(LOG[2], 50, 1)  # a single token always meets the TPOT SLO
    assert not meets_slo(LOG[3], None, None)  # a failure never does
    assert meets_slo(LOG[0], 100, 100 / 3 + 1e-9)  # both bounds inclusive


def test_percentile_matches_numpy():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100):
        xs = list(rng.exponential(size=n))
        for q in (0, 1, 50, 90, 99, 99.9, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert percentile([], 50) == 0.0


def test_empty_and_derived_duration():
    s = summarize([])
    assert s.completed == 0 and s.ttft_ms.mean == 0.0 and s.request_throughput == 0.0 and s.slo_attainment is None
    recs = [RequestRecord(0.1, [0.1], 0.2, 2, start_s=1.0), RequestRecord(0.1, [0.1], 0.2, 2, start_s=2.0)]
    s = summarize(recs)
    assert s.duration_s == pytest.approx(1.2) and s.request_throughput == pytest.approx(2 / 1.2)


def test_max_rate_meeting():
    sweep = [(3.0, 0.85), (1.0, 0.99), (2.0, 0.95), (4.0, 0.91), (5.0, 0.5)]
    assert max_rate_meeting(sweep) == 4.0
    assert max_rate_meeting(sweep, contiguous=True) == 2.0
    assert max_rate_meeting(sweep, target=0.999) is None
