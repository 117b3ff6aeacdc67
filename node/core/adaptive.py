"""The adaptive role policy: per device DECODE, MIXED (decode plus prompt chunks) or a PREFILL window,
chosen from the queue, the residents' TPOT headroom and the cost model (pure; ``shiftnode serve
--mode adaptive``; the default is colocated, docs/adaptive.md says why).

A device is in the *decode configuration* (DECODE or MIXED: the same execution configuration, so a
switch between them is free and takes effect at once) or in a PREFILL window (its own configuration:
the prefill degree, the prefill token budget, no decode graphs), reached and left through a measured
pause as in the two-role policy (:mod:`node.core.roles`, whose symbols, windows, placement and liveness
rules this policy reuses). The formulas are in :mod:`node.core.chunk_budget`: the step limit ``L``, the
chunk budget ``c`` (the efficient chunk ``c*`` within the limit), the gathering time ``G``, and the device time of a queue as chunks (``E_chunks``) or as a window
(``E_window``).

Each decision round, for every device in the decode configuration (switch reasons in quotes):

* **PREFILL window** when its queue (its own queued prompt work plus the waiting prompts that fit its
  KV, up to ``Wmax`` of prefill) is cheaper as a window than as chunks, ``E_window < E_chunks``, and the
  residents' deadlines afford the window (the two-role policy's window budget, dwell and stagger
  rules) — "cheaper" (a burst or a long prompt: the prefill configuration is faster per token, or
  ``c = 0``); or when the oldest of that work would *miss its TTFT SLO* even as chunks of ``c_T`` (the
  fastest chunk within the step limit, which the chunk grows to for it: *rescue* below) and meet it in
  a window, and a window may open (affordable, or the two-role policy's *forced* window for an urgent
  prompt) — "ttft". A window stalls every resident for its length, so it is not opened to win a head
  that meets its SLO anyway a few milliseconds (1B prompts from 32 to 7,000 tokens on 4 simulated
  H200s at 560 req/s, when heads waited for sequence slots: SLO attainment 0.75 opening a window
  whenever one served the head sooner once past ``ttft_urgency`` of the SLO, 0.98 with this rule), nor
  for a head that only the knee ``c*`` would make late (8B, the same prompts, 4 H200s at 127 req/s:
  0.90 judging the head at ``c*``, 0.99 at the largest chunk within the limit).
  **A window lasts as long as the work it was opened for** (``P`` of that work, at least ``Wmin``), not
  as long as the residents could afford: a prompt arriving meanwhile was never weighed against the
  window, and goes in chunks to a device in the decode configuration rather than stretch the stall of
  every resident (1B, the same prompts, 8 H200s at 1,129 req/s: SLO attainment 0.71 when a window took
  arrivals until its residents' budget ran out, 1.00 sized).
* Otherwise prompts are placed on decode-configuration devices whose chunk budget is positive (FIFO;
  where they fit KV and sequence slots, least ``finish + expected decode`` first, as the two-role
  placement; a device takes more only while its queue's chunked prefill ends within the TTFT target
  ``ttft_urgency x ttft_slo`` *from now* — measured from the prompt's arrival, a prompt that already
  waited that long for a sequence slot could go nowhere but to an empty queue, and held every prompt
  behind it), and the device runs **MIXED** with chunk budget ``c`` when it has queued prompt work,
  ``c > 0`` and the queue is not *gathering* — "chunks_fit" (the chunk grown past ``c*`` to keep up
  with a backlog, :mod:`node.core.chunk_budget`, or to *rescue* the queue's oldest prompt: the smallest
  chunk that carries the queue by that prompt's TTFT SLO, where ``c*`` would miss it and ``c_T`` meets
  it) — else **DECODE**: "nothing_waits" (no queued prompt work), "gather" (the queue is under ``c``
  tokens, its oldest prompt has waited less than ``G`` and the device ran MIXED less than ``G`` ago: a
  mixed step now would pay the eager penalty for a partial chunk sooner than the penalty's share
  allows), "spacing" (no chunk fits ``L`` but decode alone meets ``T``, e.g. the 70B's ~36 ms eager
  mixed step against a 20 ms TPOT SLO: the device runs mixed steps of ``c*`` within ``Wmax`` longer
  than ``T`` and decodes
  ``S = (m - T) d / (T - d)`` between them, so the residents' mean token gap stays at ``T``;
  :func:`node.core.chunk_budget.spacing_s`; where some resident's own mean cannot absorb even a
  one-token step, its later tokens counted at ``d``, the device *holds*: decode steps do not win that
  back, so its queue's work is judged as starting when those residents will have ended, and placement
  and the TTFT window see the wait) or "no_headroom" (``c = 0``: even one prompt token would
  stretch the step past ``Wmax``, or past ``L`` where decode alone misses ``T``, or ``S > Wmax``).

A window ends as in the two-role policy (queue drained, budget spent, or blocked on KV), and an idle
window (no resident, nothing queued) also ends ("drained"): an empty device waits in the decode
configuration, where a prompt costs no pause. A :class:`ChunkBudget` decision accompanies every device
in (or entering) MIXED each round.

**Hand-off windows** (:mod:`node.core.handoff_windows`, "handoff"): where every device holding residents is
spaced or has no chunk and two or more devices are in the decode configuration, one of them may prefill
for the others, each sequence it prefills moving (:class:`~node.core.imbalance.Migrate`) to a decode
device, as a disaggregated prefill pool does (a part, ``handoffs``, that owns its state). It is decided
before the windows and chunks above, which see only the prompts it did not take; its moves after the
windows, so that none lands on a device sent to a window.

**State.** The policy remembers, per device, the last decision instant at which the device was (or was
sent) MIXED: gathering counts ``G`` from there, so mixed phases stay at least ``G`` apart while a prompt
that arrives after a quiet spell of ``G`` is mixed at once (holding it would not save a mixed step).

**Liveness.** A MIXED step runs every resident's decode token and at most ``c`` prompt tokens, so
residents progress exactly as in DECODE. Gathering holds a queue at most ``G`` after its oldest
prompt's arrival; spacing holds it at most ``S`` after its last mixed step, or until the residents
that block a spaced step have ended (bounded outputs). Where ``c = 0`` the queue's
head becomes urgent with age and the two-role policy's forced window takes it (or, cheaper, a window
of its own: ``E_chunks`` is infinite). Queued prompt work on a device is therefore computed (chunks,
a window, or a forced window), and outputs are bounded, so every sequence ends. The property test in
``tests/core/test_liveness.py`` drives this policy as it drives the two-role one.
"""

