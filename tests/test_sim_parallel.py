"""Tensor-parallel degrees in the simulator: the cost terms (all-reduce ring, in-node KV scatter), the
H200 preset at any degree from one per-device model, the memory check, and a time-shared group of
D = 2, P = 1 run end to end on the live Batcher, ledger and role scheduler."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from bench.cost.derive_cost import H200_NVLINK, derive_at
from bench.sim import SimConfig, simulate
from bench.sim.parallel import DoesNotFit, ParallelModel
from bench.sim.stepcost import GroupCost, plan_step_s
from bench.sim.tuning import TP_GRID, candidates
from bench.traffic.traces import TraceRequest
from node.core.batcher import ScheduledSeq, StepKind, StepPlan
from node.core.roofline import kv_scatter_bytes, kv_scatter_s, ring_allreduce_link_bytes
from node.core.sequence import SamplingParams, Sequence
from node.plan import load_config

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here

REPO = Path(__file__).resolve().parents[1]
CFG_8B = load_config(REPO / "bench/configs/llama3-8b")
CFG_70B = load_config(REPO / "bench/configs/llama3-70b")


def test_ring_all_reduce_bytes_and_the_roofline_comm_term_agree():
    assert ring_allreduce_link_bytes(1000.0, 1) == 0.0
    assert ring_allreduce_link_bytes(1000.0, 2) == pytest.approx(1000.0)  # 2 (2-1)/2
    assert ring_allreduce_link_bytes(1000.0, 8) == pytest.approx(1750.0)  # 2 (8-1)/8
    c = derive_at(CFG_8B, 4)
    t = 128
    msg = t * c.hidden * c.dtype_bytes
    want = 2 * c.layers * (ring_allreduce_link_bytes(msg, 4) / H200_NVLINK.link_Bps + H200_NVLINK.allreduce_latency_s)
    assert c.comm_s(t) == pytest.approx(want)


def test_kv_scatter_sends_the_heads_other_devices_own():
    # P = 1 inside D = 2: half of what a device computed belongs to the other one
    assert kv_scatter_bytes(100, 1000, 1, 2) == pytest.approx(50_000)
    assert kv_scatter_bytes(100, 1000, 2, 8) == pytest.approx(75_000)  # 1 - 2/8
    assert kv_scatter_bytes(100, 1000, 4, 4) == 0
    assert kv_scatter_s(100, 1000, 4, 4, 0.0) == 0.0  # nothing to move needs no link
    assert kv_scatter_s(100, 1000, 1, 2, 1e9) == pytest.approx(50e-6)
    with pytest.raises(ValueError):
        kv_scatter_bytes(1, 1, 3, 8)


def test_the_preset_at_any_degree_is_one_per_device_model():
    # the 70B TP-8 file was built by derive(); derive_at(8) on the preset is the same model
    doc = json.loads((REPO / "bench/cost_models/h200_llama3_70b_tp8_roofline.json").read_text())
    m = derive_at(CFG_70B, 8)
    assert all(getattr(m, k) == v for k, v in doc.items() if k in m.__struct_fields__)
    one, two = derive_at(CFG_8B, 1), derive_at(CFG_8B, 2)
    assert one.link_bandwidth_Bps == 0 and two.link_bandwidth_Bps == H200_NVLINK.link_Bps
    assert two.weight_bytes == one.weight_bytes // 2 and two.kv_bytes_per_token == one.kv_bytes_per_token // 2
    assert two.hbm_bandwidth_Bps == one.hbm_bandwidth_Bps  # the same device
    assert two.decode_step_s(64, 64 * 1000) < one.decode_step_s(64, 64 * 1000)


def test_memory_refuses_70b_at_degree_1_and_scales_blocks_with_the_group():
    pm = ParallelModel(CFG_70B)
    with pytest.raises(DoesNotFit):
        pm.kv_room_bytes(1, 2048, 256)
    room2 = pm.kv_room_bytes(2, 2048, 256)
    assert 0 < room2 < H200_NVLINK.hbm_bytes * 0.9 - 141e9 / 2
    assert pm.instance_blocks(4, 2, 16, 2048, 256) == 4 * room2 // (16 * pm.kv_bytes_per_token)
    cfg = SimConfig(mode="time-shared", devices=8, decode_tp=8, prefill_tp=1)
    with pytest.raises(DoesNotFit):
        pm.lower(cfg)
    ok, cost, _ = pm.lower(dataclasses.replace(cfg, prefill_tp=2))
    assert ok.devices == 1 and ok.kv_blocks == pm.instance_blocks(8, 2, 16, 2048, 8 * 256)
    assert ok.max_num_seqs == 8 * 256  # max_num_seqs counts per device
    assert ok.max_num_batched_tokens == 4 * 2048 and ok.max_item_tokens == 2048
    assert isinstance(cost, GroupCost) and cost.instances == 4


def _prompt(rid: str, n: int) -> Sequence:
    return Sequence(rid, rid, 0, 0.0, [0] * n, SamplingParams(max_tokens=4, ignore_eos=True), 8192)


def test_a_group_prefill_step_lasts_its_longest_instance_plus_its_scatter():
    pm = ParallelModel(CFG_8B)
    cfg, cost, _ = pm.lower(SimConfig(mode="time-shared", devices=2, decode_tp=2, prefill_tp=1))
    pre = pm.cost(1)
    assert cost.scatter_s_per_token == pytest.approx(pre.kv_bytes_per_token * 0.5 / H200_NVLINK.link_Bps)
    plan = StepPlan(StepKind.PREFILL, [ScheduledSeq(_prompt("a", 1000), 1000), ScheduledSeq(_prompt("b", 600), 600),
                                       ScheduledSeq(_prompt("c", 300), 300)])
    # LPT: 1000 on one instance, 600 + 300 on the other
    want = max(pre.prefill_step_s(1000), pre.prefill_step_s(900)) + 1000 * cost.scatter_s_per_token
    assert plan_step_s(cost, plan) == pytest.approx(want)
    # the live node's groups decode eagerly (no group decode graphs): so does the lowered group
    assert cost.decode_step_s(8, 8000) == pm.cost(2, decode_graphs=False).decode_step_s(8, 8000)


def test_degrees_above_one_need_a_parallel_model_and_tuning_drops_invalid_ones():
    with pytest.raises(ValueError):
        simulate([TraceRequest(0.0, 10, 2)], SimConfig(mode="colocated", devices=2, decode_tp=2),
                 derive_at(CFG_8B, 1))
    with pytest.raises(ValueError):
        SimConfig(mode="time-shared", devices=8, decode_tp=4, prefill_tp=3)
    ts = candidates(SimConfig(mode="time-shared", devices=8), TP_GRID)
    assert all(c.decode_tp % c.prefill_tp == 0 for c in ts) and len(ts) == 10 * 2  # x 2 budgets
    # the pooled splits (2, 4, 6 prefill devices of 8) scale with the devices: 1, 2, 3 of 4
    split = lambda n: sorted({c.prefill_devices for c in candidates(SimConfig(mode="pooled", devices=n), TP_GRID)})  # noqa: E731
    assert split(8) == [2, 4, 6] and split(4) == [1, 2, 3]


def _requests() -> list[TraceRequest]:
    return [TraceRequest(0.02 * i, 300 + 97 * (i % 7), 20 + i % 5) for i in range(24)]


def test_degree_one_through_the_parallel_model_equals_the_plain_simulator():
    pm = ParallelModel(CFG_8B)
    cfg = SimConfig(mode="time-shared", devices=2, max_model_len=8192, imbalance_threshold=0.0)
    lowered, cost, _ = pm.lower(cfg)
    a = simulate(_requests(), cfg, pm)
    b = simulate(_requests(), lowered, cost)
    assert [t.token_times_s for t in a.traces] == [t.token_times_s for t in b.traces]


@pytest.mark.parametrize("mode", ["time-shared", "colocated", "pooled"])
def test_a_group_of_two_runs_end_to_end(mode):
    pm = ParallelModel(CFG_8B)
    extra = dict(decode_tp=2, prefill_tp=1) if mode != "colocated" else dict(decode_tp=2)
    if mode == "pooled":
        extra.update(prefill_devices=2)
    cfg = SimConfig(mode=mode, devices=4, max_model_len=8192, tpot_slo_ms=50, imbalance_threshold=0.0, **extra)
    res = simulate(_requests(), cfg, pm)
    assert res.summary.completed == 24 and res.summary.failed == 0
    assert all(t.done for t in res.traces)
    if mode == "time-shared":
        assert res.stats["switches"] > 0
        assert set(res.stats["busy_s"]) == {"n0/dev0", "n0/dev1"}  # two groups of two devices
