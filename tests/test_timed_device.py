"""``--benchmark-model timed:PATH``: devices that compute nothing and take a cost model's time per step
(NVIDIA Dynamo's mocker idea), with KV blocks counted and moved at the geometry's size."""

import concurrent.futures
import json
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from bench.sim.stepcost import mixed_step_s
from node.config import ConfigError, NodeConfig
from node.core.cost import CostModel
from node.timed_cost import CostFileError, load_step_cost, step_seconds
from node.plan import Geometry, kv_bytes_per_token
from node.transport.local import copy_sequence_blocks
from node.worker.timed_step import StepPacer, step_work
from support import REPO, NodeProcess

LLAMA8B = REPO / "bench" / "configs" / "llama3-8b"
DECODE_S = 0.020  # the test cost model's decode step (s)
COST = {"prefill_fixed_s": 0.010, "prefill_per_token_s": 1e-4, "decode_fixed_s": DECODE_S, "decode_per_seq_s": 0.0,
        "calibration": {"note": "extra keys are ignored"}}
KV_MEMORY = 1 << 30


def _geometry_block_bytes(block_size: int = 16) -> int:
    """KV bytes of one block of Llama-3-8B at its bfloat16 dtype, by the planner's formula (node.plan)."""
    g = Geometry.from_config(json.loads((LLAMA8B / "config.json").read_text()))
    return block_size * kv_bytes_per_token(g, 2)


@pytest.fixture
def cost_file(tmp_path):
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(COST))
    return path


def _timed_node(cost_file, *args):
    return NodeProcess("--model", str(LLAMA8B), "--benchmark-model", f"timed:{cost_file}", "--kv-cache-memory",
                       str(KV_MEMORY), "--max-model-len", "2048", *args)


@pytest.mark.quick
def test_cost_file_drops_unknown_keys_and_steps_follow_the_simulator_formula(cost_file):
    cost = load_step_cost(cost_file)
    assert cost == CostModel(**{k: v for k, v in COST.items() if k != "calibration"})
    for work in [(100, 0, 0), (0, 4, 4000), (100, 4, 4000), (0, 0, 0), (1, 1, 10)]:
        assert step_seconds(cost, *work) == pytest.approx(mixed_step_s(cost, *work))
    assert step_seconds(cost, 0, 3, 300) == pytest.approx(DECODE_S)
    assert step_seconds(cost, 50, 2, 100) == pytest.approx(max(0.010, DECODE_S) + 50 * 1e-4)
    for path in sorted((REPO / "bench" / "cost_models").glob("*.json")):  # the shipped files load, both kinds
        shipped = load_step_cost(path)
        assert 0 < shipped.decode_step_s(1, 1024) < shipped.decode_step_s(64, 64 * 1024), path
        assert step_seconds(shipped, 100, 4, 4000) == pytest.approx(shipped.mixed_step_s(100, 4, 4000))
    assert type(load_step_cost(REPO / "bench/cost_models/h200_llama3_8b_roofline.json")).__name__ == "RooflineCost"


@pytest.mark.quick
def test_step_work_reads_decode_and_prompt_items():
    items = [SimpleNamespace(seq_id="a", start=0, num_tokens=7),  # a prompt's first chunk
             SimpleNamespace(seq_id="b", start=9, num_tokens=1),  # decoding: context 10
             SimpleNamespace(seq_id="c", start=4, num_tokens=1),  # the last prompt token of c (prompt 5)
             SimpleNamespace(seq_id="d", start=5, num_tokens=1)]  # decoding: context 6
    assert step_work(items, {"a": 12, "b": 3, "c": 5, "d": 5}) == (8, 2, 16)


