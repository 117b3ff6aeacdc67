"""The time-shared imbalance fallback (node.core.imbalance) on hand-built snapshots."""

from __future__ import annotations

import msgspec
import pytest

from node.core.cost import CostModel
from node.core.imbalance import ImbalanceConfig, ImbalancePolicy, Migrate
from node.core.role_state import WaitingPrompt, urgent_at
from node.core.roles import DeviceState, NodeSnapshot, ResidentSeq, Role, blocks_for

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here

# 20 us per prompt token; decode 8 ms + 0.1 ms per sequence + 1 us per context token; 5 ms switch.
COST = CostModel(prefill_fixed_s=0.002, prefill_per_token_s=2e-5, decode_fixed_s=0.008, decode_per_seq_s=1e-4,
                 decode_per_context_token_s=1e-6, pause_s=0.005)
CFG = ImbalanceConfig(threshold=1.0, tpot_slo_ms=50, prefill_token_budget=2048)  # T = 45 ms
NOW = 10.0


def policy(cfg: ImbalanceConfig = CFG, cost: CostModel = COST) -> ImbalancePolicy:
    return ImbalancePolicy(cfg, cost)


def seq(sid: str, ctx: int = 100, out: int = 1, first: float = NOW, expected: int = 0, moved: float | None = None):
    return ResidentSeq(sid, first, out, ctx, expected, moved)


def dev(device_id: str, role: Role = Role.DECODE, resident=(), **kw) -> DeviceState:
    kw.setdefault("kv_free_blocks", 1000)
    kw.setdefault("kv_total_blocks", 1000)
    kw.setdefault("seq_slots_free", 256)
    return DeviceState(device_id=device_id, role=role, resident=tuple(resident), **kw)


def apply(snap: NodeSnapshot, moves: list[Migrate], now: float) -> NodeSnapshot:
    """What the shell does with the moves: each sequence now lives on its destination (cooling)."""
    devices = {d.device_id: d for d in snap.devices}
    for m in moves:
        src, dst = devices[m.src_device], devices[m.dst_device]
        (s,) = [s for s in src.resident if s.request_id == m.seq_id]
        need = blocks_for(s.context_tokens + 1, dst.block_size)
        devices[m.src_device] = msgspec.structs.replace(
            src, resident=tuple(x for x in src.resident if x is not s), kv_free_blocks=src.kv_free_blocks + need,
            seq_slots_free=src.seq_slots_free + 1)
        devices[m.dst_device] = msgspec.structs.replace(
            dst, resident=dst.resident + (msgspec.structs.replace(s, moved_s=now),),
            kv_free_blocks=dst.kv_free_blocks - need, seq_slots_free=dst.seq_slots_free - 1)
    return NodeSnapshot(tuple(devices[d.device_id] for d in snap.devices), snap.waiting)


def load_s(p: ImbalancePolicy, st: DeviceState) -> float:
    return p.load_s(len(st.resident), sum(s.context_tokens for s in st.resident))


# --- trigger "tpot" ----------------------------------------------------------------------------
def window_snapshot(queue_tokens: int = 4000, **dst_kw) -> NodeSnapshot:
    """p0 prefills a queue while holding a newborn (deadline NOW + 45 ms); d1 decodes two sequences."""
    return NodeSnapshot((
        dev("p0", Role.PREFILL, [seq("new-0", ctx=300)], prefill_queue_tokens=queue_tokens, prefill_queue_seqs=4,
            role_since_s=NOW - 0.01),
        dev("d1", Role.DECODE, [seq("old-0", first=NOW - 1, out=30), seq("old-1", first=NOW - 1, out=30)], **dst_kw),
    ))


def test_tpot_moves_a_sequence_the_coming_window_would_make_late():
    p = policy()
    snap = window_snapshot()
    assert p.source_next_token_s(snap.devices[0], NOW) > p.deadline_s(snap.devices[0].resident[0])
    assert p.decide(NOW, snap) == [Migrate("new-0", "p0", "d1", "tpot")]


