"""The block ledger and the batch former, on plain data (no torch, no model)."""

import pytest

from node.core.batcher import BatchConfig, Batcher, StepKind
from node.core.ledger import BlockLedger, LedgerError
from node.core.sequence import SamplingParams, Sequence

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here


def seq(i: int, prompt_len: int, max_tokens: int = 100) -> Sequence:
    return Sequence(f"s{i}", f"r{i}", 0, float(i), list(range(prompt_len)), SamplingParams(max_tokens=max_tokens), 4096)


def run_step(b: Batcher, kind: StepKind) -> dict[str, int]:
    """Schedule, commit, and append a token to every sampling sequence; return tokens per seq id."""
    plan = b.schedule(kind)
    sampled = [it.seq for it in plan.items if it.samples]
    b.commit(plan)
    for s in sampled:
        s.token_ids.append(7)
    return {it.seq.seq_id: it.num_tokens for it in plan.items}


def test_ledger_check_then_commit():
    led = BlockLedger(4, 16)
    a = led.allocate(3)
    assert a is not None and led.num_free == 1
    assert led.allocate(2) is None and led.num_free == 1  # nothing taken on failure
    led.free(a)
    led.check()
    with pytest.raises(LedgerError):
        led.free([a[0]])
    assert led.blocks_for(0) == 0 and led.blocks_for(16) == 1 and led.blocks_for(17) == 2


def test_mixed_chunked_prefill_respects_budget():
    b = Batcher(BlockLedger(100, 16), BatchConfig(max_batched_tokens=32))
    b.add(seq(0, 50))
    b.add(seq(1, 10))
    assert run_step(b, StepKind.MIXED) == {"s0": 32}
    assert run_step(b, StepKind.MIXED) == {"s0": 18, "s1": 10}
    assert run_step(b, StepKind.MIXED) == {"s0": 1, "s1": 1}  # both decode now
    assert [s.num_output for s in b.running] == [2, 2]


def test_roles_restrict_step_kind():
    b = Batcher(BlockLedger(100, 16), BatchConfig(max_batched_tokens=64))
    b.add(seq(0, 20))
    run_step(b, StepKind.PREFILL)
    b.add(seq(1, 20))
    assert run_step(b, StepKind.DECODE) == {"s0": 1}  # no prompt work in the decode role
    assert run_step(b, StepKind.PREFILL) == {"s1": 20}  # no decode work in the prefill role
    assert not b.has_work(StepKind.PREFILL) and b.has_work(StepKind.DECODE)


def test_preemption_recomputes_newest_and_frees_blocks():
    led = BlockLedger(4, 4)  # 16 tokens in all
    b = Batcher(led, BatchConfig(max_batched_tokens=64))
    b.add(seq(0, 7))
    b.add(seq(1, 7))
    run_step(b, StepKind.MIXED)  # each holds 2 blocks (8 slots); 8 tokens after sampling
    run_step(b, StepKind.MIXED)  # decode token 8 of each fits in the 2 blocks
    plan = b.schedule(StepKind.MIXED)  # token 9 of each needs a third block: none free
    assert [s.seq_id for s in plan.preempted] == ["s1"]
    assert [it.seq.seq_id for it in plan.items] == ["s0"]
    preempted = plan.preempted[0]
    assert preempted.num_computed == 0 and preempted.block_ids == [] and b.waiting == [preempted]
    assert len(preempted.token_ids) == 9  # its output is kept and will be recomputed
    led.check()


def test_waiting_is_fcfs_and_head_of_line_blocks():
    b = Batcher(BlockLedger(3, 16), BatchConfig(max_batched_tokens=1000, chunked_prefill=False))
    b.add(seq(2, 40))
    b.add(seq(1, 40))  # earlier arrival goes first
    assert [s.seq_id for s in b.waiting] == ["s1", "s2"]
    assert run_step(b, StepKind.MIXED) == {"s1": 40}
    assert [s.seq_id for s in b.waiting] == ["s2"]  # not enough blocks left: waits


def test_remove_frees_everything():
    led = BlockLedger(10, 16)
    b = Batcher(led, BatchConfig())
    s = seq(0, 40)
    b.add(s)
    run_step(b, StepKind.MIXED)
    assert led.num_used == 3
    b.remove(s)
    assert led.num_free == 10 and not b.running


def test_a_sequence_waiting_for_its_grammar_is_left_out_of_steps_and_the_others_go_on():
    """``Sequence.grammar_wait`` (its engine still compiles its grammar: node.runtime.grammar_gate): a held
    running sequence is not decoded, a held waiting one is not admitted, and the others pass it by."""
    b = Batcher(BlockLedger(100, 16), BatchConfig(max_batched_tokens=1000))
    a, c = seq(0, 20), seq(1, 20)
    b.add(a)
    b.add(c)
    a.grammar_wait = True  # the queue's head waits
    assert run_step(b, StepKind.MIXED) == {"s1": 20}
    assert b.waiting == [a] and b.running == [c]
    a.grammar_wait = False
    c.grammar_wait = True  # now the decoding one waits
    assert run_step(b, StepKind.MIXED) == {"s0": 20}
    assert run_step(b, StepKind.DECODE) == {"s0": 1}
    c.grammar_wait = False
    assert run_step(b, StepKind.DECODE) == {"s0": 1, "s1": 1}
