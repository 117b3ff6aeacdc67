"""The simulator (bench.sim) on tiny cases whose schedules are computed by hand, and the shared workload.

Cost model of every case (seconds): prefill step of n tokens 0.010 + 0.001 n; decode step of s
sequences 0.005 + 0.001 s; a mixed step 0.010 + 0.001 n + 0.001 s (one fixed cost, the larger).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from bench.sim import SimConfig, simulate
from bench.sim.config import ORACLES  # the hand-computed schedules below that need them say so
from bench.sim.stepcost import mixed_step_s
from bench.traffic.metrics import summarize
from bench.traffic.traces import TraceRequest
from bench.traffic.workload import WorkloadSpec, build_workload
from node.core.cost import CostModel


REPO = Path(__file__).resolve().parents[1]
COST = CostModel(prefill_fixed_s=0.010, prefill_per_token_s=0.001, decode_fixed_s=0.005, decode_per_seq_s=0.001)
TWO = [TraceRequest(0.0, 10, 3), TraceRequest(0.012, 20, 2)]


def token_times(res) -> list[list[float]]:
    return [[round(t, 9) for t in tr.token_times_s] for tr in res.traces]


@pytest.mark.quick
def test_mixed_step_pays_one_fixed_cost():
    assert mixed_step_s(COST, 20, 0, 0) == pytest.approx(0.030)
    assert mixed_step_s(COST, 0, 2, 50) == pytest.approx(0.007)
    assert mixed_step_s(COST, 20, 1, 11) == pytest.approx(0.010 + 0.020 + 0.001)


@pytest.mark.quick
def test_colocated_one_device_two_requests():
    # One step in flight at a time (step_pipeline=1: each step planned when the one before ends):
    # t=0      r0 arrives; step 1 prefills its 10 tokens: 0.020 s          -> r0 token 1 at 0.020
    # t=0.012  r1 arrives and waits for the step in flight
    # t=0.020  step 2 mixes r0's decode token with r1's 20-token prompt: 0.010 + 0.020 + 0.001 = 0.031
    #          -> r0 token 2 and r1 token 1 at 0.051
    # t=0.051  step 3 decodes both: 0.005 + 0.002 = 0.007  -> r0 token 3, r1 token 2 at 0.058 (both done)
    res = simulate(TWO, SimConfig(mode="colocated", devices=1, max_model_len=512, step_pipeline=1), COST)
    assert token_times(res) == [[0.020, 0.051, 0.058], [0.051, 0.058]]
    r0, r1 = res.records
    assert (r0.ttft_s, r0.e2e_s, r0.output_tokens) == (pytest.approx(0.020), pytest.approx(0.058), 3)
    assert (r1.ttft_s, r1.e2e_s, r1.output_tokens) == (pytest.approx(0.039), pytest.approx(0.046), 2)
    assert r0.itls_s == pytest.approx([0.031, 0.007])
    # The summary is bench.traffic.metrics' over these records (duration: first arrival to last finish).
    assert res.summary == summarize(res.records, ttft_slo_ms=1000.0, tpot_slo_ms=100.0)
    assert res.summary.duration_s == pytest.approx(0.058)
    assert res.summary.ttft_ms.mean == pytest.approx((20 + 39) / 2)
    assert res.summary.tpot_ms.mean == pytest.approx((19 + 7) / 2)  # (0.058-0.020)/2 and (0.046-0.039)/1


@pytest.mark.quick
def test_colocated_steps_are_pipelined_as_on_the_node():
    # The node's device loop (the default step_pipeline=2): a step is planned when the one before it
    # starts, on placeholders of the tokens still in flight.
    # t=0      step 1 prefills r0 (0 -> 0.020); step 2, planned at once, decodes r0 (0.020 -> 0.026)
    # t=0.012  r1 arrives: both steps are already planned
    # t=0.020  step 3 is planned: r0's decode + r1's prompt, 0.031 s, run 0.026 -> 0.057
    # t=0.026  step 4: r0 is complete (its last token is in flight), r1 decodes 0.057 -> 0.063
    # with the oracle's max_tokens = the true length the node knows r0 ends at its third token (EOS would not
    # stop step 4 from carrying it: test_an_unforeseen_eos_wastes_the_step_planned_past_it)
    res = simulate(TWO, SimConfig(mode="colocated", devices=1, max_model_len=512, **ORACLES), COST)
    assert token_times(res) == [[0.020, 0.026, 0.057], [0.057, 0.063]]
    assert res.records[1].ttft_s == pytest.approx(0.045)  # against 0.039 with one step in flight
    with pytest.raises(ValueError, match="step_pipeline"):
        SimConfig(mode="colocated", step_pipeline=0)


@pytest.mark.quick
def test_pooled_one_prefill_one_decode_device_with_kv_transfer():
    # 125 bytes of KV per token over a 1 Mb/s link: 1 ms per token transferred. Overlapped transfers:
    # prefill device: r0 0 -> 0.020 (token 1); r1 0.020 -> 0.050 (token 1, TTFT 0.038)
    # link: r0's 10 tokens 0.020 -> 0.030; r1's 20 tokens 0.050 -> 0.070
    # decode device: r0 steps of 0.006 from 0.030 -> tokens 2, 3 at 0.036, 0.042; r1 0.070 -> 0.076
    cfg = SimConfig(mode="pooled", devices=2, max_model_len=512, kv_bytes_per_token=125, link_gbps=1e-3, **ORACLES,
                    transfer="overlap")
    res = simulate(TWO, cfg, COST)
    assert token_times(res) == [[0.020, 0.036, 0.042], [0.050, 0.076]]
    assert res.stats["transfers"] == 2 and res.stats["transfer_bytes"] == 125 * 30
    assert res.records[1].ttft_s == pytest.approx(0.038) and res.records[1].e2e_s == pytest.approx(0.064)
    # Blocking transfers (the node's copies before they overlapped): r1's prefill was planned behind
    # r0's at 0.012 (0.020 -> 0.050), and the device drains it before it sends r0's KV 0.050 -> 0.060,
    # so r0 decodes 0.060 -> 0.066 -> 0.072; r1's KV 0.060 -> 0.080; its decode -> 0.086.
    res = simulate(TWO, replace(cfg, transfer="blocking"), COST)
    assert token_times(res) == [[0.020, 0.066, 0.072], [0.050, 0.086]]
    # One step in flight: r0's KV goes 0.020 -> 0.030 before r1 prefills 0.030 -> 0.060.
    res = simulate(TWO, replace(cfg, transfer="blocking", step_pipeline=1), COST)
    assert token_times(res) == [[0.020, 0.036, 0.042], [0.060, 0.086]]


@pytest.mark.quick
def test_pooled_router_reserves_decode_blocks_and_waits_fifo():
    # The decode device holds 4 blocks of 16 tokens. r0 reserves prompt 10 + expected output 3 -> 1
    # block; r1 (prompt 40 + 3 -> 3 blocks) fits beside it; r2 (prompt 10) must wait for r0 to leave,
    # since the router counts reservations, not only allocated blocks.
    reqs = [TraceRequest(0.0, 10, 3), TraceRequest(0.0, 40, 3), TraceRequest(0.0, 10, 2)]
    cfg = SimConfig(mode="pooled", devices=2, max_model_len=512, kv_blocks=4, kv_bytes_per_token=0,
                    transfer="overlap")
    res = simulate(reqs, cfg, COST)
    assert res.summary.failed == 0
    r0_done = res.traces[0].token_times_s[-1]
    assert res.traces[2].token_times_s[0] > r0_done


@pytest.mark.quick
def test_time_shared_one_device_runs_the_role_scheduler_with_pauses():
    # Reconfiguration pause 5 ms. The device starts in PREFILL.
    # r0 (t=0): prefill 0 -> 0.020 (token 1); switch to DECODE 0.020 -> 0.025; decode steps of 0.006:
    #           tokens 2, 3 at 0.031, 0.037; the empty device parks in PREFILL 0.037 -> 0.042.
    # r1 (t=0.1): prefill 0.100 -> 0.130 (token 1); switch 0.130 -> 0.135; decode -> token 2 at 0.141.
    reqs = [TraceRequest(0.0, 10, 3), TraceRequest(0.1, 20, 2)]
    cfg = SimConfig(mode="time-shared", devices=1, max_model_len=512, reconfig_pause_ms=5.0, **ORACLES)
    res = simulate(reqs, cfg, COST)
    assert token_times(res) == [[0.020, 0.031, 0.037], [0.130, 0.141]]
    assert res.stats["switches"] == 4  # decode, park, decode (and park again at the end)
    assert res.summary.failed == 0


@pytest.mark.quick
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


@pytest.mark.quick
def test_cluster_pool_sends_kv_between_nodes_over_both_device_links():
    # 2 nodes x 1 device, node 0 prefills, node 1 decodes; 125 bytes of KV per token over 1 Mb/s
    # network links (1 ms per token); the intra-node link (1 Gb/s) is never used.
    # r0: prefill 0 -> 0.020; KV (10 tokens) 0.020 -> 0.030; decode 0.030 -> 0.036 -> 0.042.
    # r1 (t=0.012): prefill 0.020 -> 0.050 (overlapped transfers: the prefill device goes on while
    #     r0's KV leaves); KV (20 tokens) 0.050 -> 0.070; decode step 0.070 -> 0.076.
    cfg = SimConfig(mode="pooled", devices=1, nodes=2, pool_scope="cluster", max_model_len=512, **ORACLES,
                    kv_bytes_per_token=125, internode_gbps=1e-3, link_gbps=1.0)
    res = simulate(TWO, cfg, COST)
    assert token_times(res) == [[0.020, 0.036, 0.042], [0.050, 0.076]]
    assert [t.device_id for t in res.traces] == ["n0/dev0", "n0/dev0"]  # the device of the first token
    assert set(res.stats["busy_s"]) == {"n0/dev0", "n1/dev0"}
    # Two prefill nodes feeding one decode device: the transfers queue on the decode device's link.
    # Both prompts prefill at once on n0 and n1 (0 -> 0.020); both KV caches (10 tokens, 10 ms each)
    # want n2/dev0's link: one 0.020 -> 0.030, the other 0.030 -> 0.040.
    three = SimConfig(mode="pooled", devices=1, nodes=3, pool_scope="cluster", prefill_nodes=2, max_model_len=512,
                      kv_bytes_per_token=125, internode_gbps=1e-3, **ORACLES)
    res = simulate([TraceRequest(0.0, 10, 2), TraceRequest(0.0, 10, 2)], three, COST)
    second = sorted(tr.token_times_s[1] for tr in res.traces)
    assert second == pytest.approx([0.030 + 0.006, 0.040 + 0.006])


@pytest.mark.quick
def test_link_plan_and_transfer_time_arithmetic():
    from bench.sim.batched import SimDevice
    from bench.sim.pooled import link_plan
    from node.core.batcher import StepKind
    from node.plan import transfer_s

    cfg = SimConfig(mode="pooled", devices=2, nodes=2, pool_scope="cluster", link_gbps=100.0, internode_gbps=400.0)
    a, b = SimDevice("n0/dev0", StepKind.PREFILL, cfg, node=0), SimDevice("n0/dev1", StepKind.MIXED, cfg, node=0)
    c = SimDevice("n1/dev0", StepKind.MIXED, cfg, node=1)
    assert link_plan(a, b, cfg) == (["link:n0/dev0"], 100.0)
    assert link_plan(a, c, cfg) == (["nic:n0/dev0", "nic:n1/dev0"], 400.0)
    # The seed's arithmetic: 512 MiB over 100 Gb/s at line rate is about 43 ms; 128 KiB x 4096 tokens.
    assert transfer_s(128 * 1024 * 4096, 100.0) == pytest.approx(512 * 2**20 * 8 / 100e9)
    assert transfer_s(512 * 2**20, 100.0) == pytest.approx(0.0429, abs=1e-4)
    with pytest.raises(ValueError):
        SimConfig(mode="pooled", nodes=1, pool_scope="cluster")


@pytest.mark.quick
def test_step_overhead_is_paid_once_per_step():
    # 2 ms per step on top of the cost model: r0's prefill 0.022, then two decode steps of 0.008.
    res = simulate([TraceRequest(0.0, 10, 3)], SimConfig(mode="colocated", max_model_len=512, step_overhead_ms=2.0),
                   COST)
    assert token_times(res) == [[0.022, 0.030, 0.038]]
    # A 5 ms request overhead delays the request's start at the node: TTFT 0.025, same TPOT.
    res = simulate([TraceRequest(0.0, 10, 3)], SimConfig(mode="colocated", max_model_len=512, request_overhead_ms=5.0),
                   COST)
    assert res.records[0].ttft_s == pytest.approx(0.025) and res.records[0].itls_s == pytest.approx([0.006, 0.006])


@pytest.mark.quick
def test_host_overheads_from_a_node_probe():
    from bench.studies.validate_sim import host_overheads

    # The node's lone decode gaps are 1.5 ms longer than the runner's steps, its lone TTFTs 4 ms longer
    # than the runner's prefill steps: 1.5 ms per step, 2.5 ms per request besides.
    prefill = [(n, COST.prefill_step_s(n) + 0.004) for n in (16, 32, 64)]
    decode = [(1, 160, COST.decode_step_s(1, 160) + 0.0015), (2, 320, COST.decode_step_s(2, 320) + 0.0012),
              (4, 640, 0.5)]  # the median of the three differences: 1.5 ms
    step, req = host_overheads(COST, prefill, decode)
    assert step == pytest.approx(0.0015) and req == pytest.approx(0.0025)


@pytest.mark.quick
def test_synthetic_lengths():
    from bench.traffic.workload import synthetic_lengths

    assert synthetic_lengths("azure-conv") is None
    assert synthetic_lengths("fixed:128:64") == [TraceRequest(0.0, 128, 64)]
    wide = synthetic_lengths("loguniform:32:7000:128", seed=1)
    ps = sorted(r.prompt_tokens for r in wide)
    assert 32 <= ps[0] and ps[-1] <= 7000 and all(r.output_tokens == 128 for r in wide)
    # log-uniform: the median is near the geometric mean (~473), far below the arithmetic one
    assert 380 < ps[len(ps) // 2] < 580
    with pytest.raises(ValueError):
        synthetic_lengths("uniform:10:5:1")
    w = build_workload(WorkloadSpec(trace="poisson", rate_rps=20.0, duration_s=2.0, lengths_from="fixed:100:5"))
    assert w.requests and all((r.prompt_tokens, r.output_tokens) == (100, 5) for r in w.requests)


@pytest.mark.quick
def test_capacity_search_brackets_and_bisects():
    from bench.studies.crossover import capacity

    calls = []

    def run(rate):  # attainment falls below 90% above 37 req/s
        calls.append(rate)
        return {"slo_attainment": 1.0 if rate <= 37 else 0.5}

    rate, best, n = capacity(run, 10.0, tolerance=1.05)
    assert 37 / 1.05 <= rate <= 37 and best["slo_attainment"] == 1.0 and n == len(set(calls))
    assert capacity(lambda r: {"slo_attainment": 0.0}, 1.0, min_rate=0.2)[0] == 0.0


@pytest.mark.quick
def test_derived_roofline_models_scale_with_geometry_and_match_the_committed_files(tmp_path):
    from bench.cost.calibrate import load_cost_model
    from bench.cost.derive_cost import REFERENCE_CONFIG, calibrate, derive, main
    from node.core.roofline import RooflineCost
    from node.plan import load_config

    ref_cfg = load_config(REFERENCE_CONFIG)
    ref = calibrate(ref_cfg)
    assert derive(ref_cfg, ref) == ref  # the reference geometry keeps its calibrated terms
    small = derive(load_config(REFERENCE_CONFIG.parent / "llama3.2-1b"), ref)
    assert small.decode_step_s(1, 1024) < ref.decode_step_s(1, 1024) / 2
    assert small.prefill_step_s(4096) < ref.prefill_step_s(4096) / 3
    big = derive(load_config(REFERENCE_CONFIG.parent / "llama3-70b"), ref, tensor_parallel=8)
    assert big.weight_bytes < ref.weight_bytes * 1.25 and big.comm_s(1) > 0  # 70B / 8 ranks ~ 8.7B per rank
    # The committed files are what the script writes now (fields; the record's command may differ).
    for cfg, tp, name in (("llama3-8b", 1, "h200_llama3_8b_roofline.json"),
                          ("llama3.2-1b", 1, "h200_llama3_1b_roofline.json"),
                          ("llama3-70b", 8, "h200_llama3_70b_tp8_roofline.json")):
        out = tmp_path / name
        assert main(["--config", str(REFERENCE_CONFIG.parent / cfg), "--tensor-parallel-size", str(tp),
                     "--out", str(out)]) == 0
        fresh, committed = load_cost_model(out), load_cost_model(REPO / "bench" / "cost_models" / name)
        assert isinstance(committed, RooflineCost) and fresh == committed, name
        ev = json.loads(out.read_text())["calibration"]["evidence"]
        fitted = [e for e in ev if not e["role"].startswith("left out")]
        assert len(ev) == 13 and max(abs(e["rel_residual"]) for e in fitted) < 0.10


def test_crossover_tiny_grid(capsys):
    from bench.studies import crossover

    rc = crossover.main(["--models", "8b", "--lengths", "tiny=fixed:256:4", "--links", "1,400", "--devices", "2",
                         "--duration", "1", "--modes", "time-shared,colocated,pooled", "--tolerance", "1.5",
                         "--tune-grid", "small"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "| 8b | tiny |" in out and "1 Gb/s" in out and "400 Gb/s" in out
    # At 1 Gb/s a 256-token cache (32 MiB) takes 0.27 s to send: pooled loses; at 400 Gb/s it is 0.7 ms.
    row = next(line for line in out.splitlines() if line.startswith("| 8b | tiny |"))
    slow, fast = row.split(" | ")[2:4]
    assert slow.split(", ")[-1].startswith("PD")  # pooled comes last at 1 Gb/s
    # each mode at its best setting, named: time-shared's of the small grid, pooled's split (1 of 2 devices)
    assert "imbalance_threshold=" in slow and "max_window_ms=" in slow and "prefill_devices=1" in fast
    assert "CO " in slow and "max_num_batched_tokens=" in slow


@pytest.mark.quick
def test_crossover_run_duration_holds_enough_requests():
    from argparse import Namespace

    from bench.studies.crossover import run_duration

    a = Namespace(duration=3.0, min_requests=1000, max_duration=120.0)
    assert run_duration(2000.0, a) == 3.0 and run_duration(100.0, a) == 10.0 and run_duration(1.0, a) == 120.0


def test_crossover_reuses_earlier_results(tmp_path, capsys):
    from bench.studies import crossover

    args = ["--models", "8b", "--lengths", "tiny=fixed:256:4", "--links", "400", "--devices", "2", "--duration", "1",
            "--modes", "time-shared,pooled", "--tolerance", "1.5", "--tune-grid", "small"]
    assert crossover.main(args + ["--out", str(tmp_path / "a.json"), "--png", str(tmp_path / "grid.png")]) == 0
    first = capsys.readouterr()
    assert (tmp_path / "grid.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert crossover.main(args + ["--reuse", str(tmp_path / "a.json")]) == 0
    again = capsys.readouterr()
    assert again.out == first.out and "capacity" not in again.err  # nothing searched again


@pytest.mark.quick
def test_sim_cli_table(capsys):
    from bench.sim.__main__ import main

    rc = main(["--mode", "colocated,pooled", "--devices", "2", "--prefill-devices", "1", "--trace", "poisson",
               "--lengths-from", "fixed:64:4", "--rates", "5,10", "--duration", "1", "--table"])
    assert rc == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("| trace | rate (req/s) | mode |")
    assert sum(1 for line in out if line.startswith("| poisson |")) == 4
    assert any("pooled 1P:1D" in line for line in out)


@pytest.mark.quick
@pytest.mark.parametrize("mode", ["time-shared", "colocated", "pooled"])
def test_overloaded_runs_abort_once_enough_requests_are_certainly_late(mode):
    from bench.sim import SimAborted

    # 200 prompts at once, each 100 ms of prefill on one prefill device: most wait past a 150 ms TTFT SLO.
    reqs = [TraceRequest(0.0, 90, 2) for _ in range(200)]
    cfg = SimConfig(mode=mode, devices=2, max_model_len=512, ttft_slo_ms=150.0, abort_late=20, **ORACLES,
                    max_num_batched_tokens=90)
    with pytest.raises(SimAborted):
        simulate(reqs, cfg, COST)
    assert simulate(reqs[:2], cfg, COST).summary.failed == 0  # a light load runs to the end


@pytest.mark.quick
def test_time_shared_respects_the_batch_cap():
    # Four 10-token prompts at once on one device capped at 2 sequences: the policy places two, the
    # other two wait until those finish (as the live driver's seq_slots_free makes it do).
    reqs = [TraceRequest(0.0, 10, 3) for _ in range(4)]
    res = simulate(reqs, SimConfig(mode="time-shared", devices=1, max_model_len=512, max_num_seqs=2), COST)
    firsts = sorted(t.token_times_s[0] for t in res.traces)
    lasts = sorted(t.token_times_s[-1] for t in res.traces)
    assert firsts[2] > lasts[1] and res.summary.failed == 0
    uncapped = simulate(reqs, SimConfig(mode="time-shared", devices=1, max_model_len=512, max_num_seqs=256), COST)
    assert len({t.token_times_s[0] for t in uncapped.traces}) == 1  # without the cap: one prefill step for all
