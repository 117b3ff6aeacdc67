"""The shell around the pure role scheduler in adaptive and time-shared modes.

It keeps the prompts not yet placed, turns the node's live state into a :class:`NodeSnapshot`, asks
:meth:`RoleScheduler.decide` what to do, and carries the decisions out: role switches (as tasks on the
event loop; a switch between DECODE and MIXED, one configuration, at once), chunk budgets (adaptive
mode: what each MIXED step may take) and placements (handing a request to a device's engine). It runs
on every arrival, step end and switch end, and on a short timer while work exists (urgency grows with
age alone).

With ``--imbalance-threshold`` above 0 each round first asks the fallback policy
(:class:`ImbalancePolicy`) which decoding sequences to move to another device and starts those moves
(``DeviceEngine.migrate``); the snapshot the role scheduler then sees already counts each moving
sequence on its destination (with the blocks it will take there reserved), so the scheduler does not
switch a device back to DECODE for sequences that are leaving it. The moved sequence keeps its
``RequestState``, so its tokens go on flowing into the same client stream. The adaptive policy's
hand-off windows (:mod:`node.core.handoff_windows`) return their moves among its decisions; those copies run
beside the source's later steps (``overlap``), as a pooled prefill device's hand-offs do.

The cost model the policy sizes windows with is refitted online from the node's own measured steps
(:func:`node.core.refit.fit_steps`: decode and mixed steps in one non-negative least-squares fit, each
coefficient's change bounded per refit), starting from CPU-sized defaults.
"""

from __future__ import annotations

import asyncio
from typing import Callable

import structlog

from node.core.adaptive import ChunkBudget
from node.core.batcher import StepKind, StepPlan
from node.core.handoff_windows import HANDOFF
from node.core.imbalance import ImbalanceConfig, ImbalancePolicy, Migrate
from node.core.online_refit import REFIT_EVERY, REFIT_MIN_S, OnlineRefit  # noqa: F401 (REFIT_EVERY: tests)
from node.core.sequence import Sequence, SeqStatus
from node.core.roles import DeviceState, NodeSnapshot, Place, Reject, ResidentSeq, Role, RoleScheduler, SwitchRole
from node.core.snapshot import DeviceView, Placement, node_snapshot, waiting_prompt
from node.runtime.driver import Driver
from node.runtime.engine import DeviceEngine
from node.runtime.peer_state import is_peer
from node.runtime.switching import FREE, SwitchAbandoned, SwitchRecord

from node.runtime.interfaces import DriverHost

log = structlog.get_logger("shiftnode.roles")