def test_tpot_keeps_a_sequence_the_window_does_not_delay_past_its_target():
    p = policy()
    snap = window_snapshot(queue_tokens=100)  # P(100) = 4 ms: next token by NOW + ~17 ms < NOW + 45 ms
    assert p.source_next_token_s(snap.devices[0], NOW) < p.deadline_s(snap.devices[0].resident[0])
    assert p.decide(NOW, snap) == []


def test_a_long_pause_makes_even_an_empty_window_late():
    """The pause back to DECODE alone exceeds T: every resident of a prefill device is late."""
    p = policy(msgspec.structs.replace(CFG, reconfig_pause_ms=200))
    assert p.decide(NOW, window_snapshot(queue_tokens=0)) == [Migrate("new-0", "p0", "d1", "tpot")]


def test_tpot_needs_a_decode_side_destination():
    snap = window_snapshot()
    both_prefill = NodeSnapshot((snap.devices[0], msgspec.structs.replace(snap.devices[1], role=Role.PREFILL)))
    assert policy().decide(NOW, both_prefill) == []
    switching = NodeSnapshot((snap.devices[0], msgspec.structs.replace(
        snap.devices[1], role=Role.SWITCHING, switching_to=Role.DECODE, switch_done_s=NOW + 0.005)))
    assert policy().decide(NOW, switching) == [Migrate("new-0", "p0", "d1", "tpot")]


def test_a_device_switching_to_prefill_is_a_source():
    snap = window_snapshot()
    src = msgspec.structs.replace(snap.devices[0], role=Role.SWITCHING, switching_to=Role.PREFILL,
                                  switch_done_s=NOW + 0.005)
    assert policy().decide(NOW, NodeSnapshot((src, snap.devices[1]))) == [Migrate("new-0", "p0", "d1", "tpot")]


def test_tpot_respects_free_blocks_reservations_and_slots():
    p = policy()
    need = blocks_for(301, 16)  # the newborn's context plus its next token
    assert p.decide(NOW, window_snapshot(kv_free_blocks=need)) != []
    assert p.decide(NOW, window_snapshot(kv_free_blocks=need - 1)) == []
    assert p.decide(NOW, window_snapshot(kv_free_blocks=need + 5, kv_reserved_blocks=6)) == []
    assert p.decide(NOW, window_snapshot(seq_slots_free=0)) == []


def test_room_counts_the_expected_rest_of_the_output():
    p = policy()
    snap = window_snapshot(kv_free_blocks=40)
    src = snap.devices[0]
    long = msgspec.structs.replace(src, resident=(seq("new-0", ctx=300, expected=1000),))  # 1300 tokens: 82 blocks
    assert p.decide(NOW, NodeSnapshot((long, snap.devices[1]))) == []
    short = msgspec.structs.replace(src, resident=(seq("new-0", ctx=300, expected=50),))  # 349 tokens: 22 blocks
    assert p.decide(NOW, NodeSnapshot((short, snap.devices[1]))) == [Migrate("new-0", "p0", "d1", "tpot")]


def test_tpot_never_pushes_the_destination_past_the_target():
    many = [seq(f"old-{i}", ctx=1000, first=NOW - 1, out=30) for i in range(36)]  # step 8 + 3.6 + 36 = 47.6 ms
    snap = window_snapshot()
    assert policy().decide(NOW, NodeSnapshot((snap.devices[0], dev("d1", Role.DECODE, many)))) == []


def test_tpot_picks_the_destination_that_serves_soonest_and_moves_late_ones_first():
    snap = window_snapshot()
    src = msgspec.structs.replace(snap.devices[0], resident=(
        seq("b", ctx=50, first=NOW - 0.02), seq("a", ctx=50, first=NOW - 0.03), seq("c", ctx=50, first=NOW)))
    busy = dev("d1", Role.DECODE, [seq("x")], busy_until_s=NOW + 0.03)
    free = dev("d2", Role.DECODE, [seq("y")])
    out = policy().decide(NOW, NodeSnapshot((src, busy, free)))
    assert [m.seq_id for m in out] == ["a", "b", "c"] and {m.dst_device for m in out} == {"d2"}


