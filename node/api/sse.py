"""Server-Sent Events writer: ``data: {json}`` events, comment keep-alives, the closing ``[DONE]``.

Events are encoded with msgspec (UTF-8, no ASCII escaping; a non-finite float becomes ``null``, so
every event is valid JSON) and the events of one step go out in one write.

Writes are synchronous: once :meth:`SSEWriter.prepare` has sent the headers (an aiohttp
``StreamResponse`` sends them in ``prepare``), each write frames its bytes as one HTTP/1.1 chunk
(``Transfer-Encoding: chunked``, enabled explicitly) and hands them to the connection's transport,
so a step's post-processing can write every stream's events without a coroutine per write.
HTTP/1.0 clients get the bytes unframed, the body ending when the connection closes (what aiohttp
does for them too). Nothing waits for the client to read (aiohttp's own writer would wait above
64 KiB, and the deltas would queue in the request's DeltaStream instead).

Backpressure (:class:`StreamLimits`): a client that keeps its connection open but reads slower than
the node writes, or not at all, would otherwise pin its KV and the events queued for it until its
request ends (n 64, logprobs 20: hundreds of MB). Above ``--sse-buffer-bytes`` of unsent bytes the
stream is *congested*: the handler holds each choice's deltas and joins them (:meth:`SSEWriter.hold`;
one event per choice once the client catches up, so fewer envelopes). Past ``--sse-stall-bytes``
(unsent plus held, estimated: this bounds the memory a slow reader pins) or ``--sse-stall-s`` congested
without progress (not a byte acknowledged by the client's kernel), the client is *stalled*: its requests
end at once and free their KV (the handler's next call raises ``ConnectionResetError``, as for a client
that left), and ``shiftnode_stalled_clients_total`` counts it. The stream then ends with an ``error``
event (code ``client_stalled``) and ``[DONE]``, queued behind what the client has not read, and the
connection is closed once those bytes are out: a client that reads again sees why its stream ended. One
that still has not read them :data:`CLOSE_GRACE_S` later is aborted (a reset), so a stalled client pins
its unsent bytes (at most about ``--sse-stall-bytes``) that long at most. A client that reads, however
slowly, is not stalled for time.

Once the headers are out, the writer registers :meth:`SSEWriter.probe` as the request's liveness probe
(:func:`node.api.serving.set_probe`): the connection of a client that sent FIN is probed with SSE
comments until ``[DONE]``, so that a client that left is noticed (node/api/serving.py).
"""

from __future__ import annotations

import asyncio
import struct
import sys
from dataclasses import dataclass
from typing import Callable

import msgspec
import structlog
from aiohttp import HttpVersion11, web

from node.api.errors import error_body
from node.api.serving import set_probe
from node.runtime.output import SeqDelta

log = structlog.get_logger("shiftnode.api")

_encode = msgspec.json.Encoder().encode

# A held token's size as an event, estimated (bytes): its id, text and JSON around them, and per top
# logprob entry (a token's text, its logprob and the JSON around them). Used against --sse-stall-bytes.
HELD_TOKEN_BYTES = 64
HELD_TOP_BYTES = 48
_WATCH_S = 0.1  # how often a congested stream's unsent bytes are looked at
CLOSE_GRACE_S = 10.0
"""Seconds a stalled client has to read its stream's end (the ``error`` event) before its connection is aborted."""
if sys.platform.startswith("linux"):
    import fcntl
    import termios

    _SIOCOUTQ = termios.TIOCOUTQ  # the same request on a TCP socket: unacknowledged bytes in the send queue
else:
    _SIOCOUTQ = None


@dataclass(frozen=True, slots=True)
class StreamLimits:
    """What a stream's client may leave unread (the module's docstring says what happens past each).

    Attributes:
        buffer_bytes: unsent bytes above which the stream is congested (deltas held and joined).
        stall_bytes: unsent plus held bytes above which the client is stalled.
        stall_s: seconds congested without progress (no byte acknowledged by the client) before it is stalled.
    """

    buffer_bytes: int = 1 << 20
    stall_bytes: int = 64 << 20
    stall_s: float = 60.0

    @classmethod
    def of(cls, config) -> "StreamLimits":
        """The limits of a :class:`~node.config.NodeConfig` (``--sse-buffer-bytes``, ``--sse-stall-bytes``, ``--sse-stall-s``)."""
        return cls(config.sse_buffer_bytes, config.sse_stall_bytes, config.sse_stall_s)


