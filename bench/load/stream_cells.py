"""Closed-loop streaming cells against one node, shared by the load benchmarks that compare two settings
side by side (:mod:`bench.load.structured`, :mod:`bench.load.spec_decode`): given request bodies, in this
process's loop. :mod:`bench.load.stream_client` is the host-overhead load instead (random prompts, several
client processes, the node's CPU by role).

Each client sends ``POST /v1/completions`` (streamed, ``return_token_ids``) again as soon as its stream
ends, cycling through the bodies it is given. A cell runs a 2 s warm-up, then ``duration`` seconds:
``tok_s`` is the tokens streamed before the end over ``duration``; ``itl_p50_ms`` the median over chunks of
the gap to the stream's previous chunk divided by the chunk's tokens (a chunk may carry several tokens);
``tpot_ms`` the mean per request ended in the cell of (last chunk - first chunk) / (tokens - 1).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import httpx

__all__ = ["stream_cell"]

WARMUP_S = 2.0


async def _client(http: httpx.AsyncClient, bodies: list[dict], k: int, stop_at: float, out: dict) -> None:
    while time.monotonic() < stop_at:
        body = bodies[k % len(bodies)]
        k += 1
        last = first = None
        n_tokens = 0
        async with http.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.monotonic()
                n = sum(len(c.get("token_ids") or []) for c in json.loads(line[6:]).get("choices", []))
                if not n:
                    continue
                if last is not None:
                    out["gaps"].append((now - last) / n)
                else:
                    first = now
                last = now
                n_tokens += n
                if now < stop_at:
                    out["tokens"] += n
        if first is not None and n_tokens > 1 and last < stop_at:
            out["tpots"].append((last - first) / (n_tokens - 1))


async def _cell(url: str, bodies: list[dict], clients: int, duration: float) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=clients + 4)) as http:
        warm = {"tokens": 0, "gaps": [], "tpots": []}
        await asyncio.gather(*(_client(http, bodies, i, time.monotonic() + WARMUP_S, warm) for i in range(clients)))
        out = {"tokens": 0, "gaps": [], "tpots": []}
        t0 = time.monotonic()
        await asyncio.gather(*(_client(http, bodies, i, t0 + duration, out) for i in range(clients)))
    return {"tok_s": out["tokens"] / duration,
            "itl_p50_ms": 1000 * statistics.median(out["gaps"]) if out["gaps"] else None,
            "tpot_ms": 1000 * statistics.mean(out["tpots"]) if out["tpots"] else None}


def stream_cell(url: str, bodies: list[dict], clients: int, duration: float) -> dict:
    """One cell (module doc) of ``clients`` closed-loop streams on the node at ``url``, client ``i`` starting
    at ``bodies[i % len(bodies)]``; ``duration`` in seconds. Returns ``tok_s``, ``itl_p50_ms`` and ``tpot_ms``
    (``None`` where the cell saw no gap or no ended request)."""
    return asyncio.run(_cell(url, bodies, clients, duration))