def test_moves_per_round_are_bounded():
    snap = window_snapshot()
    src = msgspec.structs.replace(snap.devices[0], resident=tuple(seq(f"n{i}") for i in range(10)))
    out = policy(msgspec.structs.replace(CFG, max_moves=3)).decide(NOW, NodeSnapshot((src, snap.devices[1])))
    assert len(out) == 3


# --- trigger "imbalance" -----------------------------------------------------------------------
def heavy_light() -> NodeSnapshot:
    heavy = [seq(f"h{i}", ctx=2000 + i, first=NOW - 2, out=50) for i in range(12)]  # 8 + 1.2 + 24 = 33 ms
    light = [seq("l0", ctx=100, first=NOW - 2, out=50)]  # 8.2 ms
    return NodeSnapshot((dev("d0", Role.DECODE, heavy), dev("d1", Role.DECODE, light)))


def test_imbalance_moves_from_the_most_to_the_least_loaded_until_balanced():
    p = policy(msgspec.structs.replace(CFG, max_moves=16))
    snap = heavy_light()
    before = [load_s(p, d) for d in snap.devices]
    assert before[0] > 2 * before[1]
    out = p.decide(NOW, snap)
    assert out and all(m.src_device == "d0" and m.dst_device == "d1" and m.reason == "imbalance" for m in out)
    after = [load_s(p, d) for d in apply(snap, out, NOW).devices]
    assert max(after) < max(before)
    assert max(after) <= 2 * min(after)  # within the threshold: L_max / L_min - 1 <= 1


def test_imbalance_below_the_threshold_moves_nothing():
    p = policy()
    snap = heavy_light()
    light = [seq(f"l{i}", ctx=1000, first=NOW - 2, out=50) for i in range(6)]  # 14.6 ms vs 33 ms: ratio 2.26
    lighter = NodeSnapshot((snap.devices[0], dev("d1", Role.DECODE, light)))
    assert p.decide(NOW, lighter) != []
    assert policy(msgspec.structs.replace(CFG, threshold=1.5)).decide(NOW, lighter) == []


def test_threshold_zero_turns_the_fallback_off():
    off = policy(msgspec.structs.replace(CFG, threshold=0.0))
    assert off.decide(NOW, heavy_light()) == []
    assert off.decide(NOW, window_snapshot()) == []
    with pytest.raises(ValueError):
        policy(msgspec.structs.replace(CFG, threshold=-1.0))


def test_imbalance_only_between_decode_role_holders():
    p = policy()
    snap = heavy_light()
    assert p.decide(NOW, NodeSnapshot((snap.devices[0], dev("d1", Role.DECODE)))) == []  # empty: parks, not a target
    prefill = msgspec.structs.replace(snap.devices[1], role=Role.PREFILL)
    assert p.decide(NOW, NodeSnapshot((snap.devices[0], prefill))) == []
    switching = msgspec.structs.replace(snap.devices[1], role=Role.SWITCHING, switching_to=Role.DECODE)
    assert p.decide(NOW, NodeSnapshot((snap.devices[0], switching))) == []


def test_imbalance_respects_room_on_the_destination():
    p = policy()
    snap = heavy_light()
    full = msgspec.structs.replace(snap.devices[1], kv_free_blocks=10, kv_reserved_blocks=5)  # needs 126 blocks
    assert p.decide(NOW, NodeSnapshot((snap.devices[0], full))) == []
    no_slot = msgspec.structs.replace(snap.devices[1], seq_slots_free=0)
    assert p.decide(NOW, NodeSnapshot((snap.devices[0], no_slot))) == []


