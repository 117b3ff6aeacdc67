"""The batcher's tight loop over running sequences (issue 31's decode fast path): the same plans as the
straightforward per-sequence loop it replaced, and no ledger or prefix-cache work for a decode step
whose sequences need no new block."""

import random

import pytest

from node.core.batcher import BatchConfig, Batcher, ScheduledSeq, StepKind, StepPlan
from node.core.ledger import BlockLedger
from node.core.sequence import SamplingParams, Sequence


class ReferenceBatcher(Batcher):
    """The running-sequence loops as they were before the fast path: every condition through the
    sequence's properties, ``_grow`` and ``_register`` called for every scheduled sequence."""

    def schedule(self, kind: StepKind, chunk_tokens: int | None = None) -> StepPlan:
        plan = StepPlan(kind)
        budget = self.config.max_batched_tokens
        if chunk_tokens is not None:
            budget = self._schedule_decodes(plan, budget)
            budget = min(budget, max(0, chunk_tokens))
        i = 0
        while i < len(self.running) and budget > 0 and len(plan.items) < self.config.max_num_seqs:
            seq = self.running[i]
            if (kind is StepKind.DECODE and not seq.is_decoding) or (kind is StepKind.PREFILL and seq.is_decoding) \
                    or (chunk_tokens is not None and seq.is_decoding) \
                    or (seq.is_decoding and len(seq.token_ids) >= seq.max_len):
                i += 1
                continue
            n = min(seq.num_uncomputed, budget, self.config.item_cap)
            if not self._grow(seq, n, plan):
                continue
            plan.items.append(ScheduledSeq(seq, n))
            self._register(seq, seq.num_computed + n, plan)
            budget -= n
            i += 1
        if kind is not StepKind.DECODE and not plan.preempted:
            self._admit(plan, budget)
        return plan

    def _schedule_decodes(self, plan: StepPlan, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0 and len(plan.items) < self.config.max_num_seqs:
            seq = self.running[i]
            if not seq.is_decoding or len(seq.token_ids) >= seq.max_len:
                i += 1
                continue
            if not self._grow(seq, 1, plan):
                continue
            plan.items.append(ScheduledSeq(seq, 1))
            self._register(seq, seq.num_computed + 1, plan)
            budget -= 1
            i += 1
        return budget


def _workload(cls, seed: int) -> list[tuple]:
    """A random run (arrivals with shared prefixes, steps of every kind with and without a chunk
    budget, finishes, a small pool so preemption happens); each step's plan as plain data."""
    rng = random.Random(seed)
    b = cls(BlockLedger(40, 4, prefix_caching=True),
            BatchConfig(max_num_seqs=rng.choice([3, 8]), max_batched_tokens=rng.choice([8, 24, 64]),
                        chunked_prefill=rng.random() < 0.8, watermark_blocks=rng.choice([0, 2])))
    out, n = [], 0
    for _step in range(120):
        if rng.random() < 0.3:
            prompt = [1, 2, 3, 4, 5, 6, 7, 8][: rng.randint(0, 8)] + [rng.randint(10, 99) for _ in range(rng.randint(1, 20))]
            b.add(Sequence(f"s{n}", f"r{n}", 0, float(n), prompt, SamplingParams(max_tokens=rng.randint(1, 30)), 48))
            n += 1
        kind = rng.choice(list(StepKind))
        chunk = rng.choice([None, 0, 5]) if kind is StepKind.MIXED else None
        if not b.has_work(kind):
            continue
        plan = b.schedule(kind, chunk)
        out.append((kind, chunk, [(it.seq.seq_id, it.num_tokens) for it in plan.items],
                    [s.seq_id for s in plan.preempted], list(plan.registered)))
        sampled = [it.seq for it in plan.items if it.samples]
        b.commit(plan)
        b.settle(plan)  # the step ran
        for s in sampled:
            s.token_ids.append(rng.randint(10, 99))
            if s.num_output >= s.params.max_tokens or len(s.token_ids) >= s.max_len:
                b.remove(s)
        b.ledger.check()
    return out


def test_tight_loop_plans_as_the_per_sequence_loop():
    for seed in range(40):
        assert _workload(Batcher, seed) == _workload(ReferenceBatcher, seed), seed


@pytest.mark.quick
def test_decode_step_within_blocks_touches_neither_ledger_nor_cache():
    b = Batcher(BlockLedger(100, 16, prefix_caching=True), BatchConfig(max_num_seqs=8))
    for i in range(4):
        b.add(Sequence(f"s{i}", f"r{i}", 0, float(i), list(range(i, i + 20)), SamplingParams(max_tokens=50), 4096))
    plan = b.schedule(StepKind.MIXED)  # the prompts: 20 tokens each, in 2 blocks of 16
    b.commit(plan)
    for it in plan.items:
        it.seq.token_ids.append(7)
    calls = []
    grow, register = b._grow, b._register

    def counted(name, fn):
        def call(*a):
            calls.append(name)
            return fn(*a)
        return call

    b._grow = counted("grow", grow)  # type: ignore[method-assign]
    b._register = counted("register", register)  # type: ignore[method-assign]
    plan = b.schedule(StepKind.DECODE)  # token 21 of each: inside the second block, which holds 16..31
    assert [(it.seq.seq_id, it.num_tokens) for it in plan.items] == [("s0", 1), ("s1", 1), ("s2", 1), ("s3", 1)]
    assert calls == []