from __future__ import annotations

import math

import msgspec

from node.core.chunk_budget import (chunk_budget, chunks_extra_s, chunks_s, efficient_chunk, fastest_chunk, gather_s,
                                    hold_s, keep_up_chunk, mean_budget_s, spacing_s, step_limit_s, window_extra_s)
from node.core.cost import CostModel
from node.core.handoff_windows import HandoffWindows
from node.core.mixed_placement import MixedPlacement
from node.core.role_state import Migrate, assured_output
from node.core.roles import (EPS, Decision, NodeSnapshot, Place, Role, RoleScheduler,
                             RoleSchedulerConfig, SwitchRole, WaitingPrompt, _Dev)
from node.core.roofline import RooflineCost

__all__ = ["AdaptiveScheduler", "ChunkBudget", "AdaptiveDecision"]

# The horizon of a backlog at c* (share of the TTFT SLO) past which the chunk grows: the queueing delay a
# prompt-bound device settles at. Simulated, 4 H200s (SLO attainment at 0.95x the best tuned baseline):
# 0.1 -> 8B wide 0.92, 1B wide 0.67 (chunks grew where slots bound); 0.5 -> 8B wide 0.77 (prompts queued
# ~0.5 s), 1B wide 0.94; 0.2 -> 0.89 and 0.93. A constant of the policy, not a per-workload knob.
KEEP_UP_SHARE = 0.2
INF = math.inf
EFF_BUCKET = 1024  # context tokens: residents' contexts this close share one efficient chunk


class ChunkBudget(msgspec.Struct, frozen=True, tag="chunk"):
    """Run ``device_id``'s MIXED steps with at most ``tokens`` prompt tokens each (the online chunk
    budget); ``step_limit_s``: the step-time limit ``L`` it came from (s; inf: no resident)."""

    device_id: str
    tokens: int
    step_limit_s: float


AdaptiveDecision = Decision | ChunkBudget | Migrate


