"""A step a device's loop sent to its engine and has not yet post-processed (:mod:`node.runtime.engine`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from node.core.batcher import StepPlan
from node.core.sequence import Sequence
from node.worker.engine_core import StepMsg


@dataclass
class InFlight:
    """A step sent to the engine and not yet post-processed: its plan, its message, the future of its
    :class:`~node.worker.engine_core.StepReply`, when it was sent (the loop's clock, s), and ``pending``:
    the sequences given a placeholder token, the placeholder's index, the item's position in the step."""

    plan: StepPlan
    msg: StepMsg
    reply: asyncio.Future  # → StepReply
    sent_s: float
    pending: list[tuple[Sequence, int, int]]
