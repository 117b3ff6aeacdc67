"""Pooled mode across node processes under faults and limits: each test starts a prefill-only node and its
decode-only peers (``tests/test_peers.py``'s helpers; four tests share one default decode node, see
``default_pair``) and kills, stops, restarts, refuses or saturates one of them. A saturated peer makes the origin queue instead of prefilling; the sending node killed
mid-transfer leaves no blocks on the receiver (B32); the receiver killed mid-transfer or mid-decode makes the
origin retry (re-send, or recompute the prompt plus the tokens already streamed) with no gap or duplicate; a dead
decode side ends requests with a clear error within bounded time; wrong secrets, layouts and weights are
refused; source blocks under eviction pressure stay pinned until sent (B35); a peer restarting under load ends
every request (B36, B38); the time-shared fallback and a drain move decoding sequences to a peer node; peers are
added and removed at run time; a relay stalled past its timeout is recomputed.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import time

import httpx
import pytest

from model_copies import change_one_weight, copy_model
from support import STORIES, NodeProcess, free_port, reference_cases, up
from test_metrics import scrape
from test_peers import SECRET, decode_node, prefill_node, stream_tokens, wait_peers

pytestmark = pytest.mark.slow_only("each test starts a prefill node and decode peers of its own, and kills, stops or "
                                   "refuses one of them")


@pytest.fixture(scope="module")
def default_pair():
    """A prefill node and one decode peer at default settings, as (prefill, decode, the decode node's KV
    port, the nodes to close at the module's end). The decode node is also the receiver of the
    sender-killed and eviction tests (each with a prefill node of its own; each leaves it idle, checked);
    the stall test stops it for 2 s under load; the restart test, the last user, kills it."""
    port = free_port()
    d, p = up(decode_node(port, wait=False), prefill_node([port], wait=False))
    nodes = [p, d]
    try:
        yield p, d, port, nodes
    finally:
        for n in nodes:
            n.close()


def test_saturated_peer_backpressure_queues_instead_of_prefilling():
    """The decode peer holds only a few sequences: the prefill node keeps at most --max-unsent
    prefilled-but-unsent caches, the rest queue, and every request completes."""
    port = free_port()
    d, p = up(decode_node(port, "--max-num-seqs", "2", wait=False), prefill_node([port], "--max-unsent", "2", wait=False))
    try:
        wait_peers(p, 1)
        body = {"prompt": "Once upon a time", "max_tokens": 60, "ignore_eos": True, "temperature": 0}
        peak = 0
        with cf.ThreadPoolExecutor(12) as ex:
            futs = [ex.submit(p.client.post, "/v1/completions", json=body) for _ in range(12)]
            while not all(f.done() for f in futs):
                dev = p.status()["devices"][0]
                peak = max(peak, dev["running"] + dev["waiting"])
                time.sleep(0.01)
        assert [f.result().status_code for f in futs] == [200] * 12
        assert len({f.result().json()["choices"][0]["text"] for f in futs}) == 1
        assert peak <= 2  # the prefill device never held more than --max-unsent requests
        p.wait_idle(5)
        d.wait_idle(5)
    finally:
        p.close()
        d.close()


def test_sender_killed_mid_transfer_receiver_frees_blocks(default_pair):
    """B32: kill -9 the sending node while a slow link streams a long prompt's KV; the receiver (the
    module's decode node) frees the partial reservation, stays up, and the request retried on a fresh
    origin completes."""
    _, d, port, _ = default_pair
    p = prefill_node([port], "--link-gbps", "0.002")  # ~0.5 MB of KV: about 2 s on the wire
    p2 = None
    try:
        wait_peers(p, 1)
        case = reference_cases()[0]
        prompt = list(range(3, 403))
        with cf.ThreadPoolExecutor(1) as ex:
            fut = ex.submit(p.client.post, "/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0})
            deadline = time.monotonic() + 20
            while d.status()["devices"][0]["kv_blocks_used"] == 0:  # the receiver reserved: a transfer is on
                assert time.monotonic() < deadline, "no transfer started"
                time.sleep(0.01)
            p.proc.kill()
            with pytest.raises(httpx.HTTPError):
                fut.result(timeout=20)
        p2 = prefill_node([port], wait=False)  # the fresh origin starts while the receiver cleans up
        d.wait_idle(15)  # the partial blocks are back (stall timeout 10 s at most)
        assert d.alive()
        p2.wait_up()
        wait_peers(p2, 1)
        r = p2.client.post("/v1/completions", json={"prompt": case["prompt"], "max_tokens": case["max_new_tokens"],
                                                    "temperature": 0, "return_token_ids": True})
        assert r.json()["choices"][0]["token_ids"] == case["output_token_ids"]
    finally:
        for n in (p, p2):
            if n is not None:
                n.close()


def test_receiver_killed_mid_transfer_and_mid_decode_the_origin_retries():
    """The link dies twice: first during a transfer (the origin still holds the KV and re-sends to
    the other peer), then during decode (the origin recomputes prompt + streamed tokens and hands it
    off again). The client's stream equals an undisturbed run, with no gap or duplicate."""
    ports = [free_port(), free_port()]
    *ds, p = up(decode_node(ports[0], wait=False), decode_node(ports[1], wait=False),
                prefill_node(ports, "--link-gbps", "0.01", wait=False))  # a 300-token prompt: ~0.4 s on the wire
    try:
        wait_peers(p, 2)
        prompt = list(range(3, 303))
        body = {"prompt": prompt, "max_tokens": 150, "ignore_eos": True, "temperature": 0}
        ref, _ = stream_tokens(p, body)
        assert len(ref) == 150
        for d in ds:
            d.wait_idle(5)

        killed = []

        def kill_receiver(_event=None):
            if killed:
                return
            for i, d in enumerate(ds):
                if d.status()["devices"][0]["kv_blocks_used"] > 0:
                    d.proc.kill()
                    killed.append(i)
                    return

        # 1) kill whichever peer is receiving, during the transfer
        with cf.ThreadPoolExecutor(1) as ex:
            fut = ex.submit(stream_tokens, p, body)
            deadline = time.monotonic() + 20
            while not killed:
                assert time.monotonic() < deadline and not fut.done(), "no transfer seen"
                kill_receiver()
                time.sleep(0.005)
            got, events = fut.result(timeout=60)
        assert got == ref
        assert not any("error" in e for e in events if e != "[DONE]")
        survivor = ds[1 - killed[0]]
        survivor.wait_idle(5)
        assert scrape(p)["shiftnode_kv_handoff_failures_total"] >= 1
    finally:
        p.close()
        for d in ds:
            d.close()


def test_decode_peer_dies_mid_decode_recompute_continues_the_stream():
    """Kill the decoding peer after some tokens were streamed: the origin recomputes the prompt plus
    the streamed tokens and hands the sequence to the other peer; tokens equal the undisturbed run."""
    ports = [free_port(), free_port()]
    *ds, p = up(decode_node(ports[0], wait=False), decode_node(ports[1], wait=False), prefill_node(ports, wait=False))
    try:
        wait_peers(p, 2)
        body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "temperature": 0}
        ref, _ = stream_tokens(p, body)
        seen = []

        def on_event(e):
            seen.extend(t for c in e["choices"] for t in c.get("token_ids") or [])
            if len(seen) >= 20 and not killed:
                for i, d in enumerate(ds):
                    if d.status()["devices"][0]["running"] > 0:
                        d.proc.kill()
                        killed.append(i)
                        break

        killed: list[int] = []
        got, _ = stream_tokens(p, body, on_event)
        assert killed, "the sequence finished before a peer could be killed"
        assert got == ref and len(got) == 400
        p.wait_idle(5)
        ds[1 - killed[0]].wait_idle(5)
    finally:
        p.close()
        for d in ds:
            d.close()


