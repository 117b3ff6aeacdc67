"""The live role driver and the simulator show the role policies the same snapshot of the same state:
both build it with one function, :func:`node.core.snapshot.node_snapshot` (issue 33, item 5).

A time-shared simulation with imbalance moves and prefix caching runs; at every decision the live
:class:`RoleDriver` is handed that very state (the simulated devices' batchers, their requests, moves,
reservations and measured pause, behind stand-ins for the node's engines) and its snapshot must equal
the simulator's.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

import bench.sim.timeshared as timeshared
import node.runtime.role_driver as role_driver
from bench.sim import SimConfig
from bench.sim.timeshared import TimeSharedSim
from bench.sim.trace import SimRequest
from node.core.cost import CostModel
from node.core.imbalance import ImbalanceConfig, ImbalancePolicy
from node.core.roles import RoleScheduler, RoleSchedulerConfig
from node.runtime.role_driver import RoleDriver

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here

COST = CostModel(prefill_fixed_s=0.002, prefill_per_token_s=2e-5, decode_fixed_s=0.008, decode_per_seq_s=1e-4,
                 decode_per_context_token_s=1e-7, pause_s=0.005)
KV_BYTES = 131072


def _sim() -> tuple[TimeSharedSim, list[SimRequest]]:
    cfg = SimConfig(mode="time-shared", devices=2, kv_blocks=4000, kv_bytes_per_token=KV_BYTES, max_model_len=2048,
                    tpot_slo_ms=50, link_gbps=100.0, imbalance_threshold=1.0, prefix_caching=True)
    sched = RoleScheduler(RoleSchedulerConfig(tpot_slo_ms=50, prefill_token_budget=2048), COST)
    imbalance = ImbalancePolicy(ImbalanceConfig(threshold=1.0, tpot_slo_ms=50, prefill_token_budget=2048,
                                                local_transfer_s_per_token=KV_BYTES * 8 / 100e9), COST)
    head = list(range(1000, 1000 + 160))  # a shared system prompt: later prompts find it cached
    # told nothing of their outputs (the node's estimate, min(max_tokens, 128) before any EOS), as the live
    # driver is: the expected and the assured lengths then come from one estimator on both sides
    reqs = [SimRequest(f"r{i}", 0.001 * i, 300, out, None, tuple(head + [i] * 140), max_tokens=out)
            for i, out in enumerate([200] * 16 + [40] * 6)]
    return TimeSharedSim(sched, COST, cfg, imbalance=imbalance), reqs


def _live_driver(sim: TimeSharedSim, now: float) -> RoleDriver:
    """A RoleDriver over stand-ins for the node's engines that hold the simulation's state as it is now."""
    engines = []
    for d in sim.devices:
        copying = [m.seq for m in sim._moves.values() if m.src is d and m.done_s < math.inf]
        seqs = list(d.batcher.running) + list(d.batcher.waiting) + copying
        switch_done = (d.switch_done_s if d.switch_done_s < math.inf else now + sim.pause_s) if d.switching else None
        engines.append(SimpleNamespace(
            device_id=d.device_id, failure=None, batcher=d.batcher,
            requests={s.request_id: SimpleNamespace(request_id=s.request_id, seqs=[s], params=s.params) for s in seqs},
            role=SimpleNamespace(role=d.role, since_s=d.role_since_s, switch_started_s=d.role_since_s,
                                 switching_to=d.switching_to, switch_done_est_s=switch_done),
            step_started_s=d.busy_until_s if d.plan is not None else None, last_step_s=0.0,
            step_listeners=[], switch_listeners=[], migration_listeners=[], compile_listeners=[]))
    by_id = {e.device_id: e for e in engines}
    node = SimpleNamespace(config=SimpleNamespace(imbalance_threshold=1.0, link_gbps=0.0), engines=engines,
                           engine=by_id.__getitem__, peers=None, draining=False)
    driver = RoleDriver(node, sim.scheduler, lambda: now)
    driver._moving = {sid: m.dst.device_id for sid, m in sim._moves.items()}
    driver._moved_s = dict(sim._moved_s)
    driver.reserve = dict(sim._reserve)  # one choice per request: request id == sequence id
    driver._pauses.append(sim.pause_s)
    driver.pending = [SimpleNamespace(request_id=r.request_id, prompt_ids=s.token_ids[: s.prompt_len], seqs=[s],
                                      params=s.params, stats=SimpleNamespace(arrival_s=r.arrival_s))
                      for r, s in sim.waiting]
    return driver


def test_the_live_driver_and_the_simulator_build_the_same_snapshot_with_one_function(monkeypatch):
    calls = {"sim": 0, "live": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(timeshared, "node_snapshot", counted("sim", timeshared.node_snapshot))
    monkeypatch.setattr(role_driver, "node_snapshot", counted("live", role_driver.node_snapshot))
    sim, reqs = _sim()
    rounds: list[float] = []
    seen = {"compared": 0, "moving": 0, "copying": 0, "cached": 0, "reserved": 0, "switching": 0}

    def compare(now, snap, _decisions):
        rounds.append(now)
        if len(rounds) % 3:  # every third decision is enough to meet every kind of state below
            return
        live = _live_driver(sim, now).snapshot(now)
        assert live == snap, f"the live driver's snapshot differs from the simulator's at {now}"
        seen["compared"] += 1
        seen["moving"] += bool(sim._moves)
        seen["copying"] += any(m.done_s < math.inf for m in sim._moves.values())
        seen["cached"] += any(w.cached_tokens for w in snap.waiting)
        seen["reserved"] += any(d.kv_reserved_blocks for d in snap.devices)
        seen["switching"] += any(d.switching_to is not None for d in snap.devices)

    traces = sim.run(reqs, on_decide=compare)
    assert all(t.done for t in traces.values())
    assert calls["live"] == seen["compared"] and calls["sim"] >= len(rounds)
    assert all(seen.values()), seen  # the states compared include moves, copies, cache hits, reserves, switches
