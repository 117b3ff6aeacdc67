"""The adaptive role policy on hand-made snapshots (virtual clock): each choice — DECODE, MIXED with its
online chunk budget, a PREFILL window — made for the reason its docstring gives."""

from __future__ import annotations

import math

import msgspec
import pytest

from node.core.adaptive import AdaptiveScheduler, ChunkBudget
from node.core.chunk_budget import (chunk_budget, chunks_extra_s, chunks_s, efficient_chunk, gather_s, spacing_s,
                                    step_limit_s)
from node.core.cost import CostModel
from node.core.roles import DeviceState, NodeSnapshot, Place, ResidentSeq, Role, RoleSchedulerConfig, SwitchRole, WaitingPrompt

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here

# 20 us per prompt token, an 8 ms decode step (+ per-sequence and context terms), 5 ms switch pause
COST = CostModel(prefill_fixed_s=0.002, prefill_per_token_s=2e-5, decode_fixed_s=0.008, decode_per_seq_s=1e-4,
                 decode_per_context_token_s=1e-7, pause_s=0.005)
CFG = RoleSchedulerConfig(ttft_slo_ms=200, tpot_slo_ms=50, min_window_ms=5, max_window_ms=200, prefill_token_budget=4096)
T = 0.9 * 0.050


class TwoInstances(CostModel, frozen=True, kw_only=True):
    """A group whose prefill configuration runs two instances side by side: a prefill step of ``n``
    tokens costs what ``n/2`` cost, while mixed steps run in the decode configuration (one instance)."""

    def prefill_step_s(self, tokens: int) -> float:
        return CostModel.prefill_step_s(self, -(-tokens // 2))

    def mixed_step_s(self, prompt_tokens: int, decode_seqs: int, context_tokens: int) -> float:
        fixed = max(self.prefill_fixed_s, self.decode_fixed_s)
        if prompt_tokens <= 0:
            return self.decode_step_s(decode_seqs, context_tokens)
        return (fixed + self.prefill_per_token_s * prompt_tokens
                + (self.decode_step_s(decode_seqs, context_tokens) - self.decode_fixed_s if decode_seqs else 0.0))


def dev(role=Role.DECODE, resident=(), **kw) -> DeviceState:
    kw.setdefault("kv_free_blocks", 4000)
    kw.setdefault("kv_total_blocks", 4000)
    return DeviceState(device_id=kw.pop("device_id", "d0"), role=role, role_since_s=kw.pop("since", 0.0),
                       resident=tuple(resident), **kw)


def on_pace(n: int, now: float, ahead_s: float) -> tuple[ResidentSeq, ...]:
    """``n`` residents whose next deadline is ``ahead_s`` after ``now`` (10 tokens out, 500 cached, 200 expected)."""
    return tuple(ResidentSeq(f"s{i}", now + ahead_s - 10 * T, 10, 500, 200) for i in range(n))


def switches(out) -> list[tuple[str, Role, str]]:
    return [(d.device_id, d.to_role, d.reason) for d in out if isinstance(d, SwitchRole)]


def test_decode_when_nothing_waits():
    pol = AdaptiveScheduler(CFG, COST)
    out = pol.decide(1.0, NodeSnapshot((dev(Role.MIXED, on_pace(4, 1.0, T)),)))
    assert switches(out) == [("d0", Role.DECODE, "nothing_waits")]
    assert not any(isinstance(d, ChunkBudget) for d in out)
    # already decoding and nothing waits: no decision at all
    assert pol.decide(1.0, NodeSnapshot((dev(Role.DECODE, on_pace(4, 1.0, T)),))) == []


def test_mixed_when_chunks_fit_the_residents_deadlines():
    pol = AdaptiveScheduler(CFG, COST)
    now = 1.0
    res = on_pace(4, now, T)
    out = pol.decide(now, NodeSnapshot((dev(Role.DECODE, res),), (WaitingPrompt("p", 3000, now, 100),)))
    assert switches(out) == [("d0", Role.MIXED, "chunks_fit")]
    budget = next(d for d in out if isinstance(d, ChunkBudget))
    assert any(isinstance(d, Place) and d.device_id == "d0" for d in out)
    # the budget is the largest chunk whose mixed step lasts at most the per-token target T
    k = sum(r.context_tokens for r in res)
    assert math.isclose(budget.step_limit_s, T)
    L = budget.step_limit_s
    assert COST.mixed_step_s(budget.tokens, 4, k) <= L < COST.mixed_step_s(budget.tokens + 1, 4, k)
    assert 0 < budget.tokens < 2048
    # the switch (free) and the budget precede the placement on the device
    kinds = [type(d) for d in out]
    assert kinds.index(Place) > kinds.index(ChunkBudget) > kinds.index(SwitchRole)


def test_chunk_budget_is_capped_by_max_num_batched_tokens():
    pol = AdaptiveScheduler(CFG, COST, max_step_tokens=512)
    now = 1.0
    # a T-long step could carry ~1,800 prompt tokens: the cap binds, decode tokens counted
    c, limit = pol.chunk_budget_of(dev(Role.DECODE, on_pace(4, now, T)), now)
    assert math.isclose(limit, T) and c == 512 - 4
    # no resident: no deadline, the whole cap
    c, limit = pol.chunk_budget_of(dev(Role.DECODE), now)
    assert limit == math.inf and c == 512


class EagerMixed(CostModel, frozen=True, kw_only=True):
    """Decode steps replay graphs; a step with any prompt token runs eagerly, ``penalty_s`` (10 ms) more."""

    penalty_s: float = 0.010

    def mixed_step_s(self, prompt_tokens: int, decode_seqs: int, context_tokens: int) -> float:
        base = CostModel.mixed_step_s(self, prompt_tokens, decode_seqs, context_tokens)
        return base + (self.penalty_s if prompt_tokens > 0 and decode_seqs > 0 else 0.0)


def test_no_headroom_when_even_the_window_bound_holds_no_mixed_step():
    """A ~40 ms decode step whose mixed form costs 250 ms more, past the 200 ms window bound ``Wmax``
    (and past T = 45 ms): no chunk fits, not even spaced, DECODE ("no_headroom"); the queue waits for a
    window."""
    cost = EagerMixed(**{f: getattr(COST, f) for f in COST.__struct_fields__} | {"decode_fixed_s": 0.0394}, penalty_s=0.25)
    pol = AdaptiveScheduler(CFG, cost)
    now = 1.0
    st = dev(Role.MIXED, on_pace(4, now, T), prefill_queue_tokens=500, prefill_queue_seqs=1, prefill_queue_oldest_s=now)
    assert pol.chunk_budget_of(st, now)[0] == 0
    out = pol.decide(now, NodeSnapshot((st,)))
    assert switches(out) == [("d0", Role.DECODE, "no_headroom")]
    # a 10 ms penalty, but decode (44.6 ms) barely meets T: winning a mixed step back takes S > Wmax
    cost = EagerMixed(**{f: getattr(COST, f) for f in COST.__struct_fields__} | {"decode_fixed_s": 0.0440})
    d = cost.decode_step_s(4, 2000)
    assert d < T and spacing_s(cost.mixed_step_s(1, 4, 2000), d, T) > CFG.max_window_ms / 1e3
    assert switches(AdaptiveScheduler(CFG, cost).decide(now, NodeSnapshot((st,)))) == [("d0", Role.DECODE, "no_headroom")]


def test_spaced_mixed_steps_where_no_chunk_fits_t_but_decode_does():
    """A ~36 ms decode step whose mixed form costs 10 ms more: no chunk fits T = 45 ms, but the TPOT SLO
    bounds the mean gap, so the device runs a mixed step of m > T and then decodes for
    S = (m - T) d / (T - d) before the next ("spacing"): the cycle's mean gap is T (before: c = 0, and the
    queue waited for a window that stops every resident)."""
    cost = EagerMixed(**{f: getattr(COST, f) for f in COST.__struct_fields__} | {"decode_fixed_s": 0.0355})
    pol = AdaptiveScheduler(CFG, cost)
    now = 1.0
    res = on_pace(4, now, T)
    k = sum(r.context_tokens for r in res)
    d = cost.decode_step_s(4, k)
    assert d < T < cost.mixed_step_s(1, 4, k)  # decode meets T, no chunk does

    def st(at, role, busy=0.0):
        return dev(role, res, prefill_queue_tokens=1000, prefill_queue_seqs=2, prefill_queue_oldest_s=now - 1.0,
                   busy_until_s=busy)

    out = pol.decide(now, NodeSnapshot((st(now, Role.DECODE),)))
    assert switches(out) == [("d0", Role.MIXED, "chunks_fit")]
    c = next(x for x in out if isinstance(x, ChunkBudget)).tokens
    assert c >= 1000 and cost.mixed_step_s(c, 4, k) <= CFG.max_window_ms / 1e3  # the whole queue, within Wmax
    m = cost.mixed_step_s(1000, 4, k)
    assert m > T
    S = spacing_s(m, d, T)
    assert math.isclose((m + S) / (1 + S / d), T)  # one mixed step and S / d decode steps: mean gap T
    # the step has begun: decode until the spacing has passed
    out = pol.decide(now + 0.001, NodeSnapshot((st(now + 0.001, Role.MIXED, busy=now + m),)))
    assert switches(out) == [("d0", Role.DECODE, "spacing")] and not any(isinstance(x, ChunkBudget) for x in out)
    t = now + m + S - 0.002
    assert pol.decide(t, NodeSnapshot((st(t, Role.DECODE, busy=t - 0.001),))) == []
    t = now + m + S + 0.001
    assert switches(pol.decide(t, NodeSnapshot((st(t, Role.DECODE, busy=t - 0.001),)))) == [("d0", Role.MIXED, "chunks_fit")]
    with pytest.raises(ValueError):
        spacing_s(m, T, T)


def test_a_spaced_step_waits_until_every_resident_can_win_it_back():
    """As above, but one resident expects 2 tokens and has 1: its one gap could not absorb a step of
    m > τ (the TPOT SLO) now, so the device decodes ("spacing") until it has gone."""
    cost = EagerMixed(**{f: getattr(COST, f) for f in COST.__struct_fields__} | {"decode_fixed_s": 0.0355})
    pol = AdaptiveScheduler(CFG, cost)
    now = 1.0
    short = ResidentSeq("short", now - 0.010, 1, 500, 2)
    res = on_pace(3, now, T) + (short,)
    k = sum(r.context_tokens for r in res)
    d, m = cost.decode_step_s(4, k), cost.mixed_step_s(1, 4, k)
    assert short.first_token_s + CFG.tpot_slo_ms / 1e3 < now + m  # f + (N - 1) τ < the step's end + (N - n - 1) d
    st = dev(Role.DECODE, res, prefill_queue_tokens=1000, prefill_queue_seqs=2, prefill_queue_oldest_s=now - 1.0)
    out = pol.decide(now, NodeSnapshot((st,)))
    assert switches(out) == [] and not any(isinstance(x, ChunkBudget) for x in out)  # stays in DECODE
    out = pol.decide(now, NodeSnapshot((msgspec.structs.replace(st, role=Role.MIXED),)))
    assert switches(out) == [("d0", Role.DECODE, "spacing")]
    # without it the step goes ahead
    st = msgspec.structs.replace(st, resident=res[:3])
    assert switches(pol.decide(now, NodeSnapshot((st,)))) == [("d0", Role.MIXED, "chunks_fit")]


def test_a_held_spaced_device_is_judged_by_when_its_blocking_resident_ends():
    """A resident whose own mean cannot absorb even a one-token spaced step, 150 tokens from its end: decode
    steps do not win the step back (its budget counts every later token at d, so it moves with the clock),
    so on a virtual clock the hold lasts until that resident ends, and the policy says so: its queue's work
    starts then, and a new prompt is not queued behind it (before: the policy judged the held
    queue as if its chunks ran now, and took every prompt that came, which only a forced window served)."""
    cost = EagerMixed(**{f: getattr(COST, f) for f in COST.__struct_fields__} | {"decode_fixed_s": 0.0355})
    pol = AdaptiveScheduler(CFG, cost)
    tau, now = CFG.tpot_slo_ms / 1e3, 1.0
    healthy = on_pace(3, now, T)
    k = sum(r.context_tokens for r in healthy) + 500
    d, m1 = cost.decode_step_s(4, k), cost.mixed_step_s(1, 4, k)
    n, N = 50, 200  # the blocker's mean so far leaves it m1 / 2 of slack with its 149 later tokens at d
    f = now + m1 / 2 + (N - n - 1) * d - (N - 1) * tau
    queue = dict(prefill_queue_tokens=1000, prefill_queue_seqs=2, prefill_queue_oldest_s=now)

    def held(out=n):
        return dev(Role.DECODE, healthy + (ResidentSeq("late", f, out, 500, N),), **queue, device_id="d0")

    t, ends = now, []
    for step in range(5):  # decode steps on the virtual clock: the hold stays, and so does its end
        mix = pol._mix(pol._prepare(t, NodeSnapshot((held(n + step),)))[0], t)
        assert mix.hold and mix.spacing
        ends.append(mix.t0)
        t += d
    assert ends == pytest.approx([now + (N - n) * d] * 5)
    # a prompt arrives: as chunks behind the hold it would miss the TTFT target, so it is not queued there
    # (it waits to be placed where, or when, it can be served: a window, or this device once the hold ends)
    w = WaitingPrompt("r", 32, now, 100)
    out = pol.decide(now, NodeSnapshot((held(),), waiting=(w,)))
    assert not any(isinstance(x, Place) for x in out) and switches(out) == []
    # once the blocker has ended, the device mixes again
    t = ends[0]
    out = pol.decide(t, NodeSnapshot((dev(Role.DECODE, on_pace(3, t, T), **queue),)))
    assert switches(out) == [("d0", Role.MIXED, "chunks_fit")]


def test_prompts_pass_a_kv_bound_head_beside_its_reserved_blocks():
    """An urgent head needs 82 KV blocks and each device has 50 free: its blocks are reserved on d0 (the
    fewest missing; a tie, the first), and a later small prompt passes it on d1 (before: every later
    prompt waited behind the head, though d1 had room). Rounds later on the virtual clock d0's residents
    have freed 70 blocks, still short: the small prompts that keep arriving go to d1, never into the
    head's blocks, and the head is placed on d0 as soon as 82 are free."""
    pol = AdaptiveScheduler(CFG, COST)
    now = 1.0
    head = WaitingPrompt("head", 1200, now - 1.0, 100)  # ceil(1300 / 16) = 82 blocks; waited past urgency
    assert pol.urgent(head, now)

    def small(i, at):
        return WaitingPrompt(f"small{i}", 32, at, 100)  # 9 blocks

    def node(at, free0, waiting):
        return NodeSnapshot(tuple(dev(Role.DECODE, on_pace(2, at, T), device_id=d, kv_free_blocks=free)
                                  for d, free in (("d0", free0), ("d1", 50))), waiting=waiting)

    def placed(out):
        return [(x.request_id, x.device_id) for x in out if isinstance(x, Place)]

    assert placed(pol.decide(now, node(now, 50, (head, small(0, now))))) == [("small0", "d1")]
    for i, free in enumerate((60, 70, 81), start=1):
        t = now + 0.01 * i
        assert placed(pol.decide(t, node(t, free, (head, small(i, t))))) == [(f"small{i}", "d1")]
    t = now + 0.05
    assert placed(pol.decide(t, node(t, 82, (head, small(9, t)))))[0] == ("head", "d0")


def test_window_when_a_burst_is_cheaper_as_a_window():
    """The prefill configuration runs two instances: 4,000 tokens cost 2 x 5 ms of pauses plus ~42 ms as
    a window, ~80 ms on top of decode as chunks; the residents have seconds of headroom."""
    cost = TwoInstances(**{f: getattr(COST, f) for f in COST.__struct_fields__})
    pol = AdaptiveScheduler(CFG, cost)
    now = 1.0
    waiting = tuple(WaitingPrompt(f"p{i}", 1000, now, 100) for i in range(4))
    st = dev(Role.MIXED, on_pace(4, now, 2.0), since=0.0)
    out = pol.decide(now, NodeSnapshot((st,), waiting))
    assert switches(out) == [("d0", Role.PREFILL, "cheaper")]
    assert [d.request_id for d in out if isinstance(d, Place)] == ["p0", "p1", "p2", "p3"]
    c, _ = pol.chunk_budget_of(st, now)
    assert 2 * pol.pause_s + pol.prefill_s(4000) < chunks_extra_s(lambda n: cost.mixed_step_s(n, 4, 2000), 4000, c)
    # the same burst on the plain cost model (one configuration): chunks are cheaper, so MIXED
    out = AdaptiveScheduler(CFG, COST).decide(now, NodeSnapshot((st,), waiting))
    assert switches(out) == []  # already MIXED
    assert any(isinstance(d, ChunkBudget) for d in out) and any(isinstance(d, Place) for d in out)


def test_window_when_ttft_is_at_risk_as_chunks():
    """A 2,000-token prompt 150 ms old would take two mixed steps (~57 ms) as chunks, past its 200 ms
    TTFT SLO; a window (residents due in 12 ms: a forced one) serves it in ~47 ms, within it."""
    pol = AdaptiveScheduler(CFG, COST)
    now = 1.0
    st = dev(Role.MIXED, on_pace(4, now, 0.012))
    c, _ = pol.chunk_budget_of(st, now)
    assert 0 < c < 2000
    m = lambda n: COST.mixed_step_s(n, 4, 2000)  # noqa: E731
    assert 0.150 + chunks_s(m, 2000, c) > 0.200 >= 0.150 + pol.pause_s + pol.prefill_s(2000)
    out = pol.decide(now, NodeSnapshot((st,), (WaitingPrompt("p", 2000, now - 0.150, 100),)))
    assert switches(out) == [("d0", Role.PREFILL, "ttft")]
    assert [d.request_id for d in out if isinstance(d, Place)] == ["p"]
    # a fresh prompt is not at risk: it goes in chunks
    out = pol.decide(now, NodeSnapshot((st,), (WaitingPrompt("p", 2000, now, 100),)))
    assert switches(out) == [] and any(isinstance(d, ChunkBudget) for d in out)


def test_no_ttft_window_for_a_head_that_meets_its_slo_as_chunks():
    """60 ms old, the same prompt is past half its TTFT SLO as chunks (~117 ms) but meets the SLO: a
    window would serve it ~10 ms sooner and stall the four residents for ~50 ms, so it goes in chunks."""
    pol = AdaptiveScheduler(CFG, COST)
    now = 1.0
    st = dev(Role.MIXED, on_pace(4, now, 0.012))
    c, _ = pol.chunk_budget_of(st, now)
    m = lambda n: COST.mixed_step_s(n, 4, 2000)  # noqa: E731
    as_chunks = 0.060 + chunks_s(m, 2000, c)
    assert CFG.ttft_urgency * 0.200 <= as_chunks <= 0.200 and 0.060 + pol.pause_s + pol.prefill_s(2000) < as_chunks
    out = pol.decide(now, NodeSnapshot((st,), (WaitingPrompt("p", 2000, now - 0.060, 100),)))
    assert switches(out) == [] and any(isinstance(d, ChunkBudget) for d in out)
    assert [d.device_id for d in out if isinstance(d, Place)] == ["d0"]


def test_a_window_lasts_as_long_as_the_work_it_was_opened_for():
    """The burst of the test above opens a window sized to its 4,000 tokens (~42 ms, not the 200 ms the
    residents could afford). A prompt arriving 10 ms later was never weighed against that window: it goes
    in chunks to the device in the decode configuration instead of stretching the residents' stall."""
    cost = TwoInstances(**{f: getattr(COST, f) for f in COST.__struct_fields__})
    pol = AdaptiveScheduler(CFG, cost)
    now = 1.0
    waiting = tuple(WaitingPrompt(f"p{i}", 1000, now, 100) for i in range(4))
    d0 = dev(Role.MIXED, on_pace(4, now, 2.0))
    d1 = dev(Role.MIXED, on_pace(4, now, 2.0), device_id="d1", kv_free_blocks=0)  # no room for the burst
    out = pol.decide(now, NodeSnapshot((d0, d1), waiting))
    sw = next(d for d in out if isinstance(d, SwitchRole))
    assert (sw.device_id, sw.reason) == ("d0", "cheaper")
    assert math.isclose(sw.window_s, pol.prefill_s(4000)) and sw.window_s < CFG.max_window_ms / 1e3
    assert sw.window_tokens == cost.prefill_tokens_within(sw.window_s, CFG.prefill_token_budget)
    # 10 ms on: d0 has paused and holds the burst; d1 has room now
    later = now + 0.010
    d0 = dev(Role.PREFILL, on_pace(4, later, 2.0), since=now + pol.pause_s, prefill_queue_tokens=4000,
             prefill_queue_seqs=4, prefill_queue_oldest_s=now)
    d1 = dev(Role.MIXED, on_pace(4, later, 2.0), device_id="d1")
    out = pol.decide(later, NodeSnapshot((d0, d1), (WaitingPrompt("q", 1000, later, 100),)))
    assert [(d.request_id, d.device_id) for d in out if isinstance(d, Place)] == [("q", "d1")]


def test_a_ttft_window_is_judged_against_the_chunk_that_keeps_up():
    """A 1,500-token prompt 150 ms old: at the knee (~500 tokens, three ~19 ms steps) it would miss its
    200 ms TTFT SLO; at c_L (one ~43 ms step) it meets it. No window: it goes in chunks, and the chunk
    grows to the smallest that meets the SLO."""
    pol = AdaptiveScheduler(CFG, KNEE)
    now = 1.0
    st = dev(Role.MIXED, on_pace(4, now, 0.012))
    knee, _ = pol.chunk_budget_of(st, now)
    m = lambda n: KNEE.mixed_step_s(n, 4, 2000)  # noqa: E731
    c_limit = chunk_budget(m, T, 2048 - 4)
    assert 0.150 + chunks_s(m, 1500, knee) > 0.200 >= 0.150 + chunks_s(m, 1500, c_limit)
    assert 0.150 + pol.pause_s + pol.prefill_s(1500) <= 0.200  # a window would have met it too
    out = pol.decide(now, NodeSnapshot((st,), (WaitingPrompt("p", 1500, now - 0.150, 100),)))
    assert switches(out) == []
    assert [d.device_id for d in out if isinstance(d, Place)] == ["d0"]
    c = next(d.tokens for d in out if isinstance(d, ChunkBudget))
    assert knee < c <= c_limit and 0.150 + chunks_s(m, 1500, c) <= 0.200 < 0.150 + chunks_s(m, 1500, c - 1)


def test_an_idle_window_returns_to_the_decode_configuration():
    pol = AdaptiveScheduler(CFG, COST)
    out = pol.decide(1.0, NodeSnapshot((dev(Role.PREFILL),)))
    assert switches(out) == [("d0", Role.DECODE, "drained")]


def test_step_limit_formulas():
    assert step_limit_s(0, 0.0, T) == math.inf
    assert step_limit_s(3, 0.01, T) == T
    assert step_limit_s(3, 0.06, 0.05) == 0.12  # decode alone misses T: share the device evenly
    step = lambda c: 0.01 + 1e-4 * c  # noqa: E731
    assert chunk_budget(step, 0.02, 1000) == 100
    assert chunk_budget(step, 0.0100999, 1000) == 0
    assert chunk_budget(step, 1.0, 64) == 64



class Knee(CostModel, frozen=True, kw_only=True):
    """Decode replays graphs; a mixed step runs eagerly: it costs at least the decode step plus a 10 ms
    launch floor, then 20 us per prompt token, plus 2 ns per token squared (attention within the chunk).
    Prompt tokens are cheapest per token at the knee, 500 tokens."""

    def mixed_step_s(self, prompt_tokens: int, decode_seqs: int, context_tokens: int) -> float:
        d = self.decode_step_s(decode_seqs, context_tokens)
        if prompt_tokens <= 0 or decode_seqs <= 0:
            return d if prompt_tokens <= 0 else CostModel.mixed_step_s(self, prompt_tokens, 0, 0)
        return d + max(0.010, 2e-5 * prompt_tokens) + 2e-9 * prompt_tokens ** 2


KNEE = Knee(**{f: getattr(COST, f) for f in COST.__struct_fields__})


def test_the_chunk_is_the_knee_not_the_largest_that_fits():
    """Under a 45 ms limit ~1,500 prompt tokens would fit, but past the knee a larger chunk buys no
    prompt throughput and lengthens every resident's step: the budget is the knee (within the search
    grid's 19 %). On the linear model a larger chunk is always cheaper per token: the limit."""
    now = 1.0
    st = dev(Role.DECODE, on_pace(4, now, T))
    c, limit = AdaptiveScheduler(CFG, KNEE).chunk_budget_of(st, now)
    m = lambda n: KNEE.mixed_step_s(n, 4, 2000)  # noqa: E731
    c_limit = chunk_budget(m, limit, 2048 - 4)
    assert c_limit > 1000 and 500 / 2 ** 0.25 <= c <= 500 * 2 ** 0.25
    u = lambda n: (m(n) - m(0)) / n  # noqa: E731
    assert u(c) < u(c_limit) and u(c) < u(100)
    assert efficient_chunk(lambda n: COST.mixed_step_s(n, 4, 2000), 700) == 700
    assert efficient_chunk(m, 0) == 0


def test_a_partial_queue_gathers_until_full_or_g_old():
    """A 128-token prompt on a device whose mixed steps pay a 10 ms eager penalty: mixing it at once would
    pay the penalty for a quarter of a chunk. It waits in DECODE ("gather") until its wait reaches
    G = 10 ms x (1 - 0.2) / 0.2 = 40 ms (the penalty's share of device time <= max_pause_share), or
    until the queue fills the chunk."""
    pol = AdaptiveScheduler(CFG, KNEE)
    now = 1.0
    res = on_pace(4, now, T)
    G = gather_s(KNEE.mixed_step_s(1, 4, 2000) - KNEE.decode_step_s(4, 2000), CFG.max_pause_share)
    assert math.isclose(G, 0.040, rel_tol=0.01)

    def queued(tokens, age, role=Role.MIXED):
        return dev(role, res, prefill_queue_tokens=tokens, prefill_queue_seqs=1, prefill_queue_oldest_s=now - age)

    out = pol.decide(now, NodeSnapshot((queued(128, 0.010),)))
    assert switches(out) == [("d0", Role.DECODE, "gather")] and not any(isinstance(d, ChunkBudget) for d in out)
    assert pol.decide(now, NodeSnapshot((queued(128, 0.010, Role.DECODE),))) == []  # already decoding: stays
    # a prompt placed now gathers too (its arrival, not the snapshot's, is the queue's oldest)
    out = pol.decide(now, NodeSnapshot((dev(Role.MIXED, res),), (WaitingPrompt("p", 128, now, 100),)))
    assert switches(out) == [("d0", Role.DECODE, "gather")] and [d.device_id for d in out if isinstance(d, Place)] == ["d0"]
    # waited G: mix
    out = pol.decide(now, NodeSnapshot((queued(128, G, Role.DECODE),)))
    assert switches(out) == [("d0", Role.MIXED, "chunks_fit")]
    # a full chunk: mix at once
    c, _ = pol.chunk_budget_of(queued(128, 0.0), now)
    out = pol.decide(now, NodeSnapshot((queued(c, 0.0, Role.DECODE),)))
    assert switches(out) == [("d0", Role.MIXED, "chunks_fit")]
    # one configuration, no eager penalty beyond a token's cost: G ~ 0, a prompt is never held
    assert AdaptiveScheduler(CFG, COST).decide(now, NodeSnapshot((queued(128, 0.001, Role.DECODE),)))[0] == \
        SwitchRole("d0", Role.MIXED, "chunks_fit")


def test_gathering_counts_from_the_last_mixed_phase_not_only_the_arrival():
    """Mixed steps need only be G apart: a lone prompt on a device that has not mixed for G is mixed at
    once (holding it would save no mixed step); one that arrives 10 ms after a mixed phase gathers until
    G after that phase (here 30 ms after its arrival), not G after its own arrival."""
    pol = AdaptiveScheduler(CFG, KNEE)
    res = on_pace(4, 1.0, T)
    G = gather_s(KNEE.mixed_step_s(1, 4, 2000) - KNEE.decode_step_s(4, 2000), CFG.max_pause_share)

    def queued(now, age, role=Role.DECODE):
        return dev(role, res, prefill_queue_tokens=128, prefill_queue_seqs=1, prefill_queue_oldest_s=now - age)

    # never mixed: the prompt 1 ms old is mixed now
    assert switches(pol.decide(1.0, NodeSnapshot((queued(1.0, 0.001),)))) == [("d0", Role.MIXED, "chunks_fit")]
    # a fresh policy that saw the device MIXED at t = 2.0 (its queue drained), then a prompt at 2.010
    pol = AdaptiveScheduler(CFG, KNEE)
    assert switches(pol.decide(2.0, NodeSnapshot((dev(Role.MIXED, res),)))) == [("d0", Role.DECODE, "nothing_waits")]
    assert pol.decide(2.020, NodeSnapshot((queued(2.020, 0.010),))) == []  # 20 ms after the phase: gathers
    assert pol.decide(2.0 + G - 0.001, NodeSnapshot((queued(2.0 + G - 0.001, G - 0.011),))) == []
    t = 2.0 + G + 1e-6  # G after the phase (the prompt is younger than G)
    out = pol.decide(t, NodeSnapshot((queued(t, G - 0.010),)))
    assert switches(out) == [("d0", Role.MIXED, "chunks_fit")]


def test_a_refitted_model_with_no_negative_cost_does_not_hold_a_lone_prompt():
    """The node's online refit (decode samples whose context grows with the batch, a loaded CPU): plain
    least squares gives a negative per-context cost and so a decode step below zero, which the policy
    reads as a large mixed-step penalty and gathers a prompt that arrives 10 ms after a mixed phase (by
    staying in DECODE); the non-negative fit the node now uses leaves a token's cost as the penalty
    (``G`` ~ 0.2 ms), and the prompt is mixed at once."""
    from test_cost import _collinear_decode_samples

    from node.core.cost import fit_cost_model

    true, dec = _collinear_decode_samples()
    now = 1.0
    res = tuple(ResidentSeq(f"s{i}", now + 0.02, 10, 150, 200) for i in range(20))
    queued = dev(Role.DECODE, res, prefill_queue_tokens=32, prefill_queue_seqs=1, prefill_queue_oldest_s=now - 0.002)
    for nonneg, want in ((False, []), (True, [("d0", Role.MIXED, "chunks_fit")])):
        pol = AdaptiveScheduler(CFG, fit_cost_model([], dec, base=true, nonneg=nonneg))
        pol.decide(now - 0.010, NodeSnapshot((dev(Role.MIXED, res),)))  # it mixed 10 ms ago, then its queue drained
        assert switches(pol.decide(now, NodeSnapshot((queued,)))) == want  # OLS: held in DECODE, gathering


def test_a_prompt_that_waited_for_a_slot_is_placed_behind_a_short_queue():
    """A prompt that already waited 300 ms for a sequence slot is past half its 200 ms TTFT SLO wherever it
    goes; a device whose queue (1,000 tokens) plus it is served within the target from now takes it
    (the target measured from its arrival fitted no device with queued work, and held the queue)."""
    pol = AdaptiveScheduler(CFG, COST)
    now = 1.0
    st = dev(Role.MIXED, on_pace(4, now, T), prefill_queue_tokens=1000, prefill_queue_seqs=1,
             prefill_queue_oldest_s=now - 0.010)
    out = pol.decide(now, NodeSnapshot((st,), (WaitingPrompt("p", 500, now - 0.300, 100),
                                               WaitingPrompt("q", 500, now - 0.010, 100))))
    assert switches(out) == []
    assert [(d.request_id, d.device_id) for d in out if isinstance(d, Place)] == [("p", "d0"), ("q", "d0")]


def test_the_chunk_grows_past_the_knee_to_keep_up_with_a_backlog():
    """c* carries a small queue; a 6,000-token queue would take ~15 knee-sized steps (~240 ms), past a
    fifth of the 200 ms TTFT SLO, so the chunk grows to the smallest that serves it within 40 ms of work
    — up to the step limit's c_L."""
    pol = AdaptiveScheduler(CFG, KNEE)
    now = 1.0
    res = on_pace(4, now, T)
    m = lambda n: KNEE.mixed_step_s(n, 4, 2000)  # noqa: E731

    def budget(tokens):
        st = dev(Role.MIXED, res, prefill_queue_tokens=tokens, prefill_queue_seqs=1, prefill_queue_oldest_s=now - 1)
        return next(d.tokens for d in pol.decide(now, NodeSnapshot((st,))) if isinstance(d, ChunkBudget))

    knee, _ = pol.chunk_budget_of(dev(Role.DECODE, res), now)
    assert budget(knee) == knee  # a queue served at once at the knee
    grown = budget(6000)
    c_limit = chunk_budget(m, T, 2048 - 4)
    assert knee < grown <= c_limit and chunks_s(m, 6000, knee) > 0.2 * 0.200
    assert chunks_s(m, 6000, grown) <= 0.2 * 0.200 or grown == c_limit


class Quadratic(CostModel, frozen=True, kw_only=True):
    """As :class:`Knee`, with attention within the chunk ten times dearer (2e-8 s per token squared, in
    prefill steps too): a chunk carries prompt tokens fastest near 650 tokens, while up to ~940 fit the
    45 ms step limit."""

    def prefill_step_s(self, tokens: int) -> float:
        return CostModel.prefill_step_s(self, tokens) + 2e-8 * tokens ** 2

    def mixed_step_s(self, prompt_tokens: int, decode_seqs: int, context_tokens: int) -> float:
        d = self.decode_step_s(decode_seqs, context_tokens)
        if prompt_tokens <= 0 or decode_seqs <= 0:
            return d if prompt_tokens <= 0 else CostModel.mixed_step_s(self, prompt_tokens, 0, 0)
        return d + max(0.010, 2e-5 * prompt_tokens) + 2e-8 * prompt_tokens ** 2


def test_a_backlog_grows_the_chunk_no_further_than_the_fastest():
    """A 6,000-token backlog wants a larger chunk than the knee (500), but past c_T = argmax c / M(c) a
    larger chunk carries the queue more slowly: the growth stops at c_T, short of the limit c_L
    (1B prompts on the Azure code trace, 4 simulated H200s, TPOT 50 ms, 290 req/s: SLO attainment 0.74
    growing to c_L, 45 ms steps; 1.00 at c_T)."""
    from node.core.chunk_budget import fastest_chunk

    cost = Quadratic(**{f: getattr(COST, f) for f in COST.__struct_fields__})
    pol = AdaptiveScheduler(CFG, cost)
    now = 1.0
    res = on_pace(4, now, T)
    m = lambda n: cost.mixed_step_s(n, 4, 2000)  # noqa: E731
    knee, _ = pol.chunk_budget_of(dev(Role.DECODE, res), now)
    c_limit = chunk_budget(m, T, 2048 - 4)
    c_fast = fastest_chunk(m, knee, c_limit)
    assert knee < c_fast < c_limit and c_fast / m(c_fast) > 1.03 * c_limit / m(c_limit)  # tokens per second
    assert 650 / 2 ** 0.25 <= c_fast <= 650 * 2 ** 0.25
    st = dev(Role.MIXED, res, prefill_queue_tokens=6000, prefill_queue_seqs=1, prefill_queue_oldest_s=now - 1)
    grown = next(d.tokens for d in pol.decide(now, NodeSnapshot((st,))) if isinstance(d, ChunkBudget))
    assert knee < grown <= c_fast
    # a linear model carries tokens fastest at the largest chunk: c_T is the limit
    lin = lambda n: COST.mixed_step_s(n, 4, 2000)  # noqa: E731
    assert fastest_chunk(lin, 100, 1500) == 1500 and fastest_chunk(lin, 700, 700) == 700


def test_quiet_when_decoding_means_no_decision():
    """AdaptiveScheduler.quiet_when_decoding (a driver then skips the snapshot): with nothing waiting and
    every device in DECODE with no queued prompt work, decide() returns nothing, whatever the residents'
    pace, the devices' KV, slots, step in flight or time in the role."""
    import random

    rng = random.Random(5)
    pol = AdaptiveScheduler(CFG, COST)
    assert pol.quiet_when_decoding
    for _ in range(300):
        now = rng.uniform(0.5, 50.0)
        devs = tuple(dev(Role.DECODE, on_pace(rng.randrange(0, 64), now, rng.uniform(-0.5, 0.5)), device_id=f"d{i}",
                         since=rng.uniform(0.0, now), busy_until_s=now + rng.uniform(-0.01, 0.02),
                         kv_free_blocks=rng.randrange(0, 4000), seq_slots_free=rng.randrange(0, 8))
                     for i in range(rng.randrange(1, 5)))
        assert pol.decide(now, NodeSnapshot(devs, pause_s=rng.choice([None, 0.005, 0.2]))) == []


def test_quiet_decisions_are_what_decide_returns_when_nothing_waits():
    """AdaptiveScheduler.quiet_decisions (a driver then skips the snapshot): with nothing waiting and every
    device in DECODE or MIXED with no queued prompt work, decide() sends each MIXED device back to DECODE
    ("nothing_waits") and nothing else; quiet_decisions gives the same, and leaves the same gathering
    state (the next prompt is gathered from this instant on in both)."""
    import random

    rng = random.Random(11)
    for _ in range(200):
        full, quick = AdaptiveScheduler(CFG, COST), AdaptiveScheduler(CFG, COST)
        now = rng.uniform(0.5, 50.0)
        devs = tuple(dev(rng.choice([Role.DECODE, Role.MIXED]), on_pace(rng.randrange(0, 64), now, rng.uniform(-0.5, 0.5)),
                         device_id=f"d{i}", since=rng.uniform(0.0, now), busy_until_s=now + rng.uniform(-0.01, 0.02),
                         kv_free_blocks=rng.randrange(0, 4000), seq_slots_free=rng.randrange(0, 8))
                     for i in range(rng.randrange(1, 5)))
        want = full.decide(now, NodeSnapshot(devs, pause_s=rng.choice([None, 0.005, 0.2])))
        got = quick.quiet_decisions(now, [d.device_id for d in devs if d.role is Role.MIXED])
        assert got == want
        assert quick._mixed_s == full._mixed_s
        # and the next round agrees too: a prompt arriving a little later is gathered (or not) alike
        later = now + rng.uniform(0.0, 0.01)
        st = tuple(msgspec.structs.replace(d, role=Role.DECODE, prefill_queue_tokens=8, prefill_queue_seqs=1,
                                           prefill_queue_oldest_s=later) for d in devs)
        assert full.decide(later, NodeSnapshot(st)) == quick.decide(later, NodeSnapshot(st))
