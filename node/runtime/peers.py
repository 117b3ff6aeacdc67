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
counted by stage in ``shiftnode_kv_timeouts_total``.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from contextlib import suppress
from typing import TYPE_CHECKING, AsyncIterator, Callable

import msgspec
import structlog

from node.core.roles import Role, blocks_for
from node.core.sequence import SamplingParams, Sequence, SeqStatus
from node.runtime.engine import DeviceEngine
from node.runtime.moves import MigrationRecord
from node.config import RELAY_KEEPALIVE_S
from node.runtime.request import RequestState
from node.runtime.peer_state import (READY, REFUSED, InboundRefusals, Peer, is_peer, peer_id,  # noqa: F401 - re-exported
                                     split_addr)
from node.transport import (KVClient, KVServer, Layout, PeerRefused, ReceiveReport, SeqState, TransferOffer,
                            TransferRefused, TransportError, timeout_stage)
from node.transport.protocol import RelayEnd, StatusReply, TokenRelay
from node.worker.sampler import TokenLogprobs

if TYPE_CHECKING:
    from node.runtime.node import Node

log = structlog.get_logger("shiftnode.peers")

STATUS_POLL_S = 0.05  # how often each peer's capacity is asked for
RECONNECT_S = 0.5  # pause before reconnecting a peer's control connection
REFUSED_RETRY_S = 2.0  # pause before asking a refused peer again (it may restart with the right model)
RETRY_AFTER_S = 2.0  # Retry-After of a request failed for want of a usable peer


def lp_to_wire(lp: TokenLogprobs | None) -> list | None:
    return None if lp is None else [lp.token_id, lp.logprob, [list(t) for t in lp.top]]


def lp_from_wire(x: list | None) -> TokenLogprobs | None:
    return None if x is None else TokenLogprobs(int(x[0]), float(x[1]), [(int(a), float(b)) for a, b in x[2]])


