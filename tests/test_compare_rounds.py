"""bench.studies.compare's budget variants (``MODE@N``), interleaved rounds and ratio table, without a node:
the node process and the replay are replaced by fakes that record what the study asked of them."""

from __future__ import annotations

import pytest

from bench.studies import compare
from bench.studies.compare import node_args, parser, ratio_table, split_entry
from bench.studies.validate_sim import compare_summaries, switch_swaps_ms
from bench.traffic.metrics import Stat, Summary

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here


def test_budget_variants_get_their_own_flag_and_mode_args():
    a = parser().parse_args(["--devices", "cpu:0", "--max-num-batched-tokens", "2048",
                             "--mode-args", "colocated=--max-num-seqs 64", "--mode-args", "colocated@64=--block-size 8"])
    assert split_entry("colocated@64") == ("colocated", 64) and split_entry("adaptive") == ("adaptive", None)
    args = node_args(a, "colocated@64")
    assert args[:2] == ["--mode", "colocated"]
    assert args[args.index("--max-num-batched-tokens") + 1] == "64" and args.count("--max-num-batched-tokens") == 1
    assert "--max-num-seqs" in args and "--block-size" in args  # bare-mode and entry mode-args both apply
    plain = node_args(a, "colocated")
    assert plain[plain.index("--max-num-batched-tokens") + 1] == "2048" and "--block-size" not in plain
    for bad in ("colocated@", "colocated@0", "colocated@x"):
        with pytest.raises(ValueError):
            split_entry(bad)


class FakeNode:
    """Stands in for NodeServer: records which entry it serves; always alive."""

    started: list[str] = []

    def __init__(self, args, log_path, env, startup_timeout_s):
        self.entry = log_path.name.removeprefix("node_").removesuffix(".log")
        self.url = "http://fake"

    def __enter__(self):
        FakeNode.started.append(self.entry)
        return self

    def __exit__(self, *exc):
        return None

    def alive(self):
        return True


def _summary(ttft, itl):
    return {"ttft_ms": {"p90": ttft}, "itl_ms": {"p90": itl}}


def test_rounds_start_every_node_first_then_alternate_with_a_seed_per_round(monkeypatch, tmp_path):
    calls = []

    async def no_info(url, vocab):
        return None

    def fake_run_rate(node, a, mode, rate, info, out, round_=None):
        assert FakeNode.started == ["adaptive", "colocated@64"]  # both nodes up before any replay
        calls.append((round_, mode, rate, a.seed))
        return {"mode": mode, "rate": rate, "round": round_, "available": True, "summary": _summary(10, 1)}

    FakeNode.started = []
    monkeypatch.setattr(compare, "NodeServer", FakeNode)
    monkeypatch.setattr(compare, "_server_info", no_info)
    monkeypatch.setattr(compare, "run_rate", fake_run_rate)
    a = parser().parse_args(["--seed", "5"])
    rows = compare.run_rounds(a, ["adaptive", "colocated@64"], [40.0], tmp_path, rounds=3)
    assert calls == [(0, "adaptive", 40.0, 5), (0, "colocated@64", 40.0, 5), (1, "colocated@64", 40.0, 6),
                     (1, "adaptive", 40.0, 6), (2, "adaptive", 40.0, 7), (2, "colocated@64", 40.0, 7)]
    assert len(rows) == 6 and a.seed == 5


def test_ratio_table_pairs_runs_of_the_same_round():
    rows = [{"mode": "base", "rate": 40.0, "round": 0, "available": True, "summary": _summary(20.0, 8.0)},
            {"mode": "new", "rate": 40.0, "round": 0, "available": True, "summary": _summary(30.0, 8.0)},
            {"mode": "base", "rate": 40.0, "round": 1, "available": True, "summary": _summary(40.0, 10.0)},
            {"mode": "new", "rate": 40.0, "round": 1, "available": True, "summary": _summary(40.0, 12.0)},
            {"mode": "new", "rate": 40.0, "round": 2, "available": True, "summary": _summary(99.0, 99.0)},  # no pair
            {"mode": "gone", "rate": None, "available": False, "reason": "x"}]
    table = ratio_table(rows, "base")
    line = next(x for x in table.splitlines() if x.startswith("| new |"))
    assert line == "| new | 40 | 1.25 | 1.10 | 1.50/1.00, 1.00/1.20 |"
    assert "gone" not in table


def test_free_switches_do_not_dilute_the_simulated_pause():
    status = {"devices": [{"switches": [
        {"from_role": "decode", "to_role": "mixed", "pause_ms": 0.0},
        {"from_role": "mixed", "to_role": "prefill", "pause_ms": 3.0},
        {"from_role": "prefill", "to_role": "decode", "pause_ms": 5.0},
        {"from_role": "mixed", "to_role": "decode", "pause_ms": 0.0}]}]}
    assert switch_swaps_ms(status) == [3.0, 5.0]


def _ttft_summary(ttft_median_ms: float) -> Summary:
    stat = Stat(median=ttft_median_ms, p90=2 * ttft_median_ms, p99=3 * ttft_median_ms)
    return Summary(completed=1, failed=0, duration_s=1.0, total_input_tokens=1, total_output_tokens=1,
                   request_throughput=1.0, output_throughput=1.0, total_token_throughput=2.0,
                   ttft_ms=stat, tpot_ms=Stat(median=5.0, p90=6.0, p99=7.0), itl_ms=Stat(), e2el_ms=Stat())


def test_the_simulation_is_compared_with_the_median_of_the_live_replays():
    """Three replays of one workload: the error is taken against their median, not the first replay."""
    rows = {(r["metric"], r["stat"]): r for r in compare_summaries(
        [_ttft_summary(100.0), _ttft_summary(70.0), _ttft_summary(80.0)], _ttft_summary(88.0))}
    ttft = rows[("ttft_ms", "median")]
    assert ttft["live_ms"] == 80.0 and ttft["rel_err"] == pytest.approx(0.10)
    assert ttft["live_runs_ms"] == [100.0, 70.0, 80.0] and ttft["live_spread"] == pytest.approx(30 / 80)
    one = {(r["metric"], r["stat"]): r for r in compare_summaries(_ttft_summary(100.0), _ttft_summary(88.0))}
    assert one[("ttft_ms", "median")]["rel_err"] == pytest.approx(-0.12) and "live_spread" not in one[("ttft_ms", "median")]


def test_each_live_replay_draws_new_prompt_contents_over_the_same_arrivals(monkeypatch):
    """A second replay of identical prompts would be served from the prefix cache the first one filled."""
    import argparse
    import asyncio

    from bench.studies import validate_sim

    seen = []

    async def fake_info(session, url):
        return argparse.Namespace(max_model_len=2048)

    async def fake_replay(url, requests, info, *, seed, **kw):
        seen.append((tuple(requests), seed))
        return "result"

    monkeypatch.setattr(validate_sim, "fetch_server_info", fake_info)
    monkeypatch.setattr(validate_sim, "replay", fake_replay)
    monkeypatch.setattr(validate_sim, "spec_from_args", lambda a, max_model_len: a.seed)
    monkeypatch.setattr(validate_sim, "build_workload", lambda seed: argparse.Namespace(requests=[f"arrivals of {seed}"]))
    a = argparse.Namespace(seed=7, ttft_slo_ms=None, tpot_slo_ms=None, drain_timeout=1.0)
    for i in range(3):
        asyncio.run(validate_sim._live("http://node", a, i))
    assert seen == [(("arrivals of 7",), 7), (("arrivals of 7",), 8), (("arrivals of 7",), 9)]
