"""The prefix cache's index and eviction order in storage allocated once per ledger (pure integers).

A cached block used to cost Python objects that lived as long as it stayed cached: its key (a
``bytes``), a slot in a ``dict`` from key to block and an entry of an ``OrderedDict`` (the LRU of
unreferenced cached blocks), about 0.2 KB a block. A 26,214-block pool takes most of an hour of
mixed load to fill, so a node's resident memory kept growing by MBs long after its warm-up (the
soak's RSS growth, issue 32). Here everything is sized by the pool when the ledger is made, the way
vLLM keeps one preallocated block object per block and its free queue as an intrusive list:

* :class:`BlockIndex`: key -> block by open addressing with linear probing over an ``array`` of
  block ids (capacity a power of two >= 2x the pool, so probes stay short), deletion by backward
  shift (no tombstones to pile up under churn); each block's key, its hash (the key's first 8 bytes,
  which a probe compares before the key), parent key and token ids in flat arrays, so a hit is
  confirmed by parent and tokens without any per-block object.
* :class:`BlockLRU`: the unreferenced cached blocks, least recently released first, as a doubly
  linked list through two ``array`` s of block ids (O(1) push, pop-oldest and unlink).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence as Seq

KEY_BYTES = 16  # block_key's BLAKE2b digest size
_NONE = -1


class BlockIndex:
    """Key -> block map of the cached blocks of a ``num_blocks`` x ``block_size`` pool, with each
    cached block's key, parent key and token ids. Memory: ``4 * capacity + num_blocks * (41 + 8 *
    block_size)`` bytes, all allocated here (capacity: the power of two >= ``2 * num_blocks``).

    Keys are :data:`KEY_BYTES`-byte digests (uniform bits), so their first 8 bytes are the hash.
    """

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        cap = 1 << max(1, (2 * num_blocks - 1).bit_length())
        self._mask = cap - 1
        self._slots = array("i", [_NONE]) * cap  # block whose key hashed here (or probed on), or -1
        self._hashes = array("Q", bytes(8 * num_blocks))  # each cached block's hash: a probe compares ints first
        self._keys = bytearray(KEY_BYTES * num_blocks)
        self._parents = bytearray(KEY_BYTES * num_blocks)
        self._flags = bytearray(num_blocks)  # bit 0: cached; bit 1: has a parent
        self._tokens = array("q", bytes(8 * num_blocks * block_size))
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block: int) -> bool:
        """Whether ``block`` is cached."""
        return bool(self._flags[block] & 1)

    def key(self, block: int) -> bytes | None:
        """The key ``block`` is cached under, or None (a fresh ``bytes``: not kept by the index)."""
        if not self._flags[block] & 1:
            return None
        return bytes(self._keys[block * KEY_BYTES : (block + 1) * KEY_BYTES])

    def _probe(self, key: bytes) -> tuple[int, int, int]:
        """``(hash, slot, block)``: the slot of the block cached under ``key`` and that block, or the
        first empty slot of ``key``'s probe run and ``_NONE`` (where ``key`` would be added)."""
        slots, hashes, mask = self._slots, self._hashes, self._mask
        h = int.from_bytes(key[:8], "little")
        i = h & mask
        while (b := slots[i]) != _NONE:
            if hashes[b] == h and self._keys[b * KEY_BYTES : (b + 1) * KEY_BYTES] == key:
                break
            i = (i + 1) & mask
        return h, i, b

    def find(self, key: bytes) -> int | None:
        """The block cached under ``key``, or None."""
        b = self._probe(key)[2]
        return None if b == _NONE else b

    def confirms(self, block: int, parent: bytes | None, tokens: Seq[int]) -> bool:
        """Whether cached ``block`` was registered with this parent key and these token ids."""
        f = self._flags[block]
        if parent is None:
            if f & 2:
                return False
        elif not f & 2 or self._parents[block * KEY_BYTES : (block + 1) * KEY_BYTES] != parent:
            return False
        bs = self.block_size
        return self._tokens[block * bs : (block + 1) * bs] == array("q", tokens)

    def add(self, block: int, key: bytes, parent: bytes | None, tokens: Seq[int]) -> None:
        """Cache ``block`` under ``key`` (not cached yet, and no other block under ``key``: the
        caller checks with :meth:`find`, or calls :meth:`insert`)."""
        if not self.insert(block, key, parent, tokens):
            raise KeyError(f"a block is already cached under this key (adding block {block})")

    def insert(self, block: int, key: bytes, parent: bytes | None, tokens: Seq[int]) -> bool:
        """Cache ``block`` (not cached yet) under ``key`` unless a block is already cached under it
        (then False, changing nothing): :meth:`find` and :meth:`add` in one probe (the key, if there,
        is in the run of slots before the first empty one, where it is added)."""
        h, i, b = self._probe(key)
        if b != _NONE:
            return False
        self._slots[i] = block
        self._hashes[block] = h
        o, bs = block * KEY_BYTES, self.block_size
        self._keys[o : o + KEY_BYTES] = key
        if parent is not None:
            self._parents[o : o + KEY_BYTES] = parent
        self._flags[block] = 3 if parent is not None else 1
        self._tokens[block * bs : (block + 1) * bs] = array("q", tokens)
        self._len += 1
        return True

    def remove(self, block: int) -> None:
        """Uncache ``block`` (cached). Backward-shift deletion: the entries after the emptied slot in
        its probe run move back when their home slot allows, so every key stays reachable."""
        slots, hashes, mask = self._slots, self._hashes, self._mask
        i = hashes[block] & mask
        while slots[i] != block:
            i = (i + 1) & mask
        j = i
        while True:
            j = (j + 1) & mask
            b = slots[j]
            if b == _NONE:
                break
            h = hashes[b] & mask
            if (j - h) & mask >= (j - i) & mask:  # b's home is at or before the hole: move it back
                slots[i] = b
                i = j
        slots[i] = _NONE
        self._flags[block] = 0
        self._len -= 1

    def cached(self) -> list[int]:
        """The cached blocks (for invariant checks)."""
        return [b for b, f in enumerate(self._flags) if f & 1]

    def check(self) -> bool:
        """Every cached block is found under its own key and the table holds nothing else."""
        return sum(b != _NONE for b in self._slots) == self._len == len(self.cached()) and \
            all(self.find(self.key(b)) == b for b in self.cached())


class BlockLRU:
    """Blocks in release order, least recent first, as a doubly linked list over ``num_blocks``
    slots (two int32 arrays with a sentinel at index ``num_blocks``)."""

    def __init__(self, num_blocks: int):
        self._head = num_blocks  # the sentinel: next = oldest, prev = newest
        self._next = array("i", [_NONE]) * (num_blocks + 1)
        self._prev = array("i", [_NONE]) * (num_blocks + 1)
        self._next[self._head] = self._prev[self._head] = self._head
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block: int) -> bool:
        return self._next[block] != _NONE

    def push(self, block: int) -> None:
        """Append ``block`` (not in the list) as the most recently released."""
        h, nxt, prv = self._head, self._next, self._prev
        last = prv[h]
        nxt[last], prv[block], nxt[block], prv[h] = block, last, h, block
        self._len += 1

    def remove(self, block: int) -> None:
        """Unlink ``block`` (in the list)."""
        nxt, prv = self._next, self._prev
        n, p = nxt[block], prv[block]
        nxt[p], prv[n] = n, p
        nxt[block] = prv[block] = _NONE
        self._len -= 1

    def pop_oldest(self) -> int:
        """Unlink and return the least recently released block (the list is not empty)."""
        b = self._next[self._head]
        self.remove(b)
        return b
