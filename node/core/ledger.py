"""The block ledger: the one authority over a device's paged KV memory (pure integers, no tensors).

Allocation is check-then-commit: :meth:`BlockLedger.allocate` returns ``None`` when it cannot satisfy
the whole request, and never hands out a block that is in use. The tensor pool only maps block ids to
memory, so the same ledger decides admission live and in simulation.

**Prefix cache.** A *full* block (``block_size`` tokens) can be registered under a key chained over
its parent's key and its token ids (:func:`block_key`, BLAKE2b-128; vLLM's and SGLang's scheme), so
a later sequence whose leading tokens are the same reuses the block instead of recomputing it. A hit
is confirmed by the stored parent key and token ids, never by the hash alone. Every block is in
exactly one of three states:

* **referenced** (refcount > 0): held by sequences (several share a cached block), or pinned by a
  transfer that has not committed — never evicted, whatever the pressure;
* **cached, unreferenced**: its content stays valid and findable, and it is *reclaimable*: it counts
  as free, and :meth:`allocate` evicts the least recently released of these when no clean block is
  left (a sequence's blocks are released tail first, so shared heads outlive private tails);
* **free**: no content worth keeping.

Registration happens when the step that fills a block is *planned*, so sequences admitted later in
the same step share it: the forward pass writes every new token's K/V of a layer before that layer
attends, so such a block is never read before it is written.

**Pending blocks and the fence.** A block registered by a planned step (``register(...,
pending=True)``) is *pending* until that step's outcome is known. Invariant:

* only the planner of the device's own step pipeline may match a pending block
  (``match(..., pending=True)``, the batcher's admission): the steps it plans run after the writing
  step on the same device, and a failed step fails every step in flight after it, so whoever reads the
  block that way fails with its writer;
* everyone else (a move's or a peer hand-off's reservation, :meth:`reserve`; the simulator's
  transfers) matches only *written* blocks, so a sequence arriving from elsewhere never keeps a
  reference to KV that a failed step did not write;
* a pending block leaves that state only through :meth:`settle`, called exactly once per registering
  step *after the fence* (its reply, success or failure, came back, so nothing can still write the
  block): ``written=True`` makes it findable by everyone; ``written=False`` drops it from the cache,
  and it becomes clean as soon as its holders (all of them failing with the step) free it. No other
  path unregisters a pending block, so no block outlives its failed writer in the cache, and none stays
  referenced by a sequence that did not fail with it.
"""

from __future__ import annotations

import functools
import hashlib
from array import array
from collections import deque
from collections.abc import Sequence as Seq

from node.core.block_index import BlockIndex, BlockLRU


class LedgerError(RuntimeError):
    """A block was freed twice or was never allocated (a bookkeeping bug, never a client error)."""


def block_key(parent: bytes | None, tokens: Seq[int]) -> bytes:
    """Cache key of a full block: BLAKE2b (16-byte digest) over the parent block's key (none for the
    first block) and the block's token ids as signed 64-bit integers."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("q", tokens))
    return h.digest()


@functools.lru_cache(maxsize=1024)
def salt_root(salt: str | None) -> bytes | None:
    """The parent key of a salted sequence's first block (``cache_salt``, as vLLM salts its first block
    hash): a digest of the salt, so every key of the sequence, and the parent a hit is confirmed
    against, differs from an unsalted or otherwise salted sequence's; None without a salt."""
    if salt is None:
        return None
    return hashlib.blake2b(b"cache_salt\0" + salt.encode(), digest_size=16).digest()