def test_past_max_retries_the_client_gets_a_clear_error():
    """One peer, --max-retries 0: killing it mid-decode ends the stream with an error (never a
    finish that looks complete) and the origin holds nothing afterwards."""
    port = free_port()
    d, p = up(decode_node(port, wait=False), prefill_node([port], "--max-retries", "0", wait=False))
    try:
        wait_peers(p, 1)
        killed = []

        def on_event(e):
            if not killed and any(c.get("token_ids") for c in e["choices"]):
                if d.status()["devices"][0]["running"] > 0:
                    d.proc.kill()
                    killed.append(1)

        t0 = time.monotonic()
        _, events = stream_tokens(p, {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True,
                                      "temperature": 0}, on_event)
        assert killed and time.monotonic() - t0 < 30
        errors = [e for e in events if e != "[DONE]" and "error" in e]
        assert errors and "max-retries" in errors[-1]["error"]["message"]
        assert errors[-1]["error"]["code"] == "peer_unavailable" and errors[-1]["error"]["type"] == "service_unavailable"
        assert not any(c.get("finish_reason") in ("stop", "length") for e in events if e != "[DONE]" and "choices" in e
                       for c in e["choices"])
        p.wait_idle(5)
        # up, but a prefill-only node with its only peer gone cannot serve, once a reconnect has failed
        deadline = time.monotonic() + 10
        while (code_health := p.health())[0] != 503 and time.monotonic() < deadline:
            time.sleep(0.05)
        code, health = code_health
        assert p.proc.poll() is None and code == 503 and health["status"] == "unavailable"
        assert any("unreachable" in r for r in health["reasons"]), health
    finally:
        p.close()
        d.close()


