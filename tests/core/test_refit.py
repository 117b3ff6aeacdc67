"""node.core.refit: the online refit fits decode and mixed steps jointly and bounds each change."""

from __future__ import annotations

import pytest

from node.core.cost import CostModel
from node.core.refit import MAX_SHIFT, bounded, fit_steps

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here

TRUE = CostModel(prefill_fixed_s=0.0015, prefill_per_token_s=1.5e-5, decode_fixed_s=0.0015, decode_per_seq_s=8e-5,
                 decode_per_context_token_s=5e-7)
FIELDS = ("decode_fixed_s", "decode_per_seq_s", "decode_per_context_token_s", "prefill_per_token_s")


def steps(model: CostModel, n: int = 200, slow: float = 1.0) -> list[tuple[int, int, int, float]]:
    """Decode and mixed steps of varied shapes, timed by ``model`` (times ``slow``)."""
    out = []
    for i in range(n):
        b, k, p = 1 + i % 9, 50 * (1 + (i * 7) % 23), (0 if i % 3 == 0 else 4 + (i * 11) % 61)
        out.append((p, b, k * b, slow * model.mixed_step_s(p, b, k * b)))
    return out


def test_an_exact_joint_fit_recovers_the_model_unbounded():
    got = fit_steps([], steps(TRUE), base=CostModel(), shared_fixed=True, max_shift=float("inf"))
    for f in FIELDS:
        assert getattr(got, f) == pytest.approx(getattr(TRUE, f), rel=1e-6), f
    assert got.prefill_fixed_s == got.decode_fixed_s


def test_each_refit_moves_a_coefficient_at_most_max_shift_of_the_mean_step():
    """A window of steps three times slower (a neighbour's burst on a shared machine): one refit moves each
    coefficient's contribution at the mean sample by at most MAX_SHIFT of the mean step, so the predicted
    mean step grows by at most 4 x 25 %, not 3x; repeated refits on such steps do get there."""
    slow = steps(TRUE, slow=3.0)
    ref = sum(s for *_, s in slow) / len(slow)
    got = fit_steps([], slow, base=TRUE, shared_fixed=True)
    means = [1.0] + [sum(r[j] for r in slow) / len(slow) for j in (1, 2, 0)]  # a, b, k, p columns
    for f, mu in zip(FIELDS, means):
        assert abs(getattr(got, f) - getattr(TRUE, f)) * mu <= MAX_SHIFT * ref * (1 + 1e-9), f
    assert any(abs(getattr(got, f) - getattr(TRUE, f)) > 0 for f in FIELDS)
    model = TRUE
    for _ in range(20):
        model = fit_steps([], slow, base=model, shared_fixed=True)
    assert model.mixed_step_s(30, 4, 2000) == pytest.approx(3 * TRUE.mixed_step_s(30, 4, 2000), rel=0.01)


def test_bounded_lets_a_zero_coefficient_grow_and_keeps_an_unseen_column():
    assert bounded([0.0, 1.0], [5.0, 0.5], [1.0, 0.0], ref_s=2.0, max_shift=0.25) == [0.5, 1.0]
    assert bounded([1.0], [-3.0], [1.0], ref_s=100.0, max_shift=0.25) == [0.0]  # never negative
    assert bounded([1.0], [2.0], [1.0], ref_s=1.0, max_shift=float("inf")) == [2.0]


def test_without_prompt_tokens_the_prompt_terms_stay():
    decode_only = [(0, b, k, s) for p, b, k, s in steps(TRUE) if p == 0]
    base = CostModel(prefill_fixed_s=0.003, prefill_per_token_s=7e-5, decode_fixed_s=0.003)
    got = fit_steps([], decode_only, base=base, shared_fixed=True, max_shift=float("inf"))
    assert got.prefill_per_token_s == 7e-5 and got.decode_per_seq_s == pytest.approx(TRUE.decode_per_seq_s)


def test_two_configurations_fit_windows_apart_and_the_mixed_extra_from_mixed_steps():
    """Decode steps replay graphs and mixed steps run eagerly, 4 ms more: with no window seen, the mixed rows
    give the prompt terms, and the model's mixed step is 4 ms over its decode step."""
    eager = CostModel(prefill_fixed_s=0.0055, prefill_per_token_s=1.5e-5, decode_fixed_s=0.0015, decode_per_seq_s=8e-5,
                      decode_per_context_token_s=5e-7)
    got = fit_steps([], steps(eager), base=CostModel(), shared_fixed=False, max_shift=float("inf"))
    assert got.mixed_step_s(1, 4, 2000) - got.decode_step_s(4, 2000) == pytest.approx(0.004 + 1.5e-5, rel=1e-4)
    windows = [(n, 0.002 + 1e-5 * n) for n in (64, 128, 256, 512)]
    got = fit_steps(windows, steps(eager), base=CostModel(), shared_fixed=False, max_shift=float("inf"))
    assert got.prefill_fixed_s == pytest.approx(0.002) and got.prefill_per_token_s == pytest.approx(1e-5)
    assert got.decode_fixed_s == pytest.approx(0.0015)