def seq_state(req: RequestState, seq: Sequence, now: float) -> SeqState:
    """What the peer needs to continue ``seq`` (durations, not clock readings)."""
    return SeqState(request_id=req.request_id, seq_id=seq.seq_id, index=seq.index, token_ids=list(seq.token_ids),
                    prompt_len=seq.prompt_len, num_computed=seq.num_computed, max_len=seq.max_len,
                    sampling=msgspec.structs.asdict(seq.params), age_s=max(0.0, now - seq.arrival_s),
                    first_token_age_s=None if seq.first_token_s is None else max(0.0, now - seq.first_token_s),
                    num_preemptions=seq.num_preemptions)


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


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
        self._ids = itertools.count()

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

    def _refused(self, peer: Peer, e: PeerRefused) -> None:
        """A handshake with ``peer`` was refused (by it or by us): counted, logged when new, shown."""
        reason = str(e)
        peer.refusals += 1
        peer.status = None
        self.node.metrics.peer_refusals.labels(reason=e.code, direction="outbound").inc()
        if peer.refusal != (e.code, reason):
            log.warning("peer_refused", peer=peer.addr, code=e.code, reason=reason)
        peer.refusal = (e.code, reason)
        self._kick()

    def _timed_out(self, e: BaseException, side: str = "sender") -> None:
        stage = timeout_stage(e)
        if stage is not None:
            self.node.metrics.kv_timeouts.labels(stage=stage, side=side).inc()

    async def _poll(self, peer: Peer) -> None:
        """Keep a control connection to ``peer`` and refresh its capacity every ``STATUS_POLL_S``."""
        while True:
            client = None
            pause = RECONNECT_S
            try:
                client = await self.connect(peer, heartbeat_interval_s=None)
                if peer.refusal is not None or peer.error is not None:
                    log.info("peer_connected", peer=peer.addr, peer_node=client.peer_node_id)
                peer.refusal, peer.error, peer.node_id = None, None, client.peer_node_id
                while True:
                    peer.status = await client.query_status(timeout_s=self.stale_s)
                    peer.status_s = time.monotonic()
                    self._kick()
                    await asyncio.sleep(STATUS_POLL_S)
            except asyncio.CancelledError:
                raise
            except PeerRefused as e:
                self._refused(peer, e)
                pause = REFUSED_RETRY_S
            except Exception as e:  # noqa: BLE001 - any failure (uvloop raises RuntimeError on a closed transport): reconnect
                self._timed_out(e)
                if peer.error is None:
                    log.warning("peer_unreachable", peer=peer.addr, error=_why(e))
                peer.status, peer.refusal, peer.error = None, None, _why(e)
                self._kick()
            finally:
                if client is not None:
                    with suppress(Exception):
                        await client.close()
            await asyncio.sleep(pause)

    def _kick(self) -> None:
        if self.node.driver is not None:
            self.node.driver.kick()

    # --- hand-off -------------------------------------------------------------------------------
    def hand_off(self, engine: DeviceEngine, req: RequestState, seq: Sequence, peer: Peer, reason: str,
                 settled: Callable[[bool], None] | None = None) -> asyncio.Task:
        """Start moving decoding ``seq`` from ``engine`` to ``peer`` (see the module docstring).

        ``settled(committed)`` is called once the transfer is decided: True when the peer committed
        (the task then relays the tokens until the sequence ends), False when the sequence stayed here
        (back on ``engine``, or dropped). The task returns whether the peer committed.
        """
        self.sending.add(seq.seq_id)

        def settle(committed: bool) -> None:
            self.sending.discard(seq.seq_id)
            if settled is not None:
                settled(committed)

        task = asyncio.get_running_loop().create_task(self._hand_off(engine, req, seq, peer, reason, settle))
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

    async def _hand_off(self, engine: DeviceEngine, req: RequestState, seq: Sequence, peer: Peer, reason: str,
                        settle: Callable[[bool], None]) -> bool:
        try:
            detached = await engine.detach(seq)
        except asyncio.CancelledError:
            settle(False)
            raise
        if detached is None:
            settle(False)
            return False
        req, index, blocks = detached
        seq.device_id = peer.id
        start = time.monotonic()
        tid = f"{self.node.config.name}/{seq.seq_id}/{next(self._ids)}"
        client: KVClient | None = None
        try:
            client = await self.connect(peer, link_gbps=self.link_gbps, heartbeat_interval_s=None)
            kv = engine.runner.kv_cache

            def layer(i: int):
                return engine.in_worker(_gather_host, kv, i, blocks)

            report = await client.send_sequence(self.layout, seq_state(req, seq, time.monotonic()), layer,
                                                len(blocks), transfer_id=tid, relay=True)
        except asyncio.CancelledError:  # the client left during the transfer
            _drop(engine, seq, blocks)
            settle(False)
            await _close(client)
            raise
        except Exception as e:  # noqa: BLE001 - whatever broke the transfer, the sequence must not be stranded
            await _close(client)
            self._settle_failed(e, engine, req, index, seq, blocks, peer)
            settle(False)
            return False
        engine.free_pinned(blocks)
        settle(True)
        peer.sent += 1
        rec = MigrationRecord(seq.seq_id, engine.device_id, peer.id, start, time.monotonic(), report.nbytes,
                              len(blocks), reason)
        self.node.record_migration(engine.device_id, peer.id, rec)
        try:
            await self._relay(client, tid, req, index, seq, peer)
        finally:
            await _close(client)
        return True

    def _settle_failed(self, e: Exception, engine: DeviceEngine, req: RequestState, index: int, seq: Sequence,
                       blocks: list[int], peer: Peer) -> None:
        """A transfer that did not commit: the sequence goes back to ``engine`` with its own blocks
        (to be sent again, to this peer or another), or ends with an error when the peer can never
        take it or the retries are spent. Nothing was adopted there, whatever happened."""
        refused_offer = isinstance(e, TransferRefused)  # nothing was reserved there
        if not isinstance(e, (TransportError, OSError)):
            log.exception("handoff_error", seq=seq.seq_id, peer=peer.addr)
        self._timed_out(e)
        peer.hold_until = time.monotonic() + (STATUS_POLL_S if refused_offer else RECONNECT_S)
        if isinstance(e, PeerRefused):  # the handshake (or the layout in the offer): not this peer for now
            self._refused(peer, e)
        elif refused_offer:
            log.info("handoff_refused", seq=seq.seq_id, peer=peer.addr, reason=str(e))
        else:  # the peer freed whatever it had reserved; our copy is intact
            peer.failures += 1
            log.warning("handoff_failed", seq=seq.seq_id, peer=peer.addr, error=str(e) or type(e).__name__)
        if refused_offer and e.code == "invalid":  # it never will take this sequence
            peer.failures += 1
            if not req.finished[index]:
                req.fail_choice(index, f"peer {peer.addr} cannot take this sequence: {e.reason}", status=503,
                                code="peer_refused", retry_after_s=RETRY_AFTER_S)
            _drop(engine, seq, blocks)
        elif req.cancelled or not (refused_offer or isinstance(e, PeerRefused)
                                   or self._count_retry(req, index, f"KV hand-off to {peer.addr} failed: {e}")):
            _drop(engine, seq, blocks)
        else:
            engine.readopt(req, index, seq, blocks)

    async def _relay(self, client: KVClient, tid: str, req: RequestState, index: int, seq: Sequence,
                     peer: Peer) -> None:
        """Feed the peer's tokens for ``seq`` through the choice's output state until it finishes."""
        out = req.outputs[index]
        relay = client.relay(tid, self.node.config.kv_transfer_timeout_s)
        error = None
        try:
            async for msg in relay:
                if isinstance(msg, RelayEnd):
                    if out.finish_reason is None and not req.finished[index]:
                        error = msg.error or f"the peer ended the sequence ({msg.finish_reason}) before this node did"
                    break
                now = time.monotonic()
                lps = msg.logprobs or [None] * len(msg.token_ids)
                for t, lp in zip(msg.token_ids, lps):
                    seq.token_ids.append(t)
                    seq.last_token_s = now
                    delta = out.on_token(t, lp_from_wire(lp))
                    req.emit(delta)
                    if delta.finish_reason is not None:
                        seq.status = SeqStatus.FINISHED
                        return  # closing the relay ends the peer's copy if it has not ended yet
        except Exception as e:  # noqa: BLE001 - a broken relay is retried, never left hanging
            if not isinstance(e, (TransportError, OSError)):
                log.exception("relay_error", seq=seq.seq_id, peer=peer.addr)
            self._timed_out(e)
            error = _why(e)
        finally:
            with suppress(Exception):
                await relay.aclose()
        if error is not None and not req.cancelled:
            peer.failures += 1
            log.warning("relay_failed", seq=seq.seq_id, peer=peer.addr, error=error)
            if self._count_retry(req, index, f"decode on peer {peer.addr} failed: {error}"):
                seq.num_computed, seq.block_ids, seq.status = 0, [], SeqStatus.WAITING
                seq.num_preemptions += 1
                self.node.metrics.kv_recomputes.inc()
                self.node.driver.recompute(req, index)

    def _count_retry(self, req: RequestState, index: int, why: str) -> bool:
        """Count a failed hand-off against ``--max-retries``: True while within it; past it, end the
        choice with an error (503 ``peer_unavailable``; the stream never looks finished)."""
        seq_id = req.seqs[index].seq_id
        n = self.retries[seq_id] = self.retries.get(seq_id, 0) + 1
        self.node.metrics.kv_handoff_failures.inc()
        if n <= self.node.config.max_retries:
            return True
        if not req.finished[index]:
            req.fail_choice(index, f"{why} (gave up after {n - 1} retries, --max-retries {self.node.config.max_retries})",
                            status=503, code="peer_unavailable", retry_after_s=RETRY_AFTER_S)
        return False


