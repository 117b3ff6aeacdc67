"""KV transfers over NIXL: what the TCP channel says around them, and each side's layer phase.

The TCP connection of :mod:`node.transport` stays the control channel: handshake (HMAC, layout,
fingerprint), offers, accepts, commits, aborts, capacity reports and relays all go over it as before.
With ``--kv-transport nixl`` only the layer payloads leave it:

  C → S  NixlQuery(agent)                          once, right after HelloAck (client runs NIXL)
  S → C  NixlInfo(agent, metadata, pools)          empty metadata: no NIXL there (reason), TCP it is
  C → S  TransferOffer(..., nixl=True)             the sender can write this sequence's blocks
  S → C  TransferAccept(cached_blocks, nixl_pool, block_ids)
                                                   nixl_pool ≥ 0: write layers into these blocks of
                                                   that pool; -1: send them over TCP as before
  C ⇒ S  NIXL WRITE of layer 0..L-1, each notifying "{transfer_id}|{layer}" (the data lands first)
  C → S  TransferDone                              after every write completed at the sender
  S → C  TransferCommitted                         after every notification and TransferDone

WRITE by the sender rather than READ by the receiver (vLLM's NIXL connector has the decode side
READ): the push flow of the TCP path stays as it is (the node that holds the sequence decides when its
layers go, and paces them under ``--link-gbps``), and only the sender has to load the other's
metadata. The server's metadata is loaded (parsed by NIXL's C++ code) only by a client that has checked the
server's HMAC proof, and the server loads nothing: a receiver needs no metadata of a sender to get
its notifications. Nothing is pickled (NIXL's descriptor serialization is): pools travel as plain
numbers in :class:`~node.transport.protocol.NixlPool`.

Failures keep the TCP path's rule: after an accept, exactly one of ``on_done`` / ``on_abort`` runs on
the receiver. A NIXL write that errors or does not finish within the stall timeout fails the
sender's transfer (it aborts and closes, the receiver frees its blocks); the receiver waits for each
layer's notification up to twice the stall timeout, so that a live sender gives up (and cancels its
writes) before the receiver frees blocks a late write could still reach. Layers carry no CRC-32
here: the bytes never pass through the node's code, and UCX's transports (TCP, RDMA) checksum their
packets on the wire.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

from node.transport.errors import ProtocolError, TransferAborted, TransportError, TransportTimeout
from node.transport.protocol import Layout, NixlInfo, NixlPool, NixlQuery, TransferAccept, TransferDone
from node.transport.wire import read_msg, send

if TYPE_CHECKING:
    from node.transport.nixl_agent import NixlAgent

_log = structlog.get_logger("node.transport")


@dataclass(frozen=True)
class NixlRoute:
    """A connection's NIXL path to its server: the peer agent's name in ours and its pools."""

    agent: str
    pools: tuple[NixlPool, ...]


async def query_route(reader, writer, nixl: "NixlAgent", peer_node_id: str, timeout_s: float,
                      max_header_bytes: int) -> NixlRoute | None:
    """Client, right after the handshake: ask the server for its NIXL agent and load its metadata.
    None when the server runs without NIXL (its transfers then go over TCP). Raises
    ``TransportTimeout`` (stage ``handshake``), ``ProtocolError``, NIXL's errors."""
    await send(writer, NixlQuery(agent=nixl.name), timeout_s)
    reply = await read_msg(reader, max_header_bytes, timeout_s, "handshake")
    if not isinstance(reply, NixlInfo):
        raise ProtocolError(f"expected NixlInfo, got {type(reply).__name__}")
    if not reply.metadata:
        _log.info("kv_peer_without_nixl", peer_node=peer_node_id, reason=reply.reason)
        return None
    name = await nixl.add_remote(peer_node_id, reply.metadata)
    return NixlRoute(name, tuple(reply.pools))


def info_of(nixl: "NixlAgent | None", metadata: bytes, reason: str = "") -> NixlInfo:
    """The server's answer to a :class:`NixlQuery` (``metadata`` taken once all pools were registered)."""
    if nixl is None:
        return NixlInfo(reason=reason or "this node runs --kv-transport tcp")
    return NixlInfo(agent=nixl.name, metadata=metadata, pools=list(nixl.pools))


