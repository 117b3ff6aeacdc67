"""Wire types of the KV transfer protocol (pure: standard library and msgspec only).

Every message is a tagged msgspec Struct sent as one frame: a 4-byte big-endian length, then the
msgpack body (see :mod:`node.transport.wire`). A :class:`LayerHeader` is followed by exactly
``nbytes`` raw payload bytes (no second length prefix). Sizes are bytes, durations seconds.
"""

from __future__ import annotations

import math
import secrets
import zlib
from typing import Any

import msgspec

from node.transport.errors import (  # noqa: F401 - the protocol's errors, re-exported
    AuthError, ChecksumMismatch, FrameTooLarge, PeerRefused, ProtocolError, TransferAborted, TransferRefused,
    TransportError, TransportTimeout, VersionMismatch, timeout_stage,
)

PROTOCOL_VERSION = 2  # 2: Layout carries a Fingerprint; the handshake ends with HelloAck


def new_transfer_id(prefix: str) -> str:
    """A transfer's id: ``prefix`` (who and what, for logs) and 128 random bits, so that nobody who sees
    some ids (logs, /v1/node) can name another transfer in flight (a counter could be guessed)."""
    return f"{prefix}/{secrets.token_hex(16)}"

# Element size (bytes) of each KV dtype the protocol knows, by torch name without "torch.".
DTYPE_BYTES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1, "uint8": 1,
}


# ---------------------------------------------------------------------------------------- layout
class Fingerprint(msgspec.Struct, frozen=True, kw_only=True):
    """What decides the bytes of a KV cache (and what a receiver does with a sequence), as SHA-256 hex
    digests (see :mod:`node.transport.fingerprint`): ``weights`` (the checkpoint's content, or the
    random weights actually drawn), ``tokenizer`` (tokenizer.json and the end-of-sequence ids),
    ``config`` (config.json, canonical). ``digest`` covers those three plus the KV dtype, the block
    size and :data:`PROTOCOL_VERSION`."""

    weights: str
    tokenizer: str
    config: str
    digest: str


FINGERPRINT_PARTS = ("config", "weights", "tokenizer")


class Layout(msgspec.Struct, frozen=True, kw_only=True):
    """Geometry of a device's paged KV cache and the model's fingerprint; two ends must agree on every field.

    The cache is ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` of ``dtype``
    (a torch dtype name without ``torch.``, e.g. ``"bfloat16"``).
    """

    model_id: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    fingerprint: Fingerprint | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown KV dtype {self.dtype!r} (known: {sorted(DTYPE_BYTES)})")
        for f in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, f) <= 0:
                raise ValueError(f"{f} must be positive, got {getattr(self, f)}")

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer, keys and values: ``2*block_size*Hkv*head_dim*itemsize``."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    def layer_bytes(self, num_blocks: int) -> int:
        """Bytes of one layer's payload for ``num_blocks`` blocks (buffer ``[2, n, bs, Hkv, D]``)."""
        return num_blocks * self.block_bytes


class LayoutMismatch(PeerRefused):
    """Two KV layouts differ; ``fields`` names the differing fields (``weights``, ``tokenizer``,
    ``config`` for the fingerprint's parts) and ``code`` the most basic of them (see :func:`mismatch_code`)."""

    def __init__(self, fields: list[str], message: str):
        super().__init__(message, mismatch_code(fields))
        self.fields = fields


def mismatch_code(fields: list[str]) -> str:
    """The reason label of a layout mismatch: ``layout`` when the geometry differs, else the first
    differing fingerprint part in the order config, weights, tokenizer (a different config usually
    means different weights too: the more basic difference is named)."""
    if any(f in Layout.__struct_fields__ and f != "fingerprint" for f in fields):
        return "layout"
    for part in FINGERPRINT_PARTS:
        if part in fields:
            return part
    return "fingerprint"


def _short(value: object) -> str:
    return repr(value[:12] + "…") if isinstance(value, str) and len(value) > 16 else repr(value)


def check_compatible(a: Layout, b: Layout) -> None:
    """Raise :class:`LayoutMismatch` naming every field where ``a`` and ``b`` differ: the geometry
    fields, then the fingerprint's parts (``config``, ``weights``, ``tokenizer``; ``fingerprint``
    when only one side has one, or only the digest differs)."""
    diffs = [(f, getattr(a, f), getattr(b, f)) for f in a.__struct_fields__
             if f != "fingerprint" and getattr(a, f) != getattr(b, f)]
    fa, fb = a.fingerprint, b.fingerprint
    if (fa is None) != (fb is None):
        diffs.append(("fingerprint", fa and fa.digest, fb and fb.digest))
    elif fa is not None and fa != fb:
        parts = [(p, getattr(fa, p), getattr(fb, p)) for p in FINGERPRINT_PARTS if getattr(fa, p) != getattr(fb, p)]
        if not parts and not diffs:  # only what the digest alone covers (dtype, block size, version)
            parts = [("fingerprint", fa.digest, fb.digest)]
        diffs += parts
    if diffs:
        detail = ", ".join(f"{f}: {_short(x)} != {_short(y)}" for f, x, y in diffs)
        raise LayoutMismatch([f for f, _, _ in diffs], f"KV layout mismatch ({detail})")


