"""The control process's end of the API front ends' links (``--api-processes`` > 1).

Each front end connects to one unix socket (:class:`LinkServer`); its :class:`FrontendLink` admits
the requests it opens (``check_admission`` and ``open_request``, as the single-process handler does,
without detokenization: :class:`~node.runtime.token_output.TokenOutputState`), closes them when the
front end is done with them (which aborts what still runs and frees its KV), and adds the front
end's latency metrics to the node's.

Deltas leave in one :class:`~node.api.link_protocol.Step` frame per front end per step: a request's
stream here is a :class:`_Sink` whose ``push`` appends to its link's batch, and the first push after
a write schedules one ``loop.call_soon`` that encodes the whole batch once the step's
post-processing has pushed everything and writes it with the admissions answered meanwhile, in one
system call (:class:`~node.api.link_protocol.FrameWriter`). The control loop's work per plain token
(not a choice's first, no logprobs, ends nothing) is three ints appended to the link's current run
(:meth:`_Sink.plain`); any other token is a small struct (:class:`~node.runtime.token_output.TokenDelta`,
made by the sequence's output state).
"""

from __future__ import annotations

import asyncio
import os
import signal
from contextlib import suppress
from typing import Callable

import msgspec
import structlog
from aiohttp import web

from node.api.frontend_metrics import apply
from node.api.link_protocol import (Admitted, Close, FrameReader, FrameWriter, MetricsDelta, Open, Ping, Pong, Ready,
                                    Step, frame)
from node.runtime.admission import EnginesDown, KVCapacityExceeded, NodeDraining, QueueFullError
from node.runtime.interfaces import ApiNode
from node.runtime.output import SeqDelta
from node.runtime.request import RequestState
from node.runtime.token_output import TokenDelta

log = structlog.get_logger("shiftnode.api")


def refusal_kind(e: QueueFullError) -> str:
    """The :class:`Admitted` refusal naming ``e`` (the front end raises the same class again)."""
    if isinstance(e, NodeDraining):
        return "draining"
    if isinstance(e, EnginesDown):
        return "engine_down"
    if isinstance(e, KVCapacityExceeded):
        return "kv_capacity"
    return "overloaded"


class _Sink:
    """A request's stream in the control process: its deltas join the link's batch for this step."""

    __slots__ = ("link", "key")

    def __init__(self, link: "FrontendLink", key: int):
        self.link = link
        self.key = key

    def push(self, delta: TokenDelta | SeqDelta) -> None:
        if type(delta) is not TokenDelta:  # an error made by RequestState.fail
            delta = TokenDelta.of(self.key, delta)
        delta.key = self.key
        link = self.link  # FrontendLink.push inlined
        link.pending.append(delta)
        link.run = None  # later plain tokens start a new run: the frame keeps the order of production
        if not link._scheduled:
            link.schedule()

    def plain(self, index: int, token_id: int) -> None:
        """A plain token of choice ``index`` (no text, logprobs or end; not the choice's first): three
        ints appended to the link's current run (``RequestState.plain``; once per streamed token)."""
        link = self.link
        run = link.run
        if run is None:
            run = link.run = []
            link.pending.append(run)
            if not link._scheduled:
                link.schedule()
        run += (self.key, index, token_id)


