"""A device's engine dies and comes back: the revival half of :class:`node.runtime.engine.DeviceEngine`
(a mixin over the engine's state).

When the engine process dies, the step it was computing is recorded (:meth:`Revival._note_fatal_step`:
its sequences are the suspects :mod:`node.runtime.resume` quarantines), the device's begun KV copies
are aborted, and :meth:`Revival._orphan_all` takes every sequence off the device and hands
each to the engine's ``orphan_listener`` (:mod:`node.runtime.resume` resumes it elsewhere); once the
supervisor (:mod:`node.runtime.engine_supervisor`) has a fresh engine loaded, :meth:`Revival.revive`
makes the device serve on it.
"""

from __future__ import annotations

import asyncio

import structlog

from node.core.ledger import BlockLedger
from node.core.sequence import PENDING
from node.worker.engine_messages import retrieved
from node.worker.engine_process import EngineDied

log = structlog.get_logger("shiftnode.engine")


class Revival:
    """Death and revival of a :class:`~node.runtime.engine.DeviceEngine` (which holds the state these
    methods read: ``requests``, ``_by_seq``, ``batcher``, ``runner``, ``role``, ``failure``,
    ``orphan_listener``, the step encoder and the queues of steps in flight and aborts), and the watch
    on its engine processes (:meth:`_on_engine_exit` marks the device dead when one ends)."""

    @property
    def kv_pools(self) -> list:
        """The device's KV pool as this process sees it, one tensor per rank in rank order (one for a
        single device; a group's ranks each hold ``K/D`` heads): what in-node moves copy between."""
        pools = getattr(self.runner, "kv_caches", None)
        return list(pools) if pools is not None else [self.runner.kv_cache]

    def _processes(self) -> list:
        """The engine's processes: none in the thread layout, one per rank of a tensor-parallel group."""
        processes = getattr(self.runner, "processes", None)
        if processes is not None:
            return list(processes)
        process = getattr(self.runner, "process", None)
        return [] if process is None else [process]

    def _on_engine_exit(self, process) -> None:
        """An engine process ended (any rank of a group): unless the node is stopping it, the device is down."""
        loop = asyncio.get_running_loop()
        loop.remove_reader(process.sentinel)
        if not self.runner.stopping and not self._dead:
            self._dead = self.runner.death_reason(process)
            self.moves.abort_now()  # a KV copy in flight ends now: the restart must not wait on it (moves.py)
            self.wake()

    def _note_fatal_step(self) -> None:
        """Record the sequences of the step the engine was computing when it died (``fatal``: seq id →
        tokens computed at that step's end; the first step in flight with no answer), and whether that
        was a quarantine step (``fatal_alone``)."""
        def answered(r) -> bool:
            return r.reply.done() and not r.reply.cancelled() and r.reply.exception() is None

        rec = self._fatal_step or next((r for r in self._inflight if not answered(r)), None)
        self._fatal_step = None
        if rec is None or not self.engine_died:
            rec = None
        self.fatal = {} if rec is None else {
            it.seq.seq_id: item.start + it.num_tokens for it, item in zip(rec.plan.items, rec.msg.items)}
        # a suspect of an earlier death, alone in the step: the death is its doing (node.core.quarantine)
        self.fatal_alone = rec is not None and self.quarantine.ran_alone(rec.plan)
        if self.fatal:
            log.warning("engine_fatal_step", device=self.device_id, seqs=sorted(self.fatal), alone=self.fatal_alone)

    def _orphan_all(self) -> None:
        """The engine died: take every sequence off this device (its blocks freed, the placeholders of
        the steps in flight dropped: those tokens were never streamed) and hand each to
        ``orphan_listener``; a choice the listener fails to take ends with 503 ``engine_down``."""
        for req in list(self.requests.values()):
            held = [i for i, s in enumerate(req.seqs) if s.seq_id in self._by_seq]
            try:
                self._finish_request(req)
            except Exception as e:  # noqa: BLE001 - bookkeeping of a broken device: the caller fails it
                log.error("engine_cleanup_failed", device=self.device_id, request=req.request_id, error=str(e))
                continue
            for i in held:
                seq = req.seqs[i]
                while seq.token_ids and seq.token_ids[-1] == PENDING:
                    seq.token_ids.pop()
                seq.num_pending = 0
                try:
                    self.orphan_listener(self, req, i)
                except Exception as e:  # noqa: BLE001 - a choice nobody took over ends with an error
                    log.error("resume_failed", device=self.device_id, seq=seq.seq_id,
                              error=f"{type(e).__name__}: {e}", exc_info=e)
                    if not req.finished[i]:
                        req.fail_choice(i, f"device {self.device_id} is down: {self.failure}", status=503,
                                        code="engine_down", retry_after_s=1.0)

    async def stop_runner(self) -> None:
        """Stop the engine (its processes, and the loop's reading of their sockets); idempotent."""
        processes = self._processes()
        if processes:
            self.runner.stopping = True
            for process in processes:
                asyncio.get_running_loop().remove_reader(process.sentinel)
            self.runner.detach()
        await asyncio.get_running_loop().run_in_executor(self._executor, self.runner.stop)

    async def revive(self, runner) -> None:
        """Serve again on ``runner`` (an :class:`~node.worker.engine_process.EngineProcess` or
        :class:`~node.worker.engine_group.TPEngineGroup`), a fresh engine of this device, loaded and
        attached; the old one died and was stopped (``stop_runner``). Its KV pool is new, so the block
        ledger is too (the old prefix cache pointed into the dead pool), and the incarnation is bumped:
        blocks transfers pinned before now are neither freed nor adopted (:mod:`node.runtime.block_pins`);
        the step diff starts over; the engine takes the layout of the device's role (of the role being
        taken, in a switch's pause); then the step loop runs again. Call once the down device holds
        nothing (its sequences were resumed elsewhere or failed).

        Raises:
            EngineDied, EngineError: the new engine failed while taking the role's layout.
        """
        old = self.batcher.ledger
        ledger = BlockLedger(runner.num_blocks, old.block_size, prefix_caching=old.prefix_caching)
        ledger.num_evictions = old.num_evictions
        self.runner = runner
        self.batcher.ledger = ledger
        self.pins.new_incarnation()  # blocks pinned before now are of the dead pool (node.runtime.block_pins)
        self.quarantine.clear()
        self.moves.rearm()
        self._encoder.reset()
        self._inflight.clear()
        self.drop_aborts()  # (their requests were failed with the device)
        self._dead = None
        self.step_started_s = None
        role = self.roles.revived_role()  # in a switch's pause: the role it is taking
        if role is not None:  # e.g. a group's decode layout, or CUDA graphs for the decode role
            await asyncio.get_running_loop().run_in_executor(self._executor, self.roles.reconfigure, role)
        self.failure, self.engine_died = None, False
        self.start()

    def _on_loop_done(self, task: asyncio.Task) -> None:
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
        log.error("engine_down", device=self.device_id, reason=self.failure)
        self.engine_died = isinstance(error, EngineDied)
        self._note_fatal_step()
        self.moves.abort_now()  # begun copies of this device end at once (their sequences are resumed)
        if self.engine_died and self.orphan_listener is not None:
            self._orphan_all()
        for req in list(self.requests.values()):
            req.fail(f"device {self.device_id} is down: {self.failure}", status=503, code="engine_down",
                     retry_after_s=1.0)
            try:  # nothing runs here any more: drop its sequences and blocks now, not at a next step
                self._finish_request(req)
            except Exception as e:  # noqa: BLE001 - bookkeeping of a broken device: log and go on
                log.error("engine_cleanup_failed", device=self.device_id, request=req.request_id, error=str(e))
        for rec in self._inflight:  # the steps behind the one the loop ended at: nobody awaits their replies
            rec.reply.add_done_callback(retrieved)
        self._inflight.clear()
        self._idle.set()  # a switch waiting for the steps in flight goes on, and fails (switch_role)
        self.refuse_detaches()  # hand-offs waiting for a step boundary: the sequence stays here (engine_residents.py)
        self.moves.refuse_queued()  # moves not begun: refused
        self.fail_jobs()  # a transfer waiting for this device's worker fails instead of hanging
        self._notify(self.down_listeners)
