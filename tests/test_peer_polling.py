"""Capacity polling costs O(peers) on the node's loop, not O(peers²) (issue 45 item 8): a peer's report
starts a placement round (which reads every peer) only when it could change what placement can do: the
first report, more room, or accepting again; the same report every 50 ms does not."""

import asyncio
from types import SimpleNamespace

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
