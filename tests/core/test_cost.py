"""The step-time cost model and its calibration."""

from __future__ import annotations

import pytest

from node.core.cost import CostModel, fit_cost_model, least_squares

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here


def test_chunked_prefill_and_its_inverse():
    c = CostModel(prefill_fixed_s=0.002, prefill_per_token_s=1e-5, prefill_per_token2_s=1e-10)
    assert c.prefill_s(0, 512) == 0.0
    # 1200 tokens under a 512 budget: two full steps and one of 176
    assert c.prefill_s(1200, 512) == pytest.approx(2 * c.prefill_step_s(512) + c.prefill_step_s(176))
    for seconds in (0.0, 0.001, 0.0021, 0.05, 1.0):
        n = c.prefill_tokens_within(seconds, 512)
        assert c.prefill_s(n, 512) <= seconds
        assert c.prefill_s(n + 1, 512) > seconds


def test_decode_step():
    c = CostModel(decode_fixed_s=0.01, decode_per_seq_s=1e-4, decode_per_context_token_s=1e-7)
    assert c.decode_step_s(0, 0) == 0.0
    assert c.decode_step_s(8, 8000) == pytest.approx(0.01 + 8e-4 + 8e-4)


def test_fit_recovers_coefficients():
    true = CostModel(prefill_fixed_s=0.003, prefill_per_token_s=2e-5, decode_fixed_s=0.008, decode_per_seq_s=2e-4,
                     decode_per_context_token_s=5e-8)
    pre = [(n, true.prefill_step_s(n)) for n in (16, 128, 512, 2048)]
    dec = [(b, k, true.decode_step_s(b, k)) for b, k in ((1, 100), (8, 4000), (32, 9000), (64, 70000))]
    fit = fit_cost_model(pre, dec, [0.004, 0.006])
    for f in ("prefill_fixed_s", "prefill_per_token_s", "decode_fixed_s", "decode_per_seq_s",
              "decode_per_context_token_s"):
        assert getattr(fit, f) == pytest.approx(getattr(true, f), rel=1e-6)
    assert fit.pause_s == pytest.approx(0.005)


def test_least_squares_overdetermined():
    # hand-computed: Sxy = 9.8, Sxx = 5 -> slope 1.96, intercept 4.0 - 1.96 * 1.5 = 1.06
    xs = [0, 1, 2, 3]
    ys = [1.1, 2.9, 5.1, 6.9]
    a, b = least_squares([[1.0, x] for x in xs], ys)
    assert a == pytest.approx(1.06) and b == pytest.approx(1.96)


def _collinear_decode_samples(seed: int = 5) -> tuple[CostModel, list[tuple[int, int, float]]]:
    """Decode steps as a loaded CPU node measures them: context grows with the batch (32-token prompts,
    ~96 tokens cached a sequence), and each step is late by an exponential delay of mean 4 ms."""
    import random

    rng = random.Random(seed)
    true = CostModel(prefill_fixed_s=0.003, prefill_per_token_s=5e-5, decode_fixed_s=0.003, decode_per_seq_s=5e-5,
                     decode_per_context_token_s=4e-6)
    samples = []
    for _ in range(60):
        b = rng.randint(2, 12)
        k = b * 96 + rng.randint(-2, 2)
        samples.append((b, k, true.decode_step_s(b, k) + rng.expovariate(1 / 0.004)))
    return true, samples


def test_nonneg_fit_keeps_step_costs_physical():
    true, dec = _collinear_decode_samples()
    ols = fit_cost_model([], dec, base=true)
    assert ols.decode_per_context_token_s < 0 and ols.decode_step_s(20, 3000) < 0  # what the online refit used to get
    fit = fit_cost_model([], dec, base=true, nonneg=True)
    assert min(fit.decode_fixed_s, fit.decode_per_seq_s, fit.decode_per_context_token_s) >= 0
    assert 0.005 < fit.decode_step_s(20, 3000) < 0.05
    # noise-free samples of a non-negative model: the same coefficients as plain least squares
    exact = [(b, k, true.decode_step_s(b, k)) for b, k in ((1, 100), (8, 4000), (32, 9000), (64, 70000))]
    got = fit_cost_model([(n, true.prefill_step_s(n)) for n in (16, 128, 512)], exact, nonneg=True)
    for f in ("prefill_fixed_s", "prefill_per_token_s", "decode_fixed_s", "decode_per_seq_s", "decode_per_context_token_s"):
        assert getattr(got, f) == pytest.approx(getattr(true, f), rel=1e-6)


def test_nonneg_least_squares_is_the_constrained_optimum():
    from node.core.cost import nonneg_least_squares

    # y = 1 + 2x - 0.5z on points where dropping z is best: the optimum puts z at 0 and refits the rest
    rows = [[1.0, x, z] for x, z in ((0, 0), (1, 1), (2, 0), (3, 2), (4, 1))]
    ys = [1 + 2 * r[1] - 0.5 * r[2] for r in rows]
    x = nonneg_least_squares(rows, ys)
    assert min(x) >= 0 and x[2] == 0.0
    sse = lambda v: sum((sum(a * b for a, b in zip(r, v)) - y) ** 2 for r, y in zip(rows, ys))  # noqa: E731
    for trial in ([x[0] + 0.01, x[1], 0.0], [x[0], x[1] - 0.01, 0.0], [x[0], x[1], 0.01]):
        assert sse(x) <= sse(trial)
    with pytest.raises(ValueError):
        nonneg_least_squares([], [])


