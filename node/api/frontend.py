"""API front-end processes (``--api-processes N`` > 1): the per-token work off the control loop.

Layout (vLLM's API server count is the model): ``shiftnode serve`` forks N front ends before its
event loop starts (:func:`launch_frontends`); each listens on ``--host:--port`` itself with
``SO_REUSEPORT`` (the kernel spreads connections over them) and owns the requests that arrive on
its connections: body decoding, validation, tokenization, detokenization, stop strings, SSE framing
and socket writes. The control process keeps the one event loop that owns the policies, drivers and
engines; it admits requests and sends each front end the tokens of its requests once per step
(:mod:`node.api.frontend_link`). Every other route (``/health``, ``/metrics``, ``/v1/node``,
``/v1/models``, drain, peers, ``/dashboard``, ``/openapi.json``) is forwarded to the control
process's own aiohttp application on a unix socket, so it answers exactly as with one process.

A front end ends when its link to the control process closes (the node stopped or died): its open
streams end with a 503 ``engine_down`` error event, and it exits. A front end that dies while the node
runs is reaped and started again (:func:`~node.api.frontend_link.link_ctx`, :meth:`Frontends.respawn`). It ignores SIGINT (a terminal's
Ctrl-C reaches the whole process group; the control process's shutdown closes the links).
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass

import aiohttp
import structlog
from aiohttp import web

from node.api.app import GC_THRESHOLDS, auth_middleware, errors_middleware
from node.api.cors import install_cors
from node.api.errors import error_response
from node.api.frontend_node import FrontNode
from node.api.link_protocol import Admitted, FrameReader, FrameWriter, Ping, Pong, Ready, Step, frame
from node.api.openai import NODE_KEY, chat_completions, completions
from node.api.request_ids import echo_request_id
from node.api.serving import NodeRunner
from node.config import NodeConfig
from node.log_native import stderr_uncaptured

log = structlog.get_logger("shiftnode.frontend")

_HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "host",
                         "content-length", "date", "server"})
SESSION_KEY = web.AppKey("control_session", aiohttp.ClientSession)


class ControlLink(FrameWriter, asyncio.Protocol):
    """The front end's end of its link: frames from the control process go to the :class:`FrontNode`;
    its own (opens, closes, metrics) leave once per loop iteration, together."""

    def __init__(self):
        super().__init__()
        self.reader = FrameReader()
        self.front: FrontNode | None = None
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        for m in self.reader.feed(data):
            if type(m) is Step:
                self.front.on_step(m)
            elif type(m) is Admitted:
                self.front.on_admitted(m)
            elif type(m) is Ping:  # answered from this loop: a stuck loop stops answering (frontend_link.py)
                self.send(frame(Pong(m.seq)))

    def connection_lost(self, exc: Exception | None) -> None:
        if self.front is not None:
            self.front.on_lost("the node's control process is gone" + (f": {exc}" if exc else ""))
        if not self.closed.done():
            self.closed.set_result(None)


async def forward(request: web.Request) -> web.StreamResponse:
    """Any route but the completions: answered by the control process's application, as is."""
    session = request.app[SESSION_KEY]
    body = await request.read()
    headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
    try:
        async with session.request(request.method, "http://control" + request.path_qs, headers=headers,
                                   data=body if body else None, allow_redirects=False) as r:
            data = await r.read()
            out = {k: v for k, v in r.headers.items() if k.lower() not in _HOP_BY_HOP}
            return web.Response(status=r.status, body=data, headers=out)
    except aiohttp.ClientError as e:
        return error_response(503, f"the node's control process did not answer: {e}", code="engine_down",
                              headers={"Retry-After": "1"})


def frontend_app(config: NodeConfig, front: FrontNode, control_http: str) -> web.Application:
    """The front end's application: the completions handlers here, everything else forwarded."""
    app = web.Application(middlewares=[errors_middleware, auth_middleware(config.api_key)],
                          client_max_size=config.max_body_bytes)
    app[NODE_KEY] = front

    async def session_ctx(app: web.Application):
        app[SESSION_KEY] = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=control_http),
                                                 auto_decompress=False, timeout=aiohttp.ClientTimeout(total=None))
        yield
        await app[SESSION_KEY].close()

    app.cleanup_ctx.append(session_ctx)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_route("*", "/{tail:.*}", forward)
    app.on_response_prepare.append(echo_request_id)
    install_cors(app, config.serving)
    return app


