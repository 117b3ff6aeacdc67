"""KV between node processes over NIXL (``--kv-transport nixl``; UCX on loopback, real agents): pooled
hand-offs and time-shared moves (a drain) reproduce the greedy references with every layer written
over NIXL, and a receiver killed mid-transfer is recovered from as on the TCP path (the origin sends
the sequence again, to the other peer; the restarted node's new agent is loaded and written to).

One set of three nodes serves every check, in order: D and A take KV (``--kv-port``), P is a pooled
prefill node sending to both, A is a time-shared node that drains to D.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import signal
import time

import pytest

from node.cli import config_from_args, run_serve, serve_parser
from node.config import ConfigError
from support import STORIES, NodeProcess, free_port, reference_cases, require_nixl, up
from test_peers import SECRET, stream_tokens, wait_peers

NIXL = ("--kv-transport", "nixl", "--peer-secret", SECRET)


def receiver(kv_port: int, port: int | None = None, *extra: str, wait: bool = False) -> NodeProcess:
    return NodeProcess("--model", str(STORIES), "--mode", "adaptive", "--kv-port", str(kv_port), *NIXL, *extra, port=port,
                       wait=wait)


@pytest.fixture(scope="module")
def trio():
    """{"D": receiver, "A": receiver that drains to D, "P": pooled prefill node sending to D and A};
    a test that restarts a node puts the new one in its place. ``--link-gbps 0.01`` on P: a
    400-token prompt's KV (512 KB) takes about 0.4 s to send, a window to kill its receiver in."""
    require_nixl()
    ports = {"D": free_port(), "A": free_port()}
    nodes = {}
    try:
        nodes["D"] = receiver(ports["D"])
        nodes["A"] = receiver(ports["A"], None, "--peers", f"127.0.0.1:{ports['D']}", "--imbalance-threshold", "0")
        nodes["P"] = NodeProcess("--model", str(STORIES), "--mode", "pooled", "--prefill-devices", "cpu:0", "--peers",
                                 f"127.0.0.1:{ports['D']},127.0.0.1:{ports['A']}", "--link-gbps", "0.01", *NIXL,
                                 wait=False)
        up(*nodes.values())
        wait_peers(nodes["P"], 2)
        yield nodes, ports
    finally:
        for n in nodes.values():
            n.close()


def nixl_layers(node: NodeProcess) -> tuple[int, int]:
    """(layers written to peers, layers received from peers) over NIXL by ``node``."""
    st = node.status()["network"]["nixl"]
    return st["layers_written"], st["layers_received"]


