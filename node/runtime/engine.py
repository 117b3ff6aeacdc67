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
the engine runs after it.

The step loop and the engine process's lifecycle are here; the role and its switches are a part that
owns them (``roles``: :class:`~node.runtime.engine_roles.RoleSwitcher`), as are the KV moves leaving the
device (``moves``: :class:`~node.runtime.moves.KVMover`); which sequences live on the device
(:mod:`node.runtime.engine_residents`) and death and revival (:mod:`node.runtime.engine_revival`) are mixins.
"""

from __future__ import annotations

import asyncio
from collections import deque
from contextlib import suppress
from dataclasses import dataclass
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import structlog

from node.core.batcher import Batcher, ScheduledSeq, StepPlan
from node.core.quarantine import Quarantine
from node.core.sequence import PENDING, Sequence
from node.runtime import block_pins
from node.runtime.block_pins import BlockPins
from node.runtime.engine_residents import Residents
from node.runtime.engine_revival import Revival
from node.runtime.engine_roles import RoleSwitcher
from node.runtime.moves import COPY_GRACE_S, KVMover
from node.runtime.parts import part as _part
from node.runtime.request import RequestState
from node.runtime.switching import DeviceRole, SwitchRecord
from node.runtime.step_encoder import StepEncoder
from node.worker.engine_core import StepMsg, StepReply
from node.worker.engine_process import EngineDied, EngineProcess
from node.worker.local_engine import LocalEngine
from node.worker.runner import SeqOutput

log = structlog.get_logger("shiftnode.engine")


@dataclass
class _InFlight:
    """A step sent to the engine and not yet post-processed."""

    plan: StepPlan
    msg: StepMsg
    reply: asyncio.Future  # → StepReply
    sent_s: float
    pending: list[tuple[Sequence, int, int]]  # sequences given a placeholder token, its index, the item's position


class DeviceEngine(Residents, Revival):
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
        self.requests: dict[str, RequestState] = {}  # request id → state, for sequences on this device
        self._by_seq: dict[str, tuple[RequestState, int]] = {}
        self._aborts: list[str] = []
        self._detaches: list[tuple[Sequence, asyncio.Future]] = []
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
        self._inflight: deque[_InFlight] = deque()  # steps sent to the engine, oldest first (at most 2)
        self._jobs: deque[tuple[Callable, tuple, asyncio.Future]] = deque()  # in_worker jobs
        self.busy_s = 0.0  # the engine's own time in steps, summed (s)
        self.errors: dict[str, int] = {}  # contained failures by stage (step | listener | reconfigure | postprocess)
        self.failure: str | None = None  # why the device is down (its step loop ended), else None
        self._encoder = StepEncoder()  # what the engine holds of each sequence; steps are diffs
        self._dead: str | None = None  # the engine process exited (seen between steps)
        self.engine_died = False  # the device went down because its engine process died (restartable)
        self.pins = BlockPins(device_id, lambda: self.batcher.ledger)  # blocks transfers hold; the incarnation
        self.quarantine = Quarantine()  # suspects of an engine death, recomputed alone (node.core.quarantine)
        # the step the engine died in: seq id → tokens computed at its end; whether it was a quarantine step
        self.fatal, self.fatal_alone, self._fatal_step = {}, False, None
        # called for each sequence held here when the engine process dies (node.runtime.resume); None: they fail
        self.orphan_listener: Callable[[DeviceEngine, RequestState, int], None] | None = None
        # the device's role and its switches (time-shared and adaptive modes; role None: colocated)
        self.roles = RoleSwitcher(device_id, role, batcher, clock, lambda: self.runner, self._executor, self._idle,
                                  lambda: self.failure, self.wake, lambda rec: self._notify(self.switch_listeners, rec),
                                  self._count_error)
        self.moves = KVMover(self, clock, self._executor, self.wake, self._notify)  # KV moves leaving this device

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

    def _busy_seq_ids(self) -> set[str]:
        """The sequences of the steps in flight."""
        return {it.seq.seq_id for r in self._inflight for it in r.plan.items}

    def replies_in_flight(self) -> list[asyncio.Future]:
        """The replies of the steps in flight now (a move's copy into blocks freed before waits for them)."""
        return [r.reply for r in self._inflight]

    def _count_error(self, stage: str) -> None:
        """One more contained failure at ``stage`` (step | listener | reconfigure | postprocess)."""
        self.errors[stage] = self.errors.get(stage, 0) + 1

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name=f"engine-{self.device_id}")
        self._task.add_done_callback(self._on_loop_done)
        for process in self._processes():
            asyncio.get_running_loop().add_reader(process.sentinel, self._on_engine_exit, process)

    async def stop(self, grace_s: float = COPY_GRACE_S) -> None:
        """Stop the loop and the engine. A KV copy in flight gets ``grace_s`` seconds to end, then is
        aborted (:meth:`KVMover.abort_copies`): a stop never waits on a slow link without bound."""
        await self.moves.stop(grace_s)
        if self._task and not self._task.done():  # a loop that already ended was reported by _on_loop_done
            self._task.cancel()
            with suppress(asyncio.CancelledError):
                await self._task
        await self.stop_runner()  # (engine_revival.py)
        self._executor.shutdown(wait=True)

    def wake(self) -> None:
        self._wake.set()

    async def _run_jobs(self) -> None:
        loop = asyncio.get_running_loop()
        while self._jobs:
            fn, args, fut = self._jobs.popleft()
            try:
                result = await loop.run_in_executor(self._executor, fn, *args)
            except Exception as e:  # noqa: BLE001 - the job's caller gets its own failure
                if not fut.done():
                    fut.set_exception(e)
                continue
            if not fut.done():
                fut.set_result(result)

    # --- the loop --------------------------------------------------------------------------------
    async def _loop(self) -> None:
        """Run steps until cancelled. A failure anywhere in one iteration is contained
        (:meth:`_contain`): the requests it touched fail with a clear error and the device goes on."""
        while True:
            try:
                await self._iteration()
            except (asyncio.CancelledError, EngineDied):
                raise  # a dead engine ends the loop: _on_loop_done reports the device down
            except Exception as e:  # noqa: BLE001 - the device must outlive any one bug
                self._contain("step", e, self._current_plan)
                await asyncio.sleep(0)  # let aborts and the driver run before the next try

    async def _iteration(self) -> None:
        """One pass: apply membership changes, then send one step of the current role, then finish
        the step before it (so the engine computes step N while the node post-processes N-1 and
        plans N+1: vLLM's async scheduling, SGLang's overlap scheduler). Changes that touch the KV
        pool from this process (moves, in_worker jobs) first let every step in flight finish."""
        self._current_plan = None
        if self._dead:
            raise EngineDied(self._dead)
        # the driver's round first: the moves and detaches it queues are taken below, before any plan
        for hook in self.plan_hooks:
            hook()
        self._apply_aborts()
        self.moves.start_overlapped(self._busy_seq_ids)
        if (self._detaches or self.moves.queued or self._jobs) and self._inflight:
            await self._complete()
            return
        self._apply_detaches()
        if self.moves.queued:
            await self.moves.apply_blocking()
            return
        if self._jobs:
            await self._run_jobs()
            return
        kind = self.roles.step_kind()
        chunk = self.roles.chunk_budget(kind)  # adaptive's MIXED role: the policy's chunk budget
        runnable = kind is not None and self.batcher.has_work(kind)
        plan = self.quarantine.schedule(self.batcher, kind, chunk) if runnable else None  # (node.core.quarantine)
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
            msg = self._encoder.encode(plan, self._by_seq)
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
        self._inflight.append(_InFlight(plan, msg, reply, now, pending))
        self._current_plan = None

    async def _complete(self) -> None:
        """Wait for the oldest step in flight, write its tokens over their placeholders, emit them."""
        rec = self._inflight[0]
        try:
            reply: StepReply = await rec.reply
        except EngineDied:
            self._fatal_step = rec  # the step the engine was computing when it died (engine_revival.py)
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
        self.steps += 1
        self.busy_s += reply.busy_s
        self._postprocess(rec, outs)
        self.last_step_s = reply.busy_s
        self._notify(self.step_listeners, rec.plan, self.last_step_s)
        if reply.compile is not None:  # a bucket compiled in the background: steps from now on are faster
            self._notify(self.compile_listeners, reply.compile)
        self._current_plan = None
        if block_pins.LEDGER_CHECK:
            self.check_ownership()

    def _settle_failed(self, rec: _InFlight) -> None:
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
        if plan is not None and plan.items:
            reqs = {self._by_seq[it.seq.seq_id][0].request_id: self._by_seq[it.seq.seq_id][0]
                    for it in plan.items if it.seq.seq_id in self._by_seq}
        else:
            reqs = dict(self.requests)
        for req in reqs.values():
            req.fail(f"internal error on {self.device_id} ({stage}): {type(error).__name__}: {error}")
            try:
                self._finish_request(req)
            except Exception as e:  # noqa: BLE001 - bookkeeping already broken: drop the request's entries
                log.error("engine_cleanup_failed", device=self.device_id, request=req.request_id, error=str(e))
                for seq in req.seqs:
                    self._by_seq.pop(seq.seq_id, None)
                    with suppress(ValueError):
                        self.batcher.running.remove(seq)
                    with suppress(ValueError):
                        self.batcher.waiting.remove(seq)
                self.requests.pop(req.request_id, None)
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

    def _postprocess(self, rec: _InFlight, outs: list[SeqOutput]) -> None:
        """Emit the step's tokens (``outs``: the engine's, in item order). A plain token (not a choice's
        first, no logprobs, ends nothing: short of ``max_len``, not in ``TokenOutputState.enders``) of a
        stream with a columnar path (``RequestState.plain``: API front ends) goes there as ``(index, id)``."""
        now = self.clock()
        by_seq = self._by_seq
        for it, item, out in zip(rec.plan.items, rec.msg.items, outs):
            entry = by_seq.get(item.seq_id)
            if entry is None:  # the sequence left the device (aborted, finished) while the step ran
                continue
            try:
                (req, i), tok = entry, out.token_id
                if (req.plain is not None and tok is not None and out.logprobs is None and not out.prompt_logprobs
                        and req.started[i]):
                    seq, position, o = it.seq, item.start + it.num_tokens, req.outputs[i]
                    if (position != seq.prompt_len and position + 1 < seq.max_len and o.finish_reason is None
                            and tok not in o.enders and seq.first_token_s is not None):
                        seq.last_token_s = now
                        req.plain(i + req.index0, tok)
                        continue
                self._postprocess_one(it, item.start, out, entry, now)
            except Exception as e:  # noqa: BLE001 - one sequence's failure (detokenizer, stop logic) is its own
                self._contain("postprocess", e, StepPlan(rec.plan.kind, [it]))

    def _postprocess_one(self, it: ScheduledSeq, start: int, out: SeqOutput, entry: tuple[RequestState, int],
                         now: float) -> None:
        """Emit one scheduled sequence's sampled token (already written over its placeholder)."""
        seq = it.seq
        req, i = entry
        if out.prompt_logprobs:  # rows start.. predict prompt tokens start+1..; idempotent on recompute
            req.prompt_logprobs[start : start + len(out.prompt_logprobs)] = out.prompt_logprobs
        if out.token_id is None:
            return
        position = start + it.num_tokens  # where the sampled token sits in token_ids
        seq.last_token_s = now
        if seq.first_token_s is None:
            seq.first_token_s = now
        delta = req.outputs[i].on_token(out.token_id, out.logprobs, position)
        if position == seq.prompt_len:
            delta.cached_tokens = seq.num_cached_tokens or 0
        if delta.finish_reason is not None:
            self._finish_seq(seq)
        req.emit(delta)  # the request leaves ``requests`` with its last sequence (_finish_seq), not when
        # it is done: one that failed elsewhere (a timeout) still holds blocks until its abort applies
