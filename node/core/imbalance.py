"""Imbalance fallback of time-shared mode: which decoding sequences move to which device (pure policy).

In time-shared mode a sequence decodes on the device that prefilled it. Two situations make that
costly; in both the fallback moves the sequence's KV to another device (the shell's
``DeviceEngine.migrate``: blocks allocated on the receiver first, copied layer by layer in logical
order, position counter unchanged), where it goes on decoding while its client's stream continues.
:meth:`ImbalancePolicy.decide` takes ``now_s`` and a :class:`NodeSnapshot` and returns
:class:`Migrate` decisions; it keeps no state (the cooldown reads ``ResidentSeq.moved_s``) and imports
only the standard library and msgspec, like :mod:`node.core.roles`.

Symbols (seconds unless noted), as in :mod:`node.core.roles`: ``T = slo_margin * tpot_slo_ms / 1e3``
the per-token target; ``p = max(reconfig_pause_ms / 1e3, measured)`` the switch pause (``measured``:
the snapshot's measured pause, else ``cost.pause_s``, as the role scheduler's);
``P(q)`` the chunked prefill time of ``q`` prompt tokens; ``d(n, k) = cost.decode_step_s(n, k)`` the
decode step of ``n`` sequences holding ``k`` context tokens. A resident sequence whose first token came
at ``f`` and which has ``m`` output tokens owes its next token by ``D = f + m*T``.

**Trigger "tpot"** (a prefill window would make sequences miss their target). A *source* is a device
in the PREFILL role, or switching to it, that holds decoding sequences. Its window starts at ``t0``
(PREFILL: ``max(now, busy_until)``; switching: the end of the pause), must prefill the ``q`` queued
prompt tokens (``qn`` prompts) placed on it, then pays the pause back to DECODE and one decode step::

    t_src = t0 + P(q) + p + d(n + qn, k + q + qn)        (n, k: the source's residents and context)

A resident with ``D < t_src`` is *late*. Late sequences (earliest deadline first) move to the
*destination* — a device in the DECODE role or switching to it — whose next decode step, the moved
sequence included, ends first::

    t_dst = s_dst + d(n_dst + 1, k_dst + k_seq)          (s_dst: max(now, busy_until), or the pause end)

provided ``t_dst < t_src`` (it is served sooner), ``d(n_dst + 1, k_dst + k_seq) <= T`` (the destination
keeps pace for everything it holds) and the destination has room (below). The copy inside the node,
``c = k_seq * local_transfer_s_per_token`` (the KV bytes at the node's ``--link-gbps``; 0 when copies are
unthrottled), is added to ``t_dst``; and since the source runs no step while it copies, its window
waits: local moves are made only while their copies, all together, leave the source's oldest queued
prompt its first token within the TTFT SLO (``oldest + ttft_slo >= t0 + P(q) + sum c``), and only when
the move pays for the queueing its copy causes (``ImbalancePolicy._tpot_pays``).
None is made while a waiting prompt is urgent (:func:`~node.core.role_state.urgent_at`): a device fed newborns
(no stall budget) stays in DECODE, its prefill lost to the queue; unmoved, a newborn waits out its birth window.

**Trigger "imbalance"** (decode loads across devices differ past ``threshold``). Among DECODE-role
devices holding sequences, the *load* of a device is its estimated decode step ``L = d(n, k)`` (s) —
the time per token of every sequence on it — and the imbalance is ``L_max / L_min - 1`` (dimensionless;
``L_min = 0`` counts as infinite). While it exceeds ``threshold``, one sequence moves from the most to
the least loaded device: the one whose move gives the smallest ``max(L_src', L_dst')``, and only if that
is below ``L_max`` (a strict improvement; a move that only swaps which device is the heavy one is never
made) and it pays: the sequence-time it saves over the moved sequence's remaining ``r`` steps exceeds
its copy ``c`` times every resident the copy stalls on both devices plus the destination's slower steps
(:meth:`ImbalancePolicy.move_pays`; moves to peers are not charged so: their network send does not hold
the source's steps). With ``threshold = 1`` sequences
move once the slowest decoding device's step is more than twice the fastest's. Since a fixed part of
the step (the weight read) is paid whatever the batch, small batches rarely differ that much; the
trigger matters when KV reads (context) dominate the step.

**Room.** A destination takes a sequence only when its free blocks minus its reservations cover
``max(blocks(k_seq + 1), min(blocks(k_seq + r), total))`` — the next token at least, and the
sequence's expected remaining output ``r = expected - m`` when known — and it has a free sequence slot.
Earlier moves of the same round count against both.

**Hysteresis.** A sequence that moved (or whose move was refused) less than ``cooldown_ms`` ago does not
move again; at most ``max_moves`` moves per round (both triggers together); the imbalance trigger fires
only past the threshold and each of its moves leaves both devices it touches below the old largest
load, so with loads standing still the loads sorted in decreasing order fall lexicographically with each
move: the moves end, and no placement comes back.

**Peer nodes.** ``decide`` may also be given peers (``--peers``), each as a DECODE-role
:class:`DeviceState` standing for the peer's roomiest device (its residents describe that device's
batch). Peers come after every device of the node. *tpot*: a peer takes a late sequence only when no
device of this node can serve it in time; its ``t_dst`` adds the transfer over the link,
``peer_overhead_ms / 1e3 + k_seq * transfer_s_per_token`` (connection, handshake and the first relayed
token; and the KV bytes at the link rate), to the peer's decode step. *imbalance*: after the node's own
devices are balanced, sequences move from the node's most loaded DECODE device to the least loaded
peer under the same rule (past the threshold, strictly lowering the larger load); an idle peer's load
is its fixed step ``d(0, 0)``, so it takes work only when the node's step is ``1 + threshold`` times that.

``threshold = 0`` turns the fallback off (:meth:`ImbalancePolicy.decide` returns nothing).

**Drain.** :meth:`ImbalancePolicy.drain` (an operator's ``POST /v1/node/drain``, before the node is
stopped) moves every decoding sequence of the node to the peer whose step with it is shortest, room
permitting, whatever the threshold.
"""