def test_wrong_secret_and_layout_are_refused_and_requests_end():
    """A peer without the secret, or with another KV layout (block size), is never used: both sides
    log and count the refusal, the origin shows the peer refused and why (in /v1/node and /health:
    503, it has no usable peer) and fails requests after a bounded wait with 503 peer_refused,
    whose message gives the peer's reason."""
    port = free_port()
    d, bad, other = up(decode_node(port, wait=False), prefill_node([port], secret="wrong-secret", wait=False),
                       prefill_node([port], "--block-size", "32", wait=False))
    try:
        for node, code in ((bad, "auth"), (other, "layout")):
            deadline = time.monotonic() + 10  # started beside the peer: it may still be retrying the connection
            while node.status()["network"]["peers"][0]["state"] != "refused" and time.monotonic() < deadline:
                time.sleep(0.05)
            [peer] = node.status()["network"]["peers"]
            assert not peer["healthy"] and peer["state"] == "refused" and peer["reason"].startswith(code), peer
            assert scrape(node)[f"shiftnode_peer_refusals_total{{direction=outbound,reason={code}}}"] >= 1
            status, health = node.health()
            assert status == 503 and health["status"] == "unavailable"
            assert any(f"refused: {code}" in r for r in health["reasons"]), health
        t0 = time.monotonic()
        r = bad.client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 4})
        err = r.json()["error"]
        assert r.status_code == 503 and r.headers["Retry-After"] and err["code"] == "peer_refused"
        assert "no decode peer reachable" in err["message"] and "could not prove the peer secret" in err["message"]
        assert time.monotonic() - t0 < 15
        assert "could not prove" in d.logs() and "kv_peer_rejected" in d.logs()
        assert "KV layout mismatch" in other.logs() and "block_size" in other.logs()
        st = d.status()["network"]
        assert st["received_sequences"] == 0 and {x["code"] for x in st["refused_inbound"]} == {"auth", "layout"}
        assert d.health()[0] == 200 and d.health()[1]["status"] == "degraded"
    finally:
        for n in (bad, other, d):
            n.close()


def test_a_briefly_stalled_peer_fails_nothing(default_pair):
    """The decode node stops for 2 s (SIGSTOP) under load: requests wait for it instead of failing with
    'no decode peer reachable' (only a decode side gone for DECODE_WAIT_S fails work)."""
    import signal

    p, d, _, _ = default_pair
    try:
        wait_peers(p, 1)
        body = {"prompt": "Once upon a time", "max_tokens": 60, "ignore_eos": True, "temperature": 0}
        with cf.ThreadPoolExecutor(20) as ex:
            futs = [ex.submit(p.client.post, "/v1/completions", json=body) for _ in range(20)]
            time.sleep(0.3)
            d.proc.send_signal(signal.SIGSTOP)
            more = [ex.submit(p.client.post, "/v1/completions", json=body) for _ in range(10)]
            time.sleep(2.0)
            d.proc.send_signal(signal.SIGCONT)
            res = [f.result(timeout=60) for f in futs + more]
        assert [r.status_code for r in res] == [200] * 30, [r.text for r in res if r.status_code != 200][:2]
        assert len({r.json()["choices"][0]["text"] for r in res}) == 1
        p.wait_idle(5)
        d.wait_idle(5)
    finally:
        d.proc.send_signal(signal.SIGCONT)  # never leave the shared peer stopped


