"""Pooled mode across node processes: a prefill-only node hands every prefilled sequence to a
decode-only peer over TCP (``--peers`` / ``--kv-port`` / ``--peer-secret``), which decodes it and
relays the tokens back through the origin's HTTP stream.

On the session's peer pair (conftest): greedy outputs equal REF on unaligned prompt lengths (B34), a seeded
request equals its single-node run (B20), a client leaving frees the peer's copy (B25/B31), a burst and an
idle spell are served (B36); and the peer flags are validated. The fault cases, each on nodes of its own,
are in ``tests/test_peer_faults.py``, which takes this module's helpers.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import time

import pytest

from node.cli import config_from_args, serve_parser
from node.config import ConfigError
from support import STORIES, NodeProcess, reference_cases, sse_events
from test_metrics import scrape

SECRET = "test-peer-secret"


def decode_node(kv_port: int, *extra: str, secret: str = SECRET, wait: bool = True) -> NodeProcess:
    return NodeProcess("--model", str(STORIES), "--mode", "pooled", "--decode-devices", "cpu:0",
                       "--kv-port", str(kv_port), "--peer-secret", secret, *extra, wait=wait)


def prefill_node(kv_ports: list[int], *extra: str, secret: str = SECRET, wait: bool = True) -> NodeProcess:
    """A prefill-only node sending to ``kv_ports``; it may start before its peers (it reconnects)."""
    return NodeProcess("--model", str(STORIES), "--mode", "pooled", "--prefill-devices", "cpu:0",
                       "--peers", ",".join(f"127.0.0.1:{p}" for p in kv_ports), "--peer-secret", secret, *extra,
                       wait=wait)


def wait_peers(node: NodeProcess, healthy: int, timeout_s: float = 10.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        peers = node.status()["network"]["peers"]
        if sum(p["healthy"] for p in peers) >= healthy:
            return peers
        if time.monotonic() > deadline:
            raise AssertionError(f"peers not healthy after {timeout_s}s: {peers}")
        time.sleep(0.05)


def stream_tokens(node: NodeProcess, body: dict, on_event=None) -> tuple[list[int], list]:
    """Stream a completion; return the token ids of choice 0 in order and the parsed events."""
    with node.client.stream("POST", "/v1/completions", json={**body, "stream": True, "return_token_ids": True}) as r:
        assert r.status_code == 200, r.read()
        lines = []
        for line in r.iter_lines():
            lines.append(line)
            if on_event is not None and line.startswith("data: {"):
                event = json.loads(line[6:])
                if "choices" in event:
                    on_event(event)
    events = sse_events(lines)
    ids = [t for e in events if e != "[DONE]" for c in e.get("choices", []) if c["index"] == 0
           for t in c.get("token_ids") or []]
    return ids, events


@pytest.fixture
def pair(peer_pair):
    """(prefill node, decode node) of the session's pair (conftest)."""
    return peer_pair


