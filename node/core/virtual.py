"""A virtual node on a virtual clock: devices advanced by the cost model, roles set by a policy (pure).

Discrete-event model of time-shared mode for unit tests and the simulator. Each device runs one step
at a time — a prefill step (placed prompts in placement order, chunked under the token budget), a
decode step (one token for every resident sequence), or a role-switch pause — and the step lasts what
:class:`~node.core.cost.CostModel` says. A prompt's first token comes at the end of the step that
finishes its prefill; it then stays resident (its KV on that device) and gains one token per decode
step of that device. After every event the policy sees a :class:`~node.core.roles.NodeSnapshot` and its
decisions are applied: a switch drains the step in flight, then pauses ``pause_s``; a placement queues
the prompt on the device and reserves its blocks.

With ``prefix_caching`` each device's memory is a :class:`~node.core.ledger.BlockLedger` with its
prefix cache, as on the live node: a request carrying its prompt's ``token_ids`` starts, when placed,
from the device's cached blocks of its longest cached prefix (its ``left`` prompt tokens exclude them,
so the policy's queue counts only tokens to compute); blocks are allocated as steps are planned and the
full prompt blocks registered then; a finished request's blocks stay cached (reclaimable). The policy
sees each waiting prompt's cached tokens per device (``WaitingPrompt.cached_tokens``), as the live
driver shows them.
"""

from __future__ import annotations

import math

import msgspec

from node.core.cost import CostModel
from node.core.roofline import RooflineCost
from node.core.ledger import BlockLedger
from node.core.roles import (
    DeviceState, NodeSnapshot, Place, Reject, ResidentSeq, Role, RoleScheduler, SwitchRole, WaitingPrompt,
    blocks_for,
)

__all__ = ["VirtualRequest", "RequestTrace", "StepRecord", "VirtualNode"]

CACHE_LOOKUPS = 64  # waiting prompts (oldest first) whose cached prefix the snapshot shows, as the node's driver


class VirtualRequest(msgspec.Struct, frozen=True):
    """A request to replay: arrival (s), prompt and true output length (tokens).

    ``expected_output_tokens`` is what the policy is told (``None``: the true length); ``token_ids``:
    the prompt's token ids, for the prefix cache (``()``: unknown, never cached).
    """

    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    expected_output_tokens: int | None = None
    token_ids: tuple[int, ...] = ()


class RequestTrace(msgspec.Struct):
    """What happened to one request: its device, and the time of each output token (s)."""

    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    device_id: str | None = None
    token_times_s: list[float] = []
    rejected: bool = False
    cached_tokens: int = 0  # prompt tokens found in the device's prefix cache when placed

    @property
    def done(self) -> bool:
        return len(self.token_times_s) >= self.output_tokens

    @property
    def ttft_s(self) -> float:
        return self.token_times_s[0] - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return self.token_times_s[-1] - self.arrival_s

    @property
    def itls_s(self) -> list[float]:
        t = self.token_times_s
        return [b - a for a, b in zip(t, t[1:])]


class StepRecord(msgspec.Struct, frozen=True):
    """One interval of device time: kind is prefill | decode | pause; tokens computed (0 for pause)."""

    device_id: str
    kind: str
    start_s: float
    end_s: float
    tokens: int = 0


class _Seq:
    __slots__ = ("trace", "expected", "left", "out", "reserve", "ids", "keys", "blocks", "registered")

    def __init__(self, trace: RequestTrace, expected: int, reserve: int, ids: tuple[int, ...] = (),
                 keys: list[bytes] | None = None):
        self.trace = trace
        self.expected = expected
        self.left = trace.prompt_tokens  # prompt tokens not yet prefilled
        self.out = 0
        self.reserve = reserve
        self.ids = ids
        self.keys = [] if keys is None else keys  # cache keys of the prompt's full blocks (memo)
        self.blocks: list[int] | None = None  # block table, with a ledger
        self.registered = 0

    def allocated(self, block_size: int) -> int:
        if self.blocks is not None:
            return len(self.blocks)
        return blocks_for(self.trace.prompt_tokens - self.left + self.out, block_size)


class _VDev:
    def __init__(self, device_id: str, role: Role, total_blocks: int, block_size: int, prefix_caching: bool = False):
        self.device_id = device_id
        self.ledger = BlockLedger(total_blocks, block_size, prefix_caching=True) if prefix_caching else None
        self.role = role
        self.role_since_s = 0.0
        self.switching_to: Role | None = None
        self.switch_done_s: float | None = None
        self.busy_until_s = 0.0
        self.step: tuple[str, list] | None = None
        self.queue: list[_Seq] = []
        self.resident: list[_Seq] = []
        self.total_blocks = total_blocks
        self.block_size = block_size

    def kv_used_and_reserved(self) -> tuple[int, int]:
        used = reserved = 0
        for s in self.queue + self.resident:
            a = s.allocated(self.block_size)
            used += a
            reserved += max(0, s.reserve - a)
        if self.ledger is not None:  # shared blocks count once; reclaimable cached blocks are free
            used = self.ledger.num_used
        return used, reserved

    def grow(self, s: _Seq, tokens: int) -> None:
        """Blocks for ``tokens`` tokens of ``s`` (ledger mode), registering its full prompt blocks."""
        led = self.ledger
        need = blocks_for(tokens, self.block_size) - len(s.blocks)
        if need > 0:
            got = led.allocate(need)
            if got is None:
                raise RuntimeError(f"KV of {self.device_id} exhausted despite the reservations")
            s.blocks.extend(got)
        bs = self.block_size
        full = min(tokens, len(s.ids)) // bs
        if full > s.registered:
            keys = led.keys(s.ids, full, s.keys)
            for i in range(s.registered, full):
                led.register(s.blocks[i], keys[i], keys[i - 1] if i else None, s.ids[i * bs : (i + 1) * bs])
            s.registered = full

    def release(self, s: _Seq) -> None:
        if self.ledger is not None and s.blocks:
            self.ledger.free(s.blocks)
            s.blocks = []