class _Mix:
    """A decode-configuration device's chunk budget ``c*`` for this round, its step limit ``L``, work
    start ``t0``, residents (``s`` holding ``k`` tokens), gathering time ``G`` and the arrival of its
    oldest queued prompt (None: none; prompts placed this round included); ``spacing``: True where no
    chunk fits ``L`` and the chunk is spaced instead (:func:`node.core.chunk_budget.spacing_s`; ``t0``
    then the earliest start of the next mixed step; ``hold``: a resident's own mean cannot absorb the
    step, and ``t0`` is when the residents that block it will have ended)."""

    __slots__ = ("chunk", "limit_s", "t0", "s", "k", "gather_s", "oldest_s", "max_chunk", "knee", "spacing", "d",
                 "hold")

    def __init__(self, chunk: int, limit_s: float, t0: float, s: int, k: int, gather: float, oldest_s: float | None,
                 max_chunk: int = 0):
        self.chunk, self.limit_s, self.t0, self.s, self.k = chunk, limit_s, t0, s, k
        self.max_chunk = max_chunk  # c_T: the fastest chunk within the step limit (what a queue may grow to)
        self.knee = chunk  # c*: what a queue gathers up to (the chunk itself may grow to keep up)
        self.gather_s, self.oldest_s = gather, oldest_s
        self.spacing, self.d, self.hold = False, 0.0, False


