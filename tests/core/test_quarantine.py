"""Suspects of an engine death are recomputed alone (issue 45 item 4), on plain data."""

import pytest

from node.core.batcher import BatchConfig, Batcher, StepKind
from node.core.ledger import BlockLedger
from node.core.quarantine import Quarantine
from node.core.sequence import SamplingParams, Sequence

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here


def seq(i: int, prompt_len: int) -> Sequence:
    return Sequence(f"s{i}", f"r{i}", 0, float(i), list(range(prompt_len)), SamplingParams(max_tokens=100), 4096)


def step(q: Quarantine, b: Batcher, kind: StepKind = StepKind.MIXED, settle: bool = True):
    """Plan one step through the quarantine, commit it, sample a token for each sampling item, and
    (``settle``) report it back; return the plan."""
    plan = q.schedule(b, kind)
    sampled = [it.seq for it in plan.items if it.samples]
    b.commit(plan)
    for s in sampled:
        s.token_ids.append(7)
    if settle:
        b.settle(plan)
        q.settled(plan)
    return plan


def ids(plan) -> dict[str, int]:
    return {it.seq.seq_id: it.num_tokens for it in plan.items}


def test_a_suspect_runs_alone_until_its_step_is_back_then_everyone_runs():
    b = Batcher(BlockLedger(100, 4), BatchConfig(max_batched_tokens=8))
    q = Quarantine()
    by, sus, later = seq(0, 6), seq(1, 12), seq(2, 3)
    b.add(by)
    step(q, b)  # the bystander is prefilled (6 of its 8-token budget... all of it)
    b.add(sus)
    q.add(sus, 12)  # it died in the step that computed its tokens up to 12
    b.add(later)
    assert ids(step(q, b)) == {"s1": 8}  # alone: the bystander's decode and the later prompt wait
    out = step(q, b, settle=False)
    assert ids(out) == {"s1": 4} and q.ran_alone(out)  # alone again: its mark; not back yet
    assert ids(step(q, b, settle=False)) == {}  # nothing is planned while its last quarantine step is out
    b.settle(out)
    q.settled(out)
    assert ids(step(q, b)) == {"s0": 1, "s1": 1, "s2": 3} and len(q) == 0  # back: quarantine over
    assert not q.ran_alone(out)


def test_decode_steps_go_on_and_suspects_go_one_at_a_time():
    b = Batcher(BlockLedger(100, 4), BatchConfig(max_batched_tokens=64))
    q = Quarantine()
    by, s1, s2 = seq(0, 5), seq(1, 5), seq(2, 5)
    b.add(by)
    step(q, b, StepKind.PREFILL)
    for s in (s1, s2):
        b.add(s)
        q.add(s, 5)
    assert ids(step(q, b, StepKind.DECODE)) == {"s0": 1}  # a decode step has no suspect in it
    assert ids(step(q, b, StepKind.PREFILL)) == {"s1": 5}
    assert ids(step(q, b, StepKind.PREFILL)) == {"s2": 5}
    assert ids(step(q, b, StepKind.MIXED)) == {"s0": 1, "s1": 1, "s2": 1}


def test_others_holding_the_blocks_are_preempted_for_the_suspect():
    led = BlockLedger(4, 4)  # 16 tokens in all
    b = Batcher(led, BatchConfig(max_batched_tokens=64))
    q = Quarantine()
    by = seq(0, 11)  # 3 blocks
    b.add(by)
    step(q, b)
    sus = seq(1, 6)  # needs 2 blocks: only 1 is free
    b.add(sus)
    q.add(sus, 6)
    plan = step(q, b)
    assert ids(plan) == {"s1": 6} and plan.preempted == [by]
    assert by in b.waiting and by.block_ids == [] and sus in b.running
    assert ids(step(q, b)) == {"s1": 1} and len(q) == 0  # quarantine over (the bystander waits for room)
    b.remove(sus)
    assert ids(step(q, b)) == {"s0": 12}  # recomputed: its prompt and the token it had sampled
    led.check()


def test_a_suspect_that_left_ends_its_quarantine():
    b = Batcher(BlockLedger(100, 4), BatchConfig(max_batched_tokens=64))
    q = Quarantine()
    by, sus = seq(0, 5), seq(1, 5)
    b.add(by)
    b.add(sus)
    q.add(sus, 5)
    b.remove(sus)  # its client left
    assert ids(step(q, b)) == {"s0": 5} and len(q) == 0