def test_a_peer_with_a_shorter_context_refuses_only_what_it_cannot_hold():
    """The decode node's --max-model-len is 128, the prefill node's 512: sequences that may grow past
    128 tokens are refused in the offer (code invalid) and end with a clear error; the others, in the
    same burst, are served with REF output."""
    port = free_port()
    d, p = up(decode_node(port, "--max-model-len", "128", wait=False), prefill_node([port], wait=False))
    try:
        wait_peers(p, 1)
        short = {"prompt": "Once upon a time", "max_tokens": 20, "temperature": 0, "return_token_ids": True}
        long = {"prompt": list(range(3, 303)), "max_tokens": 20, "temperature": 0}
        with cf.ThreadPoolExecutor(9) as ex:
            futs = [ex.submit(p.client.post, "/v1/completions", json=short) for _ in range(8)]
            bad = ex.submit(p.client.post, "/v1/completions", json=long)
            res = [f.result(timeout=60) for f in futs]
            r = bad.result(timeout=60)
        assert {x.status_code for x in res} == {200} and len({str(x.json()["choices"][0]["token_ids"]) for x in res}) == 1
        assert r.status_code == 503 and "cannot take this sequence" in r.json()["error"]["message"]
        assert r.json()["error"]["code"] == "peer_refused" and r.headers["Retry-After"]
        assert "--max-model-len 128" in r.json()["error"]["message"]
        p.wait_idle(5)
        d.wait_idle(5)
        assert "engine_error" not in d.logs()
    finally:
        p.close()
        d.close()


def test_eviction_pressure_on_the_origin_keeps_unsent_blocks_pinned(stories_node, default_pair):
    """B35: a prefill KV pool of ~2 long prompts under a burst and a slow link: blocks being sent are
    never reused, every request ends with its REF output by its deadline, nothing leaks. The decode side
    is the module's decode node."""
    _, d, port, _ = default_pair
    nodes = [prefill_node([port], "--kv-cache-memory", "700KiB", "--link-gbps", "0.5", wait=False)]
    try:
        bodies = [{"prompt": c["prompt"], "max_tokens": c["max_new_tokens"]} for c in reference_cases()] * 2
        bodies += [{"prompt": list(range(3 + k, 203 + k)), "max_tokens": 20} for k in range(6)]
        bodies = [{**b, "temperature": 0, "return_token_ids": True} for b in bodies]
        ref = [stories_node.client.post("/v1/completions", json=b).json()["choices"][0]["token_ids"] for b in bodies]
        (p,) = up(*nodes)  # it started while REF was computed
        wait_peers(p, 1)
        with cf.ThreadPoolExecutor(len(bodies)) as ex:
            futs = [ex.submit(p.client.post, "/v1/completions", json=b) for b in bodies]
            res = [f.result(timeout=60) for f in futs]
        for want, r in zip(ref, res):
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == want
        p.wait_idle(5)
        d.wait_idle(5)
    finally:
        for n in nodes:
            n.close()


def test_peer_restart_under_load_every_request_ends(default_pair):
    """B36/B38: requests at a steady rate while the decode peer is killed and restarted on the same
    port: every request ends (completed or a clear error) within its deadline, later ones succeed,
    and nothing stays allocated. It kills the module's shared decode node, so it is its last user."""
    p, d, port, nodes = default_pair
    d2 = None
    try:
        wait_peers(p, 1)
        body = {"prompt": "Once upon a time", "max_tokens": 100, "ignore_eos": True, "temperature": 0}
        with cf.ThreadPoolExecutor(24) as ex:
            futs = []
            for i in range(24):
                futs.append(ex.submit(p.client.post, "/v1/completions", json=body))
                time.sleep(0.05)
                if i == 8:
                    d.proc.kill()
                if i == 12:
                    d2 = decode_node(port)
                    nodes.append(d2)  # closed with the pair
            res = [f.result(timeout=60) for f in futs]
        codes = [r.status_code for r in res]
        assert set(codes) <= {200, 503}, codes
        for r in res:
            if r.status_code == 503:
                assert r.json()["error"]["message"] and r.json()["error"]["code"] == "peer_unavailable"
        wait_peers(p, 1)
        r = p.client.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 100
        p.wait_idle(5)
        d2.wait_idle(5)
    finally:
        for n in (p, d, d2):
            if n is not None:
                n.close()