class VirtualNode:
    """Devices on a virtual clock, driven by a :class:`RoleScheduler` and a :class:`CostModel`.

    Args:
        pause_s: true switch pause (s); default the scheduler's estimate.
        initial_role: every device starts in this role at t=0.
        tick_s: clock advance when nothing is scheduled but prompts wait (s).
    """

    def __init__(self, scheduler: RoleScheduler, cost: CostModel | RooflineCost, *, num_devices: int = 1,
                 kv_blocks: int = 1024, block_size: int = 16, pause_s: float | None = None,
                 initial_role: Role = Role.PREFILL, tick_s: float = 1e-3, prefix_caching: bool = False):
        self.scheduler = scheduler
        self.cost = cost
        self.pause_s = scheduler.pause_s if pause_s is None else pause_s
        self.budget = scheduler.config.prefill_token_budget
        self.tick_s = tick_s
        self.devices = [_VDev(f"dev{i}", initial_role, kv_blocks, block_size, prefix_caching)
                        for i in range(num_devices)]
        self._keys: dict[str, list[bytes]] = {}  # request id → its prompt's cache keys (memo)
        self.steps: list[StepRecord] = []
        self.switches: list[tuple[float, str, Role, str]] = []  # (time s, device, to role, reason)
        self.traces: dict[str, RequestTrace] = {}
        self._waiting: list[tuple[VirtualRequest, RequestTrace]] = []

    def snapshot(self, now_s: float) -> NodeSnapshot:
        devs = []
        for d in self.devices:
            used, reserved = d.kv_used_and_reserved()
            devs.append(DeviceState(
                device_id=d.device_id, role=d.role, role_since_s=d.role_since_s, switching_to=d.switching_to,
                switch_done_s=d.switch_done_s, busy_until_s=d.busy_until_s,
                resident=tuple(ResidentSeq(s.trace.request_id, s.trace.token_times_s[0], s.out,
                                           s.trace.prompt_tokens + s.out, s.expected) for s in d.resident),
                prefill_queue_tokens=sum(s.left for s in d.queue), prefill_queue_seqs=len(d.queue),
                kv_free_blocks=d.total_blocks - used,
                kv_reserved_blocks=reserved, kv_total_blocks=d.total_blocks, block_size=d.block_size))
        waiting = tuple(WaitingPrompt(r.request_id, r.prompt_tokens, r.arrival_s,
                                      r.expected_output_tokens or r.output_tokens,
                                      cached_tokens=self._cached(r) if i < CACHE_LOOKUPS else {})
                        for i, (r, _) in enumerate(self._waiting))
        return NodeSnapshot(tuple(devs), waiting)

    def _hits(self, d: _VDev, r: VirtualRequest) -> list[int]:
        if d.ledger is None or not r.token_ids:
            return []
        memo = self._keys.setdefault(r.request_id, [])
        return d.ledger.match(r.token_ids, min(r.prompt_tokens, len(r.token_ids)) - 1, memo)

    def _cached(self, r: VirtualRequest) -> dict[str, int]:
        """Prompt tokens each device's prefix cache holds for ``r`` (as the live driver reports)."""
        out = {}
        for d in self.devices:
            n = len(self._hits(d, r)) * d.block_size
            if n:
                out[d.device_id] = n
        return out

    def run(self, requests: list[VirtualRequest], *, until_s: float = math.inf, max_events: int = 2_000_000,
            on_decide=None) -> dict[str, RequestTrace]:
        """Replay ``requests`` until all finish (or ``until_s``); returns the traces by request id.

        ``on_decide(now_s, snapshot, decisions)`` is called after every policy call (for invariants).
        """
        pending = sorted(requests, key=lambda r: (r.arrival_s, r.request_id))
        for r in pending:
            self.traces[r.request_id] = RequestTrace(r.request_id, r.arrival_s, r.prompt_tokens, r.output_tokens)
        pi = 0
        now = pending[0].arrival_s if pending else 0.0
        for _ in range(max_events):
            for d in self.devices:
                if d.step is not None and d.busy_until_s <= now:
                    self._complete(d)
                if d.role is Role.SWITCHING and d.switch_done_s <= now:
                    d.role, d.role_since_s = d.switching_to, d.switch_done_s
                    d.switching_to = d.switch_done_s = None
            while pi < len(pending) and pending[pi].arrival_s <= now:
                self._waiting.append((pending[pi], self.traces[pending[pi].request_id]))
                pi += 1
            snap = self.snapshot(now)
            decisions = self.scheduler.decide(now, snap)
            if on_decide is not None:
                on_decide(now, snap, decisions)
            self._apply(now, decisions)
            for d in self.devices:
                if d.step is None:
                    self._start(now, d)
            events = [pending[pi].arrival_s] if pi < len(pending) else []
            events += [d.busy_until_s for d in self.devices if d.step is not None]
            events += [d.switch_done_s for d in self.devices if d.role is Role.SWITCHING]
            if not events:
                if not self._waiting:
                    break
                events = [now + self.tick_s]
            now = max(now, min(events))
            if now > until_s:
                break
        else:
            raise RuntimeError("virtual node did not finish within max_events")
        return self.traces

    # --- internals ------------------------------------------------------------------------------
    def _dev(self, device_id: str) -> _VDev:
        return next(d for d in self.devices if d.device_id == device_id)

    def _apply(self, now: float, decisions: list) -> None:
        for dec in decisions:
            if isinstance(dec, SwitchRole):
                d = self._dev(dec.device_id)
                if d.role is Role.SWITCHING:
                    raise RuntimeError(f"switch ordered for {d.device_id}, already switching")
                start = max(now, d.busy_until_s)
                d.role, d.switching_to, d.role_since_s = Role.SWITCHING, dec.to_role, now
                d.switch_done_s = start + self.pause_s
                self.steps.append(StepRecord(d.device_id, "pause", start, d.switch_done_s))
                self.switches.append((now, d.device_id, dec.to_role, dec.reason))
            elif isinstance(dec, Place):
                d = self._dev(dec.device_id)
                if not (d.role is Role.PREFILL or d.switching_to is Role.PREFILL):
                    raise RuntimeError(f"{dec.request_id} placed on {d.device_id}, not in a prefill role")
                i = next(i for i, (r, _) in enumerate(self._waiting) if r.request_id == dec.request_id)
                req, trace = self._waiting.pop(i)
                trace.device_id = d.device_id
                s = _Seq(trace, req.expected_output_tokens or req.output_tokens, dec.reserve_blocks,
                         req.token_ids, self._keys.pop(req.request_id, None))
                if d.ledger is not None:  # start from the cached prefix, referenced from now on
                    hits = self._hits(d, req) if req.token_ids else []
                    if d.ledger.take(hits, 0) is None:
                        hits = []
                    s.blocks, s.registered = list(hits), len(hits)
                    s.left -= len(hits) * d.block_size
                    trace.cached_tokens = len(hits) * d.block_size
                d.queue.append(s)
                used, reserved = d.kv_used_and_reserved()
                if used + reserved > d.total_blocks:
                    raise RuntimeError(f"KV of {d.device_id} over-committed by placing {dec.request_id}")
            elif isinstance(dec, Reject):
                i = next(i for i, (r, _) in enumerate(self._waiting) if r.request_id == dec.request_id)
                self._waiting.pop(i)[1].rejected = True

    def _start(self, now: float, d: _VDev) -> None:
        if d.role is Role.PREFILL and d.queue:
            budget, chunk = self.budget, []
            for s in d.queue:
                if budget <= 0:
                    break
                n = min(s.left, budget)
                chunk.append((s, n))
                budget -= n
                if d.ledger is not None:
                    d.grow(s, s.trace.prompt_tokens - s.left + n)
            tokens = self.budget - budget
            d.step, d.busy_until_s = ("prefill", chunk), now + self.cost.prefill_step_s(tokens)
        elif d.role is Role.DECODE and d.resident:
            batch = list(d.resident)
            ctx = sum(s.trace.prompt_tokens + s.out for s in batch)
            d.step, d.busy_until_s = ("decode", batch), now + self.cost.decode_step_s(len(batch), ctx)
            tokens = len(batch)
        else:
            return
        self.steps.append(StepRecord(d.device_id, d.step[0], now, d.busy_until_s, tokens))

    def _complete(self, d: _VDev) -> None:
        kind, payload = d.step
        t = d.busy_until_s
        d.step = None
        if kind == "prefill":
            for s, n in payload:
                s.left -= n
                if s.left == 0:
                    d.queue.remove(s)
                    self._emit(d, s, t, new=True)
                    if s.out >= s.trace.output_tokens:
                        d.release(s)
        else:
            for s in payload:
                self._emit(d, s, t, new=False)

    def _emit(self, d: _VDev, s: _Seq, t: float, new: bool) -> None:
        s.out += 1
        s.trace.token_times_s.append(t)
        if d.ledger is not None and s.blocks is not None and s.out < s.trace.output_tokens:
            d.grow(s, s.trace.prompt_tokens + s.out)  # as the counted model: the new token's slot
        if new and s.out < s.trace.output_tokens:
            d.resident.append(s)
        elif not new and s.out >= s.trace.output_tokens:
            d.resident.remove(s)
            d.release(s)
