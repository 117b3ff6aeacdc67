"""What a node knows about its peer nodes: each outbound peer's state (ready, unreachable, refused)
and why, and the inbound connections this node's KV listener refused. Plain data; the I/O that
updates it is in :mod:`node.runtime.peers`."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from node.transport.protocol import StatusReply

PEER_PREFIX = "peer:"
READY, UNREACHABLE, REFUSED, STALLED = "ready", "unreachable", "refused", "stalled"
PEER_STATES = (READY, STALLED, UNREACHABLE, REFUSED)
PEER_STALL_S = 1.0
"""A peer that has not answered a handshake or a capacity query (polled every 50 ms) for this long (s)
is *stalled*: it accepted the connection but does not reply (a wedged process, a full accept queue,
a middlebox that swallows the traffic). It is no hand-off target until it answers again; a short
pause only holds placements back, as an unreachable peer does."""


def peer_id(addr: str) -> str:
    """The placement id of a peer node (``peer:host:port``), used where a device id would be."""
    return PEER_PREFIX + addr


def is_peer(device_id: str | None) -> bool:
    return bool(device_id) and device_id.startswith(PEER_PREFIX)


def split_addr(addr: str) -> tuple[str, int]:
    """``host:port`` or ``[ipv6]:port`` → (host, port), the brackets dropped so the host resolves.
    Raises ValueError for anything else (port 1..65535)."""
    host, sep, port = addr.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535 or "[" in host or "]" in host:
        raise ValueError(f"peer address must be host:port, got {addr!r}")
    return host, int(port)


@dataclass
class Peer:
    """A peer node as this node sees it. Times are this node's monotonic clock (s).

    ``status``/``status_s``: its last capacity report and when it came; ``refusal``: (code, reason)
    of the last handshake refused by either side, cleared by the next accepted one; ``error``: why
    the control connection is down (None while it is up); ``asking``/``asked_s``: the handshake or
    query the control connection waits on and since when (None when it waits on none); ``timed_out``:
    the connection went down because the peer did not answer in time (it is stalled, not gone).
    """

    addr: str
    host: str
    port: int
    status: StatusReply | None = None
    status_s: float = 0.0
    sent: int = 0
    failures: int = 0
    refusals: int = 0
    hold_until: float = 0.0  # no new hand-off before this (after a refusal or a failure)
    node_id: str = ""
    refusal: tuple[str, str] | None = None
    error: str | None = "not connected yet"
    asking: str | None = None
    asked_s: float = 0.0
    timed_out: bool = False
    refused_in_row: int = 0  # handshakes refused since the last accepted one (the retry backs off)
    retry_s: float = 0.0  # when a refused peer is asked again

    @property
    def id(self) -> str:
        return peer_id(self.addr)

    def state(self, now: float, stale_s: float) -> tuple[str, str | None]:
        """(``ready`` | ``stalled`` | ``unreachable`` | ``refused``, reason or None when ready)."""
        if self.refusal is not None:
            code, reason = self.refusal
            again = f" (asked again in {self.retry_s - now:.0f} s)" if self.retry_s > now else ""
            return REFUSED, f"{code}: {reason}{again}"
        if self.asking is not None and now - self.asked_s >= PEER_STALL_S:
            return STALLED, f"no answer to {self.asking} for {now - self.asked_s:.1f} s"
        if self.status is not None and now - self.status_s < stale_s:
            if self.status.accepting:
                return READY, None
            return REFUSED, "not_accepting: the peer has no device that can decode a sequence from a peer"
        if self.status is not None:
            return UNREACHABLE, f"no capacity report for {now - self.status_s:.1f} s"
        if self.timed_out:
            return STALLED, self.error
        return UNREACHABLE, self.error or "not connected"

    def as_dict(self, now: float, stale_s: float) -> dict:
        """This peer for ``GET /v1/node``."""
        state, reason = self.state(now, stale_s)
        st = self.status
        return {"addr": self.addr, "state": state, "reason": reason, "healthy": state == READY,
                "node_id": self.node_id or None, "sent": self.sent, "failures": self.failures,
                "refusals": self.refusals,
                "kv_free_blocks": st.kv_free_blocks if st else None, "seq_slots_free": st.seq_slots_free if st else None,
                "last_report_age_s": round(now - self.status_s, 3) if st else None}


@dataclass
class InboundRefusal:
    """A node whose connection to this node's KV listener was refused (latest of its attempts)."""

    peer: str  # the address it connected from
    node_id: str
    code: str
    reason: str
    at_s: float
    count: int = 1


class InboundRefusals:
    """The last ``limit`` refused inbound peers, one entry per node id (or address when it sent none)."""

    def __init__(self, limit: int = 32):
        self.limit = limit
        self._by_key: OrderedDict[str, InboundRefusal] = OrderedDict()

    def record(self, peer: str, node_id: str, code: str, reason: str, now: float) -> InboundRefusal:
        key = node_id or peer.rpartition(":")[0]
        old = self._by_key.pop(key, None)
        entry = InboundRefusal(peer, node_id, code, reason, now, (old.count + 1) if old else 1)
        self._by_key[key] = entry
        while len(self._by_key) > self.limit:
            self._by_key.popitem(last=False)
        return entry

    def recent(self, now: float, window_s: float) -> list[InboundRefusal]:
        """Refusals within the last ``window_s`` s, oldest first."""
        return [r for r in self._by_key.values() if now - r.at_s <= window_s]

    def as_list(self, now: float) -> list[dict]:
        return [{"peer": r.peer, "node_id": r.node_id or None, "code": r.code, "reason": r.reason,
                 "age_s": round(now - r.at_s, 3), "count": r.count} for r in self._by_key.values()]
