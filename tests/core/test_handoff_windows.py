"""The adaptive policy's hand-off windows on hand-made snapshots (virtual clock): where no chunk fits a
decode step's limit, one device prefills and hands each sequence to the others (node.core.handoff_windows)."""

from __future__ import annotations

import msgspec
import pytest

from node.core.adaptive import AdaptiveScheduler, ChunkBudget
from node.core.imbalance import Migrate
from node.core.cost import CostModel
from node.core.handoff_windows import HandoffWindows
from node.core.roles import (DeviceState, NodeSnapshot, Place, ResidentSeq, Role, RoleSchedulerConfig, SwitchRole,
                             WaitingPrompt, _Dev)
from tests.core.test_adaptive import CFG, COST, T, EagerMixed, dev, on_pace, switches

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here

# decode ~36 ms, a mixed step 10 ms more: no chunk fits T = 45 ms, decode does (the spaced regime)
SPACED = EagerMixed(**{f: getattr(COST, f) for f in COST.__struct_fields__} | {"decode_fixed_s": 0.0355})


def moves(out) -> list[tuple[str, str, str, str]]:
    return [(m.seq_id, m.src_device, m.dst_device, m.reason) for m in out if isinstance(m, Migrate)]


def seqs(prefix: str, n: int, now: float) -> tuple[ResidentSeq, ...]:
    return tuple(ResidentSeq(f"{prefix}{i}", now - 10 * T, 10, 500, 200) for i in range(n))


def test_a_handoff_window_opens_where_no_chunk_fits_and_its_residents_move():
    """Two devices in the spaced regime and a prompt waiting: the one with fewer residents switches to
    PREFILL ("handoff"), takes the prompt, and its resident moves to the other device."""
    pol = AdaptiveScheduler(CFG, SPACED)
    now = 1.0
    d0, d1 = dev(Role.DECODE, seqs("a", 4, now), device_id="d0"), dev(Role.DECODE, seqs("b", 1, now), device_id="d1")
    assert pol.chunk_budget_of(d0, now)[0] > 0 and pol._mix(pol._prepare(now, NodeSnapshot((d0,)))[0], now).spacing
    out = pol.decide(now, NodeSnapshot((d0, d1), (WaitingPrompt("p", 1000, now, 100),)))
    assert switches(out) == [("d1", Role.PREFILL, "handoff")]
    assert [(p.request_id, p.device_id) for p in out if isinstance(p, Place)] == [("p", "d1")]
    assert moves(out) == [("b0", "d1", "d0", "handoff")]
    kinds = [type(d) for d in out]
    assert kinds.index(SwitchRole) < kinds.index(Place)


def test_no_handoff_where_chunks_fit_or_on_one_device():
    """Chunks fit T (one configuration, linear costs): the prompt goes in chunks, as before. One
    device in the spaced regime: nowhere to hand off to, it spaces its mixed steps."""
    now = 1.0
    d0, d1 = dev(Role.DECODE, seqs("a", 4, now), device_id="d0"), dev(Role.DECODE, seqs("b", 1, now), device_id="d1")
    out = AdaptiveScheduler(CFG, COST).decide(now, NodeSnapshot((d0, d1), (WaitingPrompt("p", 1000, now, 100),)))
    assert ("d1", Role.MIXED, "chunks_fit") in switches(out) and not moves(out)
    out = AdaptiveScheduler(CFG, SPACED).decide(now, NodeSnapshot((d0,), (WaitingPrompt("p", 1000, now, 100),)))
    assert switches(out) == [("d0", Role.MIXED, "chunks_fit")] and not moves(out)
    assert next(d for d in out if isinstance(d, ChunkBudget)).tokens >= 1000


def _opened(now: float):
    """A policy that has just opened a hand-off window on d1 (one resident) beside d0 (four), spaced;
    the policy and both devices' states before the round."""
    pol = AdaptiveScheduler(CFG, SPACED)
    d0 = dev(Role.DECODE, seqs("a", 4, now), device_id="d0")
    d1 = dev(Role.DECODE, seqs("b", 1, now), device_id="d1")
    assert switches(pol.decide(now, NodeSnapshot((d0, d1), (WaitingPrompt("p", 1000, now, 100),)))) == \
        [("d1", Role.PREFILL, "handoff")]
    return pol, d0, d1


