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

Engine restarts (issue 45). When a device's engine dies its pool is deregistered at once (a peer's
write to it fails from then on, never lands in memory the new engine may reuse; the dead pool stays
mapped until then) and the device is *down* here: its offers are answered over TCP (and, being down,
it takes none: ``KVReceiver``), its sequences are not sent from it over NIXL. Once the restarted
engine serves, its new pool is registered in the same slot and the agent's metadata and pools, which
every peer loads again on its next connection (``NixlAgent.add_remote`` replaces a changed view), are
refreshed. An accepted NIXL transfer that ends in an abort or a hang-up keeps its blocks reserved
(*quarantined*) for twice the transfer timeout: a live sender cancels its writes within its stall
timeout, so none can land in blocks already given to another sequence.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Callable

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
        self.info_listeners: list[Callable[[NixlInfo], None]] = []  # told when ``info`` changes (a re-registration)
        self.down: set[str] = set()  # devices whose pool is not registered now (engine dead or restarting): TCP
        self.accepted: set[str] = set()  # transfer ids whose layers peers may be writing over NIXL now
        self._deregs: dict[str, asyncio.Task] = {}  # device id → its dead pool's deregistration
        self._tasks: set[asyncio.Task] = set()

    def watch(self, engines: list, supervisor: Any) -> None:
        """Follow the devices' engine deaths (deregister) and restarts (register the new pool)."""
        for e in engines:
            if e.device_id in self.pools:
                e.down_listeners.append(self._on_down)
        if supervisor is not None:
            supervisor.restart_listeners.append(self._on_restart)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _on_down(self, engine: "DeviceEngine") -> None:
        d = engine.device_id
        if d not in self.down:
            self.down.add(d)
            self._deregs[d] = self._spawn(self._deregister(d, engine.runner.kv_cache))

    async def _deregister(self, device_id: str, dead_pool: Any) -> None:
        """Drop the dead pool's registration; ``dead_pool`` (kept referenced, so mapped) until then."""
        try:
            await self.agent.deregister(self.pools[device_id])
        except Exception as e:  # noqa: BLE001 - the device stays TCP-only here
            log.warning("nixl_deregister_failed", device=device_id, error=f"{type(e).__name__}: {e}")
        del dead_pool

    def _on_restart(self, engine: "DeviceEngine") -> None:
        if engine.device_id in self.down:
            self._spawn(self._reregister(engine))

    async def _reregister(self, engine: "DeviceEngine") -> None:
        """Register a restarted engine's pool in its device's slot and refresh what peers load."""
        d = engine.device_id
        try:
            await self._deregs.pop(d)
            await self.agent.register(engine.runner.kv_cache, index=self.pools[d])
            self.info = info_of(self.agent, await self.agent.metadata())
        except Exception as e:  # noqa: BLE001 - its transfers go over TCP
            log.warning("nixl_reregister_failed", device=d, error=f"{type(e).__name__}: {e}")
            return
        if engine.up:
            self.down.discard(d)
        for listener in self.info_listeners:
            listener(self.info)
        log.info("nixl_pool_reregistered", device=d, blocks=self.agent.pools[self.pools[d]].num_blocks)

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
        plane = cls(agent, pools, info)
        plane.watch(node.engines, getattr(node, "supervisor", None))
        return plane

    def blocks_of(self, engine: "DeviceEngine", blocks: list[int]) -> tuple[int, list[int]] | None:
        """``(pool index, blocks)`` for a sequence leaving ``engine`` (None: its pool is not registered)."""
        pool = self.pools.get(engine.device_id)
        return None if pool is None or engine.device_id in self.down else (pool, blocks)

    def reserve(self, offer: Any, got: Any, incoming: dict, on_abort) -> Any:
        """Wrap a receiver's reservation ``got`` (``(blocks, cached)`` or None) for an offer the sender
        can write over NIXL: an awaitable of ``(blocks, cached, pool)`` once no step is in flight on the
        device; anything else is returned as is (TCP). ``incoming[transfer id]`` holds the device;
        ``on_abort(transfer id, reason)`` frees the reservation if the wait fails."""
        if got is None or not offer.nixl:
            return got
        engine = incoming[offer.transfer_id][0]
        pool = self.pools.get(engine.device_id)
        if pool is None or engine.device_id in self.down:  # never a write into a dead (or unregistered) pool
            return got

        async def ready():
            try:
                await engine.in_worker(_nothing)
            except BaseException as e:  # the device went down, or the server is closing: nothing was accepted
                on_abort(offer.transfer_id, f"{type(e).__name__}: {e}")
                raise
            if engine.device_id in self.down:  # it died (and maybe came back) meanwhile: the layers go over TCP
                return got
            self.accepted.add(offer.transfer_id)
            return (*got, pool)
        return ready()

    def status(self) -> dict:
        """``network.nixl`` of ``GET /v1/node``: the agent's name, each registered pool's blocks, the
        devices whose pool is not registered now (``down``: engine dead or restarting; TCP meanwhile),
        and the layers written to peers and received from them so far."""
        a = self.agent
        return {"agent": a.name, "pools": {d: a.pools[i].num_blocks for d, i in self.pools.items()},
                "down": sorted(self.down), "layers_written": a.layers_written, "layers_received": a.layers_received}

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await self.agent.close()


def _nothing() -> None:
    return None
