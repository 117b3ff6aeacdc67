"""Hand-off windows of the adaptive policy: one device (or group) prefills for the others (pure).

Where no prompt chunk fits a decode step's limit, the adaptive policy spaces its mixed steps
(:func:`node.core.chunk_budget.spacing_s`: a 70B's eager mixed step of ~36 ms on tensor-parallel groups
against a 20 ms TPOT target, while its graph-replayed decode step takes 7-17 ms). The residents' token
gaps then sit at the target on average, prompts wait behind the spacing, and a plain PREFILL window
stops every resident of its device for its length. Disaggregation's answer is a prefill pool that
hands each prefilled sequence's KV to a decode pool (Splitwise, DistServe): decode steps carry no
prompt work, and prompts run in the prefill configuration (its degree, no decode graphs). The adaptive
policy takes that arrangement on one device of the node while the node is in that regime, and leaves
it when the device has nothing to prefill. Symbols as in :mod:`node.core.adaptive`.

* **Open** ("handoff"): prompts wait that no hand-off device took, two or more devices are in the
  decode configuration, and every one of them holding residents is spaced (``mix.spacing``) or has no
  chunk (``c = 0``), at least one holding residents. The candidate is the decode-configuration device
  with the fewest residents (then the least context, then snapshot order) whose residents all fit the
  others. It switches to PREFILL, and its residents move out, when both hold:

  - *the first gap fits*: the head prompt's mean token gap absorbs the first gap of a hand-off, ``g =
    2 m(c_T) + x + d`` (the copy, ``x`` = its prompt tokens times the link's seconds per token,
    ``copy_s_per_token``, starts once a destination's two pipelined steps in flight end, mixed steps of
    the largest chunk it may grow to, as the node and the simulator copy; then its decode step), with
    its other gaps at ``T``:
    ``(N - 1) tau >= g + (N - 2) T``, ``N`` its expected output tokens, ``tau`` the TPOT SLO. A short
    output cannot amortise that gap (Azure code, 70B on two groups of 4, TPOT 20 ms, 0.661 req/s:
    SLO attainment 0.917 before hand-offs, 0.826 handing off every prompt, 0.902 with this rule);
  - *it carries prompts faster*: the candidate's prefill rate on the waiting prompts (up to ``Wmax``
    of them) plus the others' chunk rates with its residents added exceeds the node's chunk rate now
    (``c / (m + S)`` per device, spaced, or ``c / m``). An empty device chunks as fast as a window in
    one configuration, so it is not handed off for nothing.
* **Placement**: waiting prompts go to hand-off devices first, FIFO, where they fit KV and sequence
  slots, their first gap fits (above), a decode device will have room for their sequences (beside the
  hand-off devices' residents, which move first; a window opens only where its candidate's residents
  and the head prompt's sequence have such room), and the device's queue is prefilled within the TTFT
  target ``ttft_urgency x ttft_slo`` from now (one prompt at least on an empty queue), least prefill end
  first. The rest go to the other devices as the adaptive policy places them (chunks, spaced chunks or
  windows).
* **Hand-off**: every round, each decoding sequence on a hand-off device (a prompt it prefilled, or a
  resident from before it opened) moves (:class:`~node.core.imbalance.Migrate`, reason "handoff") to
  the decode-configuration device with room (KV for its expected rest, as the fallback's room rule,
  and a sequence slot) whose decode step with it, ``d(n + 1, k + ctx)``, is shortest, where that step
  keeps pace (``<= T``: a device whose decode alone misses ``T`` takes no more). The copy is the
  sequence's KV at the link rate: 0.75 ms for a 2,048-token 70B prompt over NVLink, against ``T``.
* **Close** (back to DECODE): the device holds a sequence no device has room for or keeps pace with
  ("blocked": it decodes where it is, and the prompts queued there go on as chunks, rather than wait
  behind the window's queue), or has held and been given nothing for ``dwell`` (the two-role policy's
  hysteresis, so a gap between prompts costs no pair of pauses; counted from the round that last saw
  work queued, which may be while its last step runs) — "drained". The live driver
  keeps its timer running while a device is in PREFILL, so an idle node gets the round that closes it.

**Liveness.** A hand-off device runs PREFILL steps on its queue (the prompts placed on it fit its KV),
and every sequence it prefilled either moves to a decode device or, where none has room, makes it
close, and decodes there with its queue as chunks. Placement on it is bounded by the TTFT target, so
prompts it cannot take go to the other devices as before. ``tests/core/test_liveness.py`` applies the
moves.
"""

