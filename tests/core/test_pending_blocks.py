"""Blocks registered by a step still in flight (*pending*) are never handed to a sequence arriving
from elsewhere (a move, a peer hand-off), so a failed step cannot leave such a sequence reading KV
nobody wrote (issue 33, item 3); and a failed step's blocks leak nowhere (pure, no model).

The fake pool of ``test_prefix_cache`` stands in for the tensors: slots hold token ids, ``None``
where nothing was written.
"""

from __future__ import annotations

from node.core.batcher import StepKind
from node.core.ledger import BlockLedger, block_key
import pytest
from tests.core.test_prefix_cache import B, FakePool, batcher, seq

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here


def write(pool: FakePool, blocks: list[int], tokens: list[int], start: int, end: int) -> None:
    for p in range(start, end):
        pool.slots[blocks[p // B]][p % B] = tokens[p]


def unwritten_reads(pool: FakePool, blocks: list[int], tokens: list[int], upto: int) -> list[int]:
    """Positions below ``upto`` whose slot does not hold the sequence's token (what attention would read)."""
    return [p for p in range(upto) if pool.slots[blocks[p // B]][p % B] != tokens[p]]


def arriving(prefix: list[int]) -> tuple[list[int], int, int]:
    """A decoding sequence from another device: its tokens, computed tokens, blocks it needs here."""
    tokens = prefix + [901, 902, 903]
    computed = len(tokens) - 1
    return tokens, computed, -(-(computed + 1) // B)


def test_a_move_never_reuses_blocks_of_a_step_in_flight_that_then_fails():
    b, pool = batcher(num_blocks=16)
    prompt = list(range(500, 500 + 2 * B + 1))
    a = seq("a", prompt)
    b.add(a)
    plan = b.schedule(StepKind.PREFILL)  # sent, not come back: its two full blocks are registered, pending
    b.commit(plan)
    assert len(plan.registered) == 2 and all(b.ledger.is_pending(x) for x in plan.registered)
    tokens, computed, need = arriving(prompt[: 2 * B])
    got = b.ledger.reserve(tokens, computed, need)  # what DeviceEngine.reserve_for does for a move or a peer
    assert got is not None
    blocks, reused = got
    write(pool, blocks, tokens, reused * B, computed)  # the copy sends every block not reused
    b.discard(plan)  # the step failed: it wrote nothing
    b.remove(a)  # its request fails with it
    assert unwritten_reads(pool, blocks, tokens, computed) == []  # the moved sequence reads only written KV
    assert reused == 0 and not set(blocks) & set(plan.registered)
    b.ledger.free(blocks)  # the moved sequence ends
    b.ledger.check()
    assert b.ledger.num_used == 0 and b.ledger.match(prompt, 2 * B, pending=True) == []


def test_once_its_step_came_back_a_move_reuses_the_blocks_it_wrote():
    b, pool = batcher(num_blocks=16)
    prompt = list(range(600, 600 + 2 * B + 1))
    a = seq("a", prompt)
    b.add(a)
    pool.run(b, StepKind.PREFILL)  # ran and settled
    tokens, computed, need = arriving(prompt[: 2 * B])
    blocks, reused = b.ledger.reserve(tokens, computed, need)
    assert reused == 2 and blocks[:2] == a.block_ids[:2]
    write(pool, blocks, tokens, reused * B, computed)
    assert unwritten_reads(pool, blocks, tokens, computed) == []
    b.ledger.free(blocks)
    b.remove(a)
    b.ledger.check()
    assert b.ledger.num_used == 0


def test_the_devices_own_next_step_shares_a_pending_block_and_fails_with_it():
    """The planner of the same pipeline may match a pending block (its step runs after the writer,
    and fails with it); after the failure nothing is findable and nothing stays referenced."""
    b, _ = batcher(num_blocks=16)
    prompt = list(range(700, 700 + 2 * B + 1))
    a = seq("a", prompt)
    b.add(a)
    first = b.schedule(StepKind.PREFILL)
    b.commit(first)
    c = seq("c", prompt[: 2 * B] + [42], arrival=1.0)
    b.add(c)
    second = b.schedule(StepKind.PREFILL)  # planned while the first is in flight
    b.commit(second)
    assert c.block_ids[:2] == a.block_ids[:2] and c.num_cached_tokens == 2 * B
    for plan in (first, second):  # the first fails, and the second with it (DeviceEngine._complete)
        b.discard(plan)
    b.remove(a)
    b.remove(c)
    b.ledger.check()
    assert b.ledger.num_used == 0 and b.ledger.num_cached == 0


def test_an_evicted_pending_block_registered_again_stays_pending_until_its_new_step_settles():
    led = BlockLedger(1, B, prefix_caching=True)
    old, new = [1, 2, 3, 4], [5, 6, 7, 8]
    (x,) = led.allocate(1)
    led.register(x, block_key(None, old), None, old, pending=True)  # step 1, in flight
    led.free([x])  # its sequence was preempted: reclaimable, still pending
    assert led.allocate(1) == [x]  # evicted for the next plan
    led.register(x, block_key(None, new), None, new, pending=True)  # step 2, in flight
    led.settle([x], written=True)  # step 1 came back: step 2 has not
    assert led.is_pending(x) and led.match(new + [0], B) == [] and led.match(new + [0], B, pending=True) == [x]
    led.settle([x], written=True)
    assert not led.is_pending(x) and led.match(new + [0], B) == [x]
    led.free([x])
    led.check()
