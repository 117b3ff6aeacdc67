"""The adaptive role policy on hand-made snapshots (virtual clock): each choice — DECODE, MIXED with its
online chunk budget, a PREFILL window — made for the reason its docstring gives."""

from __future__ import annotations

import math

from node.core.adaptive import AdaptiveScheduler, ChunkBudget
from node.core.chunk_budget import chunk_budget, chunks_extra_s, step_limit_s
from node.core.cost import CostModel
from node.core.roles import DeviceState, NodeSnapshot, Place, ResidentSeq, Role, RoleSchedulerConfig, SwitchRole, WaitingPrompt

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
    """Decode steps replay graphs; a step with any prompt token runs eagerly, 10 ms more."""

    def mixed_step_s(self, prompt_tokens: int, decode_seqs: int, context_tokens: int) -> float:
        base = CostModel.mixed_step_s(self, prompt_tokens, decode_seqs, context_tokens)
        return base + (0.010 if prompt_tokens > 0 and decode_seqs > 0 else 0.0)


def test_no_headroom_when_one_prompt_token_stretches_the_step_past_the_target():
    """A 40 ms decode step whose mixed form costs 10 ms more exceeds T = 45 ms with any chunk: DECODE
    ("no_headroom"), the queue waits for a window."""
    cost = EagerMixed(**{f: getattr(COST, f) for f in COST.__struct_fields__} | {"decode_fixed_s": 0.0394})
    pol = AdaptiveScheduler(CFG, cost)
    now = 1.0
    st = dev(Role.MIXED, on_pace(4, now, T), prefill_queue_tokens=500, prefill_queue_seqs=1, prefill_queue_oldest_s=now)
    assert pol.chunk_budget_of(st, now)[0] == 0
    out = pol.decide(now, NodeSnapshot((st,)))
    assert switches(out) == [("d0", Role.DECODE, "no_headroom")]


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
    """A 2,000-token prompt 60 ms old would take two mixed steps (~57 ms) as chunks, past half its 200 ms
    TTFT SLO; a window (residents due in 12 ms: a forced one) serves it in ~47 ms."""
    pol = AdaptiveScheduler(CFG, COST)
    now = 1.0
    st = dev(Role.MIXED, on_pace(4, now, 0.012))
    c, _ = pol.chunk_budget_of(st, now)
    assert 0 < c < 2000
    out = pol.decide(now, NodeSnapshot((st,), (WaitingPrompt("p", 2000, now - 0.060, 100),)))
    assert switches(out) == [("d0", Role.PREFILL, "ttft")]
    assert [d.request_id for d in out if isinstance(d, Place)] == ["p"]
    # a fresh prompt is not at risk yet: it goes in chunks
    out = pol.decide(now, NodeSnapshot((st,), (WaitingPrompt("p", 2000, now, 100),)))
    assert switches(out) == [] and any(isinstance(d, ChunkBudget) for d in out)


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

