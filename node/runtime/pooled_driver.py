"""The shell of pooled (disaggregated) mode inside one node: prefill devices and decode devices.

Arrivals wait here until :class:`PooledRouter` places them on a (prefill, decode) device pair, with
the decode blocks reserved at once. A prefill device runs prompt-only steps; when a sequence's first
token is out, its KV is handed to its decode device layer by layer (``DeviceEngine.migrate``, the same
mechanism as the time-shared fallback) and it decodes there while its client's stream goes on.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Callable

import structlog

from node.core.batcher import StepPlan
from node.core.pooled import PlacePooled, PoolDevice, PooledRouter, PoolSnapshot
from node.core.roles import Reject, WaitingPrompt
from node.runtime.driver import Driver
from node.runtime.engine import DeviceEngine

if TYPE_CHECKING:
    from node.runtime.node import Node

log = structlog.get_logger("shiftnode.pooled")


class PooledDriver(Driver):
    """Places prompts on device pairs and hands prefilled sequences to their decode device."""

    def __init__(self, node: "Node", router: PooledRouter, prefill: list[str], decode: list[str],
                 clock: Callable[[], float]):
        super().__init__(node, clock)
        self.router = router
        self.prefill_ids = prefill
        self.decode_ids = decode
        self.target: dict[str, str] = {}  # request id → its decode device
        self.handing: set[str] = set()  # sequence ids whose transfer is under way
        for d in prefill:
            node.engine(d).step_listeners.append(self._on_prefill_step)

    def finished(self, req, reasons, output_tokens) -> None:
        super().finished(req, reasons, output_tokens)
        self.target.pop(req.request_id, None)

    def _device(self, device_id: str, decode_side: bool) -> PoolDevice:
        e = self.node.engine(device_id)
        led = e.batcher.ledger
        held = sum(1 for r in e.requests.values() for s in r.seqs if s.device_id == device_id)
        reserved_seqs = sum(len(r.seqs) for r in self._requests_bound_to(device_id)) if decode_side else 0
        queued = sum(s.num_uncomputed for s in e.batcher.waiting) + sum(
            s.num_uncomputed for s in e.batcher.running if not s.is_decoding)
        # Prefill side: blocks that queued prompts will take when admitted; decode side: reservations.
        reserved = self._decode_reserved(device_id) if decode_side else sum(
            led.blocks_for(s.num_uncomputed) for s in e.batcher.waiting)
        return PoolDevice(device_id=device_id, kv_free_blocks=led.num_free, kv_reserved_blocks=reserved,
                          kv_total_blocks=led.num_blocks, block_size=led.block_size, queued_tokens=queued,
                          inflight_seqs=held, seq_slots_free=e.batcher.config.max_num_seqs - held - reserved_seqs)

    def _requests_bound_to(self, device_id: str):
        """Requests placed with ``device_id`` as decode device whose sequences have not all arrived."""
        for e_id in self.prefill_ids:
            for r in self.node.engine(e_id).requests.values():
                if self.target.get(r.request_id) == device_id:
                    yield r

    def _decode_reserved(self, device_id: str) -> int:
        """Blocks promised on a decode device: whole reservations of requests still on their prefill
        device, and the unallocated rest of those already here."""
        waiting = sum(self.reserve.get(r.request_id, 0) for r in self._requests_bound_to(device_id))
        return waiting + self.reserved_on(device_id)

    def tick(self) -> None:
        snap = PoolSnapshot(
            prefill=tuple(self._device(d, False) for d in self.prefill_ids),
            decode=tuple(self._device(d, True) for d in self.decode_ids),
            waiting=tuple(WaitingPrompt(r.request_id, len(r.prompt_ids) * len(r.seqs), r.stats.arrival_s,
                                        self.expected_output(r) * len(r.seqs), seqs=len(r.seqs)) for r in self.pending),
        )
        by_id = {r.request_id: r for r in self.pending}
        for d in self.router.decide(snap):
            req = by_id.pop(d.request_id, None)
            if req is None:
                continue
            self.pending.remove(req)
            if isinstance(d, Reject):
                req.fail(f"request cannot be served: {d.reason}")
            elif isinstance(d, PlacePooled):
                self.reserve[req.request_id] = d.decode_blocks
                self.target[req.request_id] = d.decode_device
                self.node.engine(d.prefill_device).add(req)
        for d in self.prefill_ids:
            self._hand_off(self.node.engine(d))

    def _on_prefill_step(self, engine: DeviceEngine, plan: StepPlan, seconds: float) -> None:
        self._hand_off(engine)
        self.kick()

    def _hand_off(self, engine: DeviceEngine) -> None:
        """Start the transfer of every prefilled sequence on a prefill device to its decode device."""
        for seq in list(engine.batcher.running):
            if not seq.is_decoding or seq.seq_id in self.handing or engine.requests[seq.request_id].cancelled:
                continue
            dst = self.target.get(seq.request_id)
            if dst is None:
                continue
            self.handing.add(seq.seq_id)
            fut = engine.migrate(seq, self.node.engine(dst), "pooled")
            fut.add_done_callback(lambda f, sid=seq.seq_id: self._handed(sid, f))

    def _handed(self, seq_id: str, fut: asyncio.Future) -> None:
        self.handing.discard(seq_id)
        if fut.cancelled() or fut.result() is None:
            log.warning("handoff_deferred", seq=seq_id)  # retried on the next tick
        self.kick()
