"""Moves of a decoding sequence's KV from one device of the node to another (pooled hand-offs, the
time-shared fallback's moves): :class:`KVMover`, the part of :class:`node.runtime.engine.DeviceEngine`
that owns a device's outgoing moves, and :class:`MoveEnd`, what it needs of either end's device.

A move is begun (the destination's blocks taken, the sequence released here with its blocks pinned),
then copied, then finished (the source's blocks freed, the destination adopts the sequence), so nothing
is ever half-installed. Blocking moves run between this device's steps, nothing of it running
meanwhile; overlapped ones (pooled) run beside its later steps on a copier task, one job after another,
each job copying every move to one destination begun meanwhile (:mod:`node.runtime.copy_batch`: the
choices of one request send their shared prompt blocks once).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from concurrent.futures import Executor
from contextlib import suppress
from dataclasses import dataclass
from functools import partial
from typing import Callable, Protocol

import structlog

from node.core.sequence import Sequence, SeqStatus
from node.runtime.block_pins import PinnedBlocks, stale
from node.runtime.copy_batch import CopyBatch
from node.runtime.request import RequestState
from node.transport.local import copy_sharded_blocks

log = structlog.get_logger("shiftnode.engine")

COPY_GRACE_S = 5.0
"""Seconds a stopping device lets its KV copy in flight end before aborting it (SIGTERM of the node).
At a slow ``--link-gbps`` a copy can take minutes; the sequence's client is gone with the node anyway."""


@dataclass(frozen=True)
class MigrationRecord:
    """One sequence moved between devices: times on the node's monotonic clock (s), bytes of KV.
    ``start_s``: when the copy began (a queued move waits for the copies before it); ``decided_s``: when
    the policy asked for the move (the roles it saw are those of this instant; None for hand-offs).
    ``nbytes``: the KV this sequence's copy sent (blocks the destination already held, or that another
    sequence of the same copy job sent for it, are not counted); ``shared_blocks``: its leading blocks
    that another sequence of the same copy job sent (:mod:`node.runtime.copy_batch`)."""

    seq_id: str
    src: str
    dst: str
    start_s: float
    end_s: float
    nbytes: int
    blocks: int
    reason: str
    decided_s: float | None = None
    shared_blocks: int = 0


class MoveEnd(Protocol):
    """What a move needs of the device at either end (a :class:`~node.runtime.engine.DeviceEngine`)."""

    device_id: str
    failure: str | None  # why the device is down, else None
    incarnation: int  # bumped by each revive (node.runtime.block_pins)

    @property
    def up(self) -> bool: ...
    @property
    def down_reason(self) -> str | None: ...
    @property
    def kv_pools(self) -> list: ...
    def replies_in_flight(self) -> list[asyncio.Future]: ...
    def movable(self, seq: Sequence) -> tuple[RequestState, int] | None: ...
    def release_for_move(self, seq: Sequence) -> PinnedBlocks: ...
    def reserve_for(self, token_ids: list[int], num_computed: int, num_blocks: int,
                    memo: list[bytes] | None = None, salt: str | None = None) -> tuple[list[int] | None, int]: ...
    def reserve_shared(self, shared: list[int], num_computed: int, num_blocks: int) -> list[int] | None: ...
    def release_pinned(self, blocks: list[int]) -> None: ...
    def adopt(self, req: RequestState, index: int, seq: Sequence) -> None: ...
    def forget_if_empty(self, req: RequestState) -> None: ...


class Move:
    """A move of one decoding sequence to ``dst`` (:meth:`KVMover.migrate`); the fields after
    ``overlap`` are set when it begins (:meth:`KVMover._begin`)."""

    __slots__ = ("seq", "dst", "reason", "fut", "overlap", "decided_s", "req", "index", "start_s", "src_blocks",
                 "dst_blocks", "reused", "fence", "shared")

    def __init__(self, seq: Sequence, dst: MoveEnd, reason: str, fut: asyncio.Future, overlap: bool, decided_s: float):
        self.seq, self.dst, self.reason, self.fut, self.overlap = seq, dst, reason, fut, overlap
        self.decided_s = decided_s
        self.req: RequestState | None = None
        self.index = 0
        self.start_s = 0.0
        self.src_blocks: list[int] = []
        self.dst_blocks: list[int] = []
        self.reused = 0
        self.shared = 0  # leading blocks referenced from an earlier move of its copy job (copy_batch)
        self.fence: list[asyncio.Future] = []


