"""``X-Request-Id``: a client's id for its request, read and echoed back (as vLLM's
``--enable-request-id-headers``, always on here).

A completion takes the id from the ``X-Request-Id`` header, else from the body's ``request_id`` (vLLM's
field); the response's ``id`` is then ``cmpl-<id>`` / ``chatcmpl-<id>`` and every response carries the
header ``X-Request-Id``: the client's id, or the one the node made. The node's own engine request ids
stay its own (unique whatever two clients send), so a repeated client id never mixes two requests.
"""

from __future__ import annotations

from aiohttp import web

from node.api.errors import bad_request

HEADER = "X-Request-Id"
MAX_CHARS = 256
_KEY = "shiftnode_request_id"


def client_request_id(request: web.Request, body_id: str | None) -> str | None:
    """The client's id for this request: the header's, else ``body_id``; None when neither is given.

    Raises:
        APIError: 400 for an id longer than :data:`MAX_CHARS` or with characters outside printable ASCII.
    """
    given = request.headers.get(HEADER) or body_id
    if given is None:
        return None
    if not given or len(given) > MAX_CHARS or not given.isprintable() or not given.isascii():
        raise bad_request(f"a request id ({HEADER} or request_id) must be 1 to {MAX_CHARS} printable ASCII "
                          "characters", param="request_id")
    return given


def public_id(request: web.Request, prefix: str, body_id: str | None, internal: str) -> str:
    """The response's ``id``: ``prefix-<client id>``, or ``internal`` (the node's id) when the client
    gave none; remembered for the ``X-Request-Id`` response header."""
    given = client_request_id(request, body_id)
    request[_KEY] = given if given is not None else internal
    return internal if given is None else f"{prefix}-{given}"


async def echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: the ``X-Request-Id`` header on every response (a stream's too, whose
    headers leave at its first write): the id the handler chose, else the client's header."""
    rid = request.get(_KEY) or request.headers.get(HEADER)
    if rid and HEADER not in response.headers:
        response.headers[HEADER] = rid
