"""The simulator (bench.sim) on tiny cases whose schedules are computed by hand, and the shared workload.

Cost model of every case (seconds): prefill step of n tokens 0.010 + 0.001 n; decode step of s
sequences 0.005 + 0.001 s; a mixed step 0.010 + 0.001 n + 0.001 s (one fixed cost, the larger).
"""

from __future__ import annotations

import pytest

from bench.metrics import summarize
from bench.sim import SimConfig, simulate
from bench.sim.stepcost import mixed_step_s
from bench.traces import TraceRequest
from bench.workload import WorkloadSpec, build_workload
from node.core.cost import CostModel

COST = CostModel(prefill_fixed_s=0.010, prefill_per_token_s=0.001, decode_fixed_s=0.005, decode_per_seq_s=0.001)
TWO = [TraceRequest(0.0, 10, 3), TraceRequest(0.012, 20, 2)]


def token_times(res) -> list[list[float]]:
    return [[round(t, 9) for t in tr.token_times_s] for tr in res.traces]


def test_mixed_step_pays_one_fixed_cost():
    assert mixed_step_s(COST, 20, 0, 0) == pytest.approx(0.030)
    assert mixed_step_s(COST, 0, 2, 50) == pytest.approx(0.007)
    assert mixed_step_s(COST, 20, 1, 11) == pytest.approx(0.010 + 0.020 + 0.001)


def test_colocated_one_device_two_requests():
    # t=0      r0 arrives; step 1 prefills its 10 tokens: 0.020 s          -> r0 token 1 at 0.020
    # t=0.012  r1 arrives and waits for the step in flight
    # t=0.020  step 2 mixes r0's decode token with r1's 20-token prompt: 0.010 + 0.020 + 0.001 = 0.031
    #          -> r0 token 2 and r1 token 1 at 0.051
    # t=0.051  step 3 decodes both: 0.005 + 0.002 = 0.007  -> r0 token 3, r1 token 2 at 0.058 (both done)
    res = simulate(TWO, SimConfig(mode="colocated", devices=1, max_model_len=512), COST)
    assert token_times(res) == [[0.020, 0.051, 0.058], [0.051, 0.058]]
    r0, r1 = res.records
    assert (r0.ttft_s, r0.e2e_s, r0.output_tokens) == (pytest.approx(0.020), pytest.approx(0.058), 3)
    assert (r1.ttft_s, r1.e2e_s, r1.output_tokens) == (pytest.approx(0.039), pytest.approx(0.046), 2)
    assert r0.itls_s == pytest.approx([0.031, 0.007])
    # The summary is bench.metrics' over these records (duration: first arrival to last token).
    assert res.summary == summarize(res.records, ttft_slo_ms=1000.0, tpot_slo_ms=100.0)
    assert res.summary.duration_s == pytest.approx(0.058)
    assert res.summary.ttft_ms.mean == pytest.approx((20 + 39) / 2)
    assert res.summary.tpot_ms.mean == pytest.approx((19 + 7) / 2)  # (0.058-0.020)/2 and (0.046-0.039)/1


def test_pooled_one_prefill_one_decode_device_with_kv_transfer():
    # 125 bytes of KV per token over a 1 Mb/s link: 1 ms per token transferred.
    # prefill device: r0 0 -> 0.020 (token 1); r1 0.020 -> 0.050 (token 1, TTFT 0.038)
    # link: r0's 10 tokens 0.020 -> 0.030; r1's 20 tokens 0.050 -> 0.070
    # decode device: r0 steps of 0.006 from 0.030 -> tokens 2, 3 at 0.036, 0.042; r1 0.070 -> 0.076
    cfg = SimConfig(mode="pooled", devices=2, max_model_len=512, kv_bytes_per_token=125, link_gbps=1e-3)
    res = simulate(TWO, cfg, COST)
    assert token_times(res) == [[0.020, 0.036, 0.042], [0.050, 0.076]]
    assert res.stats["transfers"] == 2 and res.stats["transfer_bytes"] == 125 * 30
    assert res.records[1].ttft_s == pytest.approx(0.038) and res.records[1].e2e_s == pytest.approx(0.064)


def test_time_shared_one_device_runs_the_role_scheduler_with_pauses():
    # Reconfiguration pause 5 ms. The device starts in PREFILL.
    # r0 (t=0): prefill 0 -> 0.020 (token 1); switch to DECODE 0.020 -> 0.025; decode steps of 0.006:
    #           tokens 2, 3 at 0.031, 0.037; the empty device parks in PREFILL 0.037 -> 0.042.
    # r1 (t=0.1): prefill 0.100 -> 0.130 (token 1); switch 0.130 -> 0.135; decode -> token 2 at 0.141.
    reqs = [TraceRequest(0.0, 10, 3), TraceRequest(0.1, 20, 2)]
    cfg = SimConfig(mode="time-shared", devices=1, max_model_len=512, reconfig_pause_ms=5.0)
    res = simulate(reqs, cfg, COST)
    assert token_times(res) == [[0.020, 0.031, 0.037], [0.130, 0.141]]
    assert res.stats["switches"] == 4  # decode, park, decode (and park again at the end)
    assert res.summary.failed == 0


def test_nodes_share_requests_round_robin_and_failures_are_reported():
    reqs = [TraceRequest(0.0, 10, 3), TraceRequest(0.0, 10, 3)]
    one = simulate(reqs, SimConfig(mode="colocated", devices=1, max_model_len=512), COST)
    two = simulate(reqs, SimConfig(mode="colocated", devices=1, nodes=2, max_model_len=512), COST)
    assert one.summary.e2el_ms.mean > two.summary.e2el_ms.mean == pytest.approx(20 + 6 + 6)
    # A prompt larger than a device's whole KV pool is rejected, and counted as failed.
    tiny = simulate([TraceRequest(0.0, 100, 2)], SimConfig(mode="colocated", kv_blocks=2, max_model_len=512), COST)
    assert tiny.summary.failed == 1 and tiny.records[0].error.startswith("rejected")


def test_workload_is_deterministic_rate_scaled_and_fits_the_context():
    spec = WorkloadSpec(trace="azure-conv", rate_rps=5.0, duration_s=10.0, max_model_len=512, max_output_tokens=64)
    a, b = build_workload(spec), build_workload(spec)
    assert a.requests == b.requests and len(a.requests) == 50
    assert all(0 <= r.arrival_s < 10.0 for r in a.requests)
    assert all(r.prompt_tokens + r.output_tokens <= 512 and r.output_tokens <= 64 for r in a.requests)
    p = build_workload(WorkloadSpec(trace="poisson", rate_rps=4.0, duration_s=5.0, seed=3, length_scale=0.1))
    assert p.requests == build_workload(WorkloadSpec(trace="poisson", rate_rps=4.0, duration_s=5.0, seed=3,
                                                     length_scale=0.1)).requests
    assert p.requests and all(r.arrival_s < 5.0 for r in p.requests)
