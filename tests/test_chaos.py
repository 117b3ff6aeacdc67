"""The chaos run (``bench/load/chaos.py``, issue 45), short: two pooled nodes that find each other through a
real etcd, under streaming load, with engines killed every couple of seconds (most kills aimed at a KV transfer
in flight: an in-node move or a hand-off to the peer), the peer node killed with ``kill -9`` and started again,
and etcd killed and restarted. Every request ends (ok, a clear error, aborted by its client, or lost with its
killed node), greedy answers equal the unkilled reference, no KV block is leaked or owned twice (the ledger
check is on in both nodes), no engine outlives its node, and both nodes are healthy, registered, linked and
exact afterwards. The answer classifier's and the report's rules are unit-tested beside it."""

import pytest

from bench.load.chaos import chaos, in_flight
from bench.load.chaos_nodes import lost_to_a_killed_node
from bench.load.chaos_report import ChaosReport, EtcdRestart, Kill, NodeKill, classify_error
from support import STORIES, require_shared


@pytest.mark.quick
def test_errors_are_clear_only_with_a_code_and_an_honest_status():
    assert classify_error(503, {"type": "service_unavailable", "code": "engine_down"}, "1") == "engine_down"
    assert classify_error(503, {"code": "engine_down"}, None).startswith("unclear:")  # no Retry-After
    assert classify_error(500, {"type": "server_error", "code": "engine_crash"}) == "engine_crash"
    assert classify_error(500, {"type": "server_error", "code": "internal_error"}).startswith("unclear:")
    assert classify_error(502, None).startswith("unclear:")
    # inside a stream (status 200) the event's type carries the status
    assert classify_error(200, {"type": "service_unavailable", "code": "peer_unavailable"}) == "peer_unavailable"
    assert classify_error(200, {"type": "server_error", "code": "internal_error"}).startswith("unclear:")
    assert classify_error(200, {"type": "service_unavailable", "code": None}).startswith("unclear:")


@pytest.mark.quick
def test_the_report_fails_on_each_broken_check():
    def passing() -> ChaosReport:
        rep = ChaosReport("t", kills=[Kill(1.0, "P", "cpu:0", 1, "move-src")], health_after={"P": "ok"},
                          served_after=True, leaked_blocks={"P cpu:0": 0}, live_requests={"P": 0})
        rep.outcomes.update(ok=3, engine_down=1)
        return rep

    assert passing().ok(), passing().failures()
    breaks = {"hung": lambda r: r.outcomes.update(hung=1), "unclear": lambda r: r.outcomes.update({"unclear:500 x": 1}),
              "greedy": lambda r: r.greedy_mismatches.append("x"), "leak": lambda r: r.leaked_blocks.update({"P cpu:0": 2}),
              "held": lambda r: r.live_requests.update(P=1), "errors": lambda r: r.engine_errors.update({"P cpu:0": {"step": 1}}),
              "ledger": lambda r: setattr(r, "ledger_log_lines", 1),
              "asyncio": lambda r: setattr(r, "asyncio_error_lines", 1), "health": lambda r: r.health_after.update(P="degraded"),
              "down": lambda r: r.devices_down_after.append("P cpu:1"), "served": lambda r: setattr(r, "served_after", False),
              "kills": lambda r: r.kills.clear(),
              "orphan": lambda r: r.node_kills.append(NodeKill(2.0, "D", 9, [10, 11], orphans=[11], back_after_s=5.0)),
              "node not back": lambda r: r.node_kills.append(NodeKill(2.0, "D", 9, [10], restart_error="exited")),
              "etcd not back": lambda r: r.etcd_restarts.append(EtcdRestart(3.0, 1.0, error="no health")),
              "membership": lambda r: r.membership_after.update(P="unreachable, members []"),
              "peers": lambda r: r.unhealthy_peers_after.update(P=["D"]),
              "node silent": lambda r: r.health_after.update(D="not answering")}
    for name, brk in breaks.items():
        rep = passing()
        brk(rep)
        assert not rep.ok(), name
    # a node killed and back with no engine left over, and requests lost with it: a pass, counted apart
    rep = passing()
    rep.node_kills.append(NodeKill(2.0, "D", 9, [10], back_after_s=4.0))
    rep.etcd_restarts.append(EtcdRestart(3.0, 1.0, back_after_s=2.5))
    rep.outcomes.update({"lost:connection ServerDisconnectedError": 2})
    assert rep.ok(), rep.failures()
    assert rep.lost == {"lost:connection ServerDisconnectedError": 2} and "lost:" not in str(rep.clear_errors)