@pytest.mark.quick
def test_pacer_sleeps_only_what_host_work_left_of_the_step():
    now = [0.0]
    slept = []
    pacer = StepPacer(CostModel(decode_fixed_s=DECODE_S), clock=lambda: now[0], sleep=slept.append)
    now[0] = 0.004  # host work already spent since the step started at 0
    assert pacer.finish(0.0, (0, 1, 10)) == pytest.approx(DECODE_S)
    now[0] = 1.0 + 0.025  # host work longer than the modelled step: nothing to sleep
    pacer.finish(1.0, (0, 1, 10))
    assert slept == [pytest.approx(DECODE_S - 0.004)]
    assert pacer.steps == 2 and pacer.overrun_steps == 1


@pytest.mark.quick
@pytest.mark.parametrize("content, message", [(None, "is not a file"), ("{not json", "not valid JSON"),
                                              ("[1, 2]", "JSON object"), ('{"decode_fixed_s": "x"}', "decode_fixed_s"),
                                              ('{"decode_fixed_s": NaN}', "finite")])
def test_bad_cost_files_are_config_errors(tmp_path, content, message):
    path = tmp_path / "cost.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        NodeConfig(benchmark_model=f"timed:{path}", kv_cache_memory_bytes=KV_MEMORY).validate()
    with pytest.raises(CostFileError, match=message):
        load_step_cost(path)


@pytest.mark.quick
def test_timed_flags_the_node_cannot_run_with(cost_file):
    spec = f"timed:{cost_file}"
    NodeConfig(benchmark_model=spec, kv_cache_memory_bytes=KV_MEMORY).validate()
    with pytest.raises(ConfigError, match="--benchmark-model must be"):
        NodeConfig(benchmark_model="timed:", kv_cache_memory_bytes=KV_MEMORY).validate()
    with pytest.raises(ConfigError, match="needs --kv-cache-memory"):
        NodeConfig(benchmark_model=spec).validate()
    with pytest.raises(ConfigError, match="not with --peers"):
        NodeConfig(benchmark_model=spec, kv_cache_memory_bytes=KV_MEMORY, kv_port=0, peer_secret="s").validate()
    r = subprocess.run([sys.executable, "-m", "node.cli", "serve", "--benchmark-model", "timed:/no/such.json",
                        "--kv-cache-memory", "1GiB"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "timed:/no/such.json" in lines[0] and "is not a file" in lines[0], r.stderr


@pytest.mark.quick
def test_copy_paces_and_reports_the_emulated_block_bytes():
    src = torch.arange(4 * 2 * 6, dtype=torch.bfloat16).view(4, 2, 6, 1, 1, 1)  # 4 layers, 6 tiny blocks
    dst = torch.zeros(4, 2, 8, 1, 1, 1, dtype=torch.bfloat16)
    per_block = 1 << 20  # each block of each layer stands for 1 MiB
    report = copy_sequence_blocks(src, [1, 2, 3], dst, [5, 0, 7], link_gbps=1.0, block_layer_bytes=per_block)
    assert report.nbytes == 4 * 3 * per_block
    assert report.total_s >= report.nbytes * 8 / 1e9 * 0.95  # 100 ms at 1 Gb/s
    assert torch.equal(dst[:, :, [5, 0, 7]], src[:, :, [1, 2, 3]])  # the tiny blocks moved all the same


def test_colocated_timed_steps_and_geometry_sized_ledger(cost_file):
    node = _timed_node(cost_file, "--mode", "colocated", "--device", "cpu:1")
    try:
        st = node.status()
        assert st["benchmark_model"] == f"timed:{cost_file}"
        dev = st["devices"][0]
        assert dev["device"] == "cpu:1"
        assert dev["kv_blocks_total"] == KV_MEMORY // _geometry_block_bytes() == 512
        assert dev["kv_pool_bytes"] <= 32 * 2 * 512 * 2  # one bf16 element per block, layer and K/V: 64 KiB
        steps0, busy0 = dev["steps"], dev["engine_busy_s"]
        t0 = time.perf_counter()
        r = node.client.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 30, "temperature": 0})
        wall = time.perf_counter() - t0
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 30
        dev = node.status()["devices"][0]
        steps, busy = dev["steps"] - steps0, dev["engine_busy_s"] - busy0
        assert steps == 30  # one prefill step, then 29 decode steps
        modelled = 0.010 + 1e-4 * r.json()["usage"]["prompt_tokens"] + 29 * DECODE_S
        assert busy >= modelled * 0.98, (busy, modelled)  # each step lasts at least its modelled time
        assert wall >= modelled * 0.98 and busy / steps < DECODE_S * 2.5, (wall, busy, steps)  # loose: a loaded box
    finally:
        node.close()


