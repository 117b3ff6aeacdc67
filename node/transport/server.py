"""Receiving end of KV transfers over TCP: :class:`KVServer`.

Per connection: handshake, then offers one at a time. For an offer the server checks the layout and
the sequence state, calls ``reserve(offer)`` (the caller's block reservation), sends
``TransferAccept``, then takes layers 0..L-1 in order, verifying each CRC-32 before calling
``on_layer``; after ``TransferDone`` it calls ``on_done`` and answers ``TransferCommitted``.

Invariant: once ``reserve`` returned blocks, exactly one of ``on_done`` / ``on_abort`` is called for
that transfer, whatever fails (disconnect, timeout, checksum, oversize frame, sender abort, a raising
callback, server shutdown). A failed transfer also ends its connection (after a ``TransferAbort``).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import structlog

from node.log import request_lines
from node.transport.protocol import (
    ChecksumMismatch, FrameTooLarge, Goodbye, Heartbeat, LayerHeader, Layout, LayoutMismatch,
    ProtocolError, RelayEnd, StatusQuery, StatusReply, TransferAbort, TransferAborted, TransferAccept,
    TransferCommitted, TransferDone, TransferOffer, TransferRefuse, TransportError, check_compatible,
    offer_problems, timeout_stage, NixlInfo, NixlQuery,
)
from node.transport.errors import DeviceDown
from node.transport.peer_auth import secret_bytes
from node.transport.nixl_plane import info_of, receive_layers
from node.transport.wire import (
    DEFAULT_MAX_HEADER_BYTES, DEFAULT_MAX_PAYLOAD_BYTES, encode, read_msg, read_payload, refusal_code, say_goodbye,
    send, server_handshake,
)

_log = structlog.get_logger("node.transport")

MaybeAwaitable = Any  # T | Awaitable[T]
Reserve = Callable[[TransferOffer], "list[int] | None | Awaitable[list[int] | None]"]
OnLayer = Callable[[str, int, bytearray], MaybeAwaitable]
OnDone = Callable[[str, "ReceiveReport"], MaybeAwaitable]
OnAbort = Callable[[str, str], MaybeAwaitable]
Status = Callable[[int], StatusReply]


async def _maybe(value):
    return await value if inspect.isawaitable(value) else value


@dataclass
class ReceiveReport:
    """One inbound transfer. Times are seconds on the receiver's monotonic clock since the accept."""

    transfer_id: str
    offer: TransferOffer
    block_ids: list[int]
    peer_node_id: str
    layer_arrival_s: list[float] = field(default_factory=list)
    nbytes: int = 0
    done_s: float | None = None
    cached_blocks: int = 0  # leading blocks the receiver already held (not sent)


