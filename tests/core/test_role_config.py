"""Role configurations as data, strided instance ranks, LPT instance assignment, the per-item cap."""

import pytest

from node.core.batcher import BatchConfig, Batcher, StepKind
from node.core.ledger import BlockLedger
from node.core.role_config import RoleConfig, assign_instances, instance_ranks, shared_block_units, time_shared_roles
from node.core.sequence import SamplingParams, Sequence

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here


def test_time_shared_roles_split_the_group():
    roles = time_shared_roles(4, 2, token_budget=512, max_num_seqs=64)
    p, d = roles["prefill"], roles["decode"]
    assert (p.tp_degree, p.instances, p.step_budget, p.item_cap) == (2, 2, 1024, 512)
    assert (d.tp_degree, d.instances, d.item_cap, d.group_size) == (4, 1, None, 4)
    one = time_shared_roles(1, 1, 2048, 256, cuda_graphs=True)
    assert one["decode"].cuda_graphs and not time_shared_roles(2, 1, 2048, 256, cuda_graphs=True)["decode"].cuda_graphs
    with pytest.raises(ValueError, match="--prefill-tp 3 must divide --decode-tp 4"):
        time_shared_roles(4, 3, 512, 64)
    with pytest.raises(ValueError):
        RoleConfig("train")


def test_instance_ranks_are_strided_and_own_their_decode_heads():
    assert instance_ranks(4, 2) == [[0, 2], [1, 3]]
    assert instance_ranks(2, 1) == [[0], [1]]
    assert instance_ranks(4, 4) == [[0, 1, 2, 3]]
    # rank r's heads at degree P contain its heads at degree D (the KV it keeps for decode)
    for d, p, kv_heads in [(4, 2, 8), (2, 1, 4), (8, 2, 8), (8, 4, 8)]:
        for inst in instance_ranks(d, p):
            for j, r in enumerate(inst):
                at_p = range(j * kv_heads // p, (j + 1) * kv_heads // p)
                at_d = range(r * kv_heads // d, (r + 1) * kv_heads // d)
                assert set(at_d) <= set(at_p)
    with pytest.raises(ValueError):
        instance_ranks(4, 3)


def test_assign_instances_longest_first():
    assert assign_instances([5, 5, 5], 1) == [0, 0, 0]
    assert assign_instances([100, 10, 90, 20], 2) == [0, 0, 1, 1]  # loads 110 / 110
    out = assign_instances([7, 3, 3, 3, 2, 2], 3)
    loads = [sum(t for t, s in zip([7, 3, 3, 3, 2, 2], out) if s == k) for k in range(3)]
    assert sorted(loads) == [6, 7, 7]
    assert assign_instances([], 4) == []


def _seq(i, n):
    return Sequence(f"s{i}", f"r{i}", 0, float(i), list(range(1, n + 1)), SamplingParams(max_tokens=4), 4096)


def test_item_cap_limits_each_sequence_not_the_step():
    b = Batcher(BlockLedger(1000, 16), BatchConfig(max_num_seqs=8, max_batched_tokens=1000, max_item_tokens=300))
    for i, n in enumerate([800, 200, 700]):
        b.add(_seq(i, n))
    plan = b.schedule(StepKind.PREFILL)
    assert [it.num_tokens for it in plan.items] == [300, 200, 300]
    sampled = [it.seq for it in plan.items if it.samples]
    b.commit(plan)
    for s in sampled:  # the engine's sampled token: s1 now decodes
        s.token_ids.append(7)
    plan = b.schedule(StepKind.PREFILL)  # the running partial prefills continue, capped again
    assert [it.num_tokens for it in plan.items] == [300, 300]
    assert BatchConfig(max_batched_tokens=100, max_item_tokens=300).item_cap == 100
    assert BatchConfig(max_batched_tokens=100).item_cap == 100


def test_items_sharing_a_block_written_in_the_step_run_on_one_instance():
    # item 0 writes blocks 10, 11 (positions 0..19 at block size 16); item 1 hits block 10 (registered by
    # item 0 in this step) and writes 12; item 2 is unrelated; item 3 reads block 11
    spans = [([10, 11], 0, 20), ([10, 12], 16, 4), ([20, 21], 0, 30), ([10, 11, 13], 32, 2)]
    units = shared_block_units(spans, 16)
    assert units == [0, 0, 2, 0]
    out = assign_instances([20, 4, 30, 2], 2, units)
    assert out[0] == out[1] == out[3] != out[2]
    assert shared_block_units([([5], 0, 0), ([5], 0, 3)], 16) == [0, 1]  # a zero-token item writes nothing
    assert assign_instances([5, 5, 5, 5], 2, [0, 0, 0, 0]) == [0, 0, 0, 0]
