"""``GET /dashboard``: the node's live role dashboard, one self-contained HTML page (dashboard.html).

The page polls ``GET /v1/node?since=...`` and draws each device's role as a timeline of bands, the
queue, KV usage, TTFT/ITL quantiles, switches, transfers and peers; nothing is fetched from anywhere
else. With ``--api-key`` the page is behind the key like ``/v1/*``: a browser cannot set an
``Authorization`` header on a navigation, so the key may come as ``?key=...`` (the page then moves it
into ``sessionStorage``, takes it out of the address bar, and sends it as ``Authorization: Bearer``
on its polls). Without it a browser gets a small form asking for the key (HTTP 401); other clients get
the usual OpenAI-style 401 error. See docs/dashboard.md.
"""

from __future__ import annotations

import hmac
from importlib import resources

from aiohttp import web

from node.api.auth import bearer_ok

from node.api.errors import error_response

PAGE = resources.files("node.api").joinpath("dashboard.html").read_bytes()
"""The page, read once (about 20 kB)."""

_KEY_FORM = b"""<!doctype html><html><head><meta charset="utf-8"><title>shiftnode dashboard</title></head>
<body style="font:15px system-ui,sans-serif;margin:3em">
<h1 style="font-size:1.3em">shiftnode dashboard</h1><p>This node needs its API key (<code>--api-key</code>).</p>
<form method="get" action="/dashboard"><input type="password" name="key" autofocus placeholder="API key" size="40">
<button type="submit">Open</button></form></body></html>"""

_HEADERS = {"Cache-Control": "no-store", "Referrer-Policy": "no-referrer",
            # the page loads nothing from elsewhere: say so, so an injected script could not either
            "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                                       "connect-src 'self'; img-src 'self' data:; form-action 'self'"}


def key_ok(request: web.Request, api_key: str) -> bool:
    """Whether ``request`` carries ``api_key``: ``Authorization: Bearer KEY`` or ``?key=KEY``."""
    query = request.query.get("key", "").encode()
    return bearer_ok(request.headers.get("Authorization", ""), api_key) or hmac.compare_digest(query, api_key.encode())


def dashboard_handler(api_key: str | None):
    """The ``GET /dashboard`` handler for a node started with ``api_key`` (None: no key needed)."""

    async def dashboard(request: web.Request) -> web.Response:
        if api_key and not key_ok(request, api_key):
            if "text/html" in request.headers.get("Accept", ""):
                return web.Response(status=401, body=_KEY_FORM, content_type="text/html", headers=_HEADERS)
            return error_response(401, "invalid or missing API key (?key=<key> or Authorization: Bearer <key>)",
                                  code="invalid_api_key")
        return web.Response(body=PAGE, content_type="text/html", charset="utf-8", headers=_HEADERS)

    return dashboard
