"""The chaos run's disruptions above one engine: a whole peer node killed and started again, and etcd restarted.

:func:`kill_nodes` (``--node-kill-every``) sends ``kill -9`` to one node's server process (its engines die with
it: ``node.worker.engine_main`` watches its parent), checks that none of the engine processes it had outlives
it, and starts the node again on the same HTTP port, KV port and node id (a crashed node that a supervisor
brings back). While it is down it is in ``Chaos.down``: the clients send nothing to it and the engine killer
leaves it alone. A client whose request was on that node when it died sees its connection drop (or refused,
while the node is down): :func:`lost_to_a_killed_node` tells those apart from unclear failures.

:func:`restart_etcd` (``--etcd-restart-every``, in the ``--membership etcd`` topology) kills etcd with ``kill -9``
and starts it again ``--etcd-down`` seconds later on the same ports and data folder
(:meth:`bench.load.etcd_server.EtcdServer.restart`). The nodes' leases and watches break, and each node must
register again and keep its peers.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from typing import TYPE_CHECKING

import aiohttp

from bench.load.chaos_report import LOST_PREFIX, EtcdRestart, NodeKill

if TYPE_CHECKING:
    from bench.load.chaos import Chaos
    from bench.load.etcd_server import EtcdServer

ORPHAN_WAIT_S = 10.0  # how long a dead node's engine processes may take to notice and exit


def lost_to_a_killed_node(outcome: str, node_kills: list[NodeKill], node: str, start_s: float, end_s: float) -> str:
    """``outcome`` of a request sent to ``node`` from ``start_s`` to ``end_s`` (seconds into the run),
    reclassified as ``"lost:<what>"`` when it is a dropped or refused connection (``unclear:connection ...``
    or a stream cut without ``[DONE]``) and ``node`` was killed, or down, during the request: the client saw
    its server die, which no server can answer with an error event. Any other outcome is returned as is."""
    dropped = outcome.startswith("unclear:connection") or outcome == "unclear:stream ended without [DONE]"
    if not dropped:
        return outcome
    for k in node_kills:
        back = k.at_s + k.back_after_s if k.back_after_s is not None else float("inf")
        if k.node == node and k.at_s <= end_s and back >= start_s:
            return LOST_PREFIX + outcome.removeprefix("unclear:")
    return outcome


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie is dead for our purpose (its memory is gone; only the parent has not reaped it yet)
    with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    return False


async def _engine_pids(session: aiohttp.ClientSession, url: str) -> list[int]:
    """The engine processes of the node at ``url`` (``GET /v1/node``), or [] when it does not answer."""
    try:
        async with session.get(url + "/v1/node?since=1e300", timeout=aiohttp.ClientTimeout(total=5)) as r:
            st = await r.json()
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return []
    return [d["engine"]["pid"] for d in st["devices"] if d["engine"]["pid"]]


async def kill_nodes(ch: "Chaos", session: aiohttp.ClientSession, victim: str) -> None:
    """Every ``--node-kill-every`` seconds (uniformly 0.5-1.5x), during the kill window, ``kill -9`` the node
    ``victim`` and start it again; each kill goes into ``ch.rep.node_kills``."""
    a, rng, node = ch.a, ch.rng, ch.nodes[victim]
    while a.node_kill_every > 0:
        await asyncio.sleep(rng.uniform(0.5, 1.5) * a.node_kill_every)
        if time.monotonic() >= ch.t0 + a.kill_window * a.duration:
            return
        while victim in ch.stalled:  # not while SIGSTOPped: the stall ends first
            await asyncio.sleep(0.1)
        engines = await _engine_pids(session, node.url)
        kill = NodeKill(round(time.monotonic() - ch.t0, 2), victim, node.proc.pid, engines)
        ch.down.add(victim)
        ch.rep.node_kills.append(kill)
        node.proc.send_signal(signal.SIGKILL)
        await asyncio.to_thread(node.proc.wait)
        deadline = time.monotonic() + ORPHAN_WAIT_S
        while any(_alive(p) for p in engines) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        kill.orphans = [p for p in engines if _alive(p)]
        for p in kill.orphans:  # do not let one leak into the next life's memory
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        await asyncio.sleep(a.node_down)
        try:
            await asyncio.to_thread(node.start)
        except Exception as e:  # noqa: BLE001 - a node that does not come back is the run's finding
            kill.restart_error = f"{type(e).__name__}: {e}"[:300]
            return
        kill.back_after_s = round(time.monotonic() - ch.t0 - kill.at_s, 2)
        ch.down.discard(victim)


async def restart_etcd(ch: "Chaos", etcd: "EtcdServer") -> None:
    """Every ``--etcd-restart-every`` seconds (uniformly 0.5-1.5x), during the kill window, ``kill -9`` etcd and
    start it again after ``--etcd-down`` seconds; each restart goes into ``ch.rep.etcd_restarts``."""
    a, rng = ch.a, ch.rng
    while a.etcd_restart_every > 0:
        await asyncio.sleep(rng.uniform(0.5, 1.5) * a.etcd_restart_every)
        if time.monotonic() >= ch.t0 + a.kill_window * a.duration:
            return
        r = EtcdRestart(round(time.monotonic() - ch.t0, 2), a.etcd_down)
        ch.rep.etcd_restarts.append(r)
        try:
            await asyncio.to_thread(etcd.restart, a.etcd_down)
        except RuntimeError as e:
            r.error = str(e)[:300]
            return
        r.back_after_s = round(time.monotonic() - ch.t0 - r.at_s, 2)