def _complete_concurrently(node, n: int, max_tokens: int, prompt: str) -> list:
    results = [None] * n

    def one(i):
        results[i] = node.client.post("/v1/completions", json={"prompt": f"{i} {prompt}", "max_tokens": max_tokens,
                                                               "temperature": 0})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


def test_time_shared_two_timed_devices_complete_requests(cost_file):
    node = _timed_node(cost_file, "--mode", "time-shared", "--devices", "cpu:0,cpu:1")
    try:
        results = _complete_concurrently(node, 6, 12, "The quick brown fox")
        assert all(r is not None and r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12
                   for r in results), [r and r.text for r in results]
        st = node.wait_idle()
        assert all(d["kv_blocks_total"] == 512 for d in st["devices"])
        for m in st["kv_transfers"]:  # any fallback migration is counted at the geometry's size
            sent, rest = divmod(m["nbytes"], _geometry_block_bytes())  # reused prefix blocks are not sent
            assert rest == 0 and sent <= m["blocks"], m
    finally:
        node.close()


def test_pooled_hand_off_takes_the_geometry_sized_transfer_time(cost_file):
    link_gbps = 1.0
    node = _timed_node(cost_file, "--mode", "pooled", "--prefill-devices", "cpu:0", "--decode-devices", "cpu:1",
                       "--link-gbps", str(link_gbps))
    try:
        results = _complete_concurrently(node, 2, 4, "word " * 12)  # distinct first blocks: nothing to reuse
        assert all(r is not None and r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
                   for r in results), [r and r.text for r in results]
        st = node.wait_idle()
        moves = st["kv_transfers"]
        assert len(moves) == 2 and all(m["src"] == "cpu:0" and m["dst"] == "cpu:1" for m in moves), moves
        for m in moves:
            # fresh caches and distinct first blocks: every block is sent
            assert m["blocks"] >= 3 and m["nbytes"] == m["blocks"] * _geometry_block_bytes(), m
            line_rate_s = m["nbytes"] * 8 / (link_gbps * 1e9)  # >= 50 ms for 3 blocks of 2 MiB
            assert line_rate_s * 0.95 <= m["end_s"] - m["start_s"] < line_rate_s * 2 + 0.5, m
    finally:
        node.close()


def test_time_shared_fallback_migration_takes_the_geometry_sized_transfer_time(tmp_path):
    """As ``tests/test_migration.py``'s fallback node: the pause back to DECODE (200 ms) exceeds the TPOT
    target, so a request prefilled beside a decoding device moves to it ("tpot"), here at 1 Gb/s and the
    geometry's 2 MiB per block."""
    fast = tmp_path / "fast.json"
    fast.write_text(json.dumps({**COST, "decode_fixed_s": 0.005}))
    node = _timed_node(fast, "--mode", "time-shared", "--devices", "cpu:0,cpu:1", "--reconfig-pause-ms", "200", "--tpot-slo-ms", "100",
                       "--ttft-slo-ms", "10000", "--imbalance-threshold", "1", "--link-gbps", "1")
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            filler = pool.submit(node.client.post, "/v1/completions",
                                 json={"prompt": "a long story", "max_tokens": 600, "temperature": 0})
            deadline = time.monotonic() + 30
            while not any(d["role"] == "decode" and d["resident_decoding"] for d in node.status()["devices"]):
                assert time.monotonic() < deadline and not filler.done(), node.status()
                time.sleep(0.01)
            decoder = next(d["device"] for d in node.status()["devices"] if d["role"] == "decode")
            r = node.client.post("/v1/completions", json={"prompt": "word " * 12, "max_tokens": 20, "temperature": 0})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 20
            assert not filler.done(), "the long request ended before the second one did"
            assert filler.result().json()["usage"]["completion_tokens"] == 600
        moved = [m for m in node.wait_idle()["kv_transfers"] if m["reason"] == "tpot"]
        assert moved and all(m["dst"] == decoder for m in moved), moved
        for m in moved:
            assert m["nbytes"] > 0 and m["nbytes"] % _geometry_block_bytes() == 0, m
            assert m["end_s"] - m["start_s"] >= m["nbytes"] * 8 / 1e9 * 0.95, m
    finally:
        node.close()


