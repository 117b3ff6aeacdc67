"""``cache_salt`` in the ledger and the batcher (pure): a salted sequence's block keys, and the parent its
hits are confirmed against, start from the salt's digest, so it reuses only blocks of the same salt."""

import pytest
from node.core.batcher import BatchConfig, Batcher, StepKind
from node.core.ledger import BlockLedger, salt_root
from node.core.sequence import SamplingParams, Sequence

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here

B = 4
TOKENS = list(range(1, 14))  # three full blocks and one token


def _seq(i: int, salt: str | None) -> Sequence:
    return Sequence(f"s{i}", f"r{i}", 0, float(i), TOKENS, SamplingParams(max_tokens=2, cache_salt=salt), 4096)


def _cached_after(first_salt: str | None, second_salt: str | None) -> int:
    """Prompt tokens the second sequence finds cached after the first one ran (and left)."""
    b = Batcher(BlockLedger(32, B, prefix_caching=True), BatchConfig(max_batched_tokens=64))
    first = _seq(0, first_salt)
    b.add(first)
    plan = b.schedule(StepKind.MIXED)
    b.commit(plan)
    b.settle(plan)
    b.remove(first)
    return len(b.cached_prefix(_seq(1, second_salt))) * B


def test_hits_only_within_the_same_salt():
    assert _cached_after(None, None) == 12
    assert _cached_after("a", "a") == 12
    assert _cached_after("a", "b") == 0
    assert _cached_after("a", None) == 0
    assert _cached_after(None, "a") == 0


def test_salted_keys_differ_from_the_first_block_on():
    led = BlockLedger(8, B, prefix_caching=True)
    plain, salted, other = [], [], []
    led.keys(TOKENS, 3, plain)
    led.keys(TOKENS, 3, salted, salt_root("a"))
    led.keys(TOKENS, 3, other, salt_root("b"))
    assert all(len({p, s, o}) == 3 for p, s, o in zip(plain, salted, other))
    assert salt_root(None) is None and salt_root("a") == salt_root("a") != salt_root("b")
