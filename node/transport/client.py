"""Sending end of KV transfers over TCP: :class:`KVClient`.

One connection carries one transfer at a time (``send_sequence`` holds a lock). A failed transfer
closes the connection (the receiver frees its reservation); connect again to retry. Idle
connections are kept alive and checked with heartbeats.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import structlog

from node.log import request_lines
from node.transport.protocol import (
    Goodbye, Heartbeat, Layout, LayoutMismatch, Message, ProtocolError, RelayEnd, SeqState,
    StatusQuery, StatusReply, TokenRelay, TransferAbort, TransferAborted, TransferAccept, TransferCommitted, TransferDone, TransferOffer,
    TransferRefuse, TransferRefused, TransportError, TransportTimeout, check_compatible,
    new_transfer_id,
)
from node.transport.peer_auth import secret_bytes
from node.transport.errors import PeerRefused, TransferUnconfirmed, not_kv_peer
from node.transport.layers import FaultHook, Layers, LayerSource, payload_view, skip_blocks, write_layer
from node.transport.throttle import LinkThrottle, as_throttle
from node.transport.wire import (
    DEFAULT_CHUNK_BYTES, DEFAULT_MAX_HEADER_BYTES, client_handshake, encode, read_msg, refusal_code,
    say_goodbye, send,
)

_log = structlog.get_logger("node.transport")


@dataclass
class SendReport:
    """One outbound transfer; times in seconds on the sender's monotonic clock since the offer was sent."""

    transfer_id: str
    nbytes: int = 0
    accept_s: float = 0.0
    layer_end_s: list[float] = field(default_factory=list)  # last byte of layer i handed to the socket
    done_s: float = 0.0  # TransferCommitted received
    cached_blocks: int = 0  # leading blocks the receiver held in its prefix cache (not sent)

    @property
    def gbps(self) -> float:
        """Payload throughput from accept to commit (Gb/s)."""
        dt = self.done_s - self.accept_s
        return self.nbytes * 8 / dt / 1e9 if dt > 0 else float("inf")


