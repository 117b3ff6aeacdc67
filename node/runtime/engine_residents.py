"""Which sequences live on one device: the residents part of :class:`node.runtime.engine.DeviceEngine`
(its ``residents``), which owns the device's requests, its sequence → request map and the queues of
aborts and detaches.

New requests, recomputations, adoptions of moved-in sequences, detaches for a peer transfer and aborts
are queued here and applied between sends, on the event loop (the step loop calls
:meth:`Residents.apply_aborts` and :meth:`Residents.apply_detaches`), so a step in flight never sees its
batch change under it; blocks freed while a step is in flight go only to a later step.
"""

from __future__ import annotations

import asyncio
from contextlib import suppress
from typing import Callable

import structlog

from node.core.batcher import Batcher, ScheduledSeq, StepPlan
from node.core.ledger import salt_root
from node.core.quarantine import Quarantine
from node.core.sequence import PENDING, Sequence
from node.runtime.block_pins import BlockPins, PinnedBlocks
from node.runtime.request import RequestState
from node.runtime.spec_decode import join_kept
from node.worker.runner import SeqOutput

log = structlog.get_logger("shiftnode.engine")


class Residents:
    """The requests and sequences one device holds.

    Args:
        device_id: the device's name (sequences are stamped with it; errors, log lines).
        batcher: the device's batch former (its running and waiting queues, its block ledger).
        pins: the device's pinned blocks (detached, reserved and moving sequences' blocks).
        quarantine: suspects of an engine death, recomputed alone (:meth:`add_seq` with ``until``).
        wake: wakes the step loop (work came, or blocks were freed).
        down: returns why the device is down, else None (a down device takes nothing).
        lost: called with ``(request, index)`` for a sequence whose KV is lost with the device's pool
            (:meth:`Revival.lost <node.runtime.engine_revival.Revival.lost>`: resumed elsewhere or failed).
        hold: called with each sequence placed here, before the batcher sees it: holds a grammar sequence
            out of steps until the engine has its grammar ready (:meth:`GrammarGate.hold
            <node.runtime.grammar_gate.GrammarGate.hold>`).
    """

    def __init__(self, device_id: str, batcher: Batcher, pins: BlockPins, quarantine: Quarantine,
                 wake: Callable[[], None], down: Callable[[], str | None],
                 lost: Callable[[RequestState, int], None], hold: Callable[[Sequence], None] = lambda seq: None):
        self._device_id, self._batcher, self._pins, self._quarantine = device_id, batcher, pins, quarantine
        self._wake, self._down, self._lost, self._hold = wake, down, lost, hold
        self.requests: dict[str, RequestState] = {}  # request id → state, for sequences on this device
        self.by_seq: dict[str, tuple[RequestState, int]] = {}  # seq id → (request, choice index), held here
        self._aborts: list[str] = []
        self._detaches: list[tuple[Sequence, asyncio.Future]] = []

    # --- arrivals -----------------------------------------------------------------------------------
    def _refuse_if_down(self, req: RequestState) -> bool:
        """A down device takes nothing: fail ``req`` (503) and say so."""
        failure = self._down()
        if failure is None:
            return False
        req.fail(f"device {self._device_id} is down: {failure}", status=503, code="engine_down", retry_after_s=1.0)
        return True

    def add(self, req: RequestState) -> None:
        """Queue every sequence of a new request here (a down device fails it with 503 ``engine_down``)."""
        if self._refuse_if_down(req):
            return
        self.requests[req.request_id] = req
        for i, seq in enumerate(req.seqs):
            seq.device_id = self._device_id
            self.by_seq[seq.seq_id] = (req, i)
            self._hold(seq)
            self._batcher.add(seq)
        self._wake()

    def add_seq(self, req: RequestState, index: int, until: int | None = None) -> None:
        """Queue one sequence of ``req`` for (re)computation here: a hand-off to a peer failed after the
        peer took it, or its device died, so its prompt plus the tokens already streamed are prefilled
        again. ``until``: it was in the step a dead engine was computing; it runs alone until it has
        computed that many tokens (:mod:`node.core.quarantine`)."""
        if self._refuse_if_down(req):
            return
        seq = req.seqs[index]
        seq.device_id = self._device_id
        self.requests[req.request_id] = req
        self.by_seq[seq.seq_id] = (req, index)
        self._hold(seq)
        self._batcher.add(seq)
        if until is not None:
            self._quarantine.add(seq, until)
        self._wake()

    def adopt(self, req: RequestState, index: int, seq: Sequence) -> None:
        """Take over a decoding sequence whose KV was just copied into this device's (pinned) blocks.
        On a down device nothing would ever run it, and blocks pinned before a restart hold no KV of it
        (the pool is new): its blocks are dropped and it is resumed (``lost``)."""
        if self._down() is not None or self._pins.is_stale(seq.block_ids):
            self._pins.release(seq.block_ids)
            self._lost(req, index)
            return
        self._pins.unpin(seq.block_ids)
        seq.block_ids = list(seq.block_ids)  # a sequence's own block table now, no pin's stamp
        seq.device_id = self._device_id
        self.requests[req.request_id] = req
        self.by_seq[seq.seq_id] = (req, index)
        self._hold(seq)
        self._batcher.adopt(seq)
        self._wake()

    def readopt(self, req: RequestState, index: int, seq: Sequence, block_ids: list[int]) -> None:
        """Put a detached sequence back with its own blocks (its transfer failed before a commit); if
        they were pinned before a restart, or the device is down, the sequence is resumed instead."""
        seq.block_ids = block_ids
        self.adopt(req, index, seq)

    # --- blocks for sequences arriving from elsewhere ------------------------------------------------
    def cached_blocks_of(self, token_ids: list[int], num_computed: int, memo: list[bytes] | None = None,
                         salt: str | None = None) -> list[int]:
        """This device's cached blocks of the longest cached prefix of full blocks within the first
        ``num_computed`` tokens of a sequence arriving from elsewhere (changes nothing); ``salt``: its
        ``cache_salt`` (hits only among sequences of the same salt)."""
        return self._batcher.ledger.match(token_ids, num_computed, memo, root=salt_root(salt))

    def reserve_for(self, token_ids: list[int], num_computed: int, num_blocks: int,
                    memo: list[bytes] | None = None, salt: str | None = None) -> tuple[list[int] | None, int]:
        """Blocks here for a sequence of ``num_blocks`` blocks arriving from elsewhere: this device's
        cached blocks of its longest cached prefix (:meth:`cached_blocks_of`; referenced now, so never
        evicted, and never written by the copy, since their tokens lie before ``num_computed``), then
        new ones. Returns ``(blocks, reused)`` — the first ``reused`` are the cached ones, which need
        not be received — or ``(None, 0)`` when they do not fit. Blocks a step in flight registered
        are never reused (:meth:`BlockLedger.reserve`): that step may still fail to write them."""
        got = self._batcher.ledger.reserve(token_ids, num_computed, num_blocks, memo, root=salt_root(salt))
        return (self._pins.pin(got[0]), got[1]) if got is not None else (None, 0)

    def reserve_shared(self, shared: list[int], num_computed: int, num_blocks: int) -> list[int] | None:
        """Blocks here for a sequence of ``num_blocks`` blocks arriving in the same copy as another one
        whose leading blocks it shares on the source (the choices of one request share their prompt's):
        ``shared``, that one's blocks here, referenced once more (written by the copy once, for both), as
        far as they are full blocks of computed tokens (``num_computed``: nothing writes those again),
        then new ones. Pinned, as :meth:`reserve_for`'s; ``None`` when they do not fit."""
        shared = shared[: min(num_computed // self._batcher.ledger.block_size, num_blocks)]
        new = self._batcher.ledger.fork(shared, num_blocks - len(shared))
        return self._pins.pin([*shared, *new]) if new is not None else None

    def check_ownership(self) -> None:
        """Raise ``LedgerError`` unless every block is referenced exactly as often as it is held
        (:func:`~node.runtime.block_pins.check_ownership`)."""
        b = self._batcher
        self._pins.check([s.block_ids for s in b.running] + [s.block_ids for s in b.waiting])

    # --- a step's tokens ---------------------------------------------------------------------------------
    def emit(self, plan: StepPlan, items: list, outs: list[SeqOutput], now: float,
             contain: Callable[[Exception, ScheduledSeq], None], kept: Callable[[str], tuple] | None = None) -> None:
        """Emit a step's tokens to the requests of its sequences held here (``items``: the step message's,
        ``outs``: the engine's, both in ``plan``'s item order; ``now``: monotonic s); a failure of one
        sequence (detokenizer, stop logic) goes to ``contain`` with its item, and the others go on. A plain
        token (not a choice's first, no logprobs, ends nothing: short of ``max_len``, not in
        ``TokenOutputState.enders``) of a stream with a columnar path (``RequestState.plain``: API front
        ends) goes there as ``(index, id)``. ``kept`` (speculative decoding): a verify item's further kept
        tokens by sequence id (:meth:`node.runtime.spec_decode.SpecDecoding.kept_of`), joined to its delta."""
        by_seq = self.by_seq
        for it, item, out in zip(plan.items, items, outs):
            entry = by_seq.get(item.seq_id)
            if entry is None:  # the sequence left the device (aborted, finished) while the step ran
                continue
            try:
                (req, i), tok = entry, out.token_id
                if (req.plain is not None and tok is not None and out.logprobs is None and not out.prompt_logprobs
                        and req.started[i] and not it.draft):
                    seq, position, o = it.seq, item.start + it.num_tokens, req.outputs[i]
                    if (position != seq.prompt_len and position + 1 < seq.max_len and o.finish_reason is None
                            and tok not in o.enders and seq.first_token_s is not None):
                        seq.last_token_s = now
                        req.plain(i + req.index0, tok)
                        continue
                self._emit_one(it, item.start, out, entry, now, kept)
            except Exception as e:  # noqa: BLE001 - one sequence's failure is its own
                contain(e, it)

    def _emit_one(self, it: ScheduledSeq, start: int, out: SeqOutput, entry: tuple[RequestState, int],
                  now: float, kept: Callable[[str], tuple] | None = None) -> None:
        """Emit one scheduled sequence's sampled token (already written over its placeholder)."""
        seq = it.seq
        req, i = entry
        if out.prompt_logprobs:  # rows start.. predict prompt tokens start+1..; idempotent on recompute
            req.prompt_logprobs[start : start + len(out.prompt_logprobs)] = out.prompt_logprobs
        if out.token_id is None:
            return
        position = start + it.num_tokens - len(it.draft)  # where the sampled token sits in token_ids
        seq.last_token_s = now
        if seq.first_token_s is None:
            seq.first_token_s = now
        delta = req.outputs[i].on_token(out.token_id, out.logprobs, position)
        if position == seq.prompt_len:
            delta.cached_tokens = seq.num_cached_tokens or 0
        if it.draft and kept is not None:  # a verify item's further kept tokens, in the same delta
            delta = join_kept(req.outputs[i], delta, kept(seq.seq_id), position, seq)
        if delta.finish_reason is not None:
            self.finish_seq(seq)
        req.emit(delta)  # the request leaves ``requests`` with its last sequence (finish_seq), not when
        # it is done: one that failed elsewhere (a timeout) still holds blocks until its abort applies

    # --- departures ---------------------------------------------------------------------------------
    def detach(self, seq: Sequence) -> asyncio.Future:
        """Take a decoding sequence out of this device at the next step boundary, keeping its blocks
        allocated (pinned) for a transfer to a peer node.

        The future resolves to ``(request, index, block_ids)`` (the caller then owns the blocks: give
        them back with ``free_pinned`` after the peer committed, or :meth:`readopt` the sequence if the
        transfer failed), or to ``None`` when the sequence is not decoding here.
        """
        fut = asyncio.get_running_loop().create_future()
        if self._down() is not None:  # nothing would apply it: the sequence stays (its request failed here)
            fut.set_result(None)
            return fut
        self._detaches.append((seq, fut))
        self._wake()
        return fut

    @property
    def detaches_queued(self) -> bool:
        """Detaches wait for a step boundary (the step loop lets the steps in flight end first)."""
        return bool(self._detaches)

    def apply_detaches(self) -> None:
        """Carry out the queued detaches (no step in flight includes their sequences)."""
        while self._detaches:
            seq, fut = self._detaches.pop(0)
            entry = self.by_seq.get(seq.seq_id)
            if fut.cancelled():
                continue
            if entry is None or seq not in self._batcher.running or not seq.is_decoding:
                fut.set_result(None)
                continue
            req, index = entry
            blocks = self._pins.pin(self._batcher.release(seq))
            del self.by_seq[seq.seq_id]
            self.forget_if_empty(req)
            fut.set_result((req, index, blocks))

    def refuse_detaches(self) -> None:
        """Resolve the detaches waiting for a step boundary to None: their sequences stay here."""
        for _seq, fut in self._detaches:
            if not fut.done():
                fut.set_result(None)
        self._detaches.clear()

    def abort(self, request_id: str) -> None:
        """Drop a request at the next step boundary; its blocks return to the ledger."""
        if request_id in self.requests:
            self._aborts.append(request_id)
            self._wake()

    def apply_aborts(self) -> None:
        """Drop the requests of the queued aborts (between sends)."""
        while self._aborts:
            req = self.requests.get(self._aborts.pop())
            if req is not None:
                self.finish_request(req)

    def drop_aborts(self) -> None:
        """Forget the queued aborts (a revive: the requests they name are gone with the dead engine)."""
        self._aborts.clear()

    def movable(self, seq: Sequence) -> tuple[RequestState, int] | None:
        """``(request, index)`` of ``seq`` if it decodes here with no token pending (a move may take it), else None."""
        entry = self.by_seq.get(seq.seq_id)
        if entry is not None and seq in self._batcher.running and seq.is_decoding and not seq.num_pending:
            return entry
        return None

    def release_for_move(self, seq: Sequence) -> PinnedBlocks:
        """Take a :meth:`movable` sequence off the device, keeping its blocks pinned for the copy (no step
        or abort touches it meanwhile); its request stays listed until the move ends (:meth:`forget_if_empty`)."""
        blocks = self._pins.pin(self._batcher.release(seq))
        del self.by_seq[seq.seq_id]
        return blocks

    def forget_if_empty(self, req: RequestState) -> None:
        """Drop ``req`` from this device once none of its sequences is held here."""
        if not any(s.seq_id in self.by_seq for s in req.seqs):
            self.requests.pop(req.request_id, None)

    def finish_seq(self, seq: Sequence) -> None:
        """``seq`` ended here: its blocks go back to the ledger (and its request, with its last sequence)."""
        entry = self.by_seq.pop(seq.seq_id, None)
        if entry is not None:
            self._batcher.remove(seq)
            self.forget_if_empty(entry[0])

    def finish_request(self, req: RequestState) -> None:
        """Every sequence of ``req`` ends here (:meth:`finish_seq`) and the request leaves the device."""
        for seq in req.seqs:
            self.finish_seq(seq)
        self.requests.pop(req.request_id, None)

    def evict(self, req: RequestState) -> list[int]:
        """The engine died: take ``req``'s sequences off this device (:meth:`finish_request`) and return the
        indices of those it held, their placeholders of the steps in flight dropped (never streamed) and
        nothing pending, ready to be resumed elsewhere."""
        held = [i for i, s in enumerate(req.seqs) if s.seq_id in self.by_seq]
        self.finish_request(req)
        for i in held:
            seq = req.seqs[i]
            while seq.token_ids and seq.token_ids[-1] == PENDING:
                seq.token_ids.pop()
            seq.num_pending = 0
        return held

    def holds(self, seq: Sequence) -> bool:
        """Whether ``seq`` is held on this device now (placed here, not finished, aborted or moved on)."""
        return seq.device_id == self._device_id and seq.seq_id in self.by_seq

    def fail_seq(self, seq: Sequence, message: str, status: int) -> None:
        """End the request of ``seq``, held here, with an error event (status 400 ``grammar_error``; 503
        ``service_unavailable`` with Retry-After) and free its blocks (:meth:`fail`)."""
        entry = self.by_seq.get(seq.seq_id)
        if entry is not None:
            code, retry = ("service_unavailable", 5.0) if status == 503 else ("grammar_error", None)
            self.fail([entry[0]], message, status=status, code=code, retry_after_s=retry)
            self._wake()

    def fail(self, reqs: list[RequestState], message: str, **error) -> None:
        """Fail each of ``reqs`` with ``message`` (``error``: :meth:`RequestState.fail`'s status, code,
        retry_after_s) and drop it from the device; one whose bookkeeping is broken is dropped entry by
        entry, so a failure in one never leaves another's blocks or entries behind."""
        for req in reqs:
            req.fail(message, **error)
            try:
                self.finish_request(req)
            except Exception as e:  # noqa: BLE001 - bookkeeping already broken: drop the request's entries
                log.error("engine_cleanup_failed", device=self._device_id, request=req.request_id, error=str(e))
                for seq in req.seqs:
                    self.by_seq.pop(seq.seq_id, None)
                    with suppress(ValueError):
                        self._batcher.running.remove(seq)
                    with suppress(ValueError):
                        self._batcher.waiting.remove(seq)
                self.requests.pop(req.request_id, None)

    def touched_by(self, plan: StepPlan | None) -> list[RequestState]:
        """The requests of ``plan``'s sequences held here (every request here when ``plan`` is None or empty)."""
        if plan is not None and plan.items:
            by_seq = self.by_seq
            reqs = {by_seq[it.seq.seq_id][0].request_id: by_seq[it.seq.seq_id][0]
                    for it in plan.items if it.seq.seq_id in by_seq}
            return list(reqs.values())
        return list(self.requests.values())
