"""Time-shared mode on the live objects: a :class:`Batcher` and :class:`BlockLedger` per device, the
node's :class:`RoleScheduler` choosing roles and placements, its :class:`ImbalancePolicy` moving
decoding sequences, all on a virtual clock.

Each device is a :class:`bench.sim.batched.SimDevice` — the batch former and block ledger a live
device engine runs, so KV limits, preemption and recompute, chunked prefill and the prefix cache are
the node's own — whose step kind follows its role (PREFILL steps in the prefill role, DECODE steps in
the decode role, none while switching), and each step lasts what the cost model says
(:func:`bench.sim.stepcost.plan_step_s`). What :class:`node.runtime.role_driver.RoleDriver` does live
is done here the same way, in the same order, every round:

1. the imbalance fallback (``imbalance_threshold`` > 0, on by default as on the node) picks moves,
   told the copy's time per context token at ``link_gbps`` (as the node with ``--link-gbps``);
   a move runs once its source's steps in flight have ended (the source sends none while a move
   waits, as ``DeviceEngine._iteration`` drains for it): the destination allocates the blocks (or the move
   is refused, and the sequence cools down), the source detaches the sequence and, sending, runs no
   step until the destination's steps in flight have ended and then for ``context x
   kv_bytes_per_token / link`` seconds (``DeviceEngine.migrate`` without overlap), then the destination
   adopts it;
2. the snapshot is built as ``RoleDriver.snapshot`` builds it (a moving sequence counts on its
   destination, cooling down, with its blocks reserved there until they are allocated; residents are
   decoding sequences, everything else placed is queued prompt work; each placement's reserve stays
   promised until allocated; free sequence slots are ``max_num_seqs`` minus both);
3. the role scheduler decides; a switch drains the steps in flight, then pauses ``pause_s`` (the swap,
   at least the cost model's and ``pause_ms``, plus the ``reconfig_pause_ms`` floor the node adds);
   a placement adds the request's sequence to the device's batcher with its reserve; a rejection
   fails the request.

Rounds run after every event (arrival, step end, switch end, transfer end) and at least every
:data:`TICK_S` while work exists, as the live driver's timer, each holding the node's loop for its
measured CPU cost (``SimConfig.control_us``: steps are sent after it, and rounds asked for meanwhile run as
one when it ends). Requests have one choice and the client's ``max_tokens``; each ends by an EOS the node
does not foresee, or at its bound. Placement and the policies are told the node's own estimate,
``min(max_tokens, running estimate)`` (:class:`node.core.output_estimate.OutputEstimator`, fed by the requests
that ended by EOS), or, with ``expected_output="oracle"``, the true length. The policies plan with
``SimConfig.planning``'s model (:mod:`bench.sim.planning`; with ``refit`` the node's
:class:`node.core.online_refit.OnlineRefit` is fed every simulated step, as ``RoleDriver`` feeds it live);
the steps are timed by the true one.
"""

from __future__ import annotations

import math
import time

import msgspec

from bench.sim.batched import SimDevice, output_length, client_bound, prompt_token_ids
from bench.sim.config import SimAborted, SimConfig, count_late
from bench.sim.trace import RequestTrace, SimRequest, StepRecord
from bench.traffic.traces import TraceRequest
from node.core.batcher import StepKind
from node.core.cost import CostModel
from node.core.roofline import RooflineCost
from node.core.group_cost import GroupCost
from bench.sim.planning import perturbed, start_model
from node.core.adaptive import AdaptiveScheduler, ChunkBudget
from node.core.imbalance import ImbalanceConfig, ImbalancePolicy, Migrate
from node.core.online_refit import REFIT_MIN_S, OnlineRefit
from node.core.output_estimate import PRIOR_TOKENS, OutputEstimator
from node.core.roles import NodeSnapshot, Place, Reject, Role, RoleScheduler, RoleSchedulerConfig, SwitchRole
from node.core.sequence import SamplingParams, Sequence
from node.core.snapshot import DeviceView, Placement, node_snapshot, waiting_prompt

