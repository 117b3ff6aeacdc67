"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with the right status."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:
    from node.runtime.output import SeqDelta

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    408: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error to return to the client.

    Args:
        status: HTTP status (400, 401, 404, 413, 503, ...).
        message: human-readable explanation.
        param: the offending request field, if any.
        code: a short machine-readable code.
        headers: extra response headers (e.g. ``Retry-After``).
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(error_body(status, message, param, code), status=status, headers=headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code="invalid_value" if param else None)


def retry_after(seconds: float | None) -> dict[str, str]:
    """The ``Retry-After`` header (whole seconds, at least 1) for ``seconds``, or none."""
    return {} if seconds is None else {"Retry-After": str(max(1, math.ceil(seconds)))}


def delta_error(delta: "SeqDelta") -> APIError:
    """The API error of a choice that ended with ``delta.error``: the status, code and Retry-After the
    node gave the failure (:meth:`node.runtime.request.RequestState.fail`), 500 ``internal_error``
    when it gave none. A stream sends ``.body()`` as its error event."""
    return APIError(delta.error_status, delta.error or "error", code=delta.error_code,
                    headers=retry_after(delta.retry_after_s))