class BlockLedger:
    """Free list, reference counts and prefix cache of ``num_blocks`` blocks of ``block_size`` tokens.

    Args:
        num_blocks, block_size: pool geometry (both >= 1).
        prefix_caching: keep full blocks findable by content; off (the default of this pure class,
            so plain ledgers behave as before; the node turns it on unless ``--no-prefix-caching``),
            :meth:`register` and :meth:`match` do nothing and every prompt is computed from scratch.

    Raises:
        ValueError: an empty geometry.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token (got {num_blocks} x {block_size})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._free: deque[int] = deque(range(num_blocks))  # unreferenced, nothing cached
        self._refs = [0] * num_blocks
        # The cache index (key, parent key and token ids of each cached block) and the eviction order
        # of the unreferenced cached blocks live in storage allocated here, sized by the pool: Python
        # objects per cached block (a tuple of token ids, then a key, a dict slot and an OrderedDict
        # entry) grew the node for most of an hour as a large pool's cache filled (the soak's RSS
        # growth, issue 32).
        self._lru = BlockLRU(num_blocks if prefix_caching else 0)  # unreferenced, cached: oldest release first
        self._index = BlockIndex(num_blocks if prefix_caching else 0, block_size)
        self._writers = [0] * num_blocks  # steps that registered the block and are not settled yet (pending)
        self.num_evictions = 0

    # --- counts ---------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: clean ones plus cached, unreferenced (reclaimable) ones."""
        return len(self._free) + len(self._lru)

    @property
    def num_used(self) -> int:
        """Blocks referenced by sequences or pinned by transfers (the live KV)."""
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks findable in the prefix cache, referenced or not."""
        return len(self._index)

    @property
    def num_reclaimable(self) -> int:
        """Cached blocks no one references: free for allocation, findable until evicted."""
        return len(self._lru)

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def is_cached(self, block: int) -> bool:
        return self.prefix_caching and block in self._index

    def is_pending(self, block: int) -> bool:
        """The block is cached and a step that is to write it has not settled (:meth:`settle`)."""
        return self.is_cached(block) and self._writers[block] > 0

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    # --- allocation -----------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` blocks (refcount 1 each), clean ones first, then evicting the least recently
        released cached ones; or return ``None`` and change nothing."""
        if n > self.num_free:
            return None
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b = self._lru.pop_oldest()
                self._index.remove(b)
                self.num_evictions += 1
            self._refs[b] = 1
            out.append(b)
        return out

    def reuse_cost(self, blocks: Seq[int]) -> int:
        """Free blocks that taking a reference on ``blocks`` consumes: those nobody references now."""
        return sum(1 for b in blocks if self._refs[b] == 0)

    def take(self, cached: Seq[int], n: int) -> list[int] | None:
        """Reference the cached blocks ``cached`` (from :meth:`match`) and allocate ``n`` new ones, all
        or nothing. Returns the new blocks, or ``None`` (nothing changed) when they do not fit."""
        if n + self.reuse_cost(cached) > self.num_free:
            return None
        for b in cached:
            if not self.is_cached(b):
                raise LedgerError(f"block {b} is not cached")
            if self._refs[b] == 0:
                self._lru.remove(b)  # referenced now: out of eviction's reach before allocate runs
            self._refs[b] += 1
        out = self.allocate(n)
        assert out is not None  # checked above
        return out

    def fork(self, held: Seq[int], n: int) -> list[int] | None:
        """Reference the already referenced blocks ``held`` once more (another block table shares them,
        as the choices of one request share their prompt's blocks) and allocate ``n`` new ones, all or
        nothing. Returns the new blocks, or ``None`` (nothing changed) when they do not fit.

        Raises:
            LedgerError: a block of ``held`` that nobody references (sharing it would hand out a free block).
        """
        for b in held:
            if not 0 <= b < self.num_blocks or self._refs[b] <= 0:
                raise LedgerError(f"block {b} shared but not allocated")
        out = self.allocate(n)
        if out is None:
            return None
        for b in held:
            self._refs[b] += 1
        return out

    def free(self, blocks: Seq[int]) -> None:
        """Drop one reference from each block; a block reaching zero becomes reclaimable if cached,
        else clean. Blocks are released last first, so a sequence's tail is evicted before its head.

        Raises:
            LedgerError: a block that is not allocated.
        """
        for b in reversed(blocks):
            if not 0 <= b < self.num_blocks or self._refs[b] <= 0:
                raise LedgerError(f"block {b} freed but not allocated")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if self.prefix_caching and b in self._index:
                    self._lru.push(b)
                else:
                    self._free.append(b)

    # --- the prefix cache -----------------------------------------------------------------------
    def keys(self, token_ids: Seq[int], num_blocks: int, memo: list[bytes], root: bytes | None = None) -> list[bytes]:
        """Keys of the first ``num_blocks`` full blocks of ``token_ids``, extending ``memo`` (the keys
        already computed for these tokens, which only ever grow) as needed. ``root``: the first
        block's parent (:func:`salt_root` of the sequence's ``cache_salt``; None unsalted)."""
        bs = self.block_size
        while len(memo) < num_blocks:
            i = len(memo)
            memo.append(block_key(memo[-1] if memo else root, token_ids[i * bs : (i + 1) * bs]))
        return memo

    def match(self, token_ids: Seq[int], max_tokens: int, memo: list[bytes] | None = None,
              pending: bool = False, root: bytes | None = None) -> list[int]:
        """Cached blocks holding the longest run of leading full blocks of ``token_ids[:max_tokens]``
        (``[]`` with caching off). Changes nothing; take them with :meth:`take`.

        ``memo``: the tokens' key list (see :meth:`keys`); keys are computed only as far as the match
        goes. A candidate must also carry the same parent key and the same token ids. ``pending``:
        pending blocks match too (only the device's own planner may ask: see the module docstring);
        otherwise the match stops at the first pending block. ``root``: as in :meth:`keys`.
        """
        if not self.prefix_caching or not len(self._index):
            return []
        bs, index = self.block_size, self._index
        memo = [] if memo is None else memo
        out: list[int] = []
        parent = root
        for i in range(max(0, max_tokens) // bs):
            key = self.keys(token_ids, i + 1, memo, root)[i]
            b = index.find(key)
            if b is None or not index.confirms(b, parent, token_ids[i * bs : (i + 1) * bs]):
                break
            if not pending and self._writers[b]:
                break  # its step may still fail: never hand it to a reader outside that step's pipeline
            out.append(b)
            parent = key
        return out

    def reserve(self, token_ids: Seq[int], max_tokens: int, num_blocks: int,
                memo: list[bytes] | None = None, root: bytes | None = None) -> tuple[list[int], int] | None:
        """Blocks for a sequence of ``num_blocks`` blocks arriving from elsewhere (a move, a peer
        hand-off) whose first ``max_tokens`` tokens are computed: the *written* cached blocks of its
        longest cached prefix (never pending ones: the module docstring's invariant), referenced now so
        never evicted, then new ones; all or nothing. Returns ``(blocks, reused)``, the first
        ``reused`` being the cached ones (their KV need not be sent), or ``None`` (nothing changed)."""
        hits = self.match(token_ids, max_tokens, memo, root=root)[:num_blocks]
        new = self.take(hits, num_blocks - len(hits))
        if new is None:
            return None
        return hits + new, len(hits)

    def register(self, block: int, key: bytes, parent: bytes | None, tokens: Seq[int], pending: bool = False) -> bool:
        """Make the referenced full ``block`` findable under ``key`` (its parent's key and its token
        ids confirm a hit). False, changing nothing, when caching is off, the block is already
        cached, or another block already holds this content (the first one stays the cached copy).
        ``pending``: a planned step is still to write it; the caller must :meth:`settle` it once that
        step's outcome is known (the module docstring's invariant). Without it, the content is written.

        Raises:
            LedgerError: the block is not referenced, or ``tokens`` is not one full block.
        """
        if not 0 <= block < self.num_blocks or self._refs[block] <= 0:
            raise LedgerError(f"block {block} registered but not allocated")
        if len(tokens) != self.block_size:
            raise LedgerError(f"block {block} registered with {len(tokens)} tokens, not {self.block_size}")
        if not self.prefix_caching or block in self._index or not self._index.insert(block, key, parent, tokens):
            return False
        if pending:
            self._writers[block] += 1
        return True

    def settle(self, blocks: Seq[int], written: bool) -> None:
        """The step that registered ``blocks`` as pending has ended; call after its reply came back
        (the fence: nothing writes them any more), once per step. ``written``: it succeeded, and they
        become findable by every reader; else they leave the cache (:meth:`forget`)."""
        for b in blocks:
            if self._writers[b] > 0:
                self._writers[b] -= 1
        if not written:
            self.forget(blocks)

    def forget(self, blocks: Seq[int]) -> None:
        """Drop ``blocks`` from the prefix cache (their content is not valid: the step that was to
        write them failed; a pending block leaves through :meth:`settle`, which calls this). An
        unreferenced one becomes clean."""
        for b in blocks:
            if not self.is_cached(b):
                continue
            self._index.remove(b)
            if self._refs[b] == 0:
                self._lru.remove(b)
                self._free.append(b)

    def check_holders(self, held: dict[int, int]) -> None:
        """Each block is referenced exactly as often as it is held (``held``: block → holders, e.g. the
        block tables of a device's sequences plus the blocks pinned by transfers), and no held block is
        free or reclaimable: no block owned twice, none both free and owned. Linear in the blocks held
        plus a few C-speed passes over the pool, so cheap enough after every step (the debug mode of
        ``node.runtime.block_pins``); :meth:`check` checks the cache's own invariants besides.

        Raises:
            LedgerError: the first discrepancy found.
        """
        refs = self._refs
        for b, n in held.items():
            if not 0 <= b < self.num_blocks:
                raise LedgerError(f"block {b} is held but not in the pool")
            if refs[b] != n:
                raise LedgerError(f"block {b} has refcount {refs[b]} but {n} holders")
            if self.prefix_caching and b in self._lru:  # (no LRU without it: its one slot is the sentinel)
                raise LedgerError(f"block {b} is held but reclaimable")
        total = sum(held.values())
        if sum(refs) != total:
            raise LedgerError(f"{sum(refs)} references but {total} holders: a block is referenced by nobody")
        free = set(self._free)
        if len(free) != len(self._free) or refs.count(0) != len(free) + len(self._lru):
            raise LedgerError(f"{refs.count(0)} unreferenced blocks, {len(self._free)} on the free list "
                              f"({len(free)} distinct) and {len(self._lru)} reclaimable")
        if not free.isdisjoint(held):
            raise LedgerError(f"blocks {sorted(free.intersection(held))[:8]} are held but free")

    def check(self) -> None:
        """Invariants (used in tests and when idle): every block is exactly one of referenced, free
        (clean) or reclaimable (cached, unreferenced); the cache index and block keys agree.

        Raises:
            LedgerError: the first invariant found broken.
        """
        free = set(self._free)
        if len(free) != len(self._free):
            raise LedgerError("a block is on the free list twice")
        for b, r in enumerate(self._refs):
            in_free, in_lru = b in free, self.prefix_caching and b in self._lru
            key = self._index.key(b) if self.prefix_caching else None
            if r < 0 or self._writers[b] < 0:
                raise LedgerError(f"block {b} has refcount {r}, {self._writers[b]} unsettled writers")
            if r > 0 and (in_free or in_lru):
                raise LedgerError(f"block {b} has refcount {r} but is free")
            if r == 0 and in_free + in_lru != 1:
                raise LedgerError(f"block {b} is unreferenced but free={in_free} reclaimable={in_lru}")
            if in_free and key is not None:
                raise LedgerError(f"block {b} is clean but cached")
            if in_lru and key is None:
                raise LedgerError(f"block {b} is reclaimable but not cached")
            if key is not None and self._index.find(key) != b:
                raise LedgerError(f"block {b} has a key the cache index does not map to it")
        if self.prefix_caching and not self._index.check():
            raise LedgerError("the cache index names a block that does not carry its key")
        if self.prefix_caching and len(self._lru) != sum(self._refs[b] == 0 for b in self._index.cached()):
            raise LedgerError("the reclaimable list and the unreferenced cached blocks differ")
