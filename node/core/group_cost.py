"""What a role policy plans a time-shared *group* with: its step cost (:class:`GroupCost`) and its
prefill token budget (:func:`group_policy`), shared by the live node and the simulator (pure).

A group of ``D`` devices (``--decode-tp D``) that prefills as ``D / P`` instances (``--prefill-tp P``,
:mod:`node.core.role_config`) computes up to ``token_budget x D/P`` prompt tokens per PREFILL step (no
item more than ``token_budget``), spread over the instances, and the step lasts its longest instance.
A policy that planned with one device's ``token_budget`` and one model of a whole-group step would
size windows the group does not run.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import msgspec

from node.core.batcher import StepKind, StepPlan
from node.core.cost import CostModel, chunked_s, tokens_within
from node.core.role_config import RoleConfig, assign_instances
from node.core.roofline import RooflineCost

__all__ = ["GroupCost", "group_policy", "step_work"]


class GroupCost(msgspec.Struct, frozen=True, kw_only=True):
    """Step times of a time-shared group of ``D`` devices that prefills as ``instances = D / P``
    instances at degree ``P`` and decodes as one instance at degree ``D`` (the CostModel interface, so
    the live role scheduler and imbalance policy plan with it).

    Attributes:
        prefill: one prefill instance's model, per rank at degree ``P``
            (:func:`bench.cost.derive_cost.derive_at`; live: the node's model, whose prefill part the role
            driver fits to each group step's longest instance, :meth:`longest_instance_tokens`).
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

    prefill: CostModel | RooflineCost
    decode: CostModel | RooflineCost
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

    def longest_instance_tokens(self, tokens: Seq[int]) -> int:
        """Prompt tokens of the most loaded instance when a PREFILL step's items of ``tokens`` each are
        spread over the instances (LPT, :func:`node.core.role_config.assign_instances`, as the live node)."""
        loads = [0] * self.instances
        for tok, inst in zip(tokens, assign_instances(list(tokens), self.instances)):
            loads[inst] += tok
        return max(loads)

    def plan_step_s(self, plan: StepPlan) -> float:
        """Seconds of ``plan``: a PREFILL plan's items over the instances (LPT, as the live node), the
        longest instance's step; any other plan at degree ``D``."""
        if plan.kind is StepKind.PREFILL:
            return self.instance_step_s(self.longest_instance_tokens([it.num_tokens for it in plan.items]))
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


def group_policy(cost: CostModel | RooflineCost | GroupCost, token_budget: int, prefill: RoleConfig | None,
                 scatter_s_per_token: float = 0.0) -> tuple[CostModel | RooflineCost | GroupCost, int]:
    """``(cost model, prefill token budget)`` a role policy plans a device with, given its prefill
    role's configuration (``None`` or one instance: ``cost`` and ``token_budget`` as they are).

    A group of ``n = prefill.instances > 1`` instances plans with the group step's budget
    ``prefill.step_budget`` (``token_budget x n``, :class:`~node.core.role_config.RoleConfig`) and a
    :class:`GroupCost` of ``n`` instances with ``cost`` as both the prefill instance's and the decode
    instance's model (its ``pause_s`` kept); a ``GroupCost`` given is kept as it is (the simulator's,
    built from per-degree rooflines).
    """
    if prefill is None or prefill.instances <= 1:
        return cost, token_budget
    if not isinstance(cost, GroupCost):
        cost = GroupCost(prefill=cost, decode=cost, instances=prefill.instances,
                         scatter_s_per_token=scatter_s_per_token, pause_s=cost.pause_s)
    return cost, prefill.step_budget
