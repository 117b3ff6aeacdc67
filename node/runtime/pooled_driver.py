"""The shell of pooled (disaggregated) mode: prefill devices, decode devices and decode peers.

Arrivals wait here until :class:`PooledRouter` places them on a (prefill, decode) pair, with the
decode blocks reserved at once. The decode side is this node's ``--decode-devices`` and the healthy
``--peers`` (each seen as one device with the roomiest of its decode devices' free blocks, from its
capacity reports). A prefill device runs prompt-only steps; when a sequence's first token is out, its
KV is handed to its decode target layer by layer — ``DeviceEngine.migrate`` for a local device,
:class:`~node.runtime.peer_links.PeerLinks` over TCP for a peer — and it decodes there while its client's
stream goes on (a peer relays the tokens back).

A node with decode devices only (the far end of a cross-node pair) serves the requests it receives
itself on those devices in mixed steps. A node whose decode side is wholly unreachable fails
requests that waited ``DECODE_WAIT_S`` for it, instead of holding them forever; while one of its
decode devices is being restarted (:mod:`node.runtime.engine_supervisor`) the work waits for it instead.
Prompts go to live prefill devices only; with none live, they wait for one being restarted.
"""

from __future__ import annotations

from typing import Callable

import structlog

from node.core.batcher import StepPlan
from node.core.pooled import PlacePooled, PoolDevice, PooledRouter, PoolSnapshot
from node.core.roles import Reject, WaitingPrompt
from node.log import request_lines
from node.runtime.driver import Driver
from node.runtime.engine import DeviceEngine
from node.runtime.handoff import RETRY_AFTER_S
from node.runtime.peer_state import Peer, is_peer

from node.runtime.interfaces import DriverHost

log = structlog.get_logger("shiftnode.pooled")

DECODE_WAIT_S = 5.0  # once no decode device or peer has been reachable for this long, waiting work fails


