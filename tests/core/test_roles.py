"""The time-shared role scheduler, on hand-made snapshots and on the simulator's live objects (a
``Batcher`` and ``BlockLedger`` per device, :class:`bench.sim.timeshared.TimeSharedSim`) with a stub cost
model on a virtual clock."""

from __future__ import annotations

import msgspec
import pytest

from bench.sim.config import SimConfig
from bench.sim.timeshared import TimeSharedSim
from bench.sim.trace import SimRequest
from node.core.cost import CostModel
from node.core.roles import (
    Decision, DeviceState, NodeSnapshot, Place, Reject, ResidentSeq, Role, RoleScheduler, RoleSchedulerConfig,
    SwitchRole, WaitingPrompt,
)

# A small GPU-ish device: 20 us per prompt token, ~8-20 ms decode steps, 5 ms role switch.
COST = CostModel(prefill_fixed_s=0.002, prefill_per_token_s=2e-5, decode_fixed_s=0.008, decode_per_seq_s=1e-4,
                 decode_per_context_token_s=1e-7, pause_s=0.005)
CFG = RoleSchedulerConfig(ttft_slo_ms=1000, tpot_slo_ms=50, min_window_ms=20, max_window_ms=200,
                          prefill_token_budget=2048)
EPS = 1e-9


def sim(sched: RoleScheduler, cost: CostModel, num_devices=1, kv_blocks=8192, **kw) -> TimeSharedSim:
    """A time-shared node of ``num_devices`` on the live batcher and ledger; no imbalance fallback (these
    tests are about the role policy alone); no batch cap to speak of."""
    cfg = SimConfig(mode="time-shared", devices=num_devices, kv_blocks=kv_blocks, max_model_len=8192,
                    max_num_seqs=4096, max_num_batched_tokens=sched.config.prefill_token_budget, **kw)
    return TimeSharedSim(sched, cost, cfg)


def make(num_devices=1, kv_blocks=8192, cfg=CFG, cost=COST):
    sched = RoleScheduler(cfg, cost)
    return sched, sim(sched, cost, num_devices, kv_blocks)


def lateness_s(trace, T: float) -> list[float]:
    """Per output token k (0-based): its time minus the TPOT target ``first + k*T``."""
    t = trace.token_times_s
    return [tk - (t[0] + k * T) for k, tk in enumerate(t)]


def one_window_s(sched: RoleScheduler, vn: TimeSharedSim) -> float:
    """The overrun the policy allows: one window, its two pauses and the longest decode step."""
    d_max = max(s.end_s - s.start_s for s in vn.steps if s.kind == "decode")
    return sched.wmax + 2 * sched.pause_s + d_max + EPS


def background(n=4, prompt=500, out=600):
    return [SimRequest(f"bg{i}", 0.0, prompt, out) for i in range(n)]


# --- decide() on hand-made snapshots ------------------------------------------------------------
def dev(role=Role.DECODE, since=0.0, resident=(), **kw) -> DeviceState:
    kw.setdefault("kv_free_blocks", 1000)
    kw.setdefault("kv_total_blocks", 1000)
    return DeviceState(device_id=kw.pop("device_id", "d0"), role=role, role_since_s=since,
                       resident=tuple(resident), **kw)


@pytest.mark.quick
def test_prompt_larger_than_any_device_is_rejected_and_others_wait():
    sched = RoleScheduler(CFG, COST)
    snap = NodeSnapshot((dev(Role.PREFILL, kv_total_blocks=10, kv_free_blocks=0, prefill_queue_tokens=50),),
                        (WaitingPrompt("big", 10 * 16, 0.0, 8), WaitingPrompt("ok", 100, 0.1, 8)))
    out = sched.decide(1.0, snap)
    assert out == [Reject("big", "prompt does not fit the KV memory of any device")]  # "ok" waits for KV


