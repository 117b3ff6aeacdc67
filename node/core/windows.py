"""The formulas of the role policy's windows and deadlines (pure): the per-token target, the switch pause,
the decode step of a resident batch, the prefill seconds a window has left, whether a device is in debt,
whether a prompt is urgent, and how long a forced window may last. :class:`~node.core.roles.RoleScheduler`
(the role state machine) decides with them.

Symbols (seconds unless noted): ``T = slo_margin * tpot_slo_ms / 1e3`` the per-token target,
``p = max(reconfig_pause_ms / 1e3, measured)`` the switch pause, ``measured`` the pause measured so far
(:attr:`NodeSnapshot.pause_s <node.core.role_state.NodeSnapshot>`, else the cost model's ``pause_s``),
taken anew at every decision (:meth:`WindowMath.plan_pause`), ``d`` the cost model's decode step
for the device's resident batch, ``Wmax = max_window_ms / 1e3``, ``Wmin = min_window_ms / 1e3``,
``P(n)`` the chunked prefill time of ``n`` prompt tokens (:meth:`CostModel.prefill_s`).

**Deadlines.** A resident sequence whose first token came at ``f`` and which has ``n`` output tokens
owes token ``n+1`` by ``D = f + n*T``. Meeting every ``D`` keeps vLLM's per-request
``TPOT = (E2E - TTFT) / (n - 1)`` at or under ``T``; ``D - now`` is the sequence's TPOT headroom.

**Window budget.** A prefill window whose work can start at ``t0`` (the end of the step in flight, or
of the switch) and which started at ``ws`` has ``R`` seconds of prefill left::

    R = min( min over old seqs     ( D - t0 - p - d,  ws + Wmax - t0 ),
             min over newborn seqs ( f + Wmax - t0 ) )          (R = inf with no resident sequence)

*Old* sequences were resident before the window: the window ends, and the pause back to DECODE and one
decode step complete, before their next deadline. *Newborn* sequences were prefilled in this window:
they wait for the rest of it, so each overruns its target at most once, by at most one window
(``Wmax + p + d``). Placed prompt tokens ``q`` must satisfy ``P(q) <= min(R, Wmax)`` — placement is a
commitment, the window ends only when its placed prompts are prefilled. A placed prompt expecting
``n >= 2`` output tokens, due to be born at ``t0 + P(q)``, also caps what is queued behind it: the
window must end by ``t0 + P(q) + T - p - d + (n - 2)(T - d)``, so its first gap overruns by no more
than its later gaps win back and its TPOT still meets ``T`` (this is per-device policy state, kept
until the device leaves PREFILL). ``d`` counts the batch after the window, newborns included. An
idle device (no resident sequence, nothing queued) takes any one prompt, however long.
"""

from __future__ import annotations

from node.core.cost import CostModel
from node.core.role_state import INF, DeviceState, RoleSchedulerConfig, WaitingPrompt, assured_output, urgent_at
from node.core.roofline import RooflineCost


class _Residents:
    """Aggregates of a device's resident sequences for a window starting at ``ws`` (one pass)."""

    __slots__ = ("n", "ctx", "old_deadline", "newborn_first")

    def __init__(self, st: DeviceState, ws: float, T: float):
        self.n = len(st.resident)
        self.ctx = 0
        self.old_deadline = self.newborn_first = INF
        for s in st.resident:
            self.ctx += s.context_tokens
            if s.first_token_s < ws:
                self.old_deadline = min(self.old_deadline, s.first_token_s + s.output_tokens * T)
            else:
                self.newborn_first = min(self.newborn_first, s.first_token_s)