def test_prefilled_sequences_move_out_and_the_window_closes_after_dwell_idle():
    now = 1.0
    pol, d0, d1 = _opened(now)
    # the window's prompt has its first token: it moves; the window stays open for the next prompt
    t = now + 0.05
    fresh = ResidentSeq("p-0", t, 1, 1001, 100)
    h = dev(Role.PREFILL, (fresh,), device_id="d1", since=now + COST.pause_s)
    out = pol.decide(t, NodeSnapshot((d0, h)))
    assert moves(out) == [("p-0", "d1", "d0", "handoff")] and switches(out) == []
    # idle (the sequence left): open for the two-role policy's dwell, then back to DECODE
    idle = msgspec.structs.replace(h, resident=())
    assert switches(pol.decide(t + pol.dwell_s / 2, NodeSnapshot((d0, idle)))) == []
    assert switches(pol.decide(t + pol.dwell_s, NodeSnapshot((d0, idle)))) == [("d1", Role.DECODE, "drained")]
    # a prompt arriving while it is open goes to it, not in chunks to d0
    pol2, _, _ = _opened(now)
    out = pol2.decide(t, NodeSnapshot((d0, idle), (WaitingPrompt("q", 800, t, 100),)))
    assert [(p.request_id, p.device_id) for p in out if isinstance(p, Place)] == [("q", "d1")]


def test_a_sequence_no_device_has_room_for_closes_the_window():
    """The decode device's KV is full: the prefilled sequence cannot move, so the window closes
    ("blocked") and the sequence decodes where it is."""
    now = 1.0
    pol, d0, d1 = _opened(now)
    full = msgspec.structs.replace(d0, kv_free_blocks=0)
    h = dev(Role.PREFILL, (ResidentSeq("p-0", now + 0.05, 1, 1001, 100),), device_id="d1", since=now)
    out = pol.decide(now + 0.05, NodeSnapshot((full, h)))
    assert not moves(out) and switches(out) == [("d1", Role.DECODE, "blocked")]
    # with work still queued it closes too: the queue goes on as chunks, not ahead of the stuck sequence
    pol, _, _ = _opened(now)
    queued = msgspec.structs.replace(h, prefill_queue_tokens=500, prefill_queue_seqs=1, prefill_queue_oldest_s=now)
    assert switches(pol.decide(now + 0.05, NodeSnapshot((full, queued)))) == [("d1", Role.DECODE, "blocked")]


def test_a_destination_whose_step_would_miss_t_takes_no_sequence():
    """The only other device decodes 63 sequences: with one more its step passes T, so no hand-off
    opens (its residents could not move), and the prompt goes in spaced chunks as before."""
    pol = AdaptiveScheduler(CFG, SPACED)
    now = 1.0
    crowded = tuple(ResidentSeq(f"a{i}", now - 10 * T, 10, 500, 200) for i in range(63))
    d0 = dev(Role.DECODE, crowded, device_id="d0")
    d1 = dev(Role.DECODE, seqs("b", 1, now), device_id="d1")
    assert SPACED.decode_step_s(64, 63 * 500 + 500) > T >= SPACED.decode_step_s(63, 63 * 500)
    out = pol.decide(now, NodeSnapshot((d0, d1), (WaitingPrompt("p", 1000, now, 100),)))
    assert not moves(out) and ("d1", Role.PREFILL, "handoff") not in switches(out)


