"""Errors of the KV transfer protocol (pure: standard library only), and the timeout stage a failure
is counted under (``shiftnode_kv_timeouts_total``)."""

from __future__ import annotations


class TransportError(Exception):
    """Base class of every error raised by ``node.transport``."""


class ProtocolError(TransportError):
    """The peer sent something the protocol does not allow (bad frame, wrong message, wrong order)."""


class FrameTooLarge(ProtocolError):
    """A frame or payload is larger than the configured bound; the connection is dropped. ``size``:
    the length announced (bytes), when known."""

    def __init__(self, message: str, size: int | None = None):
        super().__init__(message)
        self.size = size


class PeerRefused(TransportError):
    """A handshake ended in a refusal (by either side); ``code`` says why, for logs and metrics:
    ``auth`` (the secret), ``version``, ``layout`` (cache geometry, dtype, block size or model id),
    ``config``, ``weights``, ``tokenizer`` (the :class:`Fingerprint`), ``fingerprint`` (one side has none)."""

    code = "refused"

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        if code:
            self.code = code


class NotKVPeer(PeerRefused):
    """The address answered, but not the shiftnode KV handshake (an HTTP port, another service): a
    configuration mistake, reported as a refusal so ``/health`` and the logs name it."""

    code = "not_shiftnode"


def not_kv_peer(addr: str, exc: ProtocolError) -> NotKVPeer:
    """The refusal for ``addr`` whose first answer to our ``Hello`` was not a KV frame (``exc``)."""
    if isinstance(exc, FrameTooLarge) and exc.size is not None and exc.size.to_bytes(4, "big") == b"HTTP":
        detail = "it answered in HTTP: that is a node's HTTP --port; --peers takes the peer's --kv-port"
    else:
        detail = f"its answer was not a KV frame: {exc}"
    return NotKVPeer(f"peer {addr} did not answer the shiftnode KV handshake ({detail})")


class AuthError(PeerRefused):
    """The peer could not prove the shared secret."""

    code = "auth"


class VersionMismatch(AuthError):
    """The peer speaks another protocol version."""

    code = "version"


class TransferRefused(TransportError):
    """The receiver refused an offer before reserving anything (``code``: see :class:`TransferRefuse`)."""

    def __init__(self, code: str, reason: str):
        super().__init__(f"{code}: {reason}")
        self.code = code
        self.reason = reason


class TransferAborted(TransportError):
    """A transfer failed after the receiver reserved its blocks; the receiver freed them."""


class DeviceDown(RuntimeError):
    """The local device whose KV pool a transfer reads or writes is down (its engine died).

    Raised by the node's side of a transfer (a gather or scatter queued for a dead device's worker), not
    by the protocol. It is an expected case that the node recovers from (the transfer aborts, the
    receiver frees what it reserved, the sequence resumes on another device), so the transfer's ends
    log it as a warning with its reason, without a traceback; anything else a callback raises is a bug
    and keeps its error-level traceback."""


class ChecksumMismatch(TransferAborted):
    """A layer's payload does not match its checksum."""


class TransportTimeout(TransportError):
    """A bounded wait expired; ``stage`` names it: ``connect``, ``handshake``, ``accept``, ``stall``
    (a frame or payload chunk during a transfer, or a send the peer does not read), ``commit``,
    ``relay`` (relayed tokens), ``status`` (a capacity report), ``heartbeat``, ``idle``."""

    def __init__(self, message: str, stage: str = "io"):
        super().__init__(message)
        self.stage = stage


def timeout_stage(exc: BaseException | None) -> str | None:
    """The ``stage`` of the :class:`TransportTimeout` that caused ``exc`` (itself or along its
    ``__cause__``/``__context__`` chain), or None when no timeout is involved."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, TransportTimeout):
            return exc.stage
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


class TransferUnconfirmed(TransportError):
    """Every layer and ``TransferDone`` were sent but ``TransferCommitted`` never came back: the
    receiver may or may not have adopted the sequence (its ``on_done`` may have run)."""
