"""Pacing of a timed benchmark device's steps (``--benchmark-model timed:PATH``), engine side.

The engine core (:class:`~node.worker.engine_core.EngineCore`) starts a step's clock when the step's
message arrives, applies the diff, runs the (computing-nothing) benchmark model and samples; then
:meth:`StepPacer.finish` sleeps whatever is left of the cost model's time for the step's work. The
host work already spent counts toward the step: a device step overlaps with nothing of its own step,
so the step takes ``max(host work, modelled time)``, not their sum. ``time.sleep`` releases the GIL,
so from the node's side it looks like waiting for a device. The idea is NVIDIA Dynamo's mocker engine.

The work is read from the step's own items, as the batcher counts it (``bench/sim/stepcost.py::step_work``):
an item computing exactly one token at or past its prompt is a decoding sequence whose context is
``start + 1`` tokens; every other item is prompt work of ``num_tokens`` tokens.
"""

from __future__ import annotations

import time
from typing import Iterable, Protocol

from node.core.cost import CostModel
from node.timed_cost import step_seconds

__all__ = ["StepPacer", "step_work"]


class _Item(Protocol):
    seq_id: str
    start: int
    num_tokens: int


def step_work(items: Iterable[_Item], prompt_len: dict[str, int]) -> tuple[int, int, int]:
    """``(prompt tokens, decode sequences, their context tokens)`` of a step's items;
    ``prompt_len``: prompt length by sequence id."""
    n = s = k = 0
    for it in items:
        if it.num_tokens == 1 and it.start >= prompt_len[it.seq_id]:
            s += 1
            k += it.start + 1
        else:
            n += it.num_tokens
    return n, s, k


class StepPacer:
    """Makes each step last the cost model's time for its work.

    Attributes:
        cost: the device's step-time model (:func:`node.timed_cost.load_step_cost`).
        steps: steps paced so far.
        overrun_steps: steps whose host work alone already took longer than the modelled time.
        modelled_s: the modelled seconds of all steps, summed.
    """

    def __init__(self, cost: CostModel, clock=time.perf_counter, sleep=time.sleep):
        self.cost = cost
        self._clock = clock
        self._sleep = sleep
        self.steps = 0
        self.overrun_steps = 0
        self.modelled_s = 0.0

    def finish(self, started_s: float, work: tuple[int, int, int]) -> float:
        """Sleep until ``started_s`` (this pacer's clock, s) plus the step's modelled seconds.
        Returns the modelled seconds."""
        target = step_seconds(self.cost, *work)
        left = started_s + target - self._clock()
        self.steps += 1
        self.modelled_s += target
        if left > 0:
            self._sleep(left)
        else:
            self.overrun_steps += 1
        return target
