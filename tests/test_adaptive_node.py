"""The adaptive mode (``shiftnode serve``'s default) on two CPU devices: the same greedy outputs as one
device, MIXED phases with the reason of every switch in ``/v1/node``, free switches between DECODE and
MIXED (no pause), and nothing leaked (issue 27)."""

from support import STORIES, NodeProcess
from test_metrics import scrape
from test_time_shared import bodies, run


def test_adaptive_default_matches_one_device_and_reports_mixed_phases(stories_node):
    node = NodeProcess("--model", str(STORIES), "--devices", "cpu:0,cpu:1", "--tpot-slo-ms", "200",
                       "--ttft-slo-ms", "2000", wait=False)  # no --mode: the default; starts while REF is computed
    try:
        reqs = bodies(20)
        ref = [r.json()["choices"][0]["token_ids"] for r in run(stories_node, reqs, 1)]
        node.wait_up()
        got = run(node, reqs, 20)
        assert all(r.status_code == 200 for r in got)
        assert [r.json()["choices"][0]["token_ids"] for r in got] == ref
        st = node.wait_idle()
        assert st["mode"] == "adaptive"
        switches = [s for d in st["devices"] for s in d["switches"]]
        assert {s["to_role"] for s in switches} >= {"mixed", "decode"}, switches
        free = [s for s in switches if {s["from_role"], s["to_role"]} <= {"decode", "mixed"}]
        assert free and all(s["pause_ms"] == 0 and s["end_s"] == s["start_s"] for s in free)
        assert {s["reason"] for s in free} >= {"chunks_fit", "nothing_waits"}
        assert all(s["reason"] for s in switches)
        assert all(d["role"] in ("decode", "mixed", "prefill") and "chunk_budget" in d for d in st["devices"])
        assert all(d["kv_blocks_used"] == 0 for d in st["devices"])
        assert all(d["steps"] > 0 for d in st["devices"])
        m = scrape(node)
        assert sum(v for k, v in m.items() if k.startswith("shiftnode_role_switches_total")) == len(switches)
    finally:
        node.close()