@pytest.mark.quick
def test_idle_decode_device_switches_at_once_and_takes_the_prompt():
    sched = RoleScheduler(CFG, COST)
    out = sched.decide(5.0, NodeSnapshot((dev(since=4.999),), (WaitingPrompt("r1", 300, 4.99, 20),)))
    assert [type(d) for d in out] == [SwitchRole, Place]
    assert out[0].to_role is Role.PREFILL and out[0].reason == "idle"
    assert out[1] == Place("r1", "d0", reserve_blocks=-(-320 // 16))


@pytest.mark.quick
def test_decode_window_respects_dwell_then_sizes_window_to_tpot_headroom():
    sched = RoleScheduler(CFG, COST)
    T, p = sched.T, sched.pause_s
    seq = ResidentSeq("s", first_token_s=0.0, output_tokens=40, context_tokens=540)  # deadline 40*T = 1.8 s
    waiting = (WaitingPrompt("r1", 1000, 1.0, 10),)
    early = NodeSnapshot((dev(since=1.0 - sched.dwell_s / 2, resident=[seq]),), waiting)
    assert sched.decide(1.0, early) == []  # hysteresis: decoded less than the dwell
    snap = NodeSnapshot((dev(since=0.5, resident=[seq]),), waiting)
    out = sched.decide(1.0, snap)
    assert isinstance(out[0], SwitchRole) and out[0].reason == "queue"
    d = COST.decode_step_s(1, 540)
    assert out[0].window_s == pytest.approx(min(sched.wmax, 40 * T - 1.0 - 2 * p - d))
    assert out[0].window_tokens == COST.prefill_tokens_within(out[0].window_s, CFG.prefill_token_budget)
    assert out[1] == Place("r1", "d0", reserve_blocks=-(-1010 // 16))


@pytest.mark.quick
def test_no_window_without_headroom_until_the_prompt_is_urgent():
    sched = RoleScheduler(CFG, COST)
    seq = ResidentSeq("s", first_token_s=0.0, output_tokens=23, context_tokens=520)  # deadline 1.035 s
    young = NodeSnapshot((dev(since=0.5, resident=[seq]),), (WaitingPrompt("r1", 1000, 0.95, 10),))
    assert sched.decide(1.0, young) == []
    old = NodeSnapshot((dev(since=0.5, resident=[seq]),), (WaitingPrompt("r1", 1000, 0.4, 10),))
    out = sched.decide(1.0, old)
    assert out[0].reason == "ttft" and out[0].window_s >= sched.wmin and isinstance(out[1], Place)


@pytest.mark.quick
def test_prefill_device_returns_to_decode_when_drained_but_idle_device_stays_parked():
    sched = RoleScheduler(CFG, COST)
    seq = ResidentSeq("s", first_token_s=0.9, output_tokens=1, context_tokens=101)
    holder = dev(role=Role.PREFILL, since=0.8, resident=[seq], device_id="a")
    idle = dev(role=Role.PREFILL, since=0.0, device_id="b")
    out = sched.decide(1.0, NodeSnapshot((holder, idle)))
    assert out == [SwitchRole("a", Role.DECODE, "drained")]


@pytest.mark.quick
def test_decisions_round_trip_as_a_tagged_union():
    out = [SwitchRole("d0", Role.PREFILL, "queue", 0.1, 4000), Place("r", "d0", 3), Reject("x", "too big")]
    data = msgspec.json.encode(out)
    assert msgspec.json.decode(data, type=list[Decision]) == out


# --- on the simulator's live objects ---------------------------------------------------------------------------
@pytest.mark.quick
def test_burst_moves_decode_device_to_prefill_and_back():
    sched, vn = make()
    burst = [SimRequest(f"b{i:02d}", 1.0 + 0.001 * i, 500, 30) for i in range(20)]
    traces = vn.run(background() + burst)
    assert all(t.done for t in traces.values())
    after = [(to, why) for (t, _, to, why) in vn.switches if t >= 1.0]
    assert after[0] == (Role.PREFILL, "queue") and (Role.DECODE, "drained") in after
    prefill_roles = [t for (t, _, to, _) in vn.switches if to is Role.PREFILL and t >= 1.0]
    assert prefill_roles[0] == 1.0  # the background had banked headroom: the window opens at once
    # the background sequences were resident before the burst: the windows never made them late
    for i in range(4):
        late = [x for x, t in zip(lateness_s(traces[f"bg{i}"], sched.T), traces[f"bg{i}"].token_times_s) if t > 1.0]
        assert max(late) <= 1e-6
    assert max(t.ttft_s for t in traces.values() if t.request_id.startswith("b")) <= CFG.ttft_slo_ms / 1e3


def test_steady_load_does_not_thrash():
    sched, vn = make()
    reqs = [SimRequest(f"s{i:05d}", 0.05 * i, 300, 100) for i in range(1200)]  # 20 req/s for 60 s
    traces = vn.run(reqs)
    assert all(t.done for t in traces.values())
    minutes = max(t.token_times_s[-1] for t in traces.values()) / 60.0
    per_minute = len(vn.switches) / minutes
    # a cycle holds one decode window of at least the dwell and two pauses
    assert per_minute <= 2 * 60.0 / (sched.dwell_s + 2 * sched.pause_s)
    assert len(vn.switches) <= 2 * len(reqs)  # never more than one prefill window per prompt
    first, second = [sum(1 for (t, *_) in vn.switches if lo <= t < lo + 30) for lo in (0, 30)]
    assert abs(first - second) <= 0.1 * first  # a steady cycle, not a growing oscillation
    # hysteresis: each decode window holding sequences lasts at least the dwell, and no window is empty
    sw = vn.switches
    for (t_a, _, to_a, _), (t_b, _, to_b, _) in zip(sw, sw[1:]):
        if to_a is Role.DECODE and to_b is Role.PREFILL:
            assert t_b - t_a >= sched.dwell_s - EPS
    starts = [t for (t, _, to, why) in sw if to is Role.PREFILL and why != "park"] + [float("inf")]
    prefill_steps = sorted(s.start_s for s in vn.steps if s.kind == "prefill")
    for a, b in zip(starts, starts[1:]):
        assert any(a <= x < b for x in prefill_steps)
    tpot = [(t.e2e_s - t.ttft_s) / (t.output_tokens - 1) for t in traces.values()]
    assert max(tpot) <= CFG.tpot_slo_ms / 1e3 and max(t.ttft_s for t in traces.values()) <= CFG.ttft_slo_ms / 1e3


def test_steady_load_switches_fall_as_min_window_grows():
    counts = []
    for w in (20, 100, 200):
        cfg = msgspec.structs.replace(CFG, min_window_ms=w, max_window_ms=max(200, w))
        _, vn = make(cfg=cfg)
        vn.run([SimRequest(f"s{i:05d}", 0.05 * i, 300, 100) for i in range(400)])
        counts.append(len(vn.switches))
    assert counts[0] > counts[1] > counts[2]


@pytest.mark.parametrize("num_devices", [1, 2, 4])
def test_long_prompt_queue_never_starves_decode_past_one_window(num_devices):
    sched, vn = make(num_devices)
    queue = [SimRequest(f"q{i:03d}", 1.0 + 0.002 * i, 1500, 40) for i in range(150)]  # ~4.5 s of prefill
    traces = vn.run(background(2 * num_devices) + queue)
    assert all(t.done for t in traces.values())
    bound = one_window_s(sched, vn)
    worst = max(max(lateness_s(t, sched.T)) for t in traces.values())
    assert worst <= bound, (worst, bound)
    assert any(why == "ttft" for (_, _, _, why) in vn.switches) or num_devices > 1


@pytest.mark.quick
def test_every_prompt_is_admitted_eventually_under_kv_pressure():
    # 64 blocks of 16 tokens per device: a few sequences at a time; one prompt needs a whole device,
    # one longer than a window, one larger than any device (rejected).
    reqs = [SimRequest(f"r{i:03d}", 0.01 * i, 200 + 37 * (i % 5), 60) for i in range(60)]
    reqs += [SimRequest("whole", 0.1, 64 * 16 - 50, 50), SimRequest("long", 0.2, 1000, 24),
             SimRequest("huge", 0.3, 64 * 16, 1)]
    cfg = msgspec.structs.replace(CFG, max_window_ms=20)
    sched = RoleScheduler(cfg, COST)
    vn = sim(sched, COST, kv_blocks=64)
    traces = vn.run(reqs)
    assert traces["huge"].rejected and not traces["huge"].token_times_s
    assert all(t.done for t in traces.values() if t.request_id != "huge")


@pytest.mark.quick
def test_pause_is_charged():
    cost = msgspec.structs.replace(COST, pause_s=0.05)
    sched, vn = make(cost=cost)
    traces = vn.run(background(2) + [SimRequest("p", 2.0, 1000, 10)])
    pauses = [s for s in vn.steps if s.kind == "pause"]
    work = [s for s in vn.steps if s.kind != "pause"]
    assert len(pauses) == len(vn.switches) and all(s.end_s - s.start_s == pytest.approx(0.05) for s in pauses)
    for p in pauses:  # a switching device does no work
        assert not any(w.start_s < p.end_s - EPS and w.end_s > p.start_s + EPS for w in work)
    assert traces["p"].ttft_s >= 0.05 + cost.prefill_s(1000, CFG.prefill_token_budget) - EPS
    gaps = [b - a for a, b in zip(traces["bg0"].token_times_s, traces["bg0"].token_times_s[1:])]
    assert max(gaps) >= 2 * 0.05 + cost.prefill_step_s(1000) - EPS  # two pauses and the prefill


@pytest.mark.parametrize("mode", ["hard", "soft"])
def test_two_devices_stagger_so_decode_keeps_flowing(mode):
    sched, vn = make(2, cfg=msgspec.structs.replace(CFG, stagger=mode))
    seen, broken = [], []

    def check(now, snap, decisions):
        holders = {d.device_id for d in snap.devices if d.resident}
        decoding = {d.device_id for d in snap.devices if d.device_id in holders
                    and (d.role is Role.DECODE or d.switching_to is Role.DECODE)}
        if len(holders) == 2 and now > 0.5:
            seen.append(now)
            if mode == "hard":
                assert decoding, f"all holders prefilling at {now}"
        for dec in decisions:
            if isinstance(dec, SwitchRole) and dec.device_id in holders:
                if dec.to_role is Role.DECODE:
                    decoding.add(dec.device_id)
                else:
                    decoding.discard(dec.device_id)
                    if not decoding:  # leaves no holder decoding: only an urgent window may do that
                        broken.append(dec.reason)

    queue = [SimRequest(f"q{i:03d}", 1.0 + 0.004 * i, 800, 60) for i in range(100)]
    traces = vn.run(background(4) + queue, on_decide=check)
    assert seen and all(t.done for t in traces.values())
    assert {dev for (_, dev, to, _) in vn.switches if to is Role.PREFILL} == {"dev0", "dev1"}
    assert broken == [] if mode == "hard" else set(broken) <= {"ttft"}


def test_soft_stagger_lifts_the_prefill_cap_under_prompt_pressure():
    # prefill-heavy load on 2 devices: hard stagger lets one holder prefill at a time
    reqs = [SimRequest(f"r{i:04d}", 0.025 * i, 1500, 12 + i % 7) for i in range(600)]
    ttft = {}
    for mode in ("hard", "soft"):
        _, vn = make(2, cfg=msgspec.structs.replace(CFG, stagger=mode))
        tr = vn.run(reqs)
        ttft[mode] = sorted(t.ttft_s for t in tr.values())[int(0.99 * len(tr))]
    assert ttft["soft"] < ttft["hard"]


@pytest.mark.quick
def test_runs_are_deterministic():
    reqs = [SimRequest(f"r{i:03d}", 0.01 * (i // 3), 100 + 7 * i, 20 + i % 9) for i in range(90)]
    a = make(2)[1]
    a.run(reqs)
    b = make(2)[1]
    b.run(list(reversed(reqs)))
    assert a.switches == b.switches and a.steps == b.steps


@pytest.mark.quick
def test_short_expected_output_bounds_what_is_queued_behind_it():
    # an idle prefill device: A (2 tokens expected) is born after P(1000) = 22 ms and may then wait
    # only T - p - d (~32 ms) for its second token, so B fits behind it only if it is short enough
    sched = RoleScheduler(CFG, COST)
    idle = dev(Role.PREFILL, since=0.0)
    a = WaitingPrompt("a", 1000, 0.0, 2)
    out = sched.decide(1.0, NodeSnapshot((idle,), (a, WaitingPrompt("b", 1000, 0.1, 100))))
    assert [d.request_id for d in out if isinstance(d, Place)] == ["a", "b"]
    sched = RoleScheduler(CFG, COST)
    out = sched.decide(1.0, NodeSnapshot((idle,), (a, WaitingPrompt("b", 2000, 0.1, 100))))
    assert [d.request_id for d in out if isinstance(d, Place)] == ["a"]


@pytest.mark.quick
def test_urgent_window_waits_for_sequences_near_their_end():
    sched = RoleScheduler(CFG, COST)
    T = sched.T
    # on time (no debt) but without headroom for a window; its last token to come: a forced window
    # would break its TPOT, since no later gap could win the overrun back
    near_end = ResidentSeq("s", first_token_s=0.0, output_tokens=23, context_tokens=520, expected_output_tokens=24)
    waiting = (WaitingPrompt("r1", 1000, 0.4, 10),)  # urgent
    d = COST.decode_step_s(1, 520)
    assert 0 < 23 * T - 1.0 - 2 * sched.pause_s - d < sched.wmin
    assert sched.decide(1.0, NodeSnapshot((dev(since=0.5, resident=[near_end]),), waiting)) == []
    long_left = msgspec.structs.replace(near_end, expected_output_tokens=400)
    out = sched.decide(1.0, NodeSnapshot((dev(since=0.5, resident=[long_left]),), waiting))
    assert out[0].reason == "ttft"
    # expected long (the mean of the node's estimate) but assured to last only its next token: a short
    # output may end there, and would never win the window back, so the window waits as above
    short_maybe = msgspec.structs.replace(long_left, assured_output_tokens=24)
    assert sched.decide(1.0, NodeSnapshot((dev(since=0.5, resident=[short_maybe]),), waiting)) == []


@pytest.mark.quick
def test_prompts_are_placed_only_where_their_sequences_fit_the_batch_cap():
    """A device at its sequence cap takes no more prompts (placed work must be able to run), and a
    prompt with n choices needs n free sequence slots."""
    sched = RoleScheduler(CFG, COST)
    waiting = (WaitingPrompt("a", 100, 0.0, 8), WaitingPrompt("b", 100, 0.1, 8, seqs=3), WaitingPrompt("c", 100, 0.2, 8))
    out = sched.decide(1.0, NodeSnapshot((dev(Role.PREFILL, seq_slots_free=2),), waiting))
    # b needs 3 slots; c waits behind b, which is urgent by now (no overtaking of an urgent prompt)
    assert [d.request_id for d in out if isinstance(d, Place)] == ["a"]
    full = sched.decide(1.0, NodeSnapshot((dev(Role.PREFILL, seq_slots_free=0),), waiting))
    assert not [d for d in full if isinstance(d, Place)]