def test_the_handoff_device_takes_prompts_only_within_the_ttft_target():
    """Prompts past what the hand-off device prefills within ``ttft_urgency x ttft_slo`` (100 ms here)
    are left to the other devices (spaced chunks there), not queued behind it."""
    pol = AdaptiveScheduler(CFG, SPACED)
    now = 1.0
    d0 = dev(Role.DECODE, seqs("a", 4, now), device_id="d0")
    d1 = dev(Role.DECODE, seqs("b", 1, now), device_id="d1")
    waiting = tuple(WaitingPrompt(f"p{i}", 2000, now, 100) for i in range(6))
    out = pol.decide(now, NodeSnapshot((d0, d1), waiting))
    on_d1 = [p.request_id for p in out if isinstance(p, Place) and p.device_id == "d1"]
    assert on_d1[0] == "p0" and len(on_d1) < 6
    target = CFG.ttft_urgency * CFG.ttft_slo_ms / 1e3
    assert pol.prefill_s(2000 * (len(on_d1) - 1)) <= target + COST.pause_s < pol.prefill_s(2000 * (len(on_d1) + 1))


def test_no_handoff_for_short_outputs_nor_where_an_empty_device_chunks_as_fast():
    """A prompt expecting 3 tokens: a hand-off's first gap (a destination's spaced mixed step, then its
    decode step) would break its mean gap, so no window opens. An empty device runs chunks with no
    resident to space them: as fast as a window in one configuration, so nothing is handed off."""
    pol = AdaptiveScheduler(CFG, SPACED)
    now = 1.0
    d0, d1 = dev(Role.DECODE, seqs("a", 4, now), device_id="d0"), dev(Role.DECODE, seqs("b", 1, now), device_id="d1")
    out = pol.decide(now, NodeSnapshot((d0, d1), (WaitingPrompt("p", 1000, now, 3),)))
    assert not moves(out) and all(why != "handoff" for *_, why in switches(out))
    empty = dev(Role.DECODE, (), device_id="d1")
    out = AdaptiveScheduler(CFG, SPACED).decide(now, NodeSnapshot((d0, empty), (WaitingPrompt("p", 1000, now, 100),)))
    assert not moves(out) and switches(out) == [("d1", Role.MIXED, "chunks_fit")]


class _Eager(CostModel, frozen=True, kw_only=True):
    """Decode ~12 ms, a mixed step 25 ms more: spaced at TPOT 20 ms (T = 18 ms)."""

    def mixed_step_s(self, prompt_tokens: int, decode_seqs: int, context_tokens: int) -> float:
        base = CostModel.mixed_step_s(self, prompt_tokens, decode_seqs, context_tokens)
        return base + (0.025 if prompt_tokens > 0 and decode_seqs > 0 else 0.0)


def test_a_handed_off_sequence_never_lands_on_a_device_the_same_round_sends_to_a_window():
    """d1 has its own queued prompt work and takes it as a window ("cheaper") in the round that opens
    the hand-off on d0: d0's resident goes to d2, which keeps decoding, not to d1 (found by a helper's
    review: the moves were decided before the windows)."""
    cost = _Eager(prefill_fixed_s=0.002, prefill_per_token_s=2e-5, decode_fixed_s=0.012, decode_per_seq_s=1e-4,
                  decode_per_context_token_s=1e-8, pause_s=0.001)
    pol = AdaptiveScheduler(RoleSchedulerConfig(tpot_slo_ms=20, ttft_slo_ms=2000, prefill_token_budget=2048), cost,
                            max_step_tokens=2048)
    now = 1.0

    def d(i, n, **kw):
        res = tuple(ResidentSeq(f"s{i}-{j}", now - 0.05, 10, 1500, 150) for j in range(n))
        return DeviceState(device_id=f"d{i}", role=Role.DECODE, resident=res, kv_free_blocks=8000,
                           kv_total_blocks=8000, **kw)

    snap = NodeSnapshot((d(0, 1), d(1, 2, prefill_queue_tokens=1500, prefill_queue_seqs=1, prefill_queue_oldest_s=now),
                         d(2, 6)), (WaitingPrompt("p", 1500, now, 150),))
    out = pol.decide(now, snap)
    assert ("d0", Role.PREFILL, "handoff") in switches(out)
    windows = {dev_id for dev_id, to, why in switches(out) if to is Role.PREFILL and why != "handoff"}
    assert windows == {"d1"}
    assert moves(out) == [("s0-0", "d0", "d2", "handoff")]


