"""CORS (``--allowed-origins``, ``--allowed-methods``, ``--allowed-headers``, ``--allow-credentials``,
vLLM's flags) for browser applications on another origin.

With no allowed origin (the default) the node sends no CORS headers and a browser keeps other
origins' pages from reading its answers. Otherwise, as the Fetch standard's CORS protocol asks: a
preflight (``OPTIONS`` with ``Access-Control-Request-Method``) from an allowed origin is answered 200
with the allowed methods and headers, before authentication (browsers send no credentials on a
preflight); one from another origin gets 400. A request from an allowed origin gets
``Access-Control-Allow-Origin`` (the origin itself, and ``Vary: Origin``, unless ``*`` without
credentials) on its response, errors included.
"""

from __future__ import annotations

from aiohttp import web

from node.api.errors import error_response
from node.serving_options import ServingOptions

MAX_AGE_S = 600  # how long a browser may reuse a preflight's answer


def _allowed(values: list[str], value: str) -> bool:
    return "*" in values or value.lower() in {v.lower() for v in values}


def install_cors(app: web.Application, options: ServingOptions) -> None:
    """Add CORS to ``app`` per ``options`` (nothing when no origin is allowed): a middleware answering
    preflights, put first so it runs before authentication, and an ``on_response_prepare`` hook adding
    the allow headers to every response to an allowed origin (a stream's too, whose headers leave at
    its first write)."""
    origins = options.allowed_origins
    if not origins:
        return
    any_origin = "*" in origins

    def allow_origin(origin: str) -> dict[str, str]:
        if any_origin and not options.allow_credentials:
            return {"Access-Control-Allow-Origin": "*"}
        head = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
        if options.allow_credentials:
            head["Access-Control-Allow-Credentials"] = "true"
        return head

    @web.middleware
    async def cors(request: web.Request, handler):
        origin = request.headers.get("Origin")
        if origin is None:
            return await handler(request)
        allowed = any_origin or origin in origins
        method = request.headers.get("Access-Control-Request-Method")
        if request.method == "OPTIONS" and method is not None:  # a preflight
            if not allowed or not _allowed(options.allowed_methods, method):
                return error_response(400, f"CORS preflight refused: origin {origin!r} or method {method!r} "
                                           "is not allowed (--allowed-origins, --allowed-methods)")
            asked = [h.strip() for h in request.headers.get("Access-Control-Request-Headers", "").split(",") if h.strip()]
            if any(not _allowed(options.allowed_headers, h) for h in asked):
                return error_response(400, "CORS preflight refused: a requested header is not allowed (--allowed-headers)")
            head = allow_origin(origin) | {"Access-Control-Max-Age": str(MAX_AGE_S),
                                           "Access-Control-Allow-Methods": method if "*" in options.allowed_methods
                                           else ", ".join(options.allowed_methods)}
            if asked:
                head["Access-Control-Allow-Headers"] = (", ".join(asked) if "*" in options.allowed_headers
                                                        else ", ".join(options.allowed_headers))
            return web.Response(status=200, headers=head)
        return await handler(request)

    async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if origin is not None and (any_origin or origin in origins):
            response.headers.update(allow_origin(origin))

    app.middlewares.insert(0, cors)
    app.on_response_prepare.append(on_prepare)
