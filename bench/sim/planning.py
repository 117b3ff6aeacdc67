"""The cost model a simulated role policy plans with, when it is not the one that times the steps.

The live node's policy never knows its devices' step times exactly: it starts from a default model and
refits it from its own measured steps (:class:`node.core.online_refit.OnlineRefit`). ``SimConfig.planning``
picks what the simulated policy gets (the steps are always timed by the true model):

* ``refit``: :func:`start_model`, the node's start (``node.runtime.role_policy.DEFAULT_CPU_COST``, its pause
  the ``reconfig_pause_ms`` floor; for a group of several prefill instances a
  :class:`~node.core.group_cost.GroupCost` of it, as :func:`node.core.group_cost.group_policy` makes it), then
  the node's refit fed with the simulated step times (:class:`bench.sim.timeshared.TimeSharedSim`);
* ``perturbed``: :func:`perturbed`, the true model with every hardware coefficient off by ``cost_error``;
* ``exact``: the true model (the oracle the simulator had before issue 43).
"""

from __future__ import annotations

import random

import msgspec

from node.core.cost import CostModel
from node.core.group_cost import GroupCost
from node.core.roofline import RooflineCost
from node.runtime.role_policy import DEFAULT_CPU_COST

__all__ = ["LINEAR_TERMS", "ROOFLINE_TERMS", "perturbed", "start_model"]

# The coefficients a planning error applies to: a linear model's every term; a roofline's hardware terms
# (rates and times: the node knows its model's geometry, not how fast its devices run it).
LINEAR_TERMS = ("prefill_fixed_s", "prefill_per_token_s", "prefill_per_token2_s", "decode_fixed_s", "decode_per_seq_s",
                "decode_per_context_token_s", "pause_s")
ROOFLINE_TERMS = ("hbm_bandwidth_Bps", "matmul_flops_per_s", "attention_flops_per_s", "host_s", "host_per_seq_s",
                  "graph_launch_s", "eager_launch_s", "piecewise_launch_s", "link_bandwidth_Bps", "link_latency_s",
                  "pause_s")


def _scaled(cost, terms: tuple[str, ...], error: float, rng: random.Random):
    return msgspec.structs.replace(cost, **{t: getattr(cost, t) * (1 + error * rng.choice((-1, 1))) for t in terms})


def perturbed(cost: CostModel | RooflineCost | GroupCost, error: float, seed: int):
    """``cost`` with each coefficient (:data:`LINEAR_TERMS`, :data:`ROOFLINE_TERMS`; a group's two parts,
    its scatter term and pause) multiplied by ``1 + error`` or ``1 - error``, the signs drawn in field order
    from ``random.Random(seed)`` (0.2: each 20 % high or low; a rate 20 % high plans steps faster).

    Raises:
        TypeError: a cost model of another kind.
    """
    rng = random.Random(seed)
    if isinstance(cost, GroupCost):
        return msgspec.structs.replace(
            cost, prefill=perturbed(cost.prefill, error, rng.randrange(1 << 30)),
            decode=perturbed(cost.decode, error, rng.randrange(1 << 30)),
            scatter_s_per_token=cost.scatter_s_per_token * (1 + error * rng.choice((-1, 1))),
            pause_s=cost.pause_s * (1 + error * rng.choice((-1, 1))))
    if isinstance(cost, RooflineCost):
        return _scaled(cost, ROOFLINE_TERMS, error, rng)
    if isinstance(cost, CostModel):
        return _scaled(cost, LINEAR_TERMS, error, rng)
    raise TypeError(f"cannot perturb a {type(cost).__name__}")


def start_model(true_cost: CostModel | RooflineCost | GroupCost, reconfig_pause_ms: float) -> CostModel | GroupCost:
    """The model the live node's role policy starts with (``node.runtime.role_policy.role_scheduler`` without
    ``--policy-cost-model``): :data:`DEFAULT_CPU_COST` with the ``reconfig_pause_ms`` floor as its pause, as
    a group's prefill and decode model when ``true_cost`` is a group of several prefill instances (its
    instance count kept; no scatter term, as ``group_policy`` builds it live)."""
    start = msgspec.structs.replace(DEFAULT_CPU_COST, pause_s=reconfig_pause_ms / 1e3)
    if isinstance(true_cost, GroupCost):
        return GroupCost(prefill=start, decode=start, instances=true_cost.instances, scatter_s_per_token=0.0,
                         pause_s=start.pause_s)
    return start
