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


# Decode steps replay graphs (6 ms + terms); mixed steps run eagerly, at a 14.4 ms launch floor until their
# prompt tokens' compute passes it (the shape of the 8B roofline on an H200, bench.sim); windows are linear, at
# 1.4x the mixed steps' cost per token (their long prompts' attention), so the chunks sit on the floor.
GRAPH_DECODE_S, EAGER_FLOOR_S, PER_TOKEN_S, PER_SEQ_S, PER_CONTEXT_S = 0.006, 0.0144, 2.2e-5, 5e-5, 3e-8


def true_step_s(p: int, b: int, k: int) -> float:
    """The step time of ``p`` prompt tokens beside ``b`` decode sequences holding ``k`` context tokens."""
    d = GRAPH_DECODE_S + PER_SEQ_S * b + PER_CONTEXT_S * k
    return d if p == 0 else max(EAGER_FLOOR_S, GRAPH_DECODE_S + PER_TOKEN_S * p) + PER_SEQ_S * b + PER_CONTEXT_S * k


WINDOWS = [(n, 1.4 * PER_TOKEN_S * n) for n in (4096, 8192, 16384)]


def test_only_mixed_steps_leave_the_decode_intercept_where_decode_steps_put_it():
    """Every sample a mixed step (a prompt-bound device): the intercept and the mixed extra are one column.
    The decode step keeps the value decode steps gave it; before, rounding decided the split: here (and in
    the held-out runaway) the fit put the mixed steps' eager floor into it (decode read 14 ms against a true
    6), with other coefficients it put it all into the mixed extra (decode read 0)."""
    decode = [(0, b, k, true_step_s(0, b, k)) for b in range(1, 9) for k in (2000 * b, 9000 * b)]
    model = fit_steps(WINDOWS, decode, base=CostModel(), shared_fixed=False, max_shift=float("inf"))
    assert model.decode_step_s(4, 20000) == pytest.approx(true_step_s(0, 4, 20000), rel=1e-6)
    mixed = [(p, b, k, true_step_s(p, b, k)) for p in (100, 120, 150, 300) for b in range(1, 9) for k in (2000 * b, 9000 * b)]
    for max_shift in (float("inf"), MAX_SHIFT):
        got = model
        for _ in range(20):
            got = fit_steps(WINDOWS, mixed, base=got, shared_fixed=False, max_shift=max_shift)
        assert got.decode_step_s(4, 20000) == pytest.approx(true_step_s(0, 4, 20000), rel=0.02), max_shift


def test_a_prompt_bound_device_keeps_its_chunk_on_a_virtual_clock():
    """The runaway of issue 43 in a few requests, the adaptive policy and the node's refit in a loop on a
    virtual clock: two to six residents and eight 24k-token prompts at TPOT 20 ms. The device mixes in every
    step, so after SAMPLES steps no decode step is left among the refit's samples. The policy's decode
    estimate and chunk must stay what decode steps gave them; before, the decode estimate climbed to the
    eager floor (14.4 ms against 6), the step limit left chunks of a few dozen tokens, and the prompts took
    1.8x as long (on the held-out cell, the queue then never drained: p50 TTFT 10 s)."""
    from node.core.adaptive import AdaptiveScheduler
    from node.core.online_refit import REFIT_EVERY, SAMPLES, OnlineRefit
    from node.core.roles import DeviceState, ResidentSeq, Role, RoleSchedulerConfig

    cfg = RoleSchedulerConfig(ttft_slo_ms=1000, tpot_slo_ms=20, min_window_ms=5, max_window_ms=250,
                              prefill_token_budget=8192)
    refit = OnlineRefit()
    refit.prefill.extend(WINDOWS)
    for i in range(64):  # a quiet start: decode steps
        b = 2 + i % 5
        refit.decode.append((0, b, 2000 * b + i, true_step_s(0, b, 2000 * b + i)))
    pol = AdaptiveScheduler(cfg, refit.refit(CostModel()), max_step_tokens=8192)
    now, queue, steps, chunks = 0.0, 8 * 24576, 0, []
    while queue > 0 and steps < 5000:
        b = 2 + steps // 3 % 5  # residents end and others join
        residents = tuple(ResidentSeq(f"s{i}", 0.0, 1 + steps, 2000 + steps, 100000) for i in range(b))
        st = DeviceState(device_id="d0", role=Role.MIXED, resident=residents, prefill_queue_tokens=queue,
                         prefill_queue_seqs=-(-queue // 24576), kv_free_blocks=40000, kv_total_blocks=40000,
                         busy_until_s=now, prefill_queue_oldest_s=0.0)
        chunk, _ = pol.chunk_budget_of(st, now)
        p = min(chunk, queue)
        k = sum(r.context_tokens for r in residents)
        step_s = true_step_s(p, b, k)
        refit.decode.append((p, b, k, step_s))
        now, queue, steps = now + step_s, queue - p, steps + 1
        chunks.append(chunk)
        if steps % REFIT_EVERY == 0:
            pol.cost = refit.refit(pol.cost)
    assert steps > 2 * SAMPLES  # the decode steps left the samples long before the end
    assert pol.cost.decode_step_s(4, 8000) == pytest.approx(true_step_s(0, 4, 8000), rel=0.05)
    assert min(chunks[SAMPLES:]) >= 0.8 * min(chunks[:REFIT_EVERY]), (min(chunks[SAMPLES:]), min(chunks[:REFIT_EVERY]))
    assert now < 9.0  # 7.8 s: ~25k prompt tokens/s; 13.9 s before
