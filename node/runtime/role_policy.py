"""The role policy a node in adaptive or time-shared mode starts with, from its flags: the scheduler's
configuration and the cost model it plans with before the node has measured its own steps.

A time-shared group that prefills as ``D / P`` instances (``--decode-tp D --prefill-tp P``) runs PREFILL
steps of up to ``--max-num-batched-tokens x D/P`` tokens that last their longest instance; the policy
plans with that budget and a :class:`~node.core.group_cost.GroupCost` (:func:`node.core.group_cost.group_policy`),
as the simulator does, rather than with one instance's budget and a model of a whole-group step.
"""

from __future__ import annotations

import msgspec

from node.config import NodeConfig
from node.core.adaptive import AdaptiveScheduler
from node.core.cost import CostModel
from node.core.group_cost import group_policy
from node.core.roles import RoleScheduler, RoleSchedulerConfig

__all__ = ["DEFAULT_CPU_COST", "kv_copy_s_per_token", "role_scheduler"]

# Starting point of the policy's cost model before the node has measured its own steps (CPU-sized).
DEFAULT_CPU_COST = CostModel(prefill_fixed_s=0.002, prefill_per_token_s=2e-5, decode_fixed_s=0.002, decode_per_seq_s=1e-4)


def kv_copy_s_per_token(config: NodeConfig, kv_bytes_per_token: int) -> float:
    """Seconds per context token of KV moved at ``--link-gbps`` (``kv_bytes_per_token * 8 / link bit/s``),
    to a peer or to another device of this node (``DeviceEngine.migrate`` copies at that rate too); 0 when
    unthrottled. ``kv_bytes_per_token``: the model geometry's (a timed device's pool is tiny)."""
    return kv_bytes_per_token * 8 / (config.link_gbps * 1e9) if config.link_gbps else 0.0


def role_scheduler(config: NodeConfig, copy_s_per_token: float = 0.0) -> RoleScheduler | AdaptiveScheduler:
    """The policy of ``--mode adaptive`` (:class:`AdaptiveScheduler`) or ``time-shared``
    (:class:`RoleScheduler`): :data:`DEFAULT_CPU_COST`, or ``--policy-cost-model``'s model, its pause
    plus ``--reconfig-pause-ms``; for a group of several prefill instances, the group's step budget and
    cost (module docstring).

    Raises:
        node.timed_cost.CostFileError: ``--policy-cost-model`` cannot be read.
    """
    cost = msgspec.structs.replace(DEFAULT_CPU_COST, pause_s=config.reconfig_pause_ms / 1e3)
    if config.policy_cost_model is not None:
        from node.timed_cost import load_step_cost

        start = load_step_cost(config.policy_cost_model)
        cost = msgspec.structs.replace(start, pause_s=start.pause_s + config.reconfig_pause_ms / 1e3)
    cost, budget = group_policy(cost, config.max_num_batched_tokens, config.role_configs().get("prefill"))
    policy = RoleSchedulerConfig(
        ttft_slo_ms=config.ttft_slo_ms, tpot_slo_ms=config.tpot_slo_ms, reconfig_pause_ms=config.reconfig_pause_ms,
        min_window_ms=config.min_window_ms, max_window_ms=config.max_window_ms,
        prefill_token_budget=budget, stagger=config.stagger, copy_s_per_token=copy_s_per_token)
    if config.mode == "adaptive":  # MIXED steps run in the decode configuration: one instance's budget
        return AdaptiveScheduler(policy, cost, max_step_tokens=config.max_num_batched_tokens)
    return RoleScheduler(policy, cost)