def _kernel_unacked(transport: asyncio.Transport) -> int:
    """Bytes in the connection's kernel send queue that the client has not acknowledged (Linux
    ``SIOCOUTQ``; 0 where it cannot be asked). The client's kernel acknowledges what fits in its receive
    window, which opens as the client reads: these bytes falling is the client reading, seen at once,
    where the transport's own buffer only shrinks when the kernel's queue has drained by a large part."""
    sock = transport.get_extra_info("socket")
    if sock is None or _SIOCOUTQ is None:
        return 0
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), _SIOCOUTQ, b"\0\0\0\0"))[0]
    except (OSError, ValueError):
        return 0


def held_bytes(token_ids: list, logprobs: list) -> int:
    """Estimated event bytes of held tokens ``token_ids`` with their ``logprobs`` (TokenLogprobs each)."""
    return HELD_TOKEN_BYTES * len(token_ids) + HELD_TOP_BYTES * sum(len(lp.top) for lp in logprobs)


class SSEWriter:
    """Streams events to one client. Writes raise ``ConnectionResetError`` once the client is gone.

    Args:
        request: the request answered.
        limits: backpressure limits (the module's docstring); default :class:`StreamLimits`'.
        on_stall: called once if the client is found stalled and its connection aborted (a metric's ``inc``).
    """

    def __init__(self, request: web.Request, limits: StreamLimits | None = None,
                 on_stall: Callable[[], None] | None = None):
        self.request = request
        self.limits = limits or StreamLimits()
        self._on_stall = on_stall
        self.held = 0  # estimated bytes of deltas the handler holds while congested (hold/release)
        self.stalled = False
        self._floor = self.limits.buffer_bytes  # unsent bytes at or under this: not congested (0 once [DONE] is out)
        self._since: float | None = None  # loop time of the last progress (bytes the client acknowledged) while congested
        self._written = 0  # bytes handed to the transport
        self._sent = 0  # of those, acknowledged by the client when last looked at (progress)
        self._watch: asyncio.TimerHandle | None = None
        self._drained: asyncio.Future | None = None
        self.response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # proxies must not buffer the stream
        })
        self._chunked = request.version == HttpVersion11
        self._ended = False  # [DONE] written: nothing more may follow

    async def prepare(self) -> None:
        """Send the status line and headers."""
        if self._chunked:
            self.response.enable_chunked_encoding()
        else:  # the close ends the body; say so, or a keep-alive HTTP/1.0 client waits for more
            self.response.force_close()
        await self.response.prepare(self.request)
        set_probe(self.request, self.probe)

    def send_many(self, payloads: list[dict]) -> None:
        """All ``payloads`` as consecutive events, in one write (nothing for an empty list)."""
        if payloads:
            self._write(b"".join([b"data: " + _encode(p) + b"\n\n" for p in payloads]))

    def send(self, payload: dict) -> None:
        self._write(b"data: " + _encode(payload) + b"\n\n")

    def comment(self, text: str) -> None:
        self._write(f": {text}\n\n".encode())

    def probe(self) -> None:
        """An empty SSE comment (``: ``), which clients skip: probes a half-closed connection's client
        (node/api/serving.py); nothing once the stream has ended."""
        if not self._ended:
            self._write(b": \n\n")

    async def done(self) -> None:
        """The ``[DONE]`` event and the end of the body. A client that has not taken the whole body
        within ``stall_s`` is stalled (aiohttp's ``write_eof`` waits for it)."""
        self._ended = True
        self._floor = 0
        self._write(b"data: [DONE]\n\n")
        await self.response.write_eof()
        self._disarm()

    # --- backpressure ---------------------------------------------------------------------------
    def congested(self) -> bool:
        """Whether the client has more than ``buffer_bytes`` unsent: the caller then holds its deltas
        (:meth:`hold`) instead of writing them, until this is False again."""
        if self.stalled:
            raise ConnectionResetError("the client stopped reading (stalled)")
        transport = self.request.transport
        if transport is None or transport.get_write_buffer_size() <= self._floor:
            return False
        self._arm()
        return True

    def hold(self, nbytes: int) -> None:
        """The caller holds ``nbytes`` more (:func:`held_bytes`) for this client.

        Raises:
            ConnectionResetError: past ``stall_bytes`` the client is stalled (the stream's end is queued,
                the module's docstring), now or before.
        """
        self.held += nbytes
        if self._check():
            raise ConnectionResetError("the client stopped reading (stalled)")

    def release(self) -> None:
        """The caller wrote (or dropped) everything it held."""
        self.held = 0

    async def drained(self) -> None:
        """Return once the unsent bytes are at most ``buffer_bytes``.

        Raises:
            ConnectionResetError: the client was stalled, or left, meanwhile.
        """
        while self.congested():  # raises once the client is stalled
            self._drained = asyncio.get_running_loop().create_future()
            await self._drained
        transport = self.request.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client closed the connection")

    def _arm(self) -> None:
        if self._since is None:
            self._since = asyncio.get_running_loop().time()
            transport = self.request.transport
            self._sent = self._written - transport.get_write_buffer_size() - _kernel_unacked(transport)
        if self._watch is None:
            self._watch = asyncio.get_running_loop().call_later(min(_WATCH_S, self.limits.stall_s / 4), self._tick)

    def _disarm(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        self._since = None

    def _wake(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def _tick(self) -> None:
        self._watch = None
        transport = self.request.transport
        if transport is None or transport.is_closing() or transport.get_write_buffer_size() <= self._floor:
            self._since = None
            self._wake()
            return
        sent = self._written - transport.get_write_buffer_size() - _kernel_unacked(transport)
        if sent > self._sent:  # the client reads, however slowly: not stalled for time
            self._sent = sent
            self._since = asyncio.get_running_loop().time()
        if not self._check():
            self._arm()

    def _check(self) -> bool:
        """Stall the client if it is past a limit; whether it is (or was)."""
        if self.stalled:
            return True
        transport = self.request.transport
        if transport is None or transport.is_closing():
            return False
        unsent = transport.get_write_buffer_size()
        waited = 0.0 if self._since is None else asyncio.get_running_loop().time() - self._since
        if unsent + self.held <= self.limits.stall_bytes and waited <= self.limits.stall_s:
            return False
        self.stalled = True
        log.warning("client_stalled", unsent_bytes=unsent, held_bytes=self.held, congested_s=round(waited, 2),
                    remote=self.request.remote)
        if self._on_stall is not None:
            self._on_stall()
        self._disarm()
        self._close_stalled(transport, unsent, waited)
        self._wake()  # a handler waiting in drained() raises now: its requests end and free their KV
        return True

    def _close_stalled(self, transport: asyncio.Transport, unsent: int, waited: float) -> None:
        """Queue the stream's end behind the unread bytes (an ``error`` event and ``[DONE]``, unless
        ``[DONE]`` is already out), close once they are sent, and abort :data:`CLOSE_GRACE_S` later if
        they are not."""
        if not self._ended:
            self._ended = True
            why = (f"the client stopped reading: {unsent + self.held} bytes unsent" if waited <= self.limits.stall_s
                   else f"the client read nothing for {waited:.1f} s")
            body = b"data: " + _encode(error_body(408, f"stream ended: {why}", code="client_stalled")) + b"\n\n"
            body += b"data: [DONE]\n\n"
            transport.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body) if self._chunked else body)
        transport.close()  # flushes what is queued first; then connection_lost
        asyncio.get_running_loop().call_later(CLOSE_GRACE_S, transport.abort)  # a no-op once closed

    def _write(self, data: bytes) -> None:
        transport = self.request.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        framed = b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data
        transport.write(framed)
        self._written += len(framed)
        if transport.get_write_buffer_size() > self._floor:
            self._arm()
            if self._check():
                raise ConnectionResetError("the client stopped reading (stalled)")


class Backlog:
    """The deltas a stream holds while its client is congested (:meth:`SSEWriter.congested`), per
    choice in order; :meth:`take` gives each choice's as one (:meth:`SeqDelta.joined`: one event
    where there would have been one per step)."""

    __slots__ = ("sse", "_parts")

    def __init__(self, sse: SSEWriter):
        self.sse = sse
        self._parts: dict[int, list[SeqDelta]] = {}

    def __bool__(self) -> bool:
        return bool(self._parts)

    def add(self, d: SeqDelta) -> None:
        """Hold ``d``; past ``stall_bytes`` the client is stalled (:meth:`SSEWriter.hold`)."""
        self._parts.setdefault(d.index, []).append(d)
        self.sse.hold(held_bytes(d.token_ids, d.logprobs))

    def take(self) -> list[SeqDelta]:
        """Every choice's held deltas joined, and none held any more."""
        out = [SeqDelta.joined(parts) for parts in self._parts.values()]
        self._parts.clear()
        self.sse.release()
        return out
