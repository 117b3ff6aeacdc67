"""The node's running output-length estimate (node.core.output_estimate), shared by the node and the simulator."""

import pytest

from node.core.output_estimate import MIN_SAMPLES, PRIOR_TOKENS, WINDOW, OutputEstimator

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
