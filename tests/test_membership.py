"""Peers found through a real etcd server (``--etcd``): join, use, death within the lease, a new node.

The server is Debian's ``etcd-server`` package (``scripts/setup`` installs it), started on free
loopback ports with a fresh data folder. Nodes are real ``shiftnode serve`` processes on stories260k:
a pooled prefill-only node that has no ``--peers`` and finds its decode nodes only through etcd.
"""
from __future__ import annotations

import os
import time

import pytest

from bench.load.etcd_server import EtcdMissing, EtcdServer
from support import STORIES, NodeProcess, free_port, reference_cases, up

SECRET = "etcd-test-secret"
TTL_S = "6"  # --etcd-lease-ttl-s, the shortest allowed (3 keep-alive timeouts): a killed node leaves within ~6 s


@pytest.fixture(scope="module")
def etcd():
    """A single-member etcd on free loopback ports (:class:`bench.load.etcd_server.EtcdServer`); yields its URL."""
    try:
        server = EtcdServer()
    except EtcdMissing as e:
        assert not os.environ.get("CI"), f"{e}: in CI, scripts/setup must install the etcd-server package"
        pytest.skip(str(e))
    with server:
        yield server.url


def decode_node(etcd: str, prefix: str, node_id: str, wait: bool = True) -> NodeProcess:
    return NodeProcess("--model", str(STORIES), "--mode", "pooled", "--decode-devices", "cpu:0", "--kv-port", "0",
                       "--kv-host", "127.0.0.1", "--peer-secret", SECRET, "--etcd", etcd, "--etcd-prefix", prefix,
                       "--node-id", node_id, "--etcd-lease-ttl-s", TTL_S, wait=wait)


def wait_for(what, predicate, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} not within {timeout_s} s"
        time.sleep(0.05)


def healthy_peers(node: NodeProcess) -> list[str]:
    return sorted(p["node_id"] for p in node.status()["network"]["peers"] if p["healthy"])


def members(node: NodeProcess) -> list[str]:
    return node.status()["network"]["membership"]["members"]


def test_peers_join_serve_die_within_the_lease_and_new_ones_join(etcd):
    prefix = "/shiftnode/test-join"
    case = reference_cases()[0]
    body = {"prompt": case["prompt"], "max_tokens": case["max_new_tokens"], "temperature": 0, "return_token_ids": True}
    p, d1 = up(NodeProcess("--model", str(STORIES), "--mode", "pooled", "--prefill-devices", "cpu:0",
                           "--peer-secret", SECRET, "--etcd", etcd, "--etcd-prefix", prefix, "--node-id", "prefill",
                           "--etcd-lease-ttl-s", TTL_S, wait=False),
               decode_node(etcd, prefix, "decode-1", wait=False))
    d2 = None
    try:
        # the decode node is found through etcd alone and used: the reference, token for token
        wait_for("decode-1 as a healthy peer", lambda: healthy_peers(p) == ["decode-1"], 20)
        st = p.status()["network"]["membership"]
        assert st["state"] == "registered" and st["members"] == ["decode-1"] and st["lease_ttl_s"] == 6
        assert members(d1) == ["prefill"]  # the prefill node is a member too, but takes no KV: nobody's peer
        r = p.client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == case["output_token_ids"]
        assert d1.status()["network"]["received_sequences"] >= 1

        # kill -9: no clean stop, so etcd drops the record when the lease runs out (TTL 6 s)
        d1.proc.kill()
        killed = time.monotonic()
        wait_for("decode-1 to leave", lambda: not p.status()["network"]["peers"], 6 + 4)
        assert members(p) == [] and time.monotonic() - killed < 10
        assert p.client.post("/v1/completions", json=body).status_code == 503  # no decode node: unavailable

        # a new decode node joins without a restart of the prefill node, and serves
        d2 = decode_node(etcd, prefix, "decode-2")
        wait_for("decode-2 as a healthy peer", lambda: healthy_peers(p) == ["decode-2"], 20)
        r = p.client.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == case["output_token_ids"], r.text

        # a clean stop revokes the lease: the peer leaves at once, not after the TTL
        d2.close()
        stopped = time.monotonic()
        wait_for("decode-2 to leave", lambda: not p.status()["network"]["peers"], 2)
        assert time.monotonic() - stopped < 2
    finally:
        for n in (p, d1, d2):
            if n is not None:
                n.close()


