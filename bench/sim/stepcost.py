"""Duration of one batched step (a :class:`~node.core.batcher.StepPlan`) under a cost model.

A plan mixes prompt work (``n`` new prompt tokens, chunks included) and decode work (``s`` sequences
with ``k`` tokens cached in all, each sequence's new token included). The cost model prices the step:
:meth:`CostModel.mixed_step_s <node.core.cost.CostModel.mixed_step_s>` (one fixed cost plus each part's
variable cost) or :meth:`RooflineCost.mixed_step_s <node.core.roofline.RooflineCost.mixed_step_s>`
(one eager pass over the union of the work); pure prefill and pure decode steps are what
``prefill_step_s`` and ``decode_step_s`` say. Seconds throughout; never negative.

A time-shared *group* (:class:`GroupCost`) that prefills as several instances prices a PREFILL plan
itself: its items are spread over the instances as the live node spreads them
(:func:`node.core.role_config.assign_instances`) and the step lasts its longest instance.
"""

from __future__ import annotations

import msgspec

from node.core.batcher import StepKind, StepPlan
from node.core.cost import CostModel, chunked_s, tokens_within
from node.core.role_config import assign_instances
from node.core.roofline import RooflineCost

__all__ = ["GroupCost", "step_work", "mixed_step_s", "plan_step_s"]


class GroupCost(msgspec.Struct, frozen=True, kw_only=True):
    """Step times of a time-shared group of ``D`` devices that prefills as ``instances = D / P``
    instances at degree ``P`` and decodes as one instance at degree ``D`` (the CostModel interface, so
    the live role scheduler and imbalance policy plan with it).

    Attributes:
        prefill: one prefill instance's model, per rank at degree ``P``
            (:func:`bench.cost.derive_cost.derive_at`).
        decode: the group's decode model, per rank at degree ``D``.
        instances: ``D / P``.
        scatter_s_per_token: seconds per prompt token of one instance of the in-node KV scatter
            (:func:`node.core.roofline.kv_scatter_s` of one token): each device writes the ``1 - P/D``
            of the KV it computed that other devices own in decode straight to them over its link.
            Charged **after** the instance's compute (added, not overlapped: the conservative choice;
            a layer-by-layer scatter could hide most of it under the next layer's GEMMs).
        pause_s: a role switch's pause (s).

    Formulas (seconds): an instance step of ``n`` fresh prompt tokens costs
    ``prefill.prefill_step_s(n) + n x scatter_s_per_token``; a group PREFILL step the maximum over its
    instances of their steps (instances run side by side, the step ends with the last); for planning,
    a queue of ``q`` tokens in group steps of ``b`` tokens (:meth:`prefill_s`) is split evenly,
    ``ceil(b / instances)`` per instance per step. DECODE (and mixed) steps are ``decode``'s.
    """

    prefill: RooflineCost
    decode: RooflineCost
    instances: int
    scatter_s_per_token: float = 0.0
    pause_s: float = 0.0

    def instance_step_s(self, tokens: int) -> float:
        """Seconds of one instance's prefill step over ``tokens`` fresh prompt tokens, scatter included."""
        if tokens <= 0:
            return 0.0
        return self.prefill.prefill_step_s(tokens) + tokens * self.scatter_s_per_token

    def prefill_step_s(self, tokens: int) -> float:
        """Seconds of a group PREFILL step of ``tokens`` prompt tokens split evenly over the instances."""
        return self.instance_step_s(-(-max(0, tokens) // self.instances))

    def prefill_s(self, tokens: int, token_budget: int) -> float:
        """Seconds to prefill ``tokens`` queued tokens in group steps of ``token_budget`` (chunked_s)."""
        return chunked_s(self.prefill_step_s, tokens, token_budget)

    def prefill_tokens_within(self, seconds: float, token_budget: int) -> int:
        """Most queued prompt tokens whose group prefill (:meth:`prefill_s`) fits in ``seconds``."""
        return tokens_within(lambda n: self.prefill_s(n, token_budget), seconds)

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        """The decode instance's step (degree ``D``)."""
        return self.decode.decode_step_s(batch, context_tokens)

    def mixed_step_s(self, prompt_tokens: int, decode_seqs: int, context_tokens: int) -> float:
        """A pure prompt step is a group PREFILL step; anything with decode work runs at degree ``D``."""
        if decode_seqs <= 0:
            return self.prefill_step_s(prompt_tokens)
        return self.decode.mixed_step_s(prompt_tokens, decode_seqs, context_tokens)

    def plan_step_s(self, plan: StepPlan) -> float:
        """Seconds of ``plan``: a PREFILL plan's items over the instances (LPT, as the live node), the
        longest instance's step; any other plan at degree ``D``."""
        if plan.kind is StepKind.PREFILL:
            tokens = [it.num_tokens for it in plan.items]
            loads = [0] * self.instances
            for tok, inst in zip(tokens, assign_instances(tokens, self.instances)):
                loads[inst] += tok
            return max(self.instance_step_s(n) for n in loads)
        return max(0.0, self.decode.mixed_step_s(*step_work(plan)))

    def with_host_overhead(self, seconds: float) -> GroupCost:
        """Both models with ``seconds`` of host work added to every step; itself for <= 0."""
        if seconds <= 0:
            return self
        return msgspec.structs.replace(self, prefill=self.prefill.with_host_overhead(seconds),
                                       decode=self.decode.with_host_overhead(seconds))


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


def plan_step_s(cost: CostModel | RooflineCost | GroupCost, plan: StepPlan) -> float:
    """Seconds the plan's step takes."""
    if isinstance(cost, GroupCost):
        return cost.plan_step_s(plan)
    return mixed_step_s(cost, *step_work(plan))
