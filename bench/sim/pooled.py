"""Pooled (disaggregated) mode: the node's own router over prefill and decode devices, on a virtual clock.

Placement is :class:`node.core.pooled.PooledRouter` — the object the node's ``PooledDriver`` runs —
fed the same :class:`~node.core.pooled.PoolSnapshot` the driver builds: arrivals wait (FIFO) until the
router places each on a (prefill device, decode device) pair and reserves its decode blocks (prompt +
expected output, the expected output being the node's ``min(max_tokens, running estimate)``
(:class:`node.core.output_estimate.OutputEstimator`, fed by the requests that ended by EOS, as the node's
``PooledDriver``), or the true length with ``expected_output="oracle"``); prefill devices take at
most ``max_unsent`` prompts in flight plus unsent caches.

Prefill devices run PREFILL steps. When a sequence's first token is out (its TTFT) it is handed to its
decode device: the destination allocates the blocks, the KV (``kv_bytes_per_token`` x cached tokens)
crosses a link, then the source frees its blocks and the destination adopts the sequence. Decode
devices run MIXED steps, as the node's role-less decode engines do (decode, and recompute of a
sequence they had to preempt).

Links (each a FIFO queue; a transfer takes ``bytes x 8 / (gbps x copy_rate x 1e9)`` s, :func:`node.plan.transfer_s`,
``copy_rate`` the assumed share of the line rate a copy gets, and the steps that start on either end while it
runs last ``1 + copy_slowdown`` times their cost: :class:`bench.sim.config.SimConfig`):

* inside a node: the source device's link at ``link_gbps``;
* between nodes (``pool_scope="cluster"``): the source device's network link and the destination
  device's, both at ``internode_gbps``; the transfer starts when both are free and holds both.

With ``prefix_caching`` every device keeps the node's prefix cache: the router is shown each waiting
prompt's cached tokens per device (the live driver's ``WaitingPrompt.cached_tokens``), a prefill device
computes only what its cache lacks, and a decode device reuses its own cached prefix of the sequence
and receives only the blocks after it (``kv_bytes_per_token`` x the tokens after it).

``transfer="overlap"`` (the node's behaviour: ``DeviceEngine.migrate(overlap=True)`` copies beside the
prefill device's later steps) lets the prefill device go on while the link works, one cache after
another; ``transfer="blocking"`` keeps it from stepping while it sends (its steps in flight drain
first), as the node did before its copies overlapped. Inside a node a copy also waits for the
destination's steps in flight when its blocks were taken, as the node's does.

Scopes: ``pool_scope="node"`` simulates one node (its ``num_prefill_devices`` first devices prefill,
the rest decode); ``"cluster"`` one pool over ``nodes`` nodes, the first ``num_prefill_nodes`` of
which prefill on every device while the others decode, with one router over all of them (a global
router: an idealisation of prefill nodes that each place onto every decode node).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import islice

from bench.sim.batched import SimDevice, client_bound, new_sequence, new_trace, output_length
from bench.sim.config import SimAborted, SimConfig, count_late
from bench.traffic.traces import TraceRequest
from node.core.batcher import StepKind
from node.core.cost import CostModel
from node.core.roofline import RooflineCost
from node.core.output_estimate import OutputEstimator
from node.core.pooled import PlacePooled, PoolDevice, PooledRouter, PoolSnapshot
from node.core.roles import Reject, WaitingPrompt
from node.core.sequence import Sequence
from bench.sim.trace import RequestTrace
from node.plan import transfer_s

__all__ = ["simulate_pooled", "link_plan"]

ROUTER_BATCH = 64  # waiting prompts shown to the router per call (it stops at the first it cannot place)


@dataclass
class _Placed:
    seq: Sequence
    src: SimDevice
    dst: SimDevice
    reserve: int
    arrived: bool = False
    queued: bool = False  # waiting for its transfer


@dataclass
class _Transfer:
    placed: _Placed
    src_blocks: list[int]
    dst_blocks: list[int]
    nbytes: int
    end_s: float


def link_plan(src: SimDevice, dst: SimDevice, cfg: SimConfig) -> tuple[list[str], float]:
    """``(links the transfer holds, their rate in Gb/s)``: the source device's link inside a node, the
    two devices' network links between nodes."""
    if src.node == dst.node:
        return [f"link:{src.device_id}"], cfg.link_gbps
    return [f"nic:{src.device_id}", f"nic:{dst.device_id}"], cfg.internode_gbps


