"""KV hand-off between nodes over TCP, the receiving side: :class:`KVReceiver` listens on ``--kv-port``,
answers capacity polls, reserves blocks for an offered sequence before its first byte (or refuses it with
the reason), scatters the layers into them in the device's worker thread and adopts the sequence into the
device's continuous batch, relaying its tokens back to the origin (the protocol is described in
:mod:`node.runtime.peer_links`).
"""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Callable

import msgspec
import structlog

from node.config import RELAY_KEEPALIVE_S
from node.core.roles import Role, blocks_for
from node.core.sequence import SamplingParams
from node.log import request_lines
from node.runtime.block_pins import stale
from node.runtime.engine import DeviceEngine
from node.runtime.interfaces import PeerHost
from node.runtime.peer_state import InboundRefusals
from node.runtime.request import RequestState
from node.transport import KVServer, Layout, ReceiveReport, TransferOffer
from node.transport.protocol import RelayEnd, StatusReply, TokenRelay
from node.worker.sampler import TokenLogprobs

log = structlog.get_logger("shiftnode.peers")


def lp_to_wire(lp: TokenLogprobs | None) -> list | None:
    return None if lp is None else [lp.token_id, lp.logprob, [list(t) for t in lp.top]]


class KVReceiver:
    """The receiving side: a :class:`KVServer` on ``--kv-port`` whose callbacks reserve blocks on a
    decode-capable device, write arriving layers into them, adopt the sequence into that device's
    continuous batch and relay its tokens back to the origin."""

    def __init__(self, node: PeerHost, layout: Layout):
        cfg = node.config
        self.node = node
        self.layout = layout
        # transfer id → (device, reserved blocks, how many of them are its own cached prefix: not received)
        self.incoming: dict[str, tuple[DeviceEngine, list[int], int]] = {}
        self.relayed = 0
        self.refused = InboundRefusals()
        self._nixl = None
        self.server = KVServer(cfg.kv_host or cfg.host, cfg.kv_port or 0, cfg.peer_secret or "", layout,
                               reserve=self._reserve_for_offer, on_layer=self._on_layer, on_done=self._on_done,
                               on_abort=self._on_abort, status=self._status, check=self._check,
                               on_refused=self._on_refused, on_timeout=self._on_timeout, node_id=cfg.name,
                               relay_keepalive_s=RELAY_KEEPALIVE_S, handshake_timeout_s=cfg.kv_connect_timeout_s,
                               stall_timeout_s=cfg.kv_transfer_timeout_s, reply_timeout_s=cfg.kv_transfer_timeout_s)

    @property
    def nixl(self):
        """The node's :class:`~node.runtime.kv_plane.NixlPlane` (``--kv-transport nixl``), or None."""
        return self._nixl

    @nixl.setter
    def nixl(self, plane) -> None:  # set before start(): offers may then be written over NIXL
        self._nixl = plane
        self.server.nixl, self.server.nixl_info = plane.agent, plane.info
        plane.info_listeners.append(lambda info: setattr(self.server, "nixl_info", info))  # a restart's new pool

    def _reserve_for_offer(self, offer: TransferOffer):
        got = self._reserve(offer)
        return got if self._nixl is None else self._nixl.reserve(offer, got, self.incoming, self._on_abort)

    def _on_refused(self, peer: str, peer_node_id: str, code: str, reason: str) -> None:
        """A node's connection to our KV port was refused (by us or by it): counted and kept for
        ``GET /v1/node`` and ``/health`` (the log line is the server's ``kv_peer_rejected``)."""
        self.node.metrics.peer_refusals.labels(reason=code, direction="inbound").inc()
        self.refused.record(peer, peer_node_id, code, reason, time.monotonic())

    def _on_timeout(self, stage: str) -> None:
        self.node.metrics.kv_timeouts.labels(stage=stage, side="receiver").inc()

    @property
    def port(self) -> int:
        return self.server.port

    async def start(self) -> None:
        await self.server.start()

    async def close(self) -> None:
        await self.server.close()

    def _decode_engines(self) -> list[DeviceEngine]:
        """Devices that may decode a sequence from a peer: pooled mode's decode devices; in time-shared
        and adaptive modes every device, those in the decode configuration (DECODE, MIXED) first. A
        down device takes none (its blocks look free once its sequences are orphaned) and is not
        advertised to peers."""
        cfg = self.node.config
        if cfg.mode == "pooled":
            engines = [self.node.engine(d) for d in cfg.decode_group_ids()]
        else:
            engines = sorted(self.node.engines,
                             key=lambda e: e.role is None or e.role.role not in (Role.DECODE, Role.MIXED))
        return [e for e in engines if e.up]

    def _room(self, e: DeviceEngine) -> tuple[int, int]:
        """(free blocks after this node's own reservations, free sequence slots) of a device."""
        held = len(e.batcher.running) + len(e.batcher.waiting)
        reserved = self.node.driver.reserved_on(e.device_id) if self.node.driver else 0
        return e.batcher.ledger.num_free - reserved, e.batcher.config.max_num_seqs - held

    def _status(self, n: int) -> StatusReply:
        engines = self._decode_engines()
        rooms = [self._room(e) for e in engines]
        open_ = [(f, e) for (f, s), e in zip(rooms, engines) if s > 0]
        best = max(open_, key=lambda x: x[0], default=(0, None))
        decoding = [s for s in best[1].batcher.running if s.is_decoding] if best[1] is not None else []
        return StatusReply(
            n=n, kv_free_blocks=sum(max(0, f) for f, _ in rooms),
            kv_total_blocks=sum(e.batcher.ledger.num_blocks for e in engines),
            max_device_free_blocks=max(0, best[0]),
            max_device_total_blocks=max((e.batcher.ledger.num_blocks for e in engines), default=0),
            seq_slots_free=sum(max(0, s) for _, s in rooms), accepting=bool(engines),
            decode_seqs=len(decoding), decode_context_tokens=sum(s.num_computed for s in decoding))

    def _check(self, offer: TransferOffer) -> list[str]:
        if offer.seq.max_len > self.node.max_model_len:
            return [f"the sequence may grow to {offer.seq.max_len} tokens, past this node's --max-model-len "
                    f"{self.node.max_model_len}"]
        return []

    def _reserve(self, offer: TransferOffer) -> tuple[list[int], int] | None:
        """Blocks for the sequence's cached tokens plus its next one, or None: on the device with the
        most free blocks plus blocks of the sequence's prefix it already caches (those it reuses in
        place and is not sent; Dynamo's overlap-against-load rule, in blocks). Returns the blocks and
        how many leading ones are cached."""
        st = offer.seq
        need = blocks_for(st.num_computed + 1, self.layout.block_size)
        # At least the last block travels (every layer carries one block or more).
        reusable = min(st.num_computed, (offer.num_blocks - 1) * self.layout.block_size)
        best = None
        for e in self._decode_engines():
            free, slots = self._room(e)
            hits = len(e.cached_blocks_of(st.token_ids, reusable, salt=st.sampling.get("cache_salt")))
            if slots > 0 and free >= need and (best is None or free + hits > best[0]):
                best = (free + hits, e)
        if best is None:
            return None
        e = best[1]
        blocks, reused = e.reserve_for(st.token_ids, reusable, offer.num_blocks, salt=st.sampling.get("cache_salt"))
        if blocks is None:
            return None
        self.incoming[offer.transfer_id] = (e, blocks, reused)
        return blocks, reused

    async def _on_layer(self, tid: str, layer: int, data: bytearray) -> None:
        from node.transport.tensors import scatter_layer_bytes

        e, blocks, reused = self.incoming[tid]
        if stale(blocks, e.incarnation):  # the device was restarted: the reserved blocks name the dead pool
            raise RuntimeError(f"device {e.device_id} was restarted during the transfer")
        await e.in_worker(scatter_layer_bytes, data, self.layout, e.runner.kv_cache, layer, blocks[reused:])

    def _on_abort(self, tid: str, reason: str) -> None:
        entry = self.incoming.pop(tid, None)
        if entry is None:
            return
        if self._nixl is not None and tid in self._nixl.accepted:  # a peer may still be writing them
            self._nixl.accepted.discard(tid)
            quarantine_s = 2 * self.node.config.kv_transfer_timeout_s  # past any write's stall timeout
            log.info("nixl_blocks_quarantined", transfer=tid, blocks=len(entry[1]), seconds=quarantine_s)
            asyncio.get_running_loop().call_later(quarantine_s, entry[0].free_pinned, entry[1])
            return
        entry[0].free_pinned(entry[1])  # freed behind any layer write still queued on the worker

    def _on_done(self, tid: str, report: ReceiveReport) -> AsyncIterator:
        e, blocks, _ = self.incoming.pop(tid)
        if self._nixl is not None:
            self._nixl.accepted.discard(tid)
        st = report.offer.seq
        node = self.node
        params = msgspec.convert(st.sampling, SamplingParams)
        now = time.monotonic()
        req = RequestState(f"{report.peer_node_id}/{st.seq_id}", st.token_ids[: st.prompt_len], params, 1,
                           node.tokenizer, node.eos_ids(), node.max_model_len, now - st.age_s)
        seq = req.seqs[0]
        seq.token_ids = list(st.token_ids)
        seq.max_len = st.max_len
        seq.num_computed = st.num_computed
        seq.num_preemptions = st.num_preemptions
        seq.first_token_s = None if st.first_token_age_s is None else now - st.first_token_age_s
        seq.last_token_s = now
        req.outputs[0].replay(seq.output_ids)
        seq.block_ids = blocks
        e.adopt(req, 0, seq)
        if node.driver is not None:
            node.driver.kick()  # e.g. a device in the PREFILL role now holds a decoding sequence
        self.relayed += 1
        node.metrics.kv_received.inc()
        if request_lines():
            log.info("sequence_adopted_from_peer", seq=st.seq_id, peer_node=report.peer_node_id, device=e.device_id,
                     blocks=len(blocks), output_tokens=len(st.token_ids) - st.prompt_len, layers_s=[round(x, 6) for x in report.layer_arrival_s])
        return _AdoptedRelay(self._relay(tid, req, e), lambda: _drop_adopted(req, e))

    async def _relay(self, tid: str, req: RequestState, e: DeviceEngine) -> AsyncIterator[TokenRelay | RelayEnd]:
        """The adopted sequence's tokens, batched per wake-up, until it ends; closing early drops it."""
        try:
            while True:
                deltas = await req.stream.take()
                tokens = [t for d in deltas for t in d.token_ids]
                lps = [lp_to_wire(lp) for d in deltas for lp in d.logprobs]
                if tokens:
                    yield TokenRelay(transfer_id=tid, token_ids=tokens, logprobs=lps if len(lps) == len(tokens) else [])
                end = next((d for d in deltas if d.finish_reason or d.error), None)
                if end is not None:
                    yield RelayEnd(transfer_id=tid, finish_reason=end.finish_reason, error=end.error)
                    return
        finally:
            _drop_adopted(req, e)


def _drop_adopted(req: RequestState, e: DeviceEngine) -> None:
    """A sequence adopted from a peer whose origin is gone: stop it and free its blocks (idempotent)."""
    if not req.done:
        req.cancelled = True
        e.abort(req.request_id)


class _AdoptedRelay:
    """The relay iterator handed to the KV server: closing it drops the adopted sequence even before
    its first item (when the commit could not be sent), which an async generator's ``finally`` would not."""

    def __init__(self, gen: AsyncIterator, drop: Callable[[], None]):
        self._gen, self._drop = gen, drop

    def __aiter__(self) -> "_AdoptedRelay":
        return self

    def __anext__(self):
        return self._gen.__anext__()

    async def aclose(self) -> None:
        try:
            await self._gen.aclose()
        finally:
            self._drop()