__all__ = ["NODE_EXPECTED_OUTPUT_TOKENS", "TICK_S", "TimeSharedSim", "simulate_time_shared"]

# What the live node's placement driver assumes of a request's output before it has seen requests end
# on their own (node.core.output_estimate's prior); ignore_eos requests never end on their own.
NODE_EXPECTED_OUTPUT_TOKENS = PRIOR_TOKENS
TICK_S = 0.005  # the live driver's timer while work exists (node/runtime/driver.py TICK_S)
_KIND = {Role.PREFILL: StepKind.PREFILL, Role.DECODE: StepKind.DECODE, Role.MIXED: StepKind.MIXED}
_FREE = frozenset({Role.DECODE, Role.MIXED})  # one configuration: switches between them are free and at once


class _Move:
    """A decoding sequence on its way from ``src`` to ``dst`` (queued until ``done_s`` is set).
    ``overlap``: the copy runs beside the source's later steps (the adaptive policy's hand-offs, as
    the node's ``DeviceEngine.migrate(overlap=True)``), one after another on the source's link;
    otherwise the source runs no step from its start to its end (the fallback's moves)."""

    __slots__ = ("seq", "src", "dst", "reason", "src_blocks", "done_s", "overlap")

    def __init__(self, seq: Sequence, src: "RoleDevice", dst: "RoleDevice", reason: str, overlap: bool = False):
        self.seq, self.src, self.dst, self.reason, self.overlap = seq, src, dst, reason, overlap
        self.src_blocks: list[int] = []
        self.done_s = math.inf


class RoleDevice(SimDevice):
    """A :class:`SimDevice` with a role: its step kind is the role's, and a switch drains, then pauses."""

    def __init__(self, device_id: str, cfg: SimConfig, role: Role):
        super().__init__(device_id, _KIND[role], cfg)
        self.role = role
        self.role_since_s = 0.0
        self.switching_to: Role | None = None
        self.switch_done_s = math.inf  # end of the pause (inf: not started: still draining)
        self.move: _Move | None = None  # the transfer under way from here
        self.link_free_s = -math.inf  # when the overlapped copies from here leave the link free

    @property
    def switching(self) -> bool:
        return self.role is Role.SWITCHING


