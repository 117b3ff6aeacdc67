"""The online refit's bookkeeping: which measured step becomes which sample, when to refit, what to refit (pure).

The node's role driver (``node.runtime.role_driver.RoleDriver``) and the simulator (:mod:`bench.sim`,
``planning="refit"``) run this one class, each fed its own step times: the live node its measured
steps, the simulator the step times of its true cost model. :meth:`OnlineRefit.record` turns a step
into a sample of :func:`node.core.refit.fit_steps`:

* a PREFILL step: ``(tokens, s)``, the tokens of its longest instance for a group
  (:meth:`node.core.group_cost.GroupCost.longest_instance_tokens`: the step lasts that instance);
* a DECODE step: ``(0, sequences, their context tokens, s)``;
* a MIXED step of a device in a role (adaptive): the whole step, ``(prompt tokens, decode sequences,
  their context, s)``, fitted jointly with the decode steps; a role-less MIXED step (colocated) is none.

:meth:`OnlineRefit.due` counts steps: a refit every :data:`REFIT_EVERY` steps, and at least
``min_interval_s`` apart (:data:`REFIT_MIN_S` in adaptive mode, where a refit's ~2.5 ms of event-loop time
every 32 short CPU steps stalled the step pipeline). :meth:`OnlineRefit.refit` refits a linear
:class:`~node.core.cost.CostModel` (a group's one fitted model becomes both its prefill and decode
parts); a roofline model is kept as it is (not of the linear fit's form). The first refit replaces the
start-up defaults outright; later ones move each coefficient a bounded step (:data:`node.core.refit.MAX_SHIFT`).
"""

from __future__ import annotations

from collections import deque
from typing import Callable

import msgspec

from node.core.batcher import StepKind, StepPlan
from node.core.cost import CostModel
from node.core.group_cost import GroupCost
from node.core.refit import MAX_SHIFT, fit_steps

__all__ = ["OnlineRefit", "REFIT_EVERY", "REFIT_MIN_S", "SAMPLES"]

SAMPLES = 256  # most recent samples of each kind kept
REFIT_EVERY = 32  # steps between refits of the cost model
REFIT_MIN_S = 0.5  # adaptive mode: at least this long between refits (s; module doc)


class OnlineRefit:
    """Step samples and the refit of a role policy's cost model from them (module doc).

    Args:
        one_configuration: prompt and decode steps run one forward configuration (same degree, no decode
            graphs): one fixed cost (:func:`node.core.refit.fit_steps`'s ``shared_fixed``).
        min_interval_s: least time between refits (s; 0: every :data:`REFIT_EVERY` steps).
    """

    def __init__(self, *, one_configuration: bool = False, min_interval_s: float = 0.0):
        self.one_configuration = one_configuration
        self.min_interval_s = min_interval_s
        self.prefill: deque[tuple[int, float]] = deque(maxlen=SAMPLES)
        # steps in the decode configuration, decode and mixed: (prompt tokens, decode seqs, their context, s)
        self.decode: deque[tuple[int, int, int, float]] = deque(maxlen=SAMPLES)
        self.pauses: deque[float] = deque(maxlen=SAMPLES)
        self.steps = 0
        self.refits = 0
        self._refit_s = -float("inf")
        self._fitted = False  # a refit has replaced the start-up cost model

    def record(self, plan: StepPlan, seconds: float, cost, *, in_role: bool) -> None:
        """Take a step of ``plan`` that lasted ``seconds`` as a sample (module doc); ``cost``: the policy's
        current model (a group's says how its prefill instances split a step); ``in_role``: the device runs
        under a role policy (a MIXED step is then an adaptive one)."""
        if plan.kind is StepKind.PREFILL:
            tokens = (cost.longest_instance_tokens([it.num_tokens for it in plan.items]) if isinstance(cost, GroupCost)
                      else plan.num_tokens)
            self.prefill.append((tokens, seconds))
        elif plan.kind is StepKind.DECODE:  # a verify item's drafts (node.core.spec_plan): prompt-like tokens
            drafts = sum(it.num_tokens for it in plan.items) - len(plan.items)
            self.decode.append((drafts, len(plan.items), sum(it.seq.num_computed for it in plan.items), seconds))
        elif plan.kind is StepKind.MIXED and in_role:  # (a verify item, num_tokens > 1, counts as prompt work)
            decodes = [it for it in plan.items if it.num_tokens == 1 and it.seq.num_output > 0]
            # the whole step, fitted jointly with the decode steps (node.core.refit): no share of it is
            # estimated from the model being fitted
            self.decode.append((plan.num_tokens - len(decodes), len(decodes), sum(it.seq.num_computed for it in decodes),
                                seconds))

    def restart(self) -> int:
        """Forget the step samples (the pauses stay): the steps changed speed (a bucket of the forward was
        compiled in the background), so samples from before would pull the fit towards steps that no
        longer happen. The next refit then replaces the model outright, as the first one does. Returns the
        number of samples dropped."""
        dropped = len(self.prefill) + len(self.decode)
        self.prefill.clear()
        self.decode.clear()
        self._fitted = False
        return dropped

    def record_pause(self, seconds: float) -> None:
        """A measured role switch's pause (s; free DECODE <-> MIXED switches are none)."""
        self.pauses.append(seconds)

    def due(self, clock: Callable[[], float]) -> bool:
        """Count a step; True when a refit is due now (``clock()``, s, read only every :data:`REFIT_EVERY` steps)."""
        self.steps += 1
        if self.steps % REFIT_EVERY:
            return False
        now = clock()
        if now - self._refit_s < self.min_interval_s:
            return False
        self._refit_s = now
        return True

    def refit(self, cost):
        """``cost`` refitted from the samples (module doc); a roofline model (or a group of them) comes back as it is."""
        group = cost if isinstance(cost, GroupCost) else None
        base = group.decode if group is not None else cost
        if not isinstance(base, CostModel):
            return cost
        fitted = fit_steps(list(self.prefill), list(self.decode), list(self.pauses), base=base,
                           shared_fixed=self.one_configuration, max_shift=MAX_SHIFT if self._fitted else float("inf"))
        self._fitted = self._fitted or msgspec.structs.replace(fitted, pause_s=base.pause_s) != base
        self.refits += 1
        if group is not None:
            return msgspec.structs.replace(group, prefill=fitted, decode=fitted, pause_s=fitted.pause_s)
        return fitted
