"""KV hand-off between nodes over TCP: the sending side (:class:`PeerLinks`) and the receiving side
(:class:`KVReceiver`), both on the node's event loop, both built on :mod:`node.transport`.

A hand-off of one decoding sequence (the node that owns the client's HTTP stream is the *origin*):

1. the origin's device detaches the sequence at a step boundary; its blocks stay pinned;
2. a fresh connection to the peer (HMAC handshake, layout and fingerprint check) offers the sequence with
   ``relay=True``; the peer reserves blocks before the first byte or refuses;
3. layers stream in order (gathered in the device's worker thread, CRC-checked on arrival, scattered
   into the reserved blocks in the peer's worker thread);
4. after ``TransferCommitted`` the origin frees its blocks and the peer decodes the sequence in its
   continuous batch; the same connection carries the tokens back, and the origin feeds them through
   the choice's own output state, so the client's stream goes on with no gap and no duplicate.

Failures: refused or failed before the commit → the sequence goes back to its device with its own
blocks (nothing lost). The relay breaking after the commit (the peer or the link died) → the origin
recomputes the prompt plus every token already streamed on a local device, counted against
``--max-retries``; past it the choice ends with an error (503 ``peer_unavailable``). A peer that
can never take the sequence (e.g. a shorter context) ends it at once (503 ``peer_refused``, with the
peer's reason). The client leaving closes the connection, which makes the peer drop the sequence.
Every wait is bounded by ``--kv-connect-timeout-s`` / ``--kv-transfer-timeout-s``; timeouts are
counted by stage in ``shiftnode_kv_timeouts_total``. One hand-off on the sending side, and who frees a
detached sequence's pinned blocks on each path (a cancel at any point included), is
:class:`~node.runtime.handoff.HandOff`.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import suppress
from typing import TYPE_CHECKING, AsyncIterator, Callable

import msgspec
import structlog

from node.core.roles import Role, blocks_for
from node.core.sequence import SamplingParams, Sequence
from node.runtime.engine import DeviceEngine
from node.runtime.handoff import RETRY_AFTER_S, HandOff, why  # noqa: F401 - RETRY_AFTER_S re-exported
from node.config import RELAY_KEEPALIVE_S
from node.runtime.request import RequestState
from node.runtime.peer_state import (READY, REFUSED, InboundRefusals, Peer, is_peer, peer_id,  # noqa: F401 - re-exported
                                     split_addr)
from node.transport import (KVClient, KVServer, Layout, PeerRefused, ReceiveReport, SeqState, TransferOffer,
                            timeout_stage)
from node.transport.protocol import RelayEnd, StatusReply, TokenRelay
from node.worker.sampler import TokenLogprobs

if TYPE_CHECKING:
    from node.runtime.node import Node

log = structlog.get_logger("shiftnode.peers")

STATUS_POLL_S = 0.05  # how often each peer's capacity is asked for
RECONNECT_S = 0.5  # pause before reconnecting a peer's control connection
REFUSED_RETRY_S = 2.0  # pause before asking a refused peer again (it may restart with the right model)


def lp_to_wire(lp: TokenLogprobs | None) -> list | None:
    return None if lp is None else [lp.token_id, lp.logprob, [list(t) for t in lp.top]]


class PeerLinks:
    """The sending side: capacity polling of every peer node and sequence hand-offs to them.

    Peers start as ``--peers`` and change at run time with :meth:`add` / :meth:`remove`
    (``POST /v1/node/peers``). Each peer keeps a control connection that is re-opened after any
    failure (resolving its hostname again, so a peer that restarts, on the same address or behind a
    name that moved, is found again) and polled for capacity every ``STATUS_POLL_S``.

    Args:
        node: the origin node (its engines, driver, metrics and config).
        layout: this node's KV layout and fingerprint; a peer with another is refused in the handshake.
    """

    def __init__(self, node: "Node", layout: Layout):
        cfg = node.config
        self.node = node
        self.layout = layout
        self.secret = cfg.peer_secret or ""
        self.link_gbps = cfg.link_gbps
        self.stale_s = cfg.peer_stale_s
        self.peers: dict[str, Peer] = {}
        self._pollers: dict[str, asyncio.Task] = {}  # peer id → its poller
        self._started = False
        for addr in cfg.peers:
            self.add(addr)
        self.tasks: dict[str, set[asyncio.Task]] = {}  # request id → its hand-off tasks
        self.retries: dict[str, int] = {}  # sequence id → recomputes after failed hand-offs
        self.sending: set[str] = set()  # sequence ids whose hand-off is not yet settled
        self.nixl = None  # --kv-transport nixl: the node's NixlPlane (hand-offs load each peer's agent)

    # --- the peer set ---------------------------------------------------------------------------
    def add(self, addr: str) -> bool:
        """Start using the peer at ``host:port``; False when it is already one. Raises ValueError."""
        host, port = split_addr(addr)
        addr = f"{host}:{port}"
        if peer_id(addr) in self.peers:
            return False
        p = Peer(addr, host, port)
        self.peers[p.id] = p
        if self._started:
            self._start_poller(p)
        log.info("peer_added", peer=addr)
        return True

    def remove(self, addr: str) -> bool:
        """Stop placing on the peer at ``host:port`` (hand-offs and relays under way go on to their
        end); False when it is not one. Raises ValueError for a malformed address."""
        host, port = split_addr(addr)
        p = self.peers.pop(peer_id(f"{host}:{port}"), None)
        if p is None:
            return False
        task = self._pollers.pop(p.id, None)
        if task is not None:
            task.cancel()
        log.info("peer_removed", peer=p.addr)
        self._kick()
        return True

    def start(self) -> None:
        self._started = True
        for p in self.peers.values():
            self._start_poller(p)

    def _start_poller(self, p: Peer) -> None:
        self._pollers[p.id] = asyncio.get_running_loop().create_task(self._poll(p), name=f"peer-{p.addr}")

    async def close(self) -> None:
        tasks = list(self._pollers.values()) + [t for ts in self.tasks.values() for t in ts]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def healthy(self, now: float) -> list[Peer]:
        """Peers whose capacity report is fresh, who accept transfers and were not refused (placement targets)."""
        return [p for p in self.peers.values() if p.state(now, self.stale_s)[0] == READY]

    def ready(self, now: float) -> list[Peer]:
        """Healthy peers not held back after a refusal or a failure (hand-off targets now)."""
        return [p for p in self.healthy(now) if now >= p.hold_until]

    def unusable(self, now: float) -> tuple[str, str]:
        """Why no peer can be used now: (``peer_refused`` when every peer was refused, else
        ``peer_unavailable``; each peer's state and reason, for a client's error message)."""
        states = [(p.addr, *p.state(now, self.stale_s)) for p in self.peers.values()]
        if not states:
            return "peer_unavailable", "no peers configured"
        code = "peer_refused" if all(s == REFUSED for _, s, _ in states) else "peer_unavailable"
        return code, "; ".join(f"{a} {s}" + (f" ({r})" if r else "") for a, s, r in states)

    async def connect(self, peer: Peer, **kw) -> KVClient:
        """A fresh, authenticated connection to ``peer`` with the configured timeouts."""
        cfg = self.node.config
        return await KVClient.connect(
            peer.host, peer.port, self.secret, node_id=cfg.name, layout=self.layout,
            connect_timeout_s=cfg.kv_connect_timeout_s, handshake_timeout_s=cfg.kv_connect_timeout_s,
            accept_timeout_s=cfg.kv_transfer_timeout_s, stall_timeout_s=cfg.kv_transfer_timeout_s,
            commit_timeout_s=cfg.kv_transfer_timeout_s, **kw)

    def refused(self, peer: Peer, e: PeerRefused) -> None:
        """A handshake with ``peer`` was refused (by it or by us): counted, logged when new, shown."""
        reason = str(e)
        peer.refusals += 1
        peer.status = None
        self.node.metrics.peer_refusals.labels(reason=e.code, direction="outbound").inc()
        if peer.refusal != (e.code, reason):
            log.warning("peer_refused", peer=peer.addr, code=e.code, reason=reason)
        peer.refusal = (e.code, reason)
        self._kick()

    def timed_out(self, e: BaseException, side: str = "sender") -> None:
        stage = timeout_stage(e)
        if stage is not None:
            self.node.metrics.kv_timeouts.labels(stage=stage, side=side).inc()

    async def _poll(self, peer: Peer) -> None:
        """Keep a control connection to ``peer`` and refresh its capacity every ``STATUS_POLL_S``."""
        while True:
            client = None
            pause = RECONNECT_S
            try:
                peer.asking, peer.asked_s = "the connection and handshake", time.monotonic()
                client = await self.connect(peer, heartbeat_interval_s=None)
                if peer.refusal is not None or peer.error is not None:
                    log.info("peer_connected", peer=peer.addr, peer_node=client.peer_node_id)
                peer.refusal, peer.error, peer.node_id, peer.timed_out = None, None, client.peer_node_id, False
                while True:
                    peer.asking, peer.asked_s = "a capacity query", time.monotonic()
                    peer.status = await client.query_status(timeout_s=self.stale_s)
                    peer.status_s, peer.asking = time.monotonic(), None
                    self._kick()
                    await asyncio.sleep(STATUS_POLL_S)
            except asyncio.CancelledError:
                raise
            except PeerRefused as e:
                self.refused(peer, e)
                pause = REFUSED_RETRY_S
            except Exception as e:  # noqa: BLE001 - any failure (uvloop raises RuntimeError on a closed transport): reconnect
                self.timed_out(e)
                stalled = timeout_stage(e) is not None  # it took the connection but did not answer in time
                if peer.error is None:
                    log.warning("peer_stalled" if stalled else "peer_unreachable", peer=peer.addr, error=why(e))
                peer.status, peer.refusal, peer.error, peer.timed_out = None, None, why(e), stalled
                self._kick()
            finally:
                peer.asking = None
                if client is not None:
                    with suppress(Exception):
                        await client.close()
            await asyncio.sleep(pause)

    def _kick(self) -> None:
        if self.node.driver is not None:
            self.node.driver.kick()

    # --- hand-off (node.runtime.handoff) ---------------------------------------------------------
    status_poll_s, reconnect_s = STATUS_POLL_S, RECONNECT_S  # how long a peer is held back after a refusal / failure

    def seq_state(self, req: RequestState, seq: Sequence) -> SeqState:
        """What the peer needs to continue ``seq`` (durations, not clock readings)."""
        now = time.monotonic()
        return SeqState(request_id=req.request_id, seq_id=seq.seq_id, index=seq.index, token_ids=list(seq.token_ids),
                        prompt_len=seq.prompt_len, num_computed=seq.num_computed, max_len=seq.max_len,
                        sampling=msgspec.structs.asdict(seq.params), age_s=max(0.0, now - seq.arrival_s),
                        first_token_age_s=None if seq.first_token_s is None else max(0.0, now - seq.first_token_s),
                        num_preemptions=seq.num_preemptions)

    def hand_off(self, engine: DeviceEngine, req: RequestState, seq: Sequence, peer: Peer, reason: str,
                 settled: Callable[[bool], None] | None = None) -> asyncio.Task:
        """Start moving decoding ``seq`` from ``engine`` to ``peer`` (see the module docstring and
        :class:`~node.runtime.handoff.HandOff`, which owns the sequence's pinned blocks until they are
        freed or given back on every path, a cancel included).

        ``settled(committed)`` is called once the transfer is decided: True when the peer committed
        (the task then relays the tokens until the sequence ends), False when the sequence stayed
        here (back on ``engine``, or dropped). The task returns whether the peer committed.
        """
        self.sending.add(seq.seq_id)

        def settle(committed: bool) -> None:
            self.sending.discard(seq.seq_id)
            if settled is not None:
                settled(committed)

        task = HandOff(self, engine, req, seq, peer, reason, settle).start()
        self.tasks.setdefault(req.request_id, set()).add(task)
        task.add_done_callback(lambda t, rid=req.request_id: self._forget(rid, t))
        return task

    def _forget(self, request_id: str, task: asyncio.Task) -> None:
        ts = self.tasks.get(request_id)
        if ts is not None:
            ts.discard(task)
            if not ts:
                del self.tasks[request_id]

    def cancel(self, request_id: str) -> None:
        """The client left: stop its hand-offs and relays (the peers drop their copies)."""
        for t in list(self.tasks.get(request_id, ())):
            t.cancel()


class KVReceiver:
    """The receiving side: a :class:`KVServer` on ``--kv-port`` whose callbacks reserve blocks on a
    decode-capable device, write arriving layers into them, adopt the sequence into that device's
    continuous batch and relay its tokens back to the origin."""

    def __init__(self, node: "Node", layout: Layout):
        cfg = node.config
        self.node = node
        self.layout = layout
        # transfer id → (device, reserved blocks, how many of them are its own cached prefix: not received)
        self.incoming: dict[str, tuple[DeviceEngine, list[int], int]] = {}
        self.relayed = 0
        self.refused = InboundRefusals()
        self._nixl = None
        self.server = KVServer(cfg.kv_host or cfg.host, cfg.kv_port or 0, cfg.peer_secret or "", layout,
                               reserve=self._reserve_for_offer, on_layer=self._on_layer, on_done=self._on_done,
                               on_abort=self._on_abort, status=self._status, check=self._check,
                               on_refused=self._on_refused, on_timeout=self._on_timeout, node_id=cfg.name,
                               relay_keepalive_s=RELAY_KEEPALIVE_S, handshake_timeout_s=cfg.kv_connect_timeout_s,
                               stall_timeout_s=cfg.kv_transfer_timeout_s, reply_timeout_s=cfg.kv_transfer_timeout_s)

    @property
    def nixl(self):
        return self._nixl

    @nixl.setter
    def nixl(self, plane) -> None:
        """The node's NixlPlane (set before :meth:`start`): offers may then be written over NIXL."""
        self._nixl = plane
        self.server.nixl, self.server.nixl_info = plane.agent, plane.info

    def _reserve_for_offer(self, offer: TransferOffer):
        got = self._reserve(offer)
        return got if self._nixl is None else self._nixl.reserve(offer, got, self.incoming, self._on_abort)

    def _on_refused(self, peer: str, peer_node_id: str, code: str, reason: str) -> None:
        """A node's connection to our KV port was refused (by us or by it): counted and kept for
        ``GET /v1/node`` and ``/health`` (the log line is the server's ``kv_peer_rejected``)."""
        self.node.metrics.peer_refusals.labels(reason=code, direction="inbound").inc()
        self.refused.record(peer, peer_node_id, code, reason, time.monotonic())

    def _on_timeout(self, stage: str) -> None:
        self.node.metrics.kv_timeouts.labels(stage=stage, side="receiver").inc()

    @property
    def port(self) -> int:
        return self.server.port

    async def start(self) -> None:
        await self.server.start()

    async def close(self) -> None:
        await self.server.close()

    def _decode_engines(self) -> list[DeviceEngine]:
        """Devices that may decode a sequence from a peer: pooled mode's decode devices; in time-shared
        and adaptive modes every device, those in the decode configuration (DECODE, MIXED) first."""
        cfg = self.node.config
        if cfg.mode == "pooled":
            return [self.node.engine(d) for d in cfg.decode_group_ids()]
        return sorted(self.node.engines, key=lambda e: e.role is None or e.role.role not in (Role.DECODE, Role.MIXED))

    def _room(self, e: DeviceEngine) -> tuple[int, int]:
        """(free blocks after this node's own reservations, free sequence slots) of a device."""
        held = len(e.batcher.running) + len(e.batcher.waiting)
        reserved = self.node.driver.reserved_on(e.device_id) if self.node.driver else 0
        return e.batcher.ledger.num_free - reserved, e.batcher.config.max_num_seqs - held

    def _status(self, n: int) -> StatusReply:
        engines = self._decode_engines()
        rooms = [self._room(e) for e in engines]
        open_ = [(f, e) for (f, s), e in zip(rooms, engines) if s > 0]
        best = max(open_, key=lambda x: x[0], default=(0, None))
        decoding = [s for s in best[1].batcher.running if s.is_decoding] if best[1] is not None else []
        return StatusReply(
            n=n, kv_free_blocks=sum(max(0, f) for f, _ in rooms),
            kv_total_blocks=sum(e.batcher.ledger.num_blocks for e in engines),
            max_device_free_blocks=max(0, best[0]),
            max_device_total_blocks=max((e.batcher.ledger.num_blocks for e in engines), default=0),
            seq_slots_free=sum(max(0, s) for _, s in rooms), accepting=bool(engines),
            decode_seqs=len(decoding), decode_context_tokens=sum(s.num_computed for s in decoding))

    def _check(self, offer: TransferOffer) -> list[str]:
        if offer.seq.max_len > self.node.max_model_len:
            return [f"the sequence may grow to {offer.seq.max_len} tokens, past this node's --max-model-len "
                    f"{self.node.max_model_len}"]
        return []

    def _reserve(self, offer: TransferOffer) -> tuple[list[int], int] | None:
        """Blocks for the sequence's cached tokens plus its next one, or None: on the device with the
        most free blocks plus blocks of the sequence's prefix it already caches (those it reuses in
        place and is not sent; Dynamo's overlap-against-load rule, in blocks). Returns the blocks and
        how many leading ones are cached."""
        st = offer.seq
        need = blocks_for(st.num_computed + 1, self.layout.block_size)
        # At least the last block travels (every layer carries one block or more).
        reusable = min(st.num_computed, (offer.num_blocks - 1) * self.layout.block_size)
        best = None
        for e in self._decode_engines():
            free, slots = self._room(e)
            hits = len(e.cached_blocks_of(st.token_ids, reusable))
            if slots > 0 and free >= need and (best is None or free + hits > best[0]):
                best = (free + hits, e)
        if best is None:
            return None
        e = best[1]
        blocks, reused = e.reserve_for(st.token_ids, reusable, offer.num_blocks)
        if blocks is None:
            return None
        self.incoming[offer.transfer_id] = (e, blocks, reused)
        return blocks, reused

    async def _on_layer(self, tid: str, layer: int, data: bytearray) -> None:
        from node.transport.tensors import scatter_layer_bytes

        e, blocks, reused = self.incoming[tid]
        await e.in_worker(scatter_layer_bytes, data, self.layout, e.runner.kv_cache, layer, blocks[reused:])

    def _on_abort(self, tid: str, reason: str) -> None:
        entry = self.incoming.pop(tid, None)
        if entry is not None:  # freed behind any layer write still queued on the worker
            entry[0].free_pinned(entry[1])

    def _on_done(self, tid: str, report: ReceiveReport) -> AsyncIterator:
        e, blocks, _ = self.incoming.pop(tid)
        st = report.offer.seq
        node = self.node
        params = msgspec.convert(st.sampling, SamplingParams)
        now = time.monotonic()
        req = RequestState(f"{report.peer_node_id}/{st.seq_id}", st.token_ids[: st.prompt_len], params, 1,
                           node.tokenizer, node._eos_ids(), node.max_model_len, now - st.age_s)
        seq = req.seqs[0]
        seq.token_ids = list(st.token_ids)
        seq.max_len = st.max_len
        seq.num_computed = st.num_computed
        seq.num_preemptions = st.num_preemptions
        seq.first_token_s = None if st.first_token_age_s is None else now - st.first_token_age_s
        seq.last_token_s = now
        req.outputs[0].replay(seq.output_ids)
        seq.block_ids = blocks
        e.adopt(req, 0, seq)
        if node.driver is not None:
            node.driver.kick()  # e.g. a device in the PREFILL role now holds a decoding sequence
        self.relayed += 1
        node.metrics.kv_received.inc()
        log.info("sequence_adopted_from_peer", seq=st.seq_id, peer_node=report.peer_node_id, device=e.device_id,
                 blocks=len(blocks), output_tokens=len(st.token_ids) - st.prompt_len, layers_s=[round(x, 6) for x in report.layer_arrival_s])
        return _AdoptedRelay(self._relay(tid, req, e), lambda: _drop_adopted(req, e))

    async def _relay(self, tid: str, req: RequestState, e: DeviceEngine) -> AsyncIterator[TokenRelay | RelayEnd]:
        """The adopted sequence's tokens, batched per wake-up, until it ends; closing early drops it."""
        try:
            while True:
                deltas = await req.stream.take()
                tokens = [t for d in deltas for t in d.token_ids]
                lps = [lp_to_wire(lp) for d in deltas for lp in d.logprobs]
                if tokens:
                    yield TokenRelay(transfer_id=tid, token_ids=tokens, logprobs=lps if len(lps) == len(tokens) else [])
                end = next((d for d in deltas if d.finish_reason or d.error), None)
                if end is not None:
                    yield RelayEnd(transfer_id=tid, finish_reason=end.finish_reason, error=end.error)
                    return
        finally:
            _drop_adopted(req, e)


def _drop_adopted(req: RequestState, e: DeviceEngine) -> None:
    """A sequence adopted from a peer whose origin is gone: stop it and free its blocks (idempotent)."""
    if not req.done:
        req.cancelled = True
        e.abort(req.request_id)


class _AdoptedRelay:
    """The relay iterator handed to the KV server: closing it drops the adopted sequence even before
    its first item (when the commit could not be sent), which an async generator's ``finally`` would not."""

    def __init__(self, gen: AsyncIterator, drop: Callable[[], None]):
        self._gen, self._drop = gen, drop

    def __aiter__(self) -> "_AdoptedRelay":
        return self

    def __anext__(self):
        return self._gen.__anext__()

    async def aclose(self) -> None:
        try:
            await self._gen.aclose()
        finally:
            self._drop()
