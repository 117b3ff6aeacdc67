"""Continuous batching under concurrency, preemption, and aborts (ABORT-LIFECYCLE, SCHED-LOAD cases)."""

import concurrent.futures as cf
import time

import httpx
import pytest

from support import STORIES, NodeProcess, raw_stream, reference_cases

PROMPTS = [c["prompt"] for c in reference_cases()] + ["Tom had a red", "The sun was", "A bird", "Sara and her mom"]


def requests_mix(k: int) -> list[dict]:
    return [{"prompt": PROMPTS[i % len(PROMPTS)] * (1 + i % 3), "max_tokens": 8 + (i * 7) % 60, "temperature": 0,
             "return_token_ids": True} for i in range(k)]


def run_all(node: NodeProcess, bodies: list[dict], workers: int) -> list[list[int]]:
    def one(body):
        r = node.client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    with cf.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, bodies))


@pytest.mark.quick
def test_32_concurrent_equal_sequential(stories_node):
    bodies = requests_mix(32)
    sequential = [run_all(stories_node, [b], 1)[0] for b in bodies]
    concurrent = run_all(stories_node, bodies, 32)
    assert concurrent == sequential
    st = stories_node.wait_idle()
    assert all(d["kv_blocks_free"] == d["kv_blocks_total"] for d in st["devices"])


@pytest.fixture(scope="module")
def b28_bodies_and_ref(stories_node) -> tuple[list[dict], list[list[int]]]:
    """The B28 load and its REF (each request alone on the unpressured node), shared by both modes."""
    bodies = [{**b, "max_tokens": 60 + i % 40, "ignore_eos": True} for i, b in enumerate(requests_mix(24))]
    return bodies, [run_all(stories_node, [b], 1)[0] for b in bodies]


@pytest.mark.parametrize("mode", ["colocated", "time-shared"])
def test_b28_tiny_pool_keeps_outputs(request, mode):
    """A pool of 40 blocks (640 tokens) for 24 concurrent sequences: colocated mode must preempt and
    recompute; time-shared mode admits against reserved KV instead. Outputs equal REF either way."""
    small = NodeProcess("--model", str(STORIES), "--kv-cache-memory", str(40 * 16 * 1280), "--max-model-len", "512",
                        "--mode", mode, wait=False)
    try:
        bodies, ref = request.getfixturevalue("b28_bodies_and_ref")  # REF (once) while the small node starts
        small.wait_up()
        got = run_all(small, bodies, 24)
        st = small.wait_idle()
        assert got == ref
        if mode == "colocated":
            assert st["devices"][0]["preemptions"] > 0
        assert st["devices"][0]["kv_blocks_free"] == 40
    finally:
        small.close()


def test_b25_abort_mid_prefill_and_mid_decode():
    """Clients that vanish mid-prefill (a long prompt, 8-token chunks) or mid-decode free their blocks at once."""
    node = NodeProcess("--model", str(STORIES), "--max-num-batched-tokens", "8")
    try:
        long_prompt = b'{"prompt": [' + b",".join([b"300"] * 500) + b'], "max_tokens": 10, "stream": true}'
        socks = [raw_stream(node.port, long_prompt) for _ in range(4)]
        deadline = time.monotonic() + 5
        while not any(d["kv_blocks_used"] > 0 for d in node.status()["devices"]):  # wait for the prefill
            assert time.monotonic() < deadline, "the prefill never started"
            time.sleep(0.005)
        assert any(d["running"] and d["resident_decoding"] == 0 for d in node.status()["devices"])  # mid-prefill
        for s in socks:
            s.close()
        node.wait_idle(5)
        decode = b'{"prompt": "Once upon a time", "max_tokens": 450, "ignore_eos": true, "stream": %s}'
        socks = [raw_stream(node.port, decode % b"true"), raw_stream(node.port, decode % b"false")]
        time.sleep(0.5)
        st = node.status()["devices"][0]
        assert st["running"] == 2 and st["kv_blocks_used"] > 0  # both decoding
        for s in socks:
            s.close()
        node.wait_idle(5)
        # The node keeps serving.
        assert node.client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 3}).status_code == 200
    finally:
        node.close()


@pytest.mark.quick
def test_stream_client_closing_early_frees_blocks(stories_node):
    with httpx.Client(base_url=stories_node.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 400,
                                                       "ignore_eos": True, "stream": True}) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i > 5:
                    break
    stories_node.wait_idle(5)