from __future__ import annotations

from typing import Callable, Protocol

from node.core.chunk_budget import spacing_s
from node.core.cost import CostModel
from node.core.role_state import (EPS, INF, Migrate, ResidentSeq, Role, RoleSchedulerConfig, SwitchRole, WaitingPrompt,
                                   assured_per_seq, move_blocks)
from node.core.roles import _Dev
from node.core.roofline import RooflineCost

__all__ = ["HANDOFF", "HandoffWindows", "PolicyEstimates"]

HANDOFF = "handoff"


class PolicyEstimates(Protocol):
    """What the hand-off windows read of the adaptive policy (a :class:`~node.core.windows.WindowMath`), at
    each call: an online refit replaces its cost model, and each round measures its switch pause again."""

    config: RoleSchedulerConfig  # ttft_urgency, ttft_slo_ms, tpot_slo_ms, copy_s_per_token, prefill_token_budget
    cost: CostModel | RooflineCost  # the step-time model: decode_step_s, mixed_step_s, prefill_tokens_within
    T: float  # the per-token target (s)
    wmax: float  # the longest window (s)
    pause_s: float  # the switch pause planned for this round (s)
    dwell_s: float  # the hysteresis a role is held for (s)

    def prefill_s(self, tokens: int) -> float:
        """Seconds of a PREFILL window's steps over ``tokens`` prompt tokens."""
        ...

    def urgent(self, w: WaitingPrompt, now_s: float) -> bool:
        """Whether ``w`` is urgent at ``now_s`` (its age plus its service reach the TTFT urgency)."""
        ...


