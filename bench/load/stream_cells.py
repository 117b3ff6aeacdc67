"""Closed-loop streaming cells against one node, shared by the load benchmarks that compare two settings
side by side (:mod:`bench.load.structured`, :mod:`bench.load.spec_decode`): given request bodies, in this
process's loop. :mod:`bench.load.stream_client` is the host-overhead load instead (random prompts, several
client processes, the node's CPU by role).

Each client sends ``POST /v1/completions`` (streamed, ``return_token_ids``) again as soon as its stream
ends, cycling through the bodies it is given. A cell runs a 2 s warm-up, then ``duration`` seconds:
``tok_s`` is the tokens streamed before the end over ``duration``; ``itl_p50_ms`` the median over chunks of
the gap to the stream's previous chunk divided by the chunk's tokens (a chunk may carry several tokens);
``tpot_ms`` the mean per request ended in the cell of (last chunk - first chunk) / (tokens - 1);
``lengths`` the output tokens of each request begun in the window (those still streaming at its end are
waited for: counting only those that ended inside it would favour short ones). Given the node's pid, ``cpu_s`` is
the CPU time (user + system, from ``/proc``) its processes spent in the window, by role (the node's own
process, its API front ends, its engines: :func:`bench.load.host_compare.cpu_by_role`), read at the
window's start and at its end, the same span as ``tok_s``'s tokens; ``node_us_per_token`` their sum
over the window's tokens, in µs (``cpu_s["client"]`` and ``client_us_per_token``: this process's own CPU,
the load's, which shares the machine with the node). CPU per token hardly depends on how much CPU the shared machine lets
the node have, so it is the steadier figure for comparing two settings.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import httpx

from bench.load.host_compare import cpu_by_role

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
        out["lengths"].append(n_tokens)  # every request begun in the window: no bias towards short ones
        if first is not None and n_tokens > 1 and last < stop_at:
            out["tpots"].append((last - first) / (n_tokens - 1))


async def _window_cpu(pid: int, until: float, out: dict) -> None:
    """The node's CPU by role from now to ``until`` (monotonic), into ``out["cpu"]``."""
    before, client = cpu_by_role(pid), time.process_time()
    await asyncio.sleep(max(0.0, until - time.monotonic()))
    out["cpu"] = [b - a for a, b in zip(before, cpu_by_role(pid))]
    out["client_cpu"] = time.process_time() - client


async def _cell(url: str, bodies: list[dict], clients: int, duration: float, pid: int | None) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=clients + 4)) as http:
        warm = {"tokens": 0, "gaps": [], "tpots": [], "lengths": []}
        await asyncio.gather(*(_client(http, bodies, i, time.monotonic() + WARMUP_S, warm) for i in range(clients)))
        out = {"tokens": 0, "gaps": [], "tpots": [], "lengths": [], "cpu": None}
        t0 = time.monotonic()
        cpu = [_window_cpu(pid, t0 + duration, out)] if pid is not None else []
        await asyncio.gather(*(_client(http, bodies, i, t0 + duration, out) for i in range(clients)), *cpu)
    res = {"tok_s": out["tokens"] / duration,
           "itl_p50_ms": 1000 * statistics.median(out["gaps"]) if out["gaps"] else None,
           "tpot_ms": 1000 * statistics.mean(out["tpots"]) if out["tpots"] else None,
           "lengths": out["lengths"]}
    if out["cpu"] is not None:
        res["cpu_s"] = dict(zip(("node", "api", "engines"), out["cpu"])) | {"client": out["client_cpu"]}
        res["node_us_per_token"] = 1e6 * sum(out["cpu"]) / out["tokens"] if out["tokens"] else None
        res["client_us_per_token"] = 1e6 * out["client_cpu"] / out["tokens"] if out["tokens"] else None
    return res


def stream_cell(url: str, bodies: list[dict], clients: int, duration: float, pid: int | None = None) -> dict:
    """One cell (module doc) of ``clients`` closed-loop streams on the node at ``url``, client ``i`` starting
    at ``bodies[i % len(bodies)]``; ``duration`` in seconds; ``pid``: the node's process, to read its CPU.
    Returns ``tok_s``, ``itl_p50_ms``, ``tpot_ms`` (``None`` where the cell saw no gap or no ended request)
    and ``lengths``; with ``pid``, ``cpu_s``, ``node_us_per_token`` and ``client_us_per_token`` too."""
    return asyncio.run(_cell(url, bodies, clients, duration, pid))
