"""The node's NIXL data plane (``--kv-transport nixl``): its agent, its devices' registered KV pools,
and the two places a hand-off uses them (see :mod:`node.transport.nixl_plane` for the protocol and
:mod:`node.transport.nixl_agent` for why the node process registers the pools).

Sending: a hand-off's connection loads the peer's agent after the handshake, and offers the
sequence's blocks in our pool (``nixl_blocks``). The blocks of a detached sequence are already safe
to read: a detach is applied only when no step is in flight, and no later step includes it.

Receiving: blocks reserved for an offer written over NIXL are handed to the sender only once no step
is in flight on the device (``DeviceEngine.in_worker``), because a block freed by an abort while a
step ran may still be written by that step; the TCP path gets the same guarantee from scattering
each layer on the device's worker. A device without a registered pool (none today: every
single-device engine's pool is registered) is answered with a TCP accept.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import structlog

from node.transport.nixl_agent import NixlAgent
from node.transport.nixl_plane import info_of
from node.transport.protocol import NixlInfo

if TYPE_CHECKING:
    from node.runtime.engine import DeviceEngine
    from node.runtime.interfaces import PeerHost

log = structlog.get_logger("shiftnode.peers")


class NixlPlane:
    """This node's NIXL agent and which registered pool each device's KV lives in."""

    def __init__(self, agent: NixlAgent, pools: dict[str, int], info: NixlInfo):
        self.agent = agent
        self.pools = pools  # device id → index in agent.pools
        self.info = info  # the answer to a peer's NixlQuery

    @classmethod
    async def start(cls, node: "PeerHost") -> "NixlPlane":
        """Create the agent and register every single-device engine's pool (a tensor-parallel group's
        pool is sharded across ranks and takes no peer KV). Raises ``NixlUnavailable``."""
        agent = await NixlAgent.create(node.config.name)
        pools: dict[str, int] = {}
        try:
            for e in node.engines:
                if getattr(e.runner, "kv_caches", None) is not None or e.runner.kv_cache is None:
                    continue
                pools[e.device_id] = len(agent.pools)
                await agent.register(e.runner.kv_cache)
            info = info_of(agent, await agent.metadata())
        except BaseException:
            await agent.close()
            raise
        log.info("nixl_agent_ready", agent=agent.name, pools={d: agent.pools[i].num_blocks for d, i in pools.items()})
        return cls(agent, pools, info)

    def blocks_of(self, engine: "DeviceEngine", blocks: list[int]) -> tuple[int, list[int]] | None:
        """``(pool index, blocks)`` for a sequence leaving ``engine`` (None: its pool is not registered)."""
        pool = self.pools.get(engine.device_id)
        return None if pool is None else (pool, blocks)

    def reserve(self, offer: Any, got: Any, incoming: dict, on_abort) -> Any:
        """Wrap a receiver's reservation ``got`` (``(blocks, cached)`` or None) for an offer the sender
        can write over NIXL: an awaitable of ``(blocks, cached, pool)`` once no step is in flight on the
        device; anything else is returned as is (TCP). ``incoming[transfer id]`` holds the device;
        ``on_abort(transfer id, reason)`` frees the reservation if the wait fails."""
        if got is None or not offer.nixl:
            return got
        engine = incoming[offer.transfer_id][0]
        pool = self.pools.get(engine.device_id)
        if pool is None:
            return got

        async def ready():
            try:
                await engine.in_worker(_nothing)
            except BaseException as e:  # the device went down, or the server is closing: nothing was accepted
                on_abort(offer.transfer_id, f"{type(e).__name__}: {e}")
                raise
            return (*got, pool)
        return ready()

    def status(self) -> dict:
        """``network.nixl`` of ``GET /v1/node``: the agent's name, each registered pool's blocks, and the
        layers written to peers and received from them so far."""
        a = self.agent
        return {"agent": a.name, "pools": {d: a.pools[i].num_blocks for d, i in self.pools.items()},
                "layers_written": a.layers_written, "layers_received": a.layers_received}

    async def close(self) -> None:
        await self.agent.close()


def _nothing() -> None:
    return None
