"""KV hand-off between nodes over TCP, the sending side: :class:`PeerLinks` (the receiving side is
:class:`~node.runtime.kv_receiver.KVReceiver`), on the node's event loop, built on :mod:`node.transport`.

A hand-off of one decoding sequence (the node that owns the client's HTTP stream is the *origin*):

1. the origin's device detaches the sequence at a step boundary; its blocks stay pinned;
2. a fresh connection to the peer (HMAC handshake, layout and fingerprint check) offers the sequence with
   ``relay=True``; the peer reserves blocks before the first byte or refuses;
3. layers stream in order (gathered in the device's worker thread, CRC-checked on arrival, scattered
   into the reserved blocks in the peer's worker thread);
4. after ``TransferCommitted`` the origin frees its blocks and the peer decodes the sequence in its
   continuous batch; the same connection carries the tokens back, and the origin feeds them through
   the choice's own output state, so the client's stream goes on with no gap and no duplicate.

Failures: refused or failed before the commit → the sequence goes back to its device with its own
blocks (nothing lost). The relay breaking after the commit (the peer or the link died) → the origin
recomputes the prompt plus every token already streamed on a local device, counted against
``--max-retries``; past it the choice ends with an error (503 ``peer_unavailable``). A peer that
can never take the sequence (e.g. a shorter context) ends it at once (503 ``peer_refused``, with the
peer's reason). The client leaving closes the connection, which makes the peer drop the sequence.
Every wait is bounded by ``--kv-connect-timeout-s`` / ``--kv-transfer-timeout-s``; timeouts are
counted by stage in ``shiftnode_kv_timeouts_total``. One hand-off on the sending side, and who frees a
detached sequence's pinned blocks on each path (a cancel at any point included), is
:class:`~node.runtime.handoff.HandOff`.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import suppress
from typing import Callable

import msgspec
import structlog

from node.core.sequence import Sequence
from node.runtime.engine import DeviceEngine
from node.runtime.handoff import HandOff, why
from node.runtime.interfaces import PeerHost
from node.runtime.request import RequestState
from node.runtime.peer_state import READY, REFUSED, Peer, peer_id, split_addr
from node.transport import KVClient, Layout, PeerRefused, SeqState, timeout_stage
from node.transport.protocol import StatusReply

log = structlog.get_logger("shiftnode.peers")

STATUS_POLL_S = 0.05  # how often each peer's capacity is asked for
RECONNECT_S = 0.5  # pause before reconnecting a peer's control connection
REFUSED_RETRY_S = 2.0  # pause before asking a refused peer again (it may restart with the right model) ...
REFUSED_RETRY_MAX_S = 60.0  # ... doubling per refusal in a row up to this (a peer that stays incompatible)


def more_room(before: StatusReply | None, now: StatusReply) -> bool:
    """Whether a peer's new capacity report could let placement do what it could not (a decision round is
    worth it): the first report, accepting again, or more room. Each of P pollers kicking a round every
    poll made P rounds of O(P) work per STATUS_POLL_S on the loop (O(P²) at 20 Hz); reports that only
    say the same or less wait for the next round a local event starts (which reads them)."""
    if before is None or now.accepting != before.accepting:
        return True
    return (now.max_device_free_blocks > before.max_device_free_blocks or now.seq_slots_free > before.seq_slots_free
            or now.kv_free_blocks > before.kv_free_blocks)


class PeerLinks:
    """The sending side: capacity polling of every peer node and sequence hand-offs to them.

    Peers start as ``--peers`` and change at run time with :meth:`add` / :meth:`remove`
    (``POST /v1/node/peers``). Each peer keeps a control connection that is re-opened after any
    failure (resolving its hostname again, so a peer that restarts, on the same address or behind a
    name that moved, is found again) and polled for capacity every ``STATUS_POLL_S``.

    Args:
        node: the origin node (its engines, driver, metrics and config).
        layout: this node's KV layout and fingerprint; a peer with another is refused in the handshake.
    """

    def __init__(self, node: PeerHost, layout: Layout):
        cfg = node.config
        self.node = node
        self.layout = layout
        self.secret = cfg.peer_secret or ""
        self.link_gbps = cfg.link_gbps
        self.stale_s = cfg.peer_stale_s
        self.peers: dict[str, Peer] = {}
        self._pollers: dict[str, asyncio.Task] = {}  # peer id → its poller
        self._started = False
        for addr in cfg.peers:
            self.add(addr)
        self.tasks: dict[str, set[asyncio.Task]] = {}  # request id → its hand-off tasks
        self.retries: dict[str, int] = {}  # sequence id → recomputes after failed hand-offs
        self.sending: dict[str, str] = {}  # sequence id → its source device, while its hand-off is not settled
        self.nixl = None  # --kv-transport nixl: the node's NixlPlane (hand-offs load each peer's agent)

    # --- the peer set ---------------------------------------------------------------------------
    def add(self, addr: str) -> bool:
        """Start using the peer at ``host:port``; False when it is already one. Raises ValueError."""
        host, port = split_addr(addr)
        addr = f"{host}:{port}"
        if peer_id(addr) in self.peers:
            return False
        p = Peer(addr, host, port)
        self.peers[p.id] = p
        if self._started:
            self._start_poller(p)
        log.info("peer_added", peer=addr)
        return True

    def remove(self, addr: str) -> bool:
        """Stop placing on the peer at ``host:port`` (hand-offs and relays under way go on to their
        end); False when it is not one. Raises ValueError for a malformed address."""
        host, port = split_addr(addr)
        p = self.peers.pop(peer_id(f"{host}:{port}"), None)
        if p is None:
            return False
        task = self._pollers.pop(p.id, None)
        if task is not None:
            task.cancel()
        log.info("peer_removed", peer=p.addr)
        self._kick()
        return True

    def start(self) -> None:
        self._started = True
        for p in self.peers.values():
            self._start_poller(p)

    def _start_poller(self, p: Peer) -> None:
        self._pollers[p.id] = asyncio.get_running_loop().create_task(self._poll(p), name=f"peer-{p.addr}")

    async def close(self) -> None:
        tasks = list(self._pollers.values()) + [t for ts in self.tasks.values() for t in ts]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def healthy(self, now: float) -> list[Peer]:
        """Peers whose capacity report is fresh, who accept transfers and were not refused (placement targets)."""
        return [p for p in self.peers.values() if p.state(now, self.stale_s)[0] == READY]

    def ready(self, now: float) -> list[Peer]:
        """Healthy peers not held back after a refusal or a failure (hand-off targets now)."""
        return [p for p in self.healthy(now) if now >= p.hold_until]

    def unusable(self, now: float) -> tuple[str, str]:
        """Why no peer can be used now: (``peer_refused`` when every peer was refused, else
        ``peer_unavailable``; each peer's state and reason, for a client's error message)."""
        states = [(p.addr, *p.state(now, self.stale_s)) for p in self.peers.values()]
        if not states:
            return "peer_unavailable", "no peers configured"
        code = "peer_refused" if all(s == REFUSED for _, s, _ in states) else "peer_unavailable"
        return code, "; ".join(f"{a} {s}" + (f" ({r})" if r else "") for a, s, r in states)

    async def connect(self, peer: Peer, **kw) -> KVClient:
        """A fresh, authenticated connection to ``peer`` with the configured timeouts."""
        cfg = self.node.config
        return await KVClient.connect(
            peer.host, peer.port, self.secret, node_id=cfg.name, layout=self.layout,
            connect_timeout_s=cfg.kv_connect_timeout_s, handshake_timeout_s=cfg.kv_connect_timeout_s,
            accept_timeout_s=cfg.kv_transfer_timeout_s, stall_timeout_s=cfg.kv_transfer_timeout_s,
            commit_timeout_s=cfg.kv_transfer_timeout_s, **kw)

    def refused(self, peer: Peer, e: PeerRefused) -> None:
        """A handshake with ``peer`` was refused (by it or by us): counted, logged when new, shown."""
        reason = str(e)
        peer.refusals += 1
        peer.status = None
        self.node.metrics.peer_refusals.labels(reason=e.code, direction="outbound").inc()
        if peer.refusal != (e.code, reason):
            log.warning("peer_refused", peer=peer.addr, code=e.code, reason=reason)
        peer.refusal = (e.code, reason)
        self._kick()

    def timed_out(self, e: BaseException, side: str = "sender") -> None:
        stage = timeout_stage(e)
        if stage is not None:
            self.node.metrics.kv_timeouts.labels(stage=stage, side=side).inc()

    async def _poll(self, peer: Peer) -> None:
        """Keep a control connection to ``peer`` and refresh its capacity every ``STATUS_POLL_S``. A peer
        that refuses the handshake (another model, layout or secret) is asked again after
        ``REFUSED_RETRY_S``, doubling per refusal in a row up to ``REFUSED_RETRY_MAX_S``: it may restart
        compatible, but one that stays incompatible is not asked (and logged about) every 2 s for ever."""
        while True:
            client = None
            pause = RECONNECT_S
            try:
                peer.asking, peer.asked_s = "the connection and handshake", time.monotonic()
                client = await self.connect(peer, heartbeat_interval_s=None)
                if peer.refusal is not None or peer.error is not None:
                    log.info("peer_connected", peer=peer.addr, peer_node=client.peer_node_id)
                peer.refusal, peer.error, peer.node_id, peer.timed_out = None, None, client.peer_node_id, False
                peer.refused_in_row = 0
                while True:
                    peer.asking, peer.asked_s = "a capacity query", time.monotonic()
                    before, peer.status = peer.status, await client.query_status(timeout_s=self.stale_s)
                    peer.status_s, peer.asking = time.monotonic(), None
                    if more_room(before, peer.status):
                        self._kick()
                    await asyncio.sleep(STATUS_POLL_S)
            except asyncio.CancelledError:
                raise
            except PeerRefused as e:
                self.refused(peer, e)
                peer.refused_in_row += 1
                pause = min(REFUSED_RETRY_MAX_S, REFUSED_RETRY_S * 2 ** (peer.refused_in_row - 1))
                peer.retry_s = time.monotonic() + pause
            except Exception as e:  # noqa: BLE001 - any failure (uvloop raises RuntimeError on a closed transport): reconnect
                self.timed_out(e)
                stalled = timeout_stage(e) is not None  # it took the connection but did not answer in time
                if peer.error is None:
                    log.warning("peer_stalled" if stalled else "peer_unreachable", peer=peer.addr, error=why(e))
                peer.status, peer.refusal, peer.error, peer.timed_out = None, None, why(e), stalled
                self._kick()
            finally:
                peer.asking = None
                if client is not None:
                    with suppress(Exception):
                        await client.close()
            await asyncio.sleep(pause)

    def _kick(self) -> None:
        if self.node.driver is not None:
            self.node.driver.kick()

    # --- hand-off (node.runtime.handoff) ---------------------------------------------------------
    status_poll_s, reconnect_s = STATUS_POLL_S, RECONNECT_S  # how long a peer is held back after a refusal / failure

    def seq_state(self, req: RequestState, seq: Sequence) -> SeqState:
        """What the peer needs to continue ``seq`` (durations, not clock readings)."""
        now = time.monotonic()
        return SeqState(request_id=req.request_id, seq_id=seq.seq_id, index=seq.index, token_ids=list(seq.token_ids),
                        prompt_len=seq.prompt_len, num_computed=seq.num_computed, max_len=seq.max_len,
                        sampling=msgspec.structs.asdict(seq.params), age_s=max(0.0, now - seq.arrival_s),
                        first_token_age_s=None if seq.first_token_s is None else max(0.0, now - seq.first_token_s),
                        num_preemptions=seq.num_preemptions)

    def hand_off(self, engine: DeviceEngine, req: RequestState, seq: Sequence, peer: Peer, reason: str,
                 settled: Callable[[bool], None] | None = None) -> asyncio.Task:
        """Start moving decoding ``seq`` from ``engine`` to ``peer`` (see the module docstring and
        :class:`~node.runtime.handoff.HandOff`, which owns the sequence's pinned blocks until they are
        freed or given back on every path, a cancel included).

        ``settled(committed)`` is called once the transfer is decided: True when the peer committed
        (the task then relays the tokens until the sequence ends), False when the sequence stayed
        here (back on ``engine``, or dropped). The task returns whether the peer committed.
        """
        self.sending[seq.seq_id] = engine.device_id

        def settle(committed: bool) -> None:
            self.sending.pop(seq.seq_id, None)
            if settled is not None:
                settled(committed)

        task = HandOff(self, engine, req, seq, peer, reason, settle).start()
        self.tasks.setdefault(req.request_id, set()).add(task)
        task.add_done_callback(lambda t, rid=req.request_id: self._forget(rid, t))
        return task

    def _forget(self, request_id: str, task: asyncio.Task) -> None:
        ts = self.tasks.get(request_id)
        if ts is not None:
            ts.discard(task)
            if not ts:
                del self.tasks[request_id]

    def cancel(self, request_id: str) -> None:
        """The client left: stop its hand-offs and relays (the peers drop their copies)."""
        for t in list(self.tasks.get(request_id, ())):
            t.cancel()
