"""Issue 32 item 5: a peer that accepts connections but never replies is reported as *stalled*, with
the reason, in ``/health`` (degraded), ``GET /v1/node`` and ``shiftnode_peers``; local requests are
admitted and served meanwhile, equal to REF."""

from __future__ import annotations

import asyncio
import time

from node.config import NodeConfig
from node.core.sequence import SamplingParams
from node.runtime.health import node_health
from node.runtime.node import Node
from support import STORIES, reference_cases
from test_metrics import text_string_to_metric_families


def test_a_peer_that_accepts_and_never_answers_is_reported_stalled_and_local_work_is_served():
    case = reference_cases()[0]

    async def main():
        conns = []

        async def silent(reader, writer):  # takes the connection, reads nothing, answers nothing
            conns.append(writer)

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        addr = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        node = await Node.create(NodeConfig(model=str(STORIES), peers=[addr], peer_secret="s",
                                            kv_connect_timeout_s=1.5))
        node.start()
        await node.start_network()
        try:
            t0 = time.monotonic()
            n = case["max_new_tokens"]
            ids = []
            async for _, d in node.generate("local", case["prompt_token_ids"], SamplingParams(max_tokens=n, temperature=0)):
                assert d.error is None, d.error
                ids += d.token_ids
            assert ids == case["output_token_ids"]  # admitted and served while the peer says nothing
            assert conns, "the fake peer was never connected to"
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
            while not peer.timed_out:  # the handshake timeout (1.5 s) ends the connection: still stalled, why
                assert time.monotonic() - t0 < 15
                await asyncio.sleep(0.05)
            state, why = peer.state(time.monotonic(), node.peers.stale_s)
            assert state == "stalled" and ("Timeout" in why or "no answer" in why), why
        finally:
            await node.close()
            server.close()
            for w in conns:
                w.close()

    asyncio.run(main())