async def send_layers(nixl: "NixlAgent", route: NixlRoute, layout: Layout, accept: TransferAccept,
                      local: tuple[int, list[int]], num_blocks: int, stall_timeout_s: float, link: Any,
                      layer_end_s: list[float], t0: float, check_abort, lost: asyncio.Event) -> int:
    """Sender, after an accept with ``nixl_pool >= 0``: WRITE the layers of our blocks after the
    ``accept.cached_blocks`` the receiver holds into ``accept.block_ids`` (see
    :meth:`NixlAgent.write_layers`), appending each layer's completion time (s since ``t0``) to
    ``layer_end_s``. ``link``: a :class:`~node.transport.throttle.LinkThrottle` or None;
    ``check_abort()`` raises if the receiver has aborted; ``lost`` is set when the TCP connection dies
    (the receiver is gone or gave up: the writes still in flight are cancelled at once rather than at
    their stall timeout). Returns the bytes written. Raises ``ProtocolError`` (an accept that does not
    fit the offer), ``TransportError`` (the connection died) and the writes' errors."""
    skip = accept.cached_blocks
    if not 0 <= accept.nixl_pool < len(route.pools):
        raise ProtocolError(f"peer named NIXL pool {accept.nixl_pool} of {len(route.pools)}")
    pool, blocks = local
    if len(accept.block_ids) != num_blocks - skip or len(blocks) != num_blocks:
        raise ProtocolError(f"peer gave {len(accept.block_ids)} blocks for {num_blocks - skip} uncached ones")
    remote_pool = route.pools[accept.nixl_pool]
    if any(not 0 <= b < remote_pool.num_blocks for b in accept.block_ids):
        raise ProtocolError(f"peer gave block ids outside its pool of {remote_pool.num_blocks} blocks")

    async def before(layer: int, nbytes: int) -> None:
        check_abort()
        if link is not None:
            await link.wait(nbytes)

    writes = asyncio.ensure_future(nixl.write_layers(
        route.agent, layout, pool, blocks[skip:], remote_pool, accept.block_ids, accept.transfer_id, stall_timeout_s,
        before, lambda _layer: layer_end_s.append(time.monotonic() - t0)))
    watch = asyncio.ensure_future(lost.wait())
    try:
        done, _ = await asyncio.wait({writes, watch}, return_when=asyncio.FIRST_COMPLETED)
        if writes in done:
            return writes.result()
        writes.cancel()
        with contextlib.suppress(BaseException):
            await writes
        check_abort()  # the receiver's abort reason, or the connection's error
        raise TransportError("the connection was lost during the NIXL writes")
    finally:
        watch.cancel()
        if not writes.done():
            writes.cancel()


async def receive_layers(reader, notifs: asyncio.Queue, transfer_id: str, num_layers: int,
                         stall_timeout_s: float, max_header_bytes: int, arrivals: list[float], t0: float) -> None:
    """Receiver, after an accept with a NIXL pool: wait for every layer's notification (each within
    ``2 * stall_timeout_s``; see the module docstring) and for the sender's ``TransferDone``, watching
    the TCP channel meanwhile (a ``TransferAbort``, a hang-up or a stray message ends the transfer).
    Appends each layer's arrival time (s since ``t0``) to ``arrivals``. Raises ``TransferAborted``,
    ``TransportTimeout`` (stage ``stall``), ``ProtocolError``, ``asyncio.IncompleteReadError``."""
    control: asyncio.Future | None = asyncio.ensure_future(read_msg(reader, max_header_bytes, None))
    seen: set[int] = set()
    try:
        while len(seen) < num_layers or control is not None:
            waits = {control} if control is not None else set()
            layer = asyncio.ensure_future(notifs.get()) if len(seen) < num_layers else None
            if layer is not None:
                waits.add(layer)
            timeout = 2 * stall_timeout_s if layer is not None else stall_timeout_s
            done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if layer is not None and layer not in done:
                layer.cancel()
            if not done:
                what = f"NIXL notification for layer {len(seen)}" if layer is not None else "TransferDone"
                raise TransportTimeout(f"no {what} within {timeout} s", "stall")
            if layer in done:
                n = layer.result()
                if 0 <= n < num_layers and n not in seen:
                    seen.add(n)
                    arrivals.append(time.monotonic() - t0)
            if control in done:
                msg, control = control.result(), None  # raises on a hang-up
                if isinstance(msg, TransferDone) and msg.transfer_id == transfer_id:
                    continue  # the notifications may still be on their way (another channel)
                reason = getattr(msg, "reason", None)
                if reason is not None:
                    raise TransferAborted(f"sender aborted: {reason}")
                raise ProtocolError(f"expected TransferDone, got {type(msg).__name__}")
    finally:
        if control is not None:
            control.cancel()