from __future__ import annotations

import math

import msgspec

from node.core.cost import CostModel
from node.core.roofline import RooflineCost
from node.core.role_state import Migrate, move_blocks, urgent_at
from node.core.roles import DeviceState, NodeSnapshot, ResidentSeq, Role

__all__ = ["Migrate", "ImbalanceConfig", "ImbalancePolicy"]  # Migrate: the decision (node.core.role_state)

INF = math.inf
EPS = 1e-9  # s; float slack in time comparisons


_DECODING = (Role.DECODE, Role.MIXED)  # roles whose steps decode every resident


class ImbalanceConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Knobs of the fallback (ms, tokens). ``threshold``: the imbalance ``L_max / L_min - 1`` past which
    sequences move (0: fallback off); the role knobs are the role scheduler's, so both see the same
    ``T``, ``p`` and ``P``."""

    threshold: float = 1.0
    tpot_slo_ms: float = 100.0
    slo_margin: float = 0.9
    reconfig_pause_ms: float = 0.0
    prefill_token_budget: int = 2048
    max_moves: int = 32  # per decision round, both triggers together
    cooldown_ms: float = 1000.0  # a sequence that moved stays at least this long
    transfer_s_per_token: float = 0.0  # s per context token to a peer: KV bytes per token * 8 / link bit rate
    local_transfer_s_per_token: float = 0.0  # s per context token to another device of this node (0: free)
    ttft_slo_ms: float = 1000.0  # the role scheduler's: how long a copy may hold a source's prefill window
    peer_overhead_ms: float = 5.0  # per move to a peer: connection, handshake, the relay's first token
    ttft_urgency: float = 0.5  # the role scheduler's: a waiting prompt this far into its TTFT SLO is urgent


class _Dev:
    """Working state of one device during a round (residents and room after the moves planned so far)."""

    __slots__ = ("st", "idx", "res", "n", "ctx", "kv", "slots", "local")

    def __init__(self, st: DeviceState, idx: int, local: bool = True):
        self.st = st
        self.idx = idx
        self.local = local  # a device of this node (not a peer node)
        self.res: list[ResidentSeq] = list(st.resident)
        self.n = len(st.resident)
        self.ctx = sum(s.context_tokens for s in st.resident)
        self.kv = st.kv_free_blocks - st.kv_reserved_blocks
        self.slots = st.seq_slots_free

    @property
    def prefill_side(self) -> bool:
        st = self.st
        return st.role is Role.PREFILL or (st.role is Role.SWITCHING and st.switching_to is Role.PREFILL)

    @property
    def decode_side(self) -> bool:
        st = self.st
        # MIXED (the adaptive policy) decodes every step, as DECODE does
        return st.role in _DECODING or (st.role is Role.SWITCHING and st.switching_to in _DECODING)


class ImbalancePolicy:
    """The fallback policy (see the module docstring). ``cost`` may be replaced as the node refits it."""

    def __init__(self, config: ImbalanceConfig, cost: CostModel | RooflineCost):
        if config.threshold < 0:
            raise ValueError("threshold must be >= 0 (0 turns the fallback off)")
        if config.prefill_token_budget < 1:
            raise ValueError("prefill_token_budget must be >= 1")
        self.config = config
        self.cost = cost
        self.T = config.slo_margin * config.tpot_slo_ms / 1e3
        self.cooldown_s = config.cooldown_ms / 1e3
        self.measured_pause_s: float | None = None  # the last snapshot's (NodeSnapshot.pause_s)

    @property
    def pause_s(self) -> float:
        p = self.cost.pause_s if self.measured_pause_s is None else self.measured_pause_s
        return max(self.config.reconfig_pause_ms / 1e3, p)

    def deadline_s(self, s: ResidentSeq) -> float:
        """When the sequence owes its next token: ``f + m*T`` (s)."""
        return s.first_token_s + s.output_tokens * self.T

    def load_s(self, n: int, ctx: int) -> float:
        """Decode step of ``n`` sequences holding ``ctx`` context tokens (s), never negative."""
        return max(0.0, self.cost.decode_step_s(n, ctx))

    def need_blocks(self, s: ResidentSeq, dst: DeviceState) -> int:
        """Free blocks a destination must have for ``s``: its next token, and its expected rest
        (:func:`node.core.role_state.move_blocks`)."""
        return move_blocks(s, dst)

    def window_end_s(self, st: DeviceState, now_s: float) -> float:
        """When a prefill-side device's window has prefilled its queue, ``t0 + P(q)`` (s)."""
        if st.role is Role.PREFILL:
            t0 = max(now_s, st.busy_until_s)
        else:
            t0 = max(now_s, st.switch_done_s if st.switch_done_s is not None else now_s + self.pause_s)
        return t0 + self.cost.prefill_s(st.prefill_queue_tokens, self.config.prefill_token_budget)

    def source_next_token_s(self, st: DeviceState, now_s: float) -> float:
        """``t_src``: when a resident of a prefill-side device gets its next token (s)."""
        n = len(st.resident) + st.prefill_queue_seqs
        k = sum(s.context_tokens for s in st.resident) + st.prefill_queue_tokens + st.prefill_queue_seqs
        return self.window_end_s(st, now_s) + self.pause_s + self.load_s(n, k)

    def _decode_start_s(self, st: DeviceState, now_s: float) -> float:
        if st.role in _DECODING:
            return max(now_s, st.busy_until_s)
        return max(now_s, st.switch_done_s if st.switch_done_s is not None else now_s + self.pause_s)

    def _movable(self, s: ResidentSeq, now_s: float, planned: set[str]) -> bool:
        return s.request_id not in planned and (s.moved_s is None or now_s - s.moved_s >= self.cooldown_s)

    def _fits(self, dst: _Dev, s: ResidentSeq) -> int:
        """Blocks ``s`` takes on ``dst``, or -1 when ``dst`` has no room for it."""
        need = self.need_blocks(s, dst.st)
        return need if need <= dst.kv and dst.slots >= 1 else -1

    @staticmethod
    def _move(s: ResidentSeq, src: _Dev, dst: _Dev, need: int, reason: str, planned: set[str],
              out: list[Migrate]) -> None:
        out.append(Migrate(s.request_id, src.st.device_id, dst.st.device_id, reason))
        planned.add(s.request_id)
        src.res.remove(s)
        src.n -= 1
        src.ctx -= s.context_tokens
        dst.res.append(s)
        dst.n += 1
        dst.ctx += s.context_tokens
        dst.kv -= need
        dst.slots -= 1

    def move_pays(self, s: ResidentSeq, n_src: int, hi: float, after: float, n_dst: int, lo: float,
                  dst_after: float) -> bool:
        """Whether moving ``s`` from a source of ``n_src`` residents (step ``hi`` before, ``after`` without
        ``s``) to a destination of ``n_dst`` (step ``lo`` before, ``dst_after`` with ``s``) saves more
        sequence-time than it costs (s; the cost-aware rule of issue 27: a fallback that may not cost
        goodput). Over the ``r = max(1, expected - output)`` steps left to ``s``::

            saved = r * ((n_src - 1) * (hi - after) + (hi - dst_after))     every other source resident's
                                                                             step is shorter; s's own too
            cost  = r * n_dst * (dst_after - lo) + c * (n_src + n_dst)      every destination resident's
                                                                             step is longer; and the copy
                                                                             ``c = k_seq * local_transfer``
                                                                             stalls both devices' residents
                                                                             (and s) for ``c``

        The move is made only if ``saved > cost``. The rule before charged the source's saving per step
        against one copy, ``(hi - after) * r > c``: it ignored that every resident of both devices waits
        the copy out and that the destination's residents slow down, so with a busy destination it moved
        sequences that cost the node more queueing than they saved."""
        r = max(1, s.expected_output_tokens - s.output_tokens)
        c = s.context_tokens * self.config.local_transfer_s_per_token
        saved = r * ((n_src - 1) * (hi - after) + (hi - dst_after))
        cost = r * n_dst * (dst_after - lo) + c * (n_src + n_dst)
        return saved > cost + EPS

    # --- the decision ---------------------------------------------------------------------------
    def decide(self, now_s: float, snapshot: NodeSnapshot, peers: tuple[DeviceState, ...] = ()) -> list[Migrate]:
        """Moves for this instant, ``tpot`` ones first (apply in order; each may be refused). ``peers``:
        peer nodes as DECODE-role devices (see the module docstring), tpot destinations of last resort."""
        self.measured_pause_s = snapshot.pause_s
        if self.config.threshold <= 0 or self.config.max_moves <= 0 or len(snapshot.devices) + len(peers) < 2:
            return []
        devs = [_Dev(st, i) for i, st in enumerate(snapshot.devices)]
        remote = [_Dev(st, len(devs) + i, local=False) for i, st in enumerate(peers)]
        out: list[Migrate] = []
        planned: set[str] = set()
        c = self.config  # no local tpot move while a waiting prompt is urgent (module doc)
        local = [] if any(urgent_at(w, now_s, self.pause_s, self.cost.prefill_s(w.prompt_tokens, c.prefill_token_budget),
                                    c.ttft_urgency, c.ttft_slo_ms) for w in snapshot.waiting) else [dv for dv in devs if dv.decode_side]
        self._tpot(now_s, devs, local, remote, planned, out)
        self._balance(now_s, devs, remote, planned, out)
        return out

    def drain(self, now_s: float, snapshot: NodeSnapshot, peers: tuple[DeviceState, ...]) -> list[Migrate]:
        """Moves of every decoding sequence to a peer (reason ``drain``), up to ``max_moves`` a round;
        a sequence that fits no peer now stays for a later round."""
        devs = [_Dev(st, i) for i, st in enumerate(snapshot.devices)]
        remote = [_Dev(st, len(devs) + i, local=False) for i, st in enumerate(peers)]
        out: list[Migrate] = []
        planned: set[str] = set()
        for src in devs:
            for s in sorted(src.res, key=lambda s: (s.first_token_s, s.request_id)):
                if len(out) >= self.config.max_moves:
                    return out
                if not self._movable(s, now_s, planned):
                    continue
                fits = [(self.load_s(dst.n + 1, dst.ctx + s.context_tokens), dst.idx, dst, need)
                        for dst in remote if (need := self._fits(dst, s)) >= 0]
                if fits:
                    _, _, dst, need = min(fits, key=lambda x: x[:2])
                    self._move(s, src, dst, need, "drain", planned, out)
        return out

    def _tpot(self, now_s: float, devs: list[_Dev], local: list[_Dev], remote: list[_Dev], planned: set[str],
              out: list[Migrate]) -> None:
        if not local and not remote:
            return
        for src in devs:
            if not src.prefill_side or not src.res:
                continue
            t_src = self.source_next_token_s(src.st, now_s)
            late = sorted((s for s in src.res if self.deadline_s(s) < t_src - EPS and self._movable(s, now_s, planned)),
                          key=lambda s: (self.deadline_s(s), s.request_id))
            # a copy inside the node holds the source (its window waits): only as long as its oldest
            # queued prompt still gets its first token within the TTFT SLO
            oldest = src.st.prefill_queue_oldest_s
            slack = INF if oldest is None else oldest + self.config.ttft_slo_ms / 1e3 - self.window_end_s(src.st, now_s)
            for s in late:
                if len(out) >= self.config.max_moves:
                    return
                copy_s = s.context_tokens * self.config.local_transfer_s_per_token
                pays = self._tpot_pays(src, s, t_src, copy_s)
                best = (self._soonest(s, local, t_src, now_s, copy_s, pays) if copy_s <= slack + EPS else None) or self._soonest(
                    s, remote, t_src, now_s, self.config.peer_overhead_ms / 1e3 + s.context_tokens * self.config.transfer_s_per_token)
                if best is not None:
                    if best[2].local:
                        slack -= copy_s
                    self._move(s, src, best[2], best[3], "tpot", planned, out)

    def _tpot_pays(self, src: _Dev, s: ResidentSeq, t_src: float, c: float):
        """The cost-aware rule for a ``tpot`` move of ``s`` off prefill-side ``src`` with a local copy of
        ``c`` s: a predicate of (destination, its step with ``s``, ``t_dst``). Over the ``r`` steps left
        to ``s``, with ``n``/``qn`` the source's residents/queued prompts and ``m`` the destination's::

            saved = (t_src - t_dst) + r * (n - 1 + qn) * dsrc    s's token sooner; after the window the
                                                                 source's steps are shorter by dsrc
            cost  = c * (n - 1 + qn + m) + r * m * ddst          the window (its residents and prompts)
                                                                 and the destination's residents wait the
                                                                 copy; the destination's steps grow by ddst

        The old rule moved every late sequence a destination served sooner: on the 4 x H200 crossover
        (8B wide prompts) its moves cut adaptive's SLO attainment from 0.89 to 0.56."""
        st = src.st
        r = max(1, s.expected_output_tokens - s.output_tokens)
        n, qn = src.n, st.prefill_queue_seqs
        k = src.ctx + st.prefill_queue_tokens + qn
        dsrc = self.load_s(n + qn, k) - self.load_s(n + qn - 1, k - s.context_tokens)

        def pays(dst: _Dev, step: float, t_dst: float) -> bool:
            ddst = step - self.load_s(dst.n, dst.ctx)
            saved = (t_src - t_dst) + r * (n - 1 + qn) * dsrc
            cost = c * (n - 1 + qn + dst.n) + r * dst.n * ddst
            return saved > cost + EPS
        return pays

    def _soonest(self, s: ResidentSeq, dsts: list[_Dev], t_src: float, now_s: float,
                 transfer_s: float, pays=None) -> tuple[float, int, _Dev, int] | None:
        """The destination whose next step with ``s`` ends first, if before ``t_src`` and within ``T``
        (and, given ``pays``, only one the move pays for)."""
        best: tuple[float, int, _Dev, int] | None = None
        for dst in dsts:
            need = self._fits(dst, s)
            if need < 0:
                continue
            step = self.load_s(dst.n + 1, dst.ctx + s.context_tokens)
            t_dst = self._decode_start_s(dst.st, now_s) + transfer_s + step
            if step > self.T + EPS or t_dst >= t_src - EPS or (pays is not None and not pays(dst, step, t_dst)):
                continue
            if best is None or (t_dst, dst.idx) < best[:2]:
                best = (t_dst, dst.idx, dst, need)
        return best

    def _balance(self, now_s: float, devs: list[_Dev], remote: list[_Dev], planned: set[str],
                 out: list[Migrate]) -> None:
        """Local DECODE devices first; then, while the node's most loaded one still exceeds the least
        loaded peer past the threshold, towards peers (an idle peer counts with its fixed step)."""
        def local_pool() -> list[_Dev]:
            return [dv for dv in devs if dv.st.role in _DECODING and dv.n > 0]

        while len(out) < self.config.max_moves:
            pool = local_pool()
            if len(pool) < 2 or not self._balance_step(now_s, pool, pool, planned, out):
                break
        while remote and len(out) < self.config.max_moves:
            if not self._balance_step(now_s, local_pool(), remote, planned, out):
                return

    def _balance_step(self, now_s: float, srcs: list[_Dev], dsts: list[_Dev], planned: set[str],
                      out: list[Migrate]) -> bool:
        """One move from the most loaded of ``srcs`` to the least loaded of ``dsts``, if it is past
        the threshold and the move strictly lowers the larger of the two loads. True if it moved."""
        if not srcs or not dsts:
            return False
        load = {dv.idx: self.load_s(dv.n, dv.ctx) for dv in srcs + dsts}
        src = max(srcs, key=lambda dv: (load[dv.idx], -dv.idx))
        dst = min(dsts, key=lambda dv: (load[dv.idx], dv.idx))
        hi, lo = load[src.idx], load[dst.idx]
        if src is dst or hi <= (1.0 + self.config.threshold) * lo + EPS:
            return False
        best: tuple[float, int, str, ResidentSeq, int] | None = None
        for s in src.res:
            if not self._movable(s, now_s, planned):
                continue
            need = self._fits(dst, s)
            if need < 0:
                continue
            after = self.load_s(src.n - 1, src.ctx - s.context_tokens)
            peak = max(after, self.load_s(dst.n + 1, dst.ctx + s.context_tokens))
            if peak >= hi - EPS:
                continue
            if dst.local and not self.move_pays(s, src.n, hi, after, dst.n, lo, self.load_s(dst.n + 1, dst.ctx + s.context_tokens)):
                continue  # the copy and the queueing it causes outweigh the step time the move saves
            key = (peak, s.context_tokens, s.request_id, s, need)
            if best is None or key[:3] < best[:3]:
                best = key
        if best is None:
            return False
        self._move(best[3], src, dst, best[4], "imbalance", planned, out)
        return True