def test_a_move_that_only_swaps_the_heavy_device_is_not_made():
    """One long sequence against one short one: moving either makes the other side the heavy one."""
    p = policy(msgspec.structs.replace(CFG, threshold=0.01))
    snap = NodeSnapshot((dev("d0", Role.DECODE, [seq("long", ctx=20000)]), dev("d1", Role.DECODE, [seq("short", ctx=10)])))
    assert load_s(p, snap.devices[0]) > 1.01 * load_s(p, snap.devices[1])
    assert p.decide(NOW, snap) == []


def test_no_ping_pong_recently_moved_sequences_stay():
    p = policy(msgspec.structs.replace(CFG, max_moves=16, cooldown_ms=1000))
    snap = heavy_light()
    moved = {m.seq_id for m in p.decide(NOW, snap)}
    after = apply(snap, p.decide(NOW, snap), NOW)
    # Make the destination the heavy one: the moved sequences still may not go back while cooling.
    d1 = after.devices[1]
    heavy_d1 = msgspec.structs.replace(d1, resident=d1.resident + tuple(seq(f"z{i}", ctx=5000, moved=NOW) for i in range(6)))
    d0 = msgspec.structs.replace(after.devices[0], resident=after.devices[0].resident[:1])
    flipped = NodeSnapshot((d0, heavy_d1))
    cooling = moved | {f"z{i}" for i in range(6)}
    assert not cooling & {m.seq_id for m in p.decide(NOW + 0.5, flipped)}
    assert cooling & {m.seq_id for m in p.decide(NOW + 2.0, flipped)}  # after the cooldown they may


def test_repeated_rounds_reach_a_fixed_point():
    """Rounds applied one after the other (cooldowns expired each time) stop moving: no cycle."""
    p = policy(msgspec.structs.replace(CFG, threshold=0.05, cooldown_ms=0))
    snap = NodeSnapshot((
        dev("d0", Role.DECODE, [seq(f"a{i}", ctx=100 * (i + 1)) for i in range(10)]),
        dev("d1", Role.DECODE, [seq("b0", ctx=50)]),
        dev("d2", Role.DECODE, [seq(f"c{i}", ctx=3000) for i in range(3)]),
    ))
    seen = set()
    for r in range(50):
        out = p.decide(NOW + r, snap)
        if not out:
            break
        key = tuple(tuple(sorted(s.request_id for s in d.resident)) for d in snap.devices)
        assert key not in seen, "the policy revisited a placement"
        seen.add(key)
        snap = apply(snap, out, NOW + r)
    else:
        pytest.fail("no fixed point after 50 rounds")
    loads = [load_s(p, d) for d in snap.devices]
    assert max(loads) < 0.008 + 1e-4 * 10 + 1e-6 * (5500 + 9000)  # below the starting maximum


def test_single_device_never_moves():
    assert policy().decide(NOW, NodeSnapshot((heavy_light().devices[0],))) == []


# --- peer nodes --------------------------------------------------------------------------------
def test_a_peer_takes_a_late_sequence_only_when_no_local_device_can():
    p = policy()
    alone = NodeSnapshot((window_snapshot().devices[0],))  # one device: nothing local to move to
    peer = dev("peer:h:1", Role.DECODE, [seq("x", ctx=50)])
    assert p.decide(NOW, alone) == []
    assert p.decide(NOW, alone, peers=(peer,)) == [Migrate("new-0", "p0", "peer:h:1", "tpot")]
    # a local decoding device that keeps pace is preferred to the peer
    assert p.decide(NOW, window_snapshot(), peers=(peer,)) == [Migrate("new-0", "p0", "d1", "tpot")]


def test_a_peer_behind_a_slow_link_or_without_room_is_not_used():
    alone = NodeSnapshot((window_snapshot().devices[0],))
    peer = dev("peer:h:1", Role.DECODE)
    slow = policy(msgspec.structs.replace(CFG, transfer_s_per_token=1e-3))  # 300 ms for the 300-token context
    assert slow.decide(NOW, alone, peers=(peer,)) == []
    full = dev("peer:h:1", Role.DECODE, kv_free_blocks=1)
    assert policy().decide(NOW, alone, peers=(full,)) == []


