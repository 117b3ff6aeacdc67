"""A device's engine dies and comes back: the revival part of :class:`node.runtime.engine.DeviceEngine`
(its ``revival``), which owns whether the device is down and why, the step its engine died in, and
who resumes its sequences.

When the engine process dies, the step it was computing is recorded (:meth:`Revival._note_fatal_step`:
its sequences are the suspects :mod:`node.runtime.resume` quarantines), the device's begun KV copies
are aborted, and :meth:`Revival._orphan_all` takes every sequence off the device and hands each to
``orphan_listener`` (:mod:`node.runtime.resume` resumes it elsewhere); once the supervisor
(:mod:`node.runtime.engine_supervisor`) has a fresh engine loaded, :meth:`Revival.revive` makes the
device serve on it.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from typing import Any, Callable, Protocol

import structlog

from node.core.batcher import Batcher
from node.core.ledger import BlockLedger
from node.core.quarantine import Quarantine
from node.runtime.block_pins import BlockPins
from node.runtime.engine_residents import Residents
from node.runtime.engine_roles import RoleSwitcher
from node.runtime.moves import KVMover
from node.runtime.request import RequestState
from node.runtime.worker_jobs import WorkerJobs
from node.worker.engine_process import EngineDied

log = structlog.get_logger("shiftnode.engine")


class StepLoop(Protocol):
    """What revival needs of the device's step loop (a :class:`~node.runtime.engine.DeviceEngine`)."""

    device_id: str
    runner: Any  # the device's engine now (EngineProcess, TPEngineGroup or LocalEngine)

    def start(self) -> None: ...  # run the step loop (again)
    def wake(self) -> None: ...
    def dying_step(self) -> Any: ...  # the step in flight the engine died in (``plan``, ``msg``), else None
    def drop_steps(self) -> None: ...  # the loop ended: forget the steps in flight, the device is idle
    def serve_on(self, runner: Any) -> None: ...  # a fresh engine: no step in flight, the step diff starts over
    def notify_down(self) -> None: ...  # call the down listeners


