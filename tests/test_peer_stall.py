"""Issue 32 item 5: a peer that accepts connections but never replies is reported as *stalled*, with
the reason, in ``/health`` (degraded), ``GET /v1/node`` and ``shiftnode_peers``; local requests are
admitted and served meanwhile, equal to REF."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from node.config import NodeConfig
from node.core.sequence import SamplingParams
from node.runtime.health import node_health
from node.runtime.node import Node
from support import STORIES, NodeProcess, free_port, reference_cases, up
from test_metrics import text_string_to_metric_families

pytestmark = pytest.mark.slow_only("its one test waits out a silent peer's stall timeouts (seconds of real time)")


def test_a_peer_that_accepts_and_never_answers_is_reported_stalled_and_local_work_is_served():
    case = reference_cases()[0]

    async def main():
        conns = []

        async def silent(reader, writer):  # takes the connection, reads nothing, answers nothing
            conns.append(writer)

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        addr = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        # the handshake's timeout: the peer shows "no answer" from PEER_STALL_S (1 s) after the connect until
        # then. At 1.5 s a loaded machine's 200-token generation outlasted that window before the test looked
        node = await Node.create(NodeConfig(model=str(STORIES), peers=[addr], peer_secret="s",
                                            kv_connect_timeout_s=4.0))
        node.start()
        await node.start_network()
        try:
            t0 = time.monotonic()
            n = case["max_new_tokens"]

            async def generate() -> list[int]:
                ids = []
                async for _, d in node.generate("local", case["prompt_token_ids"], SamplingParams(max_tokens=n, temperature=0)):
                    assert d.error is None, d.error
                    ids += d.token_ids
                return ids

            served = asyncio.create_task(generate())  # served while the peer says nothing
            while f"peer:{addr}" not in node.peers.peers or not conns:
                assert time.monotonic() - t0 < 10, "the fake peer was never connected to"
                await asyncio.sleep(0.05)
            peer = node.peers.peers[f"peer:{addr}"]
            while peer.state(time.monotonic(), node.peers.stale_s)[0] != "stalled":  # PEER_STALL_S after the connect
                assert time.monotonic() - t0 < 10, peer.state(time.monotonic(), node.peers.stale_s)
                await asyncio.sleep(0.05)
            h = node_health(node)
            assert h.http_status == 200 and h.status == "degraded", h.body()
            assert any(r.startswith(f"peer {addr} stalled: no answer to the connection and handshake for ")
                       for r in h.reasons), h.reasons
            [st] = node.status()["network"]["peers"]
            assert st["state"] == "stalled" and not st["healthy"] and "no answer" in st["reason"]
            gauge = {s.labels["state"]: s.value for f in text_string_to_metric_families(node.metrics.render().decode())
                     if f.name == "shiftnode_peers" for s in f.samples}
            assert gauge["stalled"] == 1 and gauge["ready"] == 0
            assert await asyncio.wait_for(served, 60) == case["output_token_ids"]
            while not peer.timed_out:  # the handshake timeout (4 s) ends the connection: still stalled, why
                assert time.monotonic() - t0 < 20
                await asyncio.sleep(0.05)
            state, why = peer.state(time.monotonic(), node.peers.stale_s)
            assert state == "stalled" and ("Timeout" in why or "no answer" in why), why
        finally:
            await node.close()
            server.close()
            for w in conns:
                w.close()

    asyncio.run(main())


def _stalled_within(node, addr: str, within_s: float) -> tuple[float, dict, dict]:
    """Seconds until ``node`` shows its peer ``addr`` as stalled in both /v1/node and /health."""
    t0 = time.monotonic()
    while True:
        peers = {p["addr"]: p for p in node.status()["network"]["peers"]}
        code, health = node.health()
        said = [r for r in health.get("reasons", []) if r.startswith(f"peer {addr} stalled")]
        if peers[addr]["state"] == "stalled" and said:
            return time.monotonic() - t0, peers[addr], health
        assert time.monotonic() - t0 < within_s, (peers[addr], health)
        time.sleep(0.05)


@pytest.mark.parametrize("mode", ["adaptive", "time-shared"])
def test_a_stopped_peer_is_stalled_in_two_nodes_that_are_each_others_peers(mode):
    """Issue 45 item 9: two nodes of one role-switching mode, each the other's peer; one is stopped
    (SIGSTOP: its sockets stay open, nothing answers). The other shows it stalled in /v1/node and
    /health within a few seconds, and serves its own requests meanwhile; once the stopped one goes
    on, both are ready again."""
    ports = [free_port(), free_port()]
    a, b = up(*(NodeProcess("--model", str(STORIES), "--mode", mode, "--kv-port", str(ports[i]),
                            "--peers", f"127.0.0.1:{ports[1 - i]}", "--peer-secret", "s", wait=False) for i in range(2)))
    try:
        for n in (a, b):  # each sees the other ready first
            deadline = time.monotonic() + 30
            while not all(p["state"] == "ready" for p in n.status()["network"]["peers"]):
                assert time.monotonic() < deadline, n.status()["network"]["peers"]
                time.sleep(0.05)
        b.proc.send_signal(signal.SIGSTOP)
        try:
            took, peer, health = _stalled_within(a, f"127.0.0.1:{ports[1]}", 10)
            assert took < 5 and health["status"] == "degraded", (took, health)
            r = a.client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 8, "temperature": 0}, timeout=30)
            assert r.status_code == 200, r.text
        finally:
            b.proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 20
        while a.status()["network"]["peers"][0]["state"] != "ready":
            assert time.monotonic() < deadline, a.status()["network"]["peers"]
            time.sleep(0.05)
    finally:
        a.close()
        b.close()
