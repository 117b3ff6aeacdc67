"""KV-cache transfer: move a sequence's cache to a peer device (in-process) or peer node (TCP),
layer by layer in order, so the receiver can continue decoding it with the same block order and the
same position counter.

Modules
-------
``protocol``  wire Structs, layout check, HMAC and CRC helpers (pure: stdlib + msgspec)
``errors``    the protocol's errors and their timeout stages (pure)
``wire``      framing over asyncio streams, the handshake
``server``    :class:`KVServer` (receiver)        ``client``  :class:`KVClient` (sender)
``layers``    a transfer's layer payloads on the sending side (byte views, prefetch)
``throttle``  :class:`LinkThrottle` (emulated link, Gb/s)
``tensors``   torch glue: layout of a cache, gather/scatter one layer ↔ payload bytes
``local``     :func:`copy_sequence_blocks` between two caches of one process
``fingerprint`` :func:`model_fingerprint`: what decides the KV bytes (weights, tokenizer, config), hashed
``nixl_agent`` :class:`NixlAgent`: the NIXL data plane's local end (registered pools, WRITEs, notifications)
``nixl_plane``  what the TCP channel says around NIXL transfers, and each side's layer phase (``--kv-transport nixl``)

Frames
------
Every message is ``>I`` length (bytes) + msgpack body of one tagged Struct (tag = class name). A
``LayerHeader`` frame is followed by exactly ``nbytes`` raw bytes: one layer's blocks packed as
``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (keys then values) in the layout's dtype.
Bounds: a message body above ``max_header_bytes`` (default 4 MiB; an offer carries the token ids) or
a payload above ``max_payload_bytes`` (default 1 GiB) drops the connection with a logged reason.

Handshake (client C, server S, shared secret K = ``--peer-secret``, 32-byte random nonces)
---------------------------------------------------------------------------------------------
  C → S  Hello(version, node_id, nonce_c, layout?)
  S → C  HelloReply(version, node_id, nonce_s, mac = HMAC-SHA256(K, "shiftnode-kv/2/server|" nonce_c nonce_s), layout)
  C → S  HelloProof(mac = HMAC-SHA256(K, "shiftnode-kv/2/client|" nonce_c nonce_s))
  S → C  HelloAck
Each side checks the version (must be equal: a layout-changing upgrade bumps it), the other's MAC
(the labels differ, so a MAC cannot be reflected) and the other's :class:`Layout` including its
:class:`Fingerprint` (the client before it sends its proof, the server only once the client proved
the secret). A failure sends ``Goodbye(reason, code)`` (``code``: auth, version, layout, config,
weights, tokenizer, fingerprint), closes and logs ``kv_peer_rejected`` / ``kv_connect_failed``; the
other side raises :class:`PeerRefused` with that code. The whole handshake is bounded by
``handshake_timeout_s``.

Transfer (one at a time per connection)
---------------------------------------
  C → S  TransferOffer(transfer_id, layout, seq: SeqState, num_blocks, nbytes_per_layer)
  S → C  TransferRefuse(code, reason)           layout mismatch / invalid offer / no room: nothing reserved
     or  TransferAccept(cached_blocks)          sent only after ``reserve(offer)`` returned the blocks;
                                                the first cached_blocks it holds already (prefix cache)
                                                are not sent: each layer then covers the blocks after them
  C → S  LayerHeader(layer=0, nbytes, crc32) + payload, layer 1, …, layer L-1   (in order)
  C → S  TransferDone
  S → C  TransferCommitted                      after ``on_done``: the sender may now free its blocks
Either side may send ``TransferAbort(reason)``. After an accept, every failure — disconnect, stall
timeout, checksum mismatch, oversize frame, sender abort or death, a raising callback, shutdown — calls
the receiver's ``on_abort`` exactly once (it frees the reservation) and ends the connection. While
idle the client sends ``Heartbeat(n)`` every ``heartbeat_interval_s`` and the server echoes it; the
server drops a connection silent for ``idle_timeout_s``. Every await has a finite timeout (s).

Times in :class:`SeqState` are durations (``age_s``, ``first_token_age_s``) measured by the sender,
never clock readings, since the two nodes' clocks are unrelated.
"""

from node.transport.client import KVClient, SendReport
from node.transport.errors import TransferUnconfirmed
from node.transport.protocol import (
    PROTOCOL_VERSION, AuthError, ChecksumMismatch, Fingerprint, FrameTooLarge, Layout, LayoutMismatch, PeerRefused,
    ProtocolError, SeqState, TransferAborted, TransferOffer, TransferRefused, TransportError, TransportTimeout,
    VersionMismatch, check_compatible, timeout_stage,
)
from node.transport.server import KVServer, ReceiveReport
from node.transport.throttle import LinkThrottle

__all__ = [
    "PROTOCOL_VERSION", "AuthError", "ChecksumMismatch", "Fingerprint", "FrameTooLarge", "KVClient", "KVServer",
    "Layout", "LayoutMismatch", "LinkThrottle", "PeerRefused", "ProtocolError", "ReceiveReport", "SendReport",
    "SeqState", "TransferAborted", "TransferOffer", "TransferRefused", "TransferUnconfirmed", "TransportError",
    "TransportTimeout", "VersionMismatch", "check_compatible", "copy_sequence_blocks", "layout_of",
    "timeout_stage",
]


def __getattr__(name: str):
    # torch-dependent helpers load lazily, so a process that only speaks the protocol needs no torch
    if name == "copy_sequence_blocks":
        from node.transport.local import copy_sequence_blocks
        return copy_sequence_blocks
    if name == "layout_of":
        from node.transport.tensors import layout_of
        return layout_of
    raise AttributeError(name)