class TimeSharedSim:
    """Devices of one time-shared node on a virtual clock (see the module docstring).

    Args:
        scheduler: the role policy (its ``cost`` is what it plans with).
        cost: what steps really take (s).
        cfg: devices, KV pool, batch limits, link and pauses (only the time-shared fields are read).
        imbalance: the fallback policy (``None``: off).
        initial_role: every device's role at the first arrival.
        refit: the node's online refit (``SimConfig.planning="refit"``): every step's true time is
            recorded, and due refits replace the policies' cost model, as ``RoleDriver`` does live; the
            snapshot's pause is then the mean measured one (None before any), as live. ``None``: the
            policies keep their model, and the snapshot carries the true pause.
        pause_s: a role switch's true pause (s; default the scheduler's, its model being the true one).
    Raises:
        RuntimeError: a placement on a device not in (or switching to) the prefill role, or a switch
            ordered for a device already switching: the policy broke its own contract.
    """

    def __init__(self, scheduler: RoleScheduler, cost: CostModel | RooflineCost, cfg: SimConfig, *,
                 imbalance: ImbalancePolicy | None = None, initial_role: Role = Role.PREFILL,
                 refit: OnlineRefit | None = None, pause_s: float | None = None, measured_pause: bool = False):
        self.scheduler, self.cost, self.cfg, self.imbalance = scheduler, cost, cfg, imbalance
        self.pause_s = scheduler.pause_s if pause_s is None else pause_s
        self.refit = refit
        # the snapshot's pause: the mean measured one (as RoleDriver.measured_pause_s), or the true one
        self.measured_pause = measured_pause
        self._pauses: list[float] = []
        # the node's event loop: a decision round holds it for control_round_us + per resident (SimConfig);
        # rounds asked for meanwhile run as one when it is free, and steps are sent after the round
        self.loop_free_s = -math.inf
        self.control_s = 0.0  # loop time spent on decision rounds (s)
        self.rounds = 0
        self.round_timer = None  # called (resident sequences, CPU s) after each round when set (bench.sim.control_cost)
        self.devices = [RoleDevice(f"dev{i}", cfg, initial_role) for i in range(cfg.devices)]
        self._by_id = {d.device_id: d for d in self.devices}
        self.steps: list[StepRecord] = []
        self.switches: list[tuple[float, str, Role, str]] = []  # (decided s, device, to role, reason)
        self.traces: dict[str, RequestTrace] = {}
        self.waiting: list[tuple[SimRequest, Sequence]] = []  # arrived, not placed
        self._expected: dict[str, int | None] = {}  # seq id → output tokens placement is told (None: the estimate)
        self._eos: dict[str, bool] = {}  # seq id → it ends by EOS (a sample for the estimate)
        self.outputs = OutputEstimator()  # the node's running output estimate (node.core.output_estimate)
        self._reserve: dict[str, int] = {}  # seq id → blocks reserved at placement
        self._moves: dict[str, _Move] = {}  # seq id → its move, queued or copying
        self._moved_s: dict[str, float] = {}  # seq id → end of its last move or refusal (the cooldown)
        self.num_moves = self.refused_moves = self.transfer_bytes = 0
        self.free_switches = 0  # switches between DECODE and MIXED (adaptive), no pause
        self.moves_by_reason: dict[str, int] = {}  # completed moves per trigger (tpot, imbalance)

    # --- the policy's view -------------------------------------------------------------------
    def views(self, now: float) -> list[DeviceView]:
        """The devices as :func:`node.core.snapshot.node_snapshot` reads them: each request placed on a
        device with its reserve, a sequence being copied on its source (it counts on its destination)."""
        copying: dict[str, list[Sequence]] = {d.device_id: [] for d in self.devices}
        for m in self._moves.values():
            if m.done_s < math.inf:  # copying: in neither batcher, on its destination for the policy
                copying[m.src.device_id].append(m.seq)
        out = []
        for d in self.devices:
            b = d.batcher
            placed = [Placement(self._reserve.get(s.seq_id, 0), (s,)) for s in b.running + b.waiting]
            placed += [Placement(self._reserve.get(s.seq_id, 0), (s,)) for s in copying[d.device_id]]
            out.append(DeviceView(
                d.device_id, d.role, d.role_since_s, d.switching_to,
                (d.switch_done_s if d.switch_done_s < math.inf else now + self.pause_s) if d.switching else None,
                d.busy_until_s if d.plan is not None else now, b, tuple(placed)))
        return out

    def snapshot(self, now: float) -> NodeSnapshot:
        """What ``RoleDriver.snapshot`` shows the policies: the same function
        (:func:`node.core.snapshot.node_snapshot`) over this simulation's devices."""
        batchers = {d.device_id: d.batcher for d in self.devices}
        waiting = [waiting_prompt(r.request_id, [s], r.arrival_s, self.expected_of(s), batchers, i, self.assured_of(s, 0))
                   for i, (r, s) in enumerate(self.waiting)]
        pause = (sum(self._pauses) / len(self._pauses) if self._pauses else None) if self.measured_pause else self.pause_s
        return node_snapshot(now, self.views(now), moving={k: m.dst.device_id for k, m in self._moves.items()},
                             moved_s=self._moved_s, expected=self.expected_of, waiting=waiting, pause_s=pause,
                             assured=self.assured_of)

    # --- the replay --------------------------------------------------------------------------
    def run(self, requests: list[SimRequest], *, until_s: float = math.inf, max_events: int = 50_000_000,
            on_decide=None) -> dict[str, RequestTrace]:
        """Replay ``requests`` until all finish (or ``until_s``); the traces by request id.

        ``on_decide(now_s, snapshot, decisions)`` is called after every policy call (invariants, early
        aborts). Raises RuntimeError after ``max_events`` rounds.
        """
        pending = sorted(requests, key=lambda r: (r.arrival_s, r.request_id))
        for r in pending:
            self.traces[r.request_id] = RequestTrace(r.request_id, r.arrival_s, r.prompt_tokens, r.output_tokens,
                                                     ends_by_eos=r.ends_by_eos)
        pi = 0
        now = pending[0].arrival_s if pending else 0.0
        for d in self.devices:
            d.role_since_s = now
        for _ in range(max_events):
            self._advance(now)
            while pi < len(pending) and pending[pi].arrival_s <= now:
                self._arrive(pending[pi])
                pi += 1
            deferred = now < self.loop_free_s  # the loop is busy: this event's round runs when it is free
            if not deferred:
                if self.round_timer is None:
                    self._round(now, on_decide)
                else:  # bench.sim.control_cost: the round's CPU time here, by the resident sequences
                    t0 = time.thread_time()  # CPU time: other jobs on the machine do not count
                    self._round(now, on_decide)
                    self.round_timer(sum(len(d.batcher.running) for d in self.devices), time.thread_time() - t0)
                self._charge_round(now)
            send_s = max(now, self.loop_free_s)  # the loop sends steps once the round is done
            for d in self.devices:
                self._start_move(now, d)
                self._start_copies(now, d)
                if not d.switching and d.move is None and not self._move_queued(d):  # a queued move drains
                    for step in d.start(send_s, self.cost):
                        self.steps.append(StepRecord(d.device_id, d.kind.value, step.start_s, step.end_s,
                                                     step.plan.num_tokens))
            events = [pending[pi].arrival_s] if pi < len(pending) else []
            for d in self.devices:
                events += [t for t in (d.busy_until_s, d.switch_done_s) if t < math.inf]
                if d.move is not None:
                    events.append(d.move.done_s)
            events += [m.done_s for m in self._moves.values() if m.overlap and m.done_s < math.inf]
            if deferred:  # the round put off by the busy loop (rounds asked for meanwhile: coalesced into it)
                events.append(self.loop_free_s)
            if self.waiting or any(d.batcher.running or d.batcher.waiting for d in self.devices):
                events.append(now + TICK_S)
            if not events:
                break
            now = max(now, min(events))
            if now > until_s:
                break
        else:
            raise RuntimeError("the time-shared simulation did not finish within max_events")
        return self.traces

    def _arrive(self, r: SimRequest) -> None:
        if r.max_tokens is not None and r.output_tokens > r.max_tokens:
            raise ValueError(f"{r.request_id}: {r.output_tokens} output tokens above its max_tokens {r.max_tokens}")
        params = SamplingParams(max_tokens=r.max_tokens or r.output_tokens, temperature=0.0, ignore_eos=not r.ends_by_eos)
        ids = list(r.token_ids) if r.token_ids else [-1 - len(self.traces)] + [0] * (r.prompt_tokens - 1)
        seq = Sequence(r.request_id, r.request_id, 0, r.arrival_s, ids[: r.prompt_tokens], params, self.cfg.max_model_len)
        # None: the node's estimate at each snapshot (expected_of); else what the request says
        self._expected[seq.seq_id] = (r.expected_output_tokens if r.expected_output_tokens or r.max_tokens is not None
                                      else r.output_tokens)
        self._eos[seq.seq_id] = r.ends_by_eos
        self.waiting.append((r, seq))

    def expected_of(self, seq: Sequence) -> int:
        """The output placement and the policies are told of ``seq``: its request's own figure, or the
        node's estimate, ``min(max_tokens, running estimate)`` (:class:`OutputEstimator`, fed by the
        requests that ended by EOS, as the live driver's)."""
        e = self._expected[seq.seq_id]
        return e if e is not None else self.outputs.expected(seq.params.max_tokens)

    def assured_of(self, seq: Sequence, out: int) -> int:
        """The output stall budgets may count on for ``seq`` after ``out`` tokens: its request's own figure
        where it gives one (as :meth:`expected_of`), else the node's assured length
        (:meth:`OutputEstimator.assured`, as the live driver's)."""
        e = self._expected[seq.seq_id]
        return e if e is not None else self.outputs.assured(out, seq.params.max_tokens)

    def _charge_round(self, now: float) -> None:
        """Hold the node's loop for the round just run: ``control_round_us`` plus ``control_per_resident_us``
        per resident sequence (SimConfig; measured by :mod:`bench.sim.control_cost`)."""
        self.rounds += 1
        a, b = self.cfg.control_us
        us = a + b * sum(len(d.batcher.running) for d in self.devices) if a or b else 0.0
        if us > 0:
            self.loop_free_s = now + us / 1e6
            self.control_s += us / 1e6

    def _round(self, now: float, on_decide) -> None:
        snap = self.snapshot(now)
        if self.imbalance is not None:
            moves = self.imbalance.decide(now, snap)
            if self._queue_moves(moves):
                snap = self.snapshot(now)
        decisions = self.scheduler.decide(now, snap)
        if on_decide is not None:
            on_decide(now, snap, decisions)
        adaptive = isinstance(self.scheduler, AdaptiveScheduler)
        for dec in decisions:
            if isinstance(dec, ChunkBudget):
                d = self._by_id[dec.device_id]
                d.chunk_tokens = dec.tokens
                d.version += 1
            elif isinstance(dec, SwitchRole):
                d = self._by_id[dec.device_id]
                if d.role in _FREE and dec.to_role in _FREE:  # DECODE <-> MIXED: no drain, no pause
                    if d.role is not dec.to_role:
                        d.role, d.kind = dec.to_role, _KIND[dec.to_role]
                        d.version += 1
                        self.free_switches += 1
                        self.switches.append((now, d.device_id, dec.to_role, dec.reason))
                else:
                    self._switch(now, dec)
            elif isinstance(dec, Place):
                d = self._by_id[dec.device_id]
                if not (d.role is Role.PREFILL or d.switching_to is Role.PREFILL or (adaptive and d.role in _FREE)):
                    raise RuntimeError(f"{dec.request_id} placed on {d.device_id}, not in a prefill role")
                i = next(i for i, (r, _) in enumerate(self.waiting) if r.request_id == dec.request_id)
                _, seq = self.waiting.pop(i)
                seq.device_id = d.device_id
                self.traces[seq.request_id].device_id = d.device_id
                self._reserve[seq.seq_id] = dec.reserve_blocks
                d.batcher.add(seq)
                d.version += 1
            elif isinstance(dec, Reject):
                i = next(i for i, (r, _) in enumerate(self.waiting) if r.request_id == dec.request_id)
                self.traces[self.waiting.pop(i)[0].request_id].rejected = True
            elif isinstance(dec, Migrate):  # the adaptive policy's hand-off windows (node.core.handoff_windows)
                self._queue_moves([dec], overlap=True)

    def _switch(self, now: float, dec: SwitchRole) -> None:
        d = self._by_id[dec.device_id]
        if d.switching:
            raise RuntimeError(f"switch ordered for {d.device_id}, already switching")
        d.role, d.switching_to, d.role_since_s, d.kind = Role.SWITCHING, dec.to_role, now, None
        d.switch_done_s = math.inf
        self.switches.append((now, d.device_id, dec.to_role, dec.reason))
        self._begin_pause(now, d)

    def _begin_pause(self, now: float, d: RoleDevice) -> None:
        """The pause starts once the step in flight (and any transfer from here) has drained."""
        if d.switching and d.switch_done_s == math.inf and d.plan is None and d.move is None:
            d.switch_done_s = now + self.pause_s
            self.steps.append(StepRecord(d.device_id, "pause", now, d.switch_done_s))

    def _queue_moves(self, moves: list[Migrate], overlap: bool = False) -> int:
        started = 0
        for m in moves:
            src, dst = self._by_id.get(m.src_device), self._by_id.get(m.dst_device)
            if m.seq_id in self._moves or src is None or dst is None:
                continue
            seq = next((s for s in src.batcher.running if s.seq_id == m.seq_id), None)
            if seq is None or not seq.is_decoding:
                continue
            self._moves[seq.seq_id] = _Move(seq, src, dst, m.reason, overlap)
            started += 1
        return started

    def _move_queued(self, d: RoleDevice) -> bool:
        """A move from ``d`` waits for its steps in flight to end (the node sends no step meanwhile)."""
        return any(m.src is d and m.done_s == math.inf and not m.overlap for m in self._moves.values())

    def _start_move(self, now: float, d: RoleDevice) -> None:
        """At a step boundary of ``d``, start its oldest queued move (or refuse it)."""
        while d.plan is None and d.move is None:
            m = next((m for m in self._moves.values()
                      if m.src is d and m.done_s == math.inf and not m.overlap), None)
            if m is None:
                return
            nbytes = self._take_blocks(now, m)
            if nbytes is None:
                continue
            start = max(now, m.dst.last_end_s)  # the copy waits for the destination's steps in flight
            m.done_s = start + nbytes * 8 / (self.cfg.link_gbps * self.cfg.copy_rate * 1e9)
            m.dst.copy_until_s = max(m.dst.copy_until_s, m.done_s)  # the source runs no step meanwhile
            d.move = m
            d.version += 1
            self.transfer_bytes += nbytes
            self.steps.append(StepRecord(d.device_id, "transfer", now, m.done_s))

    def _take_blocks(self, now: float, m: _Move) -> int | None:
        """Begin move ``m``: the destination's blocks taken, the sequence released from its source (its
        blocks kept for the copy); the KV bytes to copy. None, the move dropped, where the sequence is
        gone from the source, no longer decoding, or the destination has no room (it stays, cooling down)."""
        seq, src = m.seq, m.src
        here = seq in src.batcher.running and seq.is_decoding
        blocks = m.dst.batcher.ledger.allocate(len(seq.block_ids)) if here else None
        if blocks is None:
            del self._moves[seq.seq_id]
            self._moved_s[seq.seq_id] = now
            self.refused_moves += 1
            return None
        m.src_blocks = src.batcher.release(seq)
        seq.block_ids = blocks
        return seq.num_computed * self.cfg.kv_bytes_per_token

    def _start_copies(self, now: float, d: RoleDevice) -> None:
        """Start the overlapped moves from ``d`` whose sequence no step in flight holds: each copy
        follows the last one on ``d``'s link, and waits for the destination's steps in flight."""
        for m in [m for m in self._moves.values() if m.overlap and m.src is d and m.done_s == math.inf]:
            if m.seq.num_pending:  # a step in flight samples its token: the copy waits for its end
                continue
            nbytes = self._take_blocks(now, m)
            if nbytes is None:
                continue
            start = max(now, m.dst.last_end_s, d.link_free_s)
            m.done_s = d.link_free_s = start + nbytes * 8 / (self.cfg.link_gbps * self.cfg.copy_rate * 1e9)
            for end in (d, m.dst):  # the steps beside the copy slow down (SimConfig.copy_slowdown)
                end.copy_until_s = max(end.copy_until_s, m.done_s)
            d.version += 1
            self.transfer_bytes += nbytes
            self.steps.append(StepRecord(d.device_id, "transfer", start, m.done_s))

    def _finish_move(self, m: _Move) -> None:
        m.src.batcher.ledger.free(m.src_blocks)
        m.dst.batcher.adopt(m.seq)
        m.seq.device_id = m.dst.device_id
        m.src.version += 1
        m.dst.version += 1
        del self._moves[m.seq.seq_id]
        self._moved_s[m.seq.seq_id] = m.done_s
        self.num_moves += 1
        self.moves_by_reason[m.reason] = self.moves_by_reason.get(m.reason, 0) + 1

    def _advance(self, now: float) -> None:
        """Apply everything due at ``now``: step ends, transfer ends, pause ends."""
        for d in self.devices:
            while d.busy_until_s <= now:
                t = d.busy_until_s
                seqs = d.complete()
                if self.refit is not None:
                    self._on_step(d, t)
                for seq in seqs:
                    tr = self.traces[seq.request_id]
                    if tr.done:  # a token of a step planned before its EOS was seen: discarded, as live
                        continue
                    tr.token_times_s.append(t)
                    if seq.first_token_s is None:
                        seq.first_token_s = t
                        tr.cached_tokens = seq.num_cached_tokens or 0
                    if tr.done:
                        d.batcher.remove(seq)
                        if self._eos.get(seq.seq_id):  # the live driver learns from natural ends only
                            self.outputs.observe(len(tr.token_times_s))
                        self._forget(seq)
            if d.move is not None and d.move.done_s <= now:
                m, d.move = d.move, None
                self._finish_move(m)
            for m in [m for m in self._moves.values() if m.overlap and m.src is d and m.done_s <= now]:
                self._finish_move(m)
            self._begin_pause(now, d)
            if d.switching and d.switch_done_s <= now:
                self._pauses.append(self.pause_s)  # measured as it ran (free switches are no sample)
                if self.refit is not None:
                    self.refit.record_pause(self.pause_s)
                d.role, d.role_since_s, d.kind = d.switching_to, d.switch_done_s, _KIND[d.switching_to]
                d.switching_to, d.switch_done_s = None, math.inf

    def _on_step(self, d: RoleDevice, now: float) -> None:
        """The node's refit fed with the step that just ended on ``d`` (``RoleDriver._on_step``)."""
        step = d.last_step
        self.refit.record(step.plan, step.end_s - step.start_s, self.scheduler.cost, in_role=True)
        if self.refit.due(lambda: now):
            self.scheduler.cost = self.refit.refit(self.scheduler.cost)
            if self.imbalance is not None:
                self.imbalance.cost = self.scheduler.cost

    def _forget(self, seq: Sequence) -> None:
        for table in (self._expected, self._eos, self._reserve, self._moved_s):
            table.pop(seq.seq_id, None)
        m = self._moves.pop(seq.seq_id, None)
        if m is not None and m.done_s < math.inf:  # cannot happen: a copying sequence is in no batcher
            raise RuntimeError(f"{seq.seq_id} finished while its KV was being copied")


