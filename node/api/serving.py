"""Serving the application over HTTP: aiohttp's server, with TCP half-close kept open.

A client may shut the write side of its connection once its request is sent (``shutdown(SHUT_WR)``:
a FIN, "I send nothing more") and go on reading the answer; HTTP/1.1 allows it (RFC 9112 §9.6 asks
a server to read on until it has sent its response) and tools such as ``nc -N`` or ``curl`` behind
some proxies do it. aiohttp's protocol answers the FIN by letting the transport close the
connection, which cancels the request's handler: the stream was aborted as if the client had left.
:class:`HalfCloseRequestHandler` keeps the connection open for writing while a request it has read
in full is being answered, and closes it once that answer is sent. A client that really left is
still seen: the next write to its socket fails (``ECONNRESET``/``EPIPE``), one or two steps later.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

__all__ = ["HalfCloseRequestHandler", "NodeRunner", "run"]


class HalfCloseRequestHandler(RequestHandler):
    """aiohttp's HTTP/1.x protocol, keeping a half-closed connection open until its answer is sent."""

    __slots__ = ("_answered",)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._answered = 0  # requests whose answer ended (finish_response ran); _request_count: those read

    async def finish_response(self, request, resp, start_time):
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            self._answered += 1

    def eof_received(self) -> bool | None:
        """The client sent FIN. Return True (keep the transport open for writing) while a request read
        in full is unanswered (queued, about to start, or being answered); the connection then takes
        no further request and closes after that answer (``close``). An idle connection, or one whose
        request body was cut short (it can never be answered), closes now (None: the transport closes,
        as aiohttp does)."""
        if self._request_count <= self._answered:
            return None
        current = self._current_request
        if current is not None and not current.content.is_eof():
            return None
        if any(not payload.is_eof() for _, payload in self._messages):
            return None
        self.close()
        return True


class _Server(web.Server):
    """aiohttp's low-level server making :class:`HalfCloseRequestHandler` protocols."""

    def __call__(self) -> RequestHandler:
        return HalfCloseRequestHandler(self, loop=self._loop, **self._kwargs)


class NodeRunner(web.AppRunner):
    """``web.AppRunner`` whose connections use :class:`HalfCloseRequestHandler`."""

    __slots__ = ()

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # The application builds a plain Server (Application._make_handler, private); it has no
        # slots, so giving it the subclass changes only which protocol it makes per connection.
        server.__class__ = _Server
        return server


def run(app: web.Application, *, loop: asyncio.AbstractEventLoop, shutdown_timeout: float,
        on_ready: Callable[[], None], host: str | None = None, port: int | None = None,
        path: str | None = None) -> None:
    """Serve ``app`` on ``host:port`` (or the unix socket ``path``: behind the API front-end
    processes) until SIGINT/SIGTERM, as ``web.run_app`` does (the same runner
    arguments as before: handler cancellation on a lost connection, no access log), with
    :class:`NodeRunner`. Errors of the application's start-up (its ``cleanup_ctx``) propagate.
    ``shutdown_timeout``: seconds open requests get to end after the signal before their handlers are
    cancelled. Closes ``loop``."""

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
