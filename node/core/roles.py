"""Role scheduler for time-shared prefill/decode, with routing and admission (pure policy).

Every device switches in time between a PREFILL role (prompt-only batches) and a DECODE role (one
token per resident sequence); KV stays on the device that prefilled it, so a sequence only advances
while *its* device decodes. :meth:`RoleScheduler.decide` takes ``now_s`` and a :class:`NodeSnapshot`
and returns decisions: :class:`SwitchRole`, :class:`Place` (route a waiting prompt to a device) and
:class:`Reject`. It imports only the standard library and msgspec, so the node, the unit tests (virtual
clock) and the simulator run the same object.

**Switch to PREFILL** (a DECODE device, for the prompts no prefill device could take), when all of:

* it has decoded at least ``dwell = max(Wmin, 2p(1 - s)/s)`` (hysteresis; ``s = max_pause_share``
  bounds the share of device time lost to pauses, since a cycle then lasts at least ``dwell + 2p``);
* the stagger rule allows it: with 2+ devices, a device holding sequences leaves DECODE only while
  another holder is decoding, so decode keeps flowing and devices take turns. ``stagger="hard"``
  always; ``"soft"`` (default) lets an *urgent* switch (below) through, so prefill capacity is not
  capped at (N-1)/N devices when TTFT is at risk; ``"off"`` never staggers;
* some waiting prompt fits its free KV (prompt + expected output, in blocks);
* either the affordable window ``W = R(t0 = now + p)`` is at least ``max(Wmin, min(P(waiting), Wmax))``
  (headroom to serve the queue, or a full window), or the oldest fitting prompt is *urgent* —
  ``age + p + P(prompt) >= ttft_urgency * ttft_slo`` — no resident sequence is past its deadline, and
  the prompt fits the *lifetime* headroom of every resident sequence whose expected length is known:
  ``W <= D - t0 - p - d + (remaining - 1)(T - d)``, what its remaining gaps win back at pace ``d``
  (both waived when decode cannot keep up anyway, ``d >= T``). An urgent switch opens a *forced*
  window of ``max(Wmin, P(urgent prefix))``, the urgent prompts at the head of the queue cut at
  ``Wmax`` and that headroom (one prompt at least): old sequences overrun by at most that one window,
  and the ones near their end not at all, so a prompt may wait for them to finish.

A device with no resident sequence switches (or parks in PREFILL) at once: no one waits on it.

**Switch to DECODE** when a PREFILL device holding sequences has nothing queued and nothing more was
placed on it (queue drained, or ``R`` spent). Idle devices stay parked in PREFILL.

**Admission and routing.** Waiting prompts are taken in (arrival, request id) order and placed on the
prefill-role device (PREFILL, or switching to it) where they fit KV and window and cost least (ties:
snapshot order; the cost follows). A prompt that fits nowhere stays waiting (the shell bounds the queue and answers 503
past ``--max-queue``); one that cannot fit an *empty* device is rejected. Once an urgent prompt cannot be
placed, later prompts wait behind it (no starvation of long prompts by short ones). A prompt's age
keeps growing until it is urgent and forces a window (once the sequences near their end have
finished, which they do as the device decodes), so every admissible prompt is placed eventually; a
decoding sequence is never stalled past its deadline except by the single window it was born in or
one forced window, as above.

**Cache-aware placement.** A waiting prompt carries, per device, the prompt tokens that device's prefix
cache holds (``cached_tokens``); a device computes only the rest, ``new = prompt - cached``, which is
what its queue ``q`` grows by and what the window must fit. Among the devices where it fits, the
prompt goes to the one of least cost (seconds)::

    cost = t0 + P(q + new)  +  DECODE_LOAD_WEIGHT * E * d(n + 1, ctx + q + prompt + n + 1)

the prompt's prefill end there — the cached prefix it need not compute (the *overlap*) against the
prefill queued there (the *load*), both in seconds of prefill — plus its expected decode time there,
``E`` expected output tokens at the decode step ``d`` of that device's batch once it joins (``n``
resident and queued sequences of ``ctx`` tokens). This is NVIDIA Dynamo's KV-router cost
(``overlap_weight * prefill_blocks + active_blocks``, weight 1) in time units, so a cached prefix
draws its conversation to one device only while that device is not already the busier one by more than
the prefill the cache saves; ``DECODE_LOAD_WEIGHT = 1`` weighs a second of expected decode like a
second of prefill (0 would ignore decode load, and place by prefill end alone).

**Liveness.** While work exists, some device steps or switches: a PREFILL window also ends
(``blocked``) when its queued work cannot run (``prefill_runnable`` false: e.g. a sequence preempted
for lack of KV, whose blocks the residents hold; the residents give them back only by decoding), and
no prompt is placed on such a device. A DECODE device whose own queue can run (sequences it preempted,
or a recompute) switches for it as for waiting prompts — a ``recompute`` window when affordable, or a
forced one once the oldest of that work is urgent — and a device with nothing resident parks in
PREFILL at once. A DECODE phase lasts at least ``dwell`` and decodes every resident, so outputs grow
between windows; outputs are bounded, so every sequence ends (the property test in
``tests/core/test_liveness.py`` drives this policy over the live :class:`~node.core.batcher.Batcher`
with pools down to one sequence).

The shell applies decisions in list order (a :class:`SwitchRole` precedes the :class:`Place` s on the
same device), and on completing a switch sets ``role = switching_to`` and ``role_since_s = switch_done_s``.
"""

