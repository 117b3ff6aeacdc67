"""Request priority in the pure queues (``--scheduling-policy priority``): the batcher's waiting list,
the role policy's placement order and the drivers' insertion rule, each lower value first and arrival
order within a priority (so first-come-first-served, all priorities 0, is unchanged)."""

import pytest
from node.core.batcher import BatchConfig, Batcher, StepKind
from node.core.ledger import BlockLedger
from node.core.priority import insert_by_priority
from node.core.roles import DeviceState, NodeSnapshot, Place, Role, RoleScheduler, RoleSchedulerConfig, WaitingPrompt
from node.core.cost import CostModel
from node.core.sequence import SamplingParams, Sequence

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here


def test_insert_by_priority_keeps_arrival_order_within_a_priority():
    q: list[tuple[str, int]] = []
    for item in [("a", 0), ("b", 5), ("c", 0), ("d", -1), ("e", 5), ("f", 0)]:
        insert_by_priority(q, item, lambda x: x[1])
    assert [x[0] for x in q] == ["d", "a", "c", "f", "b", "e"]
    fcfs: list[tuple[str, int]] = []
    for item in [("a", 0), ("b", 0), ("c", 0)]:
        assert insert_by_priority(fcfs, item, lambda x: x[1]) == len(fcfs) - 1  # appended
    assert [x[0] for x in fcfs] == ["a", "b", "c"]


def _seq(i: int, priority: int) -> Sequence:
    return Sequence(f"s{i}", f"r{i}", 0, float(i), list(range(8)), SamplingParams(max_tokens=4, priority=priority), 4096)


def test_batcher_admits_the_better_priority_first():
    b = Batcher(BlockLedger(100, 16), BatchConfig(max_batched_tokens=64, max_num_seqs=1))
    for s in (_seq(0, 3), _seq(1, 3), _seq(2, -2)):
        b.add(s)
    assert [s.seq_id for s in b.waiting] == ["s2", "s0", "s1"]
    plan = b.schedule(StepKind.MIXED)
    assert [it.seq.seq_id for it in plan.items] == ["s2"]


def test_role_policy_places_the_better_priority_first():
    cost = CostModel(prefill_fixed_s=0.002, prefill_per_token_s=2e-5, decode_fixed_s=0.008, decode_per_seq_s=1e-4,
                     decode_per_context_token_s=1e-7, pause_s=0.005)
    cfg = RoleSchedulerConfig(ttft_slo_ms=1000, tpot_slo_ms=50, min_window_ms=20, max_window_ms=200,
                              prefill_token_budget=100)
    dev = DeviceState(device_id="d0", role=Role.PREFILL, role_since_s=0.0, resident=(), kv_free_blocks=1000,
                      kv_total_blocks=1000)
    waiting = (WaitingPrompt("old", 100, 0.0, 8, priority=1), WaitingPrompt("urgent", 100, 0.5, 8, priority=0))
    places = [d for d in RoleScheduler(cfg, cost).decide(1.0, NodeSnapshot((dev,), waiting)) if isinstance(d, Place)]
    assert [p.request_id for p in places][:1] == ["urgent"]
