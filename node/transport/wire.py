"""Framing over asyncio streams and the mutual HMAC handshake.

Frame: ``>I`` length (bytes) + msgpack body of one :data:`~node.transport.protocol.Message`; a
``LayerHeader`` frame is followed by its raw payload. Every read is bounded in size and in time.
"""

from __future__ import annotations

import asyncio
import secrets
import struct

import msgspec

from node.transport.peer_auth import NONCE_BYTES, client_mac, mac_ok, server_mac
from node.transport.protocol import (
    PROTOCOL_VERSION, AuthError, FrameTooLarge, Goodbye, Hello, HelloAck, HelloProof, HelloReply,
    Layout, Message, PeerRefused, ProtocolError, TransportError, TransportTimeout, VersionMismatch, checksum,
    check_compatible,
)

_LEN = struct.Struct(">I")
_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder(Message)

DEFAULT_MAX_HEADER_BYTES = 4 << 20  # an offer carries the token ids: ~5 bytes/token
DEFAULT_MAX_PAYLOAD_BYTES = 1 << 30
DEFAULT_CHUNK_BYTES = 1 << 20


def encode(msg: Message) -> bytes:
    """One frame: length prefix + msgpack body."""
    body = _ENC.encode(msg)
    return _LEN.pack(len(body)) + body


async def read_msg(reader: asyncio.StreamReader, max_header_bytes: int, timeout_s: float | None,
                   stage: str = "idle") -> Message:
    """Read one frame within ``timeout_s`` s. Raises ``FrameTooLarge`` (length > ``max_header_bytes``),
    ``ProtocolError`` (undecodable), ``TransportTimeout`` (its ``stage`` is ``stage``),
    ``asyncio.IncompleteReadError`` (EOF)."""
    try:
        async with asyncio.timeout(timeout_s):
            (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
            if n > max_header_bytes:
                raise FrameTooLarge(f"frame of {n} bytes exceeds max_header_bytes {max_header_bytes}", n)
            body = await reader.readexactly(n)
    except TimeoutError:
        raise TransportTimeout(f"no frame within {timeout_s} s", stage) from None
    try:
        return _DEC.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"undecodable frame: {exc}") from None


async def read_payload(reader: asyncio.StreamReader, nbytes: int, stall_timeout_s: float | None,
                       chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> tuple[bytearray, int]:
    """Read ``nbytes`` raw bytes into a fresh (writable) bytearray, computing its CRC-32 as chunks land.

    The timeout is a stall timeout: each chunk of ``chunk_bytes`` must arrive within ``stall_timeout_s``
    s, so a large payload on a slow (throttled) link is not cut short while it makes progress.
    """
    buf = bytearray(nbytes)
    view = memoryview(buf)
    crc = 0
    off = 0
    try:
        async with asyncio.timeout(None) as cm:
            loop = asyncio.get_running_loop()
            while off < nbytes:
                if stall_timeout_s is not None:
                    cm.reschedule(loop.time() + stall_timeout_s)
                k = min(chunk_bytes, nbytes - off)
                piece = await reader.readexactly(k)
                view[off : off + k] = piece
                crc = checksum(piece, crc)
                off += k
    except TimeoutError:
        raise TransportTimeout(f"payload stalled at {off}/{nbytes} bytes for {stall_timeout_s} s", "stall") from None
    return buf, crc


async def drain(writer: asyncio.StreamWriter, timeout_s: float | None) -> None:
    try:
        async with asyncio.timeout(timeout_s):
            await writer.drain()
    except TimeoutError:
        raise TransportTimeout(f"peer did not read for {timeout_s} s", "stall") from None


async def send(writer: asyncio.StreamWriter, msg: Message, timeout_s: float | None) -> None:
    writer.write(encode(msg))
    await drain(writer, timeout_s)


def say_goodbye(writer: asyncio.StreamWriter, reason: str, code: str = "") -> None:
    """Best effort: queue a Goodbye (``code``: why a handshake was refused) and close (no await; never raises)."""
    try:
        if not writer.is_closing():
            writer.write(encode(Goodbye(reason=reason[:1000], code=code)))
        writer.close()
    except Exception:  # noqa: BLE001 - the connection may already be gone
        pass


def refusal_code(exc: BaseException) -> str:
    """The ``Goodbye.code`` that tells the other side why a handshake failed ("" when it was not a refusal)."""
    return exc.code if isinstance(exc, PeerRefused) else ""


def _peer_goodbye(msg: Message, step: str) -> TransportError:
    if isinstance(msg, Goodbye):
        if msg.code:
            return PeerRefused(f"peer refused the handshake: {msg.reason}", msg.code)
        return TransportError(f"peer closed during {step}: {msg.reason}")  # it gave up (e.g. its timeout)
    return ProtocolError(f"expected {step}, got {type(msg).__name__}")


async def client_handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: bytes,
                           node_id: str, layout: Layout | None, timeout_s: float,
                           max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES) -> HelloReply:
    """Client side: send Hello, check the server's proof, version and (with ``layout``) its layout,
    send ours, wait for the server's ``HelloAck``.

    Raises:
        AuthError / VersionMismatch: the server could not prove the secret or speaks another version.
        LayoutMismatch: the server's layout or fingerprint differs from ``layout`` (no proof is sent).
        PeerRefused: the server refused us (its ``Goodbye.code`` is the exception's ``code``).
        TransportTimeout: not done within ``timeout_s`` s (stage ``handshake``).
    """
    nonce = secrets.token_bytes(NONCE_BYTES)
    try:
        async with asyncio.timeout(timeout_s):
            await send(writer, Hello(version=PROTOCOL_VERSION, node_id=node_id, nonce=nonce, layout=layout), None)
            reply = await read_msg(reader, max_header_bytes, None)
            if not isinstance(reply, HelloReply):
                raise _peer_goodbye(reply, "HelloReply")
            if reply.version != PROTOCOL_VERSION:
                raise VersionMismatch(f"server speaks protocol {reply.version}, we speak {PROTOCOL_VERSION}")
            if len(reply.nonce) != NONCE_BYTES or not mac_ok(server_mac(secret, nonce, reply.nonce), reply.mac):
                raise AuthError(f"server {reply.node_id!r} could not prove the peer secret")
            if layout is not None and reply.layout is not None:
                check_compatible(layout, reply.layout)
            await send(writer, HelloProof(mac=client_mac(secret, nonce, reply.nonce)), None)
            ack = await read_msg(reader, max_header_bytes, None)
            if not isinstance(ack, HelloAck):
                raise _peer_goodbye(ack, "HelloAck")
    except TimeoutError:
        raise TransportTimeout(f"handshake not done within {timeout_s} s", "handshake") from None
    return reply