def test_imbalance_towards_a_peer_after_the_node_is_balanced():
    """8 long sequences on the only decoding device, an idle peer: moves until the loads are even,
    never past that; below the threshold nothing moves."""
    busy = dev("d0", Role.DECODE, [seq(f"s{i}", ctx=4000) for i in range(8)])
    idle_peer = dev("peer:h:1", Role.DECODE)
    moves = policy().decide(NOW, NodeSnapshot((busy,)), peers=(idle_peer,))
    assert moves and all(m.dst_device == "peer:h:1" and m.reason == "imbalance" for m in moves)
    p = policy()
    left, sent = 8 - len(moves), len(moves)
    assert p.load_s(left, left * 4000) <= 2 * p.load_s(sent, sent * 4000)  # within 1 + threshold now
    assert p.load_s(left + 1, (left + 1) * 4000) > 2 * p.load_s(sent - 1, (sent - 1) * 4000)  # not before
    assert sent <= 4  # never past even
    calm = dev("d0", Role.DECODE, [seq("s0", ctx=100)])  # d(1, 100) / d(0, 0) - 1 < 1
    assert policy().decide(NOW, NodeSnapshot((calm,)), peers=(idle_peer,)) == []
    # a local DECODE device holding work is balanced with first
    two = NodeSnapshot((busy, dev("d1", Role.DECODE, [seq("t0", ctx=100)])))
    first = policy().decide(NOW, two, peers=(idle_peer,))
    assert first[0].dst_device == "d1"


def test_drain_sends_every_decoding_sequence_to_the_least_loaded_peer_with_room():
    src = dev("d0", Role.DECODE, [seq("a", ctx=100), seq("b", ctx=100, moved=NOW - 0.1)])
    full = dev("peer:full:1", Role.DECODE, kv_free_blocks=0)
    busy = dev("peer:busy:1", Role.DECODE, [seq(f"x{i}", ctx=1000) for i in range(6)])
    idle = dev("peer:idle:1", Role.DECODE)
    p = policy(msgspec.structs.replace(CFG, threshold=0))  # the drain ignores the threshold
    assert p.drain(NOW, NodeSnapshot((src,)), (full, busy, idle)) == [Migrate("a", "d0", "peer:idle:1", "drain")]
    assert p.drain(NOW + 2, NodeSnapshot((src,)), (full,)) == []  # no room anywhere: stays for later


# --- copies inside the node hold their source -----------------------------------------------------
def test_a_local_copy_is_added_to_the_destinations_next_token():
    snap = window_snapshot()
    t_src = policy().source_next_token_s(snap.devices[0], NOW)
    slow = policy(msgspec.structs.replace(CFG, local_transfer_s_per_token=(t_src - NOW) / 300))  # copy ends past t_src
    assert slow.decide(NOW, snap) == []
    fast = policy(msgspec.structs.replace(CFG, local_transfer_s_per_token=1e-6))
    assert fast.decide(NOW, snap) == [Migrate("new-0", "p0", "d1", "tpot")]


def test_local_copies_may_not_push_the_sources_queue_past_its_ttft_slo():
    # p0's oldest queued prompt arrived 0.9 s ago (TTFT SLO 1 s) and its window prefills until
    # NOW + P(4000) = NOW + 84 ms: 16 ms of slack. A 300-token copy takes 30 ms at 1e-4 s/token, 3 ms at 1e-5.
    base = window_snapshot()
    # new-0 has 1,000 tokens to come, so that the 30 ms copy pays for itself (see the next test) and
    # only the TTFT slack decides
    long_lived = msgspec.structs.replace(base.devices[0].resident[0], expected_output_tokens=1000)
    src = msgspec.structs.replace(base.devices[0], prefill_queue_oldest_s=NOW - 0.9, resident=(long_lived,))
    snap = NodeSnapshot((src, base.devices[1]))
    slow = policy(msgspec.structs.replace(CFG, local_transfer_s_per_token=1e-4, ttft_slo_ms=1000))
    assert slow.window_end_s(src, NOW) == pytest.approx(NOW + 0.084)
    assert slow.decide(NOW, snap) == []
    fast = policy(msgspec.structs.replace(CFG, local_transfer_s_per_token=1e-5, ttft_slo_ms=1000))
    assert fast.decide(NOW, snap) == [Migrate("new-0", "p0", "d1", "tpot")]
    assert policy(msgspec.structs.replace(CFG, local_transfer_s_per_token=1e-4, ttft_slo_ms=2000)).decide(NOW, snap) \
        == [Migrate("new-0", "p0", "d1", "tpot")]  # a looser TTFT SLO leaves room for the copy


