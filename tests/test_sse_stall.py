"""A stalled client's stream ends with an error event it can still read (node/api/sse.py), checked on an
in-process aiohttp server with tiny limits: the handler learns at once (its requests would end there), and a
client that reads again gets every byte sent, the ``client_stalled`` error event, ``[DONE]`` and the body's
end, then EOF (not a reset)."""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web

import node.api.sse as sse_module
from node.api.sse import SSEWriter, StreamLimits
from support import dechunk, sse_events

pytestmark = pytest.mark.quick

EVENT = {"text": "y" * 1000}


async def _serve(limits: StreamLimits, ended: asyncio.Event, reason: list) -> tuple[web.AppRunner, int]:
    async def handler(request: web.Request) -> web.StreamResponse:
        sse = SSEWriter(request, limits)
        await sse.prepare()
        try:
            while True:  # as node.api.openai does: write while the client keeps up, hold while it is congested
                if sse.congested():
                    sse.hold(2000)
                else:
                    sse.send(EVENT)
                await asyncio.sleep(0.001)
        except ConnectionResetError as e:
            reason.append(str(e))
            ended.set()
        return sse.response

    app = web.Application()
    app.router.add_get("/stream", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


def _connect(port: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window stays small
    s.connect(("127.0.0.1", port))
    s.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
    return s


def _read_all(s: socket.socket) -> bytes:
    s.settimeout(10)
    got = b""
    while chunk := s.recv(1 << 20):  # a reset raises here: the test fails
        got += chunk
    return got


@pytest.mark.parametrize("limit", ["time", "bytes"])
def test_a_stalled_client_reads_an_error_event_then_the_end_of_its_stream(limit):
    limits = (StreamLimits(buffer_bytes=16384, stall_bytes=1 << 30, stall_s=0.3) if limit == "time"
              else StreamLimits(buffer_bytes=16384, stall_bytes=200_000, stall_s=600.0))

    async def go():
        ended, reason = asyncio.Event(), []
        runner, port = await _serve(limits, ended, reason)
        loop = asyncio.get_running_loop()
        s = await loop.run_in_executor(None, _connect, port)
        try:
            await asyncio.wait_for(ended.wait(), 30)  # the handler is told while the client reads nothing
            assert "stalled" in reason[0]
            return await loop.run_in_executor(None, _read_all, s)  # the client reads again
        finally:
            s.close()
            await runner.cleanup()

    got = asyncio.run(go())
    head, _, payload = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    events = sse_events(dechunk(payload).decode().split("\n"))  # ends with [DONE], and the body's last chunk
    error = events[-2]["error"]
    assert error["code"] == "client_stalled" and error["type"] == "invalid_request_error", error
    assert ("read nothing" if limit == "time" else "bytes unsent") in error["message"], error
    assert len(events) > 10 and all(e == EVENT for e in events[:-2])  # what was sent before, intact


def test_a_stalled_client_that_never_reads_is_cut_after_the_grace(monkeypatch):
    """Past CLOSE_GRACE_S the connection is aborted: what the node still held for the client (the error
    event among it) is dropped, and the client, reading at last, gets what its kernel had, then the end."""
    monkeypatch.setattr(sse_module, "CLOSE_GRACE_S", 0.2)

    async def go():
        ended, reason = asyncio.Event(), []
        runner, port = await _serve(StreamLimits(buffer_bytes=16384, stall_bytes=1 << 30, stall_s=0.3), ended, reason)
        loop = asyncio.get_running_loop()
        s = await loop.run_in_executor(None, _connect, port)
        try:
            await asyncio.wait_for(ended.wait(), 30)
            await asyncio.sleep(1.0)  # past the grace, still unread
            return await loop.run_in_executor(None, _read_until_closed, s)
        finally:
            s.close()
            await runner.cleanup()

    got = asyncio.run(go())
    assert got.startswith(b"HTTP/1.1 200") and b"client_stalled" not in got and not got.endswith(b"0\r\n\r\n")


def _read_until_closed(s: socket.socket) -> bytes:
    """What arrives until the server's end closes (EOF, or a reset), within 10 s."""
    s.settimeout(10)
    got = b""
    try:
        while chunk := s.recv(1 << 20):
            got += chunk
    except ConnectionResetError:
        pass
    return got
