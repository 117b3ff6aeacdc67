"""Duration of one batched step (a :class:`~node.core.batcher.StepPlan`) under a cost model.

A plan mixes prompt work (``n`` new prompt tokens, chunks included) and decode work (``s`` sequences
with ``k`` tokens cached in all, each sequence's new token included). The cost model prices the step:
:meth:`CostModel.mixed_step_s <node.core.cost.CostModel.mixed_step_s>` (one fixed cost plus each part's
variable cost) or :meth:`RooflineCost.mixed_step_s <node.core.roofline.RooflineCost.mixed_step_s>`
(one eager pass over the union of the work); pure prefill and pure decode steps are what
``prefill_step_s`` and ``decode_step_s`` say. Seconds throughout; never negative.
"""

from __future__ import annotations

from node.core.batcher import StepPlan
from node.core.cost import CostModel
from node.core.roofline import RooflineCost

__all__ = ["step_work", "mixed_step_s", "plan_step_s"]


def step_work(plan: StepPlan) -> tuple[int, int, int]:
    """``(prompt tokens, decode sequences, their cached tokens)`` of a plan (before it is committed)."""
    n = s = k = 0
    for it in plan.items:
        if it.seq.is_decoding:
            s += 1
            k += it.seq.num_computed + 1
        else:
            n += it.num_tokens
    return n, s, k


def mixed_step_s(cost: CostModel | RooflineCost, prompt_tokens: int, decode_seqs: int, context_tokens: int) -> float:
    """Seconds of one step with ``prompt_tokens`` of prompt work and ``decode_seqs`` decode tokens."""
    return max(0.0, cost.mixed_step_s(prompt_tokens, decode_seqs, context_tokens))


def plan_step_s(cost: CostModel | RooflineCost, plan: StepPlan) -> float:
    """Seconds the plan's step takes."""
    return mixed_step_s(cost, *step_work(plan))
