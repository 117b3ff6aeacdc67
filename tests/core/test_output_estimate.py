"""The node's running output-length estimate (node.core.output_estimate), shared by the node and the simulator."""

import pytest

from node.core.output_estimate import ASSURED_QUANTILE, MIN_SAMPLES, PRIOR_TOKENS, WINDOW, OutputEstimator

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here


def test_the_prior_until_enough_natural_ends_then_the_windowed_mean_plus_one():
    est = OutputEstimator()
    for _ in range(MIN_SAMPLES - 1):
        est.observe(40)
    assert est.estimate() == PRIOR_TOKENS
    est.observe(40)
    assert est.estimate() == 41
    for i in range(2 * WINDOW):  # the window forgets the old samples
        est.observe(300 + i % 2)
    assert est.estimate() == int((300 * WINDOW / 2 + 301 * WINDOW / 2) / WINDOW) + 1
    assert len(est) == WINDOW


def test_a_sample_is_per_choice_and_the_bound_caps_the_expectation():
    est = OutputEstimator(window=4, prior_tokens=10, min_samples=1)
    est.observe(90, choices=3)
    assert est.estimate() == 31
    assert est.expected(max_tokens=12) == 12 and est.expected(max_tokens=4096) == 31


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError):
        OutputEstimator(window=0)


def test_the_assured_length_is_a_low_quantile_of_the_samples_that_outlived_the_tokens_so_far():
    est = OutputEstimator(window=100, min_samples=5)
    assert est.assured(3, 4096) == 4  # no samples: nothing beyond the next token is assured
    for n in range(1, 101):  # outputs 1..100 (each ends at n + 1 tokens with the stop)
        est.observe(n)
    # a new request: the 10 % quantile of every sample, plus the ending token
    assert est.assured(0, 4096) == 1 + int(ASSURED_QUANTILE * 99) + 1
    # 50 tokens out: among the samples >= 50 (51 of them), the 10 % quantile, and never below 51
    assert est.assured(50, 4096) == 50 + int(ASSURED_QUANTILE * 50) + 1
    assert est.assured(50, 53) == 53  # within the request's own bound
    assert est.assured(98, 4096) == 99  # under min_samples outlived it: only the next token
    assert est.assured(50, 4096) < est.estimate() + 50  # never the mean's credit for a short-lived request


def test_the_assured_length_forgets_with_the_window():
    est = OutputEstimator(window=8, min_samples=1)
    for _ in range(8):
        est.observe(500)
    assert est.assured(0, 4096) == 501
    for _ in range(8):  # the window moves on to short outputs: the old 500s are gone from the quantile too
        est.observe(5)
    assert est.assured(0, 4096) == 6 and est.assured(5, 4096) == 6
