"""Prefix reuse in the benchmarks: Mooncake hash ids as shared token blocks, the traces' own
infinite-cache hit ratios, and the simulator's prefix cache and cache-following placement."""

from __future__ import annotations

import pytest

from bench.sim.batched import prompt_token_ids
from bench.sim.config import SimConfig
from bench.sim.run import simulate
from bench.sim.timeshared import TimeSharedSim
from bench.sim.trace import SimRequest
from bench.traffic.traces import (TraceRequest, hash_prompt_ids, infinite_cache_hit_ratio, read_mooncake_jsonl,
                          scale_hash_blocks)
from bench.traffic.workload import WorkloadSpec, build_workload
from node.core.cost import CostModel
from node.core.roles import RoleScheduler, RoleSchedulerConfig
from support import SHARED, require_shared

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here

COST = CostModel(prefill_fixed_s=0.002, prefill_per_token_s=2e-4, decode_fixed_s=0.004, decode_per_seq_s=1e-4,
                 decode_per_context_token_s=1e-7)


@pytest.mark.parametrize("name,blocks,tokens", [("conversation_trace", 0.366, 0.374), ("synthetic_trace", 0.640, 0.651)])
def test_the_traces_infinite_cache_hit_ratios_match_their_readme(name, blocks, tokens):
    require_shared()
    rows = read_mooncake_jsonl(SHARED / "traces" / "mooncake" / f"{name}.jsonl", keep_hashes=True)
    got = infinite_cache_hit_ratio(rows)
    assert got == pytest.approx((blocks, tokens), abs=6e-4)
    assert infinite_cache_hit_ratio(scale_hash_blocks(rows, 16)) == pytest.approx((blocks, tokens), abs=2e-3)


def test_scaled_hash_blocks_give_shared_tokens_for_shared_hashes():
    a = TraceRequest(0.0, 2 * 512 + 100, 512, (7, 8, 9), 512)
    b = TraceRequest(1.0, 2 * 512 + 1, 256, (7, 8, 11), 512)
    sa, sb = scale_hash_blocks([a, b], 16)
    assert (sa.prompt_tokens, sa.output_tokens, sa.hash_block_tokens) == (2 * 16 + 4, 16, 16)
    assert (sb.prompt_tokens, sb.output_tokens) == (2 * 16 + 1, 8)
    ia, ib = hash_prompt_ids(sa, 512), hash_prompt_ids(sb, 512)
    assert len(ia) == sa.prompt_tokens and len(ib) == sb.prompt_tokens and ia[0] == ib[0] == 1
    assert ia[:32] == ib[:32] and ia[32:33] != ib[32:33]  # hash 9 and hash 11 are other blocks
    assert all(3 <= t < 512 for t in ia[1:])
    with pytest.raises(ValueError):
        hash_prompt_ids(TraceRequest(0.0, 10, 1), 512)


def test_a_mooncake_workload_keeps_hashes_when_asked():
    require_shared()
    wl = build_workload(WorkloadSpec(trace="mooncake-conv", duration_s=30, tokens_per_hash=16, max_model_len=512))
    assert wl.requests and all(r.hash_ids and r.hash_block_tokens == 16 for r in wl.requests)
    assert all(r.prompt_tokens + r.output_tokens <= 512 for r in wl.requests)
    assert all(r.prompt_tokens <= len(r.hash_ids) * 16 for r in wl.requests)
    plain = build_workload(WorkloadSpec(trace="mooncake-conv", duration_s=30))
    assert not any(r.hash_ids for r in plain.requests)


def shared_prefix_requests(n: int = 40) -> list[TraceRequest]:
    """Conversations of one system prompt: 24 shared hash blocks, then two private ones."""
    return scale_hash_blocks([TraceRequest(0.05 * i, 26 * 512, 512, tuple(range(24)) + (1000 + i, 2000 + i), 512)
                              for i in range(n)], 16)


@pytest.mark.parametrize("mode", ["time-shared", "colocated", "pooled"])
def test_the_simulated_cache_saves_prefill_in_every_mode(mode):
    reqs = shared_prefix_requests()
    base = dict(mode=mode, devices=2, kv_blocks=2000, kv_bytes_per_token=1280, max_model_len=1024)
    off = simulate(reqs, SimConfig(**base), COST)
    on = simulate(reqs, SimConfig(**base, prefix_caching=True), COST)
    assert off.summary.completed == on.summary.completed == len(reqs)
    assert off.stats.get("cached_tokens", 0) == 0
    # everything but the first prompt's (and, with two devices, at most one more) shared head is reused
    assert on.stats["cached_tokens"] >= (len(reqs) - 2) * 24 * 16
    assert on.summary.ttft_ms.median < off.summary.ttft_ms.median
    if mode == "pooled":  # the decode device reuses its cached prefix: fewer bytes move
        assert on.stats["transfer_bytes"] < off.stats["transfer_bytes"]


def test_time_shared_sim_places_a_prompt_where_its_prefix_is_cached():
    sched = RoleScheduler(RoleSchedulerConfig(ttft_slo_ms=5000, tpot_slo_ms=100, max_window_ms=2000), COST)
    vn = TimeSharedSim(sched, COST, SimConfig(mode="time-shared", devices=2, kv_blocks=500, prefix_caching=True))
    head = tuple(range(5, 5 + 160))
    reqs = [SimRequest("b", 0.0, 200, 400, token_ids=tuple(range(900, 1100))),  # dev0 (both idle)
            SimRequest("a", 0.01, 170, 4, token_ids=head + (1,) * 10),  # dev1 (dev0 is busy)
            SimRequest("c", 5.0, 175, 4, token_ids=head + (2,) * 15)]  # both idle again: a's cache wins
    traces = vn.run(reqs)
    assert (traces["b"].device_id, traces["a"].device_id) == ("dev0", "dev1")
    assert traces["b"].token_times_s[-1] < 5.0  # dev0 is idle when c arrives: only the cache draws c
    assert traces["c"].device_id == "dev1" and traces["c"].cached_tokens == 160
    for d in vn.devices:
        d.batcher.ledger.check()
        assert d.batcher.ledger.num_used == 0 and d.batcher.ledger.num_reclaimable > 0


def test_simulated_prompts_without_hashes_never_share():
    a, b = (prompt_token_ids(rid, TraceRequest(0.0, 40, 1), True) for rid in ("r0", "r1"))
    assert a[0] != b[0] and len(a) == 40
    assert prompt_token_ids("r0", TraceRequest(0.0, 5, 1), False) == [0] * 5