def test_an_imbalance_move_must_pay_for_its_copy():
    # each move out of d0 saves it ~2 ms a step; a 2,000-token copy at 1e-5 s/token holds it 20 ms
    costly = policy(msgspec.structs.replace(CFG, local_transfer_s_per_token=1e-5, max_moves=16))
    snap = heavy_light()
    assert costly.decide(NOW, snap) == []  # expected output unknown: one step's saving counts
    long_lived = [msgspec.structs.replace(s, expected_output_tokens=1000) for s in snap.devices[0].resident]
    snap2 = NodeSnapshot((msgspec.structs.replace(snap.devices[0], resident=tuple(long_lived)), snap.devices[1]))
    out = costly.decide(NOW, snap2)  # 950 more tokens each: the saving outweighs the copy
    assert out and all(m.reason == "imbalance" and m.dst_device == "d1" for m in out)
    assert policy(msgspec.structs.replace(CFG, max_moves=16)).decide(NOW, snap)  # free copies: moves as before


def test_an_imbalance_move_must_pay_for_the_queueing_its_copy_causes():
    # d0: 12 sequences of ~2,000 tokens (33.3 ms a step); d1: 20 short ones (10.2 ms). Moving one h
    # (2,000 tokens, 100 tokens still to come) saves d0 2.1 ms a step, so the old rule moved it
    # (2.1 ms * 100 > 20 ms copy at 1e-5 s/token). But its copy stalls all 32 residents 20 ms (640 ms of
    # sequence-time) and each of d1's 20 steps grows by 2.1 ms: 44.1 ms * 100 saved < 42 ms * 100 + 640
    # ms lost, so the cost-aware rule keeps it where it is (move_pays' docstring).
    p = policy(msgspec.structs.replace(CFG, local_transfer_s_per_token=1e-5, max_moves=16))
    heavy = [seq(f"h{i}", ctx=2000 + i, first=NOW - 2, out=50, expected=150) for i in range(12)]
    busy = [seq(f"l{i}", ctx=10, first=NOW - 2, out=50) for i in range(20)]
    snap = NodeSnapshot((dev("d0", Role.DECODE, heavy), dev("d1", Role.DECODE, busy)))
    assert load_s(p, snap.devices[0]) > 3 * load_s(p, snap.devices[1])  # past the threshold
    assert p.decide(NOW, snap) == []
    # the same imbalance against an idle-ish destination (one resident) pays: 12 + 1 stalled, not 32
    light = NodeSnapshot((snap.devices[0], dev("d1", Role.DECODE, busy[:1])))
    out = p.decide(NOW, light)
    assert out and all(m.reason == "imbalance" and m.src_device == "d0" for m in out)
    # the rule on the same figures (s): 12 residents at 33.3 -> 31.2 ms; 20 at 10.2 -> 12.3 ms, or 1 at 8.2 -> 10.3 ms
    assert p.move_pays(heavy[0], 12, 0.0333, 0.0312, 20, 0.0102, 0.0123) is False
    assert p.move_pays(heavy[0], 12, 0.0333, 0.0312, 1, 0.0082, 0.0103) is True