class HandoffWindows:
    """The hand-off windows of :class:`node.core.adaptive.AdaptiveScheduler` (its ``handoffs``; module
    docstring). The policy's ``decide`` calls :meth:`devices`, :meth:`place`, :meth:`open_window` and
    :meth:`hand_off` in that order each round.

    Args:
        estimates: the policy's cost model, ``T``, ``wmax``, ``pause_s``, ``dwell_s``, prefill time and
            urgency (:class:`PolicyEstimates`), read at each call.
        fits_kv: blocks a prompt reserves on a device, or -1 when its free KV or sequence slots cannot
            take it (``RoleScheduler._fits_kv``).

    State (its own): per hand-off device, the last decision instant (s) it had work, from which its
    ``dwell`` runs before it closes "drained".
    """

    def __init__(self, estimates: PolicyEstimates, fits_kv: Callable[[_Dev, WaitingPrompt], int]):
        self._est, self._fits_kv = estimates, fits_kv
        self._last_work_s: dict[str, float] = {}

    @property
    def open_devices(self) -> list[str]:
        """The devices in a hand-off window as of the last round (ids; a copy)."""
        return list(self._last_work_s)

    def devices(self, now_s: float, devs: list[_Dev]) -> list[_Dev]:
        """The devices in a hand-off window now (in PREFILL or switching to it); forget the others."""
        out = [dv for dv in devs if dv.st.device_id in self._last_work_s and dv.target]
        kept = {dv.st.device_id for dv in out}
        for device_id in [d for d in self._last_work_s if d not in kept]:
            del self._last_work_s[device_id]
        for dv in out:
            dv.end_by = INF  # its sequences leave after their first token: no resident bounds its queue
            # not "busy": a prompt's tokens leave the queue when its last step is sent, so a window may be
            # told to close while that step runs (the switch drains it first). Counting the dwell from the
            # step's end instead kept one group prefilling longer: 70B conversation, 4:4, TPOT 20 ms, 13.28
            # req/s, SLO attainment 0.917 -> 0.823 (the groups trade roles less often)
            if dv.q or dv.st.resident:
                self._last_work_s[dv.st.device_id] = now_s
        return out

    def place(self, now_s: float, waiting: list[WaitingPrompt], hand: list[_Dev], out: list,
              dsts: list[_Dev], mixes: dict) -> list[WaitingPrompt]:
        """Place prompts FIFO on hand-off devices (module docstring), those whose mean gap absorbs the
        first gap a move to one of ``dsts`` may cost and whose sequences one of ``dsts`` has room for
        once the hand-off devices' residents have moved; return those left."""
        if not hand:
            return waiting
        steps = self._handoff_steps(dsts, mixes)
        taken = self._handoff_taken(hand, dsts, mixes)
        target_s = self._est.config.ttft_urgency * self._est.config.ttft_slo_ms / 1e3
        left: list[WaitingPrompt] = []
        for i, w in enumerate(waiting):
            best = None
            trial = {k: list(v) for k, v in taken.items()}  # its sequences' room counts once it is placed
            movable = self._absorbs(w, steps) and self._room_for(w, dsts, mixes, trial)
            for dv in (hand if movable else ()):
                need = self._fits_kv(dv, w)
                if need < 0:
                    continue
                finish = dv.t0 + self._est.prefill_s(dv.q + w.new_tokens(dv.st.device_id))
                if dv.q > 0 and finish - now_s > target_s + EPS:
                    continue
                if best is None or (finish, dv.idx) < best[:2]:
                    best = (finish, dv.idx, dv, need)
            if best is None:
                left.append(w)
                if self._est.urgent(w, now_s):  # FIFO: later prompts do not pass an urgent one here
                    left.extend(waiting[i + 1:])
                    break
                continue
            out.append(best[2].take(w, best[3]))
            self._last_work_s[best[2].st.device_id] = now_s
            taken = trial
        return left

    def open_window(self, now_s: float, dec: list[_Dev], mixes: dict, waiting: list[WaitingPrompt],
                    hand: list[_Dev], out: list) -> _Dev | None:
        """Switch a decode-configuration device to a hand-off window if the node is in the regime
        (module docstring), counting the room the open hand-off devices ``hand`` take for their moves;
        the device, or None."""
        holders = [dv for dv in dec if dv.st.resident]
        if len(dec) < 2 or not holders:
            return None
        if not all(mixes[dv.st.device_id].spacing or mixes[dv.st.device_id].chunk <= 0 for dv in holders):
            return None
        for dv in sorted(dec, key=lambda dv: (len(dv.st.resident), sum(r.context_tokens for r in dv.st.resident),
                                              dv.idx)):
            others = [o for o in dec if o is not dv]
            taken = self._handoff_taken(hand, others, mixes)
            if all(self._destination(r, others, mixes, taken) is not None for r in dv.st.resident):
                break
        else:
            return None
        if not waiting or not self._absorbs(waiting[0], self._handoff_steps(others, mixes)):
            return None
        if not self._room_for(waiting[0], others, mixes, dict(taken)):  # its sequence would have nowhere to go
            return None
        # the node's prompt rate as it is, against dv prefilling the waiting prompts (up to a window of
        # Wmax) and the others chunking with dv's residents added
        now_rate = sum(self._chunk_rate(mixes[o.st.device_id]) for o in dec)
        tokens = sum(w.prompt_tokens for w in waiting)
        window_tokens = self._est.cost.prefill_tokens_within(self._est.wmax, self._est.config.prefill_token_budget)
        tokens = max(1, min(tokens, window_tokens))
        hand_rate = tokens / self._est.prefill_s(tokens) + sum(
            self._chunk_rate(mixes[o.st.device_id], *taken.get(o.st.device_id, (0, 0, 0, 0))[2:]) for o in others)
        if hand_rate <= now_rate:
            return None
        out.append(SwitchRole(dv.st.device_id, Role.PREFILL, HANDOFF, self._est.wmax, window_tokens))
        t0 = max(now_s, dv.st.busy_until_s) + self._est.pause_s
        dv.target, dv.decodeish, dv.t0, dv.ws, dv.end_by = True, False, t0, t0, INF
        self._last_work_s[dv.st.device_id] = now_s
        return dv

    def _handoff_taken(self, hand: list[_Dev], dsts: list[_Dev], mixes: dict) -> dict[str, list[int]]:
        """The room on ``dsts`` the residents of the hand-off devices ``hand`` will take when they move
        (:meth:`_destination`'s ``taken``)."""
        taken: dict[str, list[int]] = {}
        for dv in hand:
            for r in dv.st.resident:
                self._destination(r, dsts, mixes, taken)
        return taken

    def _room_for(self, w: WaitingPrompt, dsts: list[_Dev], mixes: dict, taken: dict[str, list[int]]) -> bool:
        """Whether one of ``dsts`` has room for each of ``w``'s sequences once prefilled (their prompt
        and expected output, beside ``taken``, which records them)."""
        n = max(1, w.seqs)
        seq = ResidentSeq(w.request_id, 0.0, 1, w.prompt_tokens + 1, max(1, w.expected_output_tokens // n))
        return all(self._destination(seq, dsts, mixes, taken) is not None for _ in range(n))

    def _handoff_steps(self, dsts: list[_Dev], mixes: dict) -> list[tuple[float, float]]:
        """``(m(c_T), d)`` (s) of each of ``dsts``: its mixed step at the largest chunk it may grow to, and
        its decode step, the parts of a handed-off sequence's first gap there (:meth:`_first_gap_s`)."""
        cost = self._est.cost
        return [(cost.mixed_step_s(max(1, mx.chunk, mx.max_chunk), mx.s, mx.k), cost.decode_step_s(mx.s, mx.k))
                for mx in (mixes[dv.st.device_id] for dv in dsts if dv.st.device_id in mixes)]

    def _first_gap_s(self, w: WaitingPrompt, steps: list[tuple[float, float]]) -> float:
        """The first token gap (s) of ``w``'s sequence handed off, at worst, on the best of the
        destinations' ``steps`` (:meth:`_handoff_steps`): its copy of ``x`` (prompt tokens at
        ``copy_s_per_token``) starts once the destination's two pipelined steps in flight end (the node's
        moves and the simulator's wait for them), then the sequence decodes: ``2 m + x + d``; inf with no
        destination. Copies queued before it on the source's link are not counted."""
        x = w.prompt_tokens * self._est.config.copy_s_per_token
        return min((2 * m + x + d for m, d in steps), default=INF)

    def _absorbs(self, w: WaitingPrompt, steps: list[tuple[float, float]]) -> bool:
        """Whether ``w``'s mean token gap absorbs its first gap after a hand-off to the best of the
        destinations' ``steps`` (:meth:`_first_gap_s`) with its other gaps at ``T`` (the spaced regime's
        mean): ``(N - 1) tau >= gap + (N - 2) T``, ``N`` its expected output tokens per sequence (``tau``
        the TPOT SLO; one token: no gap). Azure code (short outputs), 70B at 4:4, TPOT 20 ms, 0.661
        req/s: SLO attainment 0.917 before hand-offs, 0.826 handing off every prompt."""
        n = assured_per_seq(w)  # what it surely produces: a short output wins no overrun back
        tau = self._est.config.tpot_slo_ms / 1e3
        return n < 2 or (n - 1) * tau >= self._first_gap_s(w, steps) + (n - 2) * self._est.T

    def _chunk_rate(self, mix, n_in: int = 0, k_in: int = 0) -> float:
        """Prompt tokens per second a decode-configuration device carries in chunks of ``mix.chunk``
        with ``n_in`` more residents of ``k_in`` context tokens: ``c / m``, its mixed steps back to
        back, or ``c / (m + S)`` where ``m > T`` spaces them (:func:`~node.core.chunk_budget.spacing_s`);
        0 where no chunk runs or decode alone misses ``T``. ``c`` stays the chunk chosen without the
        added residents (an estimate: they shorten the spacing's room, not the chunk's knee much)."""
        c, s, k = mix.chunk, mix.s + n_in, mix.k + k_in
        if c <= 0:
            return 0.0
        d = self._est.cost.decode_step_s(s, k)
        if s and d >= self._est.T:
            return 0.0
        m = self._est.cost.mixed_step_s(c, s, k)
        if s and m > self._est.T:
            m += spacing_s(m, d, self._est.T)
        return c / m

    def hand_off(self, now_s: float, hand: list[_Dev], dec: list[_Dev], mixes: dict, out: list) -> None:
        """Move every decoding sequence of the hand-off devices to a decode-configuration device, and
        close the hand-off windows that are done (module docstring). The destinations' room left
        (``kv``, ``slots``) shrinks by what the moves take."""
        taken: dict[str, list[int]] = {}
        dsts = [dv for dv in dec if not dv.target]
        for dv in hand:
            stuck = False
            for r in dv.st.resident:
                dst = self._destination(r, dsts, mixes, taken)
                if dst is None:
                    stuck = True
                else:
                    out.append(Migrate(r.request_id, dv.st.device_id, dst.st.device_id, HANDOFF))
            if dv.st.role is not Role.PREFILL:
                continue
            idle = (not dv.st.resident and not dv.placed and not dv.q
                    and now_s - self._last_work_s.get(dv.st.device_id, now_s) >= self._est.dwell_s - EPS)
            if stuck or idle:
                out.append(SwitchRole(dv.st.device_id, Role.DECODE, "blocked" if stuck else "drained"))
                self._last_work_s.pop(dv.st.device_id, None)
        for dv in dsts:
            kv, slots, _, _ = taken.get(dv.st.device_id, (0, 0, 0, 0))
            dv.kv -= kv
            dv.slots -= slots

    def _destination(self, r, dsts: list[_Dev], mixes: dict, taken: dict[str, list[int]]) -> _Dev | None:
        """The device of ``dsts`` where resident ``r`` goes: room for it (KV for its expected rest, as
        the fallback's room rule, and a slot) beside what ``taken`` records as taken this round
        (``[blocks, slots, sequences, context tokens]`` per device), then the shortest decode step with
        it, ``d(n + 1, k + ctx)`` (``n``, ``k``: the residents of its ``mixes`` entry, its queued prompts
        and what ``taken`` adds), where that is at most ``T``; it is recorded in ``taken``. None where no
        device has room or keeps pace."""
        best = None
        for dv in dsts:
            kv, slots, n_in, k_in = taken.get(dv.st.device_id, (0, 0, 0, 0))
            need = move_blocks(r, dv.st)
            if need > dv.kv - kv or dv.slots - slots < 1:
                continue
            mix = mixes[dv.st.device_id]
            n = mix.s + dv.qn + n_in
            k = mix.k + dv.q + k_in
            step = self._est.cost.decode_step_s(n + 1, k + r.context_tokens)
            if step > self._est.T + EPS:  # it would not keep pace there, nor would the device's residents
                continue
            if best is None or (step, dv.idx) < best[:2]:
                best = (step, dv.idx, dv, need)
        if best is None:
            return None
        dv, need = best[2], best[3]
        t = taken.setdefault(dv.st.device_id, [0, 0, 0, 0])
        t[0] += need
        t[1] += 1
        t[2] += 1
        t[3] += r.context_tokens
        return dv