def test_nonneg_least_squares_matches_refitting_every_subset_on_the_samples():
    """The Gram-matrix form picks the same fit as fitting each column subset on the samples themselves
    and summing its squared residuals there (the form the refit used before, 6x slower on 256 samples)."""
    import random

    from node.core.cost import nonneg_least_squares

    def by_samples(rows, ys):
        n = len(rows[0])
        best, best_sse = [0.0] * n, sum(y * y for y in ys)
        for mask in range(1, 1 << n):
            cols = [j for j in range(n) if mask >> j & 1]
            coef = least_squares([[r[j] for j in cols] for r in rows], ys)
            if min(coef) < 0:
                continue
            x = [0.0] * n
            for j, c in zip(cols, coef):
                x[j] = c
            sse = sum((sum(a * b for a, b in zip(r, x)) - y) ** 2 for r, y in zip(rows, ys))
            if sse < best_sse:
                best, best_sse = x, sse
        return best

    rng = random.Random(7)
    for trial in range(40):
        # decode-like rows (1, batch, context): context grows with batch, the noise of a loaded CPU
        rows, ys = [], []
        for _ in range(rng.choice((4, 30, 256))):
            b = rng.randint(1, 32)
            k = b * rng.randint(50, 400)
            rows.append([1.0, float(b), float(k)])
            ys.append(rng.uniform(-1, 1) * 1e-3 + 1e-3 + 2e-5 * b * rng.choice((1, -1)) + 1e-8 * k)
        got, want = nonneg_least_squares(rows, ys), by_samples(rows, ys)
        assert min(got) >= 0
        assert got == pytest.approx(want, rel=1e-6, abs=1e-12), trial


def test_one_configuration_shares_one_fixed_cost_so_no_mixed_penalty_appears():
    """Without decode graphs a prompt row is one more row of the same forward pass: fitted apart, the
    prefill intercept came out above the decode one by noise (here +3 ms), and ``M(1) - d`` read as a
    3 ms mixed-step penalty (the adaptive policy then holds prompts for ``G = e (1 - s) / s``). With
    ``shared_fixed`` the prefill intercept is the decode one and ``M(1) - d`` is one prompt token's cost."""
    from node.core.chunk_budget import gather_s

    a, b_seq, b_ctx, b_tok = 0.002, 50e-6, 1e-6, 20e-6
    decode = [(s, k, a + b_seq * s + b_ctx * k) for s, k in ((1, 40), (4, 300), (16, 900), (32, 2500), (8, 100))]
    noisy = [(n, a + 0.003 + b_tok * n) for n in (32, 64, 96, 128)]  # the chunk shares, 3 ms too high
    apart = fit_cost_model(noisy, decode, nonneg=True)
    shared = fit_cost_model(noisy, decode, nonneg=True, shared_fixed=True)
    d = shared.decode_step_s(8, 400)
    assert apart.mixed_step_s(1, 8, 400) - d == pytest.approx(0.003 + b_tok, rel=1e-3)
    assert shared.prefill_fixed_s == pytest.approx(a) and shared.decode_fixed_s == pytest.approx(a)
    e = shared.mixed_step_s(1, 8, 400) - d
    assert 0 < e < 0.0002  # one prompt token's share of the noise, not a 3 ms floor
    assert gather_s(e, 0.1) < 0.002 < gather_s(apart.mixed_step_s(1, 8, 400) - d, 0.1)


def test_one_configuration_shares_the_fitted_fixed_cost_before_any_prompt_sample():
    """The node's refit passes no prompt samples until it has seen three prompt sizes (a CPU node serving
    32-token prompts one at a time may not for minutes). The decode intercept is fitted meanwhile; the
    prompt rows must share it, not keep the starting model's: a base of 2 ms against a fitted 1 ms read
    as a 1 ms mixed-step penalty, and the adaptive policy gathered prompts for ~10 ms."""
    from node.core.chunk_budget import gather_s

    base = CostModel(prefill_fixed_s=0.002, prefill_per_token_s=2e-5, decode_fixed_s=0.002, decode_per_seq_s=1e-4)
    decode = [(s, k, 0.001 + 40e-6 * s + 1e-7 * k) for s, k in ((1, 40), (4, 300), (16, 900), (8, 100))]
    shared = fit_cost_model([], decode, base=base, nonneg=True, shared_fixed=True)
    assert shared.decode_fixed_s == pytest.approx(0.001) and shared.prefill_fixed_s == pytest.approx(0.001)
    assert shared.prefill_per_token_s == base.prefill_per_token_s  # no samples: base's per-token term
    e = shared.mixed_step_s(1, 8, 400) - shared.decode_step_s(8, 400)
    assert e == pytest.approx(2e-5) and gather_s(e, 0.1) < 0.0002
    apart = fit_cost_model([], decode, base=base, nonneg=True)  # two configurations: base's intercept kept
    assert apart.prefill_fixed_s == 0.002


def test_tokens_within_is_the_largest_count_that_fits():
    """Against a scan of every count, on linear and quadratic step costs, caps that fit and caps that do not."""
    import random

    from node.core.cost import tokens_within

    rng = random.Random(1)
    for _ in range(2000):
        a, b, q = rng.uniform(0, 1), rng.uniform(0, 0.1), rng.choice([0.0, 1e-4])
        cap, seconds = rng.randrange(0, 300), rng.uniform(-0.5, 30)
        cost = lambda n: a + b * n + q * n * n  # noqa: E731
        want = max([n for n in range(cap + 1) if cost(n) <= seconds], default=0) if seconds > 0 else 0
        assert tokens_within(cost, seconds, cap) == want, (a, b, q, cap, seconds)
    assert tokens_within(lambda n: 0.0, 1.0) == 1 << 40  # time costs nothing: the default cap