async def _serve(config: NodeConfig, info, index: int, paths: "FrontendPaths", parent: int) -> int:
    loop = asyncio.get_running_loop()
    while True:  # the control process opens the link once its node runs (loading may take minutes)
        if os.getppid() != parent:
            return 1
        try:
            _, link = await loop.create_unix_connection(ControlLink, paths.link)
            break
        except (FileNotFoundError, ConnectionRefusedError):
            await asyncio.sleep(0.05)
    front = FrontNode(config, info, index, link.send)
    link.front = front
    runner = NodeRunner(frontend_app(config, front, paths.http), handler_cancellation=True, access_log=None,
                        shutdown_timeout=1)  # a half-closed client is probed, not dropped (serving.py)
    await runner.setup()
    await web.TCPSite(runner, config.host, config.port, reuse_port=True).start()
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    link.send(frame(Ready(os.getpid())))
    await link.closed
    await runner.cleanup()
    return 0


def frontend_main(config: NodeConfig, index: int, paths: "FrontendPaths", parent: int) -> None:
    """The front-end process (forked by :func:`launch_frontends`): load the tokenizer, wait for the
    control process's link, listen, serve until the link closes."""
    import uvloop

    from node.log import configure_logging
    from node.worker.loader import load_model_info

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):  # named for ps/top, as the engines are
        ctypes.CDLL(None).prctl(15, f"shiftnode-api-{index}".encode()[:15])  # PR_SET_NAME
    configure_logging(config.log_format, config.log_level, config.log_requests)
    info = load_model_info(config)  # the control process reports a failure to load it
    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    sys.exit(loop.run_until_complete(_serve(config, info, index, paths, parent)))


@dataclass
class FrontendPaths:
    """Where the front ends meet the control process: the link socket and its HTTP socket."""

    folder: str
    link: str
    http: str


class Frontends:
    """The front-end processes of a node (forked at start; :meth:`respawn` starts one that exited
    again); :meth:`stop` ends them."""

    def __init__(self, config: NodeConfig, count: int):
        self.config = config
        folder = tempfile.mkdtemp(prefix="shiftnode-api-")
        self.paths = FrontendPaths(folder, os.path.join(folder, "link.sock"), os.path.join(folder, "http.sock"))
        ctx = multiprocessing.get_context("fork")
        self.procs = [ctx.Process(target=frontend_main, args=(config, i, self.paths, os.getpid()),
                                  name=f"shiftnode-api-{i}", daemon=True) for i in range(count)]
        with stderr_uncaptured():  # the children's descriptor 2 is the real one (node.log_native)
            for p in self.procs:
                p.start()

    def respawn(self, index: int) -> int:
        """Start front end ``index`` again (its process exited; it was reaped). Returns the new pid.

        Spawned, not forked: the control process now runs its event loop, threads and engine links,
        which a forked child would inherit. The new process loads the tokenizer, connects to the link
        socket and listens on the port with ``SO_REUSEPORT`` beside the others, as the first did."""
        ctx = multiprocessing.get_context("spawn")
        p = ctx.Process(target=frontend_main, args=(self.config, index, self.paths, os.getpid()),
                        name=f"shiftnode-api-{index}", daemon=True)
        with stderr_uncaptured():
            p.start()
        self.procs[index] = p
        return p.pid

    def stop(self, timeout_s: float = 5.0) -> None:
        """Wait for the front ends to leave (their links are closed by now), then terminate what remains."""
        for p in self.procs:
            p.join(timeout_s)
            if p.is_alive():
                p.terminate()
                p.join(2)
        shutil.rmtree(self.paths.folder, ignore_errors=True)


def launch_frontends(config: NodeConfig, count: int) -> Frontends:
    """Fork ``count`` front ends now: before the event loop and before the engines are forked, so no
    front end holds an engine's socket open."""
    return Frontends(config, count)
