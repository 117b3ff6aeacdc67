"""Server-Sent Events writer: ``data: {json}`` events, comment keep-alives, the closing ``[DONE]``.

Events are encoded with msgspec (UTF-8, no ASCII escaping; a non-finite float becomes ``null``, so
every event is valid JSON) and the events of one step go out in one write.

Writes are synchronous: once :meth:`SSEWriter.prepare` has sent the headers (an aiohttp
``StreamResponse`` sends them in ``prepare``), each write frames its bytes as one HTTP/1.1 chunk
(``Transfer-Encoding: chunked``, enabled explicitly) and hands them to the connection's transport,
so a step's post-processing can write every stream's events without a coroutine per write.
HTTP/1.0 clients get the bytes unframed, the body ending when the connection closes (what aiohttp
does for them too). Nothing waits for the client to read: a slow reader's events queue in the
transport, a few hundred bytes per token and at most the request's ``max_tokens`` of them (aiohttp's
own writer would wait above 64 KiB, and the deltas would queue in the request's DeltaStream instead).

Once the headers are out, the writer registers :meth:`SSEWriter.probe` as the request's liveness probe
(:func:`node.api.serving.set_probe`): the connection of a client that sent FIN is probed with SSE
comments until ``[DONE]``, so that a client that left is noticed (node/api/serving.py).
"""

from __future__ import annotations

import msgspec
from aiohttp import HttpVersion11, web

from node.api.serving import set_probe

_encode = msgspec.json.Encoder().encode


class SSEWriter:
    """Streams events to one client. Writes raise ``ConnectionResetError`` once the client is gone."""

    def __init__(self, request: web.Request):
        self.request = request
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
        """The ``[DONE]`` event and the end of the body."""
        self._ended = True
        self._write(b"data: [DONE]\n\n")
        await self.response.write_eof()

    def _write(self, data: bytes) -> None:
        transport = self.request.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data)