@pytest.mark.quick
def test_only_a_dropped_connection_to_a_node_killed_during_the_request_is_lost():
    kills = [NodeKill(10.0, "B", 9, [], back_after_s=5.0), NodeKill(30.0, "B", 19, [])]  # the second never came back
    drop, cut = "unclear:connection ServerDisconnectedError", "unclear:stream ended without [DONE]"
    assert lost_to_a_killed_node(drop, kills, "B", 8.0, 10.5) == "lost:connection ServerDisconnectedError"
    assert lost_to_a_killed_node(cut, kills, "B", 9.0, 10.2) == "lost:stream ended without [DONE]"
    assert lost_to_a_killed_node(drop, kills, "B", 12.0, 12.1).startswith("lost:")  # refused while it was down
    assert lost_to_a_killed_node(drop, kills, "B", 40.0, 40.1).startswith("lost:")  # down for good
    assert lost_to_a_killed_node(drop, kills, "B", 16.0, 20.0) == drop  # back since 15 s: a real failure
    assert lost_to_a_killed_node(drop, kills, "A", 8.0, 10.5) == drop  # another node was killed
    assert lost_to_a_killed_node(drop, kills, "B", 2.0, 9.9) == drop  # ended before the kill
    for other in ("ok", "hung", "unclear:500 internal_error", "engine_down"):  # not a dropped connection
        assert lost_to_a_killed_node(other, kills, "B", 8.0, 10.5) == other


@pytest.mark.quick
def test_in_flight_names_both_ends_of_each_transfer_on_live_devices():
    st = {"devices": [{"device": "cpu:0", "failure": None, "kv_moves_out": ["cpu:1"]},
                      {"device": "cpu:1", "failure": "killed", "kv_moves_out": []}],
          "network": {"sending_from": ["cpu:0"], "receiving_on": ["cpu:1"]}}
    assert sorted(in_flight({"P": st})) == [("P", "cpu:0", "handoff-src"), ("P", "cpu:0", "move-src")]


def test_engines_peer_node_and_etcd_killed_leave_no_leak_no_hang_and_exact_greedy_outputs(tmp_path):
    require_shared()
    rep = chaos("pooled", duration_s=14, kill_every_s=2.0, kill_window=0.7, concurrency=6, targeted=0.8,
                membership="etcd", node_kill_every_s=6.0, node_down_s=0.5, etcd_restart_every_s=6.0,
                greedy_prompts=4, settle_s=60, seed=1, model=STORIES, log_dir=tmp_path)
    print("\n".join(rep.lines()))
    assert rep.ok(), rep.lines()
    assert len(rep.kills) >= 2, rep.lines()  # one per node at least (a node has one device down at most)
    assert any(k.context != "no-transfer" for k in rep.kills), rep.lines()  # a kill met KV in flight
    # the first of each comes 3-9 s in, inside the 9.8 s kill window: one at least, and each came back
    assert rep.node_kills and all(k.back_after_s is not None and k.engines for k in rep.node_kills), rep.lines()
    assert rep.etcd_restarts and all(r.back_after_s is not None for r in rep.etcd_restarts), rep.lines()
    assert rep.greedy_compared >= 5 and rep.greedy_during_kills >= 1, rep.lines()
    assert sum(c["restarts"] for c in rep.counters.values()) >= len(rep.kills) - sum(
        k.node == "D" for k in rep.kills), rep.counters  # D's counters start again when the node does
