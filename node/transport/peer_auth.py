"""The peer handshake's proof of the shared secret (pure): each side answers the
other's random nonce with an HMAC-SHA256 of both nonces under the secret, labelled by side and
protocol version, so a proof is never replayed as the other side's or across versions
(:func:`node.transport.wire.client_handshake`, :func:`~node.transport.wire.server_handshake`)."""

from __future__ import annotations

import hashlib
import hmac

from node.transport.protocol import PROTOCOL_VERSION

NONCE_BYTES = 32  # each side's random nonce (bytes)


def _mac(secret: bytes, label: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    msg = b"shiftnode-kv/%d/%s|" % (PROTOCOL_VERSION, label) + client_nonce + server_nonce
    return hmac.new(secret, msg, hashlib.sha256).digest()


def server_mac(secret: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """HMAC-SHA256 the server sends; labelled so it can never be replayed as a client proof."""
    return _mac(secret, b"server", client_nonce, server_nonce)


def client_mac(secret: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """HMAC-SHA256 the client sends."""
    return _mac(secret, b"client", client_nonce, server_nonce)


def mac_ok(expected: bytes, got: bytes) -> bool:
    """Whether a received proof ``got`` equals the ``expected`` one (in constant time)."""
    return hmac.compare_digest(expected, got)


def secret_bytes(secret: str | bytes) -> bytes:
    """The shared secret as bytes; an empty secret is refused."""
    b = secret.encode() if isinstance(secret, str) else bytes(secret)
    if not b:
        raise ValueError("the peer secret must not be empty")
    return b
