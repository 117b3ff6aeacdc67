"""The prefix cache's preallocated index and LRU (node/core/block_index.py) against a dict and a list."""

from __future__ import annotations

import random

import pytest

from node.core.block_index import BlockIndex, BlockLRU

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here


def key(home: int, tag: int) -> bytes:
    """A 16-byte key whose hash (first 8 bytes) is ``home``: few homes force long probe runs."""
    return home.to_bytes(8, "little") + tag.to_bytes(8, "little")


def test_index_agrees_with_a_dict_under_colliding_churn():
    rng = random.Random(0)
    n = 64
    idx, model = BlockIndex(n, 2), {}  # key -> block
    for step in range(4000):
        free = [b for b in range(n) if b not in idx]
        if free and (rng.random() < 0.55 or not model):
            b, k = rng.choice(free), key(rng.randrange(6) * 37 + 120, step)  # homes wrap past the table's end
            parent = None if rng.random() < 0.3 else key(1, step)
            idx.add(b, k, parent, [step, b])
            model[k] = (b, parent, [step, b])
        else:
            k = rng.choice(list(model))
            b, _, _ = model.pop(k)
            idx.remove(b)
        assert len(idx) == len(model)
        if step % 97 == 0:
            assert idx.check()
            for k, (b, parent, toks) in model.items():
                assert idx.find(k) == b and idx.key(b) == k
                assert idx.confirms(b, parent, toks) and not idx.confirms(b, key(2, 0), toks)
                assert not idx.confirms(b, parent, [toks[0], toks[1] + 1])
            assert idx.find(key(999, 0)) is None


def test_lru_pops_in_release_order_and_unlinks_anywhere():
    lru = BlockLRU(8)
    for b in [5, 2, 7, 0]:
        lru.push(b)
    lru.remove(7)
    assert 7 not in lru and 2 in lru and len(lru) == 3
    lru.push(7)
    assert [lru.pop_oldest() for _ in range(4)] == [5, 2, 0, 7] and len(lru) == 0


def test_insert_refuses_a_key_already_cached_in_one_probe():
    """``insert`` is find-then-add in one probe: a key already cached (even behind colliding ones, and
    after a removal shifted the run back) is refused and nothing changes; a new one is added."""
    idx = BlockIndex(8, 2)
    keys = [key(5, t) for t in range(4)]  # one home: a probe run of four
    for b, k in enumerate(keys):
        assert idx.insert(b, k, None, [b, b])
    idx.remove(1)  # backward shift: keys[2], keys[3] move up the run
    assert not idx.insert(6, keys[3], None, [9, 9]) and 6 not in idx and len(idx) == 3
    assert idx.find(keys[3]) == 3 and idx.confirms(3, None, [3, 3])
    assert idx.insert(6, keys[1], key(1, 0), [9, 9]) and idx.find(keys[1]) == 6 and idx.check()