def test_time_shared_policies_start_from_the_timed_cost_model_and_charge_geometry_copies(cost_file):
    import asyncio

    from node.runtime.node import Node

    async def go():
        node = await Node.create(NodeConfig(model=str(LLAMA8B), benchmark_model=f"timed:{cost_file}",
                                            kv_cache_memory_bytes=KV_MEMORY, max_model_len=2048, mode="time-shared",
                                            devices=["cpu:0", "cpu:1"], link_gbps=10.0, reconfig_pause_ms=3.0,
                                            engine_layout="thread"))
        try:
            cost = node.driver.scheduler.cost
            assert (cost.decode_fixed_s, cost.prefill_per_token_s) == (DECODE_S, COST["prefill_per_token_s"])
            assert cost.pause_s == pytest.approx(0.003)  # the file has none: the configured floor
            assert node.driver.refits is False  # a timed device's steps are its model's by construction
            per_token = _geometry_block_bytes() // 16  # not the tiny pool's bytes
            assert node.driver.imbalance.config.local_transfer_s_per_token == pytest.approx(per_token * 8 / 10e9)
            assert node.driver.scheduler.config.copy_s_per_token == pytest.approx(per_token * 8 / 10e9)  # hand-offs
        finally:
            await node.close()

    asyncio.run(go())


@pytest.mark.quick
def test_cost_model_flag_seeds_the_role_policy_with_either_kind(tmp_path):
    import asyncio

    from node.core.roofline import RooflineCost
    from node.runtime.node import Node

    roofline = REPO / "bench" / "cost_models" / "h200_llama3_8b_roofline.json"
    with pytest.raises(ConfigError, match="--cost-model"):
        NodeConfig(cost_model=str(tmp_path / "missing.json")).validate()
    for name, doc in (("negative.json", {"decode_fixed_s": -0.005}), ("empty.json", {}),
                      ("roofline-negative.json", json.loads(roofline.read_text()) | {"hbm_bandwidth_Bps": -1.0})):
        (tmp_path / name).write_text(json.dumps(doc))
        with pytest.raises(ConfigError, match="--cost-model"):
            NodeConfig(cost_model=str(tmp_path / name)).validate()
    with pytest.raises(ConfigError, match="not with --mode colocated"):
        NodeConfig(cost_model=str(roofline), mode="colocated").validate()

    async def go():
        node = await Node.create(NodeConfig(model=str(LLAMA8B), benchmark_model="zero", max_model_len=2048,
                                            kv_cache_memory_bytes=KV_MEMORY, mode="time-shared", devices=["cpu:0"],
                                            cost_model=str(roofline), engine_layout="thread"))
        try:
            cost = node.driver.scheduler.cost
            assert isinstance(cost, RooflineCost) and node.driver.imbalance.cost is cost
            assert node.status()["cost_model"] == str(roofline)
            node.driver.refit()  # a roofline model is kept, not refitted into the linear form
            assert node.driver.scheduler.cost is cost and node.driver.refits  # (a real device would refit a linear one)
        finally:
            await node.close()

    asyncio.run(go())
