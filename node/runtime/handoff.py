"""The sending side of one sequence's KV hand-off to a peer node, and who owns its pinned blocks.

A hand-off (see :mod:`node.runtime.peer_links` for the protocol) detaches a decoding sequence from its
device at a step boundary; from then on its blocks are *pinned*: allocated in the device's ledger but
held by no sequence there. Exactly one of three things must happen to them, on every path:

* the peer committed its copy → freed here (:meth:`HandOff._committed`);
* the transfer failed before a commit and the sequence goes on here → given back with the sequence
  (``DeviceEngine.readopt``; if the device died meanwhile, the sequence is resumed like its others);
* the sequence will not go on (its client left, the request timed out or was failed, the node is
  closing, the peer can never take it) → freed, and the choice ended if nobody ended it yet.

The last case is enforced by the task's done callback (:meth:`HandOff._finish`), not by the
coroutine, because a task cancelled before its first step never runs its body, and a task cancelled
just after ``detach`` resolved loses the result at its ``await`` (issue 33 item 2; issue 32's
cross-node leak was this: a client leaving right after its first token, which is also when its
hand-off starts). The detach future is created when the hand-off is, and kept: the callback cancels
it if it has not resolved (the device then keeps the sequence, and the request's abort frees it), or
frees the blocks it resolved to. The blocks are stamped with the device's incarnation
(:mod:`node.runtime.block_pins`): after a restart of the device they are neither freed nor adopted.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import suppress
from typing import Callable, Protocol

import structlog

from node.core.sequence import Sequence, SeqStatus
from node.runtime.block_pins import stale
from node.runtime.engine import DeviceEngine
from node.runtime.interfaces import PeerHost
from node.runtime.moves import MigrationRecord
from node.runtime.peer_state import Peer
from node.runtime.request import RequestState
from node.transport import KVClient, Layout, PeerRefused, SeqState, TransferRefused, TransportError
from node.transport.errors import DeviceDown
from node.transport.protocol import RelayEnd, new_transfer_id
from node.worker.sampler import TokenLogprobs

log = structlog.get_logger("shiftnode.peers")

RETRY_AFTER_S = 2.0  # Retry-After of a request failed for want of a usable peer


def lp_from_wire(x: list | None) -> TokenLogprobs | None:
    return None if x is None else TokenLogprobs(int(x[0]), float(x[1]), [(int(a), float(b)) for a, b in x[2]])


def why(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


class Links(Protocol):
    """What a hand-off uses of the node's :class:`~node.runtime.peer_links.PeerLinks` (which imports this
    module, so the links are typed by this view)."""

    node: PeerHost
    layout: Layout
    link_gbps: float | None
    reconnect_s: float
    status_poll_s: float
    retries: dict[str, int]

    async def connect(self, peer: Peer, **kw) -> KVClient:
        """A fresh connection to ``peer`` (handshake done)."""
        ...

    def refused(self, peer: Peer, e: PeerRefused) -> None:
        """Record that ``peer`` refused us."""
        ...

    def timed_out(self, e: BaseException, side: str = "sender") -> None:
        """Count a transfer timeout by stage."""
        ...

    def seq_state(self, req: RequestState, seq: Sequence) -> SeqState:
        """What the peer needs to go on decoding ``seq``."""
        ...


class HandOff:
    """One sequence's move to ``peer``: detach, send, then relay its tokens back (one task).

    Args:
        links: the node's :class:`~node.runtime.peer_links.PeerLinks` (connections, counters, retries).
        engine, req, seq: the device the sequence decodes on, its request and the sequence.
        peer: the target node; reason: why it moves (``pooled``, ``fallback``, ``drain``: metrics label).
        settle: called exactly once with True when the peer committed, False when the sequence stayed
            here or was dropped (also when the task was cancelled before it ran).
    """

    def __init__(self, links: Links, engine: DeviceEngine, req: RequestState, seq: Sequence, peer: Peer,
                 reason: str, settle: Callable[[bool], None]):
        self.links, self.engine, self.req, self.seq, self.peer, self.reason = links, engine, req, seq, peer, reason
        self._settle_cb = settle
        self.settled = False
        self.detach = engine.detach(seq)  # kept: its result is ours even if the task never reads it
        self.blocks: list[int] | None = None  # pinned blocks this hand-off owns (None: none, or handed on)
        self.index = 0

    def start(self) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(self._run())
        task.add_done_callback(self._finish)
        return task

    def _settle(self, committed: bool) -> None:
        if not self.settled:
            self.settled = True
            self._settle_cb(committed)

    def _take(self) -> bool:
        """Read the applied detach: True when the sequence left its device and its blocks are ours."""
        detached = self.detach.result()
        if detached is None:
            return False
        self.req, self.index, self.blocks = detached
        return True

    def _drop(self) -> None:
        """The sequence will not continue (here or there): its pinned blocks go back to the device."""
        if self.blocks is not None:
            self.engine.free_pinned(self.blocks)
            self.blocks = None
        self.seq.block_ids = []
        self.seq.status = SeqStatus.FINISHED

    def _finish(self, task: asyncio.Task) -> None:
        """The task ended, however: no pinned block and no unended choice may be left behind."""
        if not self.detach.done():
            self.detach.cancel()  # not applied yet: the device keeps the sequence (an abort frees it there)
        elif not self.detach.cancelled() and self.blocks is None and self.detach.exception() is None \
                and self.detach.result() is not None and not self.settled:
            self._take()  # applied, never read: the task was cancelled before it resumed
        if self.blocks is not None:
            self._drop()
            i = self.index
            if not self.req.cancelled and not self.req.finished[i]:  # e.g. the node closing: end the choice
                self.req.fail_choice(i, f"KV hand-off to peer {self.peer.addr} was stopped", status=503,
                                     code="peer_unavailable", retry_after_s=RETRY_AFTER_S)
        if not task.cancelled() and task.exception() is not None:
            log.error("handoff_task_failed", seq=self.seq.seq_id, peer=self.peer.addr, error=why(task.exception()))
        self._settle(False)

    async def _run(self) -> bool:
        await self.detach
        if not self._take():
            return False
        engine, seq, peer, links = self.engine, self.seq, self.peer, self.links
        blocks = self.blocks
        seq.device_id = peer.id
        start = time.monotonic()
        tid = new_transfer_id(f"{links.node.config.name}/{seq.seq_id}")
        client: KVClient | None = None
        try:
            nixl = links.nixl
            client = await links.connect(peer, link_gbps=links.link_gbps, heartbeat_interval_s=None,
                                         nixl=nixl.agent if nixl is not None else None)
            kv = engine.runner.kv_cache

            def layer(i: int):
                if stale(blocks, engine.incarnation):  # the device was restarted: its pool is another
                    raise RuntimeError(f"device {engine.device_id} was restarted during the hand-off")
                return engine.in_worker(_gather_host, kv, i, blocks)

            report = await client.send_sequence(links.layout, links.seq_state(self.req, seq), layer,
                                                len(blocks), transfer_id=tid, relay=True,
                                                nixl_blocks=nixl.blocks_of(engine, blocks) if nixl else None)
        except asyncio.CancelledError:  # the client left during the transfer: _finish frees the blocks
            await _close(client)
            raise
        except Exception as e:  # noqa: BLE001 - whatever broke the transfer, the sequence must not be stranded
            self._failed(e)  # before any await, so a cancel cannot come between the failure and its handling
            await _close(client)
            return False
        self._committed()
        rec = MigrationRecord(seq.seq_id, engine.device_id, peer.id, start, time.monotonic(), report.nbytes,
                              len(blocks), self.reason)
        links.node.record_migration(engine.device_id, peer.id, rec)
        try:
            await self._relay(client, tid)
        finally:
            await _close(client)
        return True

    def _committed(self) -> None:
        """The peer holds the sequence now: our copy's blocks are freed (behind any gather still queued)."""
        self.engine.free_pinned(self.blocks)
        self.blocks = None
        self._settle(True)
        self.peer.sent += 1

    def _failed(self, e: Exception) -> None:
        """A transfer that did not commit: the sequence goes back to its device with its own blocks
        (to be sent again, to this peer or another), or ends with an error when the peer can never
        take it or the retries are spent. Nothing was adopted there, whatever happened."""
        links, req, index, seq, peer = self.links, self.req, self.index, self.seq, self.peer
        refused_offer = isinstance(e, TransferRefused)  # nothing was reserved there
        device_down = isinstance(e, DeviceDown)  # our device died under the gather: not the peer's fault
        if not isinstance(e, (TransportError, OSError, DeviceDown)):
            log.exception("handoff_error", seq=seq.seq_id, peer=peer.addr)
        links.timed_out(e)
        if not device_down:
            peer.hold_until = time.monotonic() + (links.status_poll_s if refused_offer else links.reconnect_s)
        if isinstance(e, PeerRefused):  # the handshake (or the layout in the offer): not this peer for now
            links.refused(peer, e)
        elif refused_offer:
            log.info("handoff_refused", seq=seq.seq_id, peer=peer.addr, reason=str(e))
        elif device_down:  # the sequence resumes on another device (engine revival); logged without a traceback
            log.warning("handoff_device_down", seq=seq.seq_id, peer=peer.addr, error=str(e))
        else:  # the peer freed whatever it had reserved; our copy is intact
            peer.failures += 1
            log.warning("handoff_failed", seq=seq.seq_id, peer=peer.addr, error=str(e) or type(e).__name__)
        if refused_offer and e.code == "invalid":  # it never will take this sequence
            peer.failures += 1
            if not req.finished[index]:
                req.fail_choice(index, f"peer {peer.addr} cannot take this sequence: {e.reason}", status=503,
                                code="peer_refused", retry_after_s=RETRY_AFTER_S)
            self._drop()
        elif req.cancelled or not (refused_offer or isinstance(e, PeerRefused)
                                   or self.count_retry(f"KV hand-off to {peer.addr} failed: {e}")):
            self._drop()
        else:
            blocks, self.blocks = self.blocks, None
            self.engine.readopt(req, index, seq, blocks)
        self._settle(False)

    async def _relay(self, client: KVClient, tid: str) -> None:
        """Feed the peer's tokens through the choice's output state until it finishes."""
        req, index, seq, peer, links = self.req, self.index, self.seq, self.peer, self.links
        out = req.outputs[index]
        relay = client.relay(tid, links.node.config.kv_transfer_timeout_s)
        error = None
        try:
            async for msg in relay:
                if isinstance(msg, RelayEnd):
                    if out.finish_reason is None and not req.finished[index]:
                        error = msg.error or f"the peer ended the sequence ({msg.finish_reason}) before this node did"
                    break
                now = time.monotonic()
                lps = msg.logprobs or [None] * len(msg.token_ids)
                for t, lp in zip(msg.token_ids, lps):
                    seq.token_ids.append(t)
                    seq.last_token_s = now
                    delta = out.on_token(t, lp_from_wire(lp))
                    req.emit(delta)
                    if delta.finish_reason is not None:
                        seq.status = SeqStatus.FINISHED
                        return  # closing the relay ends the peer's copy if it has not ended yet
        except Exception as e:  # noqa: BLE001 - a broken relay is retried, never left hanging
            if not isinstance(e, (TransportError, OSError)):
                log.exception("relay_error", seq=seq.seq_id, peer=peer.addr)
            links.timed_out(e)
            error = why(e)
        finally:
            with suppress(Exception):
                await relay.aclose()
        if error is not None and not req.cancelled:
            peer.failures += 1
            log.warning("relay_failed", seq=seq.seq_id, peer=peer.addr, error=error)
            if self.count_retry(f"decode on peer {peer.addr} failed: {error}"):
                seq.num_computed, seq.block_ids, seq.status = 0, [], SeqStatus.WAITING
                seq.num_preemptions += 1
                links.node.metrics.kv_recomputes.inc()
                links.node.driver.recompute(req, index)

    def count_retry(self, reason: str) -> bool:
        """Count a failed hand-off against ``--max-retries``: True while within it; past it, end the
        choice with an error (503 ``peer_unavailable``; the stream never looks finished)."""
        node, req, index = self.links.node, self.req, self.index
        seq_id = req.seqs[index].seq_id
        n = self.links.retries[seq_id] = self.links.retries.get(seq_id, 0) + 1
        node.metrics.kv_handoff_failures.inc()
        if n <= node.config.max_retries:
            return True
        if not req.finished[index]:
            req.fail_choice(index, f"{reason} (gave up after {n - 1} retries, --max-retries {node.config.max_retries})",
                            status=503, code="peer_unavailable", retry_after_s=RETRY_AFTER_S)
        return False


async def _close(client: KVClient | None) -> None:
    if client is not None:
        with suppress(Exception):
            await client.close()


def _gather_host(kv, layer: int, blocks: list[int]):
    """One layer's blocks ``[2, n, block_size, Hkv, D]``, copied to host memory (worker thread)."""
    from node.transport.tensors import gather_layer

    return gather_layer(kv, layer, blocks).cpu()
