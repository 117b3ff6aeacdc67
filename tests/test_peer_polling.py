"""Capacity polling costs O(peers) on the node's loop, not O(peers²) (issue 45 item 8): a peer's report
starts a placement round (which reads every peer) only when it could change what placement can do: the
first report, more room, or accepting again; the same report every 50 ms does not."""

import asyncio
from types import SimpleNamespace

import pytest

from node.config import NodeConfig
from node.runtime import peer_links
from node.runtime.peer_links import PeerLinks
from node.transport.protocol import StatusReply


class _Driver:
    def __init__(self):
        self.kicks = 0

    def kick(self):
        self.kicks += 1


class _Client:
    """A peer's control connection that answers ``replies`` in turn, then the last one for ever."""

    def __init__(self, replies):
        self.replies = list(replies)
        self.peer_node_id = "peer"
        self.asked = 0

    async def query_status(self, timeout_s):
        self.asked += 1
        return self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]

    async def close(self):
        pass


def _reply(free: int, accepting: bool = True) -> StatusReply:
    return StatusReply(n=1, kv_free_blocks=free, kv_total_blocks=100, max_device_free_blocks=free,
                       max_device_total_blocks=100, seq_slots_free=8, accepting=accepting)


@pytest.mark.quick
def test_the_same_capacity_report_starts_no_round_and_more_room_does():
    async def main():
        peers = [f"127.0.0.1:{7000 + i}" for i in range(8)]
        node = SimpleNamespace(config=NodeConfig(peers=peers, peer_secret="s"), driver=_Driver(), metrics=None)
        links = PeerLinks(node, layout=None)
        clients = {}

        async def connect(peer, **kw):
            # the first peer's room grows on its 5th report, and it stops accepting on its 8th
            replies = [_reply(10)] * 4 + [_reply(20)] * 3 + [_reply(20, accepting=False)] if peer.port == 7000 else [_reply(10)]
            clients[peer.port] = c = _Client(replies)
            return c

        links.connect = connect
        links.start()
        await asyncio.sleep(0.1 + 20 * peer_links.STATUS_POLL_S)
        await links.close()
        asked = sum(c.asked for c in clients.values())
        assert asked >= 8 * 10  # every peer polled at its period
        # one round per peer for its first report, one for the first peer's more room, one for its refusal
        assert node.driver.kicks == 8 + 2, (node.driver.kicks, asked)

    asyncio.run(main())


def test_a_peer_that_keeps_refusing_is_asked_with_backoff_and_health_says_why(monkeypatch):
    """A pooled prefill node whose only peer is incompatible: asked again after REFUSED_RETRY_S, doubling
    per refusal up to REFUSED_RETRY_MAX_S (not every 2 s for ever), logged once, and /health says the node
    cannot serve because every peer refused it."""
    from node.runtime.health import node_health
    from node.transport import PeerRefused

    monkeypatch.setattr(peer_links, "REFUSED_RETRY_S", 0.05)
    monkeypatch.setattr(peer_links, "REFUSED_RETRY_MAX_S", 0.4, raising=False)
    refusals = SimpleNamespace(labels=lambda **kw: SimpleNamespace(inc=lambda: None))

    async def main():
        cfg = NodeConfig(mode="pooled", prefill_devices=["cpu:0"], peers=["127.0.0.1:7000"], peer_secret="s")
        node = SimpleNamespace(config=cfg, driver=_Driver(), metrics=SimpleNamespace(peer_refusals=refusals),
                               engines=[SimpleNamespace(device_id="cpu:0", failure=None)], receiver=None, draining=False)
        links = PeerLinks(node, layout=None)
        node.peers = links
        asked = []

        async def connect(peer, **kw):
            asked.append(asyncio.get_running_loop().time())
            raise PeerRefused("KV layout mismatch (model: stories260k here, llama there)", "model")

        links.connect = connect
        links.start()
        await asyncio.sleep(2.0)
        h = node_health(node)
        await links.close()
        gaps = [b - a for a, b in zip(asked, asked[1:])]
        assert 5 <= len(asked) <= 9, gaps  # 0.05, 0.1, 0.2, 0.4, 0.4, ...: not 40 tries at a fixed 0.05 s
        assert max(gaps) < 0.4 + 0.2 and gaps[-1] > 0.3, gaps  # capped
        assert h.status == "unavailable" and h.reasons[0].startswith(
            "no decode peer is ready: every peer refused the handshake (incompatible"), h.reasons
        assert h.reasons[1].startswith("peer 127.0.0.1:7000 refused: model: KV layout mismatch") and "asked again in" in h.reasons[1]

    asyncio.run(main())