class Revival:
    """Death and revival of one device, and the watch on its engine processes (:meth:`on_engine_exit`
    marks the device dead when one ends; :meth:`on_loop_done` reports it down once its step loop ends).

    Args:
        loop: the device's step loop (what it runs on, and what dies with it: :class:`StepLoop`);
            the first argument ``orphan_listener`` is called with.
        batcher: the device's batch former (a revive gives it a new block ledger).
        residents: the device's sequences (failed, or handed to ``orphan_listener``, when it dies).
        pins: the device's pinned blocks (a revive starts a new incarnation).
        quarantine: suspects of an engine death (the step it died in may be a suspect's, alone).
        moves: the device's outgoing KV moves (aborted when it dies, refused while it is down).
        jobs: the device's worker jobs (failed when it dies).
        roles: the device's role (a fresh engine takes the layout of the role held or being taken).
        executor: the device's worker thread (the engine's stop and a fresh engine's reconfiguration).
    """

    def __init__(self, loop: StepLoop, batcher: Batcher, residents: Residents, pins: BlockPins,
                 quarantine: Quarantine, moves: KVMover, jobs: WorkerJobs, roles: RoleSwitcher, executor: Executor):
        self._loop, self._batcher, self._residents, self._pins = loop, batcher, residents, pins
        self._quarantine, self._moves, self._jobs, self._roles, self._executor = quarantine, moves, jobs, roles, executor
        self.failure: str | None = None  # why the device is down (its step loop ended), else None
        self.exited: str | None = None  # the engine process was seen to exit (between steps): why
        self.engine_died = False  # the device went down because its engine process died (restartable)
        # the step the engine died in: seq id → tokens computed at its end; whether it was a quarantine step
        self.fatal: dict[str, int] = {}
        self.fatal_alone = False
        # called for each sequence held here when the engine process dies (node.runtime.resume); None: they fail
        self.orphan_listener: Callable[[Any, RequestState, int], None] | None = None

    @property
    def up(self) -> bool:
        """The device serves: its step loop runs and its engine process has not been seen to exit."""
        return self.failure is None and not self.exited

    @property
    def down_reason(self) -> str | None:
        """Why the device is down (its step loop ended, or its engine process was seen to exit), else None."""
        return self.failure or self.exited

    @property
    def kv_pools(self) -> list:
        """The device's KV pool as this process sees it, one tensor per rank in rank order (one for a
        single device; a group's ranks each hold ``K/D`` heads): what in-node moves copy between."""
        runner = self._loop.runner
        pools = getattr(runner, "kv_caches", None)
        return list(pools) if pools is not None else [runner.kv_cache]

    def processes(self) -> list:
        """The engine's processes: none in the thread layout, one per rank of a tensor-parallel group."""
        runner = self._loop.runner
        processes = getattr(runner, "processes", None)
        if processes is not None:
            return list(processes)
        process = getattr(runner, "process", None)
        return [] if process is None else [process]

    def on_engine_exit(self, process) -> None:
        """An engine process ended (any rank of a group): unless the node is stopping it, the device is down."""
        loop = asyncio.get_running_loop()
        loop.remove_reader(process.sentinel)
        runner = self._loop.runner
        if not runner.stopping and not self.exited:
            self.exited = runner.death_reason(process)
            self._moves.abort_now()  # a KV copy in flight ends now: the restart must not wait on it (moves.py)
            self._loop.wake()

    def lost(self, req: RequestState, index: int) -> None:
        """A sequence held by no device whose KV is lost with this device's pool (it was adopted, detached
        or moving when the engine died): resumed like the dead device's others (``orphan_listener``,
        :mod:`node.runtime.resume`), or, with none to take it, ended with 503 ``engine_down``."""
        seq = req.seqs[index]
        seq.block_ids, seq.num_pending = [], 0
        if self.orphan_listener is not None and (self.engine_died or self.failure is None):
            try:
                return self.orphan_listener(self._loop, req, index)
            except Exception as e:  # noqa: BLE001 - a choice nobody took over ends with an error below
                log.error("resume_failed", device=self._loop.device_id, seq=seq.seq_id, error=f"{type(e).__name__}: {e}")
        if not req.finished[index]:
            req.fail_choice(index, f"device {self._loop.device_id} is down: {self.failure}", status=503,
                            code="engine_down", retry_after_s=1.0)

    def _note_fatal_step(self) -> None:
        """Record the sequences of the step the engine was computing when it died (``fatal``: seq id →
        tokens computed at that step's end; the first step in flight with no answer), and whether that
        was a quarantine step (``fatal_alone``)."""
        rec = self._loop.dying_step()
        if not self.engine_died:
            rec = None
        self.fatal = {} if rec is None else {
            it.seq.seq_id: item.start + it.num_tokens - len(it.draft) for it, item in zip(rec.plan.items, rec.msg.items)}
        # a suspect of an earlier death, alone in the step: the death is its doing (node.core.quarantine)
        self.fatal_alone = rec is not None and self._quarantine.ran_alone(rec.plan)
        if self.fatal:
            log.warning("engine_fatal_step", device=self._loop.device_id, seqs=sorted(self.fatal), alone=self.fatal_alone)

    def _orphan_all(self) -> None:
        """The engine died: take every sequence off this device (its blocks freed, the placeholders of
        the steps in flight dropped: those tokens were never streamed) and hand each to
        ``orphan_listener``; a choice the listener fails to take ends with 503 ``engine_down``."""
        device_id = self._loop.device_id
        for req in list(self._residents.requests.values()):
            try:
                held = self._residents.evict(req)
            except Exception as e:  # noqa: BLE001 - bookkeeping of a broken device: the caller fails it
                log.error("engine_cleanup_failed", device=device_id, request=req.request_id, error=str(e))
                continue
            for i in held:
                try:
                    self.orphan_listener(self._loop, req, i)
                except Exception as e:  # noqa: BLE001 - a choice nobody took over ends with an error
                    log.error("resume_failed", device=device_id, seq=req.seqs[i].seq_id,
                              error=f"{type(e).__name__}: {e}", exc_info=e)
                    if not req.finished[i]:
                        req.fail_choice(i, f"device {device_id} is down: {self.failure}", status=503,
                                        code="engine_down", retry_after_s=1.0)

    async def stop_runner(self) -> None:
        """Stop the engine (its processes, and the loop's reading of their sockets); idempotent."""
        processes = self.processes()
        runner = self._loop.runner
        if processes:
            runner.stopping = True
            for process in processes:
                asyncio.get_running_loop().remove_reader(process.sentinel)
            runner.detach()
        await asyncio.get_running_loop().run_in_executor(self._executor, runner.stop)

    async def revive(self, runner) -> None:
        """Serve again on ``runner`` (an :class:`~node.worker.engine_process.EngineProcess` or
        :class:`~node.worker.engine_group.TPEngineGroup`), a fresh engine of this device, loaded and
        attached; the old one died and was stopped (:meth:`stop_runner`). Its KV pool is new, so the block
        ledger is too (the old prefix cache pointed into the dead pool), and the incarnation is bumped:
        blocks transfers pinned before now are neither freed nor adopted (:mod:`node.runtime.block_pins`);
        the step diff starts over; the engine takes the layout of the device's role (of the role being
        taken, in a switch's pause); then the step loop runs again. Call once the down device holds
        nothing (its sequences were resumed elsewhere or failed).

        Raises:
            EngineDied, EngineError: the new engine failed while taking the role's layout.
        """
        old = self._batcher.ledger
        ledger = BlockLedger(runner.num_blocks, old.block_size, prefix_caching=old.prefix_caching)
        ledger.num_evictions = old.num_evictions
        self._loop.serve_on(runner)
        self._batcher.ledger = ledger
        self._pins.new_incarnation()  # blocks pinned before now are of the dead pool (node.runtime.block_pins)
        self._quarantine.clear()
        self._moves.rearm()
        self._residents.drop_aborts()  # (their requests were failed with the device)
        self.exited = None
        role = self._roles.revived_role()  # in a switch's pause: the role it is taking
        if role is not None:  # e.g. a group's decode layout, or CUDA graphs for the decode role
            await asyncio.get_running_loop().run_in_executor(self._executor, self._roles.reconfigure, role)
        self.failure, self.engine_died = None, False
        self._loop.start()

    def on_loop_done(self, task: asyncio.Task) -> None:
        """The step loop ended other than by cancellation: the engine process died (its sequences go to
        ``orphan_listener`` to be resumed elsewhere) or a bug ended the loop; the device is down. Its other
        requests fail and ``failure`` says why (``/health`` reports it)."""
        if task.cancelled():
            return
        error = task.exception()
        if isinstance(error, EngineDied):
            self.failure = str(error)
        else:
            self.failure = f"step loop ended: {type(error).__name__}: {error}" if error else "step loop ended"
        device_id = self._loop.device_id
        log.error("engine_down", device=device_id, reason=self.failure)
        self.engine_died = isinstance(error, EngineDied)
        self._note_fatal_step()
        self._moves.abort_now()  # begun copies of this device end at once (their sequences are resumed)
        if self.engine_died and self.orphan_listener is not None:
            self._orphan_all()
        for req in list(self._residents.requests.values()):
            req.fail(f"device {device_id} is down: {self.failure}", status=503, code="engine_down",
                     retry_after_s=1.0)
            try:  # nothing runs here any more: drop its sequences and blocks now, not at a next step
                self._residents.finish_request(req)
            except Exception as e:  # noqa: BLE001 - bookkeeping of a broken device: log and go on
                log.error("engine_cleanup_failed", device=device_id, request=req.request_id, error=str(e))
        self._loop.drop_steps()  # a switch waiting for the steps in flight goes on, and fails (switch_role)
        self._residents.refuse_detaches()  # hand-offs waiting for a step boundary: the sequence stays here
        self._moves.refuse_queued()  # moves not begun: refused
        self._jobs.fail_queued()  # a transfer waiting for this device's worker fails instead of hanging
        self._loop.notify_down()

