"""What every placement driver shares: the prompts not yet placed, the wake-up loop, output-length
estimates and KV reservations. Subclasses implement ``tick`` (one decision round of a pure policy)."""

from __future__ import annotations

import asyncio
from contextlib import suppress
from typing import Callable

import structlog

from node.core.output_estimate import PRIOR_TOKENS, OutputEstimator
from node.core.priority import insert_by_priority
from node.core.snapshot import CACHE_LOOKUPS, cached_tokens
from node.runtime.request import RequestState

from node.runtime.interfaces import DriverHost

log = structlog.get_logger("shiftnode.driver")

TICK_S = 0.005  # re-decide at least this often while prompts wait or sequences are resident
# ... and this often while a driver rests between kicks with sequences resident (RoleDriver's quiet node):
# a backstop, so that prompt work queued on a device by a path that forgot to kick waits this long, not
# forever (a resumed sequence once did, behind a quiet adaptive driver)
RESTING_TICK_S = 0.1
SAMPLES = 256  # most recent samples kept
DEFAULT_EXPECTED_OUTPUT = PRIOR_TOKENS  # tokens, until enough requests have ended on their own


def _priority_of(req: RequestState) -> int:
    return req.params.priority


class Driver:
    """Base of the node's placement drivers (time-shared roles, pooled pools)."""

    def __init__(self, node: DriverHost, clock: Callable[[], float]):
        self.node = node
        self.clock = clock
        self.pending: list[RequestState] = []
        self.reserve: dict[str, int] = {}  # request id → KV blocks reserved at placement
        self._event = asyncio.Event()  # wakes the driver's task
        self._due = False  # a decision round was asked for and has not run yet
        self._task: asyncio.Task | None = None
        # output lengths of naturally-ended requests (node.core.output_estimate: the simulator runs the same)
        self.outputs = OutputEstimator()

    def start(self) -> None:
        for e in self.node.engines:
            e.plan_hooks.append(self.before_plan)
        self._task = asyncio.get_running_loop().create_task(self._run(), name=type(self).__name__)

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with suppress(asyncio.CancelledError):
                await self._task

    def submit(self, req: RequestState) -> None:
        """Queue ``req`` for placement, in priority order (node.core.priority; arrival order at equal priority)."""
        insert_by_priority(self.pending, req, _priority_of)
        self.kick()

    def withdraw(self, req: RequestState) -> bool:
        """Remove a request that was never placed (client gone). True if it was pending."""
        if req in self.pending:
            self.pending.remove(req)
            return True
        return False

    def finished(self, req: RequestState, reasons: list[str], output_tokens: int) -> None:
        """Forget the request's reservation; learn output lengths from requests that ended naturally."""
        self.reserve.pop(req.request_id, None)
        if "stop" in reasons:
            self.outputs.observe(output_tokens, len(req.seqs))
        if self.round_on_finish():
            self.kick()

    def round_on_finish(self) -> bool:
        """Whether a request's end calls for a decision round (its slots and blocks may let a prompt in)."""
        return True

    def expected_output(self, req: RequestState) -> int:
        """Expected output tokens per choice: the running estimate capped by ``max_tokens`` (the request's
        own bound; :meth:`node.core.output_estimate.OutputEstimator.expected`)."""
        return self.outputs.expected(req.params.max_tokens)

    def expected_estimate(self) -> int:
        """Expected output tokens per choice before a request's own bound (the mean of the recent
        naturally-ended requests plus one, or the prior until 8 have been seen: :mod:`node.core.output_estimate`)."""
        return self.outputs.estimate()

    def cached_tokens(self, req: RequestState, position: int, device_ids: list[str]) -> dict[str, int]:
        """Prompt tokens (all choices) each device's prefix cache holds for pending ``req`` (the
        ``position``-th pending): what placement may count as not to compute there. Only the oldest
        ``CACHE_LOOKUPS`` pending prompts are looked up, since placement is FIFO and each lookup walks
        the prompt's blocks; the key memo lives on the sequence, so a prompt is hashed once."""
        if position >= CACHE_LOOKUPS:
            return {}
        return cached_tokens(req.seqs, {d: self.node.engine(d).batcher for d in device_ids})

    def reserved_on(self, device_id: str) -> int:
        """Blocks promised on a device to its requests and not yet allocated there."""
        total = 0
        for req in self.node.engine(device_id).requests.values():
            allocated = sum(len(s.block_ids) for s in req.seqs if s.device_id == device_id)
            total += max(0, self.reserve.get(req.request_id, 0) - allocated)
        return total

    def recompute(self, req: RequestState, index: int) -> None:
        """Prefill one sequence again, here (its hand-off to a peer failed after the peer took it): on
        the device with the fewest queued and resident sequences."""
        self.node.least_loaded().add_seq(req, index)
        self.kick()  # prompt work appeared on a device

    def kick(self) -> None:
        """Ask for a decision round: the next plan of a device runs it (:meth:`before_plan`), or the
        driver's task, whichever comes first."""
        self._due = True
        self._event.set()

    def kick_at_plan(self) -> None:
        """Ask for a decision round at the next plan of a device, without waking the driver's task: for
        the end of a step, which its engine's loop follows at once with a pass that runs the plan hooks.
        Waking the task as well cost a task switch and a timer reset at every step end, for a round the
        plan took first."""
        self._due = True

    def tick(self) -> None:
        raise NotImplementedError

    def needs_timer(self) -> bool:
        """Whether the next round must come within ``TICK_S`` even without a kick: prompts wait or
        sequences are resident, and a policy's decisions may change with their age alone."""
        return bool(self.pending) or self._sequences_placed()

    def _sequences_placed(self) -> bool:
        """Some device holds sequences (running or queued)."""
        return any(e.batcher.running or e.batcher.waiting for e in self.node.engines)

    def before_plan(self) -> None:
        """Run the decision round a kick asked for now, if it has not run yet: each device engine calls
        this at the start of each pass of its step loop, before it applies moves and plans a step
        (``DeviceEngine.plan_hooks``), so an arrival's placement, or a switch a finished step called
        for, reaches the step planned next. Waiting for the driver's own task instead put it a step
        later whenever the engine's step reply was handled first (one stories260k CPU device at 40
        req/s: a median 1.3 ms from arrival to placement against 0.03 ms in colocated mode, which
        places in the request's own callback). Kicks that arrive together still make one round."""
        if self._due:
            self._event.clear()
            self._safe_tick()

    def _safe_tick(self) -> None:
        self._due = False
        try:
            self.tick()
        except Exception:  # noqa: BLE001 - a policy bug must not stop the node; it is logged
            log.exception("driver_tick_failed", driver=type(self).__name__)

    async def _run(self) -> None:
        due = True
        while True:
            if due:
                self._safe_tick()
            busy = self.needs_timer()
            resting = not busy and self._sequences_placed()
            self._event.clear()
            try:  # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation
                async with asyncio.timeout(TICK_S if busy else RESTING_TICK_S if resting else None):
                    await self._event.wait()
                # woken by a kick whose round a device's plan has run meanwhile (before_plan took it):
                # a second round now would find what that one left
                due = self._due
            except TimeoutError:
                due = True
