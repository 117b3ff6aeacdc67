"""The role policy a node starts with plans a tensor-parallel group as the group runs, and keeps doing
so as the node refits its cost model (issue 33, item 5). No node is started."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest

from node.config import NodeConfig
from node.core.cost import CostModel
from node.core.group_cost import GroupCost
from node.runtime.role_driver import RoleDriver
from node.runtime.role_policy import DEFAULT_CPU_COST, role_scheduler

DEVICES = ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]


def test_a_group_of_four_prefill_instances_plans_with_the_group_step():
    config = NodeConfig(mode="time-shared", devices=DEVICES, decode_tp=4, prefill_tp=1, max_num_batched_tokens=512,
                        reconfig_pause_ms=3.0)
    s = role_scheduler(config)
    assert s.config.prefill_token_budget == 2048  # the group's PREFILL step: 4 instances of 512 tokens
    assert isinstance(s.cost, GroupCost) and s.cost.instances == 4
    assert s.cost.prefill == msgspec.structs.replace(DEFAULT_CPU_COST, pause_s=0.003) and s.pause_s == 0.003
    assert s.prefill_s(2048) == pytest.approx(DEFAULT_CPU_COST.prefill_step_s(512))


def test_one_instance_plans_with_its_own_budget():
    for devices, d, p in ((DEVICES[:1], 1, 1), (DEVICES[:2], 2, 2)):
        s = role_scheduler(NodeConfig(mode="adaptive", devices=devices, decode_tp=d, prefill_tp=p,
                                      max_num_batched_tokens=512))
        assert s.config.prefill_token_budget == 512 and isinstance(s.cost, CostModel)


def test_a_groups_refit_fits_the_longest_instance_and_keeps_the_group():
    config = NodeConfig(mode="time-shared", devices=DEVICES[:2], decode_tp=2, prefill_tp=1, max_num_batched_tokens=256)
    node = SimpleNamespace(config=SimpleNamespace(imbalance_threshold=0.0, link_gbps=0.0), engines=[])
    driver = RoleDriver(node, role_scheduler(config), lambda: 0.0)
    for n in (64, 128, 256):  # per instance: 1 ms + 10 us a token
        driver._prefill.append((n, 0.001 + 1e-5 * n))
    driver._pauses.append(0.02)
    driver.refit()
    cost = driver.scheduler.cost
    assert isinstance(cost, GroupCost) and cost.instances == 2 and cost.pause_s == pytest.approx(0.02)
    assert cost.prefill.prefill_per_token_s == pytest.approx(1e-5) and cost.prefill is cost.decode
    assert driver.imbalance.cost is cost
    assert driver.measured_pause_s == pytest.approx(0.02)