class KVMover:
    """The moves leaving one device: queued (not begun), overlapped ones begun and waiting for the link,
    and the copy in flight.

    Args:
        home: the device the moves leave (its sequences, pins and KV pools: :class:`MoveEnd`).
        clock: monotonic seconds.
        executor: the device's worker thread (copies run there).
        wake: wakes the home device's step loop (a freed block, a move queued).
        notify: calls each of a list of listeners with the arguments given (errors contained:
            ``DeviceEngine._notify``).
    """

    def __init__(self, home: MoveEnd, clock: Callable[[], float], executor: Executor, wake: Callable[[], None],
                 notify: Callable[..., None]):
        self._home, self._clock, self._executor, self._wake, self._notify = home, clock, executor, wake, notify
        self._queued: list[Move] = []  # queued moves, not begun
        self._copies: deque[CopyBatch] = deque()  # overlapped moves begun, copied by _copy_loop in order
        self._copier: asyncio.Task | None = None
        self.copying: CopyBatch | None = None  # the overlapped moves being copied now
        self._blocking: Move | None = None  # the blocking move being copied now (between two steps)
        self._abort = threading.Event()  # set on stop or death: a copy in flight ends at its next layer
        self.link_gbps: float | None = None  # emulated interconnect for KV leaving this device
        self.block_layer_bytes: int | None = None  # a timed device: KV bytes one block of one layer emulates
        self.migration_listeners: list[Callable[[MoveEnd, MoveEnd, Sequence, MigrationRecord], None]] = []

    def migrate(self, seq: Sequence, dst: MoveEnd, reason: str, overlap: bool = False) -> asyncio.Future:
        """Move a decoding sequence's KV to ``dst``.

        ``overlap=False``: at this device's next step boundary, with nothing of this device running
        meanwhile (the steps in flight end first and none is sent until the copy is done: the imbalance
        fallback's moves, whose cost the policy prices as time the source is busy). ``overlap=True``
        (pooled hand-offs): as soon as no step in flight includes the sequence, the copy runs beside this
        device's later steps, one copy after another (a FIFO link), so a prefill device goes on
        prefilling while it sends. Either way the copy waits for the destination's steps in flight at
        the time its blocks were taken (a step sent before a block was freed may still write it).

        The future resolves to a :class:`MigrationRecord`, or ``None`` when the move was refused (the
        sequence is not decoding here, or ``dst`` is down or has no free blocks) or failed; the sequence
        then stays. A move whose request is cancelled or whose choice ended (a timeout) before its copy
        starts is dropped without copying, and both sides' blocks are freed.
        """
        fut = asyncio.get_running_loop().create_future()
        self._queued.append(Move(seq, dst, reason, fut, overlap, self._clock()))
        self._wake()
        return fut

    @property
    def outgoing_tokens(self) -> int:
        """Tokens of KV queued to leave this device or leaving it now (moves not yet done)."""
        return sum(m.seq.num_computed for m in self._in_flight())

    def _in_flight(self) -> list[Move]:
        batches = [*self._copies, *([self.copying] if self.copying is not None else [])]
        return [*self._queued, *(m for b in batches for m in b.moves), *([self._blocking] if self._blocking else [])]

    @property
    def destinations(self) -> list[str]:
        """The destination device of each move leaving this device and not yet done (queued, waiting for
        the link, or copying), for ``GET /v1/node`` (``kv_moves_out``: the chaos run kills either end of one)."""
        return [m.dst.device_id for m in self._in_flight()]

    @property
    def queued(self) -> bool:
        """Moves wait to begin (the step loop gives the blocking ones a step boundary)."""
        return bool(self._queued)

    def _begin(self, m: Move, batch: CopyBatch | None = None) -> bool:
        """Take the destination's blocks and release the sequence here (keeping its blocks pinned);
        False (and the future resolved to None) when the move is refused. ``batch``: the copy job it
        joins; leading blocks it shares here with a move of that job are shared there too."""
        seq, dst, home = m.seq, m.dst, self._home
        entry = home.movable(seq)
        blocks = None
        if entry is not None and dst.failure is None:
            lead = []  # (never blocks taken before a restart of dst: their ids name the dead pool's memory)
            if batch is not None and batch.moves and not stale(batch.moves[0].dst_blocks, dst.incarnation):
                lead = batch.shared_lead(seq.block_ids)
            blocks = dst.reserve_shared(lead, seq.num_computed, len(seq.block_ids)) if lead else None
            if blocks is not None:  # (the destination's cached blocks among them stay out of the copy: batch.cached)
                m.shared = next((i for i, (a, b) in enumerate(zip(blocks, lead)) if a != b), min(len(blocks), len(lead)))
            else:
                blocks, m.reused = dst.reserve_for(seq.token_ids, seq.num_computed, len(seq.block_ids),
                                                   seq.block_keys, seq.params.cache_salt)
        if blocks is None:
            m.fut.set_result(None)
            return False
        m.req, m.index = entry
        m.dst_blocks = blocks  # pinned on dst, stamped with its incarnation (node.runtime.block_pins)
        m.fence = dst.replies_in_flight()
        # No step or abort touches it during the copy (an abort meanwhile finds no sequence to free;
        # the request is marked cancelled, which _finish checks). The request stays listed here
        # until the copy ends, so the pooled router still counts its reservation.
        m.src_blocks = home.release_for_move(seq)
        return True

    async def _finish(self, batch: CopyBatch) -> None:
        """Copy a batch of begun moves' KV in one job (layer by layer, in logical block order, each
        destination block once, read back for verification), then, per move, free the source blocks and
        let the destination adopt the sequence with its position counter unchanged; on a failed copy every
        move's destination blocks are freed and its sequence comes back here. A move whose request ended
        (client left, timed out) before or during the copy is dropped. Prefix cache: the destination's own
        cached prefix (``m.reused`` blocks) is not received."""
        dst, home = batch.dst, self._home
        for reply in {id(r): r for m in batch.moves for r in m.fence}.values():  # dst's steps sent before its blocks were taken
            with suppress(BaseException):
                await asyncio.shield(reply)
        live = []
        for m in batch.moves:
            if self._gone(m):
                self._drop(m)  # its references to shared blocks go; the others' keep them
            else:
                live.append(m)
        if not live:
            return
        start = self._clock()  # the copy itself starts now (queued copies waited for the link)
        src_blocks, dst_blocks, first = batch.pairs(live)
        try:
            for m in live:
                m.start_s = start
                self._check_ends(m)
            report = await asyncio.get_running_loop().run_in_executor(self._executor, partial(
                copy_sharded_blocks, home.kv_pools, src_blocks, dst.kv_pools, dst_blocks, link_gbps=self.link_gbps,
                block_layer_bytes=self.block_layer_bytes, abort=self._abort))
            for m in live:
                self._check_ends(m)  # either end died (or came back) during the copy: nothing would run it there
        except Exception as e:  # noqa: BLE001 - a failed copy leaves the sequences where they were
            for m in live:
                log.warning("migration_failed", seq=m.seq.seq_id, src=home.device_id, dst=dst.device_id, error=str(e))
                self._give_back(m)
            return
        end = self._clock()
        block_bytes = report.nbytes // len(dst_blocks) if dst_blocks else 0
        for m in live:
            if self._gone(m):
                self._drop(m)
                continue
            seq = m.seq
            home.release_pinned(m.src_blocks)
            home.forget_if_empty(m.req)
            self._wake()
            seq.block_ids = m.dst_blocks
            dst.adopt(m.req, m.index, seq)
            record = MigrationRecord(seq.seq_id, home.device_id, dst.device_id, m.start_s, end,
                                     block_bytes * first[id(m)], len(m.dst_blocks), m.reason, m.decided_s, m.shared)
            self._notify(self.migration_listeners, dst, seq, record)
            m.fut.set_result(record)

    def _give_back(self, m: Move) -> None:
        """A begun move whose copy failed: its destination blocks are freed and its sequence goes on here
        (a dead source resumes it instead: ``Residents.adopt``), or is dropped if its request ended."""
        if self._gone(m):
            return self._drop(m)
        m.dst.release_pinned(m.dst_blocks)
        m.seq.block_ids = m.src_blocks
        self._home.adopt(m.req, m.index, m.seq)
        m.fut.set_result(None)

    def _check_ends(self, m: Move) -> None:
        """Raise ``RuntimeError`` if either end of ``m`` is down or was restarted since it began (its
        blocks there name the dead pool's memory: :mod:`node.runtime.block_pins`)."""
        for end, blocks in ((self._home, m.src_blocks), (m.dst, m.dst_blocks)):
            if not end.up or stale(blocks, end.incarnation):
                raise RuntimeError(f"device {end.device_id} is down or was restarted: {end.down_reason}")

    @staticmethod
    def _gone(m: Move) -> bool:
        """The move's request was cancelled or its choice has ended (a timeout, a failure)."""
        return m.req.cancelled or m.req.finished[m.index]

    def _drop(self, m: Move) -> None:
        """End a begun move without adopting it anywhere: both sides' blocks are freed and its future
        resolves to None."""
        m.dst.release_pinned(m.dst_blocks)
        self._home.release_pinned(m.src_blocks)
        m.seq.block_ids, m.seq.status = [], SeqStatus.FINISHED
        self._home.forget_if_empty(m.req)
        self._wake()
        m.fut.set_result(None)

    async def apply_blocking(self) -> None:
        """Carry out the queued blocking moves between steps (nothing of this device runs meanwhile)."""
        while self._queued:
            m = self._queued.pop(0)
            batch = CopyBatch(m.dst)
            if self._begin(m, batch):
                batch.add(m)
                self._blocking = m
                try:
                    await self._finish(batch)
                finally:
                    self._blocking = None

    def start_overlapped(self, busy: Callable[[], set[str]]) -> None:
        """Begin every queued overlapped move whose sequence is in no step in flight (``busy``: the seq
        ids of the steps in flight), and hand it to the copier task (the others wait: the blocking ones
        for a step boundary, the overlapped ones for their sequence's last step to end). Moves to one
        device join one copy job: the last one still waiting for the link, else a new one
        (:mod:`node.runtime.copy_batch`), so a burst of hand-offs is one gather, not one job each."""
        if not self._queued or not any(m.overlap for m in self._queued):
            return
        in_flight = busy()
        keep = []
        for m in self._queued:
            if not m.overlap or m.seq.seq_id in in_flight:
                keep.append(m)
                continue
            batch = next((b for b in self._copies if b.dst is m.dst), None)
            if batch is None:
                batch = CopyBatch(m.dst)
                self._copies.append(batch)
            if self._begin(m, batch):
                batch.add(m)
        self._queued = keep
        while self._copies and not self._copies[-1].moves:  # (a new job none of whose moves began)
            self._copies.pop()
        if self._copies and (self._copier is None or self._copier.done()):
            self._copier = asyncio.get_running_loop().create_task(self._copy_loop(),
                                                                  name=f"copies-{self._home.device_id}")

    async def abort_copies(self, grace_s: float) -> None:
        """Let the overlapped copy in flight end within ``grace_s`` seconds, then make every copy of this
        device stop at its next layer or link wait (``CopyAborted``: the move fails, its destination
        blocks are freed), so the worker thread is free for the engine's stop. A copy whose request
        already ended (on SIGTERM the server cancelled every handler first) is aborted at once."""
        b = self.copying
        if b is not None and not all(map(self._gone, b.moves)) and self._copier is not None and not self._copier.done():
            await asyncio.wait([self._copier], timeout=grace_s)
        self._abort.set()

    async def _copy_loop(self) -> None:
        """Overlapped copy jobs, one after another while this device's steps go on."""
        while self._copies:
            b = self.copying = self._copies.popleft()
            try:
                await self._finish(b)
            except asyncio.CancelledError:
                for m in b.moves:
                    if not m.fut.done():
                        m.fut.cancel()
                raise
            except Exception as e:  # noqa: BLE001 - one job's bug must not strand the others
                for m in b.moves:
                    log.warning("migration_failed", seq=m.seq.seq_id, src=self._home.device_id,
                                dst=m.dst.device_id, error=str(e))
                    if not m.fut.done():
                        m.fut.set_result(None)
            finally:
                self.copying = None

    async def stop(self, grace_s: float) -> None:
        """Abort the copies (:meth:`abort_copies`) and end the copier task."""
        await self.abort_copies(grace_s)
        if self._copier and not self._copier.done():
            self._copier.cancel()
            with suppress(asyncio.CancelledError):
                await self._copier

    def abort_now(self) -> None:
        """The home device died: a copy in flight ends at its next layer (the restart must not wait on it)."""
        self._abort.set()

    def rearm(self) -> None:
        """The home device serves again (a revive): copies run to their end again."""
        self._abort.clear()

    def refuse_queued(self) -> None:
        """The home device is down: the moves not begun resolve to None (the sequences stay, and fail here)."""
        for m in self._queued:
            if not m.fut.done():
                m.fut.set_result(None)
        self._queued.clear()

