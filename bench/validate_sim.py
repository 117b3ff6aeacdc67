"""Check the simulator against the real node: the same workload, live and simulated, side by side.

``python -m bench.validate_sim --modes time-shared --devices cpu:0 --trace azure-conv --rate 2
--duration 20 --max-prompt-tokens 256 --max-output-tokens 64 --max-num-batched-tokens 512
--cost-model bench/cost_models/cpu_stories260k.json``

For each mode: start a node (stories260k by default, ``OMP_NUM_THREADS=1`` on CPU devices), replay the
workload against it (:mod:`bench.replay`), stop it; then simulate the identical request list
(:mod:`bench.workload` is deterministic) on a :class:`bench.sim.SimConfig` with the node's own
geometry (devices, KV blocks per device and block size from ``GET /v1/node``, context from
``/v1/models``) and the node's flags. It prints, per mode, the median / p90 / p99 of TTFT and TPOT (ms),
live and simulated, and the relative error ``(sim - live) / live``; the exit status is 1 when a median
or p90 is off by more than ``--tolerance`` (default 25%). ``--calibrate runner`` measures the cost model
afresh first (on a shared machine, step times drift with the load of other processes);
``--calibrate node`` measures it through each live node's API (:mod:`bench.calibrate_node`), which
includes the node's per-step shell and in-process contention that the runner alone does not see. A bench, not a test:
it depends on the machine, and on the machine being otherwise quiet.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import aiohttp

from bench.calibrate import load_cost_model, main as calibrate_main
from bench.calibrate_node import calibrate as calibrate_node
from bench.metrics import Summary
from bench.node_process import NodeServer, NodeUnavailable
from bench.replay import fetch_server_info, replay
from bench.sim import SimConfig, simulate
from bench.workload import add_workload_args, build_workload, shared_dir, spec_from_args

REPO = Path(__file__).resolve().parents[1]
STATS = (("ttft_ms", "median"), ("ttft_ms", "p90"), ("ttft_ms", "p99"),
         ("tpot_ms", "median"), ("tpot_ms", "p90"), ("tpot_ms", "p99"))
CHECKED = ("median", "p90")


async def _live(url: str, a: argparse.Namespace):
    async with aiohttp.ClientSession() as s:
        info = await fetch_server_info(s, url)
    wl = build_workload(spec_from_args(a, max_model_len=info.max_model_len))
    res = await replay(url, wl.requests, info, seed=a.seed, ttft_slo_ms=a.ttft_slo_ms, tpot_slo_ms=a.tpot_slo_ms,
                       drain_timeout_s=a.drain_timeout, progress=False)
    return info, wl, res


def compare_summaries(live: Summary, sim: Summary) -> list[dict]:
    """Rows ``{metric, stat, live_ms, sim_ms, rel_err}`` for :data:`STATS`."""
    rows = []
    for metric, stat in STATS:
        lv = getattr(getattr(live, metric), stat)
        sv = getattr(getattr(sim, metric), stat)
        rows.append({"metric": metric, "stat": stat, "live_ms": lv, "sim_ms": sv,
                     "rel_err": (sv - lv) / lv if lv else float("inf")})
    return rows


def validate_mode(a: argparse.Namespace, mode: str, out: Path) -> dict:
    serve = ["--mode", mode, "--devices", a.devices, "--model", a.model, "--ttft-slo-ms", str(a.ttft_slo_ms),
             "--tpot-slo-ms", str(a.tpot_slo_ms), "--max-num-batched-tokens", str(a.max_num_batched_tokens),
             "--reconfig-pause-ms", str(a.reconfig_pause_ms)]
    env = {"OMP_NUM_THREADS": "1"} if a.devices.startswith("cpu") else {}
    cost_path = a.cost_model
    with NodeServer(serve, log_path=out / f"validate_node_{mode}.log", env=env) as node:
        if a.calibrate == "node":
            cost_path = out / f"cost_model_node_{mode}.json"
            calibrate_node(node.url, cost_path, max_prompt_tokens=a.max_prompt_tokens or 256)
            node.wait_idle()
        switches0 = sum(d.get("switch_count", 0) for d in node.get_json("/v1/node")["devices"])
        info, wl, res = asyncio.run(_live(node.url, a))
        status = node.get_json("/v1/node")
    dev0 = status["devices"][0]
    cfg = SimConfig(mode=mode, devices=len(status["devices"]), kv_blocks=dev0["kv_blocks_total"],
                    block_size=status["block_size"], max_model_len=info.max_model_len or 2048,
                    max_num_batched_tokens=a.max_num_batched_tokens, ttft_slo_ms=a.ttft_slo_ms,
                    tpot_slo_ms=a.tpot_slo_ms, reconfig_pause_ms=a.reconfig_pause_ms)
    sim = simulate(wl.requests, cfg, load_cost_model(cost_path))
    rows = compare_summaries(res.summary, sim.summary)
    live_switches = sum(d.get("switch_count", 0) for d in status["devices"]) - switches0
    return {"mode": mode, "requests": len(wl.requests), "live_failed": res.summary.failed,
            "sim_failed": sim.summary.failed, "cost_model": str(cost_path),
            "live_switches": live_switches, "sim_switches": sim.stats.get("switches", 0),
            "rows": rows, "ok": all(abs(r["rel_err"]) <= a.tolerance for r in rows if r["stat"] in CHECKED)}


def format_report(results: list[dict], tolerance: float) -> str:
    lines = ["| mode | metric | stat | live (ms) | sim (ms) | sim vs live |", "|---|---|---|---:|---:|---:|"]
    for res in results:
        if "error" in res:
            lines.append(f"| {res['mode']} | — | — | — | — | {res['error']} |")
            continue
        for r in res["rows"]:
            flag = "" if r["stat"] not in CHECKED or abs(r["rel_err"]) <= tolerance else " ✗"
            lines.append(f"| {res['mode']} | {r['metric'][:-3].upper()} | {r['stat']} | {r['live_ms']:.1f} | "
                         f"{r['sim_ms']:.1f} | {r['rel_err']:+.0%}{flag} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.validate_sim", description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="time-shared")
    ap.add_argument("--devices", default="cpu:0")
    ap.add_argument("--model", default=str(shared_dir() / "models" / "stories260k"))
    ap.add_argument("--cost-model", default=str(REPO / "bench" / "cost_models" / "cpu_stories260k.json"))
    ap.add_argument("--calibrate", default="none", choices=["none", "runner", "node"],
                    help="cost model: none = --cost-model; runner = measure afresh with bench.calibrate just before "
                         "the live runs; node = probe each mode's live node through its API first "
                         "(bench.calibrate_node: the steps as the client sees them)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--reconfig-pause-ms", type=float, default=0.0)
    ap.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    ap.add_argument("--tpot-slo-ms", type=float, default=100.0)
    ap.add_argument("--drain-timeout", type=float, default=60.0)
    ap.add_argument("--tolerance", type=float, default=0.25, help="largest |sim - live| / live for medians and p90s")
    ap.add_argument("--out", default=None, help="folder for the report JSON and node logs (default bench/out/validate)")
    add_workload_args(ap)
    a = ap.parse_args(argv)
    out = Path(a.out) if a.out else REPO / "bench" / "out" / "validate"
    out.mkdir(parents=True, exist_ok=True)
    if a.calibrate == "runner":
        a.cost_model = str(out / "cost_model_runner.json")
        cal = ["--model", a.model, "--device", a.devices.split(",")[0], "--threads", "1", "--quadratic",
               "--max-num-batched-tokens", str(a.max_num_batched_tokens), "--out", a.cost_model]
        if a.max_prompt_tokens:
            cal += ["--max-prompt-tokens", str(a.max_prompt_tokens)]
        calibrate_main(cal)
    results = []
    for mode in [m.strip() for m in a.modes.split(",") if m.strip()]:
        try:
            results.append(validate_mode(a, mode, out))
        except NodeUnavailable as e:
            results.append({"mode": mode, "error": f"not available: {e}", "ok": False})
    report = format_report(results, a.tolerance)
    (out / "validate_sim.json").write_text(json.dumps({"argv": argv or sys.argv[1:], "results": results}, indent=1))
    print(report)
    for r in results:
        if "error" not in r:
            print(f"{r['mode']}: {r['requests']} requests, failed live {r['live_failed']} / sim {r['sim_failed']}, "
                  f"switches live {r['live_switches']} / sim {r['sim_switches']}")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