class KVServer:
    """Accept KV transfers on ``host:port`` (``port=0``: any free port, see :attr:`port`).

    Callbacks may be plain functions or coroutines:
      * ``reserve(offer) -> list[int] | (list[int], int) | None``: block ids in logical order, ``None``
        to refuse; with a count ``c``, the first ``c`` blocks already hold the sequence's KV (the
        receiver's prefix cache, ``0 <= c < num_blocks``) and are not sent; with a third item, a pool
        index of the server's ``nixl`` agent, an offer with ``nixl=True`` has its layers written there
        by the sender over NIXL (``on_layer`` is then not called; see :mod:`node.transport.nixl_plane`);
      * ``on_layer(transfer_id, layer, payload: bytearray)``: layer ``layer`` landed and passed its
        checksum; ``payload`` is the ``[2, n - c, block_size, Hkv, D]`` buffer of the blocks after the
        cached ones (see
        :func:`node.transport.tensors.layer_from_bytes`); layers come in order 0..L-1;
      * ``on_done(transfer_id, report)``: every layer landed; adopt the sequence (raising aborts). For
        an offer with ``relay=True`` it returns an async iterator of ``TokenRelay`` messages ending with
        a ``RelayEnd``: they are sent after ``TransferCommitted`` on the same connection (``Heartbeat``
        frames fill silences longer than ``relay_keepalive_s``), and the connection closes after the
        ``RelayEnd``. The sender hanging up or aborting first closes the iterator (``aclose``), which is
        where the caller drops the sequence; so does a ``TransferCommitted`` that cannot be sent (the
        iterator is then closed before its first item: an async generator's ``finally`` would not run);
      * ``on_abort(transfer_id, reason)``: free the reservation;
      * ``status(n) -> StatusReply`` (optional): the answer to a peer's ``StatusQuery``;
      * ``check(offer) -> list[str]`` (optional): reasons this receiver cannot take the sequence at all
        (e.g. longer than its context); any makes the offer refused with code ``invalid``;
      * ``on_refused(peer, peer_node_id, code, reason)`` (optional, plain function): a handshake was
        refused, by us or by the client (``code``: see :class:`~node.transport.protocol.PeerRefused`);
      * ``on_timeout(stage)`` (optional, plain function): a bounded wait on a connection expired.
    Timeouts (s): ``handshake_timeout_s`` for the whole handshake, ``idle_timeout_s`` between
    messages outside a transfer (the client's heartbeats keep it alive), ``stall_timeout_s`` for each
    frame or payload chunk during a transfer, ``reply_timeout_s`` for our own sends.
    """

    def __init__(self, host: str, port: int, secret: str | bytes, layout: Layout, *,
                 reserve: Reserve, on_layer: OnLayer, on_done: OnDone, on_abort: OnAbort,
                 status: Status | None = None, check: Callable[[TransferOffer], list[str]] | None = None,
                 on_refused: Callable[[str, str, str, str], None] | None = None,
                 on_timeout: Callable[[str], None] | None = None, node_id: str = "", relay_keepalive_s: float = 2.0, max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
                 max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES, handshake_timeout_s: float = 5.0,
                 idle_timeout_s: float = 60.0, stall_timeout_s: float = 10.0, reply_timeout_s: float = 10.0,
                 nixl: Any = None, nixl_info: NixlInfo | None = None):
        self.host, self._port = host, port
        self.nixl = nixl  # a NixlAgent: offers with nixl=True may be written over it (node.transport.nixl_plane)
        self.nixl_info = nixl_info or info_of(None, b"")  # the answer to a NixlQuery
        self._secret = secret_bytes(secret)
        self.layout = layout
        self._reserve, self._on_layer, self._on_done, self._on_abort = reserve, on_layer, on_done, on_abort
        self._status = status
        self._check = check
        self._on_refused = on_refused
        self._on_timeout = on_timeout
        self.relay_keepalive_s = relay_keepalive_s
        self.node_id = node_id
        self.max_header_bytes = max_header_bytes
        self.max_payload_bytes = max_payload_bytes
        self.handshake_timeout_s = handshake_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.reply_timeout_s = reply_timeout_s
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task] = set()
        self.in_flight: dict[str, ReceiveReport] = {}

    @property
    def port(self) -> int:
        """The bound port (after :meth:`start`)."""
        if self._server is not None and self._server.sockets:
            return self._server.sockets[0].getsockname()[1]
        return self._port

    async def start(self) -> "KVServer":
        self._server = await asyncio.start_server(self._serve, self.host, self._port)
        _log.info("kv_server_listening", host=self.host, port=self.port)
        return self

    async def close(self) -> None:
        """Stop listening and drop every connection; in-flight transfers get ``on_abort``."""
        if self._server is not None:
            self._server.close()
        conns = list(self._conns)
        for t in conns:
            t.cancel()
        await asyncio.gather(*conns, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> "KVServer":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ------------------------------------------------------------------------------ connection
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._conns.add(task)
        peer = writer.get_extra_info("peername")
        addr = f"{peer[0]}:{peer[1]}" if peer else "?"
        log = _log.bind(peer=addr)
        try:
            try:
                hello = await server_handshake(reader, writer, self._secret, self.node_id, self.layout,
                                               self.handshake_timeout_s, self.max_header_bytes)
            except (TransportError, asyncio.IncompleteReadError, ConnectionError) as exc:
                code = refusal_code(exc)
                log.warning("kv_peer_rejected", reason=str(exc) or type(exc).__name__, code=code or None,
                            peer_node=getattr(exc, "peer_node_id", "") or None)
                say_goodbye(writer, f"handshake failed: {exc}", code)
                if code and self._on_refused is not None:
                    self._on_refused(addr, getattr(exc, "peer_node_id", ""), code, str(exc))
                self._timed_out(exc)
                return
            log = log.bind(peer_node=hello.node_id)
            log.info("kv_peer_connected")
            await self._messages(reader, writer, hello.node_id, log)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            log.info("kv_peer_closed", reason=str(exc) or type(exc).__name__)
        except TransportError as exc:
            log.warning("kv_peer_dropped", reason=str(exc), error=type(exc).__name__)
            say_goodbye(writer, str(exc))
            self._timed_out(exc)
        except asyncio.CancelledError:
            # only close() cancels these tasks; ending normally keeps asyncio's stream callback quiet
            say_goodbye(writer, "server closing")
        except Exception as exc:  # noqa: BLE001 - a raising callback must not kill the server
            log.exception("kv_connection_error", error=type(exc).__name__)
            say_goodbye(writer, f"internal error: {type(exc).__name__}")
        finally:
            writer.close()
            self._conns.discard(task)

    def _timed_out(self, exc: BaseException) -> None:
        stage = timeout_stage(exc)
        if stage is not None and self._on_timeout is not None:
            self._on_timeout(stage)

    async def _messages(self, reader, writer, peer_node_id: str, log) -> None:
        while True:
            msg = await read_msg(reader, self.max_header_bytes, self.idle_timeout_s, "idle")
            if isinstance(msg, Heartbeat):
                await send(writer, msg, self.reply_timeout_s)
            elif isinstance(msg, StatusQuery):
                reply = self._status(msg.n) if self._status is not None else StatusReply(
                    n=msg.n, kv_free_blocks=0, kv_total_blocks=0, max_device_free_blocks=0, max_device_total_blocks=0,
                    seq_slots_free=0,
                    accepting=False)
                await send(writer, reply, self.reply_timeout_s)
            elif isinstance(msg, NixlQuery):
                await send(writer, self.nixl_info, self.reply_timeout_s)
            elif isinstance(msg, TransferOffer):
                relay = await self._receive(msg, reader, writer, peer_node_id, log.bind(transfer_id=msg.transfer_id))
                if relay is not None:
                    await self._relay(msg.transfer_id, relay, reader, writer, log.bind(transfer_id=msg.transfer_id))
                    return  # a relayed sequence's connection ends with it
            elif isinstance(msg, Goodbye):
                log.info("kv_peer_goodbye", reason=msg.reason)
                return
            elif isinstance(msg, TransferAbort):
                continue  # about a transfer already refused or finished
            else:
                raise ProtocolError(f"unexpected {type(msg).__name__} outside a transfer")

    async def _refuse(self, writer, offer: TransferOffer, code: str, reason: str, log,
                      fields: list[str] | None = None) -> None:
        log.warning("kv_transfer_refused", code=code, reason=reason)
        await send(writer, TransferRefuse(transfer_id=offer.transfer_id, code=code, reason=reason,
                                          fields=fields or []), self.reply_timeout_s)

    # -------------------------------------------------------------------------------- transfer
    async def _receive(self, offer: TransferOffer, reader, writer, peer_node_id: str, log) -> None:
        tid = offer.transfer_id
        try:
            check_compatible(self.layout, offer.layout)
        except LayoutMismatch as exc:
            return await self._refuse(writer, offer, "layout", str(exc), log, exc.fields)
        problems = offer_problems(offer) + (self._check(offer) if self._check is not None else [])
        if offer.nbytes_per_layer > self.max_payload_bytes:
            problems.append(f"nbytes_per_layer {offer.nbytes_per_layer} > max_payload_bytes {self.max_payload_bytes}")
        if problems:
            return await self._refuse(writer, offer, "invalid", "; ".join(problems), log)
        if tid in self.in_flight:
            return await self._refuse(writer, offer, "busy", f"transfer {tid} already in flight", log)
        try:
            block_ids = await _maybe(self._reserve(offer))
        except Exception as exc:  # noqa: BLE001
            log.exception("kv_reserve_failed")
            return await self._refuse(writer, offer, "no_room", f"reserve raised {type(exc).__name__}: {exc}", log)
        if block_ids is None:
            return await self._refuse(writer, offer, "no_room", f"cannot reserve {offer.num_blocks} blocks", log)
        cached, pool = 0, None
        if isinstance(block_ids, tuple):
            block_ids, cached, *rest = block_ids
            pool = rest[0] if rest else None
        nixl = self.nixl if offer.nixl and pool is not None else None
        per_layer = offer.layout.layer_bytes(offer.num_blocks - cached)

        report = ReceiveReport(tid, offer, list(block_ids), peer_node_id, cached_blocks=cached)
        self.in_flight[tid] = report
        adopted, relay = False, None
        try:
            if len(block_ids) != offer.num_blocks:
                raise TransferAborted(f"reserve returned {len(block_ids)} blocks, the offer needs {offer.num_blocks}")
            if not 0 <= cached < offer.num_blocks:
                raise TransferAborted(f"reserve said {cached} of {offer.num_blocks} blocks are cached")
            t0 = time.monotonic()
            if nixl is not None:  # layers land by NIXL WRITE, each announced by a notification
                notifs = nixl.expect(tid)
                try:
                    await send(writer, TransferAccept(transfer_id=tid, cached_blocks=cached, nixl_pool=pool,
                                                      block_ids=list(block_ids[cached:])), self.reply_timeout_s)
                    await receive_layers(reader, notifs, tid, offer.layout.num_layers, self.stall_timeout_s,
                                         self.max_header_bytes, report.layer_arrival_s, t0)
                finally:
                    nixl.unexpect(tid)
                report.nbytes = per_layer * offer.layout.num_layers
            else:
                await send(writer, TransferAccept(transfer_id=tid, cached_blocks=cached), self.reply_timeout_s)
            for layer in range(offer.layout.num_layers if nixl is None else 0):
                head = await self._next_of_transfer(reader, tid)
                if not isinstance(head, LayerHeader) or head.layer != layer:
                    raise ProtocolError(f"expected LayerHeader for layer {layer}, got {head!r:.200}")
                if head.nbytes > self.max_payload_bytes:
                    raise FrameTooLarge(f"layer {layer} payload of {head.nbytes} bytes exceeds "
                                        f"max_payload_bytes {self.max_payload_bytes}")
                if head.nbytes != per_layer:
                    raise ProtocolError(f"layer {layer} has {head.nbytes} bytes, not {per_layer} for "
                                        f"{offer.num_blocks - cached} uncached blocks")
                data, crc = await read_payload(reader, head.nbytes, self.stall_timeout_s)
                if crc != head.checksum:
                    raise ChecksumMismatch(f"layer {layer}: crc32 {crc:#010x} != header {head.checksum:#010x}")
                report.layer_arrival_s.append(time.monotonic() - t0)
                report.nbytes += head.nbytes
                await _maybe(self._on_layer(tid, layer, data))
            done = await self._next_of_transfer(reader, tid) if nixl is None else None
            if nixl is None and not isinstance(done, TransferDone):
                raise ProtocolError(f"expected TransferDone, got {type(done).__name__}")
            report.done_s = time.monotonic() - t0
            relay = await _maybe(self._on_done(tid, report))
            adopted = True
            if request_lines():  # one per sequence moved: --log-requests (node.log)
                log.info("kv_transfer_received", nbytes=report.nbytes, layers=len(report.layer_arrival_s),
                         seconds=round(report.done_s, 6))
            try:
                await send(writer, TransferCommitted(transfer_id=tid), self.reply_timeout_s)
            except (TransportError, ConnectionError) as exc:
                log.warning("kv_commit_not_delivered", reason=str(exc) or type(exc).__name__)
                raise
        except BaseException as exc:
            if adopted and relay is not None:  # the sender never heard of the commit: drop the adopted copy
                aclose = getattr(relay, "aclose", None)
                if aclose is not None:
                    with contextlib.suppress(Exception):
                        await aclose()
            if not adopted:
                reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                log.warning("kv_transfer_aborted", reason=reason, layers=len(report.layer_arrival_s))
                try:
                    await _maybe(self._on_abort(tid, reason))
                except Exception:  # noqa: BLE001
                    log.exception("kv_on_abort_failed")
                if not isinstance(exc, asyncio.CancelledError) and not writer.is_closing():
                    writer.write(encode(TransferAbort(transfer_id=tid, reason=reason[:1000])))
                if isinstance(exc, DeviceDown):  # expected and recovered: kv_transfer_aborted said why
                    raise TransferAborted(reason) from exc
                if not isinstance(exc, (TransportError, asyncio.IncompleteReadError, ConnectionError,
                                        asyncio.CancelledError)):
                    log.error("kv_callback_failed", exc_info=exc)
                    raise TransferAborted(reason) from exc  # drop the connection cleanly
            raise
        finally:
            self.in_flight.pop(tid, None)
        return relay if offer.relay else None

    async def _relay(self, tid: str, relay, reader, writer, log) -> None:
        """Forward a relayed sequence's messages until its ``RelayEnd``; anything from the sender but a
        heartbeat (an abort, a goodbye, a hang-up) ends the relay early and closes the iterator."""
        async def sender_gone() -> str:
            while True:
                msg = await read_msg(reader, self.max_header_bytes, None)
                if not isinstance(msg, Heartbeat):
                    return getattr(msg, "reason", type(msg).__name__)

        it = relay.__aiter__()
        watcher = asyncio.ensure_future(sender_gone())
        nxt: asyncio.Future | None = None
        try:
            while True:
                if nxt is None:
                    nxt = asyncio.ensure_future(it.__anext__())
                done, _ = await asyncio.wait({nxt, watcher}, timeout=self.relay_keepalive_s,
                                             return_when=asyncio.FIRST_COMPLETED)
                if watcher in done:
                    exc = watcher.exception()
                    log.info("kv_relay_ended_by_sender", reason=str(exc or watcher.result()) or type(exc).__name__)
                    return
                if not done:
                    await send(writer, Heartbeat(n=0), self.reply_timeout_s)
                    continue
                try:
                    msg = nxt.result()
                except StopAsyncIteration:
                    return
                nxt = None
                await send(writer, msg, self.reply_timeout_s)
                if isinstance(msg, RelayEnd):
                    return
        finally:
            watcher.cancel()
            if nxt is not None:
                nxt.cancel()
                with contextlib.suppress(BaseException):
                    await nxt
            aclose = getattr(it, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()

    async def _next_of_transfer(self, reader, tid: str):
        msg = await read_msg(reader, self.max_header_bytes, self.stall_timeout_s, "stall")
        if isinstance(msg, TransferAbort):
            raise TransferAborted(f"sender aborted: {msg.reason}")
        if getattr(msg, "transfer_id", tid) != tid:
            raise ProtocolError(f"{type(msg).__name__} for transfer {msg.transfer_id!r} inside transfer {tid!r}")
        return msg
