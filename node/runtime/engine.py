"""The step loop of one device: schedule → send to its engine → postprocess, all on the node's event loop.

The loop talks to the device's engine itself (``runner.async_submit``): it writes a step's diff
(:class:`~node.runtime.step_encoder.StepEncoder`) and goes on, so the API keeps answering while a step
runs, and it plans step N+1 while the engine computes step N (at most two steps in flight; the token
each decoding sequence will sample in N is a placeholder in N+1 that the engine fills in itself). The
device's one worker thread (``_executor``) runs only what blocks or touches the KV pool from the
node's process: a role switch's reconfiguration (after the drain), ``in_worker`` jobs (a peer
transfer's gather or scatter) and blocking moves (both once every step in flight has ended),
overlapped moves (pooled hand-offs: beside later steps, on blocks of a sequence no step in flight
includes) and the engine's stop. Membership changes (new sequences, aborts, detaches) are applied
between sends, on the loop; a block freed while a step is in flight goes only to a later step, which
the engine runs after it (with ``--speculative-config`` it may wait instead: :mod:`node.runtime.spec_decode`).

The step loop and the engine process's lifecycle are here; every other concern is a part that owns its
state and is given by its constructor only what it uses (nano-vllm's and vLLM v1's way): the sequences
the device holds (``residents``: :class:`~node.runtime.engine_residents.Residents`), its role and its
switches (``roles``: :class:`~node.runtime.engine_roles.RoleSwitcher`), the KV moves leaving it (``moves``:
:class:`~node.runtime.moves.KVMover`), the blocks transfers hold (``pins``:
:class:`~node.runtime.block_pins.BlockPins`), its worker jobs (``jobs``:
:class:`~node.runtime.worker_jobs.WorkerJobs`) and its death and revival (``revival``:
:class:`~node.runtime.engine_revival.Revival`). The step loop calls the parts; the parts call each other
only through what their constructors were given. The engine keeps the old names as properties over the
parts (:mod:`node.runtime.parts`), so drivers, transfers and status pages need not know which part holds what.
"""

from __future__ import annotations

import asyncio
from collections import deque
from contextlib import suppress
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import structlog

from node.core.batcher import Batcher, StepPlan
from node.core.quarantine import Quarantine
from node.core.sequence import PENDING, Sequence
from node.runtime import block_pins
from node.runtime.block_pins import BlockPins
from node.runtime.engine_residents import Residents
from node.runtime.engine_revival import Revival
from node.runtime.engine_roles import RoleSwitcher
from node.runtime.grammar_gate import GrammarGate
from node.runtime.inflight import InFlight
from node.runtime.moves import COPY_GRACE_S, KVMover
from node.runtime.parts import part as _part
from node.runtime.switching import DeviceRole, SwitchRecord
from node.runtime.step_encoder import StepEncoder
from node.runtime.worker_jobs import WorkerJobs
from node.runtime.spec_decode import SpecDecoding
from node.worker.engine_core import StepMsg, StepReply
from node.worker.engine_messages import retrieved
from node.worker.engine_process import EngineDied, EngineProcess
from node.worker.local_engine import LocalEngine

log = structlog.get_logger("shiftnode.engine")