class FrontendLink(FrameWriter, asyncio.Protocol):
    """One front end's connection (the control side)."""

    def __init__(self, node: ApiNode, server: "LinkServer"):
        super().__init__()
        self.node = node
        self.server = server
        self.reader = FrameReader()
        self.reqs: dict[int, RequestState] = {}  # the front end's key → the request
        self.pending: list[TokenDelta | list[int]] = []  # this step's deltas and runs of plain tokens, in order
        self.run: list[int] | None = None  # the last entry of ``pending`` when it is a run (see Step)
        self.pid: int | None = None
        self.heard_s = self._loop.time()  # when the front end last sent anything (a Pong at least every WATCH_S)

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.server.links.add(self)

    def data_received(self, data: bytes) -> None:
        self.heard_s = self._loop.time()
        try:
            messages = self.reader.feed(data)
        except msgspec.DecodeError as e:  # a front end of another version, or a bug: drop it
            log.error("frontend_link_corrupt", pid=self.pid, error=str(e))
            self.transport.close()
            return
        for m in messages:
            try:
                self.handle(m)
            except Exception as e:  # noqa: BLE001 - one bad message must not take the link down
                log.exception("frontend_message_failed", pid=self.pid, message=type(m).__name__, error=str(e))

    def handle(self, m) -> None:
        kind = type(m)
        if kind is Open:
            self._open(m)
        elif kind is Close:
            self._close(m)
        elif kind is MetricsDelta:
            apply(self.node.metrics, m)
        elif kind is Ready:
            self.pid = m.pid
            self.server.ready(self)
        elif kind is Pong:
            pass  # heard_s is set for any frame

    def _open(self, m: Open) -> None:
        node = self.node
        opened: list[RequestState] = []
        try:
            node.check_admission(len(m.jobs))  # all the prompts, or none of them
            for job in m.jobs:
                req = node.open_request(job.request_id, job.prompt_ids, job.params, job.n, stream=_Sink(self, job.key),
                                        index0=job.index0, detokenize=False)
                req.log_line = False  # the front end logs it, off this loop
                opened.append(req)
                self.reqs[job.key] = req
        except QueueFullError as e:
            for job, req in zip(m.jobs, opened):
                self.reqs.pop(job.key, None)
                node.close_request(req)
            self.send(frame(Admitted(m.ticket, refusal_kind(e), str(e))))
            return
        self.send(frame(Admitted(m.ticket)))

    def _close(self, m: Close) -> None:
        req = self.reqs.pop(m.key, None)
        if req is None:
            return
        # what the client saw, for the node's request metrics and log line (closing accounts nothing else)
        req.reasons[:] = m.reasons
        req.tokens[:] = m.tokens
        req.stats.output_tokens = sum(m.tokens)
        if m.ttft_s is not None:
            req.first_s[0] = req.stats.arrival_s + m.ttft_s
        self.node.close_request(req)

    def push(self, wd: TokenDelta) -> None:
        self.pending.append(wd)
        self.run = None
        self.schedule()

    def last_frame(self) -> bytes | None:
        """Every delta pushed since the last flush, as one :class:`Step` (after any :class:`Admitted`)."""
        if not self.pending:
            return None
        items, self.pending, self.run = self.pending, [], None
        return frame(Step(items))

    def connection_lost(self, exc: Exception | None) -> None:
        """The front end is gone (exited, or the node is closing): its requests end, their KV is freed."""
        self.server.links.discard(self)
        if self.pid in self.server.pids:  # GET /v1/node lists the front ends that serve
            self.server.pids.remove(self.pid)
        if not self.server.closing:
            log.error("frontend_exited", pid=self.pid, requests=len(self.reqs), error=str(exc) if exc else None)
        reqs, self.reqs = self.reqs, {}
        for req in reqs.values():
            self.node.close_request(req)


class LinkServer:
    """The unix socket the front ends connect to, and their links.

    Args:
        node: the node whose requests the front ends open.
        path: the socket's path.
        expected: how many front ends will connect (logged as ready once all listen).
    """

    def __init__(self, node: ApiNode, path: str, expected: int):
        self.node = node
        self.path = path
        self.expected = expected
        self.links: set[FrontendLink] = set()
        self.pids: list[int] = []
        self.closing = False
        self.all_ready = asyncio.Event()
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)
        self._server = await asyncio.get_running_loop().create_unix_server(
            lambda: FrontendLink(self.node, self), self.path)

    def ready(self, link: FrontendLink) -> None:
        self.pids.append(link.pid)
        if len(self.pids) == self.expected:
            self.all_ready.set()
            log.info("api_processes_ready", pids=self.pids, port=self.node.config.port)

    async def close(self) -> None:
        self.closing = True
        if self._server is not None:
            self._server.close()
        for link in list(self.links):
            link.transport.close()
        with suppress(OSError):
            os.unlink(self.path)


RESPAWN_BACKOFF_S = 1.0  # wait before restarting a front end that exited; doubles per restart within the window
RESPAWN_BACKOFF_MAX_S = 30.0
RESPAWN_WINDOW_S = 300.0  # restarts of one front end older than this no longer lengthen the wait
WATCH_S = 0.5  # how often the front ends' processes are polled (which also reaps one that exited) and pinged


