"""Serving the application over HTTP until SIGINT/SIGTERM (``web.run_app``'s loop, on a TCP port or on the
unix socket behind the API front-end processes).

A client's FIN ends its request, as in aiohttp and vLLM: the handler is cancelled and the request's KV
freed at once. A client that only shuts its write side (TCP half-close, ``shutdown(SHUT_WR)``) and goes
on reading looks the same on the wire until a write to it fails, which for a request still waiting
(queued, or its KV on the way to a peer) may be seconds away; keeping such connections open held the
work of clients that had left (the pooled and cross-node leak tests caught it), so half-closed clients
are not served.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from aiohttp import web

__all__ = ["run"]


def run(app: web.Application, *, loop: asyncio.AbstractEventLoop, shutdown_timeout: float,
        on_ready: Callable[[], None], host: str | None = None, port: int | None = None,
        path: str | None = None) -> None:
    """Serve ``app`` on ``host:port`` (or the unix socket ``path``: behind the API front-end
    processes) until SIGINT/SIGTERM, as ``web.run_app`` does (the same runner
    arguments as before: handler cancellation on a lost connection, no access log). Errors of the application's start-up (its ``cleanup_ctx``) propagate.
    ``shutdown_timeout``: seconds open requests get to end after the signal before their handlers are
    cancelled. Closes ``loop``."""

    async def serve() -> None:
        runner = web.AppRunner(app, handle_signals=True, handler_cancellation=True, access_log=None,
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
