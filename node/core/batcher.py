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
recompute preemption), so it never loses tokens and never fails for lack of memory.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from node.core.ledger import BlockLedger
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
    """

    max_num_seqs: int = 256
    max_batched_tokens: int = 2048
    chunked_prefill: bool = True
    watermark_blocks: int = 0


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # new tokens computed this step: token_ids[num_computed : num_computed + num_tokens]

    @property
    def samples(self) -> bool:
        """The step reaches the end of the known tokens, so it samples the next one."""
        return self.seq.num_computed + self.num_tokens == len(self.seq.token_ids)


@dataclass
class StepPlan:
    kind: StepKind
    items: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(i.num_tokens for i in self.items)

    def __bool__(self) -> bool:
        return bool(self.items)


class Batcher:
    """Waiting and running sequences of one device, and the step former."""

    def __init__(self, ledger: BlockLedger, config: BatchConfig):
        self.ledger = ledger
        self.config = config
        self.waiting: list[Sequence] = []  # arrival order
        self.running: list[Sequence] = []  # arrival order
        self.num_preemptions = 0

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
        """Detach a running sequence without freeing its blocks (the caller now owns them)."""
        self.running.remove(seq)
        blocks, seq.block_ids = seq.block_ids, []
        return blocks

    @property
    def num_decoding(self) -> int:
        return sum(1 for s in self.running if s.is_decoding)

    def has_work(self, kind: StepKind) -> bool:
        if kind is StepKind.DECODE:
            return any(s.is_decoding for s in self.running)
        if kind is StepKind.PREFILL:
            return bool(self.waiting) or any(not s.is_decoding for s in self.running)
        return bool(self.waiting or self.running)

    # --- scheduling -------------------------------------------------------------------------
    def schedule(self, kind: StepKind) -> StepPlan:
        """Form the next step of ``kind``. Mutates block tables (allocation) and queues (preemption)."""
        plan = StepPlan(kind)
        budget = self.config.max_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0 and len(plan.items) < self.config.max_num_seqs:
            seq = self.running[i]
            if (kind is StepKind.DECODE and not seq.is_decoding) or (kind is StepKind.PREFILL and seq.is_decoding):
                i += 1
                continue
            n = min(seq.num_uncomputed, budget)
            if not self._grow(seq, n, plan):
                continue  # seq itself was preempted; running[i] is now the next one
            plan.items.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1
        if kind is not StepKind.DECODE and not plan.preempted:
            self._admit(plan, budget)
        return plan

    def _grow(self, seq: Sequence, n: int, plan: StepPlan) -> bool:
        """Ensure blocks for ``seq.num_computed + n`` tokens, preempting the newest others if needed."""
        need = self.ledger.blocks_for(seq.num_computed + n) - len(seq.block_ids)
        while need > 0:
            got = self.ledger.allocate(need)
            if got is not None:
                seq.block_ids.extend(got)
                return True
            victim = self.running[-1]
            self._preempt(victim, plan)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        self.running.remove(seq)
        plan.items = [it for it in plan.items if it.seq is not seq]
        self.ledger.free(seq.block_ids)
        seq.block_ids = []
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self._insert_waiting(seq)
        plan.preempted.append(seq)

    def _admit(self, plan: StepPlan, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            n = seq.num_uncomputed
            if n > budget:
                if not self.config.chunked_prefill:
                    break
                n = budget
            need = self.ledger.blocks_for(seq.num_computed + n) - len(seq.block_ids)
            if self.ledger.num_free - need < self.config.watermark_blocks and self.running:
                break
            got = self.ledger.allocate(need)
            if got is None:
                break
            seq.block_ids.extend(got)
            self.waiting.pop(0)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            plan.items.append(ScheduledSeq(seq, n))
            budget -= n

    def commit(self, plan: StepPlan) -> None:
        """Advance ``num_computed`` for every scheduled sequence after its step ran."""
        for it in plan.items:
            it.seq.num_computed += it.num_tokens

    def _insert_waiting(self, seq: Sequence) -> None:
        key = seq.sort_key()
        pos = len(self.waiting)
        while pos > 0 and self.waiting[pos - 1].sort_key() > key:
            pos -= 1
        self.waiting.insert(pos, seq)