def test_time_shared_fallback_moves_a_decoding_sequence_to_a_peer_node(stories_node):
    """A one-device time-shared node whose switch back to DECODE (a 200 ms pause) would make a freshly
    prefilled sequence miss its 100 ms TPOT target: the fallback ("tpot") streams the sequence's KV to
    the peer node instead, the peer decodes it and relays the tokens, and both clients' streams equal
    REF with no gap or duplicate; the node keeps prefilling."""
    port = free_port()
    nodes = [NodeProcess("--model", str(STORIES), "--kv-port", str(port), "--peer-secret", SECRET, wait=False),
             NodeProcess("--model", str(STORIES), "--mode", "time-shared", "--peers", f"127.0.0.1:{port}", "--peer-secret",
                         SECRET, "--reconfig-pause-ms", "200", "--tpot-slo-ms", "100", "--ttft-slo-ms", "400", wait=False)]
    try:
        body = {"prompt": "Once upon a time", "max_tokens": 150, "ignore_eos": True, "temperature": 0}
        ref, _ = stream_tokens(stories_node, body)
        other = {"prompt": "Lily and Ben", "max_tokens": 8, "temperature": 0, "return_token_ids": True}
        want_other = stories_node.client.post("/v1/completions", json=other).json()["choices"][0]["token_ids"]
        b, a = up(*nodes)  # they started while REF was computed
        wait_peers(a, 1)
        with cf.ThreadPoolExecutor(1) as ex:
            second = []

            def on_event(_e):
                if not second and len(got_so_far) >= 20:
                    second.append(ex.submit(a.client.post, "/v1/completions", json=other))

            got_so_far: list[int] = []
            got, _ = stream_tokens(a, body, lambda e: (got_so_far.extend(
                t for c in e["choices"] for t in c.get("token_ids") or []), on_event(e)))
            assert second and second[0].result(timeout=30).json()["choices"][0]["token_ids"] == want_other
        assert got == ref
        st_a = a.wait_idle(5)
        moved = [t for t in st_a["kv_transfers"] if t["dst"] == f"peer:127.0.0.1:{port}"]
        assert moved and all(t["reason"] == "tpot" and t["src"] == "cpu:0" and t["nbytes"] > 0 for t in moved)
        assert b.wait_idle(5)["network"]["received_sequences"] == len(moved)
        assert scrape(a)[f"shiftnode_kv_transfers_total{{dst=peer:127.0.0.1:{port},reason=tpot,src=cpu:0}}"] == len(moved)
    finally:
        for n in nodes:
            n.close()