# ------------------------------------------------------------------------------------- sequence
class SeqState(msgspec.Struct, frozen=True, kw_only=True):
    """What a receiver needs to continue a sequence exactly where the sender left it.

    ``token_ids`` is prompt then output so far; ``num_computed`` (the position counter) counts the
    leading tokens whose K/V travel with the transfer: for a decoding sequence (at least one output
    token) it must be ``len(token_ids) - 1`` (every token but the last sampled one is cached).
    Times are durations measured by the sender when it builds the offer, never clock readings:
    ``age_s`` since arrival, ``first_token_age_s`` since the first output token (None before it).
    ``sampling`` is the sampling parameters as a plain dict (e.g. ``msgspec.structs.asdict``).
    """

    request_id: str
    seq_id: str
    index: int = 0
    token_ids: list[int]
    prompt_len: int
    num_computed: int
    max_len: int
    sampling: dict[str, Any] = {}
    age_s: float = 0.0
    first_token_age_s: float | None = None
    num_preemptions: int = 0

    def problems(self, block_size: int, num_blocks: int) -> list[str]:
        """Reasons this state cannot be adopted with ``num_blocks`` blocks of ``block_size`` (empty: ok)."""
        n = len(self.token_ids)
        out = []
        if not 0 < self.prompt_len <= n:
            out.append(f"prompt_len {self.prompt_len} not in 1..{n}")
        if n > self.max_len:
            out.append(f"{n} tokens exceed max_len {self.max_len}")
        if n > self.prompt_len and self.num_computed != n - 1:
            out.append(f"decoding sequence with num_computed {self.num_computed} != len(token_ids)-1 = {n - 1}")
        if not 0 <= self.num_computed <= n - 1:
            out.append(f"num_computed {self.num_computed} not in 0..{n - 1}")
        need = math.ceil(self.num_computed / block_size)
        most = math.ceil(self.max_len / block_size)
        if not need <= num_blocks <= max(most, need):
            out.append(f"num_blocks {num_blocks} not in {need}..{most} for {self.num_computed} cached tokens")
        if any(t < 0 for t in self.token_ids):
            out.append("negative token id")
        if self.age_s < 0 or (self.first_token_age_s is not None and self.first_token_age_s < 0):
            out.append("negative age")
        return out


# ------------------------------------------------------------------------------------- messages
class Msg(msgspec.Struct, tag=True, kw_only=True):
    """Base of every framed message (tagged by class name)."""


class Hello(Msg):
    """Client → server, first frame: version, who, a fresh challenge nonce and (optionally) its layout."""

    version: int
    node_id: str
    nonce: bytes
    layout: Layout | None = None


class HelloReply(Msg):
    """Server → client: proof of the secret over both nonces, the server's own nonce and layout."""

    version: int
    node_id: str
    nonce: bytes
    mac: bytes
    layout: Layout | None = None


class HelloProof(Msg):
    """Client → server: proof of the secret over both nonces (a different label than the server's)."""

    mac: bytes


class HelloAck(Msg):
    """Server → client, last frame of the handshake: the client's proof and layout were accepted (a
    refusal is a ``Goodbye`` with a ``code`` instead)."""


class Goodbye(Msg):
    """Either side, just before it closes the connection on purpose: why (``code``: a
    :class:`PeerRefused` code when the handshake was refused)."""

    reason: str
    code: str = ""


class Heartbeat(Msg):
    """Client → server when idle; the server echoes it back (same ``n``)."""

    n: int


class TransferOffer(Msg):
    """Sender → receiver: a sequence of ``num_blocks`` blocks; every layer is ``nbytes_per_layer``."""

    transfer_id: str
    layout: Layout
    seq: SeqState
    num_blocks: int
    nbytes_per_layer: int
    relay: bool = False  # after the commit, the receiver decodes the sequence and relays its tokens back
    nixl: bool = False  # the sender can WRITE the layers over NIXL (it loaded the receiver's agent)


