"""``node_health`` on stand-in nodes (no processes): ok, degraded and unavailable, and why."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from node.config import NodeConfig

from node.runtime.health import STALLED_STEP_S, node_health
from node.runtime.peer_state import InboundRefusals, Peer
from node.transport.protocol import StatusReply

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here

NOW = 100.0


def engine(device_id: str, failure: str | None = None, step_started_s: float | None = None) -> SimpleNamespace:
    return SimpleNamespace(device_id=device_id, failure=failure, step_started_s=step_started_s)


def ready_peer(addr: str = "10.0.0.2:9100", accepting: bool = True) -> Peer:
    host, _, port = addr.rpartition(":")
    p = Peer(addr, host, int(port), error=None)
    p.status = StatusReply(n=1, kv_free_blocks=10, kv_total_blocks=10, max_device_free_blocks=10,
                           max_device_total_blocks=10, seq_slots_free=4, accepting=accepting)
    p.status_s = NOW - 0.1
    return p


def node(mode="time-shared", engines=None, peers=None, prefill=(), decode=(), draining=False, receiver=None):
    links = None if peers is None else SimpleNamespace(peers={p.id: p for p in peers}, stale_s=3.0)
    cfg = NodeConfig(mode=mode, prefill_devices=list(prefill), decode_devices=list(decode),
                     devices=list(prefill) + list(decode) or ["cpu:0"])
    return SimpleNamespace(config=cfg, engines=engines or [engine("cpu:0")], peers=links, receiver=receiver,
                           draining=draining)


def test_a_plain_node_is_ok_and_a_draining_one_degraded():
    h = node_health(node(), NOW)
    assert (h.status, h.http_status, h.body()) == ("ok", 200, {"status": "ok"})
    h = node_health(node(draining=True), NOW)
    assert h.status == "degraded" and h.http_status == 200 and h.reasons == ["draining: the node takes no new requests"]


def test_engines_down_degrade_and_all_down_is_unavailable():
    h = node_health(node(engines=[engine("cpu:0", "step failed: boom"), engine("cpu:1")]), NOW)
    assert h.status == "degraded" and h.reasons == ["engine cpu:0 down: step failed: boom"]
    h = node_health(node(engines=[engine("cpu:0", "a"), engine("cpu:1", "b")]), NOW)
    assert h.status == "unavailable" and h.http_status == 503 and h.reasons[0] == "every engine is down or stalled"
    assert node_health(node(engines=[SimpleNamespace(device_id="cpu:0")]), NOW).status == "ok"  # no failure attribute yet


def test_peer_states_name_the_reason():
    stale = ready_peer("10.0.0.3:9100")
    stale.status_s = NOW - 5
    refused = Peer("10.0.0.4:9100", "10.0.0.4", 9100, refusal=("weights", "KV layout mismatch (weights: ...)"))
    gone = Peer("10.0.0.5:9100", "10.0.0.5", 9100, error="ConnectionRefusedError: [Errno 111]")
    h = node_health(node(peers=[ready_peer(), stale, refused, gone]), NOW)
    assert h.status == "degraded" and h.http_status == 200
    assert h.reasons == ["peer 10.0.0.3:9100 unreachable: no capacity report for 5.0 s",
                         "peer 10.0.0.4:9100 refused: weights: KV layout mismatch (weights: ...)",
                         "peer 10.0.0.5:9100 unreachable: ConnectionRefusedError: [Errno 111]"]


def test_a_prefill_only_pooled_node_needs_a_ready_peer():
    kw = dict(mode="pooled", prefill=["cpu:0"])
    assert node_health(node(peers=[ready_peer()], **kw), NOW).status == "ok"
    refused = Peer("10.0.0.4:9100", "10.0.0.4", 9100, refusal=("auth", "server could not prove the peer secret"))
    h = node_health(node(peers=[refused], **kw), NOW)
    assert h.status == "unavailable" and "refused: auth" in h.reasons[1]
    assert h.reasons[0] == ("no decode peer is ready: every peer refused the handshake (incompatible: another model, "
                            "layout or secret)")
    h = node_health(node(peers=[ready_peer(accepting=False)], **kw), NOW)
    assert h.status == "unavailable" and "not_accepting" in h.reasons[1]
    gone = Peer("10.0.0.5:9100", "10.0.0.5", 9100, error="ConnectionRefusedError: [Errno 111]")
    assert node_health(node(peers=[refused, gone], **kw), NOW).reasons[0] == "no decode peer is ready"  # not all refused
    # with a decode device of its own, the peers are extra: it degrades instead
    both = dict(mode="pooled", prefill=["cpu:0"], decode=["cpu:1"], engines=[engine("cpu:0"), engine("cpu:1")])
    assert node_health(node(peers=[refused], **both), NOW).status == "degraded"
    h = node_health(node(peers=[], **{**both, "engines": [engine("cpu:0"), engine("cpu:1", "x")]}), NOW)
    assert h.status == "unavailable" and h.reasons[0] == "no decode device is up and no decode peer is ready"


def test_recent_inbound_refusals_degrade_and_old_ones_do_not():
    refused = InboundRefusals()
    refused.record("10.0.0.9:40000", "prefill-a", "weights", "KV layout mismatch", NOW - 1)
    refused.record("10.0.0.8:40000", "", "auth", "could not prove", NOW - 600)
    h = node_health(node(receiver=SimpleNamespace(refused=refused)), NOW)
    assert h.status == "degraded"
    assert h.reasons == ["refused peer prefill-a connecting to the KV port (weights): KV layout mismatch"]


def test_a_step_that_never_returns_marks_its_device_stalled():
    """An engine that lives but loops inside a step (a kernel bug once did) fails no request by itself:
    health names it once its step has run for STALLED_STEP_S, and all devices stalled is unavailable."""
    long_ago = NOW - STALLED_STEP_S - 5
    h = node_health(node(engines=[engine("cpu:0", step_started_s=long_ago), engine("cpu:1", step_started_s=NOW - 1)]), NOW)
    assert h.status == "degraded" and h.reasons == [f"engine cpu:0 stalled: a step has run for {STALLED_STEP_S + 5:.0f} s"]
    h = node_health(node(engines=[engine("cpu:0", step_started_s=long_ago), engine("cpu:1", "gone")]), NOW)
    assert h.status == "unavailable" and h.reasons[0] == "every engine is down or stalled"
    # a busy device whose step is recent, and an idle one, are fine
    assert node_health(node(engines=[engine("cpu:0", step_started_s=NOW - 2.0), engine("cpu:1")]), NOW).status == "ok"