def simulate_time_shared(requests: list[TraceRequest], cfg: SimConfig, cost: CostModel | RooflineCost,
                         prefix: str = "r", round_timer=None) -> tuple[list[RequestTrace], dict]:
    """Replay ``requests`` on one time-shared node; ``(traces in request order, stats)``.

    ``round_timer(resident sequences, CPU s)`` is called after every decision round (:mod:`bench.sim.control_cost`).
    The policy is configured as :class:`node.runtime.node.Node` configures it from the same flags;
    it plans with ``cost`` whose ``pause_s`` is the switch's true pause: ``max(cost.pause_s,
    pause_ms)`` of swap plus the ``reconfig_pause_ms`` floor (the live node adds the floor to every
    measured swap, and its role driver refits ``pause_s`` from those records).
    """
    policy = RoleSchedulerConfig(
        ttft_slo_ms=cfg.ttft_slo_ms, tpot_slo_ms=cfg.tpot_slo_ms, reconfig_pause_ms=cfg.reconfig_pause_ms,
        min_window_ms=cfg.min_window_ms, max_window_ms=cfg.max_window_ms,
        prefill_token_budget=cfg.max_num_batched_tokens, stagger=cfg.stagger,
        copy_s_per_token=cfg.kv_bytes_per_token * 8 / (cfg.link_gbps * 1e9))  # as the node sets it from --link-gbps
    cost = msgspec.structs.replace(cost, pause_s=max(cost.pause_s, cfg.pause_ms / 1e3) + cfg.reconfig_pause_ms / 1e3)
    true_pause = max(cfg.reconfig_pause_ms / 1e3, cost.pause_s)
    # what the policies plan with (SimConfig.planning, bench.sim.planning); the steps are timed by `cost`
    plan_cost = {"exact": cost, "refit": start_model(cost, cfg.reconfig_pause_ms),
                 "perturbed": perturbed(cost, cfg.cost_error, cfg.cost_error_seed)}[cfg.planning]
    adaptive = cfg.mode == "adaptive"
    scheduler = (AdaptiveScheduler(policy, plan_cost, max_step_tokens=cfg.max_num_batched_tokens) if adaptive
                 else RoleScheduler(policy, plan_cost))
    imbalance = None
    if cfg.fallback_threshold > 0:
        imbalance = ImbalancePolicy(ImbalanceConfig(
            threshold=cfg.fallback_threshold, tpot_slo_ms=policy.tpot_slo_ms, slo_margin=policy.slo_margin,
            reconfig_pause_ms=policy.reconfig_pause_ms, prefill_token_budget=policy.prefill_token_budget,
            local_transfer_s_per_token=policy.copy_s_per_token,
            ttft_slo_ms=policy.ttft_slo_ms, ttft_urgency=policy.ttft_urgency), plan_cost)
    refit = None
    if cfg.planning == "refit":  # as Node builds RoleDriver: one configuration where no decode graphs and one degree
        one = not (isinstance(cost, RooflineCost) and cost.max_graph_batch > 0) and not isinstance(cost, GroupCost)
        refit = OnlineRefit(one_configuration=one, min_interval_s=REFIT_MIN_S if adaptive else 0.0)
    # the node starts adaptive devices in the decode configuration, time-shared ones parked in PREFILL
    sim = TimeSharedSim(scheduler, cost, cfg, imbalance=imbalance, initial_role=Role.DECODE if adaptive else Role.PREFILL,
                        refit=refit, pause_s=true_pause, measured_pause=cfg.planning != "exact")
    sim.round_timer = round_timer
    sreqs = []
    for i, r in enumerate(requests):
        n, eos = output_length(r, cfg)
        rid = f"{prefix}{i}"
        sreqs.append(SimRequest(rid, r.arrival_s, r.prompt_tokens, n, n if cfg.expected_output == "oracle" else None,
                                tuple(prompt_token_ids(rid, r, cfg.prefix_caching)),
                                max_tokens=client_bound(r, cfg)[0], ends_by_eos=eos))
    t_end = (requests[0].arrival_s if requests else 0.0) + cfg.max_sim_s
    slo_s, limit = cfg.ttft_slo_ms / 1e3, cfg.abort_late

    def abort_when_late(now_s, snap, decisions):
        if count_late((w.arrival_s for w in snap.waiting), now_s, slo_s, limit) >= limit:
            raise SimAborted(f"{limit} requests waited past the TTFT SLO")

    traces = sim.run(sreqs, until_s=t_end, on_decide=abort_when_late if limit is not None else None)
    pauses = sum(s.end_s - s.start_s for s in sim.steps if s.kind == "pause")
    stats = {"switches": len(sim.switches), "free_switches": sim.free_switches, "pause_s": pauses,
             "switch_reasons": {r: sum(1 for sw in sim.switches if sw[3] == r) for r in sorted({sw[3] for sw in sim.switches})},
             "busy_s": {d.device_id: d.busy_s for d in sim.devices},
             "transfers": sim.num_moves, "transfer_bytes": sim.transfer_bytes,
             **{f"moves_{k}": v for k, v in sorted(sim.moves_by_reason.items())},
             "preemptions": sum(d.batcher.num_preemptions for d in sim.devices),
             "rounds": sim.rounds, "control_s": sim.control_s, "refits": refit.refits if refit else 0,
             "cached_tokens": sum(d.batcher.prefix_hit_tokens for d in sim.devices)}
    return [traces[r.request_id] for r in sreqs], stats
