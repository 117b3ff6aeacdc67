"""One copy job for several moves to the same device (:class:`CopyBatch`), so that the choices of a
request, which share their prompt's blocks on the source, send those blocks once.

The moves of a batch are begun together (:meth:`node.runtime.moves.KVMover.start_overlapped`; a move
begun while the batch still waits for the link joins it). A move whose leading source blocks an
earlier move of the batch already maps to blocks of the destination references those blocks there
(:meth:`~node.runtime.engine_residents.Residents.reserve_shared`: ref-counted, as the prefix cache
shares blocks) instead of taking new ones; the copy writes each destination block once, before any
move of the batch is adopted, so a shared block is never read before it holds its KV. If the copy
fails, every move of the batch fails with it (each frees its own references).
"""

from __future__ import annotations

from typing import Protocol


class Move(Protocol):
    """What a batch reads of a begun :class:`node.runtime.moves.Move` (which imports this module)."""

    src_blocks: list[int]  # its blocks on the source, in logical order
    dst_blocks: list[int]  # its blocks on the destination, same order
    reused: int  # leading destination blocks taken from the destination's prefix cache


class CopyBatch:
    """Moves to ``dst`` (a :class:`node.runtime.moves.MoveEnd`) copied in one job.

    ``sharing``: source block → the destination block a move of the batch holds for it (its blocks
    past those the destination's prefix cache already held); ``cached``: destination blocks taken
    from that cache (they hold the KV already and are never written by the copy)."""

    __slots__ = ("dst", "moves", "sharing", "cached")

    def __init__(self, dst: object):
        self.dst = dst
        self.moves: list[Move] = []
        self.sharing: dict[int, int] = {}
        self.cached: set[int] = set()

    def shared_lead(self, src_blocks: list[int]) -> list[int]:
        """The destination blocks of the leading run of ``src_blocks`` that a move of the batch already
        maps (empty when the first block is not mapped)."""
        out = []
        for b in src_blocks:
            d = self.sharing.get(b)
            if d is None:
                break
            out.append(d)
        return out

    def add(self, m: Move) -> None:
        """Add a begun move: its blocks become shareable by the moves begun after it."""
        self.moves.append(m)
        self.cached.update(m.dst_blocks[: m.reused])
        for s, d in zip(m.src_blocks, m.dst_blocks):
            self.sharing.setdefault(s, d)

    def pairs(self, live: list[Move]) -> tuple[list[int], list[int], dict[int, int]]:
        """The copy of ``live`` (the batch's moves still wanted): source and destination block lists, each
        destination block once and no block of the destination's cache, and how many of them each move
        is the first to need (by ``id`` of the move: the bytes its record reports)."""
        src: list[int] = []
        dst: list[int] = []
        seen = set(self.cached)
        first: dict[int, int] = {}
        for m in live:
            n = 0
            for s, d in zip(m.src_blocks, m.dst_blocks):
                if d not in seen:
                    seen.add(d)
                    src.append(s)
                    dst.append(d)
                    n += 1
            first[id(m)] = n
        return src, dst, first