async def _close(client: KVClient | None) -> None:
    if client is not None:
        with suppress(Exception):
            await client.close()


def _drop(engine: DeviceEngine, seq: Sequence, blocks: list[int]) -> None:
    """A detached sequence that will not continue: its pinned blocks go back to the device."""
    engine.free_pinned(blocks)
    seq.block_ids = []
    seq.status = SeqStatus.FINISHED


def _gather_host(kv, layer: int, blocks: list[int]):
    """One layer's blocks ``[2, n, block_size, Hkv, D]``, copied to host memory (worker thread)."""
    from node.transport.tensors import gather_layer

    return gather_layer(kv, layer, blocks).cpu()


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
        self.server = KVServer(cfg.kv_host or cfg.host, cfg.kv_port or 0, cfg.peer_secret or "", layout,
                               reserve=self._reserve, on_layer=self._on_layer, on_done=self._on_done,
                               on_abort=self._on_abort, status=self._status, check=self._check,
                               on_refused=self._on_refused, on_timeout=self._on_timeout, node_id=cfg.name,
                               relay_keepalive_s=RELAY_KEEPALIVE_S, handshake_timeout_s=cfg.kv_connect_timeout_s,
                               stall_timeout_s=cfg.kv_transfer_timeout_s, reply_timeout_s=cfg.kv_transfer_timeout_s)

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
        return self._relay(tid, req, e)

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
            if not req.done:
                req.cancelled = True
                e.abort(req.request_id)
