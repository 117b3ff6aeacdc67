"""The block ledger: the one authority over a device's paged KV memory (pure integers, no tensors).

Allocation is check-then-commit: :meth:`BlockLedger.allocate` returns ``None`` when it cannot satisfy
the whole request, and never hands out a block that is in use. The tensor pool only maps block ids to
memory, so the same ledger decides admission live and in simulation.
"""

from __future__ import annotations

from collections import deque


class LedgerError(RuntimeError):
    """A block was freed twice or was never allocated (a bookkeeping bug, never a client error)."""


class BlockLedger:
    """Free list and reference counts of ``num_blocks`` blocks of ``block_size`` tokens each."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token (got {num_blocks} x {block_size})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        """Blocks not referenced by any sequence."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` free blocks (refcount 1 each), or return ``None`` and change nothing."""
        if n > len(self._free):
            return None
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def free(self, blocks: list[int]) -> None:
        """Drop one reference from each block; blocks reaching zero return to the free list.

        Raises:
            LedgerError: a block that is not allocated.
        """
        for b in blocks:
            if not 0 <= b < self.num_blocks or self._refs[b] <= 0:
                raise LedgerError(f"block {b} freed but not allocated")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)

    def check(self) -> None:
        """Invariant: free list and refcounts agree (used in tests and when idle)."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise LedgerError("a block is on the free list twice")
        for b, r in enumerate(self._refs):
            if (r == 0) != (b in free):
                raise LedgerError(f"block {b} has refcount {r} but free={b in free}")
