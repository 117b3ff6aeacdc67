"""The adaptive mode (``shiftnode serve``'s default) on two CPU devices: the same greedy outputs as one
device, MIXED phases with the reason of every switch in ``/v1/node``, free switches between DECODE and
MIXED (no pause), and nothing leaked (issue 27)."""

import json

import httpx
import pytest

from support import STORIES, NodeProcess
from test_metrics import scrape
from test_time_shared import bodies, run

pytestmark = pytest.mark.slow_only("both tests start two-device adaptive nodes of their own (one on timed 70B devices)")


def test_adaptive_matches_one_device_and_reports_mixed_phases(stories_node):
    node = NodeProcess("--model", str(STORIES), "--mode", "adaptive", "--devices", "cpu:0,cpu:1", "--tpot-slo-ms", "200",
                       "--ttft-slo-ms", "2000", wait=False)  # starts while REF is computed
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


def test_adaptive_hands_prompts_off_where_no_chunk_fits_a_70b_decode_step():
    """Two timed devices paced by the 70B roofline (an eager mixed step ~36 ms, a decode step well under
    the 18 ms target at TPOT 20 ms): the node opens hand-off windows (node.core.handoff_windows), one device
    prefills and its sequences move to the other, copied beside its later steps; every request gets all
    its tokens and no block is left. Each prompt is sent once the one before has its first token (an event,
    not a fixed stagger: on a loaded machine prompts sent at fixed times could all queue before any decodes),
    so every prompt after the first meets sequences decoding on the node."""
    import concurrent.futures
    import random
    import threading

    from support import REPO
    node = NodeProcess("--mode", "adaptive", "--devices", "cpu:0,cpu:1", "--model", str(REPO / "bench/configs/llama3-70b"),
                       "--benchmark-model", f"timed:{REPO / 'bench/cost_models/h200_llama3_70b_tp8_roofline.json'}",
                       "--kv-cache-memory", "60GiB", "--tpot-slo-ms", "20", "--ttft-slo-ms", "2000")
    try:
        model = node.client.get("/v1/models").json()["data"][0]["id"]
        rng = random.Random(0)
        bodies_ = [{"model": model, "prompt": [rng.randint(10, 1000) for _ in range(rng.randint(200, 1500))],
                    "max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": True, "return_token_ids": True,
                    "stream_options": {"include_usage": True}} for _ in range(24)]
        first_token = [threading.Event() for _ in bodies_]

        def send(i):
            if i:
                first_token[i - 1].wait(120)
            try:
                # a client per thread (support.post_concurrently says why)
                with httpx.Client(base_url=node.url, timeout=120, verify=False) as client, \
                        client.stream("POST", "/v1/completions", json=bodies_[i]) as r:
                    events = []
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            events.append(json.loads(line[6:]))
                            if any(c.get("token_ids") for c in events[-1]["choices"]):
                                first_token[i].set()
                    return r.status_code, events[-1]["usage"]
            finally:
                first_token[i].set()  # a request that failed must not hold the ones after it

        with concurrent.futures.ThreadPoolExecutor(24) as pool:
            got = list(pool.map(send, range(24)))
        assert [status for status, _ in got] == [200] * 24
        assert all(usage["completion_tokens"] == 200 for _, usage in got)
        st = node.wait_idle()
        switches = [(d["device"], s["to_role"], s["reason"]) for d in st["devices"] for s in d["switches"]]
        assert any(to == "prefill" and why == "handoff" for _, to, why in switches), switches
        handoffs = [t for t in st["kv_transfers"] if t["reason"] == "handoff"]
        assert handoffs and all(t["src"] != t["dst"] and t["nbytes"] > 0 for t in handoffs)
        assert all(d["kv_blocks_used"] == 0 for d in st["devices"])
        moved = scrape(node)
        counted = [v for k, v in moved.items()
                   if k.startswith("shiftnode_kv_transfers_total") and "reason=handoff" in k]
        assert sum(counted) == len(handoffs)
    finally:
        node.close()
