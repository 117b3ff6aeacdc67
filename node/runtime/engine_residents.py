"""Which sequences live on one device: the membership half of :class:`node.runtime.engine.DeviceEngine`
(a mixin over the engine's state).

New requests, recomputations, adoptions of moved-in sequences, detaches for a peer transfer, aborts and
worker jobs are queued here and applied between sends, on the event loop, so a step in flight never sees
its batch change under it; blocks freed while a step is in flight go only to a later step.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from node.core.sequence import Sequence
from node.runtime.request import RequestState


def _nothing() -> None:
    return None


class Residents:
    """The sequences of a :class:`~node.runtime.engine.DeviceEngine` (which holds the state these methods
    read: ``requests``, ``_by_seq``, ``batcher``, ``failure``, the queues of aborts, detaches and jobs)."""

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

    def add_seq(self, req: RequestState, index: int) -> None:
        """Queue one sequence of ``req`` for (re)computation here: a hand-off to a peer failed after the
        peer took it, so its prompt plus the tokens already streamed are prefilled again."""
        if self._refuse_if_down(req):
            return
        seq = req.seqs[index]
        seq.device_id = self.device_id
        self.requests[req.request_id] = req
        self._by_seq[seq.seq_id] = (req, index)
        self.batcher.add(seq)
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
        worker's current job, so a gather still reading them finishes first."""
        fut = self.in_worker(_nothing)
        fut.add_done_callback(lambda _f: (self.batcher.ledger.free(block_ids), self.wake()))

    def readopt(self, req: RequestState, index: int, seq: Sequence, block_ids: list[int]) -> None:
        """Put a detached sequence back with its own blocks (its transfer failed before a commit)."""
        seq.block_ids = block_ids
        self.adopt(req, index, seq)

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
            blocks = self.batcher.release(seq)
            del self._by_seq[seq.seq_id]
            self._forget_if_empty(req)
            fut.set_result((req, index, blocks))

    def abort(self, request_id: str) -> None:
        """Drop a request at the next step boundary; its blocks return to the ledger."""
        if request_id in self.requests:
            self._aborts.append(request_id)
            self.wake()

    def cached_blocks_of(self, token_ids: list[int], num_computed: int, memo: list[bytes] | None = None) -> list[int]:
        """This device's cached blocks of the longest cached prefix of full blocks within the first
        ``num_computed`` tokens of a sequence arriving from elsewhere (changes nothing)."""
        return self.batcher.ledger.match(token_ids, num_computed, memo)

    def reserve_for(self, token_ids: list[int], num_computed: int, num_blocks: int,
                    memo: list[bytes] | None = None) -> tuple[list[int] | None, int]:
        """Blocks here for a sequence of ``num_blocks`` blocks arriving from elsewhere: this device's
        cached blocks of its longest cached prefix (:meth:`cached_blocks_of`; referenced now, so never
        evicted, and never written by the copy, since their tokens lie before ``num_computed``), then
        new ones. Returns ``(blocks, reused)`` — the first ``reused`` are the cached ones, which need
        not be received — or ``(None, 0)`` when they do not fit. Blocks a step in flight registered
        are never reused (:meth:`BlockLedger.reserve`): that step may still fail to write them."""
        got = self.batcher.ledger.reserve(token_ids, num_computed, num_blocks, memo)
        return got if got is not None else (None, 0)

    def adopt(self, req: RequestState, index: int, seq: Sequence) -> None:
        """Take over a decoding sequence whose KV was just copied into this device's blocks. On a down
        device nothing would ever run it (and a peer's relay heartbeats would keep its origin waiting):
        its blocks are freed and its choice ends at once (503 ``engine_down``)."""
        if self.failure is not None:
            self.batcher.ledger.free(seq.block_ids)
            seq.block_ids = []
            if not req.finished[index]:
                req.fail_choice(index, f"device {self.device_id} is down: {self.failure}", status=503,
                                code="engine_down", retry_after_s=1.0)
            return
        seq.device_id = self.device_id
        self.requests[req.request_id] = req
        self._by_seq[seq.seq_id] = (req, index)
        self.batcher.adopt(seq)
        self.wake()

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