async def server_handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: bytes,
                           node_id: str, layout: Layout | None, timeout_s: float,
                           max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES) -> Hello:
    """Server side: answer the client's challenge with ours, check its proof and then (only for an
    authenticated client) its layout, and acknowledge.

    Raises:
        AuthError / VersionMismatch / LayoutMismatch: the client is refused (the caller says why in
            a ``Goodbye`` with the exception's ``code``); ``PeerRefused``: the client refused us.
            Every ``TransportError`` raised carries ``peer_node_id`` (the client's, "" before its Hello).
        TransportTimeout: not done within ``timeout_s`` s (stage ``handshake``).
    """
    nonce = secrets.token_bytes(NONCE_BYTES)
    hello = None
    try:
        async with asyncio.timeout(timeout_s):
            hello = await read_msg(reader, max_header_bytes, None)
            if not isinstance(hello, Hello):
                raise ProtocolError(f"expected Hello, got {type(hello).__name__}")
            if hello.version != PROTOCOL_VERSION:
                raise VersionMismatch(f"client speaks protocol {hello.version}, we speak {PROTOCOL_VERSION}")
            if len(hello.nonce) != NONCE_BYTES:
                raise AuthError(f"client nonce of {len(hello.nonce)} bytes, want {NONCE_BYTES}")
            mac = server_mac(secret, hello.nonce, nonce)
            await send(writer, HelloReply(version=PROTOCOL_VERSION, node_id=node_id, nonce=nonce, mac=mac,
                                          layout=layout), None)
            proof = await read_msg(reader, max_header_bytes, None)
            if not isinstance(proof, HelloProof):
                raise _peer_goodbye(proof, "HelloProof")
            if not mac_ok(client_mac(secret, hello.nonce, nonce), proof.mac):
                raise AuthError(f"client {hello.node_id!r} could not prove the peer secret")
            if layout is not None and hello.layout is not None:
                check_compatible(layout, hello.layout)
            await send(writer, HelloAck(), None)
    except TimeoutError:
        raise TransportTimeout(f"handshake not done within {timeout_s} s", "handshake") from None
    except TransportError as exc:
        exc.peer_node_id = hello.node_id if isinstance(hello, Hello) else ""  # who, for the refusal log
        raise
    return hello