def link_ctx(path: str, procs: list, node_key: web.AppKey, respawn: Callable[[int], int], heartbeat_timeout_s: float = 10.0):
    """An aiohttp ``cleanup_ctx`` entry (append it after the node's): open the link socket once the node
    runs, close it (ending the front ends) before the node closes. The server is kept at ``app[LINK_KEY]``.

    ``procs`` (the front ends' ``multiprocessing.Process`` objects, by index) are watched: one that
    exits before all listen (it could not load the tokenizer or bind the port) stops the node (SIGTERM
    to this process), which would otherwise run without a listener. One that exits later (killed,
    crashed) is reaped, its requests end (:meth:`FrontendLink.connection_lost`) and it is started again
    by ``respawn(index)`` after a backoff (:data:`RESPAWN_BACKOFF_S` doubling per restart within
    :data:`RESPAWN_WINDOW_S`, at most :data:`RESPAWN_BACKOFF_MAX_S`); meanwhile the others serve the
    port and ``/health`` says the node is degraded (``node.api_down``).

    A front end that listens but is hung (its event loop stuck, or its process stopped) is found by a
    heartbeat: every :data:`WATCH_S` each ready front end gets a :class:`Ping`, answered from its loop;
    one that has sent nothing for ``heartbeat_timeout_s`` is killed (SIGKILL), its requests end and it is
    started again as above (``/health`` says it hung)."""
    restarts: dict[int, list[float]] = {}
    hung: dict[int, str] = {}  # pid → why it was killed (the heartbeat), for the reason /health gives

    async def revive(node, i: int, p) -> None:
        loop = asyncio.get_running_loop()
        recent = restarts.setdefault(i, [])
        recent[:] = [t for t in recent if t > loop.time() - RESPAWN_WINDOW_S]
        delay = min(RESPAWN_BACKOFF_MAX_S, RESPAWN_BACKOFF_S * 2 ** len(recent))
        what = f"pid {p.pid} {hung.pop(p.pid, 'exited')} (exit code {p.exitcode})"
        log.error("api_process_exited", index=i, pid=p.pid, exitcode=p.exitcode, restart_in_s=delay)
        node.api_down[i] = f"{what}; restarting in {delay:g} s"
        await asyncio.sleep(delay)
        recent.append(loop.time())
        pid = await loop.run_in_executor(None, respawn, i)
        node.api_down[i] = f"{what}; restarting now (pid {pid})"
        while pid not in node.api_pids and procs[i].exitcode is None:  # until it listens, or dies again
            await asyncio.sleep(0.05)
        if pid in node.api_pids:
            del node.api_down[i]
            log.warning("api_process_restarted", index=i, pid=pid)

    async def watch(server: LinkServer) -> None:
        while not server.all_ready.is_set():
            dead = [p for p in procs if p.exitcode is not None]
            if dead:
                log.error("api_process_failed_to_start", pid=dead[0].pid, exitcode=dead[0].exitcode)
                os.kill(os.getpid(), signal.SIGTERM)
                return
            with suppress(TimeoutError):
                await asyncio.wait_for(server.all_ready.wait(), 0.5)
        node = server.node
        reviving: dict[int, asyncio.Task] = {}
        loop = asyncio.get_running_loop()
        ping = 0
        try:
            while True:
                slept = loop.time()
                await asyncio.sleep(WATCH_S)
                # this loop itself was held up (a long callback): the front ends' answers may wait unread
                # behind this timer (uvloop runs timers before it polls), so judge nobody this round
                judge = loop.time() - slept < 2 * WATCH_S
                ping += 1
                ours = {p.pid for p in procs}
                for link in list(server.links):
                    if link.pid is None or link.pid not in ours:
                        continue  # not listening yet: its start is watched below
                    silent = loop.time() - link.heard_s
                    if judge and silent > heartbeat_timeout_s and link.pid not in hung:
                        hung[link.pid] = f"hung (no heartbeat for {silent:.1f} s), killed"
                        log.error("api_process_hung", pid=link.pid, silent_s=round(silent, 1))
                        with suppress(ProcessLookupError):
                            os.kill(link.pid, signal.SIGKILL)
                    else:
                        link.send(frame(Ping(ping)))
                for i, p in enumerate(procs):
                    task = reviving.get(i)
                    if task is not None and not task.done():
                        continue
                    if p.exitcode is not None and not server.closing:
                        reviving[i] = asyncio.create_task(revive(node, i, p), name=f"api-respawn-{i}")
        finally:
            for task in reviving.values():
                task.cancel()

    async def ctx(app: web.Application):
        server = LinkServer(app[node_key], path, len(procs))
        await server.start()
        app[LINK_KEY] = server
        app[node_key].api_pids = server.pids  # for GET /v1/node
        watcher = asyncio.create_task(watch(server))
        yield
        watcher.cancel()
        await server.close()

    return ctx


LINK_KEY = web.AppKey("frontend_links", LinkServer)
