"""The ledger's prefix cache on its own, and the batcher admitting from it (pure, no model).

A fake KV pool stands in for the tensors: every planned step writes each new token's id into its slot
(``pool[block][offset]``) and then every scheduled sequence reads its whole context through its block
table, as the forward pass does per layer. A sequence that ever sees a token that is not its own
(another conversation's content, or a slot never written) fails the test.
"""

from __future__ import annotations

import random

import pytest

from node.core.batcher import BatchConfig, Batcher, StepKind
from node.core.ledger import BlockLedger, LedgerError, block_key
from node.core.sequence import SamplingParams, Sequence

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here

B = 4


def ledger(n: int = 8) -> BlockLedger:
    return BlockLedger(n, B, prefix_caching=True)


def keys_of(tokens: list[int]) -> list[bytes]:
    out: list[bytes] = []
    for i in range(len(tokens) // B):
        out.append(block_key(out[-1] if out else None, tokens[i * B : (i + 1) * B]))
    return out


def register_all(led: BlockLedger, blocks: list[int], tokens: list[int]) -> None:
    ks = keys_of(tokens)
    for i, b in enumerate(blocks[: len(ks)]):
        led.register(b, ks[i], ks[i - 1] if i else None, tokens[i * B : (i + 1) * B])


# --- the ledger ------------------------------------------------------------------------------------
def test_block_key_chains_over_the_parent():
    a, b = block_key(None, [1, 2, 3, 4]), block_key(block_key(None, [9, 9, 9, 9]), [1, 2, 3, 4])
    assert a != b and len(a) == 16 and block_key(None, [1, 2, 3, 4]) == a


def test_cached_blocks_are_reclaimable_and_found_again():
    led = ledger()
    toks = list(range(10))  # two full blocks and a partial one
    blocks = led.allocate(3)
    register_all(led, blocks, toks)
    assert led.num_cached == 2 and led.num_used == 3
    led.free(blocks)
    led.check()
    assert led.num_used == 0 and led.num_free == 8 and led.num_reclaimable == 2 and led.num_cached == 2
    assert led.match(toks, len(toks) - 1) == blocks[:2]
    assert led.match(toks, 7) == blocks[:1]  # only blocks entirely within max_tokens
    assert led.match([0, 1, 2, 3, 9, 9, 9, 9, 0], 8) == blocks[:1]  # stops at the first miss
    assert led.match([5] + toks[1:], 9) == []
    got = led.take(blocks[:2], 1)
    assert got is not None and led.refcount(blocks[0]) == 1 and led.num_reclaimable == 0
    led.check()


def test_a_hit_is_confirmed_by_tokens_and_parent_not_the_key_alone():
    led = ledger()
    [b0] = led.allocate(1)
    forged = block_key(None, [5, 6, 7, 8])
    led.register(b0, forged, None, [1, 2, 3, 4])  # as if [5,6,7,8] collided with [1,2,3,4]
    assert led.match([5, 6, 7, 8, 0], 4) == []
    assert led.match([1, 2, 3, 4, 0], 4) == []  # its own key is not the forged one either
    [b1] = led.allocate(1)
    k0 = block_key(None, [9, 9, 9, 9])
    led.register(b1, block_key(k0, [1, 1, 1, 1]), b"x" * 16, [1, 1, 1, 1])  # wrong parent recorded
    [b2] = led.allocate(1)
    led.register(b2, k0, None, [9, 9, 9, 9])
    assert led.match([9, 9, 9, 9, 1, 1, 1, 1, 0], 8) == [b2]
    led.check()


def test_eviction_takes_least_recently_released_unreferenced_blocks_tail_first():
    led = ledger(6)
    a = led.allocate(3)
    register_all(led, a, list(range(12)))
    held = led.allocate(1)
    register_all(led, held, [7] * 4)
    led.free(a)  # released tail first: a[2] is the oldest reclaimable
    assert led.num_free == 5
    got = led.allocate(3)  # two clean blocks, then evicts a[2]
    assert a[2] in got and led.num_evictions == 1
    assert led.match(list(range(12)) + [0], 12) == a[:2]
    got2 = led.allocate(2)
    assert set(got2) == {a[0], a[1]} and led.num_evictions == 3
    assert led.allocate(1) is None  # the referenced cached block is never evicted
    assert led.refcount(held[0]) == 1 and led.is_cached(held[0])
    led.check()


def test_take_is_all_or_nothing_and_counts_reclaimable_hits_as_consumed():
    led = ledger(4)
    a = led.allocate(2)
    register_all(led, a, list(range(8)))
    led.free(a)
    assert led.reuse_cost(a) == 2
    assert led.take(a, 3) is None  # 2 reclaimable hits + 3 new > 4 free
    led.check()
    assert led.num_reclaimable == 2 and led.refcount(a[0]) == 0
    assert led.take(a, 2) is not None and led.num_free == 0
    led.check()


def test_register_refuses_duplicates_partial_blocks_and_free_blocks():
    led = ledger()
    a, b = led.allocate(2)
    k = block_key(None, [1, 2, 3, 4])
    assert led.register(a, k, None, [1, 2, 3, 4])
    assert not led.register(b, k, None, [1, 2, 3, 4])  # the first copy stays the cached one
    assert not led.register(a, k, None, [1, 2, 3, 4])
    with pytest.raises(LedgerError):
        led.register(b, block_key(None, [1, 2, 3]), None, [1, 2, 3])
    led.free([b])
    with pytest.raises(LedgerError):
        led.register(b, block_key(None, [5, 6, 7, 8]), None, [5, 6, 7, 8])
    led.check()


def test_forget_drops_blocks_whose_step_failed():
    led = ledger()
    a = led.allocate(2)
    register_all(led, a, list(range(8)))
    led.forget(a[1:])
    led.free(a)
    led.check()
    assert led.match(list(range(9)), 8) == a[:1] and led.num_reclaimable == 1


def test_caching_off_registers_and_finds_nothing():
    led = BlockLedger(4, B)
    a = led.allocate(1)
    assert not led.register(a[0], block_key(None, [1, 2, 3, 4]), None, [1, 2, 3, 4])
    led.free(a)
    assert led.match([1, 2, 3, 4, 5], 4) == [] and led.num_reclaimable == 0
    led.check()


def test_check_catches_a_broken_state():
    led = ledger()
    a = led.allocate(1)
    register_all(led, a, [1, 2, 3, 4])
    led._refs[a[0]] = 0  # lost its reference without going to the reclaimable list
    with pytest.raises(LedgerError):
        led.check()


# --- the batcher on the cache ---------------------------------------------------------------------
def seq(name: str, tokens: list[int], arrival: float = 0.0, **params) -> Sequence:
    return Sequence(name, name, 0, arrival, tokens, SamplingParams(max_tokens=params.pop("max_tokens", 8), **params), 4096)


class FakePool:
    """Token ids written per slot; reads check that every context slot holds the sequence's token."""

    def __init__(self, num_blocks: int):
        self.slots: list[list[int | None]] = [[None] * B for _ in range(num_blocks)]

    def run(self, b: Batcher, kind: StepKind, sampled_token: int = 7) -> dict[str, int]:
        plan = b.schedule(kind)
        for it in plan.items:  # every layer writes all new K/V of the step, then attends
            s = it.seq
            for p in range(s.num_computed, s.num_computed + it.num_tokens):
                self.slots[s.block_ids[p // B]][p % B] = s.token_ids[p]
        for it in plan.items:
            s = it.seq
            for p in range(s.num_computed + it.num_tokens):
                assert self.slots[s.block_ids[p // B]][p % B] == s.token_ids[p], f"{s.seq_id} read a foreign slot at {p}"
        sampled = [it.seq for it in plan.items if it.samples]
        b.commit(plan)
        b.settle(plan)  # its reply came back: the blocks it filled are written
        for s in sampled:
            s.token_ids.append(sampled_token)
        b.ledger.check()
        return {it.seq.seq_id: it.num_tokens for it in plan.items}


def batcher(num_blocks: int = 64, **kw) -> tuple[Batcher, FakePool]:
    return Batcher(BlockLedger(num_blocks, B, prefix_caching=True), BatchConfig(**kw)), FakePool(num_blocks)


@pytest.mark.parametrize("length", [B - 1, B, B + 1, 2 * B, 3 * B + 5])
def test_a_repeated_prompt_starts_at_its_cached_blocks_and_computes_its_last_token(length):
    cached = B * ((length - 1) // B)  # whole blocks short of the last token
    b, pool = batcher()
    prompt = [100 + i for i in range(length)]
    first = seq("a", prompt)
    b.add(first)
    pool.run(b, StepKind.MIXED)
    b.remove(first)
    again = seq("b", prompt)
    b.add(again)
    assert pool.run(b, StepKind.MIXED) == {"b": length - cached}
    assert again.num_cached_tokens == cached and again.num_computed == length
    assert again.block_ids[: cached // B] == first_blocks(b, prompt, cached)
    assert b.prefix_query_tokens == 2 * length and b.prefix_hit_tokens == cached


def first_blocks(b: Batcher, prompt: list[int], cached: int) -> list[int]:
    return b.ledger.match(prompt, cached)


def test_sequences_admitted_in_the_same_step_share_the_blocks_it_fills():
    b, pool = batcher()
    prefix = list(range(100, 100 + 3 * B))
    seqs = [seq(f"s{i}", prefix + [i, i + 1], arrival=float(i)) for i in range(4)]
    for s in seqs:
        b.add(s)
    got = pool.run(b, StepKind.PREFILL)
    assert got == {"s0": 3 * B + 2, "s1": 2, "s2": 2, "s3": 2}
    head = seqs[0].block_ids[:3]
    assert all(s.block_ids[:3] == head for s in seqs)
    assert all(b.ledger.refcount(x) == 4 for x in head)
    for s in seqs:
        b.remove(s)
    b.ledger.check()
    assert b.ledger.num_used == 0 and b.ledger.num_reclaimable == 3


def test_a_chunked_prompt_shares_the_blocks_its_next_chunk_fills_in_the_same_step():
    b, pool = batcher(max_batched_tokens=3 * B)
    prompt = list(range(200, 200 + 5 * B))
    a = seq("a", prompt)
    b.add(a)
    assert pool.run(b, StepKind.PREFILL) == {"a": 3 * B}  # blocks 0-2 full and registered
    c = seq("c", prompt, arrival=1.0)
    b.add(c)
    # a's second chunk fills blocks 3-4 and registers them first; c reuses 0-3 in the same step
    assert pool.run(b, StepKind.PREFILL) == {"a": 2 * B, "c": B}
    assert c.num_cached_tokens == 4 * B and c.block_ids[:4] == a.block_ids[:4]


def test_prompt_logprobs_compute_the_whole_prompt():
    b, pool = batcher()
    prompt = list(range(3 * B))
    a = seq("a", prompt)
    b.add(a)
    pool.run(b, StepKind.MIXED)
    p = seq("p", prompt, prompt_logprobs=1)
    b.add(p)
    assert pool.run(b, StepKind.MIXED)["p"] == 3 * B and p.num_cached_tokens == 0


def test_preemption_and_removal_release_every_reference():
    b, pool = batcher(num_blocks=10, max_batched_tokens=64)
    prefix = list(range(300, 300 + 2 * B))
    seqs = [seq(f"s{i}", prefix + [i] * 3, arrival=float(i), max_tokens=40, ignore_eos=True) for i in range(4)]
    for s in seqs:
        b.add(s)
    for step in range(60):
        pool.run(b, StepKind.MIXED, sampled_token=step % 5)
        for s in list(b.running):
            if s.num_output >= 12:
                b.remove(s)
    assert b.num_preemptions > 0
    for s in b.running + b.waiting:
        b.remove(s)
    b.ledger.check()
    assert b.ledger.num_used == 0 and b.ledger.num_free == 10


def test_a_failed_step_leaves_nothing_findable():
    b, pool = batcher()
    prompt = list(range(2 * B + 1))
    a = seq("a", prompt)
    b.add(a)
    plan = b.schedule(StepKind.MIXED)
    assert len(plan.registered) == 2
    b.discard(plan)
    b.remove(a)
    b.ledger.check()
    assert b.ledger.match(prompt, 2 * B) == [] and b.ledger.num_used == 0


def test_admission_falls_back_to_no_reuse_when_reclaimable_hits_do_not_fit():
    """Reusing reclaimable blocks consumes free ones: 4 hits and a chunk of B need 5 blocks, 4 are
    free, so the prompt starts from scratch (1 block) rather than waiting."""
    b, pool = batcher(num_blocks=6, max_batched_tokens=B)
    prompt = list(range(400, 400 + 5 * B))
    a = seq("a", prompt)
    b.add(a)
    while b.has_work(StepKind.PREFILL):
        pool.run(b, StepKind.PREFILL)
    b.remove(a)
    hog = seq("hog", list(range(2 * B)), max_tokens=1)  # 2 blocks: a clean one and a's evicted tail
    b.add(hog)
    while b.has_work(StepKind.PREFILL):
        pool.run(b, StepKind.PREFILL)
    assert b.ledger.num_free == 4 and b.ledger.num_reclaimable == 4
    c = seq("c", prompt, arrival=1.0)
    b.add(c)
    assert len(b.cached_prefix(c)) == 4
    assert pool.run(b, StepKind.PREFILL) == {"c": B}
    assert c.num_cached_tokens == 0
    b.ledger.check()


def test_detached_blocks_survive_any_eviction_pressure():
    """A sequence detached for a transfer keeps its references until the caller frees them (B35)."""
    b, pool = batcher(num_blocks=12, max_batched_tokens=64)
    shared = list(range(500, 500 + 2 * B))
    a = seq("a", shared + [1], max_tokens=4)
    b.add(a)
    pool.run(b, StepKind.MIXED)
    pinned = b.release(a)
    pinned_content = [list(pool.slots[x]) for x in pinned]
    for i in range(30):  # churn: prompts sharing the head and private ones fill and evict the pool
        s = seq(f"c{i}", (shared if i % 2 else []) + [600 + i] * (B * (1 + i % 3)), arrival=float(i + 1), max_tokens=2)
        b.add(s)
        for _ in range(4):
            pool.run(b, StepKind.MIXED)
        for r in list(b.running):
            if r.num_output >= 2:
                b.remove(r)
        assert all(b.ledger.refcount(x) >= 1 for x in pinned)
    assert [pool.slots[x] for x in pinned] == pinned_content  # never handed to another sequence
    b.ledger.free(pinned)
    for s in b.running + b.waiting:
        b.remove(s)
    b.ledger.check()
    assert b.ledger.num_used == 0 and b.ledger.num_reclaimable > 0


@pytest.mark.parametrize("seed", range(6))
def test_no_sequence_ever_reads_another_conversations_content(seed):
    """Many conversations on a small pool: shared and private prefixes, growing turns, preemption,
    aborts, detaches with re-adoption; every read is checked against the reader's own tokens."""
    rng = random.Random(seed)
    b, pool = batcher(num_blocks=14, max_batched_tokens=rng.choice([B, 3 * B, 64]), max_num_seqs=rng.choice([2, 4, 8]))
    system = [rng.randrange(50) for _ in range(2 * B + 1)]
    history: dict[int, list[int]] = {}
    detached: list[tuple[Sequence, list[int]]] = []
    n = 0
    for step in range(300):
        if rng.random() < 0.3:
            conv = rng.randrange(5)
            prompt = history.get(conv, system + [conv]) + [rng.randrange(50) for _ in range(rng.randrange(1, 2 * B))]
            prompt = prompt[-40:]
            s = seq(f"q{n}", prompt, arrival=float(n), max_tokens=rng.randrange(1, 10), ignore_eos=True)
            s.request_id = str(conv)
            b.add(s)
            n += 1
        kind = rng.choice([StepKind.MIXED, StepKind.PREFILL, StepKind.DECODE])
        if b.has_work(kind):
            pool.run(b, kind, sampled_token=rng.randrange(50))
        for s in list(b.running):
            if s.num_output >= s.params.max_tokens or rng.random() < 0.02:
                history[int(s.request_id)] = list(s.token_ids)
                b.remove(s)
            elif s.is_decoding and rng.random() < 0.03:
                detached.append((s, b.release(s)))
        if detached and rng.random() < 0.3:
            s, blocks = detached.pop(rng.randrange(len(detached)))
            if rng.random() < 0.5:
                s.block_ids = blocks
                b.adopt(s)
            else:
                b.ledger.free(blocks)
        b.ledger.check()
    for s, blocks in detached:
        b.ledger.free(blocks)
    for s in b.running + b.waiting:
        b.remove(s)
    b.ledger.check()
    assert b.ledger.num_used == 0
    assert b.prefix_hit_tokens > 0


def test_cached_blocks_keep_no_python_objects_per_block():
    """Issue 32 (the soak's RSS growth): the cache kept a tuple of token-id ints per cached block
    (~19 Python objects, ~0.7 KB), so a large pool's cache index grew the node by tens of MB as it
    filled. Parents and token ids now live in storage allocated with the ledger: registering blocks
    allocates no object per block beyond the caller's key (the dict's table is not a Python object)."""
    import sys

    n, bs = 2048, 16
    led = BlockLedger(n, bs, prefix_caching=True)
    blocks = led.allocate(n)
    stream = list(range(1000, 1000 + n * bs))  # one long "prompt": block b holds stream[b*bs:(b+1)*bs]
    keys = led.keys(stream, n, [])  # made before counting: the caller's objects
    tokens = [stream[b * bs : (b + 1) * bs] for b in range(n)]
    before = sys.getallocatedblocks()
    for i, b in enumerate(blocks):
        assert led.register(b, keys[i], keys[i - 1] if i else None, tokens[i])
    assert (sys.getallocatedblocks() - before) / n < 0.5  # it kept two tuples per block (their ints are shared here)
    led.free(blocks)
    assert led.match(stream[: 3 * bs] + [7], 3 * bs + 1) == blocks[:3]  # hits are still confirmed by parent and tokens
    assert led.match(stream[:bs] + [5] * bs, 2 * bs) == blocks[:1]
    led.check()


def test_the_cache_index_keeps_no_memory_per_cached_block():
    """Issue 32 (the soak's RSS growth, continued): after the tuples went, each cached block still
    kept its key (a ``bytes``), a ``dict`` slot and an ``OrderedDict`` entry, ~0.2 KB, so a 26k-block
    pool's node kept growing for most of an hour of load as its cache filled. The index and the LRU
    are now sized with the ledger: filling the cache, releasing it and evicting part of it keeps
    nothing the caller's keys and block lists do not (they go with their sequences)."""
    import tracemalloc

    n, bs = 4096, 4
    led = BlockLedger(n, bs, prefix_caching=True)
    stream = list(range(n * bs))
    tokens = [stream[b * bs : (b + 1) * bs] for b in range(n)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        blocks = led.allocate(n)
        keys = led.keys(stream, n, [])
        for i, b in enumerate(blocks):
            assert led.register(b, keys[i], keys[i - 1] if i else None, tokens[i])
        led.free(blocks)
        assert led.num_cached == led.num_reclaimable == n
        del keys, blocks
        retained = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert retained / n < 4, f"{retained / n:.0f} bytes kept per cached block"
    assert led.match(stream[: 3 * bs] + [7], 3 * bs + 1) == [0, 1, 2]  # still found, confirmed by parent and tokens
    again = led.allocate(n // 2)  # evicts the least recently released: the tail of the "prompt" first
    assert sorted(again) == list(range(n // 2, n)) and led.num_evictions == n // 2
    assert led.match(stream, n * bs) == list(range(n // 2))
    led.check()