class DeviceEngine:
    """Runs continuous batching on one device.

    Args:
        device_id: e.g. ``"cpu:0"`` or ``"cuda:0"``.
        runner: the device's engine (:class:`EngineProcess`, :class:`TPEngineGroup` for a
            tensor-parallel group of devices, or :class:`LocalEngine` in the thread layout): runs
            steps, holds the KV pool (``kv_cache``, shared with this process; None for a group,
            whose pool is sharded across its ranks and is never moved).
        batcher: the device's pure batch former (owns the block ledger).
        role: the device's role state in time-shared mode; ``None`` runs MIXED steps (colocated).
        clock: monotonic seconds.
    """

    def __init__(self, device_id: str, runner: EngineProcess | LocalEngine, batcher: Batcher,
                 clock: Callable[[], float], role: DeviceRole | None = None):
        self.device_id = device_id
        self.runner = runner
        self.batcher = batcher
        self.clock = clock
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"worker-{device_id}")
        self._task: asyncio.Task | None = None
        self.steps = 0
        self.step_listeners: list[Callable[[DeviceEngine, StepPlan, float], None]] = []
        self.switch_listeners: list[Callable[[DeviceEngine, SwitchRecord], None]] = []
        self.down_listeners: list[Callable[[DeviceEngine], None]] = []  # called once the device is down
        self.compile_listeners: list[Callable] = []  # (engine, CompileState): its compiled buckets changed (compile_watch)
        self.plan_hooks: list[Callable[[], None]] = []  # each step-loop pass's first act (Driver.before_plan)
        self.step_started_s: float | None = None  # when the oldest step in flight was sent, else None
        self.last_step_s = 0.0
        self._idle = asyncio.Event()
        self._idle.set()
        self._current_plan: StepPlan | None = None  # the step being post-processed
        self._inflight: deque[InFlight] = deque()  # steps sent to the engine, oldest first (at most 2)
        self._fatal_step: InFlight | None = None  # the step whose reply said the engine died
        self.busy_s = 0.0  # the engine's own time in steps, summed (s)
        self.grammar_in_step = 0  # grammars compiled and matchers rebuilt inside this device's steps (0: all prepared)
        self.errors: dict[str, int] = {}  # contained failures by stage (step | listener | reconfigure | postprocess)
        self._encoder = StepEncoder()  # what the engine holds of each sequence; steps are diffs
        down = lambda: self.revival.failure  # noqa: E731 - why the device is down, else None (the revival part's)
        self.spec: SpecDecoding | None = None  # --speculative-config (node.runtime.spec_decode); None: off
        self.pins = BlockPins(device_id, lambda: self.batcher.ledger)  # blocks transfers hold; the incarnation
        self.quarantine = Quarantine()  # suspects of an engine death, recomputed alone (node.core.quarantine)
        self.residents = Residents(device_id, batcher, self.pins, self.quarantine, self.wake, down,
                                   lambda req, index: self.revival.lost(req, index),
                                   lambda seq: self.grammar_gate.hold(seq))  # the sequences held here
        # grammar sequences wait out of steps until this device's engine has their grammar ready (grammar_gate)
        self.grammar_gate = GrammarGate(device_id, lambda: self.runner, self.residents.holds,
                                        self.residents.fail_seq, self.wake)
        # the device's role and its switches (time-shared and adaptive modes; role None: colocated)
        self.roles = RoleSwitcher(device_id, role, batcher, clock, lambda: self.runner, self._executor, self._idle,
                                  down, self.wake, lambda rec: self._notify(self.switch_listeners, rec),
                                  self._count_error)
        self.moves = KVMover(self, clock, self._executor, self.wake, self._notify)  # KV moves leaving this device
        self.jobs = WorkerJobs(device_id, self._executor, down, self.wake)  # in_worker jobs, between steps
        self.revival = Revival(self, batcher, self.residents, self.pins, self.quarantine, self.moves, self.jobs,
                               self.roles, self._executor)  # death and revival, whether the device is up

    # --- the role part's face (engine_roles.py): the names drivers, status pages and tests use ---
    role = _part("roles", "role")  # the DeviceRole; None: colocated (every step is MIXED)
    role_configs = _part("roles", "role_configs")
    active_config = _part("roles", "active_config")
    chunk_tokens = _part("roles", "chunk_tokens")
    kv_scatter_bytes = _part("roles", "kv_scatter_bytes")
    configure_roles = _part("roles", "configure_roles")
    set_chunk_budget = _part("roles", "set_chunk_budget")
    switch_free = _part("roles", "switch_free")
    switch_role = _part("roles", "switch_role")
    # the moves part's (moves.py)
    migrate = _part("moves", "migrate")
    outgoing_tokens = _part("moves", "outgoing_tokens")
    link_gbps = _part("moves", "link_gbps", settable=True)
    block_layer_bytes = _part("moves", "block_layer_bytes", settable=True)
    migration_listeners = _part("moves", "migration_listeners")
    incarnation = _part("pins", "incarnation")  # bumped by each revive (node.runtime.block_pins)
    # the residents part's (engine_residents.py)
    requests = _part("residents", "requests")  # request id → state, for sequences on this device
    add = _part("residents", "add")
    add_seq = _part("residents", "add_seq")
    adopt = _part("residents", "adopt")
    readopt = _part("residents", "readopt")
    detach = _part("residents", "detach")
    abort = _part("residents", "abort")
    cached_blocks_of = _part("residents", "cached_blocks_of")
    reserve_for = _part("residents", "reserve_for")
    reserve_shared = _part("residents", "reserve_shared")
    check_ownership = _part("residents", "check_ownership")
    movable = _part("residents", "movable")
    release_for_move = _part("residents", "release_for_move")
    forget_if_empty = _part("residents", "forget_if_empty")
    release_pinned = _part("pins", "release")  # free pinned blocks now, unless stale (block_pins.py)
    # the revival part's (engine_revival.py)
    failure = _part("revival", "failure", settable=True)  # why the device is down (its loop ended), else None
    up = _part("revival", "up")
    down_reason = _part("revival", "down_reason")
    engine_died = _part("revival", "engine_died")
    fatal = _part("revival", "fatal", settable=True)
    fatal_alone = _part("revival", "fatal_alone", settable=True)  # the supervisor reads it once
    orphan_listener = _part("revival", "orphan_listener", settable=True)
    kv_pools = _part("revival", "kv_pools")
    stop_runner = _part("revival", "stop_runner")
    revive = _part("revival", "revive")

    in_worker = _part("jobs", "submit")  # (worker_jobs.py)

    def free_pinned(self, block_ids: list[int]) -> None:
        """Free blocks of a detached sequence once a peer has committed its copy. Queued behind the
        worker's current job, so a gather still reading them finishes first. Blocks pinned before a
        restart are not freed (:func:`~node.runtime.block_pins.stale`)."""
        self.jobs.after_queued(lambda: (self.pins.release(block_ids), self.wake()))

    def _busy_seq_ids(self) -> set[str]:
        """The sequences of the steps in flight."""
        return {it.seq.seq_id for r in self._inflight for it in r.plan.items}

    def replies_in_flight(self) -> list[asyncio.Future]:
        """The replies of the steps in flight now (a move's copy into blocks freed before waits for them)."""
        return [r.reply for r in self._inflight]

    # --- what the revival part needs of the step loop (engine_revival.StepLoop) -------------------------
    def dying_step(self) -> InFlight | None:
        """The step the engine was computing when it died: the one whose reply said so, else the first
        step in flight with no answer (None: none). Asked once per death."""
        def answered(r: InFlight) -> bool:
            return r.reply.done() and not r.reply.cancelled() and r.reply.exception() is None

        rec = self._fatal_step or next((r for r in self._inflight if not answered(r)), None)
        self._fatal_step = None
        return rec

    def drop_steps(self) -> None:
        """The step loop ended: nobody awaits the replies of the steps in flight; the device is idle (a
        switch waiting for the steps in flight goes on, and fails: ``switch_role``)."""
        for rec in self._inflight:
            rec.reply.add_done_callback(retrieved)
        self._inflight.clear()
        self._idle.set()

    def serve_on(self, runner: EngineProcess | LocalEngine) -> None:
        """Run steps on ``runner`` (a revive's fresh engine): no step is in flight, and the step diff
        starts over (the new engine holds nothing)."""
        self.runner = runner
        self._encoder.reset()
        self._inflight.clear()
        self.step_started_s = None

    def notify_down(self) -> None:
        """Tell the down listeners the device is down."""
        self._notify(self.down_listeners)

    def _count_error(self, stage: str) -> None:
        """One more contained failure at ``stage`` (step | listener | reconfigure | postprocess)."""
        self.errors[stage] = self.errors.get(stage, 0) + 1

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name=f"engine-{self.device_id}")
        self._task.add_done_callback(self.revival.on_loop_done)
        for process in self.revival.processes():
            asyncio.get_running_loop().add_reader(process.sentinel, self.revival.on_engine_exit, process)

    async def stop(self, grace_s: float = COPY_GRACE_S) -> None:
        """Stop the loop and the engine. A KV copy in flight gets ``grace_s`` seconds to end, then is
        aborted (:meth:`KVMover.abort_copies`): a stop never waits on a slow link without bound."""
        await self.moves.stop(grace_s)
        self.grammar_gate.cancel()
        if self._task and not self._task.done():  # a loop that already ended was reported (on_loop_done)
            self._task.cancel()
            with suppress(asyncio.CancelledError):
                await self._task
        await self.revival.stop_runner()
        self._executor.shutdown(wait=True)

    def wake(self) -> None:
        self._wake.set()

    # --- the loop --------------------------------------------------------------------------------
    async def _loop(self) -> None:
        """Run steps until cancelled. A failure anywhere in one iteration is contained
        (:meth:`_contain`): the requests it touched fail with a clear error and the device goes on."""
        while True:
            try:
                await self._iteration()
            except (asyncio.CancelledError, EngineDied):
                raise  # a dead engine ends the loop: the revival part reports the device down
            except Exception as e:  # noqa: BLE001 - the device must outlive any one bug
                self._contain("step", e, self._current_plan)
                await asyncio.sleep(0)  # let aborts and the driver run before the next try

    async def _iteration(self) -> None:
        """One pass: apply membership changes, then send one step of the current role, then finish
        the step before it (so the engine computes step N while the node post-processes N-1 and
        plans N+1: vLLM's async scheduling, SGLang's overlap scheduler). Changes that touch the KV
        pool from this process (moves, in_worker jobs) first let every step in flight finish."""
        self._current_plan = None
        if self.revival.exited:
            raise EngineDied(self.revival.exited)
        # the driver's round first: the moves and detaches it queues are taken below, before any plan
        for hook in self.plan_hooks:
            hook()
        residents = self.residents
        residents.apply_aborts()
        self.moves.start_overlapped(self._busy_seq_ids)
        hold = self.spec is not None and self.spec.hold(self._inflight)  # a verify step in flight: its kept count is unknown
        if (residents.detaches_queued or self.moves.queued or self.jobs.queued or hold) and self._inflight:
            await self._complete()
            return
        residents.apply_detaches()
        if self.moves.queued:
            await self.moves.apply_blocking()
            return
        if self.jobs.queued:
            await self.jobs.run_queued()
            return
        kind = self.roles.step_kind()
        chunk = self.roles.chunk_budget(kind)  # adaptive's MIXED role: the policy's chunk budget
        runnable = kind is not None and self.batcher.has_work(kind)
        plan = self.quarantine.schedule(self.batcher, kind, chunk) if runnable else None  # (node.core.quarantine)
        if plan and self.spec is not None:
            self.spec.draft(plan, known=not self._inflight)
        if plan:
            await self._send(plan)
        if self._inflight and (not plan or len(self._inflight) > 1):
            await self._complete()
        elif not plan:
            self._wake.clear()
            await self._wake.wait()

    async def _send(self, plan: StepPlan) -> None:
        """Encode ``plan`` as a diff, give each sampling sequence its placeholder token, advance the
        batcher as if the step ran (the next plan builds on it) and hand the message to the engine."""
        self._current_plan = plan
        try:
            msg = self._encoder.encode(plan, self.residents.by_seq)
            self.roles.split_prefill(plan, msg)  # one step, several instances (a prefill role's layout)
        except BaseException:
            self.batcher.discard(plan)  # never sent: nothing will write the blocks it registered (node.core.ledger)
            raise
        pending = []  # (sequence, placeholder index, item position): read back by _complete
        for pos, (it, item) in enumerate(zip(plan.items, msg.items)):
            if item.sample:
                seq = it.seq
                toks = seq.token_ids
                pending.append((seq, len(toks), pos))
                toks.append(PENDING)
                seq.num_pending += 1
        self._encoder.sent(msg)
        self.batcher.commit(plan)
        now = self.clock()
        try:
            reply = self.runner.async_submit(msg)
        except BaseException as e:
            reply = asyncio.get_running_loop().create_future()
            reply.set_exception(e)
        if not self._inflight:
            self.step_started_s = now
        self._idle.clear()
        self._inflight.append(InFlight(plan, msg, reply, now, pending))
        self._current_plan = None

    async def _complete(self) -> None:
        """Wait for the oldest step in flight, write its tokens over their placeholders, emit them."""
        rec = self._inflight[0]
        try:
            reply: StepReply = await rec.reply
        except EngineDied:
            self._fatal_step = rec  # the step the engine was computing when it died (dying_step)
            raise
        except Exception:
            # The steps sent after it were planned on its outcome: they fail with it (at most one more).
            failed = list(self._inflight)
            self._inflight.clear()
            for later in failed[1:]:
                with suppress(Exception):
                    await later.reply
            for r in failed:
                self._settle_failed(r)
            self._current_plan = StepPlan(rec.plan.kind, [it for r in failed for it in r.plan.items])
            raise
        finally:
            if rec.reply.done() and self._inflight and self._inflight[0] is rec:
                self._inflight.popleft()
            self.step_started_s = self._inflight[0].sent_s if self._inflight else None
            if not self._inflight:
                self._idle.set()
        self._current_plan = rec.plan
        self.batcher.settle(rec.plan)  # after the fence: the blocks it filled are written (node.core.ledger)
        self.quarantine.settled(rec.plan)  # a suspect's step that came back: its quarantine may end
        outs = reply.outputs  # one per item, in item order
        for seq, index, pos in rec.pending:
            seq.num_pending -= 1
            toks = seq.token_ids
            if index < len(toks) and toks[index] == PENDING:
                toks[index] = outs[pos].token_id
        if self.spec is not None:  # verify items: their further kept tokens, their rejected drafts' blocks
            self.spec.settle(rec.plan, reply, self.residents.by_seq)
        self.steps += 1
        self.busy_s += reply.busy_s
        self.grammar_in_step += reply.grammar_in_step  # an arrival's grammar its engine had to make in a step
        self.residents.emit(rec.plan, rec.msg.items, outs, self.clock(),
                            lambda e, it: self._contain("postprocess", e, StepPlan(rec.plan.kind, [it])), self.spec and self.spec.kept_of)
        self.last_step_s = reply.busy_s
        self._notify(self.step_listeners, rec.plan, self.last_step_s)
        if reply.compile is not None:  # a bucket compiled in the background: steps from now on are faster
            self._notify(self.compile_listeners, reply.compile)
        self._current_plan = None
        if block_pins.LEDGER_CHECK:
            self.check_ownership()

    def _settle_failed(self, rec: InFlight) -> None:
        """A step failed: its placeholders go, the engine's state is rebuilt by the next message, the
        blocks it was to fill leave the prefix cache; its requests are failed by the caller."""
        for seq, index, _pos in rec.pending:
            seq.num_pending -= 1
            if index < len(seq.token_ids) and seq.token_ids[index] == PENDING:
                del seq.token_ids[index:]
        self._encoder.reset()
        self.batcher.discard(rec.plan)

    def _contain(self, stage: str, error: BaseException, plan: StepPlan | None) -> None:
        """Fail the requests ``plan`` touched (all of this device's when unknown: their state may be
        inconsistent), log and count the error; the device keeps serving the others."""
        self._count_error(stage)
        log.error("engine_error", device=self.device_id, stage=stage, error=f"{type(error).__name__}: {error}",
                  exc_info=error)
        self.residents.fail(self.residents.touched_by(plan),
                            f"internal error on {self.device_id} ({stage}): {type(error).__name__}: {error}")
        self._current_plan = None

    def _notify(self, listeners: list[Callable], *args) -> None:
        """Call each listener; one that raises is logged and counted, and the others still run."""
        for listener in listeners:
            try:
                listener(self, *args)
            except Exception as e:  # noqa: BLE001 - an observer's bug must not stop the device
                self._count_error("listener")
                log.error("engine_listener_failed", device=self.device_id, listener=getattr(listener, "__qualname__", repr(listener)),
                          error=f"{type(e).__name__}: {e}", exc_info=e)