class _Pool:
    def __init__(self, cfg: SimConfig, cost: CostModel | RooflineCost, nodes: int, layout=None):
        self.cfg, self.cost = cfg, cost
        # Prefill instances at another degree (bench.sim.parallel.PoolLayout): their own model and blocks.
        self.front_cost = cost if layout is None else layout.prefill_cost
        front_blocks = None if layout is None else layout.prefill_blocks
        self.front: list[SimDevice] = []
        self.back: list[SimDevice] = []
        for n in range(nodes):
            for i in range(cfg.devices):
                if cfg.pool_scope == "cluster":
                    prefill = n < cfg.num_prefill_nodes
                else:
                    prefill = i < cfg.num_prefill_devices
                dev = SimDevice(f"n{n}/dev{i}" if nodes > 1 else f"dev{i}",
                                StepKind.PREFILL if prefill else StepKind.MIXED, cfg, node=n,
                                kv_blocks=front_blocks if prefill else None)
                (self.front if prefill else self.back).append(dev)
        self.devices = self.front + self.back
        self.router = PooledRouter(cfg.max_unsent)
        self.traces: dict[str, RequestTrace] = {}
        self.waiting: deque[tuple[str, TraceRequest]] = deque()  # arrived, not yet placed
        self.placed: dict[str, _Placed] = {}
        self.held = {d.device_id: 0 for d in self.devices}  # prefill: sequences placed and not yet handed off
        self.bound = {d.device_id: [0, 0] for d in self.back}  # decode: [blocks, seqs] of placed, not arrived
        self.resident_reserve: dict[str, int] = {}  # request id → reservation, once on its decode device
        self.handoffs = {d.device_id: deque() for d in self.front}
        self.flying: list[_Transfer] = []
        self.link_free: dict[str, float] = {}
        self.transfers = 0
        self.transfer_bytes = 0
        self.transfer_s = 0.0
        self._views: dict[str, tuple[int, PoolDevice]] = {}  # device id → (its version, its view)
        self._seqs: dict[str, Sequence] = {}  # waiting request id → its sequence (token ids, key memo)
        self._blocked_at: tuple | None = None  # state in which the router last placed nothing more
        self.outputs = OutputEstimator()  # the node's running output estimate, fed by EOS ends

    # --- the router's view, as node.runtime.pooled_driver.PooledDriver._device builds it -----------
    def _view(self, d: SimDevice, decode_side: bool) -> PoolDevice:
        """The device's view, cached until the device (or, decode side, its bound work) changes."""
        key = d.version if not decode_side else (d.version, *self.bound[d.device_id])
        got = self._views.get(d.device_id)
        if got is not None and got[0] == key:
            return got[1]
        view = self._decode_view(d) if decode_side else self._prefill_view(d)
        self._views[d.device_id] = (key, view)
        return view

    def _prefill_view(self, d: SimDevice) -> PoolDevice:
        b, led = d.batcher, d.batcher.ledger
        queued = (sum(s.num_uncomputed for s in b.waiting)
                  + sum(s.num_uncomputed for s in b.running if not s.is_decoding))
        reserved = sum(led.blocks_for(s.num_uncomputed) for s in b.waiting)
        held = self.held[d.device_id]
        outgoing = (sum(p.seq.num_computed for p in self.handoffs[d.device_id])
                    + sum(t.placed.seq.num_computed for t in self.flying if t.placed.src is d))
        return PoolDevice(device_id=d.device_id, kv_free_blocks=led.num_free, kv_reserved_blocks=reserved,
                          kv_total_blocks=led.num_blocks, block_size=led.block_size, queued_tokens=queued,
                          inflight_seqs=held, seq_slots_free=b.config.max_num_seqs - held, outgoing_tokens=outgoing)

    def _decode_view(self, d: SimDevice) -> PoolDevice:
        b, led = d.batcher, d.batcher.ledger
        seqs = b.running + b.waiting
        rest = sum(max(0, self.resident_reserve.get(s.request_id, 0) - len(s.block_ids)) for s in seqs)
        blocks, nseqs = self.bound[d.device_id]
        return PoolDevice(device_id=d.device_id, kv_free_blocks=led.num_free, kv_reserved_blocks=blocks + rest,
                          kv_total_blocks=led.num_blocks, block_size=led.block_size, queued_tokens=0,
                          inflight_seqs=len(seqs), seq_slots_free=b.config.max_num_seqs - len(seqs) - nseqs)

    def _expected(self, r: TraceRequest) -> int:
        if self.cfg.expected_output == "oracle":
            return output_length(r, self.cfg)[0]
        return self.outputs.expected(client_bound(r, self.cfg)[0])

    def _state(self) -> tuple:
        return (self.waiting[0][0] if self.waiting else None,
                tuple(d.version for d in self.devices), tuple(self.held.values()))

    def place(self) -> None:
        """Ask the router to place waiting prompts (skipped when nothing changed since it last could not)."""
        if self._blocked_at is not None and self._blocked_at == self._state():
            return
        by_id = {d.device_id: d for d in self.devices}
        while self.waiting:
            head = list(islice(self.waiting, ROUTER_BATCH))
            snap = PoolSnapshot(tuple(self._view(d, False) for d in self.front),
                                tuple(self._view(d, True) for d in self.back),
                                tuple(WaitingPrompt(rid, r.prompt_tokens, r.arrival_s, self._expected(r),
                                                    cached_tokens=self._cached(rid, r))
                                      for rid, r in head))
            decisions = self.router.decide(snap)
            reqs = dict(head)
            for dec in decisions:
                r = reqs[dec.request_id]
                self.waiting.remove((dec.request_id, r))
                if isinstance(dec, Reject):
                    self.traces[dec.request_id].rejected = True
                elif isinstance(dec, PlacePooled):
                    src, dst = by_id[dec.prefill_device], by_id[dec.decode_device]
                    seq = self._seqs.pop(dec.request_id, None) or new_sequence(dec.request_id, r, self.cfg)
                    self.placed[dec.request_id] = _Placed(seq, src, dst, dec.decode_blocks)
                    self.held[src.device_id] += 1
                    self.bound[dst.device_id][0] += dec.decode_blocks
                    self.bound[dst.device_id][1] += 1
                    src.batcher.add(seq)
                    src.version += 1
            if len(decisions) < len(head):
                self._blocked_at = self._state()
                return
        self._blocked_at = None

    def _cached(self, rid: str, r: TraceRequest) -> dict[str, int]:
        """Prompt tokens each device's prefix cache holds for a waiting request (none with caching off)."""
        if not self.cfg.prefix_caching:
            return {}
        seq = self._seqs.get(rid)
        if seq is None:
            seq = self._seqs[rid] = new_sequence(rid, r, self.cfg)
        out = {}
        for d in self.devices:
            n = len(d.batcher.cached_prefix(seq)) * d.batcher.ledger.block_size
            if n:
                out[d.device_id] = n
        return out

    def _unbind(self, p: _Placed) -> None:
        self.held[p.src.device_id] -= 1
        self.bound[p.dst.device_id][0] -= p.reserve
        self.bound[p.dst.device_id][1] -= 1

    # --- tokens and hand-offs ---------------------------------------------------------------------
    def on_tokens(self, dev: SimDevice, seqs: list[Sequence], now_s: float) -> None:
        for seq in seqs:
            tr = self.traces[seq.request_id]
            if tr.done:  # a token of a step planned before its EOS was seen: discarded, as live
                continue
            tr.token_times_s.append(now_s)
            if tr.device_id is None:
                tr.device_id = dev.device_id
            p = self.placed[seq.request_id]
            if tr.done:
                if tr.ends_by_eos:
                    self.outputs.observe(len(tr.token_times_s))
                dev.batcher.remove(seq)
                dev.version += 1
                if p.arrived:
                    self.resident_reserve.pop(seq.request_id, None)
                else:
                    self._unbind(p)
                del self.placed[seq.request_id]
            elif dev.kind is StepKind.PREFILL and not p.queued:
                p.queued = True
                self.handoffs[dev.device_id].append(p)

    def _send(self, p: _Placed, now_s: float) -> bool:
        """Start one transfer if its destination can take the blocks now (else it is retried later)."""
        seq, src, dst = p.seq, p.src, p.dst
        if seq not in src.batcher.running or not seq.is_decoding:
            return False
        led = dst.batcher.ledger  # its own cached prefix of the sequence stays; the rest is sent
        hits = led.match(seq.token_ids, seq.num_computed, seq.block_keys)[: len(seq.block_ids) - 1]
        new = led.take(hits, len(seq.block_ids) - len(hits))
        if new is None:
            return False
        dst_blocks = hits + new
        src_blocks = src.batcher.release(seq)
        src.version += 1
        dst.version += 1
        nbytes = self.cfg.kv_bytes_per_token * (seq.num_computed - len(hits) * led.block_size)
        links, gbps = link_plan(src, dst, self.cfg)
        start = max([now_s] + [self.link_free.get(k, 0.0) for k in links])
        if src.node == dst.node:  # the node's copy waits for the destination's steps in flight (DeviceEngine.migrate)
            start = max(start, dst.last_end_s)
        end = start + transfer_s(nbytes, gbps * self.cfg.copy_rate)  # SimConfig.copy_rate of the line rate
        for k in links:
            self.link_free[k] = end
        for d in (src, dst):  # the steps beside the copy slow down (SimConfig.copy_slowdown)
            d.copy_until_s = max(d.copy_until_s, end)
        self.flying.append(_Transfer(p, src_blocks, dst_blocks, nbytes, end))
        self.transfers += 1
        self.transfer_bytes += nbytes
        self.transfer_s += end - start
        return True

    def start_transfers(self, now_s: float) -> None:
        blocking = self.cfg.transfer == "blocking"
        for d in self.front:
            q = self.handoffs[d.device_id]
            if blocking and (d.plan is not None or d.sending):
                continue  # the node copies at the device's step boundary, one cache at a time
            for p in list(q):
                if self._send(p, now_s):
                    q.remove(p)
                    if blocking:
                        d.sending = True
                        break

    def land_transfers(self, now_s: float) -> None:
        for t in [t for t in self.flying if t.end_s <= now_s]:
            self.flying.remove(t)
            p = t.placed
            p.src.batcher.ledger.free(t.src_blocks)
            p.src.sending = False
            p.seq.block_ids = t.dst_blocks
            p.dst.batcher.adopt(p.seq)
            p.src.version += 1
            p.dst.version += 1
            p.arrived = True
            self._unbind(p)
            self.resident_reserve[p.seq.request_id] = p.reserve

    # --- the event loop ---------------------------------------------------------------------------
    def run(self, requests: list[tuple[str, TraceRequest]]) -> None:
        pending = sorted(requests, key=lambda x: (x[1].arrival_s, x[0]))
        for rid, r in pending:
            self.traces[rid] = new_trace(rid, r, self.cfg)
        i = 0
        now = pending[0][1].arrival_s if pending else 0.0
        t_end = now + self.cfg.max_sim_s
        blocking = self.cfg.transfer == "blocking"
        while True:
            for d in self.devices:
                while d.busy_until_s <= now:
                    self.on_tokens(d, d.complete(), now)
            self.land_transfers(now)
            while i < len(pending) and pending[i][1].arrival_s <= now:
                self.waiting.append(pending[i])
                i += 1
            if self.waiting:
                self.place()
            self.start_transfers(now)
            for d in self.front:
                if not (blocking and self.handoffs[d.device_id]):  # a queued blocking copy drains the device
                    d.start(now, self.front_cost)
            for d in self.back:
                d.start(now, self.cost)
            if self.cfg.abort_late is not None:
                self._check_late(now)
            events = [pending[i][1].arrival_s] if i < len(pending) else []
            events += [d.busy_until_s for d in self.devices if d.plan is not None]
            events += [t.end_s for t in self.flying]
            if not events:
                break  # nothing can move: what is left never finishes (counted as failed)
            now = max(now, min(events))
            if now > t_end:
                break

    def _check_late(self, now_s: float) -> None:
        slo_s, limit = self.cfg.ttft_slo_ms / 1e3, self.cfg.abort_late
        late = count_late((r.arrival_s for _, r in self.waiting), now_s, slo_s, limit)
        late += sum(count_late((q.arrival_s for q in d.batcher.waiting), now_s, slo_s, limit) for d in self.front)
        if late >= limit:
            raise SimAborted(f"{limit} requests waited past the TTFT SLO")

    def stats(self) -> dict:
        return {"switches": 0, "pause_s": 0.0, "busy_s": {d.device_id: d.busy_s for d in self.devices},
                "transfers": self.transfers, "transfer_bytes": self.transfer_bytes,
                "transfer_s": self.transfer_s, "preemptions": sum(d.batcher.num_preemptions for d in self.devices),
                "cached_tokens": sum(d.batcher.prefix_hit_tokens for d in self.front)}


def simulate_pooled(requests: list[TraceRequest], cfg: SimConfig, cost: CostModel | RooflineCost, prefix: str = "r",
                    nodes: int = 1, layout=None) -> tuple[list[RequestTrace], dict]:
    """Replay ``requests`` on one pool of ``nodes`` nodes; ``(traces in request order, stats)``.

    With ``pool_scope="node"`` call it once per node (``nodes=1``); with ``"cluster"`` once for all.
    ``layout`` (a :class:`bench.sim.parallel.PoolLayout`): the prefill instances' own cost model and
    KV blocks, when they run at another degree than the decode instances (``cost``, ``cfg.kv_blocks``).
    """
    pool = _Pool(cfg, cost, nodes, layout)
    ids = [f"{prefix}{i}" for i in range(len(requests))]
    pool.run(list(zip(ids, requests)))
    return [pool.traces[i] for i in ids], pool.stats()