def test_drain_moves_decoding_sequences_mid_decode_to_a_peer_node(stories_node):
    """``POST /v1/node/drain`` on a time-shared node: sequences that have decoded for a while stream
    to the peer node mid-decode and finish there with REF output and no gap or duplicate; new
    requests get 503 (code ``draining``); the drained node ends with nothing allocated."""
    port = free_port()
    nodes = [NodeProcess("--model", str(STORIES), "--mode", "adaptive", "--kv-port", str(port), "--peer-secret", SECRET,
                         "--log-format", "json", "--log-requests", wait=False),
             NodeProcess("--model", str(STORIES), "--mode", "adaptive", "--peers", f"127.0.0.1:{port}", "--peer-secret", SECRET,
                         "--imbalance-threshold", "0", wait=False)]  # only the drain moves sequences
    try:
        bodies = [{"prompt": list(range(3 + k, 40 + k)), "max_tokens": 200, "ignore_eos": True, "temperature": 0}
                  for k in range(3)]
        ref = [stream_tokens(stories_node, body)[0] for body in bodies]
        b, a = up(*nodes)  # they started while REF was computed
        wait_peers(a, 1)
        seen = [0] * len(bodies)
        drained = []

        def watch(i):
            def on_event(e):
                seen[i] += sum(len(c.get("token_ids") or []) for c in e["choices"])
                if min(seen) >= 30 and not drained:
                    drained.append(a.client.post("/v1/node/drain"))
            return on_event

        with cf.ThreadPoolExecutor(3) as ex:
            futs = [ex.submit(stream_tokens, a, body, watch(i)) for i, body in enumerate(bodies)]
            got = [f.result(timeout=60)[0] for f in futs]
        assert got == ref
        assert drained and drained[0].status_code == 200 and drained[0].json()["draining"] is True
        r = a.client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 4})
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining" and r.headers["Retry-After"]
        st_a = a.wait_idle(5)
        assert st_a["draining"] is True
        moved = [t for t in st_a["kv_transfers"] if t["reason"] == "drain"]
        assert len(moved) == 3 and all(t["dst"] == f"peer:127.0.0.1:{port}" for t in moved)
        adopted = [json.loads(line) for line in b.logs().splitlines()
                   if line.startswith("{") and "sequence_adopted_from_peer" in line]
        assert len(adopted) == 3 and min(x["output_tokens"] for x in adopted) >= 30  # mid-decode
        b.wait_idle(5)
        bad = b.client.post("/v1/node/drain")  # no peers to drain to
        assert bad.status_code == 409 and "needs time-shared mode and --peers" in bad.json()["error"]["message"]
    finally:
        for n in nodes:
            n.close()


def test_a_same_named_copy_with_one_changed_weight_is_refused(tmp_path):
    """vLLM #42895: two decode peers serve copies of stories260k in folders of the same basename, one
    with a single weight changed. The prefill node accepts the identical copy and refuses the other
    (reason weights: logged, counted on both sides, shown in /v1/node and /health), and serves REF
    output through the good one."""
    good, bad = copy_model(tmp_path, "good"), copy_model(tmp_path, "bad")
    change_one_weight(bad)
    ports = [free_port(), free_port()]
    d_good, d_bad, p = up(
        NodeProcess("--model", str(good), "--mode", "pooled", "--decode-devices", "cpu:0",
                    "--kv-port", str(ports[0]), "--peer-secret", SECRET, wait=False),
        NodeProcess("--model", str(bad), "--mode", "pooled", "--decode-devices", "cpu:0",
                    "--kv-port", str(ports[1]), "--peer-secret", SECRET, wait=False),
        prefill_node(ports, wait=False))
    try:
        wait_peers(p, 1)
        deadline = time.monotonic() + 10
        while True:
            peers = {x["addr"]: x for x in p.status()["network"]["peers"]}
            if peers[f"127.0.0.1:{ports[1]}"]["state"] == "refused" or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        ok, refused = peers[f"127.0.0.1:{ports[0]}"], peers[f"127.0.0.1:{ports[1]}"]
        assert ok["state"] == "ready" and refused["state"] == "refused", peers
        assert refused["reason"].startswith("weights: KV layout mismatch (weights: ")
        assert scrape(p)["shiftnode_peer_refusals_total{direction=outbound,reason=weights}"] >= 1
        assert "peer_refused" in p.logs()
        [inbound] = d_bad.status()["network"]["refused_inbound"]
        assert inbound["code"] == "weights" and inbound["node_id"] == p.status()["network"]["node_id"]
        assert scrape(d_bad)["shiftnode_peer_refusals_total{direction=inbound,reason=weights}"] >= 1
        fps = [n.status()["network"]["fingerprint"] for n in (p, d_good, d_bad)]
        assert fps[0] == fps[1] and fps[2]["weights"] != fps[0]["weights"] and fps[2]["config"] == fps[0]["config"]
        status, health = p.health()
        assert status == 200 and health["status"] == "degraded" and any("weights" in r for r in health["reasons"])
        case = reference_cases()[0]
        r = p.client.post("/v1/completions", json={"prompt": case["prompt"], "max_tokens": case["max_new_tokens"],
                                                   "temperature": 0, "return_token_ids": True})
        assert r.json()["choices"][0]["token_ids"] == case["output_token_ids"]
        assert d_good.wait_idle(5)["network"]["received_sequences"] == 1
        assert d_bad.status()["network"]["received_sequences"] == 0
    finally:
        for n in (p, d_good, d_bad):
            n.close()


