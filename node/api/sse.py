"""Server-Sent Events writer: ``data: {json}`` events, comment keep-alives, the closing ``[DONE]``."""

from __future__ import annotations

import json

from aiohttp import web


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
        await self.response.write(b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n")

    async def comment(self, text: str) -> None:
        await self.response.write(f": {text}\n\n".encode())

    async def done(self) -> None:
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