def test_a_tpot_move_must_pay_for_the_queueing_its_copy_causes():
    # p0 (a window until ~NOW + 97 ms) holds new-0 (300 tokens, one token to come) and 4 queued prompts;
    # d1 decodes 2 sequences. A 30 ms copy (1e-4 s/token) gets new-0 its token ~58 ms sooner, but holds
    # the window's 4 prompts and d1's 2 residents 30 ms each (180 ms): no move (the old rule moved it).
    # With 1,000 tokens to come, p0's later steps shorter for 4 sequences and d1's longer for 2 outweigh it.
    snap = window_snapshot()
    p = policy(msgspec.structs.replace(CFG, local_transfer_s_per_token=1e-4, ttft_slo_ms=5000))
    assert p.decide(NOW, snap) == []
    long_lived = msgspec.structs.replace(snap.devices[0].resident[0], expected_output_tokens=1000)
    snap2 = NodeSnapshot((msgspec.structs.replace(snap.devices[0], resident=(long_lived,)), snap.devices[1]))
    assert p.decide(NOW, snap2) == [Migrate("new-0", "p0", "d1", "tpot")]
    # a cheap copy (3 ms) pays even for one token: ~85 ms sooner against 6 x 3 ms
    assert policy(msgspec.structs.replace(CFG, local_transfer_s_per_token=1e-5, ttft_slo_ms=5000)).decide(NOW, snap) \
        == [Migrate("new-0", "p0", "d1", "tpot")]


# --- no local tpot move while prompts wait urgent (a burst on two CPU devices) ---------------------
def _with_waiting(snap: NodeSnapshot, arrival_s: float, n: int = 8) -> NodeSnapshot:
    """The snapshot with ``n`` unplaced 280-token prompts that arrived at ``arrival_s``."""
    return NodeSnapshot(snap.devices, tuple(WaitingPrompt(f"w{i}", 280, arrival_s, 10) for i in range(n)))


def test_no_local_tpot_move_while_a_waiting_prompt_is_urgent():
    # The burst of the report: p0 prefills, its newborn would be late; d1 decodes. A move would hold d1 in
    # DECODE (a newborn has no stall budget) while the queue waits, so d1 could never take a window.
    p = policy()  # TTFT SLO 1 s, urgency 0.5: urgent once age + p + P(280) >= 0.5 s
    fresh = _with_waiting(window_snapshot(), arrival_s=NOW)  # age 0: 5 ms + 7.6 ms, not urgent
    assert p.decide(NOW, fresh) == [Migrate("new-0", "p0", "d1", "tpot")]
    old = _with_waiting(window_snapshot(), arrival_s=NOW - 0.6)
    assert urgent_at(old.waiting[0], NOW, p.pause_s, COST.prefill_s(280, 2048), 0.5, 1000)
    assert p.decide(NOW, old) == []
    # the threshold is the role scheduler's: just under it, the move is made
    edge = NOW - (0.5 - p.pause_s - COST.prefill_s(280, 2048)) + 1e-3
    assert p.decide(NOW, _with_waiting(window_snapshot(), arrival_s=edge)) == [Migrate("new-0", "p0", "d1", "tpot")]


def test_an_urgent_queue_still_lets_a_peer_take_a_late_sequence():
    # a peer node's device is not this node's prefill capacity: the move there is still made
    p = policy()
    snap = _with_waiting(window_snapshot(), arrival_s=NOW - 0.6)
    peer = dev("peer:d0", Role.DECODE)
    assert p.decide(NOW, snap, (peer,)) == [Migrate("new-0", "p0", "peer:d0", "tpot")]


def test_an_urgent_queue_leaves_the_imbalance_trigger_alone():
    # only tpot moves into a decode device are held back; balancing two decoding devices goes on
    p = policy()
    heavy = [seq(f"h{i}", ctx=4000, out=5, first=NOW - 1) for i in range(8)]
    snap = NodeSnapshot((dev("d0", Role.DECODE, heavy), dev("d1", Role.DECODE, [seq("l0", ctx=10, out=5, first=NOW - 1)])),
                        tuple(WaitingPrompt(f"w{i}", 280, NOW - 0.6, 10) for i in range(4)))
    assert [m.reason for m in p.decide(NOW, snap)] and all(m.reason == "imbalance" for m in p.decide(NOW, snap))