@pytest.mark.quick
def test_etcd_flags_are_checked_before_loading():
    from node.config import ConfigError, NodeConfig

    base = dict(model=str(STORIES), devices=["cpu:0"])
    with pytest.raises(ConfigError, match="need --peer-secret"):
        NodeConfig(**base, etcd="http://127.0.0.1:2379").validate()
    with pytest.raises(ConfigError, match="http:// or https://"):
        NodeConfig(**base, etcd="127.0.0.1:2379", peer_secret="s").validate()
    with pytest.raises(ConfigError, match="--etcd is for the adaptive, time-shared and pooled"):
        NodeConfig(**base, etcd="http://127.0.0.1:2379", peer_secret="s", mode="colocated").validate()
    NodeConfig(**base, mode="pooled", prefill_devices=["cpu:0"], etcd="http://127.0.0.1:2379", peer_secret="s").validate()


def test_membership_reconciles_records_and_reports_an_unreachable_etcd(etcd):
    """In-process, against the same etcd: who joins (records with a KV endpoint), who leaves (a
    revoked lease), a changed endpoint (leave then join), and an etcd that is not there."""
    import asyncio

    from node.runtime.membership import EtcdGateway, Membership

    async def scenario():
        prefix, events = "/shiftnode/test-unit", []
        a = Membership(etcd, prefix, "a", {"node_id": "a", "kv": "127.0.0.1:7001"}, 2,
                       lambda addr: events.append(("join", addr)), lambda addr: events.append(("leave", addr)))
        b = Membership(etcd, prefix, "b", {"node_id": "b", "kv": "127.0.0.1:7002"}, 2, lambda _: None, lambda _: None)
        c = Membership(etcd, prefix, "c", {"node_id": "c", "kv": None}, 2, lambda _: None, lambda _: None)
        gone = Membership(f"http://127.0.0.1:{free_port()}", prefix, "x", {"kv": None}, 2, lambda _: None, lambda _: None)
        for m in (a, b, c, gone):
            m.start()

        async def until(predicate, timeout_s=5.0):
            deadline = time.monotonic() + timeout_s
            while not predicate():
                assert time.monotonic() < deadline, (events, a.status(), gone.status())
                await asyncio.sleep(0.02)

        await until(lambda: a.status()["members"] == ["b", "c"])
        assert events == [("join", "127.0.0.1:7002")]  # c takes no KV: a member, not a peer
        assert a.status()["state"] == "registered" and a.sessions == 1
        # b moves its KV endpoint (a restart on another port under the same id): leave, then join
        gw = EtcdGateway(etcd)
        await gw.put(b.key, '{"node_id": "b", "kv": "127.0.0.1:7003"}', b._lease)
        await until(lambda: events[-1] == ("join", "127.0.0.1:7003"))
        assert events[-2] == ("leave", "127.0.0.1:7002")
        await gw.close()
        await b.close()  # revoked: a sees the delete at once
        await until(lambda: events[-1] == ("leave", "127.0.0.1:7003"), 1.0)
        await until(lambda: gone.status()["state"] == "unreachable")
        assert "ClientConnectorError" in gone.status()["reason"] or "Connect" in gone.status()["reason"]
        for m in (a, c, gone):
            await m.close()

    asyncio.run(scenario())


def test_a_quiet_watch_is_tested_and_kept_when_etcd_echoes(etcd, monkeypatch):
    """The watch guard against a real etcd: a watch quiet for QUIET_S has this node put its record again,
    and the echo etcd sends keeps the session (a silently dead one ends: test_membership_faults.py)."""
    import asyncio

    from node.runtime import membership
    from node.runtime.membership import Membership

    monkeypatch.setattr(membership, "QUIET_S", 0.3)

    async def scenario():
        m = Membership(etcd, "/shiftnode/test-quiet", "q", {"node_id": "q", "kv": None}, 6, lambda _: None,
                       lambda _: None)
        m.start()
        await asyncio.sleep(2.5)
        assert m.status()["state"] == "registered" and m.sessions == 1, m.status()
        await m.close()

    asyncio.run(scenario())