def test_peers_added_and_removed_at_run_time_and_health_follows():
    """The only decode peer dies: /health turns 503 naming it unreachable. A new decode node starts on
    another address; POST /v1/node/peers swaps it in, and the node is healthy and serves again."""
    old_port, new_port = free_port(), free_port()
    # the new decode node is launched with the others (it idles unknown to the origin until swapped in)
    d_old, p, d_new = up(decode_node(old_port, wait=False), prefill_node([old_port], wait=False),
                         decode_node(new_port, wait=False))
    try:
        wait_peers(p, 1)
        assert p.health() == (200, {"status": "ok"})
        d_old.proc.kill()
        deadline = time.monotonic() + 10
        while p.health()[0] != 503:
            assert time.monotonic() < deadline, p.health()
            time.sleep(0.05)
        assert any(f"peer 127.0.0.1:{old_port} unreachable" in x for x in p.health()[1]["reasons"])
        bad = p.client.post("/v1/node/peers", json={"add": ["nohost"]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "add"
        r = p.client.post("/v1/node/peers", json={"add": [f"127.0.0.1:{new_port}"], "remove": [f"127.0.0.1:{old_port}"]})
        assert r.status_code == 200 and r.json()["removed"] == [f"127.0.0.1:{old_port}"], r.text
        assert [x["addr"] for x in r.json()["peers"]] == [f"127.0.0.1:{new_port}"]
        wait_peers(p, 1)
        assert p.health() == (200, {"status": "ok"})
        assert scrape(p)["shiftnode_peers{state=ready}"] == 1
        r = p.client.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        assert d_new.wait_idle(5)["network"]["received_sequences"] == 1
    finally:
        for n in (p, d_old, d_new):
            n.close()


def test_a_relay_stalled_past_the_transfer_timeout_is_recomputed():
    """--kv-transfer-timeout-s 3: the decode peer stops (SIGSTOP) for 4.5 s mid-decode. The origin's
    relay times out (counted, stage relay), it recomputes the sequence (counted) and hands it off
    again once the peer is back; the stream equals an undisturbed run."""
    import signal

    port = free_port()
    d, p = up(decode_node(port, wait=False), prefill_node([port], "--kv-transfer-timeout-s", "3", wait=False))
    try:
        wait_peers(p, 1)
        assert p.status()["network"]["config"]["kv_transfer_timeout_s"] == 3.0
        body = {"prompt": "Once upon a time", "max_tokens": 300, "ignore_eos": True, "temperature": 0}
        ref, _ = stream_tokens(p, body)
        seen: list[int] = []
        stopped: list[float] = []

        def on_event(e):
            seen.extend(t for c in e["choices"] for t in c.get("token_ids") or [])
            if len(seen) >= 20 and not stopped:
                d.proc.send_signal(signal.SIGSTOP)
                stopped.append(time.monotonic())

        with cf.ThreadPoolExecutor(1) as ex:
            fut = ex.submit(stream_tokens, p, body, on_event)
            while not stopped:
                assert not fut.done(), "the sequence finished before the peer could be stopped"
                time.sleep(0.01)
            time.sleep(max(0.0, stopped[0] + 4.5 - time.monotonic()))
            d.proc.send_signal(signal.SIGCONT)
            got, events = fut.result(timeout=60)
        assert got == ref and not any("error" in e for e in events if e != "[DONE]")
        m = scrape(p)
        assert m["shiftnode_kv_timeouts_total{side=sender,stage=relay}"] >= 1
        assert m["shiftnode_kv_recomputes_total"] >= 1
        assert m["shiftnode_remote_kv_waiting_requests{stage=unsent}"] == 0
        p.wait_idle(5)
        d.wait_idle(10)
    finally:
        d.proc.send_signal(signal.SIGCONT)
        p.close()
        d.close()