def test_pooled_handoffs_over_nixl_equal_the_reference(trio):
    nodes, _ = trio
    P, D, A = nodes["P"], nodes["D"], nodes["A"]
    assert P.status()["network"]["config"]["kv_transport"] == "nixl"
    cases = reference_cases()
    for case in cases:
        r = P.client.post("/v1/completions", json={"prompt": case["prompt"], "max_tokens": case["max_new_tokens"],
                                                   "temperature": 0, "return_token_ids": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == case["output_token_ids"]
    case = cases[1]
    ids, _ = stream_tokens(P, {"prompt": case["prompt"], "max_tokens": case["max_new_tokens"], "temperature": 0})
    assert ids == case["output_token_ids"]  # no gap or duplicate across the hand-off
    for n in (P, D, A):
        n.wait_idle()
    layers = 5 * (len(cases) + 1)  # stories260k has 5 layers: one NIXL write per layer and hand-off
    assert nixl_layers(P)[0] == layers
    assert nixl_layers(D)[1] + nixl_layers(A)[1] == layers  # every layer came over NIXL, none over TCP


def test_a_receiver_killed_mid_transfer_is_recovered_from(trio):
    """A 400-token prompt's KV is being written when its receiver is killed (-9): the origin's write
    fails, the sequence goes back to its device and is sent to the other peer; the stream equals an
    undisturbed run. The killed node restarts on its ports with a new NIXL agent, which the origin
    loads and writes to (the other peer taken out of its set meanwhile)."""
    nodes, ports = trio
    P = nodes["P"]
    body = {"prompt": list(range(3, 403)), "max_tokens": 24, "ignore_eos": True, "temperature": 0}
    ref, _ = stream_tokens(P, body)
    killed: list[str] = []
    with cf.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(stream_tokens, P, body)
        deadline = time.monotonic() + 30
        while not killed:
            assert time.monotonic() < deadline and not fut.done(), "no transfer seen"
            for name in ("D", "A"):
                st = nodes[name].status()
                if st["network"]["receiving"] > 0:
                    nodes[name].proc.kill()
                    killed.append(name)
                    break
            time.sleep(0.005)
        got, events = fut.result(timeout=60)
    assert got == ref and not any("error" in e for e in events if e != "[DONE]")
    name = killed[0]
    other = "A" if name == "D" else "D"
    nodes[other].wait_idle()
    P.wait_idle()
    old = nodes[name]
    extra = ("--peers", f"127.0.0.1:{ports['D']}", "--imbalance-threshold", "0") if name == "A" else ()
    nodes[name] = receiver(ports[name], old.port, *extra, wait=True)
    r = P.client.post("/v1/node/peers", json={"remove": [f"127.0.0.1:{ports[other]}"]})
    assert r.status_code == 200, r.text
    try:
        wait_peers(P, 1)
        written = nixl_layers(P)[0]
        ids, _ = stream_tokens(P, body)
        assert ids == ref
        assert nixl_layers(nodes[name])[1] == 5 and nixl_layers(P)[0] == written + 5
    finally:
        assert P.client.post("/v1/node/peers", json={"add": [f"127.0.0.1:{ports[other]}"]}).status_code == 200
    nodes[name].wait_idle()
    P.wait_idle()


def test_a_receivers_restarted_engine_gets_its_new_pool_registered(trio):
    """Issue 45 item 2: D's engine is killed (-9) and restarted by its node. Its new KV pool is
    registered with D's NIXL agent in the dead one's slot, and the metadata P loads from D is
    refreshed: P's next hand-off to D is written over NIXL into the pool the new engine computes on,
    and the stream equals an undisturbed run (with the dead pool still registered, the writes went to
    memory no engine reads any more)."""
    nodes, ports = trio
    P, D = nodes["P"], nodes["D"]
    body = {"prompt": list(range(3, 403)), "max_tokens": 24, "ignore_eos": True, "temperature": 0}
    ref, _ = stream_tokens(P, body)
    pid = D.status()["devices"][0]["engine"]["pid"]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while not ((dev := D.status()["devices"][0])["engine"]["pid"] != pid and dev["failure"] is None):
        assert time.monotonic() < deadline, dev
        time.sleep(0.05)
    r = P.client.post("/v1/node/peers", json={"remove": [f"127.0.0.1:{ports['A']}"]})
    assert r.status_code == 200, r.text
    try:
        wait_peers(P, 1)
        written, received = nixl_layers(P)[0], nixl_layers(D)[1]
        deadline = time.monotonic() + 10  # the new pool is registered just after the engine serves
        while D.status()["network"]["nixl"].get("down"):
            assert time.monotonic() < deadline, D.status()["network"]["nixl"]
            time.sleep(0.05)
        ids, _ = stream_tokens(P, body)
        assert ids == ref
        assert nixl_layers(D)[1] == received + 5 and nixl_layers(P)[0] == written + 5
    finally:
        assert P.client.post("/v1/node/peers", json={"add": [f"127.0.0.1:{ports['A']}"]}).status_code == 200
    D.wait_idle()
    P.wait_idle()


def test_time_shared_drain_over_nixl_equals_the_reference(trio):
    """A drains two sequences mid-decode to D: both streams equal the references, and D received
    their layers over NIXL."""
    nodes, _ = trio
    A, D = nodes["A"], nodes["D"]
    wait_peers(A, 1)
    cases = reference_cases()[:2]  # 200 and 128 tokens: both still decoding when the drain starts
    before = nixl_layers(D)[1]
    seen = [0] * len(cases)
    drained = []

    def watch(i):
        def on_event(e):
            seen[i] += sum(len(c.get("token_ids") or []) for c in e["choices"])
            if min(seen) >= 20 and not drained:
                drained.append(A.client.post("/v1/node/drain"))
        return on_event

    with cf.ThreadPoolExecutor(len(cases)) as ex:
        futs = [ex.submit(stream_tokens, A, {"prompt": c["prompt"], "max_tokens": c["max_new_tokens"],
                                             "temperature": 0}, watch(i)) for i, c in enumerate(cases)]
        got = [f.result(timeout=60)[0] for f in futs]
    assert got == [c["output_token_ids"] for c in cases]
    assert drained and drained[0].status_code == 200
    moved = [t for t in A.wait_idle()["kv_transfers"] if t["reason"] == "drain"]
    assert len(moved) == 2
    D.wait_idle()
    assert nixl_layers(D)[1] == before + 5 * len(moved)


@pytest.mark.quick
def test_nixl_flags_are_checked_before_loading(monkeypatch, capsys):
    """``--kv-transport nixl`` needs a KV listener or peers, and NIXL itself: without the package the
    node does not start (exit 2) and says how to install it."""
    parser = argparse.ArgumentParser()
    serve_parser(parser.add_subparsers(dest="command"))
    config = lambda *argv: config_from_args(parser.parse_args(["serve", *argv]))  # noqa: E731
    with pytest.raises(ConfigError, match="--kv-transport nixl moves KV between nodes"):
        config("--kv-transport", "nixl").validate()
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--kv-transport", "rdma"])
    import node.transport.nixl_agent as na

    monkeypatch.setattr(na, "_MODULES", ("no_such_nixl._api",))
    cfg = config("--port", str(free_port()), "--kv-port", "0", "--peer-secret", "s", "--kv-transport", "nixl")
    assert run_serve(cfg) == 2
    err = capsys.readouterr().err
    assert "cannot start" in err and "--kv-transport nixl needs the NIXL package" in err
    assert "pip install 'shiftnode[nixl]'" in err


def test_a_grammar_survives_a_pooled_hand_off_over_nixl(trio, stories_node):
    """Issue 44: a json_schema request handed from the prefill node to a peer over NIXL decodes there under the
    matcher rebuilt from the tokens already emitted: greedy output equal to one node's, and valid."""
    from test_grammar_moves import BODY, _complete, valid

    nodes, _ = trio
    P = nodes["P"]
    written = nixl_layers(P)[0]
    one = _complete(stories_node, BODY)
    handed = _complete(P, BODY)
    assert nixl_layers(P)[0] > written  # the KV went over NIXL
    valid(one["text"])
    assert handed["token_ids"] == one["token_ids"] and handed["text"] == one["text"]
    for n in nodes.values():
        n.wait_idle()