def _eager_policy() -> AdaptiveScheduler:
    cost = _Eager(prefill_fixed_s=0.002, prefill_per_token_s=2e-5, decode_fixed_s=0.012, decode_per_seq_s=1e-4,
                  decode_per_context_token_s=1e-8, pause_s=0.001)
    return AdaptiveScheduler(RoleSchedulerConfig(tpot_slo_ms=20, ttft_slo_ms=2000, prefill_token_budget=2048), cost,
                             max_step_tokens=2048)


def _d(name, role, resident=(), kv=8000, **kw) -> DeviceState:
    return DeviceState(device_id=name, role=role, resident=resident, kv_free_blocks=kv, kv_total_blocks=8000, **kw)


def _res(prefix, n, now):
    return tuple(ResidentSeq(f"{prefix}{i}", now - 0.05, 10, 1500, 150) for i in range(n))


def test_a_second_handoff_counts_the_room_the_open_ones_moves_take():
    """H hands off; its prefilled sequence will take most of B's room. A second window does not open on
    A (fewest residents), whose resident would then have nowhere to go (it would close "blocked" a
    round later, two pauses for nothing), but on B, whose residents A can take (found by a helper's
    review)."""
    pol = _eager_policy()
    now = 1.0
    pol.decide(now, NodeSnapshot((_d("H", Role.DECODE, _res("h", 1, now)), _d("A", Role.DECODE, _res("a", 2, now)),
                                  _d("B", Role.DECODE, _res("b", 3, now))), (WaitingPrompt("p1", 1500, now, 150),)))
    t = now + 0.05
    H = _d("H", Role.PREFILL, (ResidentSeq("p1-0", t, 1, 1501, 150),), kv=50, role_since_s=now + 0.001)
    A = _d("A", Role.DECODE, _res("a", 1, now))
    B = _d("B", Role.DECODE, _res("b", 2, now), kv=110)  # room for one sequence
    out = pol.decide(t, NodeSnapshot((H, A, B), (WaitingPrompt("p2", 1500, t, 150),)))
    opened = [dev_id for dev_id, to, why in switches(out) if why == "handoff"]
    assert opened == ["B"]
    assert sorted(m[0] for m in moves(out)) == ["b0", "b1", "p1-0"] and all(m[2] == "A" for m in moves(out))


def test_no_handoff_for_a_prompt_whose_sequence_could_not_move():
    """B has room for A's resident but not for the prompt's sequence once prefilled: a hand-off window
    would prefill it, find it stuck and close ("blocked"), two pauses for nothing (found by a helper's
    review), so none opens."""
    now = 1.0
    out = _eager_policy().decide(now, NodeSnapshot((_d("A", Role.DECODE, _res("a", 1, now)),
                                                    _d("B", Role.DECODE, _res("b", 2, now), kv=110)),
                                                   (WaitingPrompt("p", 1500, now, 150),)))
    assert all(why != "handoff" for *_, why in switches(out)) and not moves(out)
    # with the room, it opens
    out = _eager_policy().decide(now, NodeSnapshot((_d("A", Role.DECODE, _res("a", 1, now)),
                                                    _d("B", Role.DECODE, _res("b", 2, now), kv=300)),
                                                   (WaitingPrompt("p", 1500, now, 150),)))
    assert ("A", Role.PREFILL, "handoff") in switches(out)


def test_a_slow_link_copy_counts_in_the_first_gap():
    """The first test's node and prompt (1,000 tokens, 100 expected): a 10 ms copy still opens the window;
    a copy of 1 s (1 ms per token) makes the first gap ``2 m + x + d`` more than the prompt's mean gap
    absorbs ((N - 1) tau - (N - 2) T = 0.54 s), so no window opens and the prompt goes in spaced chunks."""
    now = 1.0
    d0, d1 = dev(Role.DECODE, seqs("a", 4, now), device_id="d0"), dev(Role.DECODE, seqs("b", 1, now), device_id="d1")
    snap = NodeSnapshot((d0, d1), (WaitingPrompt("p", 1000, now, 100),))
    fast = msgspec.structs.replace(CFG, copy_s_per_token=1e-5)  # 10 ms, under a mixed step
    assert switches(AdaptiveScheduler(fast, SPACED).decide(now, snap)) == [("d1", Role.PREFILL, "handoff")]
    slow = msgspec.structs.replace(CFG, copy_s_per_token=1e-3)
    out = AdaptiveScheduler(slow, SPACED).decide(now, snap)
    assert not moves(out) and all(why != "handoff" for *_, why in switches(out))
    assert any(isinstance(p, Place) for p in out)  # placed elsewhere, not left behind


