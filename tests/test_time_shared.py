"""Time-shared node on two emulated devices: same greedy outputs as one device, visible role switches,
overload answered with 503 + Retry-After, nothing leaked (issue: time-shared node; SCHED-LOAD cases)."""

import time

import httpx
import pytest

from support import STORIES, NodeProcess, post_concurrently, reference_cases
from test_metrics import scrape

pytestmark = pytest.mark.slow_only("every test starts a node of its own (time-shared, colocated, or with tight queue limits)")

PROMPTS = [c["prompt"] for c in reference_cases()] + ["Tom had a red", "The sun was", "A bird", "Sara and her mom"]
FLOOR_MS = 15.0


def bodies(k: int) -> list[dict]:
    return [{"prompt": PROMPTS[i % len(PROMPTS)] * (1 + i % 4), "max_tokens": 5 + (i * 13) % 70, "temperature": 0,
             "return_token_ids": True} for i in range(k)]


def run(node: NodeProcess, reqs: list[dict], workers: int) -> list[httpx.Response]:
    return post_concurrently(node, "/v1/completions", reqs, workers)


@pytest.fixture
def two_device_node():
    """Launched, not yet up: the test computes REF while it starts, then waits for it."""
    node = NodeProcess("--model", str(STORIES), "--mode", "time-shared", "--devices", "cpu:0,cpu:1",
                       "--reconfig-pause-ms", str(FLOOR_MS), "--tpot-slo-ms", "200", "--ttft-slo-ms", "2000", wait=False)
    yield node
    node.close()


def test_two_devices_match_single_device_and_switch_roles(stories_node, two_device_node):
    reqs = bodies(40)
    ref = [r.json()["choices"][0]["token_ids"] for r in run(stories_node, reqs, 1)]
    two_device_node.wait_up()
    got = run(two_device_node, reqs, 40)
    assert all(r.status_code == 200 for r in got)
    assert [r.json()["choices"][0]["token_ids"] for r in got] == ref
    st = two_device_node.wait_idle()
    deadline = time.monotonic() + 5  # idle devices park back in PREFILL right after the last request
    while time.monotonic() < deadline and any(d["role"] != "prefill" for d in st["devices"]):
        time.sleep(0.05)
        st = two_device_node.status()
    assert st["mode"] == "time-shared"
    switches = [s for d in st["devices"] for s in d["switches"]]
    assert switches, st
    assert all(s["pause_ms"] >= FLOOR_MS for s in switches)
    assert all(s["end_s"] - s["start_s"] >= FLOOR_MS / 1e3 for s in switches)
    assert {s["to_role"] for s in switches} >= {"decode", "prefill"}
    assert all(d["kv_blocks_used"] == 0 for d in st["devices"])
    assert sum(d["steps"] for d in st["devices"]) > 0 and all(d["steps"] > 0 for d in st["devices"])
    m = scrape(two_device_node)
    total = sum(v for k, v in m.items() if k.startswith("shiftnode_role_switches_total"))
    assert total == len(switches)
    pauses = sum(v for k, v in m.items() if k.startswith("shiftnode_role_switch_pause_seconds_count"))
    assert pauses == len(switches)
    assert sum(v for k, v in m.items() if k.startswith("shiftnode_role_switch_pause_seconds_sum")) >= len(switches) * FLOOR_MS / 1e3


def test_colocated_mode_same_outputs(stories_node):
    reqs = bodies(16)
    node = NodeProcess("--model", str(STORIES), "--devices", "cpu:0,cpu:1", "--mode", "colocated", "--max-num-batched-tokens", "32",
                       wait=False)  # starts while REF is computed
    try:
        ref = [r.json()["choices"][0]["token_ids"] for r in run(stories_node, reqs, 1)]
        node.wait_up()
        got = run(node, reqs, 16)
        assert [r.json()["choices"][0]["token_ids"] for r in got] == ref
        st = node.wait_idle()
        assert st["mode"] == "colocated" and all(d["role"] == "mixed" for d in st["devices"])
    finally:
        node.close()


def test_overload_gets_503_with_retry_after_and_nothing_leaks(limits_node):
    """--max-queue 4, --max-num-seqs 2 (the session's ``limits_node``)."""
    node = limits_node
    rejected_before = scrape(node).get("shiftnode_rejected_requests_total", 0)
    reqs = [{"prompt": "Once upon a time", "max_tokens": 80, "ignore_eos": True, "temperature": 0}] * 30
    got = run(node, reqs, 30)
    codes = [r.status_code for r in got]
    assert set(codes) <= {200, 503} and codes.count(503) > 0 and codes.count(200) >= 4
    for r in got:
        if r.status_code == 503:
            assert r.headers["Retry-After"] and r.json()["error"]["type"] == "service_unavailable"
        else:
            assert r.json()["usage"]["completion_tokens"] == 80
    # every 503 for overload is counted (the API's own queue check counted none before)
    assert scrape(node)["shiftnode_rejected_requests_total"] - rejected_before == codes.count(503)
    node.wait_idle()
    assert node.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    # More choices than one device's batch can hold could never be placed: a 400, not a hang.
    r = node.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_b30_burst_of_500_and_one_request_filling_the_pool():
    # The pool holds exactly one max-length sequence (32 blocks of 16 = 512 tokens).
    node = NodeProcess("--model", str(STORIES), "--devices", "cpu:0,cpu:1", "--kv-cache-memory", str(32 * 16 * 1280),
                       "--max-queue", "1000")
    try:
        big = node.client.post("/v1/completions", json={"prompt": [1] + [300] * 499, "max_tokens": 12, "ignore_eos": True})
        assert big.status_code == 200 and big.json()["usage"]["completion_tokens"] == 12
        reqs = [{"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 1 + i % 8, "temperature": 0} for i in range(500)]
        got = run(node, reqs, 64)
        assert [r.status_code for r in got] == [200] * 500
        assert all(r.json()["usage"]["completion_tokens"] <= 1 + i % 8 for i, r in enumerate(got))
        node.wait_idle()
        assert node.alive()
    finally:
        node.close()


def test_stream_gets_keepalive_comments_through_a_pause():
    node = NodeProcess("--model", str(STORIES), "--mode", "time-shared", "--reconfig-pause-ms", "1200",
                       "--sse-keepalive-s", "0.2")
    try:
        with node.client.stream("POST", "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 4,
                                                                  "temperature": 0, "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line]
        comments = [line for line in lines if line.startswith(":")]
        assert comments and all(c == ": keep-alive" for c in comments)
        data = [line for line in lines if line.startswith("data: ")]
        assert data[-1] == "data: [DONE]"
        switches = node.status()["devices"][0]["switches"]
        assert any(s["to_role"] == "decode" and s["pause_ms"] >= 1200 for s in switches)
    finally:
        node.close()
