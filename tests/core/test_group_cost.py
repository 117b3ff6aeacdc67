"""What a role policy plans a tensor-parallel group with (node.core.group_cost), and the switch pause it
plans each decision with (measured, fed in by the snapshot; issue 33, item 5). Pure."""

from __future__ import annotations

import pytest

from node.core.cost import CostModel
from node.core.group_cost import GroupCost, group_policy
from node.core.imbalance import ImbalanceConfig, ImbalancePolicy
from node.core.role_config import time_shared_roles
from node.core.roles import DeviceState, NodeSnapshot, ResidentSeq, Role, RoleScheduler, RoleSchedulerConfig

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here

COST = CostModel(prefill_fixed_s=0.002, prefill_per_token_s=2e-5, decode_fixed_s=0.008, decode_per_seq_s=1e-4,
                 pause_s=0.005)


def test_a_group_of_prefill_instances_plans_with_the_group_steps_budget_and_cost():
    roles = time_shared_roles(4, 1, 512, 64)  # four devices: four prefill instances of 512 tokens each
    cost, budget = group_policy(COST, 512, roles["prefill"])
    assert budget == 2048 == roles["prefill"].step_budget  # what the group's PREFILL step computes
    assert isinstance(cost, GroupCost) and cost.instances == 4 and cost.pause_s == COST.pause_s
    # a group step of 2048 tokens lasts one instance's step of 512; a queue of 4096 two such steps
    assert cost.prefill_step_s(2048) == pytest.approx(COST.prefill_step_s(512))
    assert cost.prefill_s(4096, budget) == pytest.approx(2 * COST.prefill_step_s(512))
    assert cost.decode_step_s(8, 1000) == COST.decode_step_s(8, 1000)
    assert cost.longest_instance_tokens([500, 300, 300, 200, 100]) == 500


def test_one_instance_plans_as_before():
    for prefill in (None, time_shared_roles(2, 2, 512, 64)["prefill"]):
        assert group_policy(COST, 512, prefill) == (COST, 512)


def test_a_groups_own_cost_is_kept_with_the_group_budget():
    given = GroupCost(prefill=COST, decode=COST, instances=2, scatter_s_per_token=1e-6)
    assert group_policy(given, 256, time_shared_roles(2, 1, 256, 64)["prefill"]) == (given, 512)


def _snapshot(pause_s: float | None) -> NodeSnapshot:
    resident = (ResidentSeq("a-0", 0.0, 3, 100, 10),)
    return NodeSnapshot((DeviceState(device_id="d0", role=Role.DECODE, resident=resident, kv_free_blocks=100,
                                     kv_total_blocks=100),), pause_s=pause_s)


def test_the_scheduler_plans_each_decision_with_the_measured_pause():
    config = RoleSchedulerConfig(reconfig_pause_ms=2.0, min_window_ms=20.0, max_pause_share=0.2)
    s = RoleScheduler(config, COST)
    assert s.pause_s == COST.pause_s  # nothing measured yet: the cost model's
    s.decide(1.0, _snapshot(0.04))
    assert s.pause_s == 0.04 and s.dwell_s == pytest.approx(2 * 0.04 * 0.8 / 0.2)
    s.decide(1.1, _snapshot(0.0005))  # below the configured floor
    assert s.pause_s == 0.002 and s.dwell_s == 0.02
    s.cost = CostModel(pause_s=0.03)  # refitted: with nothing measured the policy follows its model
    s.decide(1.2, _snapshot(None))
    assert s.pause_s == 0.03


def test_the_imbalance_fallback_plans_with_the_measured_pause_too():
    policy = ImbalancePolicy(ImbalanceConfig(threshold=1.0, reconfig_pause_ms=1.0), COST)
    assert policy.pause_s == COST.pause_s
    policy.decide(1.0, _snapshot(0.07))
    assert policy.pause_s == 0.07
