"""Streams survive an engine's death: a sequence whose device died is resumed elsewhere.

When a device's engine process dies, each sequence it held (waiting, prefilling or decoding) is
taken off it (its blocks there freed) and queued on a live device of the node, where its prompt plus
every token already streamed is prefilled again and decoding goes on: the recompute the peer relay
uses when a peer fails mid-stream (:mod:`node.runtime.handoff`), and vLLM's recompute preemption.
The client sees a pause, not an error; with greedy decoding the continuation is what the dead device
would have produced (the same model on the same context). The tokens of the steps that were in flight
when it died were never streamed and are computed again.

A live device is one whose engine is up: in pooled mode a prefill device (the pooled driver then
hands the sequence to a decode device as after any prefill), else a decode device; in the other
modes the least loaded device. With none up and the dead device's restart planned
(:mod:`node.runtime.engine_supervisor`), the sequence waits for it (*parked*) and is queued on the
first device that serves again; if it is left down instead, the sequence goes to a device up by then,
or ends with an error. A request whose client left, or that ended meanwhile (its deadline), is not
resumed.

A request that kills its engine. The sequences of the step the engine was computing when it died
(``DeviceEngine.fatal``) are suspects: each is resumed in quarantine, alone in its steps until it has
passed the point where the engine died (:mod:`node.core.quarantine`), and each such resume counts
against ``--max-retries`` (per sequence, apart from the count of failed peer hand-offs; past it the
choice ends with 503 ``engine_down``). If the engine dies again in a suspect's quarantine step, the
suspect alone caused it: it ends with 500 ``engine_crash`` and is not resumed, and the supervisor does
not count that restart towards ``--engine-restart-max`` (the cause is gone), so requests that kill
their engine cannot leave a device down for good. The other sequences (bystanders) are resumed
without a retry charged: a death is not theirs.

Sequences away from the device when it died (detached for a peer hand-off, in a begun in-node move,
adopted from a peer or a move after it died) are resumed the same way (:meth:`Revival.lost <node.runtime.engine_revival.Revival.lost>`).

Sampled (temperature > 0) sequences resume too; their continuation is another sample (the engine's
generator state died with it), as after a preemption.
"""

from __future__ import annotations

from typing import Callable

import structlog

from node.runtime.engine import DeviceEngine
from node.runtime.engine_supervisor import EngineSupervisor
from node.runtime.interfaces import DriverHost
from node.runtime.request import RequestState

log = structlog.get_logger("shiftnode.resume")

RETRY_AFTER_S = 1.0