class AdaptiveScheduler(RoleScheduler):
    """The adaptive policy (module docstring). ``max_step_tokens``: ``--max-num-batched-tokens``, the
    upper bound of a MIXED step's tokens (decode tokens included).

    Raises:
        ValueError: ``max_step_tokens < 1``, or a config the two-role policy refuses.
    """

    quiet_when_decoding = True
    """With no waiting prompt and every device in DECODE with only decoding sequences (no queued prompt
    work), :meth:`decide` returns no decision: nothing to place, no window reason (no work), and each
    device already has the role it would get ("nothing_waits"). A driver may then skip building the
    snapshot, which costs a pass over every sequence of the node at each step's end (a quarter of a
    stories260k node's control loop at 40 req/s, profiled). The two-role policy has no such state: it
    parks idle devices back in PREFILL. Where some of those devices are in MIXED instead,
    :meth:`quiet_decisions` gives what :meth:`decide` would, without the snapshot."""

    def __init__(self, config: RoleSchedulerConfig, cost: CostModel | RooflineCost, *, max_step_tokens: int = 2048):
        super().__init__(config, cost)
        if max_step_tokens < 1:
            raise ValueError("max_step_tokens must be >= 1")
        self.max_step_tokens = max_step_tokens
        self.share = min(max(config.max_pause_share, 1e-6), 1.0)
        # (s, k // EFF_BUCKET, c_L) -> (c*, c_T): the grid searches are dear
        self._eff: dict[tuple[int, int, int], tuple[int, int]] = {}
        self._spaced: dict[str, tuple[float, float]] = {}  # device -> (its last spaced mixed step's start, next start)
        self._mixed_s: dict[str, float] = {}  # device -> last decision instant it was (or was sent) MIXED (s)
        # chunk placement, a part given the estimates it uses (node.core.mixed_placement); bound methods, so
        # the cost model is read at each call (an online refit replaces it) and the policy still pickles
        self.mixed = MixedPlacement(target_s=self._ttft_target_s, fits_kv=self._fits_kv, need_blocks=self._need_blocks,
                                    chunks_s=self._chunks_s, decode_step_s=self._decode_s, urgent=self.urgent)
        self.handoffs = HandoffWindows(self, self._fits_kv)  # hand-off windows, a part reading these estimates

    def quiet_decisions(self, now_s: float, mixed: list[str]) -> list[SwitchRole]:
        """:meth:`decide`'s decisions at ``now_s`` (s) when nothing waits and every device is in the decode
        configuration with no queued prompt work, ``mixed`` (device ids) being those in MIXED: each goes
        back to DECODE ("nothing_waits"), and its last MIXED instant is now (gathering counts from it).
        No snapshot is needed for that: on a CPU node the round after each prompt's last chunk is this
        one, and building the snapshot for it cost about as much as the arrival's own round."""
        for device_id in mixed:
            self._mixed_s[device_id] = now_s
        return [SwitchRole(device_id, Role.DECODE, "nothing_waits") for device_id in mixed]

    # --- the formulas, on a device ---------------------------------------------------------------
    def _mix(self, dv: _Dev, now_s: float) -> _Mix:
        st = dv.st
        s = len(st.resident)
        k = sum(r.context_tokens for r in st.resident)
        t0 = max(now_s, st.busy_until_s)
        d = self.cost.decode_step_s(s, k)
        limit = step_limit_s(s, d, self.T)
        cap = max(0, self.max_step_tokens - s)
        m = lambda c: self.cost.mixed_step_s(c, s, k)  # noqa: E731
        c = c_fast = chunk_budget(m, limit, cap)  # c_L
        spaced = c == 0 and 0 < s and d < self.T  # no chunk fits T, decode does: spaced mixed steps
        if spaced:
            c = c_fast = chunk_budget(m, self.wmax, cap)
        gather = 0.0
        if c > 0 and s > 0:  # with no resident there is no decode step to amortise: take the limit
            key = (s, k // EFF_BUCKET, c)
            if key not in self._eff:
                if len(self._eff) > 1 << 14:
                    self._eff.clear()
                knee = efficient_chunk(m, c)
                self._eff[key] = (knee, fastest_chunk(m, knee, c))
            c, c_fast = self._eff[key]  # c*, c_T
            gather = gather_s(m(1) - d, self.share)
        if spaced and c > 0 and spacing_s(m(c), d, self.T) > self.wmax:  # decode barely meets T: no room to win back
            c = 0
        oldest = st.prefill_queue_oldest_s if st.prefill_queue_tokens > 0 else None
        mix = _Mix(c, limit, t0, s, k, gather, oldest, c if spaced else c_fast)  # spaced: no growth to keep up
        if spaced and c > 0:
            mix.spacing, mix.d = True, d
            start, nxt = self._spaced.get(st.device_id, (-1.0, -1.0))
            if start + EPS < now_s:  # its last spaced step has begun: the next waits for the spacing
                mix.t0 = max(t0, nxt)
            # every resident must still meet its own mean: its remaining tokens at d after the step
            tau = self.config.tpot_slo_ms / 1e3
            budgets = [mean_budget_s(r.first_token_s, r.output_tokens, assured_output(r), tau, d)
                       for r in st.resident]
            mix.chunk = chunk_budget(m, min(budgets) - mix.t0, c)
            if mix.chunk == 0:  # none fits: hold until the residents that cannot absorb one have ended
                mix.hold, mix.chunk = True, c
                mix.t0 += hold_s(st.resident, budgets, mix.t0, m(1), d)
        return mix

    def chunk_budget_of(self, st, now_s: float) -> tuple[int, float]:
        """``(c, L)`` of a device state (:mod:`node.core.chunk_budget`): its chunk budget (prompt tokens)
        and step limit (s)."""
        m = self._mix(_Dev(st, 0), now_s)
        return m.chunk, m.limit_s

    def _ttft_target_s(self) -> float:
        """The TTFT target a queue as chunks must end within: ``ttft_urgency x ttft_slo`` (s)."""
        return self.config.ttft_urgency * self.config.ttft_slo_ms / 1e3

    def _decode_s(self, n: int, k: int) -> float:
        """The decode step time (s) of ``n`` sequences holding ``k`` context tokens (the cost model of now)."""
        return self.cost.decode_step_s(n, k)

    def _m(self, mix: _Mix):
        return lambda c: self.cost.mixed_step_s(c, mix.s, mix.k)

    def _chunks_s(self, mix: _Mix, tokens: int, chunk: int | None = None) -> float:
        """Seconds from ``mix.t0`` until ``tokens`` prompt tokens are carried in chunks of ``chunk``
        (default: the device's chunk this round; spacing included)."""
        m = self._m(mix)
        c = mix.chunk if chunk is None else chunk
        out = chunks_s(m, tokens, c)
        if mix.spacing and tokens > c > 0:
            out += (-(-tokens // c) - 1) * spacing_s(m(c), mix.d, self.T)
        return out

    # --- the decision ----------------------------------------------------------------------------
    def decide(self, now_s: float, snapshot: NodeSnapshot) -> list[AdaptiveDecision]:
        """Decisions for this instant (apply in order): rejections, placements, role switches (free ones
        between DECODE and MIXED), chunk budgets, and the hand-off windows' moves (:class:`Migrate`,
        :mod:`node.core.handoff_windows`)."""
        devs = self._prepare(now_s, snapshot)
        out: list[AdaptiveDecision] = []
        remaining = self._reject(snapshot, devs, out)
        dec = [dv for dv in devs if dv.st.role in (Role.DECODE, Role.MIXED)]
        mixes = {dv.st.device_id: self._mix(dv, now_s) for dv in dec}
        hand = self.handoffs.devices(now_s, devs)  # node.core.handoff_windows
        remaining = self.handoffs.place(now_s, remaining, hand, out, dec, mixes)
        remaining = self._place(now_s, remaining, [dv for dv in devs if dv.target and dv not in hand], out)
        self._end_windows([dv for dv in devs if dv not in hand], out, idle_too=True)
        if remaining and (opened := self.handoffs.open_window(now_s, dec, mixes, remaining, hand, out)) is not None:
            hand.append(opened)
            dec.remove(opened)
            del mixes[opened.st.device_id]
            remaining = self.handoffs.place(now_s, remaining, [opened], out, dec, mixes)
        # windows first: a device whose work is cheaper (or only in time) as a window takes it
        for dv in sorted(dec, key=lambda dv: (dv.holder, -self._afford_s(dv, now_s), dv.idx)):
            if not (remaining or self._own_work(dv)):
                continue
            why = self._window_reason(now_s, dv, mixes[dv.st.device_id], remaining)
            if why is None:
                continue
            reason, work_s = why
            n = len(out)
            remaining = self._maybe_switch(now_s, dv, devs, remaining, out, work_s)
            if len(out) > n and isinstance(out[n], SwitchRole):
                out[n] = msgspec.structs.replace(out[n], reason=reason)
                del mixes[dv.st.device_id]
        # after the windows: a hand-off's sequence must not land on a device this round sends to a window
        self.handoffs.hand_off(now_s, hand, dec, mixes, out)
        mixing = [dv for dv in dec if dv.st.device_id in mixes]
        places: list[Place] = []
        self._keep_up(now_s, mixing, mixes, 0)  # a queue longer than the target at c*
        remaining, capped = self.mixed.place(now_s, remaining, mixing, mixes, places)
        if capped:  # prompts the devices had room for but not the time at their chunks: grow them
            self._keep_up(now_s, mixing, mixes, capped)
            remaining, _ = self.mixed.place(now_s, remaining, mixing, mixes, places)
        self._rescue(now_s, mixing, mixes)
        for dv in mixing:
            mix = mixes[dv.st.device_id]
            queued = dv.q > 0
            if dv.st.role is Role.MIXED:  # it has been running mixed steps until now
                self._mixed_s[dv.st.device_id] = now_s
            gathering = queued and self._gathering(now_s, dv, mix, self._mixed_s.get(dv.st.device_id, -INF))
            spacing = queued and mix.spacing and (mix.hold or mix.t0 > max(now_s, dv.st.busy_until_s) + EPS)
            want = Role.MIXED if queued and mix.chunk > 0 and not gathering and not spacing else Role.DECODE
            if want is Role.MIXED:
                self._mixed_s[dv.st.device_id] = now_s
            if dv.st.role is not want:
                reason = ("chunks_fit" if want is Role.MIXED else "nothing_waits" if not queued
                          else "no_headroom" if mix.chunk <= 0 else "spacing" if spacing else "gather")
                out.append(SwitchRole(dv.st.device_id, want, reason))
            if want is Role.MIXED:
                out.append(ChunkBudget(dv.st.device_id, mix.chunk, mix.limit_s))
                if mix.spacing and self._spaced.get(dv.st.device_id, (-1.0,))[0] + EPS < now_s:
                    step = self._m(mix)(min(mix.chunk, dv.q))
                    self._spaced[dv.st.device_id] = (mix.t0, mix.t0 + step + spacing_s(step, mix.d, self.T))
        return out + places

    def _keep_up(self, now_s: float, devs: list[_Dev], mixes: dict[str, _Mix], capped: int) -> None:
        """Grow each device's chunk from ``c*`` to the smallest whose chunks serve its backlog — its queue
        plus an even share of the ``capped`` tokens of the waiting prompts that the devices had the slots
        and KV for but not the time — within ``KEEP_UP_SHARE`` of the TTFT SLO from now (``c_T`` if none
        does; :func:`node.core.chunk_budget.keep_up_chunk`)."""
        if not devs:
            return
        share = capped // len(devs)
        target_s = KEEP_UP_SHARE * self.config.ttft_slo_ms / 1e3
        for dv in devs:
            mix = mixes[dv.st.device_id]
            if 0 < mix.knee < mix.max_chunk and dv.q + share > 0:
                mix.chunk = keep_up_chunk(self._m(mix), dv.q + share, mix.knee, mix.max_chunk,
                                          target_s - max(0.0, mix.t0 - now_s))

    def _rescue(self, now_s: float, devs: list[_Dev], mixes: dict[str, _Mix]) -> None:
        """Grow a device's chunk (within ``[c, c_T]``) to the smallest whose chunks carry its whole queue
        by its oldest prompt's TTFT SLO, where the chunk would miss that and ``c_T`` meets it: the chunks
        a TTFT window was judged against (:meth:`_window_reason`). A prompt that misses even at ``c_T``
        (it waited for a sequence slot) is not rescued by a longer step for every resident."""
        slo = self.config.ttft_slo_ms / 1e3
        for dv in devs:
            mix = mixes[dv.st.device_id]
            if dv.q <= 0 or mix.oldest_s is None or mix.spacing or not 0 < mix.chunk < mix.max_chunk:
                continue
            left = slo - (now_s - mix.oldest_s) - max(0.0, mix.t0 - now_s)
            if self._chunks_s(mix, dv.q) > left + EPS and self._chunks_s(mix, dv.q, mix.max_chunk) <= left:
                mix.chunk = keep_up_chunk(self._m(mix), dv.q, mix.chunk, mix.max_chunk, left)

    @staticmethod
    def _gathering(now_s: float, dv: _Dev, mix: _Mix, mixed_s: float) -> bool:
        """The queue waits for company: under one chunk ``c*`` (the knee, not the chunk grown to keep up),
        its oldest prompt younger than ``G``, and the device's last MIXED instant ``mixed_s`` (s) less
        than ``G`` ago (a mixed step now would come sooner than ``G`` after the last one; after a quiet
        spell of ``G`` holding the prompt would save no mixed step, only delay it)."""
        return (mix.gather_s > 0 and dv.q < mix.knee and mix.oldest_s is not None
                and now_s - mix.oldest_s < mix.gather_s and now_s - mixed_s < mix.gather_s)

    def _work_tokens(self, dv: _Dev, remaining: list[WaitingPrompt]) -> tuple[int, int, float | None]:
        """The device's own queued tokens plus the waiting prompts that fit its KV (up to ``Wmax`` of
        prefill); the tokens of its head (its own queue, else the first fitting prompt); the head's
        arrival (s; None: no work)."""
        tokens = head = dv.q
        oldest = dv.st.prefill_queue_oldest_s if dv.q else None
        kv, slots = dv.kv, dv.slots
        for w in remaining:
            if kv <= 0 or slots <= 0 or self.prefill_s(tokens) > self.wmax:
                break
            need = self._need_blocks(dv.st, w)
            if 0 <= need <= kv and w.seqs <= slots:
                kv, slots = kv - need, slots - w.seqs
                tokens += w.new_tokens(dv.st.device_id)
                if oldest is None:
                    head, oldest = tokens, w.arrival_s
        return tokens, head, oldest

    def _window_reason(self, now_s: float, dv: _Dev, mix: _Mix,
                       remaining: list[WaitingPrompt]) -> tuple[str, float] | None:
        """Why the device should take its work as a PREFILL window ("cheaper", "no_chunk_fits", "ttft"),
        with the prefill seconds of that work (the window's length), or None (see the module docstring)."""
        tokens, head, oldest = self._work_tokens(dv, remaining)
        if tokens <= 0:
            return None
        m = self._m(mix)
        work_s = self.prefill_s(tokens)
        if window_extra_s(work_s, self.pause_s) + EPS < chunks_extra_s(m, tokens, mix.chunk):
            return ("cheaper" if mix.chunk > 0 else "no_chunk_fits"), work_s
        wait = now_s - (oldest if oldest is not None else now_s) + max(0.0, mix.t0 - now_s)
        # as chunks, the head is judged at c_T: where that meets its SLO, _rescue grows the chunk for it
        fastest = mix.chunk if mix.spacing else max(mix.chunk, mix.max_chunk)
        as_chunks = wait + self._chunks_s(mix, head, fastest)
        as_window = wait + self.pause_s + self.prefill_s(head)
        slo = self.config.ttft_slo_ms / 1e3
        if as_chunks > slo + EPS and as_window <= slo:
            return "ttft", work_s
        return None
