"""Server-Sent Events writer: ``data: {json}`` events, comment keep-alives, the closing ``[DONE]``.

Events are encoded with msgspec (UTF-8, no ASCII escaping; a non-finite float becomes ``null``, so
every event is valid JSON) and the events of one wake-up go out in one write.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

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

    async def prepare(self) -> None:
        await self.response.prepare(self.request)

    async def send(self, payload: dict) -> None:
        await self.response.write(b"data: " + _encode(payload) + b"\n\n")

    async def send_many(self, payloads: list[dict]) -> None:
        """All ``payloads`` as consecutive events, in one write (nothing for an empty list)."""
        if payloads:
            await self.response.write(b"".join(b"data: " + _encode(p) + b"\n\n" for p in payloads))

    async def comment(self, text: str) -> None:
        await self.response.write(f": {text}\n\n".encode())

    async def done(self) -> None:
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
