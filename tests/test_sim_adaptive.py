"""Adaptive mode in the simulator: the node's policy object (:class:`AdaptiveScheduler`) over the live
``Batcher`` and ``BlockLedger``, MIXED steps under the online chunk budget, free switches, windows only
where the cost model makes them cheaper (issue 27)."""

from __future__ import annotations

import pytest

from bench.sim import SimConfig, simulate
from bench.sim.stepcost import GroupCost
from bench.sim.timeshared import TimeSharedSim
from bench.sim.trace import SimRequest
from node.core.adaptive import AdaptiveScheduler
from node.core.cost import CostModel
from node.core.roles import Role, RoleSchedulerConfig
from bench.traffic.traces import TraceRequest

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here

COST = CostModel(prefill_fixed_s=0.002, prefill_per_token_s=2e-5, decode_fixed_s=0.008, decode_per_seq_s=1e-4,
                 decode_per_context_token_s=1e-7, pause_s=0.005)


def _load() -> list[TraceRequest]:
    """A steady stream with a burst of long prompts in the middle."""
    return ([TraceRequest(0.02 * i, 200, 100) for i in range(60)] + [TraceRequest(0.5 + 0.001 * i, 3000, 50)
                                                                    for i in range(6)])


def test_adaptive_mixes_chunks_into_decode_and_keeps_tpot():
    cfg = SimConfig(mode="adaptive", devices=2, kv_blocks=4000, max_model_len=4096, tpot_slo_ms=50,
                    ttft_slo_ms=1000, imbalance_threshold=0.0)
    res = simulate(_load(), cfg, COST)
    assert res.summary.completed == 66 and res.summary.failed == 0
    reasons = res.stats["switch_reasons"]
    assert reasons.get("chunks_fit", 0) > 0 and reasons.get("nothing_waits", 0) > 0
    # one configuration, linear costs: chunks are never dearer than a window, so no paused switch at all
    assert res.stats["switches"] == res.stats["free_switches"] and res.stats["pause_s"] == 0
    assert res.summary.tpot_ms.p90 <= 50 and res.summary.slo_attainment == 1.0


def test_the_simulator_runs_the_policy_object_and_windows_where_prefill_is_cheaper():
    """A group whose prefill configuration runs 4 instances (4x the prompt throughput of its mixed
    steps): the burst of long prompts goes to PREFILL windows ("cheaper"), the stream in chunks."""
    cost = GroupCost(prefill=COST, decode=COST, instances=4, pause_s=0.002)  # linear models stand in for rooflines
    cfg = SimConfig(mode="adaptive", devices=1, kv_blocks=4000, max_model_len=4096, tpot_slo_ms=200,
                    ttft_slo_ms=2000, max_num_batched_tokens=2048)
    sched = AdaptiveScheduler(RoleSchedulerConfig(tpot_slo_ms=200, ttft_slo_ms=2000, prefill_token_budget=2048), cost,
                              max_step_tokens=2048)
    sim = TimeSharedSim(sched, cost, cfg, initial_role=Role.DECODE)
    reqs = [SimRequest(f"r{i}", r.arrival_s, r.prompt_tokens, r.output_tokens, r.output_tokens)
            for i, r in enumerate(_load())]
    traces = sim.run(reqs)
    assert all(t.done for t in traces.values())
    kinds = {s.kind for s in sim.steps}
    assert {"mixed", "prefill", "decode", "pause"} <= kinds
    reasons = {r for *_, r in sim.switches}
    assert "cheaper" in reasons and "chunks_fit" in reasons



class _EagerMixed(CostModel, frozen=True, kw_only=True):
    """Decode steps of ~15 ms; a step with any prompt token runs eagerly, 25 ms more (a 70B-like gap)."""

    def mixed_step_s(self, prompt_tokens: int, decode_seqs: int, context_tokens: int) -> float:
        base = CostModel.mixed_step_s(self, prompt_tokens, decode_seqs, context_tokens)
        return base + (0.025 if prompt_tokens > 0 and decode_seqs > 0 else 0.0)


def test_handoff_windows_move_prefilled_sequences_with_copies_beside_the_source_steps():
    """Two devices where no chunk fits T (18 ms at TPOT 20 ms) but decode does: hand-off windows
    (node.core.handoff_windows) prefill on one device and move each sequence to the other; every copy runs
    beside the source's later steps (a prefill step overlaps some transfer), and every request ends."""
    cost = _EagerMixed(prefill_fixed_s=0.002, prefill_per_token_s=2e-5, decode_fixed_s=0.012, decode_per_seq_s=1e-4,
                       decode_per_context_token_s=1e-8, pause_s=0.001)
    cfg = SimConfig(mode="adaptive", devices=2, kv_blocks=8000, max_model_len=4096, tpot_slo_ms=20, ttft_slo_ms=2000,
                    imbalance_threshold=0.0, kv_bytes_per_token=1000, link_gbps=100)
    sched = AdaptiveScheduler(RoleSchedulerConfig(tpot_slo_ms=20, ttft_slo_ms=2000, prefill_token_budget=2048), cost,
                              max_step_tokens=2048)
    sim = TimeSharedSim(sched, cost, cfg, initial_role=Role.DECODE)
    reqs = [SimRequest(f"r{i}", 0.05 * i, 1500, 150, 150) for i in range(30)]
    traces = sim.run(reqs)
    assert all(t.done for t in traces.values())
    assert sim.moves_by_reason.get("handoff", 0) >= 10
    assert any(why == "handoff" for *_, why in sim.switches)
    transfers = [s for s in sim.steps if s.kind == "transfer"]
    prefills = [s for s in sim.steps if s.kind == "prefill"]
    assert any(p.device_id == t.device_id and p.start_s < t.end_s and t.start_s < p.end_s
               for t in transfers for p in prefills)
    for d in sim.devices:
        assert d.batcher.ledger.num_free == d.batcher.ledger.num_blocks