class Resumer:
    """Resumes the sequences of dead devices (see the module docstring); one per node.

    Args:
        node: the node's engines, config and metrics (``kv_recomputes`` counts each resume).
        supervisor: says whether a dead device will be restarted, and when it serves again.

    It installs :meth:`orphaned` as each engine's ``orphan_listener`` and :meth:`restarted` and
    :meth:`left_down` as the supervisor's listeners. ``on_queued`` is called after it queues prompt work
    on a device (the node points it at its driver's ``kick``: the queued work may change the device's
    role, and a quiet adaptive driver makes no decision round until asked).
    """

    def __init__(self, node: DriverHost, supervisor: EngineSupervisor):
        self.node = node
        self.supervisor = supervisor
        self.retries: dict[str, int] = {}  # sequence id → resumes so far
        self.suspects: dict[str, int] = {}  # sequence id → tokens its quarantine runs to (node.core.quarantine)
        # device id → sequences waiting for its restart (request, choice, quarantine mark or None)
        self.parked: dict[str, list[tuple[RequestState, int, int | None]]] = {}
        self.resumed = 0  # sequences resumed (queued on another device, or parked)
        self.on_queued: Callable[[], None] = lambda: None
        for e in node.engines:
            e.orphan_listener = self.orphaned
        supervisor.restart_listeners.append(self.restarted)
        supervisor.left_down_listeners.append(self.left_down)

    def orphaned(self, engine: DeviceEngine, req: RequestState, index: int) -> None:
        """Choice ``index`` of ``req`` was on ``engine``, whose engine process died (or it was away, in a
        transfer, when it did); it holds nothing there any more (its blocks were freed, its in-flight
        placeholders dropped). Resume it on a live device, park it for the restart, or end it with an
        error: 500 ``engine_crash`` when the death was its own doing, else 503 ``engine_down``."""
        seq = req.seqs[index]
        if req.cancelled or req.finished[index]:
            return
        reason = (f"device {engine.device_id} is down: {engine.failure}" if engine.failure is not None
                  else f"device {engine.device_id} was restarted while the sequence was in a KV transfer")
        fatal = seq.seq_id in engine.fatal  # it was in the step the engine died in: a suspect
        if fatal and engine.fatal_alone:
            self._fail(req, index, f"{reason}. This request's step killed the engine again while it ran alone "
                       "(it had killed it once before); it is not resumed again", status=500, code="engine_crash")
            return
        if fatal:  # a death is charged to its suspects only
            until = self.suspects[seq.seq_id] = engine.fatal[seq.seq_id]
            max_retries = self.node.config.max_retries
            n = self.retries[seq.seq_id] = self.retries.get(seq.seq_id, 0) + 1
            if n > max_retries:
                self._fail(req, index, f"{reason} (gave up after {n - 1} resumes, --max-retries {max_retries})")
                return
        else:  # a suspect not yet past its mark stays one; a bystander is not quarantined
            until = self.suspects.get(seq.seq_id)
            until = until if until is not None and seq.num_computed < until else None
        target = self._live_target(engine)
        if target is None and not self.supervisor.will_restart(engine):
            self._fail(req, index, f"{reason} (no other device is up, and it will not be restarted)")
            return
        seq.num_computed, seq.num_registered, seq.block_ids = 0, 0, []
        seq.num_preemptions += 1
        self.resumed += 1
        self.node.metrics.kv_recomputes.inc()
        log.warning("sequence_resumed", seq=seq.seq_id, dead=engine.device_id, suspect=until is not None,
                    on=target.device_id if target else "(its restart)", streamed=seq.num_output)
        if target is not None:
            self._queue(target, req, index, until)
        else:
            self.parked.setdefault(engine.device_id, []).append((req, index, until))

    def _queue(self, engine: DeviceEngine, req: RequestState, index: int, until: int | None) -> None:
        engine.add_seq(req, index, until)
        self.on_queued()

    def _live_target(self, dead: DeviceEngine) -> DeviceEngine | None:
        """Where a sequence of ``dead`` is prefilled again: pooled, the live prefill device with the least
        queued prompt work, else a live decode device; other modes, the least loaded live device. (A
        ``dead`` device that is up again counts: a sequence it lost in a transfer may go back to it.)"""
        node = self.node
        live = [e for e in node.engines if e.up and (e is not dead or dead.failure is None)]
        if not live:
            return None
        if node.config.mode == "pooled":
            prefill = set(node.config.prefill_group_ids())
            live = [e for e in live if e.device_id in prefill] or live
            return min(live, key=lambda e: sum(s.num_uncomputed for s in e.batcher.waiting))
        return node.least_loaded([e.device_id for e in live])

    def restarted(self, engine: DeviceEngine) -> None:
        """``engine``'s device serves again: queue there the sequences still wanted that were parked,
        for it or for any other device (the first device back takes them all)."""
        parked, self.parked = self.parked, {}
        for entries in parked.values():
            for req, index, until in entries:
                if not (req.cancelled or req.finished[index]):
                    self._queue(engine, req, index, until)
        engine.wake()

    def left_down(self, engine: DeviceEngine) -> None:
        """``engine``'s device will not come back: the sequences parked for it go to a live device if
        one is up now, else end with 503 ``engine_down``."""
        for req, index, until in self.parked.pop(engine.device_id, []):
            if req.cancelled or req.finished[index]:
                continue
            target = self._live_target(engine)
            if target is not None:
                self._queue(target, req, index, until)
            else:
                self._fail(req, index, f"device {engine.device_id} is down for good: {engine.failure}")

    def forget(self, req: RequestState) -> None:
        """The request ended: drop its resume counts."""
        for seq in req.seqs:
            self.retries.pop(seq.seq_id, None)
            self.suspects.pop(seq.seq_id, None)

    @staticmethod
    def _fail(req: RequestState, index: int, message: str, status: int = 503, code: str = "engine_down") -> None:
        if not req.finished[index]:
            req.fail_choice(index, message, status=status, code=code,
                            retry_after_s=RETRY_AFTER_S if status == 503 else None)
