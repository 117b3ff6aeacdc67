"""Placement that follows the prefix cache, weighed against load (role scheduler and pooled router),
on hand-made snapshots."""

from __future__ import annotations

import pytest

from node.core.cost import CostModel
from node.core.pooled import PlacePooled, PoolDevice, PooledRouter, PoolSnapshot
from node.core.roles import (DeviceState, NodeSnapshot, Place, ResidentSeq, Role, RoleScheduler,
                             RoleSchedulerConfig, WaitingPrompt)

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here

COST = CostModel(prefill_fixed_s=0.002, prefill_per_token_s=2e-5, decode_fixed_s=0.008, decode_per_seq_s=1e-4,
                 decode_per_context_token_s=1e-7, pause_s=0.005)
CFG = RoleSchedulerConfig(ttft_slo_ms=1000, tpot_slo_ms=50, min_window_ms=20, max_window_ms=2000,
                          prefill_token_budget=2048)


def prefill_dev(name: str, **kw) -> DeviceState:
    kw.setdefault("kv_free_blocks", 4000)
    kw.setdefault("kv_total_blocks", 4000)
    return DeviceState(device_id=name, role=Role.PREFILL, role_since_s=0.0, **kw)


def placed(snapshot: NodeSnapshot) -> dict[str, str]:
    out = RoleScheduler(CFG, COST).decide(1.0, snapshot)
    return {d.request_id: d.device_id for d in out if isinstance(d, Place)}


def test_role_scheduler_prefers_the_device_holding_the_prefix():
    w = WaitingPrompt("a", 4000, 1.0, 50, cached_tokens={"d1": 3200})
    assert placed(NodeSnapshot((prefill_dev("d0"), prefill_dev("d1")), (w,))) == {"a": "d1"}
    plain = WaitingPrompt("b", 4000, 1.0, 50)
    assert placed(NodeSnapshot((prefill_dev("d0"), prefill_dev("d1")), (plain,))) == {"b": "d0"}  # ties: order


def test_role_scheduler_weighs_the_prefix_against_queued_prefill():
    w = WaitingPrompt("a", 4000, 1.0, 50, cached_tokens={"d1": 3200})  # saves 64 ms of prefill on d1
    busy = prefill_dev("d1", prefill_queue_tokens=2000, prefill_queue_seqs=1)  # 40 ms queued: d1 still wins
    assert placed(NodeSnapshot((prefill_dev("d0"), busy), (w,))) == {"a": "d1"}
    busier = prefill_dev("d1", prefill_queue_tokens=6000, prefill_queue_seqs=1)  # 120 ms queued: d0 is sooner
    assert placed(NodeSnapshot((prefill_dev("d0"), busier), (w,))) == {"a": "d0"}


def test_role_scheduler_weighs_the_prefix_against_decode_load(monkeypatch):
    w = WaitingPrompt("a", 1000, 1.0, 100, cached_tokens={"d1": 800})  # saves 16 ms of prefill on d1
    ten = tuple(ResidentSeq(f"s{i}", 0.99, 100, 100) for i in range(10))  # +1 ms per decode step: 100 ms
    one = ten[:1]  # +0.1 ms per step: 10 ms < 16 ms
    assert placed(NodeSnapshot((prefill_dev("d0"), prefill_dev("d1", resident=ten)), (w,))) == {"a": "d0"}
    assert placed(NodeSnapshot((prefill_dev("d0"), prefill_dev("d1", resident=one)), (w,))) == {"a": "d1"}
    monkeypatch.setattr("node.core.roles.DECODE_LOAD_WEIGHT", 0.0)  # by prefill end alone, the cache wins
    assert placed(NodeSnapshot((prefill_dev("d0"), prefill_dev("d1", resident=ten)), (w,))) == {"a": "d1"}


def pool_dev(name: str, free: int, **kw) -> PoolDevice:
    return PoolDevice(device_id=name, kv_free_blocks=free, kv_total_blocks=200, block_size=16, **kw)


def test_pooled_router_follows_the_cache_on_both_sides():
    w = WaitingPrompt("a", 640, 0.0, 60, cached_tokens={"p1": 512, "d1": 320})
    snap = PoolSnapshot(prefill=(pool_dev("p0", 100), pool_dev("p1", 100)),
                        decode=(pool_dev("d0", 100), pool_dev("d1", 100)), waiting=(w,))
    (d,) = PooledRouter(8).decide(snap)
    assert (d.prefill_device, d.decode_device) == ("p1", "d1")


def test_pooled_router_weighs_the_cache_against_load():
    w = WaitingPrompt("a", 640, 0.0, 60, cached_tokens={"p1": 512, "d1": 320})  # d1 saves 20 blocks, p1 512 tokens
    snap = PoolSnapshot(prefill=(pool_dev("p0", 100), pool_dev("p1", 100, queued_tokens=600)),
                        decode=(pool_dev("d0", 130), pool_dev("d1", 100)), waiting=(w,))
    (d,) = PooledRouter(8).decide(snap)
    assert isinstance(d, PlacePooled) and (d.prefill_device, d.decode_device) == ("p0", "d0")
    near = PoolSnapshot(prefill=(pool_dev("p0", 100), pool_dev("p1", 100, queued_tokens=400)),
                        decode=(pool_dev("d0", 115), pool_dev("d1", 100)), waiting=(w,))
    (d,) = PooledRouter(8).decide(near)
    assert (d.prefill_device, d.decode_device) == ("p1", "d1")
