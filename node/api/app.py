"""The aiohttp application: routes, auth and error middlewares, and the node's lifetime."""

from __future__ import annotations

import asyncio
import gc
import importlib.metadata
import math
import time

import msgspec
import structlog
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from node.api.auth import bearer_ok
from node.api.cors import install_cors
from node.api.dashboard import dashboard_handler
from node.api.errors import APIError, bad_request, error_response, retry_after
from node.api.openai import NODE_KEY, chat_completions, completions
from node.config import NodeConfig
from node.api.openapi import openapi_document
from node.api.request_ids import echo_request_id
from node.api.tokenize import detokenize, tokenize
from node.protocol import PeerChange
from node.runtime.health import node_health
from node.runtime.memory import trim_periodically
from node.runtime.node import Node
from node.runtime.peer_state import split_addr
from node.runtime.stats_log import log_stats_periodically

log = structlog.get_logger("shiftnode.api")

GC_THRESHOLDS = (2000, 20, 100)
"""The cyclic collector's thresholds in the node's process, instead of CPython's (700, 10, 10).
Measured at 256 streams (zero-cost model, bench/RESULTS.md 2026-12-03, sixth session): with the
defaults the collector took about 6 % of the event loop's time, 100+ young collections a second and
a full collection (13-17 ms, every live request's objects walked) about every 2 s, a pause every
stream sees as one long inter-token gap; CPython's rule that defers full collections until the
long-lived objects grew by a quarter no longer holds them back once ``gc.freeze()`` has moved the
start-up objects out of that count. With these, about 1 %, no full collection in 8 s, and pauses
of up to 15 ms (a gen-1 collection) 2-3 times in 4 s instead of 40-odd collections of up to 17 ms. Cycles
are rare on the hot path (requests free their state by reference counting); the collector still
runs, less often."""


@web.middleware
async def errors_middleware(request: web.Request, handler):
    """Every failure leaves as an OpenAI error body; nothing a client sends can produce a bare 500."""
    try:
        return await handler(request)
    except APIError as e:
        resp = error_response(e.status, e.message, e.param, e.code, e.headers)
        if e.status in (408, 413, 415) or isinstance(e.__cause__, (RequestPayloadError, HttpProcessingError)):
            resp.force_close()  # the body was not (fully) read: this connection cannot carry another request
        return resp
    except web.HTTPRequestEntityTooLarge as e:
        return error_response(413, f"request body too large: {e.text}")
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return error_response(e.status, e.reason or e.text or "error", headers={k: v for k, v in e.headers.items() if k == "Allow"})
    except Exception as e:  # noqa: BLE001 - a bug: log it, answer 500, keep serving
        log.exception("unhandled_error", path=request.path, error=str(e))
        return error_response(500, f"internal server error: {type(e).__name__}", code="internal_error")


def auth_middleware(api_key: str | None):
    @web.middleware
    async def check(request: web.Request, handler):
        if api_key and (request.path.startswith("/v1/") or request.path in ("/tokenize", "/detokenize")):
            if not bearer_ok(request.headers.get("Authorization", ""), api_key):
                return error_response(401, "invalid or missing API key (Authorization: Bearer <key>)", code="invalid_api_key")
        return await handler(request)

    return check


async def health(request: web.Request) -> web.Response:
    """``GET /health``: 200 ``{"status": "ok"}`` or ``{"status": "degraded", "reasons": [...]}``; 503
    ``{"status": "unavailable", "reasons": [...]}`` with ``Retry-After`` when the node cannot serve
    (see :mod:`node.runtime.health`)."""
    h = node_health(request.app[NODE_KEY])
    return web.json_response(h.body(), status=h.http_status, headers=retry_after(2) if h.http_status == 503 else None)


def _model_card(node) -> dict:
    return {"id": node.config.model_name, "object": "model", "created": int(node.started_wall_s), "owned_by": "shiftnode",
            "root": node.config.model, "max_model_len": node.max_model_len, "vocab_size": node.info.cfg.vocab_size}


async def models(request: web.Request) -> web.Response:
    """``GET /v1/models``: the one model this node serves."""
    return web.json_response({"object": "list", "data": [_model_card(request.app[NODE_KEY])]})


async def model(request: web.Request) -> web.Response:
    """``GET /v1/models/{id}`` (the SDK's ``models.retrieve``): the model's card, or a 404 naming the served one."""
    node = request.app[NODE_KEY]
    asked, served = request.match_info["model"], node.config.model_name
    if asked != served:
        raise APIError(404, f"The model `{asked}` does not exist. This node serves `{served}`.", param="model",
                       code="model_not_found")
    return web.json_response(_model_card(node))