class TransferAccept(Msg):
    """Receiver → sender, only after it reserved ``num_blocks`` blocks for the transfer.

    ``cached_blocks``: the receiver already holds the sequence's first ``cached_blocks`` blocks (its
    prefix cache), so the sender sends only the others: every layer is then the
    ``[2, num_blocks - cached_blocks, block_size, Hkv, D]`` buffer of the blocks after them.
    """

    transfer_id: str
    cached_blocks: int = 0
    nixl_pool: int = -1  # ≥ 0: WRITE the layers over NIXL into block_ids of this pool (NixlInfo.pools); -1: TCP
    block_ids: list[int] = []  # with nixl_pool: the receiver's blocks after the cached ones, in logical order


class TransferRefuse(Msg):
    """Receiver → sender: not accepted, nothing reserved. ``code``: ``layout`` (see ``reason`` for the
    differing fields), ``invalid`` (inconsistent offer), ``no_room`` (reservation failed),
    ``busy`` (duplicate transfer id)."""

    transfer_id: str
    code: str
    reason: str
    fields: list[str] = []  # code "layout": the differing Layout fields


class LayerHeader(Msg):
    """Sender → receiver: layer ``layer`` (0, 1, … in order) follows as ``nbytes`` raw bytes whose
    CRC-32 (``zlib.crc32``) is ``checksum``."""

    transfer_id: str
    layer: int
    nbytes: int
    checksum: int


class TransferDone(Msg):
    """Sender → receiver: every layer was sent."""

    transfer_id: str


class TransferCommitted(Msg):
    """Receiver → sender: the sequence is adopted; the sender may free its blocks."""

    transfer_id: str


class TransferAbort(Msg):
    """Either side: the transfer failed; the receiver frees its reservation, the sender keeps its copy."""

    transfer_id: str
    reason: str


class NixlPool(msgspec.Struct, frozen=True, kw_only=True):
    """Where a peer's registered KV pool is: base address, blocks, NIXL memory type and device."""

    addr: int
    num_blocks: int
    mem: str = "DRAM"
    dev: int = 0


class NixlQuery(Msg):
    """Client → server right after the handshake, when the client runs ``--kv-transport nixl``: send
    your NIXL agent (see :mod:`node.transport.nixl_plane`). ``agent``: the client's, for logs."""

    agent: str


class NixlInfo(Msg):
    """Server → client: its NIXL agent's metadata and KV pools; empty ``metadata``: no NIXL (``reason``)."""

    agent: str = ""
    metadata: bytes = b""
    pools: list[NixlPool] = []
    reason: str = ""


class StatusQuery(Msg):
    """Client → server when idle: how much can you take? (the router's view of a peer)."""

    n: int


class StatusReply(Msg):
    """Server → client: the receiver's decode capacity now. Blocks are KV blocks of the shared layout
    summed over the receiver's decode-capable devices; ``max_device_free_blocks`` is the most free
    (after reservations) on any single one, which bounds the largest sequence it can take, and
    ``decode_seqs``/``decode_context_tokens`` describe the batch on that device (where a sequence
    sent now would decode)."""

    n: int
    kv_free_blocks: int
    kv_total_blocks: int
    max_device_free_blocks: int
    max_device_total_blocks: int
    seq_slots_free: int
    accepting: bool = True
    decode_seqs: int = 0  # on the roomiest device: its decoding sequences ...
    decode_context_tokens: int = 0  # ... and the tokens they hold (its decode load)


class TokenRelay(Msg):
    """Receiver → sender after ``TransferCommitted`` when the offer asked for a relay: tokens the
    receiver produced for the sequence, in order, continuing its output without gap. ``logprobs``:
    per token ``[token_id, logprob, [[alt_id, alt_logprob], ...]]`` when the sampling asked for them."""

    transfer_id: str
    token_ids: list[int]
    logprobs: list[Any] = []


class RelayEnd(Msg):
    """Receiver → sender: the relayed sequence ended here (``finish_reason``) or failed (``error``)."""

    transfer_id: str
    finish_reason: str | None = None
    error: str | None = None


Message = (Hello | HelloReply | HelloProof | HelloAck | Goodbye | Heartbeat | TransferOffer | TransferAccept
           | TransferRefuse | LayerHeader | TransferDone | TransferCommitted | TransferAbort
           | StatusQuery | StatusReply | TokenRelay | RelayEnd | NixlQuery | NixlInfo)


def offer_problems(offer: TransferOffer) -> list[str]:
    """Internal consistency of an offer (the layout is checked separately)."""
    out = offer.seq.problems(offer.layout.block_size, offer.num_blocks)
    want = offer.layout.layer_bytes(offer.num_blocks)
    if offer.nbytes_per_layer != want:
        out.append(f"nbytes_per_layer {offer.nbytes_per_layer} != {want} for {offer.num_blocks} blocks")
    return out


# ---------------------------------------------------------------------------------- checksum
def checksum(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """CRC-32 of ``data`` continuing from ``value`` (stdlib ``zlib.crc32``, ~1 GB/s, releases the GIL)."""
    return zlib.crc32(data, value)

