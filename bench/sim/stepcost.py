"""Duration of one batched step (a :class:`~node.core.batcher.StepPlan`) under a cost model.

A plan mixes prompt work (``n`` new prompt tokens, chunks included) and decode work (``s`` sequences
with ``k`` tokens cached in all, each sequence's new token included). The cost model prices the step:
:meth:`CostModel.mixed_step_s <node.core.cost.CostModel.mixed_step_s>` (one fixed cost plus each part's
variable cost) or :meth:`RooflineCost.mixed_step_s <node.core.roofline.RooflineCost.mixed_step_s>`
(one eager pass over the union of the work); pure prefill and pure decode steps are what
``prefill_step_s`` and ``decode_step_s`` say. Seconds throughout; never negative.

A time-shared *group* (:class:`node.core.group_cost.GroupCost`) that prefills as several instances prices a PREFILL plan
itself: its items are spread over the instances as the live node spreads them
(:func:`node.core.role_config.assign_instances`) and the step lasts its longest instance.
"""

from __future__ import annotations

from node.core.batcher import StepPlan
from node.core.cost import CostModel
from node.core.group_cost import GroupCost, step_work  # node.core's, so the live policy plans with the same
from node.core.roofline import RooflineCost

__all__ = ["GroupCost", "step_work", "mixed_step_s", "plan_step_s"]


def mixed_step_s(cost: CostModel | RooflineCost, prompt_tokens: int, decode_seqs: int, context_tokens: int) -> float:
    """Seconds of one step with ``prompt_tokens`` of prompt work and ``decode_seqs`` decode tokens."""
    return max(0.0, cost.mixed_step_s(prompt_tokens, decode_seqs, context_tokens))


def plan_step_s(cost: CostModel | RooflineCost | GroupCost, plan: StepPlan) -> float:
    """Seconds the plan's step takes."""
    if isinstance(cost, GroupCost):
        return cost.plan_step_s(plan)
    return mixed_step_s(cost, *step_work(plan))