class KVClient:
    """A connection to a peer's :class:`~node.transport.server.KVServer`; use :meth:`connect`."""

    def __init__(self, reader, writer, *, peer_node_id: str, peer_layout: Layout | None,
                 link: LinkThrottle | None, accept_timeout_s: float, stall_timeout_s: float,
                 commit_timeout_s: float, heartbeat_interval_s: float | None, max_header_bytes: int,
                 chunk_bytes: int, fault_hook: FaultHook | None, nixl: Any = None, nixl_route: Any = None):
        self._reader, self._writer = reader, writer
        self.nixl, self.nixl_route = nixl, nixl_route  # NixlAgent and NixlRoute when layers may go over NIXL
        self.peer_node_id, self.peer_layout = peer_node_id, peer_layout
        self.link = link
        self.accept_timeout_s = accept_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.commit_timeout_s = commit_timeout_s
        self.max_header_bytes = max_header_bytes
        self.chunk_bytes = chunk_bytes
        self.fault_hook = fault_hook  # tests only: alters a payload after its checksum was computed
        self._lock = asyncio.Lock()
        self._status_n = 0
        self._inbox: asyncio.Queue = asyncio.Queue()
        self._dead: BaseException | None = None
        self.lost = asyncio.Event()  # set once the connection is dead (NIXL writes stop waiting then)
        self._log = _log.bind(peer_node=peer_node_id)
        self._pump_task = asyncio.create_task(self._pump())
        self._hb_task = (asyncio.create_task(self._heartbeats(heartbeat_interval_s))
                         if heartbeat_interval_s else None)

    @classmethod
    async def connect(cls, host: str, port: int, secret: str | bytes, *, node_id: str = "",
                      layout: Layout | None = None, link_gbps: LinkThrottle | float | None = None,
                      connect_timeout_s: float = 5.0, handshake_timeout_s: float = 5.0,
                      accept_timeout_s: float = 10.0, stall_timeout_s: float = 10.0,
                      commit_timeout_s: float = 10.0, heartbeat_interval_s: float | None = 5.0,
                      max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                      fault_hook: FaultHook | None = None, nixl: Any = None) -> "KVClient":
        """Connect and authenticate (both ways). With ``layout``, a peer whose layout or fingerprint
        differs is refused here (:class:`LayoutMismatch`, before our proof is sent), and the peer
        checks ours. ``link_gbps``: None (unthrottled), Gb/s, or a shared :class:`LinkThrottle`.
        The hostname is resolved on every call, so a reconnect finds a peer that moved.
        Raises ``TransportTimeout`` (stage ``connect`` or ``handshake``), ``PeerRefused`` (its
        subclasses ``AuthError``, ``VersionMismatch``, ``LayoutMismatch``; ``code`` says why),
        ``OSError``. ``nixl``: this node's :class:`~node.transport.nixl_agent.NixlAgent`: after the
        handshake the peer's NIXL agent is loaded (see :mod:`node.transport.nixl_plane`)."""
        secret_b = secret_bytes(secret)
        try:
            async with asyncio.timeout(connect_timeout_s):
                reader, writer = await asyncio.open_connection(host, port, limit=2 * chunk_bytes)
        except TimeoutError:
            raise TransportTimeout(f"connect to {host}:{port} not done within {connect_timeout_s} s",
                                   "connect") from None
        try:
            try:
                reply = await client_handshake(reader, writer, secret_b, node_id, layout, handshake_timeout_s,
                                               max_header_bytes)
            except ProtocolError as exc:  # it answered, but not as a KV port (an HTTP port, say)
                raise not_kv_peer(f"{host}:{port}", exc) from exc
            route = None
            if nixl is not None:  # only now: the server proved the secret, its metadata may be parsed
                from node.transport.nixl_plane import query_route
                # keyed by the address dialed and proven, not the id it claims (two nodes may claim one)
                route = await query_route(reader, writer, nixl, f"{host}:{port}", handshake_timeout_s, max_header_bytes)
        except BaseException as exc:
            # a refusal is the caller's to report (PeerLinks logs a peer's refusal once, not every retry)
            (_log.info if isinstance(exc, PeerRefused) else _log.warning)(
                "kv_connect_failed", peer=f"{host}:{port}", reason=str(exc) or type(exc).__name__)
            say_goodbye(writer, f"handshake failed: {exc}", refusal_code(exc))
            raise
        return cls(reader, writer, peer_node_id=reply.node_id, peer_layout=reply.layout,
                   link=as_throttle(link_gbps), accept_timeout_s=accept_timeout_s,
                   stall_timeout_s=stall_timeout_s, commit_timeout_s=commit_timeout_s,
                   heartbeat_interval_s=heartbeat_interval_s, max_header_bytes=max_header_bytes,
                   chunk_bytes=chunk_bytes, fault_hook=fault_hook, nixl=nixl, nixl_route=route)

    @property
    def closed(self) -> bool:
        return self._dead is not None

    async def close(self) -> None:
        """Say goodbye and close; idempotent."""
        if self._dead is None:
            self._dead = TransportError("client closed")
        for t in (self._hb_task, self._pump_task):
            if t is not None and t is not asyncio.current_task():
                t.cancel()
        say_goodbye(self._writer, "client closing")
        try:
            async with asyncio.timeout(1.0):
                await self._writer.wait_closed()
        except (TimeoutError, OSError):
            pass

    async def __aenter__(self) -> "KVClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ---------------------------------------------------------------------------------- inbound
    async def _pump(self) -> None:
        """Read every frame from the server into the inbox; a dead connection becomes a sticky error."""
        try:
            while True:
                msg = await read_msg(self._reader, self.max_header_bytes, None)
                if isinstance(msg, Goodbye):
                    raise TransportError(f"peer closed the connection: {msg.reason}")
                self._inbox.put_nowait(msg)
        except asyncio.CancelledError:
            raise
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            self._set_dead(TransportError(f"peer closed the connection ({type(exc).__name__})"))
        except TransportError as exc:
            self._set_dead(exc)

    def _set_dead(self, exc: BaseException) -> None:
        if self._dead is None:
            self._dead = exc
        self._inbox.put_nowait(exc)
        self.lost.set()

    async def _next(self, timeout_s: float | None, what: str, stage: str) -> Message:
        try:
            async with asyncio.timeout(timeout_s):
                item = await self._inbox.get()
        except TimeoutError:
            raise TransportTimeout(f"no {what} within {timeout_s} s", stage) from None
        if isinstance(item, BaseException):
            self._inbox.put_nowait(item)  # sticky
            raise item
        return item

    def _raise_if_aborted(self, tid: str) -> None:
        """Non-blocking: has the receiver already given up on this transfer?"""
        while not self._inbox.empty():
            item = self._inbox.get_nowait()
            if isinstance(item, BaseException):
                self._inbox.put_nowait(item)
                raise item
            if isinstance(item, TransferAbort) and item.transfer_id == tid:
                raise TransferAborted(f"receiver aborted: {item.reason}")

    async def _heartbeats(self, interval_s: float) -> None:
        n = 0
        try:
            while self._dead is None:
                await asyncio.sleep(interval_s)
                if self._lock.locked():
                    continue  # a transfer is in progress: the connection is evidently alive
                async with self._lock:
                    n += 1
                    await send(self._writer, Heartbeat(n=n), self.stall_timeout_s)
                    reply = await self._next(self.stall_timeout_s, "heartbeat echo", "heartbeat")
                    if not (isinstance(reply, Heartbeat) and reply.n == n):
                        raise ProtocolError(f"expected heartbeat echo {n}, got {reply!r:.200}")
        except asyncio.CancelledError:
            raise
        except (TransportError, ConnectionError) as exc:
            self._log.warning("kv_peer_heartbeat_failed", reason=str(exc))
            self._set_dead(exc if isinstance(exc, TransportError) else TransportError(str(exc)))
            say_goodbye(self._writer, f"heartbeat failed: {exc}")

    # --------------------------------------------------------------------------------- transfer
    async def query_status(self, timeout_s: float = 2.0) -> StatusReply:
        """Ask the peer for its decode capacity (:class:`StatusReply`). Raises ``TransportError``."""
        async with self._lock:
            if self._dead is not None:
                raise TransportError(f"connection is closed: {self._dead}")
            self._status_n += 1
            await send(self._writer, StatusQuery(n=self._status_n), self.stall_timeout_s)
            reply = await self._next(timeout_s, "StatusReply", "status")
            if not (isinstance(reply, StatusReply) and reply.n == self._status_n):
                raise ProtocolError(f"expected StatusReply {self._status_n}, got {reply!r:.200}")
            return reply

    async def relay(self, transfer_id: str, idle_timeout_s: float = 30.0) -> AsyncIterator[TokenRelay | RelayEnd]:
        """After ``send_sequence(..., relay=True)``: the receiver's ``TokenRelay`` messages for the
        sequence, then its ``RelayEnd`` (the last item). Holds the connection (no heartbeats of ours;
        the receiver's keep the link checked). Raises ``TransportTimeout`` after ``idle_timeout_s`` of
        silence and ``TransportError`` when the connection is lost; closing the iterator early (the
        client left) closes the connection, which makes the receiver drop the sequence."""
        async with self._lock:
            finished = False
            try:
                while True:
                    msg = await self._next(idle_timeout_s, "relayed tokens", "relay")
                    if isinstance(msg, Heartbeat):
                        continue
                    if isinstance(msg, (TokenRelay, RelayEnd)) and msg.transfer_id == transfer_id:
                        finished = isinstance(msg, RelayEnd)
                        yield msg
                        if finished:
                            return
                        continue
                    raise ProtocolError(f"expected relayed tokens of {transfer_id}, got {msg!r:.200}")
            finally:
                if not finished:  # the caller stopped early: hang up, which makes the receiver drop it
                    self._hang_up("relay closed before the sequence ended")

    async def send_sequence(self, layout: Layout, seq: SeqState, layers: LayerSource, num_blocks: int, *,
                            transfer_id: str | None = None, relay: bool = False,
                            nixl_blocks: tuple[int, list[int]] | None = None) -> SendReport:
        """Offer ``seq`` (``num_blocks`` blocks) and, once the peer reserved them, stream its layers
        0..``layout.num_layers``-1 in order; return when the peer committed.

        ``layers``: ``callable(layer) -> payload`` (or an awaitable of one; the next layer is then
        prefetched), or an (async) iterable of payloads in layer order. A payload is bytes-like or a
        tensor ``[2, num_blocks, block_size, Hkv, D]`` and must have exactly
        ``layout.layer_bytes(num_blocks)`` bytes; it must not be mutated until this call returns.

        Raises ``LayoutMismatch`` or ``TransferRefused`` (nothing was reserved; the connection stays
        usable), ``TransferAborted`` (the receiver freed its reservation), ``TransferUnconfirmed``,
        ``TransportTimeout``/``TransportError`` (the connection is closed; the receiver aborts).
        Keep the sequence's blocks on this side until this returns successfully. ``relay=True``: the
        receiver goes on decoding the sequence and sends its tokens back; read them with :meth:`relay`.
        ``nixl_blocks``: (our NIXL pool index, the sequence's block ids in it): on a connection with a
        NIXL route, the receiver may then have the layers written over NIXL instead (``layers`` is
        used when it answers for TCP).
        """
        if self.peer_layout is not None:
            check_compatible(layout, self.peer_layout)
        problems = seq.problems(layout.block_size, num_blocks)
        if problems:
            raise ValueError(f"sequence {seq.seq_id} cannot be transferred: {'; '.join(problems)}")
        tid = transfer_id or new_transfer_id("kv")
        per_layer = layout.layer_bytes(num_blocks)
        offer = TransferOffer(transfer_id=tid, layout=layout, seq=seq, num_blocks=num_blocks,
                              nbytes_per_layer=per_layer, relay=relay,
                              nixl=self.nixl_route is not None and nixl_blocks is not None)
        log = self._log.bind(transfer_id=tid)
        async with self._lock:
            if self._dead is not None:
                raise TransportError(f"connection is closed: {self._dead}")
            report = SendReport(tid)
            t0 = time.monotonic()
            source = Layers(layers, layout.num_layers)
            try:
                await send(self._writer, offer, self.stall_timeout_s)
                reply = await self._next(self.accept_timeout_s, "TransferAccept", "accept")
                if isinstance(reply, TransferRefuse) and reply.transfer_id == tid:
                    log.info("kv_transfer_refused", code=reply.code, reason=reply.reason)
                    if reply.code == "layout":
                        raise LayoutMismatch(reply.fields, f"peer refused: {reply.reason}")
                    raise TransferRefused(reply.code, reply.reason)
                if isinstance(reply, TransferAbort) and reply.transfer_id == tid:
                    raise TransferAborted(f"receiver aborted: {reply.reason}")
                if not (isinstance(reply, TransferAccept) and reply.transfer_id == tid):
                    raise ProtocolError(f"expected TransferAccept, got {reply!r:.200}")
                skip = reply.cached_blocks
                if not 0 <= skip < num_blocks:
                    raise ProtocolError(f"peer holds {skip} of {num_blocks} blocks cached")
                report.accept_s = time.monotonic() - t0
                report.cached_blocks = skip
                sent = layout.layer_bytes(num_blocks - skip)
                if reply.nixl_pool >= 0:
                    if not offer.nixl:
                        raise ProtocolError("peer asked for NIXL writes that were not offered")
                    from node.transport.nixl_plane import send_layers
                    report.nbytes = await send_layers(
                        self.nixl, self.nixl_route, layout, reply, nixl_blocks, num_blocks, self.stall_timeout_s,
                        self.link, report.layer_end_s, t0, lambda: self._raise_if_aborted(tid), self.lost)
                for layer in range(layout.num_layers if reply.nixl_pool < 0 else 0):
                    payload = await source.get(layer)
                    if skip:
                        payload = skip_blocks(payload_view(payload), skip, num_blocks)
                    await write_layer(self._writer, tid, layer, payload, sent, chunk_bytes=self.chunk_bytes,
                                      stall_timeout_s=self.stall_timeout_s, link=self.link, fault_hook=self.fault_hook,
                                      before_write=lambda: self._raise_if_aborted(tid))
                    report.nbytes += sent
                    report.layer_end_s.append(time.monotonic() - t0)
                await send(self._writer, TransferDone(transfer_id=tid), self.stall_timeout_s)
                try:
                    reply = await self._next(self.commit_timeout_s, "TransferCommitted", "commit")
                except TransportError as exc:
                    raise TransferUnconfirmed(f"transfer {tid}: {exc}") from exc
                if isinstance(reply, TransferAbort) and reply.transfer_id == tid:
                    raise TransferAborted(f"receiver aborted: {reply.reason}")
                if not (isinstance(reply, TransferCommitted) and reply.transfer_id == tid):
                    raise TransferUnconfirmed(f"expected TransferCommitted, got {reply!r:.200}")
                report.done_s = time.monotonic() - t0
            except (LayoutMismatch, TransferRefused):
                raise
            except BaseException as exc:
                source.cancel()
                err = self._explain(tid, exc)
                self._fail(tid, err, log)
                if err is exc:
                    raise
                raise err from exc
        if request_lines():  # one per sequence moved: --log-requests (node.log)
            log.info("kv_transfer_sent", nbytes=report.nbytes, seconds=round(report.done_s, 6), gbps=round(report.gbps, 3))
        return report

    def _explain(self, tid: str, exc: BaseException) -> BaseException:
        """Prefer the receiver's own abort reason over the broken pipe it caused; socket errors become
        ``TransportError``."""
        if isinstance(exc, (TransferAborted, asyncio.CancelledError, ValueError)):
            return exc
        if isinstance(exc, (TransportError, OSError, asyncio.IncompleteReadError, RuntimeError)):
            try:
                self._raise_if_aborted(tid)
            except TransferAborted as aborted:
                return aborted
            except BaseException:  # noqa: BLE001 - the sticky connection error: keep the original
                pass
        if isinstance(exc, (OSError, asyncio.IncompleteReadError)) or (
                isinstance(exc, RuntimeError) and self._writer.is_closing()):  # uvloop: write on a closed transport
            return TransportError(f"connection lost: {type(exc).__name__}: {exc}")
        return exc

    def _hang_up(self, reason: str) -> None:
        if self._dead is None:
            self._dead = TransportError(reason)
        for t in (self._hb_task, self._pump_task):
            if t is not None:
                t.cancel()
        say_goodbye(self._writer, reason)

    def _fail(self, tid: str, exc: BaseException, log) -> None:
        reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        log.warning("kv_transfer_failed", reason=reason)
        try:
            if not self._writer.is_closing():
                self._writer.write(encode(TransferAbort(transfer_id=tid, reason=reason[:1000])))
        except Exception:  # noqa: BLE001
            pass
        if self._dead is None:
            self._dead = TransportError(f"connection closed after transfer {tid} failed: {reason}")
        for t in (self._hb_task, self._pump_task):
            if t is not None:
                t.cancel()
        self._writer.close()
