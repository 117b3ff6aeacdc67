"""Pooled (disaggregated) mode inside one node: prefill device → KV hand-off → decode device.

Greedy outputs equal the colocated/single-device reference for the stories260k cases and a mixed
load; every sequence's KV moved exactly once; nothing stays allocated; a saturated decode pool turns
into queueing or 503, never a hang (the seed's first failure mode)."""

import concurrent.futures as cf

import pytest

from support import STORIES, NodeProcess, raw_stream, reference_cases
from test_metrics import scrape
from test_time_shared import bodies, run

pytestmark = pytest.mark.slow_only("every test needs a pooled node (a prefill and a decode device) besides the quick tier's one node")


def test_pooled_reference_greedy(pooled_node):
    for case in reference_cases():
        r = pooled_node.client.post("/v1/completions", json={"prompt": case["prompt"], "max_tokens": case["max_new_tokens"],
                                                             "temperature": 0, "return_token_ids": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == case["output_token_ids"]
        assert r.json()["choices"][0]["text"] == case["output_text"]


def test_pooled_concurrent_equals_single_device(stories_node, pooled_node):
    reqs = bodies(24)
    ref = [r.json()["choices"][0]["token_ids"] for r in run(stories_node, reqs, 1)]
    before = len(pooled_node.status()["kv_transfers"])
    got = run(pooled_node, reqs, 24)
    assert [r.json()["choices"][0]["token_ids"] for r in got] == ref
    st = pooled_node.wait_idle()
    assert st["mode"] == "pooled" and [d["role"] for d in st["devices"]] == ["prefill", "decode"]
    moved = st["kv_transfers"][before:]
    multi = sum(1 for t in ref if len(t) > 1)  # one-token outputs finish on the prefill device
    assert len(moved) >= multi and all(m["src"] == "cpu:0" and m["dst"] == "cpu:1" and m["nbytes"] > 0 for m in moved)
    m = scrape(pooled_node)
    assert m["shiftnode_kv_transfers_total{dst=cpu:1,reason=pooled,src=cpu:0}"] >= len(moved)


def test_pooled_stream_has_no_gap_across_the_handoff(pooled_node):
    case = reference_cases()[1]
    with pooled_node.client.stream("POST", "/v1/completions", json={"prompt": case["prompt"], "max_tokens": 40,
                                                                    "temperature": 0, "stream": True, "return_token_ids": True}) as r:
        import json
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    ids = [t for e in events for c in e["choices"] for t in c["token_ids"]]
    assert ids == case["output_token_ids"][:40]


def test_saturated_decode_pool_queues_then_serves():
    """A decode pool that holds only two requests' reservations: the rest wait (or get 503), none hangs,
    and the prefill device never holds more than --max-unsent unsent caches."""
    node = NodeProcess("--model", str(STORIES), "--mode", "pooled", "--prefill-devices", "cpu:0", "--decode-devices", "cpu:1",
                       "--kv-cache-memory", str(40 * 16 * 1280), "--max-unsent", "2", "--max-queue", "64")
    try:
        reqs = [{"prompt": "Once upon a time", "max_tokens": 250, "ignore_eos": True, "temperature": 0}] * 8
        with cf.ThreadPoolExecutor(8) as pool:
            futs = [pool.submit(node.client.post, "/v1/completions", json=b) for b in reqs]
            peak = 0
            while not all(f.done() for f in futs):
                st = node.status()
                peak = max(peak, st["devices"][0]["running"] + st["devices"][0]["waiting"])
            got = [f.result() for f in futs]
        assert all(r.status_code == 200 for r in got)
        assert {r.json()["choices"][0]["text"] for r in got} == {got[0].json()["choices"][0]["text"]}
        assert peak <= 2
        node.wait_idle()
    finally:
        node.close()


SLOW_LINK_GBPS = 0.0003
"""The slow link of :func:`slow_link_node`: a block of stories260k KV (20 KiB) takes about 0.55 s over it."""


@pytest.fixture(scope="module")
def slow_link_node():
    """A pooled node whose hand-offs cross a slow link (``--link-gbps`` :data:`SLOW_LINK_GBPS`), shared by the
    three link tests below. Each leaves it idle (checked) and reads only the transfers made after its start
    (``kv_transfers`` keeps the last 200 moves; these tests make about a dozen)."""
    node = NodeProcess("--model", str(STORIES), "--mode", "pooled", "--prefill-devices", "cpu:0", "--decode-devices", "cpu:1",
                       "--link-gbps", str(SLOW_LINK_GBPS))
    yield node
    node.close()


def _transfers_since(st: dict, before: int) -> list[dict]:
    return st["kv_transfers"][before:]


def test_link_gbps_paces_transfers(slow_link_node):
    """--link-gbps G makes each hand-off of N bytes take about N*8/(G*1e9) s (within a generous factor)."""
    node = slow_link_node
    before = len(node.status()["kv_transfers"])
    # token ids no other test of the node sends (a prefix it had cached could shorten the hand-off): 3 blocks
    prompt = [1] + list(range(460, 500))
    r = node.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200
    (t,) = _transfers_since(node.wait_idle(), before)
    expected_s = t["nbytes"] * 8 / (SLOW_LINK_GBPS * 1e9)
    assert expected_s > 0.02
    assert 0.5 * expected_s <= t["end_s"] - t["start_s"] <= 5 * expected_s + 0.05


def test_prefill_device_goes_on_while_a_kv_copy_runs(slow_link_node):
    """Hand-offs overlap (DeviceEngine.migrate(overlap=True)): while one request's KV crawls over a slow
    link (--link-gbps 0.0003: ~1.1 s for its two blocks), the prefill device prefills and answers
    another request; with copies between steps that request would wait for the copy."""
    import json

    node = slow_link_node
    before = len(node.status()["kv_transfers"])
    case = reference_cases()[1]
    body = {"prompt": "Once upon a time " * 6, "max_tokens": 4, "temperature": 0, "stream": True, "return_token_ids": True}
    with node.client.stream("POST", "/v1/completions", json=body) as a:
        lines = a.iter_lines()
        first = next(x for x in lines if x.startswith("data: {"))  # A's prefill is done: its copy starts
        b = node.client.post("/v1/completions", json={"prompt": case["prompt"], "max_tokens": 1, "temperature": 0,
                                                      "return_token_ids": True})
        b_done_s = node.status()["clock_s"]
        rest = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert b.status_code == 200 and b.json()["choices"][0]["token_ids"] == case["output_token_ids"][:1]
    assert len(json.loads(first[6:])["choices"][0]["token_ids"]) + sum(
        len(c["token_ids"]) for e in rest for c in e["choices"]) == 4
    st = node.wait_idle()
    (t,) = _transfers_since(st, before)  # B's one token finished on the prefill device: only A moved
    assert t["blocks"] >= 2 and t["end_s"] - t["start_s"] > 0.3
    assert b_done_s < t["end_s"], (b_done_s, t)
    assert all(d["kv_blocks_used"] == 0 for d in st["devices"])


def test_clients_leaving_while_their_copies_queue_free_kv_at_once(slow_link_node):
    """Ten clients leave right after their first token while their KV queues for a slow link (each copy
    about 1.6 s at --link-gbps 0.0003): the queued copies are dropped, not sent, so both devices are
    empty within seconds (sending them all would take 16 s) and a new request is served."""
    node = slow_link_node
    before = len(node.status()["kv_transfers"])
    body = b'{"prompt": [1' + b", 300" * 40 + b'], "max_tokens": 200, "ignore_eos": true, "stream": true}'
    socks = [raw_stream(node.port, body) for _ in range(10)]
    for s in socks:  # every first token is out: prefill done, copies queued behind the link
        s.settimeout(30)
        got = b""
        while b"data: " not in got:
            got += s.recv(4096)
    for s in socks:
        s.close()
    st = node.wait_idle(8)
    assert all(d["kv_blocks_used"] == 0 for d in st["devices"])
    assert len(_transfers_since(st, before)) < 10  # the queued ones were never sent
    r = node.client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200


def test_b31_clients_leaving_right_after_prefill_free_both_sides(pooled_node):
    """Disconnect right after the first token (around the hand-off), many times: prefill and decode KV
    both return to zero and the node keeps serving."""
    import time

    body = b'{"prompt": "Once upon a time", "max_tokens": 300, "ignore_eos": true, "stream": true}'
    for _ in range(40):
        s = raw_stream(pooled_node.port, body)
        s.settimeout(10)
        got = b""
        while b"data: " not in got:  # the first token is out: prefill is done, the hand-off is near
            got += s.recv(4096)
        s.close()
        time.sleep(0.01)
    st = pooled_node.wait_idle(10)
    assert all(d["kv_blocks_used"] == 0 for d in st["devices"])
    assert pooled_node.client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 3}).status_code == 200
