"""Which sequences live on one device: the membership half of :class:`node.runtime.engine.DeviceEngine`
(a mixin over the engine's state).

New requests, recomputations, adoptions of moved-in sequences, detaches for a peer transfer, aborts and
worker jobs are queued here and applied between sends, on the event loop, so a step in flight never sees
its batch change under it; blocks freed while a step is in flight go only to a later step.
"""

from __future__ import annotations

import asyncio
from typing import Callable

import structlog

from node.core.ledger import salt_root
from node.core.sequence import Sequence
from node.runtime.block_pins import PinnedBlocks
from node.runtime.request import RequestState

log = structlog.get_logger("shiftnode.engine")


def _nothing() -> None:
    return None


class Residents:
    """The sequences of a :class:`~node.runtime.engine.DeviceEngine` (which holds the state these methods
    read: ``requests``, ``_by_seq``, ``batcher``, ``failure``, the queues of aborts, detaches and jobs)."""

    @property
    def up(self) -> bool:
        """The device serves: its step loop runs and its engine process has not been seen to exit."""
        return self.failure is None and not self._dead

    # --- membership ------------------------------------------------------------------------------
    def _refuse_if_down(self, req: RequestState) -> bool:
        """A down device takes nothing: fail ``req`` (503) and say so."""
        if self.failure is None:
            return False
        req.fail(f"device {self.device_id} is down: {self.failure}", status=503, code="engine_down", retry_after_s=1.0)
        return True

    def add(self, req: RequestState) -> None:
        if self._refuse_if_down(req):
            return
        self.requests[req.request_id] = req
        for i, seq in enumerate(req.seqs):
            seq.device_id = self.device_id
            self._by_seq[seq.seq_id] = (req, i)
            self.batcher.add(seq)
        self.wake()

    def add_seq(self, req: RequestState, index: int, until: int | None = None) -> None:
        """Queue one sequence of ``req`` for (re)computation here: a hand-off to a peer failed after the
        peer took it, or its device died, so its prompt plus the tokens already streamed are prefilled
        again. ``until``: it was in the step a dead engine was computing; it runs alone until it has
        computed that many tokens (:mod:`node.core.quarantine`)."""
        if self._refuse_if_down(req):
            return
        seq = req.seqs[index]
        seq.device_id = self.device_id
        self.requests[req.request_id] = req
        self._by_seq[seq.seq_id] = (req, index)
        self.batcher.add(seq)
        if until is not None:
            self.quarantine.add(seq, until)
        self.wake()

    def detach(self, seq: Sequence) -> asyncio.Future:
        """Take a decoding sequence out of this device at the next step boundary, keeping its blocks
        allocated (pinned) for a transfer to a peer node.

        The future resolves to ``(request, index, block_ids)`` (the caller then owns the blocks: give
        them back with :meth:`free_pinned` after the peer committed, or :meth:`readopt` the sequence
        if the transfer failed), or to ``None`` when the sequence is not decoding here.
        """
        fut = asyncio.get_running_loop().create_future()
        if self.failure is not None:  # nothing would apply it: the sequence stays (its request failed here)
            fut.set_result(None)
            return fut
        self._detaches.append((seq, fut))
        self.wake()
        return fut

    def in_worker(self, fn: Callable, *args) -> asyncio.Future:
        """Run ``fn(*args)`` on this device's worker thread at the next point where no step is in
        flight, in order with the steps (a KV gather or scatter for a transfer must not race a step
        writing the same pool). The future fails with ``RuntimeError`` if the device goes down first."""
        fut = asyncio.get_running_loop().create_future()
        if self.failure is not None:
            fut.set_exception(RuntimeError(f"device {self.device_id} is down: {self.failure}"))
            return fut
        self._jobs.append((fn, args, fut))
        self.wake()
        return fut

    def free_pinned(self, block_ids: list[int]) -> None:
        """Free blocks of a detached sequence once a peer has committed its copy. Queued behind the
        worker's current job, so a gather still reading them finishes first. Blocks pinned before a
        restart are not freed (:func:`~node.runtime.block_pins.stale`)."""
        fut = self.in_worker(_nothing)
        fut.add_done_callback(lambda _f: (self.release_pinned(block_ids), self.wake()))

    def readopt(self, req: RequestState, index: int, seq: Sequence, block_ids: list[int]) -> None:
        """Put a detached sequence back with its own blocks (its transfer failed before a commit); if
        they were pinned before a restart, or the device is down, the sequence is resumed instead."""
        seq.block_ids = block_ids
        self.adopt(req, index, seq)

    def release_pinned(self, blocks: list[int]) -> None:
        """Free pinned blocks now (unless stale: :meth:`BlockPins.unpin <node.runtime.block_pins.BlockPins.unpin>`)."""
        self.pins.release(blocks)

    def check_ownership(self) -> None:
        """Raise ``LedgerError`` unless every block is referenced exactly as often as it is held
        (:func:`~node.runtime.block_pins.check_ownership`)."""
        b = self.batcher
        self.pins.check([s.block_ids for s in b.running] + [s.block_ids for s in b.waiting])

    def _apply_detaches(self) -> None:
        while self._detaches:
            seq, fut = self._detaches.pop(0)
            entry = self._by_seq.get(seq.seq_id)
            if fut.cancelled():
                continue
            if entry is None or seq not in self.batcher.running or not seq.is_decoding:
                fut.set_result(None)
                continue
            req, index = entry
            blocks = self.pins.pin(self.batcher.release(seq))
            del self._by_seq[seq.seq_id]
            self._forget_if_empty(req)
            fut.set_result((req, index, blocks))

    def abort(self, request_id: str) -> None:
        """Drop a request at the next step boundary; its blocks return to the ledger."""
        if request_id in self.requests:
            self._aborts.append(request_id)
            self.wake()

    def cached_blocks_of(self, token_ids: list[int], num_computed: int, memo: list[bytes] | None = None,
                         salt: str | None = None) -> list[int]:
        """This device's cached blocks of the longest cached prefix of full blocks within the first
        ``num_computed`` tokens of a sequence arriving from elsewhere (changes nothing); ``salt``: its
        ``cache_salt`` (hits only among sequences of the same salt)."""
        return self.batcher.ledger.match(token_ids, num_computed, memo, root=salt_root(salt))

    def reserve_for(self, token_ids: list[int], num_computed: int, num_blocks: int,
                    memo: list[bytes] | None = None, salt: str | None = None) -> tuple[list[int] | None, int]:
        """Blocks here for a sequence of ``num_blocks`` blocks arriving from elsewhere: this device's
        cached blocks of its longest cached prefix (:meth:`cached_blocks_of`; referenced now, so never
        evicted, and never written by the copy, since their tokens lie before ``num_computed``), then
        new ones. Returns ``(blocks, reused)`` — the first ``reused`` are the cached ones, which need
        not be received — or ``(None, 0)`` when they do not fit. Blocks a step in flight registered
        are never reused (:meth:`BlockLedger.reserve`): that step may still fail to write them."""
        got = self.batcher.ledger.reserve(token_ids, num_computed, num_blocks, memo, root=salt_root(salt))
        return (self.pins.pin(got[0]), got[1]) if got is not None else (None, 0)

    def adopt(self, req: RequestState, index: int, seq: Sequence) -> None:
        """Take over a decoding sequence whose KV was just copied into this device's (pinned) blocks.
        On a down device nothing would ever run it, and blocks pinned before a restart hold no KV of it
        (the pool is new): its blocks are dropped and it is resumed (:meth:`_lost`)."""
        if self.failure is not None or self.pins.is_stale(seq.block_ids):
            self.release_pinned(seq.block_ids)
            self._lost(req, index)
            return
        self.pins.unpin(seq.block_ids)
        seq.block_ids = list(seq.block_ids)  # a sequence's own block table now, no pin's stamp
        seq.device_id = self.device_id
        self.requests[req.request_id] = req
        self._by_seq[seq.seq_id] = (req, index)
        self.batcher.adopt(seq)
        self.wake()

    def _lost(self, req: RequestState, index: int) -> None:
        """A sequence held by no device whose KV is lost with this device's pool (it was adopted, detached
        or moving when the engine died): resumed like the dead device's others (``orphan_listener``,
        :mod:`node.runtime.resume`), or, with none to take it, ended with 503 ``engine_down``."""
        seq = req.seqs[index]
        seq.block_ids, seq.num_pending = [], 0
        if self.orphan_listener is not None and (self.engine_died or self.failure is None):
            try:
                return self.orphan_listener(self, req, index)
            except Exception as e:  # noqa: BLE001 - a choice nobody took over ends with an error below
                log.error("resume_failed", device=self.device_id, seq=seq.seq_id, error=f"{type(e).__name__}: {e}")
        if not req.finished[index]:
            req.fail_choice(index, f"device {self.device_id} is down: {self.failure}", status=503,
                            code="engine_down", retry_after_s=1.0)

    def _apply_aborts(self) -> None:
        while self._aborts:
            req = self.requests.get(self._aborts.pop())
            if req is not None:
                self._finish_request(req)

    def _forget_if_empty(self, req: RequestState) -> None:
        """Drop ``req`` from this device once none of its sequences is held here."""
        if not any(s.seq_id in self._by_seq for s in req.seqs):
            self.requests.pop(req.request_id, None)

    def _finish_seq(self, seq: Sequence) -> None:
        entry = self._by_seq.pop(seq.seq_id, None)
        if entry is not None:
            self.batcher.remove(seq)
            self._forget_if_empty(entry[0])

    def _finish_request(self, req: RequestState) -> None:
        for seq in req.seqs:
            self._finish_seq(seq)
        self.requests.pop(req.request_id, None)

    # --- the device went down (engine_revival.py) ------------------------------------------------------
    def refuse_detaches(self) -> None:
        """Resolve the detaches waiting for a step boundary to None: their sequences stay here."""
        for _seq, fut in self._detaches:
            if not fut.done():
                fut.set_result(None)
        self._detaches.clear()

    def fail_jobs(self) -> None:
        """Fail the ``in_worker`` jobs waiting for the worker with ``RuntimeError`` (the device is down)."""
        while self._jobs:
            _fn, _args, fut = self._jobs.popleft()
            if not fut.done():
                fut.set_exception(RuntimeError(f"device {self.device_id} is down: {self.failure}"))

    def drop_aborts(self) -> None:
        """Forget the queued aborts (a revive: the requests they name are gone with the dead engine)."""
        self._aborts.clear()

    # --- what a KV move needs of its ends (node.runtime.moves.MoveEnd) --------------------------------
    @property
    def down_reason(self) -> str | None:
        """Why the device is down (its step loop ended, or its engine process was seen to exit), else None."""
        return self.failure or self._dead

    def movable(self, seq: Sequence) -> tuple[RequestState, int] | None:
        """``(request, index)`` of ``seq`` if it decodes here with no token pending (a move may take it), else None."""
        entry = self._by_seq.get(seq.seq_id)
        if entry is not None and seq in self.batcher.running and seq.is_decoding and not seq.num_pending:
            return entry
        return None

    def release_for_move(self, seq: Sequence) -> PinnedBlocks:
        """Take a :meth:`movable` sequence off the device, keeping its blocks pinned for the copy (no step
        or abort touches it meanwhile); its request stays listed until the move ends (:meth:`forget_if_empty`)."""
        blocks = self.pins.pin(self.batcher.release(seq))
        del self._by_seq[seq.seq_id]
        return blocks

    def forget_if_empty(self, req: RequestState) -> None:
        """Drop ``req`` from this device once none of its sequences is held here."""
        self._forget_if_empty(req)