class _Estimates:
    """The estimates the hand-off windows read of a policy (:class:`PolicyEstimates`), by hand and mutable,
    with no scheduler: the tests' cost model, 1 ms of prefill per 100 prompt tokens, no prompt urgent."""

    def __init__(self, T: float = T, dwell_s: float = 0.1):
        self.config, self.cost, self.T, self.wmax, self.pause_s, self.dwell_s = CFG, COST, T, 0.2, 0.005, dwell_s

    def prefill_s(self, tokens: int) -> float:
        return tokens / 1e5

    def urgent(self, w: WaitingPrompt, now_s: float) -> bool:
        return False


class _Mix:
    """A decode device's round (the adaptive policy's ``_Mix``): no chunk fits, ``s`` residents of ``k`` tokens."""

    def __init__(self, s: int, k: int):
        self.chunk, self.max_chunk, self.s, self.k = 0, 0, s, k


def _round(hand_resident=()):
    """A hand-off device ``h`` in PREFILL, and decode devices ``a`` (4 residents) and ``b`` (1)."""
    devs = [_Dev(dev(Role.PREFILL, hand_resident, device_id="h"), 0), _Dev(dev(device_id="a"), 1),
            _Dev(dev(device_id="b"), 2)]
    return devs[0], devs[1:], {"a": _Mix(4, 2000), "b": _Mix(1, 500)}


def test_the_windows_part_alone_moves_to_the_device_that_keeps_pace_reading_t_at_each_call():
    est = _Estimates()
    part = HandoffWindows(est, lambda dv, w: 2)
    h, dec, mixes = _round(seqs("r", 1, 0.0))
    out: list = []
    part.hand_off(0.0, [h], dec, mixes, out)
    assert moves(out) == [("r0", "h", "b", "handoff")] and switches(out) == []  # b's decode step is the shorter
    assert dec[1].slots == dev().seq_slots_free - 1  # the move's room is taken from b for the rest of the round
    est.T = 0.005  # under any decode step here: no destination keeps pace now, so the window closes
    h, dec, mixes = _round(seqs("r", 1, 0.0))
    out = []
    part.hand_off(0.0, [h], dec, mixes, out)
    assert moves(out) == [] and switches(out) == [("h", Role.DECODE, "blocked")]


def test_the_windows_part_owns_its_dwell_state_and_closes_drained_after_the_dwell_of_now():
    est = _Estimates(dwell_s=0.1)
    part, other = HandoffWindows(est, lambda dv, w: 2), HandoffWindows(est, lambda dv, w: 2)
    h, dec, mixes = _round()
    out: list = []
    left = part.place(0.0, [WaitingPrompt("p", 400, 0.0, expected_output_tokens=200)], [h], out, dec, mixes)
    assert left == [] and [(p.request_id, p.device_id) for p in out] == [("p", "h")]
    assert part.open_devices == ["h"] and other.open_devices == []  # each part's own state
    h, dec, mixes = _round()  # the next round: the prompt was prefilled and moved, h holds nothing
    assert part.devices(0.05, [h, *dec]) == [h] and other.devices(0.05, [h, *dec]) == []
    out = []
    part.hand_off(0.05, [h], dec, mixes, out)
    assert out == [] and part.open_devices == ["h"]  # 50 ms idle, under the 100 ms dwell
    est.dwell_s = 0.04  # a shorter pause measured since: the dwell is read at each call
    part.hand_off(0.05, [h], dec, mixes, out)
    assert switches(out) == [("h", Role.DECODE, "drained")]
    assert part.open_devices == []