class WindowMath:
    """The window and deadline estimates of one policy configuration and cost model (see the module
    docstring for the symbols). Raises ``ValueError`` for a configuration the policy cannot run."""

    def __init__(self, config: RoleSchedulerConfig, cost: CostModel | RooflineCost):
        if config.stagger not in ("hard", "soft", "off"):
            raise ValueError(f"stagger must be hard, soft or off (got {config.stagger!r})")
        if not 0 < config.min_window_ms <= config.max_window_ms:
            raise ValueError("need 0 < min_window_ms <= max_window_ms")
        if config.prefill_token_budget < 1:
            raise ValueError("prefill_token_budget must be >= 1")
        self.config = config
        self.cost = cost
        self.T = config.slo_margin * config.tpot_slo_ms / 1e3
        self.wmin = config.min_window_ms / 1e3
        self.wmax = config.max_window_ms / 1e3
        self.plan_pause(None)

    def plan_pause(self, measured_s: float | None) -> None:
        """Set the switch pause ``p`` (and the dwell ``max(Wmin, 2p(1 - s)/s)`` that bounds the pauses'
        share ``s = max_pause_share``) for the next decision: ``max(reconfig_pause_ms / 1e3, m)`` with
        ``m`` the pause measured so far, or the cost model's ``pause_s`` while none is (``None``)."""
        p = self.cost.pause_s if measured_s is None else measured_s
        self.pause_s = max(self.config.reconfig_pause_ms / 1e3, p)
        share = min(max(self.config.max_pause_share, 1e-6), 1.0)
        self.dwell_s = max(self.wmin, 2 * self.pause_s * (1 - share) / share)

    # --- estimates ------------------------------------------------------------------------------
    def prefill_s(self, tokens: int) -> float:
        """Chunked prefill time of ``tokens`` prompt tokens (s)."""
        return self.cost.prefill_s(tokens, self.config.prefill_token_budget)

    def decode_step_s(self, st: DeviceState) -> float:
        """Decode step time of the device's resident batch (s)."""
        return self.cost.decode_step_s(len(st.resident), sum(s.context_tokens for s in st.resident))

    def window_left_s(self, st: DeviceState, t0: float, ws: float, new_seqs: int = 0, new_tokens: int = 0) -> float:
        """Prefill seconds left from ``t0`` in a window that began at ``ws`` (``R`` of the docstring).

        ``d`` is the first decode step after the window: the resident batch plus ``new_seqs`` prompts
        of ``new_tokens`` tokens in all, prefilled in the window.
        """
        return self._window_left(_Residents(st, ws, self.T), t0, ws, new_seqs, new_tokens)

    def _window_left(self, res: _Residents, t0: float, ws: float, new_seqs: int, new_tokens: int) -> float:
        if res.n == 0:
            return INF
        d = self.cost.decode_step_s(res.n + new_seqs, res.ctx + new_tokens + new_seqs)
        r = INF
        if res.old_deadline < INF:
            r = min((res.old_deadline - t0) - self.pause_s - d, self.wmax + (ws - t0))
        if res.newborn_first < INF:
            r = min(r, self.wmax + (res.newborn_first - t0))
        return r

    def in_debt(self, st: DeviceState, now_s: float) -> bool:
        """Some resident sequence cannot get its next token by its deadline even decoding now."""
        d = self.decode_step_s(st)
        return any(s.first_token_s + s.output_tokens * self.T < max(now_s, st.busy_until_s) + d for s in st.resident)

    def urgent(self, w: WaitingPrompt, now_s: float) -> bool:
        """The prompt's age plus its service time reaches ``ttft_urgency`` of the TTFT SLO."""
        return urgent_at(w, now_s, self.pause_s, self.prefill_s(w.prompt_tokens), self.config.ttft_urgency,
                         self.config.ttft_slo_ms)

    def _forced_cap_s(self, st: DeviceState, now_s: float, t0: float) -> float:
        """Longest forced window (s) from ``t0``; -inf when none may open now.

        None may open while a resident sequence is past its deadline (it recovers first), unless
        decode cannot keep up anyway (``d >= T``). Otherwise each sequence with a known expected length
        may overrun by what its remaining gaps win back, ``(remaining - 1) * (T - d)``, so its TPOT
        still meets the target: ``W <= D - t0 - p - d + max(0, remaining - 1) * (T - d)``.
        """
        d = self.decode_step_s(st)
        if d >= self.T:
            return INF
        if self.in_debt(st, now_s):
            return -INF
        cap = INF
        for s in st.resident:
            n = assured_output(s)  # what it surely produces, not the mean: a short one wins nothing back
            if n > 0:
                rem = n - s.output_tokens
                deadline = s.first_token_s + s.output_tokens * self.T
                cap = min(cap, (deadline - t0) - self.pause_s - d + max(0, rem - 1) * (self.T - d))
        return cap
