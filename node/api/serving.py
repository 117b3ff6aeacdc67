"""Serving the application over HTTP until SIGINT/SIGTERM (``web.run_app``'s loop, on a TCP port or on the
unix socket behind the API front-end processes), with TCP half-close told apart from a departed client.

A client may shut the write side of its connection once its request is sent (``shutdown(SHUT_WR)``: a
FIN, "I send nothing more") and go on reading; ``nc -N`` and some proxies do. RFC 9112 §9.6 asks a
server to read on until it has sent its response. aiohttp answers every FIN by closing the connection,
which cancels the request: the client lost its answer. Keeping every FIN's connection open instead
(tried and reverted on 2026-12-04) held the KV of clients that had fully closed: on the wire a FIN
looks the same either way, and a departed client is only noticed when a write to it fails, which for
a request that writes nothing for a while (queued, a non-streamed answer, KV on the way to a peer)
came seconds later or never.

:class:`HalfCloseRequestHandler` keeps the connection of an HTTP/1.1 request read in full open after
the client's FIN and **probes** the client: a write it ignores, at once, again about one round trip
later (by then a departed client's RST is back, so it is noticed within milliseconds: a prompt being
prefilled for it is aborted before its first token) and then every :data:`PROBE_S` seconds until the
answer ends. A client that only half-closed reads and skips it. A
client that fully closed has its kernel answer the write with a RST; the next write then fails
(``EPIPE``/``ECONNRESET``), the transport reports the connection lost and the request is aborted and
its KV freed as for any disconnect. The probe is

- before the response has begun: an interim ``HTTP/1.1 100 Continue`` (RFC 9110 §15.2: a client must
  parse and skip 1xx responses before the final one, expected or not; §15.2.1: the request was received
  and is not yet rejected). ``103 Early Hints`` is not used: Python's ``http.client`` (and so
  ``requests``/``urllib3``) skips only 100 and would return a 103 as the final response;
- once an SSE stream has begun: an SSE comment ``: `` (the stream registers it with :func:`set_probe`,
  node/api/sse.py; SSE clients ignore comments);
- while a non-streamed response is being written: nothing (it ends within the write).

An HTTP/1.0 request cannot be probed before its response (no 1xx for HTTP/1.0, RFC 9110 §15.2), and a
request whose body was cut short can never be answered: their FIN still closes the connection at once,
as in aiohttp. Once the requests read before the FIN are answered, the connection closes; the last
response says so (``Connection: close``) when its head goes out after the FIN.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import Callable

from aiohttp import HttpVersion11, web
from aiohttp.web_protocol import RequestHandler

__all__ = ["ECHO_MIN_S", "INTERIM", "PROBE_S", "HalfCloseRequestHandler", "NodeRunner", "run", "set_probe"]

# Seconds between two probes of a half-closed connection after the first two (at the FIN, and a round trip
# later: a client that had fully closed is noticed by the second). They find a client that closes later
# (a FIN first, a RST for the probes only once it closes): within about PROBE_S. Shorter only adds writes
# (25 bytes each, 9 in a stream) for a client that stays.
PROBE_S = 0.25
# The second probe follows the one at the FIN after about a round trip (_echo_s), at least this long (s): the
# client's kernel answers the first with a RST within one round trip, so the second write fails at once.
ECHO_MIN_S = 0.002
INTERIM = b"HTTP/1.1 100 Continue\r\n\r\n"


class HalfCloseRequestHandler(RequestHandler):
    """aiohttp's HTTP/1.x protocol, answering the requests read before a client's FIN and probing the
    client meanwhile (the module's docstring says how and why)."""

    __slots__ = ("_answering", "_eof", "_probe_handle", "_response_probe")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._answering: web.BaseRequest | None = None  # the request being answered, from its creation
        self._eof = False  # the client sent FIN and the connection was kept open
        self._probe_handle: asyncio.TimerHandle | None = None
        self._response_probe: Callable[[], None] | None = None  # set_probe's, for the request being answered
        make = self._request_factory

        def request_factory(*args):  # start() makes the request and its task in one call: no gap
            self._answering, self._response_probe = make(*args), None
            return self._answering

        self._request_factory = request_factory

    async def _handle_request(self, request, start_time, request_handler):
        try:
            return await super()._handle_request(request, start_time, request_handler)
        finally:
            self._answering = self._response_probe = None
            if self._eof and not self._messages:  # all read before the FIN is answered: close after this one
                self.close()

    def _answerable(self) -> bool:
        """Whether every request read but not answered is HTTP/1.1 with its body in full (and there is one)."""
        request = self._answering
        if request is not None and (request.version < HttpVersion11 or not request.content.is_eof()):
            return False
        for message, payload in self._messages:
            version = getattr(message, "version", None)  # none: a parse error, answered by a 400 and a close
            if version is None or version < HttpVersion11 or not payload.is_eof():
                return False
        return request is not None or bool(self._messages)

    def eof_received(self) -> bool | None:
        """The client sent FIN. Keep the transport open for writing (True: asyncio stops reading) while an
        answerable request is unanswered, and probe the client; else None: the transport closes, as in aiohttp.
        (uvloop 0.23 reports the FIN twice: the second changes nothing.)"""
        if self._eof:
            return True
        if self._force_close or self._close or not self._answerable():
            return None
        self._eof = True
        self._probe(_echo_s(self.transport))
        return True

    def _probe(self, next_s: float = PROBE_S) -> None:
        """One probe (the module's docstring), then the next in ``next_s`` and every :data:`PROBE_S`
        after it, until nothing is left to answer."""
        self._probe_handle = None
        transport = self.transport
        if transport is None or transport.is_closing() or (self._answering is None and not self._messages):
            return
        request = self._answering
        try:
            if request is None or request.writer.output_size == 0:  # nothing of its response is on the wire
                transport.write(INTERIM)
            elif self._response_probe is not None:  # a response that has begun without one ends within its write
                self._response_probe()
        except ConnectionError:  # closing: connection_lost ends the request
            return
        self._probe_handle = self._loop.call_later(next_s, self._probe)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._probe_handle is not None:
            self._probe_handle.cancel()
            self._probe_handle = None
        super().connection_lost(exc)


def _echo_s(transport) -> float:
    """When to probe again after the probe at a FIN (s): once the first probe's RST can be back, so that a
    client that fully closed is noticed within about a round trip (milliseconds), not a :data:`PROBE_S`
    later. Twice the connection's smoothed RTT (Linux ``TCP_INFO``'s ``tcpi_rtt``, µs at byte 68), at
    least :data:`ECHO_MIN_S`, at most :data:`PROBE_S`; :data:`ECHO_MIN_S` where the RTT is not known."""
    sock = transport.get_extra_info("socket") if transport is not None else None
    rtt_s = 0.0
    if sock is not None and hasattr(socket, "TCP_INFO"):
        try:
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
            rtt_s = struct.unpack_from("I", info, 68)[0] / 1e6 if len(info) >= 72 else 0.0
        except (OSError, ValueError):  # a unix socket (behind the front ends), or no TCP_INFO
            pass
    return min(PROBE_S, max(ECHO_MIN_S, 2 * rtt_s))


def set_probe(request: web.BaseRequest, probe: Callable[[], None]) -> None:
    """Register ``probe``, which writes something harmless into ``request``'s response once it has begun
    (an SSE stream's comment), as the liveness probe of its connection should the client send FIN; it
    may raise ``ConnectionError``. Nothing on a connection not served by :class:`HalfCloseRequestHandler`."""
    protocol = request.protocol
    if isinstance(protocol, HalfCloseRequestHandler) and protocol._answering is request:
        protocol._response_probe = probe


async def _announce_close(request: web.BaseRequest, response: web.StreamResponse) -> None:
    """``Connection: close`` on the last response of a connection whose client sent FIN: the connection
    closes after it (RFC 9112 section 9.6: a server that will close says so), so a client or proxy that
    pools connections opens a new one for its next request instead of writing it into one about to close.
    A response whose head went out before the FIN cannot say it."""
    protocol = request.protocol
    if isinstance(protocol, HalfCloseRequestHandler) and protocol._eof and not protocol._messages:
        response.force_close()
        # on_response_prepare runs after aiohttp has computed the head's headers, before it writes them
        response.headers["Connection"] = "close"


class _Server(web.Server):
    """aiohttp's low-level server making :class:`HalfCloseRequestHandler` protocols."""

    def __call__(self) -> RequestHandler:
        return HalfCloseRequestHandler(self, loop=self._loop, **self._kwargs)


class NodeRunner(web.AppRunner):
    """``web.AppRunner`` whose connections use :class:`HalfCloseRequestHandler` (the single-process
    node, the control process behind the front ends, and each API front end)."""

    __slots__ = ()

    async def _make_server(self) -> web.Server:
        if _announce_close not in self.app.on_response_prepare:  # before super() freezes the app's signals
            self.app.on_response_prepare.append(_announce_close)
        server = await super()._make_server()
        # The application builds a plain Server (Application._make_handler, private); it has no slots,
        # so giving it the subclass changes only which protocol it makes per connection.
        server.__class__ = _Server
        return server


def run(app: web.Application, *, loop: asyncio.AbstractEventLoop, shutdown_timeout: float,
        on_ready: Callable[[], None], host: str | None = None, port: int | None = None,
        path: str | None = None) -> None:
    """Serve ``app`` on ``host:port`` (or the unix socket ``path``: behind the API front-end
    processes) until SIGINT/SIGTERM, as ``web.run_app`` does (handler cancellation on a lost
    connection, no access log), with :class:`NodeRunner`. Errors of the application's start-up (its
    ``cleanup_ctx``) propagate. ``shutdown_timeout``: seconds open requests get to end after the signal
    before their handlers are cancelled. Closes ``loop``."""

    async def serve() -> None:
        runner = NodeRunner(app, handle_signals=True, handler_cancellation=True, access_log=None,
                            shutdown_timeout=shutdown_timeout)
        await runner.setup()
        try:
            site = web.UnixSite(runner, path) if path is not None else web.TCPSite(runner, host, port)
            await site.start()
            on_ready()
            await asyncio.Event().wait()  # until the signal handler raises GracefulExit
        finally:
            await runner.cleanup()

    asyncio.set_event_loop(loop)
    main = loop.create_task(serve())
    try:
        loop.run_until_complete(main)
    except (web.GracefulExit, KeyboardInterrupt):
        pass
    finally:
        if not main.done():  # stopped by the signal: the task's finally runs the cleanup
            main.cancel()
            loop.run_until_complete(asyncio.gather(main, return_exceptions=True))
        rest = asyncio.all_tasks(loop)
        for t in rest:
            t.cancel()
        loop.run_until_complete(asyncio.gather(*rest, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