class PooledDriver(Driver):
    """Places prompts on device pairs and hands prefilled sequences to their decode device."""

    def __init__(self, node: DriverHost, router: PooledRouter, prefill: list[str], decode: list[str],
                 clock: Callable[[], float]):
        super().__init__(node, clock)
        self.router = router
        self.prefill_ids = prefill
        self.decode_ids = decode
        self.target: dict[str, str] = {}  # request id → its decode device
        self.handing: set[str] = set()  # sequence ids whose transfer is under way
        self.sending: dict[str, str] = {}  # sequence id → prefill device, while its KV is on the way to a peer
        self.unreachable_since: float | None = None  # when the whole decode side was last seen go away
        for d in prefill:
            node.engine(d).step_listeners.append(self._on_prefill_step)

    def finished(self, req, reasons, output_tokens) -> None:
        super().finished(req, reasons, output_tokens)
        self.target.pop(req.request_id, None)

    def recompute(self, req, index: int) -> None:
        """Prefill a sequence again (after a failed peer hand-off) on the least busy prefill device."""
        engines = [self.node.engine(d) for d in self._placeable_prefill_ids()] or [
            self.node.engine(d) for d in self.decode_ids]
        min(engines, key=lambda e: sum(s.num_uncomputed for s in e.batcher.waiting)).add_seq(req, index)

    def _peer_device(self, p: Peer) -> PoolDevice:
        """A peer as one decode device: its roomiest device's free blocks, less what we promised it."""
        st = p.status
        bound = list(self._requests_bound_to(p.id))
        return PoolDevice(device_id=p.id, kv_free_blocks=st.max_device_free_blocks,
                          kv_reserved_blocks=sum(self.reserve.get(r.request_id, 0) for r in bound),
                          kv_total_blocks=max(1, st.max_device_total_blocks), block_size=self.node.config.block_size,
                          seq_slots_free=st.seq_slots_free - sum(len(r.seqs) for r in bound))

    def _device(self, device_id: str, decode_side: bool) -> PoolDevice:
        e = self.node.engine(device_id)
        led = e.batcher.ledger
        held = sum(1 for r in e.requests.values() for s in r.seqs if s.device_id == device_id)
        held += sum(1 for d in self.sending.values() if d == device_id)  # detached, still unsent until committed
        reserved_seqs = sum(len(r.seqs) for r in self._requests_bound_to(device_id)) if decode_side else 0
        queued = sum(s.num_uncomputed for s in e.batcher.waiting) + sum(
            s.num_uncomputed for s in e.batcher.running if not s.is_decoding)
        # Prefill side: blocks that queued prompts will take when admitted; decode side: reservations.
        reserved = self._decode_reserved(device_id) if decode_side else sum(
            led.blocks_for(s.num_uncomputed) for s in e.batcher.waiting)
        return PoolDevice(device_id=device_id, kv_free_blocks=led.num_free, kv_reserved_blocks=reserved,
                          kv_total_blocks=led.num_blocks, block_size=led.block_size, queued_tokens=queued,
                          inflight_seqs=held, seq_slots_free=e.batcher.config.max_num_seqs - held - reserved_seqs,
                          outgoing_tokens=0 if decode_side else e.outgoing_tokens)

    def _requests_bound_to(self, device_id: str):
        """Requests placed with ``device_id`` as decode device whose sequences have not all arrived."""
        for e_id in self.prefill_ids:
            for r in self.node.engine(e_id).requests.values():
                if self.target.get(r.request_id) == device_id:
                    yield r

    def _decode_reserved(self, device_id: str) -> int:
        """Blocks promised on a decode device: whole reservations of requests still on their prefill
        device, and the unallocated rest of those already here."""
        waiting = sum(self.reserve.get(r.request_id, 0) for r in self._requests_bound_to(device_id))
        return waiting + self.reserved_on(device_id)

    def tick(self) -> None:
        now = self.clock()
        peers = self.node.peers.healthy(now) if self.node.peers else []
        if not self.prefill_ids:  # a decode-only node serves its own arrivals on its decode devices
            for req in list(self.pending):
                self.pending.remove(req)
                self.node.least_loaded(self.decode_ids).add(req)
            return
        decode_ids = self._live_decode_ids()  # a down device takes nothing
        if not decode_ids and not peers:
            if self.unreachable_since is None:
                self.unreachable_since = now
                log.warning("no_decode_peer_reachable", peers=self.node.peers.unusable(now)[1] if self.node.peers else None)
            # (not while a decode device is being restarted: the work waits for it, within its deadline)
            if now - self.unreachable_since > DECODE_WAIT_S and not self._decode_coming_back():
                self._fail_stranded()
        elif self.unreachable_since is not None:
            log.info("decode_peer_reachable_again", after_s=round(now - self.unreachable_since, 3))
            self.unreachable_since = None
        snap = PoolSnapshot(
            prefill=tuple(self._device(d, False) for d in self._placeable_prefill_ids()),
            decode=tuple(self._device(d, True) for d in decode_ids) + tuple(self._peer_device(p) for p in peers),
            waiting=tuple(WaitingPrompt(r.request_id, len(r.prompt_ids) * len(r.seqs), r.stats.arrival_s,
                                        self.expected_output(r) * len(r.seqs), seqs=len(r.seqs),
                                        cached_tokens=self.cached_tokens(r, i, self.prefill_ids + self.decode_ids),
                                        priority=r.params.priority)
                          for i, r in enumerate(self.pending)),
        )
        by_id = {r.request_id: r for r in self.pending}
        for d in self.router.decide(snap):
            req = by_id.pop(d.request_id, None)
            if req is None:
                continue
            self.pending.remove(req)
            if isinstance(d, Reject):
                req.fail(f"request cannot be served: {d.reason} (its prompt times n, plus one token, must fit "
                         f"one device's KV cache even when empty)", status=400, code="kv_capacity_exceeded")
            elif isinstance(d, PlacePooled):
                self.reserve[req.request_id] = d.decode_blocks
                self.target[req.request_id] = d.decode_device
                self.node.engine(d.prefill_device).add(req)
        for d in self.prefill_ids:
            self._hand_off(self.node.engine(d))

    def _on_prefill_step(self, engine: DeviceEngine, plan: StepPlan, seconds: float) -> None:
        self._hand_off(engine)
        self.kick()

    def _hand_off(self, engine: DeviceEngine) -> None:
        """Start the transfer of every prefilled sequence on a prefill device to its decode target."""
        for seq in list(engine.batcher.running):
            req = engine.requests[seq.request_id]
            if not seq.is_decoding or seq.seq_id in self.handing or req.cancelled:
                continue
            dst = self.target.get(seq.request_id)
            if dst is None:
                continue
            self.handing.add(seq.seq_id)
            if is_peer(dst):
                peer = self._peer_for(dst, len(seq.block_ids) + 1)
                if peer is None:
                    self.handing.discard(seq.seq_id)
                    continue  # no peer can take it now: it waits here (bounded by --max-unsent)
                self.target[seq.request_id] = peer.id
                self.sending[seq.seq_id] = engine.device_id
                self.node.peers.hand_off(engine, req, seq, peer, "pooled",
                                         settled=lambda ok, sid=seq.seq_id: self._handed(sid, ok))
            else:
                if self.node.engine(dst).failure is not None:  # its decode device died: another one, or 503
                    dst = self._retarget(req, seq, engine)
                    if dst is None:
                        self.handing.discard(seq.seq_id)
                        continue
                fut = engine.migrate(seq, self.node.engine(dst), "pooled", overlap=True)  # the prefill device goes on
                fut.add_done_callback(lambda f, sid=seq.seq_id: self._handed(
                    sid, not f.cancelled() and f.exception() is None and f.result() is not None))

    def _retarget(self, req, seq, engine: DeviceEngine) -> str | None:
        """A new decode device for a prefilled sequence whose target went down: the live one with the
        most free blocks after reservations that holds the sequence and its reservation; else a healthy
        peer that fits (the target becomes the peer, and the next round hands it off over the peer path:
        a restart takes seconds, and it may die again); else it waits here (bounded by ``--max-unsent``
        and the request's deadline) while a decode device is live or being restarted, and otherwise the
        request fails (503 ``engine_down``) and leaves the prefill device. None: not handed now."""
        live = self._live_decode_ids()
        room = {d: self.node.engine(d).batcher.ledger.num_free - self._decode_reserved(d) for d in live}
        best = max(live, key=room.__getitem__, default=None)
        if best is not None and room[best] >= max(self.reserve.get(req.request_id, 0), len(seq.block_ids) + 1):
            self.target[req.request_id] = best
            log.warning("handoff_retargeted", request=req.request_id, to=best)
            return best
        peer = self._peer_for("", len(seq.block_ids) + 1) if self.node.peers else None
        if peer is not None:
            self.target[req.request_id] = peer.id
            log.warning("handoff_retargeted", request=req.request_id, to=peer.id)
            self.kick()
        elif not live and not self._decode_coming_back():
            req.fail("every decode device is down", status=503, code="engine_down", retry_after_s=RETRY_AFTER_S)
            engine.abort(req.request_id)
        return None

    def _decode_coming_back(self) -> bool:
        """Whether a decode device of this node is down with its restart planned or under way."""
        return any(self.node.supervisor.coming_back(d) for d in self.decode_ids)

    def _placeable_prefill_ids(self) -> list[str]:
        """The prefill devices work may be placed on: the live ones. With none live while one is being
        restarted, none: prompts wait for it (within their deadline) instead of failing on a dead device that
        looks idle (nothing queued). With none coming back, all: a down device fails what it is given (503)."""
        live = [d for d in self.prefill_ids if self.node.engine(d).failure is None]
        if live or any(self.node.supervisor.coming_back(d) for d in self.prefill_ids):
            return live
        return self.prefill_ids

    def _live_decode_ids(self) -> list[str]:
        return [d for d in self.decode_ids if self.node.engine(d).failure is None]

    def unsent_to_peers(self) -> int:
        """Prefilled sequences on the prefill devices waiting for a peer to take their KV (not yet
        being sent): the ``unsent`` stage of ``shiftnode_remote_kv_waiting_requests``."""
        n = 0
        for d in self.prefill_ids:
            e = self.node.engine(d)
            for seq in e.batcher.running:
                if seq.is_decoding and seq.seq_id not in self.handing and is_peer(self.target.get(seq.request_id)):
                    n += 1
        return n

    def _peer_for(self, wanted: str, need_blocks: int) -> Peer | None:
        """The peer the router chose if it is healthy, else the roomiest healthy peer that fits."""
        healthy = [p for p in self.node.peers.ready(self.clock())
                   if p.status.max_device_free_blocks >= need_blocks and p.status.seq_slots_free > 0]
        for p in healthy:
            if p.id == wanted:
                return p
        return max(healthy, key=lambda p: p.status.max_device_free_blocks, default=None)

    def _handed(self, seq_id: str, moved: bool) -> None:
        self.handing.discard(seq_id)
        self.sending.pop(seq_id, None)
        if not moved and request_lines():
            log.info("handoff_deferred", seq=seq_id)  # retried on the next tick
        self.kick()

    def _fail_stranded(self) -> None:
        """No decode device and no peer reachable for ``DECODE_WAIT_S``: fail the waiting prompts and
        the prefilled sequences that cannot be handed off with 503 (``peer_refused`` when every peer
        was refused, else ``peer_unavailable``), naming each peer's state and reason; a node without
        peers whose own decode devices are all down says so (``engine_down``, each device's failure)."""
        down = "; ".join(f"{d}: {self.node.engine(d).failure}" for d in self.decode_ids)
        if self.node.peers is None or not self.node.peers.peers:
            code = "engine_down" if self.decode_ids else "peer_unavailable"
            why = f"every decode device is down ({down})" if self.decode_ids else "no decode device and no peers"
        else:
            code, states = self.node.peers.unusable(self.clock())
            why = f"no decode peer reachable for {DECODE_WAIT_S:.0f} s: {states}" + (
                f"; every decode device of this node is down ({down})" if down else "")
        for req in list(self.pending):
            self.pending.remove(req)
            req.fail(why, status=503, code=code, retry_after_s=RETRY_AFTER_S)
        for d in self.prefill_ids:
            e = self.node.engine(d)
            for req in list(e.requests.values()):
                if any(s.is_decoding and s.seq_id not in self.handing for s in req.seqs):
                    req.fail(why, status=503, code=code, retry_after_s=RETRY_AFTER_S)
                    e.abort(req.request_id)
