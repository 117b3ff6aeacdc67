"""Reading a request's JSON body into its msgspec type: content type, size and time limits, and a 400
that names the field for anything that does not decode (an unknown field included)."""

from __future__ import annotations

import asyncio
import re

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from node.api.errors import APIError, bad_request
from node.protocol import decode_request
from node.runtime.interfaces import ApiNode

NODE_KEY = web.AppKey("node", ApiNode)  # the node (or an API front end's stand-in) an application serves

def _error_param(message: str) -> str | None:
    """The request field a msgspec validation message points at, with its path (``$.messages[0].role`` →
    ``messages[0].role``, as OpenAI names a nested field); an unknown field is named with its path too
    (``foo``, ``stream_options.foo``, ``messages[0].foo``)."""
    unknown = re.match(r"Object contains unknown field `([^`]+)`(?: - at `\$\.?([^`]*)`)?", message)
    if unknown:
        return f"{unknown.group(2)}.{unknown.group(1)}" if unknown.group(2) else unknown.group(1)
    if " - at `$." in message:
        return message.rpartition(" - at `$.")[2].split("`")[0] or None
    missing = re.search(r"missing required field `([^`]+)`", message)
    return missing.group(1) if missing else None


async def read_json(request: web.Request, kind: type) -> object:
    """Read and decode a JSON body into ``kind``.

    Raises:
        APIError: 415 for a missing or non-JSON content type, 413 for a body over the size limit, 408 for a body
            slower than ``--body-timeout-s``, 400 for anything that does not decode.
    """
    node = request.app[NODE_KEY]
    # A missing Content-Type is refused like a wrong one: the body's type is never guessed. aiohttp
    # reports a missing header as application/octet-stream, so the header itself is checked.
    if "Content-Type" not in request.headers:
        raise APIError(415, "Content-Type: application/json is required")
    if request.content_type != "application/json" and not request.content_type.endswith("+json"):
        raise APIError(415, f"Content-Type must be application/json, got {request.content_type!r}")
    if request.content_length is not None and request.content_length > node.config.max_body_bytes:
        raise APIError(413, f"request body of {request.content_length} bytes exceeds the limit of {node.config.max_body_bytes} bytes")
    try:
        async with asyncio.timeout(node.config.body_timeout_s):
            body = await request.read()  # aiohttp raises 413 past client_max_size without Content-Length
    except TimeoutError as e:
        raise APIError(408, f"request body not received within {node.config.body_timeout_s:g} s") from e
    except (RequestPayloadError, HttpProcessingError) as e:  # e.g. a Content-Encoding the body does not have
        raise bad_request(f"request body could not be read: {e}") from e
    try:
        return decode_request(body, kind)
    except msgspec.ValidationError as e:
        raise bad_request(f"invalid request: {e}", param=_error_param(str(e))) from e
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as e:
        raise bad_request(f"request body is not valid JSON: {str(e)[:200]}") from e


async def off_loop(fn, *args):
    """Run CPU-heavy request preparation (tokenization, templates) in a thread, not on the event loop."""
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