def test_two_nodes_equal_reference_and_leave_nothing_behind(pair):
    p, d = pair
    for case in reference_cases():  # unaligned prompt lengths (B34): REF token for token
        r = p.client.post("/v1/completions", json={"prompt": case["prompt"], "max_tokens": case["max_new_tokens"],
                                                   "temperature": 0, "return_token_ids": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == case["output_token_ids"]
        assert r.json()["choices"][0]["text"] == case["output_text"]
    case = reference_cases()[1]
    ids, _ = stream_tokens(p, {"prompt": case["prompt"], "max_tokens": case["max_new_tokens"], "temperature": 0})
    assert ids == case["output_token_ids"]  # the stream has no gap or duplicate across the hand-off
    st_p, st_d = p.wait_idle(), d.wait_idle()
    assert st_d["network"]["received_sequences"] >= len(reference_cases()) + 1
    peer = st_p["network"]["peers"][0]
    assert peer["healthy"] and peer["sent"] >= len(reference_cases()) + 1 and peer["failures"] == 0
    assert peer["state"] == "ready" and peer["reason"] is None and peer["node_id"] == st_d["network"]["node_id"]
    assert st_p["network"]["fingerprint"] == st_d["network"]["fingerprint"] and st_p["network"]["fingerprint"]["digest"]
    assert p.health() == (200, {"status": "ok"}) and d.health() == (200, {"status": "ok"})
    moved = [t for t in st_p["kv_transfers"] if t["dst"].startswith("peer:")]
    assert moved and all(t["nbytes"] > 0 and t["reason"] == "pooled" for t in moved)
    assert scrape(p)[f"shiftnode_kv_transfers_total{{dst=peer:127.0.0.1:{st_d['network']['kv_port']},reason=pooled,src=cpu:0}}"] >= len(moved)


def test_seeded_sampling_n2_logprobs_stop_match_one_node(pair, stories_node):
    """Sampling state crosses the wire: seeded n=2 with logprobs and a stop string equals one node (B20)."""
    p, _ = pair
    body = {"prompt": "Once upon a time", "max_tokens": 40, "temperature": 0.8, "seed": 7, "n": 2,
            "logprobs": 2, "stop": ["the end"], "return_token_ids": True}
    want = stories_node.client.post("/v1/completions", json=body).json()["choices"]
    got = p.client.post("/v1/completions", json=body).json()["choices"]
    key = lambda c: c["index"]  # noqa: E731
    for a, b in zip(sorted(want, key=key), sorted(got, key=key)):
        assert (a["text"], a["token_ids"], a["finish_reason"]) == (b["text"], b["token_ids"], b["finish_reason"])
        assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
        assert a["logprobs"]["token_logprobs"] == pytest.approx(b["logprobs"]["token_logprobs"], abs=1e-5)


def test_client_leaving_frees_the_peers_copy(pair):
    """B25/B31 across nodes: close streams mid-decode; both nodes return to zero KV at once."""
    p, d = pair
    for _ in range(5):
        with p.client.stream("POST", "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 400,
                                                              "ignore_eos": True, "temperature": 0, "stream": True}) as r:
            for i, line in enumerate(r.iter_lines()):
                if i > 12:
                    break
    p.wait_idle(5)
    d.wait_idle(5)


def test_burst_then_idle_then_serve(pair):
    """B36: a 64-request burst across the pair completes, and after an idle spell the pair still serves
    (the capacity polls keep the control connection alive; every hand-off opens a fresh one)."""
    p, d = pair
    body = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}
    with cf.ThreadPoolExecutor(64) as ex:
        res = list(ex.map(lambda _: p.client.post("/v1/completions", json=body), range(64)))
    assert {r.status_code for r in res} == {200} and len({r.json()["choices"][0]["text"] for r in res}) == 1
    time.sleep(2.0)
    assert p.client.post("/v1/completions", json=body).json()["choices"][0]["text"] == res[0].json()["choices"][0]["text"]
    p.wait_idle(5)
    d.wait_idle(5)


@pytest.mark.quick
@pytest.mark.parametrize("argv,message", [
    (["--mode", "pooled", "--prefill-devices", "cpu:0"], "needs --peers"),
    (["--mode", "pooled", "--decode-devices", "cpu:0"], "needs --kv-port"),
    (["--mode", "pooled", "--prefill-devices", "cpu:0", "--peers", "127.0.0.1:9"], "need --peer-secret"),
    (["--mode", "pooled", "--prefill-devices", "cpu:0", "--peers", "nohost", "--peer-secret", "s"], "host:port"),
    (["--mode", "colocated", "--peers", "127.0.0.1:9", "--peer-secret", "s"], "pooled and time-shared"),
    (["--kv-port", "70000", "--peer-secret", "s"], "--kv-port"),
    (["--max-retries", "-1"], "--max-retries"),
    (["--imbalance-threshold", "-1"], "--imbalance-threshold"),
    (["--kv-transfer-timeout-s", "1"], "relay keep-alive"),
    (["--kv-connect-timeout-s", "0"], "--kv-connect-timeout-s"),
])
def test_peer_flags_are_validated(argv, message, monkeypatch):
    monkeypatch.delenv("SHIFTNODE_PEER_SECRET", raising=False)
    parser = argparse.ArgumentParser()
    serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", *argv])
    with pytest.raises(ConfigError, match=message):
        config_from_args(args).validate()
