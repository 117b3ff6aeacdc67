"""The ownership self-check (issue 45: a block is never handed out twice), on plain data."""

from collections import Counter

import pytest

from node.core.ledger import BlockLedger, LedgerError

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here


def test_check_holders_finds_blocks_owned_twice_freed_under_a_holder_or_held_by_nobody():
    led = BlockLedger(5, 4, prefix_caching=True)
    a, b = led.allocate(2), led.allocate(3)
    led.check_holders(Counter(a + b))
    led.free(a)  # a stale free (a transfer's, after a restart): a's holder still names them
    with pytest.raises(LedgerError, match="refcount 0 but 1 holders"):
        led.check_holders(Counter(a + b))
    c = led.allocate(2)  # and handed out again: two owners
    assert set(c) == set(a)
    with pytest.raises(LedgerError, match="refcount 1 but 2 holders"):
        led.check_holders(Counter(a + b + c))
    led.check_holders(Counter(b + c))
    with pytest.raises(LedgerError, match="referenced by nobody"):
        led.check_holders(Counter(b))  # c's references have no holder: a leak
    led.free(c)
    named = Counter(b)
    named[c[0]] = 0  # named by a holder that took no reference: the block is free under it
    with pytest.raises(LedgerError, match="held but free"):
        led.check_holders(named)
    led.check_holders(Counter(b))
    with pytest.raises(LedgerError, match="not in the pool"):
        led.check_holders(Counter(b + [99]))


def test_check_holders_of_a_ledger_without_prefix_caching_passes_a_consistent_pool():
    """Without prefix caching there is no LRU (zero slots, only its sentinel): block 0 held once must
    not read as reclaimable (the check once looked it up in the empty list's sentinel)."""
    led = BlockLedger(4, 4, prefix_caching=False)
    held = led.allocate(2)
    assert 0 in held
    led.check_holders(Counter(held))


def test_fork_shares_held_blocks_all_or_nothing_and_refuses_free_ones():
    """``fork``: a second block table referencing held blocks (a request's choices sharing their prompt on
    the device a hand-off copies them to) plus new ones; nothing changes when the new ones do not fit."""
    led = BlockLedger(6, 4)
    a = led.allocate(3)
    new = led.fork(a[:2], 1)
    assert new is not None and new[0] not in a and [led.refcount(b) for b in a] == [2, 2, 1]
    led.check_holders(Counter(a) + Counter(a[:2] + new))
    assert led.fork(a[:2], 3) is None and [led.refcount(b) for b in a] == [2, 2, 1] and led.num_free == 2
    with pytest.raises(LedgerError):
        led.fork([next(b for b in range(6) if led.refcount(b) == 0)], 0)
    led.free(a[:2] + new)
    led.free(a)
    assert led.num_free == 6
    led.check()