class RoleDriver(Driver):
    """Applies the role scheduler's decisions to the node's devices."""

    def __init__(self, node: DriverHost, scheduler: RoleScheduler, clock: Callable[[], float], *, refit: bool = True,
                 one_configuration: bool = False):
        super().__init__(node, clock)
        self.scheduler = scheduler
        self.refits = refit  # False: the policy keeps the cost model it was given (timed devices: it is exact)
        # prompt and decode steps run one forward configuration (same degree, no decode graphs): the refit
        # gives them one fixed cost (fit_cost_model's shared_fixed), so noise reads as no mixed-step penalty
        self.one_configuration = one_configuration
        # device -> the role a switch ordered for it goes to, from the order until the switch ends: the
        # snapshot shows it switching from the order on (the engine does from the switch task's start)
        self._switching: dict[str, tuple[Role, float]] = {}
        # the refit's samples and schedule (node.core.online_refit, which the simulator runs too); a refit
        # (non-negative least squares over up to 2 x 256 samples) holds the event loop ~2.5 ms, so in adaptive
        # mode at most one per REFIT_MIN_S (its module doc); the two-role policy keeps one every 32 steps: its
        # windows and fallback moves follow the fitted model (tests/test_migration.py)
        self.online = OnlineRefit(one_configuration=one_configuration,
                                  min_interval_s=REFIT_MIN_S if getattr(scheduler, "quiet_when_decoding", False) else 0.0)
        self._prefill, self._decode, self._pauses = self.online.prefill, self.online.decode, self.online.pauses
        self._quiet = False  # the last tick left every device decoding with nothing to decide (quiet_when_decoding)
        self._can_be_quiet = getattr(scheduler, "quiet_when_decoding", False)  # the adaptive policy
        self._rounds = 0  # full decision rounds (with a snapshot) so far
        self._rounds_seen: dict[str, int] = {}  # device -> self._rounds at its last step end
        rc = scheduler.config
        copy_s_per_token = rc.copy_s_per_token  # the node's link (kv_copy_s_per_token): peers and own devices
        self.imbalance = ImbalancePolicy(ImbalanceConfig(
            threshold=node.config.imbalance_threshold, tpot_slo_ms=rc.tpot_slo_ms, slo_margin=rc.slo_margin,
            reconfig_pause_ms=rc.reconfig_pause_ms, prefill_token_budget=rc.prefill_token_budget,
            transfer_s_per_token=copy_s_per_token, local_transfer_s_per_token=copy_s_per_token,
            ttft_slo_ms=rc.ttft_slo_ms, ttft_urgency=rc.ttft_urgency), scheduler.cost)
        self._switch_tasks: set[asyncio.Task] = set()  # role switches under way
        self._switch_series: dict[tuple[str, str, str], tuple] = {}  # (device, from, to) -> its two metric series
        self._moving: dict[str, str] = {}  # sequence id → destination device, while its move is queued or copying
        self._moving_ctx: dict[str, int] = {}  # sequence id → its context tokens, for moves to peers
        self._to_peer: dict[str, list[tuple[float, int]]] = {}  # peer → (commit time, context) of recent moves
        self._moved_s: dict[str, float] = {}  # sequence id → end of its last move (or refusal): the cooldown
        self._compiled_seen: dict[str, tuple[int, ...]] = {}  # device → its compiled buckets last heard of
        for e in node.engines:
            e.step_listeners.append(self._on_step)
            e.switch_listeners.append(self._on_switch)
            e.migration_listeners.append(lambda *_: self.kick())  # a sequence arrived: its device's role may change
            e.compile_listeners.append(self._on_compiled)  # a bucket compiled in the background: faster steps

    # --- one decision round --------------------------------------------------------------------------
    def tick(self) -> None:
        mixed = self._quiet_mixed() if self._can_be_quiet else None
        if mixed is not None:
            # the policy's decisions need no snapshot (AdaptiveScheduler.quiet_when_decoding): none while
            # every device decodes, else back to DECODE for the devices still in MIXED
            for d in self.scheduler.quiet_decisions(self.clock(), mixed) if mixed else ():
                self.node.engine(d.device_id).switch_free(d.to_role, d.reason)
            self._quiet = True
            return
        self._quiet = False
        self._rounds += 1
        now = self.clock()
        snap = self.snapshot(now)
        if self.node.draining:
            moves = self.imbalance.drain(now, snap, self._peers(now))
        elif self.imbalance.config.threshold > 0:
            moves = self.imbalance.decide(now, snap, self._peers(now))
        else:
            moves = []
        if self._start_moves(moves):
            snap = self.snapshot(now)  # the moving sequences now count on their destinations
        decisions = self.scheduler.decide(now, snap)
        by_id = {r.request_id: r for r in self.pending}
        for d in decisions:
            if isinstance(d, ChunkBudget):
                self.node.engine(d.device_id).set_chunk_budget(d.tokens)
            elif isinstance(d, SwitchRole):
                e = self.node.engine(d.device_id)
                if d.device_id not in self._switching and e.role.role in FREE and d.to_role in FREE:
                    if e.role.role is not d.to_role:  # DECODE <-> MIXED: one configuration, at once
                        e.switch_free(d.to_role, d.reason)
                elif d.device_id not in self._switching:
                    self._switching[d.device_id] = (d.to_role, now)
                    task = asyncio.get_running_loop().create_task(self._switch(d))
                    self._switch_tasks.add(task)  # kept: a bare task may be collected mid-switch
                    task.add_done_callback(self._switch_tasks.discard)
            elif isinstance(d, Place):
                req = by_id.pop(d.request_id, None)
                if req is not None:
                    self.pending.remove(req)
                    self.reserve[req.request_id] = d.reserve_blocks
                    self.node.engine(d.device_id).add(req)
            elif isinstance(d, Migrate):  # the adaptive policy's hand-off windows (node.core.handoff_windows)
                self._start_moves([d])
            elif isinstance(d, Reject):
                req = by_id.pop(d.request_id, None)
                if req is not None:
                    self.pending.remove(req)
                    req.fail(f"request cannot be served: {d.reason} (its prompt times n, plus one token, must fit "
                             f"one device's KV cache even when empty)", status=400, code="kv_capacity_exceeded")

    def needs_timer(self) -> bool:
        """Not while the last round was quiet (every device decodes, nothing waits): there no decision
        depends on time alone, and every change that could end the quiet kicks the driver (an arrival, a
        preempting step, a finished request, a move or a restart). The 5 ms timer woke the adaptive
        driver 200 times a second on a decoding node for nothing. In adaptive mode also while a device is
        in PREFILL with nothing placed anywhere: a hand-off window closes after a dwell with nothing to do
        (node.core.handoff_windows), and on an idle node no other event would run that round (one stayed
        in PREFILL for 16 s, found by a helper's review). Time-shared devices park in PREFILL: not there."""
        if self._quiet:
            return False
        return super().needs_timer() or (self._can_be_quiet and any(
            e.failure is None and e.role is not None and e.role.role is Role.PREFILL for e in self.node.engines))

    def _quiet_mixed(self) -> list[str] | None:
        """The devices in MIXED when nothing waits to be placed, no move is to be considered (fallback off,
        not draining, no switch under way) and every live device is in the decode configuration (DECODE
        or MIXED) holding decoding sequences only (no queued prompt work); None otherwise. Checked
        without the snapshot."""
        if self.pending or self._switching or self.node.draining or self.imbalance.config.threshold > 0:
            return None
        mixed = []
        for e in self.node.engines:
            if e.failure is not None:  # down: out of the policy's view
                continue
            if e.role is None or e.role.role not in FREE or e.batcher.has_work(StepKind.PREFILL):
                return None
            if e.role.role is Role.MIXED:
                mixed.append(e.device_id)
        return mixed

    def _peers(self, now: float) -> tuple[DeviceState, ...]:
        """Ready peer nodes as DECODE-role devices: each one's roomiest device, from its last report."""
        if self.node.peers is None:
            return ()
        out = []
        for p in self.node.peers.ready(now):
            st = p.status
            # its last report, plus what we sent since (committed after it, or still on the way)
            sent = [c for t, c in self._to_peer.get(p.id, ()) if t >= p.status_s]
            self._to_peer[p.id] = [(t, c) for t, c in self._to_peer.get(p.id, ()) if t >= p.status_s]
            sent += [self._moving_ctx[sid] for sid, dst in self._moving.items() if dst == p.id]
            each = st.decode_context_tokens // max(1, st.decode_seqs)
            resident = tuple(ResidentSeq(f"{p.id}#{i}", now, 1, each, 1) for i in range(st.decode_seqs)) + tuple(
                ResidentSeq(f"{p.id}#sent{i}", now, 1, c, 1) for i, c in enumerate(sent))
            out.append(DeviceState(
                device_id=p.id, role=Role.DECODE, role_since_s=now, busy_until_s=now, resident=resident,
                kv_free_blocks=st.max_device_free_blocks, kv_total_blocks=max(1, st.max_device_total_blocks),
                block_size=self.node.config.block_size, seq_slots_free=st.seq_slots_free))
        return tuple(out)

    def _start_moves(self, moves: list[Migrate]) -> int:
        """Queue moves on their source engines (a peer's over TCP): the fallback's, and the adaptive
        policy's hand-offs (overlapped with the source's steps); the number started."""
        started = 0
        for m in moves:
            if m.seq_id in self._moving:
                continue
            src = self.node.engine(m.src_device)
            seq = next((s for s in src.batcher.running if s.seq_id == m.seq_id), None)
            req = src.requests.get(seq.request_id) if seq is not None else None
            if seq is None or req is None or req.cancelled or not seq.is_decoding:
                continue
            self._moving[seq.seq_id] = m.dst_device
            if is_peer(m.dst_device):
                self._moving_ctx[seq.seq_id] = seq.num_computed
                self.node.peers.hand_off(src, req, seq, self.node.peers.peers[m.dst_device], m.reason,
                                         settled=lambda ok, seq=seq, m=m: self._moved(seq, m, ok))
            else:
                # a hand-off window goes on prefilling while it sends, as a pooled prefill device does
                fut = src.migrate(seq, self.node.engine(m.dst_device), m.reason, overlap=m.reason == HANDOFF)
                fut.add_done_callback(lambda f, seq=seq, m=m: self._moved(
                    seq, m, not f.cancelled() and f.exception() is None and f.result() is not None))
            started += 1
        return started

    def _moved(self, seq: Sequence, m: Migrate, ok: bool) -> None:
        self._moving.pop(seq.seq_id, None)
        ctx = self._moving_ctx.pop(seq.seq_id, 0)
        if ok and is_peer(m.dst_device):
            self._to_peer.setdefault(m.dst_device, []).append((self.clock(), ctx))
        if seq.status is not SeqStatus.FINISHED:
            self._moved_s[seq.seq_id] = self.clock()
        if not ok:
            log.info("migration_refused", seq=seq.seq_id, src=m.src_device, dst=m.dst_device, reason=m.reason)
        self.kick()

    def finished(self, req, reasons, output_tokens) -> None:
        super().finished(req, reasons, output_tokens)
        for s in req.seqs:
            self._moved_s.pop(s.seq_id, None)

    def round_on_finish(self) -> bool:
        """Not on a quiet node (the last round left every device decoding, nothing waiting): an end there
        only takes a resident away, and the node stays quiet (AdaptiveScheduler.quiet_when_decoding)."""
        return not (self._quiet and not self.pending)

    async def stop(self) -> None:
        tasks = list(self._switch_tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await super().stop()

    async def _switch(self, d: SwitchRole) -> None:
        try:
            await self.node.engine(d.device_id).switch_role(d.to_role, d.reason)
        except SwitchAbandoned as e:  # the device is down or stalled: /health says so; no retry here
            log.warning("role_switch_abandoned", device=d.device_id, to_role=d.to_role.value, reason=str(e))
        finally:
            self._switching.pop(d.device_id, None)
            self.kick()

    def views(self, now: float) -> list[DeviceView]:
        """The node's live devices as :func:`node.core.snapshot.node_snapshot` reads them (a down device
        is out of the policy's view): each request on a device with its placement reserve."""
        out = []
        for e in self.node.engines:
            if e.failure is not None:
                continue
            r = e.role
            busy_until = now if e.step_started_s is None else max(now, e.step_started_s + e.last_step_s)
            placed = tuple(Placement(self.reserve.get(req.request_id, 0), self._seqs_on(req.seqs, e.device_id))
                           for req in e.requests.values())
            ordered = self._switching.get(e.device_id)
            if ordered is not None and r.role is not Role.SWITCHING and r.role is not ordered[0]:
                # ordered, its task not begun: a round meanwhile (another device's plan) must not take it
                # for what it was (a hand-off window forgotten, a move or chunks sent into a window)
                out.append(DeviceView(e.device_id, Role.SWITCHING, ordered[1], ordered[0], None, busy_until, e.batcher,
                                      placed))
                continue
            out.append(DeviceView(e.device_id, r.role, r.since_s if r.role is not Role.SWITCHING else r.switch_started_s,
                                  r.switching_to, r.switch_done_est_s, busy_until, e.batcher, placed))
        return out

    @staticmethod
    def _seqs_on(seqs: list[Sequence], device_id: str) -> tuple[Sequence, ...] | list[Sequence]:
        """A request's sequences on ``device_id`` (the list itself for the common one-choice request there)."""
        if len(seqs) == 1 and seqs[0].device_id == device_id:
            return seqs
        return tuple(s for s in seqs if s.device_id == device_id)

    def snapshot(self, now: float) -> NodeSnapshot:
        """The policy's view of the node (:func:`node.core.snapshot.node_snapshot`, the simulator's too):
        a sequence whose move is under way counts on its destination (cooling down), with the blocks the
        destination will allocate for it reserved there; the pause is the mean measured one."""
        views = self.views(now)
        req_of = {s.seq_id: req for e in self.node.engines for req in e.requests.values() for s in req.seqs}
        batchers = {v.device_id: v.batcher for v in views}
        assured = self.outputs.assured  # stall budgets count on it, not the mean (node.core.output_estimate)
        waiting = tuple(waiting_prompt(req.request_id, req.seqs, req.stats.arrival_s, self.expected_output(req),
                                       batchers, i, assured(0, req.params.max_tokens))
                        for i, req in enumerate(self.pending))
        est = self.expected_estimate()  # expected_output's, once per snapshot rather than per resident
        return node_snapshot(now, views, moving=self._moving, moved_s=self._moved_s,
                             expected=lambda s: min(req_of[s.seq_id].params.max_tokens, est), waiting=waiting,
                             pause_s=self.measured_pause_s,
                             assured=lambda s, out: assured(out, req_of[s.seq_id].params.max_tokens))

    @property
    def measured_pause_s(self) -> float | None:
        """Mean of the recent measured switch pauses (s; free switches are none), or None before any."""
        return sum(self._pauses) / len(self._pauses) if self._pauses else None

    # --- measurements ----------------------------------------------------------------------------------
    def _on_step(self, engine: DeviceEngine, plan: StepPlan, seconds: float) -> None:
        self.online.record(plan, seconds, self.scheduler.cost, in_role=engine.role is not None)
        if plan.kind is StepKind.PREFILL:
            resident = sum(1 for s in engine.batcher.running if s.is_decoding)  # a loop per sequence: PREFILL steps only
            if resident:
                self.node.metrics.decode_stall.labels(device=engine.device_id, cause="prefill_window").inc(resident * seconds)
        if self.refits and self.online.due(self.clock):
            self.refit()
        # A decode step that preempted nothing leaves a quiet node quiet: no decision round for it
        # (arrivals, ends, moves and restarts kick the driver; the TICK_S timer runs meanwhile).
        seen = self._rounds_seen.get(engine.device_id)
        self._rounds_seen[engine.device_id] = self._rounds
        if self._quiet and plan.kind is StepKind.DECODE and not plan.preempted:
            return
        # Nor, in adaptive mode, the end of a step of a device in MIXED with prompt work still queued and
        # nothing waiting to be placed, when a full round ran since the device's last step end (so during
        # this step's flight: the round counted its tokens, whose placeholders are appended at send). A
        # round now would see the same node but for the clock, and would keep the device mixing; the
        # TICK_S timer covers decisions that wait on time. On a CPU node every prompt's arrival round was
        # followed by such a round at the next step end, on the way to the step that carries the prompt.
        # A step that preempted still kicks; so do ends, arrivals, moves, and a queue that has drained.
        if (self._can_be_quiet and seen is not None and seen != self._rounds and not plan.preempted
                and not self.pending and engine.role is not None and engine.role.role is Role.MIXED
                and engine.batcher.has_work(StepKind.PREFILL)):
            return
        self.kick_at_plan()  # this engine's loop plans next, and runs the round first

    def _on_switch(self, engine: DeviceEngine, rec: SwitchRecord) -> None:
        key = (engine.device_id, rec.from_role, rec.to_role)
        series = self._switch_series.get(key)
        if series is None:  # labels() takes a lock and builds the key: once per device and direction
            m, direction = self.node.metrics, f"{rec.from_role}_to_{rec.to_role}"
            series = self._switch_series[key] = (m.role_switches.labels(device=engine.device_id, direction=direction),
                                                 m.switch_pause.labels(device=engine.device_id, direction=direction))
        series[0].inc()
        series[1].observe(rec.pause_ms / 1e3)
        stall = rec.end_s - rec.start_s  # 0 for a free switch: no pass over the running sequences for it
        resident = sum(1 for s in engine.batcher.running if s.is_decoding) if stall > 0 else 0
        if resident:
            self.node.metrics.decode_stall.labels(device=engine.device_id, cause="role_switch").inc(resident * stall)
        if not (rec.from_role in ("decode", "mixed") and rec.to_role in ("decode", "mixed")):
            self._pauses.append(rec.pause_ms / 1e3)  # a free switch (DECODE <-> MIXED) is no pause sample

    def _on_compiled(self, engine: DeviceEngine, state) -> None:
        """A device's compiled buckets changed (:mod:`node.runtime.compile_watch`): its steps of those sizes
        now take about half the time of the eager ones sampled so far (stories260k), so a refit over both would
        fit neither; the refit starts again from the steps to come (:meth:`OnlineRefit.restart`)."""
        seen = self._compiled_seen.get(engine.device_id)
        self._compiled_seen[engine.device_id] = tuple(state.compiled)
        if self.refits and tuple(state.compiled) != (seen or ()):  # (a restarted engine: eager again, fewer)
            dropped = self.online.restart()
            log.info("cost_refit_restarted", device=engine.device_id, compiled=list(state.compiled),
                     pending=state.pending, samples_dropped=dropped)

    def refit(self) -> None:
        """Refit the policy's cost model from the recent measured steps (:meth:`node.core.online_refit.OnlineRefit.refit`:
        :func:`node.core.refit.fit_steps`, joint and damped; keeps parts with few samples). A roofline model
        (timed devices started from one) is kept as it is; a group's model (:class:`GroupCost`) gets its one
        fitted model as both its prefill instance's and its decode's."""
        self.scheduler.cost = self.imbalance.cost = self.online.refit(self.scheduler.cost)
