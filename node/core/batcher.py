"""Iteration-level (continuous) batching for one device, on top of its block ledger.

Each call to :meth:`Batcher.schedule` forms one step: running sequences first (decode tokens, or the
next chunk of a prompt), then waiting prompts in arrival order while the step's token budget, the
sequence cap and free blocks allow. The step kind restricts what may run, which is how a device's
*role* becomes an execution configuration:

* ``MIXED`` — chunked prefill mixed with decode under one token budget (the colocated baseline; the
  scheme of Sarathi-Serve, Agrawal et al. 2024, and vLLM's default).
* ``PREFILL`` — prompt (chunks) only, under the prefill token budget; resident decoders wait.
* ``DECODE`` — one token per resident decoding sequence; no prompt work.

When a sequence needs a block and none is free, the newest running sequence is preempted: its
blocks are freed and it is recomputed later from its prompt plus its output so far (vLLM's
recompute preemption), so it never loses tokens and never fails for lack of memory. A sequence whose
grammar is not ready on the device's engine (``Sequence.grammar_wait``) is left out of steps meanwhile.

Prefix caching (the ledger's cache): a waiting sequence is admitted with its block table starting
with the cached blocks of its longest cached prefix of full blocks, and ``num_computed`` at their
tokens, so only the rest is computed. At most ``len(token_ids) - 1`` tokens are taken from the cache:
the last one is always computed, since its logits give the next token (vLLM's rule). Sequences that
want prompt logprobs compute their whole prompt. Every block that a planned step fills is registered
in the cache at once, so a sequence admitted later in the same step reuses it (the step writes it
before it reads it). Such blocks are *pending* (:mod:`node.core.ledger`) until the step's reply came
back: :meth:`Batcher.settle` (it ran) or :meth:`Batcher.discard` (it failed), once per step.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import msgspec

from node.core.ledger import BlockLedger, salt_root
from node.core.sequence import Sequence, SeqStatus


class StepKind(enum.Enum):
    MIXED = "mixed"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class BatchConfig:
    """Limits of one step.

    Attributes:
        max_num_seqs: resident (running) sequences at most, hence also sequences per step.
        max_batched_tokens: new tokens per step (the chunked-prefill token budget).
        chunked_prefill: split a prompt over steps when it exceeds the remaining budget.
        watermark_blocks: free blocks kept back when admitting a new prompt, so running sequences
            can grow without immediate preemption.
        max_item_tokens: new tokens per *sequence* per step (None: the step budget). A group that
            prefills as several model instances in one step (time-shared prefill at a degree below
            the decode degree, :mod:`node.core.role_config`) sets it to one instance's budget, so a
            long prompt cannot take every instance's share and the others get whole items.
    """

    max_num_seqs: int = 256
    max_batched_tokens: int = 2048
    chunked_prefill: bool = True
    watermark_blocks: int = 0
    max_item_tokens: int | None = None

    @property
    def item_cap(self) -> int:
        """Most new tokens one sequence may compute in a step."""
        cap = self.max_item_tokens
        return self.max_batched_tokens if cap is None else min(cap, self.max_batched_tokens)


class ScheduledSeq(msgspec.Struct, gc=False):
    """One sequence of a step: a struct made in C (a fifth of a dataclass's cost; untracked by the GC)."""

    seq: Sequence
    num_tokens: int  # new tokens computed this step: token_ids[num_computed : num_computed + num_tokens] + draft
    draft: tuple[int, ...] | list[int] = ()  # speculative tokens verified after the last one (node.core.spec_plan)

    @property
    def samples(self) -> bool:
        """The step reaches the end of the known tokens, so it samples the next one."""
        return self.seq.num_computed + self.num_tokens - len(self.draft) == len(self.seq.token_ids)


@dataclass
class StepPlan:
    kind: StepKind
    items: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    registered: list[int] = field(default_factory=list)  # blocks this step fills, cached as it was planned

    @property
    def num_tokens(self) -> int:
        return sum(i.num_tokens for i in self.items)

    def __bool__(self) -> bool:
        return bool(self.items)


@dataclass(frozen=True)
class PrefillQueue:
    """A device's queued prompt work: prompt tokens still to compute, sequences, the oldest arrival
    (s, ``None`` when empty), and ``runnable``: a PREFILL step could make progress on it now."""

    tokens: int
    seqs: int
    oldest_arrival_s: float | None
    runnable: bool


class Batcher:
    """Waiting and running sequences of one device, and the step former."""

    def __init__(self, ledger: BlockLedger, config: BatchConfig):
        self.ledger = ledger
        self.config = config
        self.waiting: list[Sequence] = []  # arrival order
        self.running: list[Sequence] = []  # arrival order
        self.num_preemptions = 0
        self.prefix_query_tokens = 0  # tokens of admitted sequences looked up in the prefix cache
        self.prefix_hit_tokens = 0  # of which found cached (not computed)

    # --- membership -------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self._insert_waiting(seq)

    def adopt(self, seq: Sequence) -> None:
        """Take a sequence whose KV blocks are already in this device's ledger (a migration)."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        self.running.sort(key=Sequence.sort_key)

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence (finished, aborted or migrated away) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.ledger.free(seq.block_ids)
        seq.block_ids = []
        seq.status = SeqStatus.FINISHED

    def release(self, seq: Sequence) -> list[int]:
        """Detach a running sequence without freeing its blocks (the caller now owns them; they stay
        referenced, so no eviction can take them, until the caller frees them)."""
        self.running.remove(seq)
        blocks, seq.block_ids = seq.block_ids, []
        seq.num_registered = 0  # its next block table is registered afresh where it lands
        return blocks

    @property
    def num_decoding(self) -> int:
        return sum(1 for s in self.running if s.is_decoding)

    def prefill_queue(self) -> "PrefillQueue":
        """The device's queued prompt work (waiting sequences and running partial prefills): tokens,
        sequences, the oldest arrival, and whether a PREFILL step could run it now."""
        tokens = seqs = 0
        oldest = None
        for s in self.running + self.waiting:
            if s.is_decoding:
                continue
            tokens += s.num_uncomputed
            seqs += 1
            oldest = s.arrival_s if oldest is None else min(oldest, s.arrival_s)
        return PrefillQueue(tokens, seqs, oldest, seqs > 0 and self.prefill_runnable())

    def prefill_runnable(self) -> bool:
        """Whether PREFILL steps could now take the queue head's prompt work to its end.

        Admitting a chunk is not enough: a partial prefill that cannot grow preempts the newest
        running sequence, itself included, and one preempted again and again computes forever while
        the decoding residents, which hold the blocks, never run (a PREFILL step decodes nothing).
        So the head's whole remaining prefill must fit the free blocks, or, for a running partial
        prefill, it must have a newer running sequence to preempt. The waiting head also needs a
        sequence slot. (A prefix-cache hit may need fewer blocks than counted: the estimate errs
        towards ending a window early, never towards one that cannot end.)
        """
        for s in self.running:
            if s.is_decoding:
                continue
            need = self.ledger.blocks_for(len(s.token_ids)) - len(s.block_ids)
            return need <= self.ledger.num_free or self.running[-1] is not s
        if not self.waiting or len(self.running) >= self.config.max_num_seqs:
            return False
        s = self.waiting[0]
        if not self.config.chunked_prefill and s.num_uncomputed > self.config.item_cap:
            return False
        need = self.ledger.blocks_for(len(s.token_ids)) - len(s.block_ids)
        keep = self.config.watermark_blocks if self.running else 0
        return need + keep <= self.ledger.num_free

    def has_work(self, kind: StepKind) -> bool:
        if kind is StepKind.DECODE:
            return any(s.is_decoding for s in self.running)
        if kind is StepKind.PREFILL:
            return bool(self.waiting) or any(not s.is_decoding for s in self.running)
        return bool(self.waiting or self.running)

    # --- scheduling -------------------------------------------------------------------------
    def schedule(self, kind: StepKind, chunk_tokens: int | None = None) -> StepPlan:
        """Form the next step of ``kind``. Mutates block tables (allocation) and queues (preemption).

        ``chunk_tokens`` (MIXED steps): prompt tokens the step may compute at most, on top of one token
        per decoding sequence (the adaptive policy's online chunk budget; stall-free batching: decodes
        are planned first, so a prompt chunk never takes a decoding sequence's place). None: prompt
        work takes what the token budget leaves, in arrival order (colocated mode).
        """
        plan = StepPlan(kind)
        budget = self.config.max_batched_tokens
        if chunk_tokens is not None:
            budget = self._schedule_running(plan, budget, decodes=True, prompts=False)
            budget = min(budget, max(0, chunk_tokens))
            budget = self._schedule_running(plan, budget, decodes=False, prompts=kind is not StepKind.DECODE)
        else:
            budget = self._schedule_running(plan, budget, decodes=kind is not StepKind.PREFILL,
                                            prompts=kind is not StepKind.DECODE)
        if kind is not StepKind.DECODE and not plan.preempted:
            self._admit(plan, budget)
        return plan

    def _schedule_running(self, plan: StepPlan, budget: int, decodes: bool, prompts: bool) -> int:
        """Plan running sequences in arrival order within the step's limits: one token for each decoding
        one (``decodes``) and the next chunk of each partial prefill (``prompts``); the budget left.

        The hot path of a decode step at many streams: per sequence it only tests whether the sequence
        decodes, whether its next token needs a new block, and whether it completes a block for the
        prefix cache, with ``is_decoding``, ``_grow`` and ``_register`` inlined as those tests (the
        calls run only when a block is needed or filled), so an unchanged decode batch costs a few
        attribute reads per sequence."""
        running = self.running
        max_seqs = self.config.max_num_seqs
        cap = self.config.item_cap
        bs = self.ledger.block_size
        caching = self.ledger.prefix_caching
        items = plan.items
        i = 0
        while i < len(running) and budget > 0 and len(items) < max_seqs:
            seq = running[i]
            ntok = len(seq.token_ids)
            done = seq.num_computed
            if ntok - done == 1 and ntok > seq.prompt_len:  # seq.is_decoding
                if not decodes or ntok >= seq.max_len or seq.grammar_wait:  # ends, or its grammar is not ready
                    i += 1
                    continue
                n = 1
            elif not prompts or seq.grammar_wait:
                i += 1
                continue
            else:
                n = min(ntok - done, budget, cap)
            if -(-(done + n) // bs) > len(seq.block_ids):  # needs a block (ledger.blocks_for)
                grown = self._grow(seq, n, plan)
                items = plan.items  # a preemption rebuilds the list
                if not grown:
                    continue  # seq itself was preempted; running[i] is now the next one
            items.append(ScheduledSeq(seq, n))
            if caching and (done + n) // bs > seq.num_registered:  # may fill a block: offer it to the cache
                self._register(seq, done + n, plan)
            budget -= n
            i += 1
        return budget

    def _grow(self, seq: Sequence, n: int, plan: StepPlan) -> bool:
        """Ensure blocks for ``seq.num_computed + n`` tokens, preempting the newest others if needed."""
        need = self.ledger.blocks_for(seq.num_computed + n) - len(seq.block_ids)
        while need > 0:
            got = self.ledger.allocate(need)
            if got is not None:
                seq.block_ids.extend(got)
                return True
            victim = self.running[-1]
            self.preempt(victim, plan)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence, plan: StepPlan) -> None:
        """Take running ``seq`` out of ``plan`` and back to waiting, its blocks freed (recomputed later)."""
        self.running.remove(seq)
        plan.items = [it for it in plan.items if it.seq is not seq]
        self.ledger.free(seq.block_ids)  # its cached blocks stay findable: the recompute may reuse them
        seq.block_ids, seq.num_computed, seq.num_registered = [], 0, 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self._insert_waiting(seq)
        plan.preempted.append(seq)

    def _admit(self, plan: StepPlan, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = next((s for s in self.waiting if not s.grammar_wait), None)  # ready ones, in queue order
            if seq is None:
                break
            adm = self._admission(seq, budget)
            if adm is None:
                break
            hits, n, new = adm
            got = self.ledger.take(hits, new)
            if got is None:
                break
            cached = len(hits) * self.ledger.block_size
            if self._may_reuse(seq):
                self.prefix_query_tokens += len(seq.token_ids)
                self.prefix_hit_tokens += cached
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = min(cached, seq.prompt_len)
            if hits:  # the block table starts with the cached blocks, already registered
                seq.num_registered = len(hits)
            seq.block_ids.extend(hits + got)
            seq.num_computed += cached
            self.waiting.remove(seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            plan.items.append(ScheduledSeq(seq, n))
            self._register(seq, seq.num_computed + n, plan)
            budget -= n

    # --- prefix cache -----------------------------------------------------------------------
    def _may_reuse(self, seq: Sequence) -> bool:
        """A waiting sequence may start from cached blocks: caching is on, it holds no blocks yet, and
        it does not want prompt logprobs (they need every prompt position's logits)."""
        return (self.ledger.prefix_caching and not seq.block_ids and seq.num_computed == 0
                and seq.params.prompt_logprobs is None)

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks a waiting ``seq`` would start from (its longest cached prefix of full blocks,
        short of its last token); changes nothing."""
        if not self._may_reuse(seq):
            return []
        # pending blocks too: they are this device's own steps' (the ledger's fence invariant)
        return self.ledger.match(seq.token_ids, len(seq.token_ids) - 1, seq.block_keys, True, salt_root(seq.params.cache_salt))

    def _admission(self, seq: Sequence, budget: int) -> tuple[list[int], int, int] | None:
        """How the waiting head ``seq`` would start this step: (cached blocks it reuses, tokens it
        computes, blocks it allocates), or ``None`` when it cannot (budget, blocks or watermark).

        With its cached prefix first; if that does not fit the free blocks (reusing reclaimable blocks
        consumes free ones too), without it, so the cache never admits less than no cache would.
        """
        first = self.cached_prefix(seq)
        for hits in ([first, []] if first else [first]):
            cached = len(hits) * self.ledger.block_size
            n = seq.num_uncomputed - cached
            cap = min(budget, self.config.item_cap)
            if n > cap:
                if not self.config.chunked_prefill:
                    continue
                n = cap
            new = self.ledger.blocks_for(seq.num_computed + cached + n) - len(seq.block_ids) - len(hits)
            cost = new + self.ledger.reuse_cost(hits)
            keep = self.config.watermark_blocks if self.running else 0
            if cost + keep <= self.ledger.num_free:
                return hits, n, new
        return None

    def _register(self, seq: Sequence, upto_tokens: int, plan: StepPlan) -> None:
        """Offer ``seq``'s full blocks within its first ``upto_tokens`` tokens (computed, or computed by
        this step) to the prefix cache."""
        if not self.ledger.prefix_caching:
            return
        bs = self.ledger.block_size
        upto_tokens = min(upto_tokens, len(seq.token_ids) - seq.num_pending)  # a placeholder is not content
        full = min(upto_tokens // bs, len(seq.block_ids))
        if seq.num_registered >= full:
            return
        keys = self.ledger.keys(seq.token_ids, full, seq.block_keys, root := salt_root(seq.params.cache_salt))
        for i in range(seq.num_registered, full):
            b = seq.block_ids[i]
            if self.ledger.register(b, keys[i], keys[i - 1] if i else root, seq.token_ids[i * bs : (i + 1) * bs],
                                    pending=True):
                plan.registered.append(b)
        seq.num_registered = full

    def settle(self, plan: StepPlan) -> None:
        """The step of ``plan`` ran (its reply came back): the blocks it filled are written, findable
        by moves and peers too (:meth:`BlockLedger.settle`)."""
        self.ledger.settle(plan.registered, written=True)
        plan.registered = []

    def discard(self, plan: StepPlan) -> None:
        """The step of ``plan`` failed (its reply came back with an error): the blocks it was to fill
        leave the prefix cache (their content was never written). Call before freeing the step's
        sequences."""
        self.ledger.settle(plan.registered, written=False)
        plan.registered = []

    def commit(self, plan: StepPlan) -> None:
        """Advance ``num_computed`` for every scheduled sequence after its step ran (drafts: node.core.spec_plan)."""
        for it in plan.items:
            it.seq.num_computed += it.num_tokens - len(it.draft)

    def _insert_waiting(self, seq: Sequence) -> None:
        key, pos = seq.sort_key(), len(self.waiting)
        while pos > 0 and self.waiting[pos - 1].sort_key() > key:
            pos -= 1
        self.waiting.insert(pos, seq)