from __future__ import annotations

from node.core.cost import CostModel
from node.core.role_state import (DECODE_LOAD_WEIGHT, EPS, INF, Decision, DeviceState, NodeSnapshot, Place, Reject,
                                  ResidentSeq, Role, RoleSchedulerConfig, SwitchRole, WaitingPrompt, assured_per_seq,
                                  blocks_for, reserve_blocks)
from node.core.roofline import RooflineCost
from node.core.windows import WindowMath, _Residents

__all__ = [
    "Role", "WaitingPrompt", "ResidentSeq", "DeviceState", "NodeSnapshot", "SwitchRole", "Place",
    "Reject", "Decision", "RoleSchedulerConfig", "RoleScheduler", "CostModel", "blocks_for",
    "reserve_blocks",
]
"""The policy's inputs and outputs live in :mod:`node.core.role_state` and its formulas in
:mod:`node.core.windows`; they are re-exported here, where the policy's users have always found them."""


class _Dev:
    """Per-decision working state of one device."""

    __slots__ = ("st", "idx", "target", "t0", "ws", "q", "qn", "kv", "placed", "forced_until", "end_by", "holder", "decodeish", "slots",
                 "res")

    def __init__(self, st: DeviceState, idx: int):
        self.st = st
        self.idx = idx
        self.holder = bool(st.resident)
        self.target = st.role is Role.PREFILL or (st.role is Role.SWITCHING and st.switching_to is Role.PREFILL)
        # the decode configuration: DECODE, or MIXED (decode plus prompt chunks, the adaptive policy)
        self.decodeish = st.role in (Role.DECODE, Role.MIXED) or (st.role is Role.SWITCHING
                                                                  and st.switching_to in (Role.DECODE, Role.MIXED))
        self.t0 = 0.0
        self.ws = 0.0
        self.q = st.prefill_queue_tokens
        self.qn = st.prefill_queue_seqs
        self.kv = st.kv_free_blocks - st.kv_reserved_blocks
        self.slots = st.seq_slots_free
        self.placed = 0
        self.forced_until = -INF
        self.end_by = INF
        self.res: _Residents | None = None  # for the window start ws, once known

    def take(self, w: WaitingPrompt, need: int) -> Place:
        """Place ``w`` here: its prompt tokens, a sequence, ``need`` KV blocks and its slots leave this
        device's room for the rest of the decision."""
        self.q += w.new_tokens(self.st.device_id)
        self.qn += 1
        self.kv -= need
        self.slots -= w.seqs
        self.placed += 1
        return Place(w.request_id, self.st.device_id, need)


