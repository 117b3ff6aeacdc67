"""Pinned KV blocks carry the engine incarnation they were taken in, and a debug check that no block
is owned twice.

A device's engine can die and be restarted while some of its blocks are *pinned*: held by no sequence
there, but by a transfer (a hand-off's detach, an inbound reservation, either side of an in-node
move). The restart allocates a new KV pool and a new block ledger
(:meth:`~node.runtime.engine_revival.Revival.revive`), and each revive bumps the device's
``incarnation`` (:meth:`BlockPins.new_incarnation`). Block ids taken before it name memory of the dead pool: freeing them into the new
ledger would release blocks new sequences own (the same block then handed out twice), and adopting a
sequence with them would read KV that was never written there. So every pin is stamped
(:class:`PinnedBlocks`), and a stale stamp is neither freed nor adopted: the old ledger went with the
old pool, and the transfer's sequence is resumed like the dead device's others
(:mod:`node.runtime.resume`).

The check (:func:`check_ownership`, after every step when ``SHIFTNODE_LEDGER_CHECK=1``): each block's
reference count equals its holders — the sequences on the device whose block table names it plus the
current incarnation's pins — and no held block is free. A block freed by a stale holder while a new
sequence holds it, or a sequence adopted with blocks it holds no reference to, breaks the equality.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Callable

import structlog

log = structlog.get_logger("shiftnode.engine")

LEDGER_CHECK = os.environ.get("SHIFTNODE_LEDGER_CHECK", "") not in ("", "0")
"""Check block ownership after every step (``SHIFTNODE_LEDGER_CHECK=1``; tests and the chaos run turn it
on: it costs a pass over the pool per step)."""


class PinnedBlocks(list):
    """Block ids pinned on a device by a transfer, with the device's ``incarnation`` when pinned (a
    plain ``list`` of ints otherwise; slicing gives plain lists)."""

    def __init__(self, blocks, incarnation: int):
        super().__init__(blocks)
        self.incarnation = incarnation


def stale(blocks, incarnation: int) -> bool:
    """Whether ``blocks`` were pinned in an incarnation other than ``incarnation`` (unstamped: not stale)."""
    return getattr(blocks, "incarnation", incarnation) != incarnation


def check_ownership(ledger, holders: list[list[int]], pinned: Counter) -> None:
    """Every block of ``ledger`` is referenced exactly as often as it is held: by the block tables in
    ``holders`` (one per sequence on the device) plus ``pinned`` (block → pins of the current
    incarnation), and no held block is free (:meth:`BlockLedger.check_holders
    <node.core.ledger.BlockLedger.check_holders>`).

    Raises:
        LedgerError: the first block owned more (or less) often than it is referenced.
    """
    held = Counter(pinned)
    for blocks in holders:
        held.update(blocks)
    ledger.check_holders(held)


class BlockPins:
    """The blocks of one device that transfers hold (no sequence there does), counted per block, and the
    device's engine incarnation: a part of :class:`node.runtime.engine.DeviceEngine` (its ``pins``).

    Args:
        device_id: the device's name (log lines).
        ledger: returns the device's block ledger now (a revive replaces it): released pins go there.
    """

    def __init__(self, device_id: str, ledger: Callable[[], object]):
        self._device_id, self._ledger = device_id, ledger
        self.incarnation = 0  # bumped by each revive: blocks pinned before it are stale
        self._pinned: Counter[int] = Counter()  # block → pins by transfers in this incarnation

    def pin(self, blocks: list[int]) -> PinnedBlocks:
        """Blocks a transfer now holds (no sequence on the device does), stamped with this incarnation."""
        self._pinned.update(blocks)
        return PinnedBlocks(blocks, self.incarnation)

    def is_stale(self, blocks) -> bool:
        """Whether ``blocks`` were pinned in an earlier incarnation (:func:`stale`)."""
        return stale(blocks, self.incarnation)

    def unpin(self, blocks: list[int]) -> bool:
        """Blocks a transfer held leave its hands (freed, or adopted by a sequence); False, changing
        nothing, when they were pinned in an earlier incarnation (the ledger they were in is gone)."""
        if self.is_stale(blocks):
            log.warning("stale_blocks_dropped", device=self._device_id, blocks=len(blocks),
                        pinned_in=blocks.incarnation, incarnation=self.incarnation)
            return False
        for b in blocks:
            if self._pinned[b] <= 1:
                del self._pinned[b]
            else:
                self._pinned[b] -= 1
        return True

    def release(self, blocks: list[int]) -> None:
        """Free pinned blocks into the ledger now (unless stale: see :meth:`unpin`)."""
        if self.unpin(blocks):
            self._ledger().free(blocks)

    def check(self, holders: list[list[int]]) -> None:
        """:func:`check_ownership` of the ledger against ``holders`` (the device's sequences' block tables)
        plus these pins.

        Raises:
            LedgerError: a block owned more (or less) often than it is referenced.
        """
        check_ownership(self._ledger(), holders, self._pinned)

    def new_incarnation(self) -> None:
        """The device serves on a new engine and pool (a revive): every pin taken before now is stale."""
        self.incarnation += 1
        self._pinned.clear()
