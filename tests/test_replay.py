"""bench.load.replay against a live stories260k node (a ~10 s run), and bench.studies.compare's handling of a mode the
node does not have (reported 'not available', never skipped)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.studies.compare import markdown_table, parser as compare_parser, run_mode
from bench.studies.timeline import role_segments
from support import REPO, STORIES
from test_metrics import scrape


DURATION_S = 10  # Poisson arrivals at 3/s for 10 s: 35 requests with seed 7


@pytest.fixture(scope="module")
def node(stories_node):
    """The session's shared stories260k node (tests/conftest.py): the replay's checks count the node's
    tokens from before each run and compare two seeded runs with each other, so its earlier traffic
    does not matter, and a node of its own would cost a start-up."""
    return stories_node


def test_replay_runs_a_poisson_workload_with_exact_lengths(node, tmp_path):
    before = scrape(node)
    out = tmp_path / "run.json"
    cmd = [sys.executable, "-m", "bench.load.replay", "--url", node.url, "--trace", "poisson", "--rate", "3",
           "--duration", str(DURATION_S), "--max-prompt-tokens", "96", "--max-output-tokens", "24", "--seed", "7",
           "--drain-timeout", "60", "--no-progress", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert "Successful requests:" in proc.stdout and "Goodput (req/s):" in proc.stdout
    doc = json.loads(out.read_text())
    reqs, s = doc["requests"], doc["summary"]
    assert len(reqs) == doc["config"]["workload"]["num_requests"] >= 10
    assert [r["error"] for r in reqs] == [None] * len(reqs)
    assert s["completed"] == len(reqs) and s["failed"] == 0
    for r in reqs:  # ignore_eos: the trace's output lengths exactly; one ITL per later token
        assert 1 <= r["prompt_tokens"] <= 96 and r["output_tokens"] == r["max_tokens"] <= 24
        assert 0 < r["ttft_s"] <= r["e2e_s"] and len(r["itls_s"]) == r["output_tokens"] - 1
    # Prompts are token ids, so the node saw exactly the planned token counts.
    after = scrape(node)
    assert after["shiftnode_prompt_tokens_total"] - before.get("shiftnode_prompt_tokens_total", 0) == sum(
        r["prompt_tokens"] for r in reqs)
    assert after["shiftnode_generation_tokens_total"] - before.get("shiftnode_generation_tokens_total", 0) == sum(
        r["output_tokens"] for r in reqs)
    # A sane summary: ordered percentiles, consistent rates, SLO terms in range.
    for m in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert 0 < s[m]["median"] <= s[m]["p90"] <= s[m]["p99"], m
    assert s["ttft_ms"]["mean"] < s["e2el_ms"]["mean"]
    first = min(r["start_s"] for r in reqs)
    assert s["duration_s"] == pytest.approx(max(r["start_s"] + r["e2e_s"] for r in reqs) - first)
    assert max(r["arrival_s"] for r in reqs) < DURATION_S and s["duration_s"] < DURATION_S + 60  # arrivals stop; drain is bounded
    assert s["request_throughput"] == pytest.approx(s["completed"] / s["duration_s"])
    assert s["output_throughput"] == pytest.approx(sum(r["output_tokens"] for r in reqs) / s["duration_s"])
    assert 0 <= s["slo_attainment"] <= 1 and s["goodput"] <= s["request_throughput"] + 1e-9
    assert doc["node_clock_start_s"] < doc["node_clock_end_s"]


@pytest.mark.quick
def test_compare_reports_a_mode_the_node_lacks_as_not_available(tmp_path):
    # Any mode the node refuses at start-up (as it refused "pooled" before that mode existed).
    a = compare_parser().parse_args(["--modes", "no-such-mode", "--model", str(STORIES), "--rates", "1"])
    rows = run_mode(a, "no-such-mode", [1.0], tmp_path)
    assert len(rows) == 1 and rows[0]["available"] is False and "no-such-mode" in rows[0]["reason"]
    table = markdown_table(rows)
    assert "| no-such-mode |" in table and "not available" in table


@pytest.mark.quick
def test_role_segments_follow_switch_records():
    recs = [{"start_s": 11.0, "end_s": 11.5, "from_role": "prefill", "to_role": "decode", "pause_ms": 300.0},
            {"start_s": 13.0, "end_s": 13.1, "from_role": "decode", "to_role": "prefill", "pause_ms": 100.0},
            {"start_s": 2.0, "end_s": 2.1, "from_role": "decode", "to_role": "prefill", "pause_ms": 100.0}]
    segs = role_segments(recs, 10.0, 14.0, "prefill")
    assert [(round(a, 6), round(b, 6), s) for a, b, s in segs] == [
        (0.0, 1.0, "prefill"), (1.0, 1.2, "drain"), (1.2, 1.5, "pause"), (1.5, 3.0, "decode"),
        (3.0, 3.1, "pause"), (3.1, 4.0, "prefill")]
    assert role_segments([], 0.0, 5.0, "mixed") == [(0.0, 5.0, "mixed")]


def test_natural_eos_replay_sends_a_cap_and_counts_an_early_end_as_success(node, tmp_path):
    """--natural-eos: no ignore_eos, max_tokens only a cap, so a sampled story that ends (EOS) before it is a
    success with fewer tokens; every request of the same seed samples the same tokens."""
    docs = []
    for run in range(2):
        out = tmp_path / f"run{run}.json"
        cmd = [sys.executable, "-m", "bench.load.replay", "--url", node.url, "--trace", "poisson", "--rate", "3",
               "--duration", "3", "--lengths-from", "fixed:16:400", "--seed", "3", "--natural-eos",
               "--temperature", "1.0", "--drain-timeout", "60", "--no-progress", "--out", str(out)]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stderr
        docs.append(json.loads(out.read_text()))
    reqs = docs[0]["requests"]
    assert [r["error"] for r in reqs] == [None] * len(reqs) and len(reqs) >= 5
    assert all(1 <= r["output_tokens"] <= r["max_tokens"] == 400 for r in reqs)
    assert any(r["output_tokens"] < 400 for r in reqs)  # EOS ended some: the node was not told the length
    assert [r["output_tokens"] for r in reqs] == [r["output_tokens"] for r in docs[1]["requests"]]  # seeded