class RoleScheduler(WindowMath):
    """The time-shared role policy. State per device in PREFILL: the end of a forced window and the
    end-by bound of its queued prompts (both dropped when it leaves the role)."""

    def __init__(self, config: RoleSchedulerConfig, cost: CostModel | RooflineCost):
        super().__init__(config, cost)
        self._forced_until: dict[str, float] = {}
        self._end_by: dict[str, float] = {}

    # --- the decision ---------------------------------------------------------------------------
    def decide(self, now_s: float, snapshot: NodeSnapshot) -> list[Decision]:
        """Decisions for this instant: rejections, placements, role switches (apply in order)."""
        devs = self._prepare(now_s, snapshot)
        out: list[Decision] = []
        remaining = self._reject(snapshot, devs, out)
        remaining = self._place(now_s, remaining, [dv for dv in devs if dv.target], out)
        self._end_windows(devs, out)
        order = sorted((dv for dv in devs if dv.st.role is Role.DECODE),
                       key=lambda dv: (dv.holder, -self._afford_s(dv, now_s), dv.idx))
        for dv in order:
            if not remaining and dv.holder and not self._own_work(dv):
                continue
            remaining = self._maybe_switch(now_s, dv, devs, remaining, out)
        return out

    # --- the decision's parts (the adaptive policy, node.core.adaptive, reuses them) ----------------
    def _prepare(self, now_s: float, snapshot: NodeSnapshot) -> list[_Dev]:
        """Per-device working state; a prefill-role device's window start ``ws``, work start ``t0`` and
        its per-window bounds (policy state dropped for devices that left PREFILL). The pause is the
        snapshot's measured one from this decision on (:meth:`WindowMath.plan_pause`)."""
        self.plan_pause(snapshot.pause_s)
        devs = [_Dev(st, i) for i, st in enumerate(snapshot.devices)]
        for dv in devs:
            if not dv.target or (not dv.holder and dv.q == 0):
                self._end_by.pop(dv.st.device_id, None)
            if not dv.target:
                self._forced_until.pop(dv.st.device_id, None)
                continue
            st = dv.st
            if st.role is Role.PREFILL:
                dv.t0, dv.ws = max(now_s, st.busy_until_s), st.role_since_s
            else:
                done = st.switch_done_s if st.switch_done_s is not None else now_s + self.pause_s
                dv.t0 = dv.ws = max(now_s, done)
            dv.forced_until = self._forced_until.get(st.device_id, -INF)
            dv.end_by = self._end_by.get(st.device_id, INF)
            dv.res = _Residents(st, dv.ws, self.T)
        return devs

    @staticmethod
    def _reject(snapshot: NodeSnapshot, devs: list[_Dev], out: list[Decision]) -> list[WaitingPrompt]:
        """Reject prompts no empty device could hold; the others in (priority, arrival, request id) order."""
        remaining: list[WaitingPrompt] = []
        # block size -> its largest pool: one check per prompt, not one per device (the queue is hundreds long
        # on an overloaded node, and this runs every round: ~9 % of its loop, py-spy)
        largest: dict[int, int] = {}
        for dv in devs:
            largest[dv.st.block_size] = max(largest.get(dv.st.block_size, 0), dv.st.kv_total_blocks)
        for w in sorted(snapshot.waiting, key=WaitingPrompt.order_key):
            if not any(blocks_for(w.prompt_tokens + 1, bs) <= total for bs, total in largest.items()):
                out.append(Reject(w.request_id, "prompt does not fit the KV memory of any device"))
            else:
                remaining.append(w)
        return remaining

    def _end_windows(self, devs: list[_Dev], out: list[Decision], idle_too: bool = False) -> None:
        """End drained windows, and windows whose queued work waits on the residents' KV (devices
        holding sequences; with ``idle_too`` also an idle one whose queue is empty)."""
        for dv in devs:
            if (dv.st.role is Role.PREFILL and (dv.holder or (idle_too and dv.q == 0)) and dv.placed == 0
                    and (dv.q == 0 or self._blocked(dv))):
                reason = "blocked" if dv.q else "window" if self._limit_s(dv) <= 0 else "drained"
                out.append(SwitchRole(dv.st.device_id, Role.DECODE, reason))
                dv.target, dv.decodeish = False, True
                self._forced_until.pop(dv.st.device_id, None)
                self._end_by.pop(dv.st.device_id, None)

    # --- helpers --------------------------------------------------------------------------------
    def _afford_s(self, dv: _Dev, now_s: float) -> float:
        t0 = max(now_s, dv.st.busy_until_s) + self.pause_s
        return self.window_left_s(dv.st, t0, t0)

    def _limit_s(self, dv: _Dev, w: WaitingPrompt | None = None) -> float:
        """Prefill seconds of queued work (plus ``w``) the device may commit from ``t0``: ``min(R, Wmax)``."""
        n, tokens = (dv.qn + 1, dv.q + w.prompt_tokens) if w is not None else (dv.qn, dv.q)
        r = self._window_left(dv.res, dv.t0, dv.ws, n, tokens)
        limit = INF if (r == INF and dv.q == 0) else min(r, self.wmax)
        return min(max(limit, dv.forced_until - dv.t0), dv.end_by - dv.t0)

    @staticmethod
    def _need_blocks(st: DeviceState, w: WaitingPrompt) -> int:
        """Blocks the prompt reserves on the device, or -1 if it cannot fit even an empty one."""
        need = reserve_blocks(w.prompt_tokens, w.expected_output_tokens, st.block_size, st.kv_total_blocks)
        return need if blocks_for(w.prompt_tokens + 1, st.block_size) <= need else -1

    def _fits_kv(self, dv: _Dev, w: WaitingPrompt) -> int:
        """Blocks to reserve on the device, or -1 when its free KV or sequence slots cannot take ``w``."""
        need = self._need_blocks(dv.st, w)
        return need if 0 <= need <= dv.kv and w.seqs <= dv.slots else -1

    def _place(self, now_s: float, waiting: list[WaitingPrompt], targets: list[_Dev],
               out: list[Decision]) -> list[WaitingPrompt]:
        """Place prompts on prefill-role devices; return those left waiting."""
        left: list[WaitingPrompt] = []
        blocked = False
        open_ = [dv for dv in targets if not self._closed(dv)]
        for i, w in enumerate(waiting):
            if not open_:  # no target can take even one more token
                left.extend(waiting[i:])
                break
            best: tuple[float, int, _Dev, int] | None = None
            if not blocked:
                for dv in open_:
                    need = self._fits_kv(dv, w)
                    new = w.new_tokens(dv.st.device_id)
                    if need < 0 or self.prefill_s(dv.q + new) > self._limit_s(dv, w) + EPS:
                        continue
                    key = (self._placement_cost_s(dv, w, new), dv.idx, dv, need)
                    if best is None or key[:2] < best[:2]:
                        best = key
            if best is None:
                left.append(w)
                blocked = blocked or self.urgent(w, now_s)
                continue
            _, _, dv, need = best
            out.append(dv.take(w, need))
            n = assured_per_seq(w)
            if n >= 2:  # its first gap may overrun by what its later gaps surely win back
                d = self.cost.decode_step_s(dv.res.n + dv.qn, dv.res.ctx + dv.q + dv.qn)
                budget = self.T - self.pause_s - d + (n - 2) * (self.T - d)
                dv.end_by = min(dv.end_by, dv.t0 + self.prefill_s(dv.q) + max(0.0, budget))
                self._end_by[dv.st.device_id] = dv.end_by
            if self._closed(dv):
                open_.remove(dv)
        return left

    def _placement_cost_s(self, dv: _Dev, w: WaitingPrompt, new_tokens: int) -> float:
        """Seconds a placement of ``w`` on the device costs (lower is better; see *Cache-aware
        placement* in the module docstring): its prefill end, counting only the tokens the device's
        prefix cache lacks, plus ``DECODE_LOAD_WEIGHT`` times its expected decode time there."""
        finish = dv.t0 + self.prefill_s(dv.q + new_tokens)
        if DECODE_LOAD_WEIGHT == 0:
            return finish
        n = dv.res.n + dv.qn + w.seqs
        d = self.cost.decode_step_s(n, dv.res.ctx + dv.q + w.prompt_tokens + n)
        return finish + DECODE_LOAD_WEIGHT * max(1, w.expected_output_tokens // max(1, w.seqs)) * d

    def _closed(self, dv: _Dev) -> bool:
        """No prompt can be added: no free block, its queue is blocked, or one more token would
        overrun the window."""
        return (dv.kv <= 0 or dv.slots <= 0 or self._blocked(dv)
                or self.prefill_s(dv.q + 1) > self._limit_s(dv) + EPS)

    @staticmethod
    def _blocked(dv: _Dev) -> bool:
        """Work is queued on the device that no PREFILL step can run until residents free KV."""
        return dv.st.prefill_queue_tokens > 0 and not dv.st.prefill_runnable

    @staticmethod
    def _own_work(dv: _Dev) -> bool:
        """A DECODE device holds queued prompt work a PREFILL step could run now (sequences it
        preempted for KV, to recompute; or a recompute after a lost hand-off)."""
        return dv.st.prefill_queue_tokens > 0 and dv.st.prefill_runnable

    def _stagger_ok(self, dv: _Dev, devs: list[_Dev]) -> bool:
        if self.config.stagger == "off" or len(devs) < 2 or not dv.holder:
            return True
        return any(o is not dv and o.holder and o.decodeish for o in devs)

    def _maybe_switch(self, now_s: float, dv: _Dev, devs: list[_Dev], remaining: list[WaitingPrompt],
                      out: list[Decision], work_s: float = INF) -> list[WaitingPrompt]:
        # work_s (the adaptive policy): the window lasts the prefill seconds of the work it was opened
        # for (at least Wmin), not as long as the residents could afford

        st = dv.st
        t0 = max(now_s, st.busy_until_s) + self.pause_s
        staggered = dv.holder and not self._stagger_ok(dv, devs)
        if dv.holder and (now_s - st.role_since_s < self.dwell_s or (staggered and self.config.stagger == "hard")):
            return remaining
        fitting: list[WaitingPrompt] = []
        kv, slots = dv.kv, dv.slots
        own = self._own_work(dv)  # its own queue goes first; its KV is already its own
        tokens = dv.q if own else 0
        own_urgent = own and (now_s - (st.prefill_queue_oldest_s if st.prefill_queue_oldest_s is not None else now_s)
                              + self.pause_s + self.prefill_s(dv.q)
                              >= self.config.ttft_urgency * self.config.ttft_slo_ms / 1e3)
        for w in remaining:
            if kv <= 0 or slots <= 0 or self.prefill_s(tokens) > self.wmax:
                break  # enough to size the window
            need = self._need_blocks(st, w)
            if 0 <= need <= kv and w.seqs <= slots:
                fitting.append(w)
                kv -= need
                slots -= w.seqs
                tokens += w.new_tokens(st.device_id)
            elif not fitting and self.urgent(w, now_s):
                break  # keep FIFO behind an urgent prompt this device cannot hold
        forced_until = -INF
        if not dv.holder:
            reason, window = ("idle" if fitting else "park"), self.wmax
        elif not fitting and not own:
            return remaining
        else:
            afford = self.window_left_s(st, t0, t0)
            need_s = self.prefill_s(tokens)
            first_s = min([self.prefill_s(w.prompt_tokens) for w in fitting] + ([self.prefill_s(dv.q)] if own else []))
            head_tokens = dv.q if own else fitting[0].prompt_tokens
            head_urgent = own_urgent if own else self.urgent(fitting[0], now_s)
            if not staggered and afford + EPS >= max(self.wmin, min(need_s, self.wmax), first_s):
                reason, window = ("queue" if fitting else "recompute"), min(afford, self.wmax)
            elif head_urgent and ((cap := self._forced_cap_s(st, now_s, t0)) >= self.prefill_s(head_tokens)):
                urgent_tokens = dv.q if own else 0
                for w in fitting:
                    if not self.urgent(w, now_s):
                        break
                    if urgent_tokens and self.prefill_s(urgent_tokens + w.prompt_tokens) > min(self.wmax, cap):
                        break
                    urgent_tokens += w.prompt_tokens
                window = max(min(self.wmin, cap), self.prefill_s(urgent_tokens), afford)
                reason, forced_until = "ttft", t0 + window
            else:
                return remaining
        if work_s < INF:
            window = min(window, max(work_s, self.wmin))
            forced_until = min(forced_until, t0 + window)
        out.append(SwitchRole(st.device_id, Role.PREFILL, reason, window,
                              self.cost.prefill_tokens_within(window, self.config.prefill_token_budget)))
        dv.target, dv.decodeish, dv.t0, dv.ws, dv.forced_until = True, False, t0, t0, forced_until
        if work_s < INF:
            dv.end_by = self._end_by[st.device_id] = t0 + window
        dv.res = _Residents(st, t0, self.T)
        if forced_until > -INF:
            self._forced_until[st.device_id] = forced_until
        return self._place(now_s, remaining, [dv], out) if fitting else remaining
