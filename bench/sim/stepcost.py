"""Duration of one batched step (a :class:`~node.core.batcher.StepPlan`) under a :class:`CostModel`.

A plan mixes prompt work (``n`` new prompt tokens, chunks included) and decode work (``s`` sequences
with ``k`` tokens cached in all). Pure prefill and pure decode steps cost what the cost model says
(:meth:`CostModel.prefill_step_s`, :meth:`CostModel.decode_step_s`). A mixed step (colocated mode's
chunked prefill) runs one forward pass, so it pays one fixed cost — the larger of the two, since both
stand for reading the weights and launching the pass — plus each part's variable cost::

    mixed_s = max(a_p, a_d) + (prefill_step_s(n) - a_p) + (decode_step_s(s, k) - a_d)

Seconds throughout; never negative.
"""

from __future__ import annotations

from node.core.batcher import StepPlan
from node.core.cost import CostModel

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


def mixed_step_s(cost: CostModel, prompt_tokens: int, decode_seqs: int, context_tokens: int) -> float:
    """Seconds of one step with ``prompt_tokens`` of prompt work and ``decode_seqs`` decode tokens."""
    if decode_seqs == 0:
        return max(0.0, cost.prefill_step_s(prompt_tokens))
    if prompt_tokens == 0:
        return max(0.0, cost.decode_step_s(decode_seqs, context_tokens))
    fixed = max(cost.prefill_fixed_s, cost.decode_fixed_s)
    return max(0.0, fixed + (cost.prefill_step_s(prompt_tokens) - cost.prefill_fixed_s)
               + (cost.decode_step_s(decode_seqs, context_tokens) - cost.decode_fixed_s))


def plan_step_s(cost: CostModel, plan: StepPlan) -> float:
    """Seconds the plan's step takes."""
    return mixed_step_s(cost, *step_work(plan))