async def node_status(request: web.Request) -> web.Response:
    """``GET /v1/node[?since=CLOCK_S]``: the node's state (:meth:`Node.status`); with ``since`` (a
    ``clock_s`` of an earlier answer) the switches and KV transfers that ended after it instead of the
    last 200, so a poller gets each record once."""
    node = request.app[NODE_KEY]
    since = request.query.get("since")
    since_s = None
    if since is not None:
        try:
            since_s = float(since)
        except ValueError:
            since_s = math.nan
        if not math.isfinite(since_s):
            raise bad_request(f"since must be a number of seconds on the node's clock (clock_s), got {since!r}",
                              param="since")
    return web.json_response(node.status(since_s=since_s))


async def drain(request: web.Request) -> web.Response:
    """``POST /v1/node/drain``: stop taking requests and move every decoding sequence to the peers."""
    node = request.app[NODE_KEY]
    try:
        remaining = node.drain()
    except ValueError as e:
        return error_response(409, str(e), code="drain_unavailable")
    return web.json_response({"draining": True, "sequences_here": remaining})


_PEER_CHANGE = msgspec.json.Decoder(PeerChange)


async def change_peers(request: web.Request) -> web.Response:
    """``POST /v1/node/peers`` ``{"add": [...], "remove": [...]}``: change the peer set at run time
    (removals first; adding a present peer or removing an absent one changes nothing). Answers the
    peers after the change. 400 for a malformed address, 409 on a node without peer links."""
    node = request.app[NODE_KEY]
    try:
        body = _PEER_CHANGE.decode(await request.read())
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise bad_request(f"invalid body (want {{\"add\": [\"host:port\", ...], \"remove\": [...]}}): {e}") from e
    if node.peers is None:
        raise APIError(409, "this node has no peer links: start it with --peers or --peer-secret, in time-shared "
                       "or pooled mode", code="peers_unavailable")
    for field_name in ("add", "remove"):
        for addr in getattr(body, field_name):
            try:
                split_addr(addr)
            except ValueError as e:
                raise bad_request(str(e), param=field_name) from e
    for addr in body.add:
        if node.config.is_own_kv_address(addr):
            raise bad_request(f"{addr} is this node's own KV address (--kv-port {node.config.kv_port}): a node "
                              "cannot be its own peer", param="add")
    removed = [a for a in body.remove if node.peers.remove(a)]
    added = [a for a in body.add if node.peers.add(a)]
    return web.json_response({"added": added, "removed": removed, "peers": node.status()["network"]["peers"]})


def _version() -> str:
    try:
        return importlib.metadata.version("shiftnode")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


async def metrics(request: web.Request) -> web.Response:
    body = request.app[NODE_KEY].metrics.render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


def create_app(config: NodeConfig, node: Node | None = None, prelaunched: dict | None = None) -> web.Application:
    """Build the application. With ``node=None`` the node is created on startup (with the engine
    processes in ``prelaunched``, see :meth:`Node.create`) and closed on cleanup."""
    app = web.Application(
        middlewares=[errors_middleware, auth_middleware(config.api_key)],
        client_max_size=config.max_body_bytes,
    )

    async def node_ctx(app: web.Application):
        n = node or await Node.create(config, prelaunched)
        n.started_wall_s = time.time()
        n.start()
        await n.start_network()
        app[NODE_KEY] = n
        # What loading made lives as long as the node: move it out of the collector's view, so a
        # full collection under load walks only the requests' objects.
        gc.collect()
        gc.freeze()
        gc.set_threshold(*GC_THRESHOLDS)
        trimmer = asyncio.create_task(trim_periodically())  # freed native pages back to the OS (memory.py)
        stats = asyncio.create_task(log_stats_periodically(n, config.stats_interval_s))  # the stats line
        yield
        trimmer.cancel()
        stats.cancel()
        await n.close()

    app.cleanup_ctx.append(node_ctx)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model:.+}", model)
    app.router.add_get("/v1/node", node_status)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/dashboard", dashboard_handler(config.api_key))  # its own key check: see node/api/dashboard.py
    app.router.add_post("/v1/node/drain", drain)
    app.router.add_post("/v1/node/peers", change_peers)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.on_response_prepare.append(echo_request_id)
    install_cors(app, config.serving)
    document = msgspec.json.encode(openapi_document(config.model_name, _version()))  # built once: it never changes

    async def openapi(request: web.Request) -> web.Response:
        return web.Response(body=document, content_type="application/json")

    app.router.add_get("/openapi.json", openapi)
    return app
