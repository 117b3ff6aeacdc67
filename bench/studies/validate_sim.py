"""Check the simulator against the real node: the same workload, live and simulated, side by side.

``python -m bench.studies.validate_sim --modes time-shared --devices cpu:0 --trace azure-conv --rate 2
--duration 20 --max-prompt-tokens 256 --max-output-tokens 64 --max-num-batched-tokens 512
--cost-model bench/cost_models/cpu_stories260k.json``

For each mode: start a node (stories260k by default, ``OMP_NUM_THREADS=1`` on CPU devices), replay the
workload against it (:mod:`bench.load.replay`), stop it; then simulate the identical request list
(:mod:`bench.traffic.workload` is deterministic) on a :class:`bench.sim.SimConfig` with the node's own
geometry (devices, KV blocks per device and block size from ``GET /v1/node``, context from
``/v1/models``) and the node's flags. It prints, per mode, the median / p90 / p99 of TTFT and TPOT (ms),
live and simulated, and the relative error ``(sim - live) / live``; the exit status is 1 when a median
or p90 is off by more than ``--tolerance`` (default 25%). ``--calibrate runner`` measures the cost model
afresh first (on a shared machine, step times drift with the load of other processes);
``--calibrate node`` measures it through each live node's API (:mod:`bench.cost.calibrate_node`), which
includes the node's per-step shell and in-process contention that the runner alone does not see;
``--calibrate runner+node`` keeps the runner's model for the steps and probes the node only for its
host overheads — a fixed time per step and per request (:func:`host_overheads`), which the simulator
then adds (``SimConfig.step_overhead_ms``, ``request_overhead_ms``); ``--calibrate overheads`` probes
the node for those host overheads alone and keeps ``--cost-model`` for the steps (what a timed device's
steps take by construction). When the node was probed, a
time-shared simulation's switch pause is the mean swap of the probe's own switches (``--pause-ms`` to
set it). ``--repeat N`` replays the workload N times on each live node: the simulation is then compared
with the median of the N replays' statistics, and the report shows how much the live node disagrees
with itself (per-request rows and failure counts are the first replay's). A bench, not a test: it
depends on the machine, and on the machine being otherwise quiet.

**Timed devices** (issue 13's validation target): ``--benchmark-model timed:PATH --kv-cache-memory 60GiB
--model bench/configs/llama3-8b`` runs the live node on devices whose steps take the cost model PATH's
time for their work, with the geometry's KV blocks and transfer sizes (``node/worker/timed_step.py``);
the simulation then uses the same cost model (``--cost-model`` defaults to PATH), the geometry's KV bytes
per token and ``--link-gbps``, so the comparison isolates what the simulator leaves out of the live
node (its host work, its clock, the policies' view of a running system). ``--prefill-devices N``
(pooled): the first N of ``--devices`` prefill, the rest decode. ``--modes`` takes ``time-shared``,
``colocated`` (the node's default), ``pooled`` and ``adaptive`` (DECODE, MIXED and PREFILL windows per
device; the simulator runs the same ``AdaptiveScheduler``); an adaptive or time-shared simulation's
switch pause is the mean over the probe's paid switches (those to or from PREFILL, not DECODE <-> MIXED).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import aiohttp

from bench.cost.calibrate import load_cost_model, main as calibrate_main
from bench.cost.calibrate_node import calibrate as calibrate_node, probe
from bench.load.node_process import NodeServer, NodeUnavailable
from bench.load.replay import fetch_server_info, replay
from bench.sim import SimConfig, kv_geometry, simulate
from bench.traffic.metrics import Summary, request_tpot_s
from node.plan import load_config, resolve_dtype
from node.core.cost import CostModel
from bench.traffic.workload import add_workload_args, build_workload, shared_dir, spec_from_args

REPO = Path(__file__).resolve().parents[2]
STATS = (("ttft_ms", "median"), ("ttft_ms", "p90"), ("ttft_ms", "p99"),
         ("tpot_ms", "median"), ("tpot_ms", "p90"), ("tpot_ms", "p99"))
CHECKED = ("median", "p90")


async def _live(url: str, a: argparse.Namespace, replay_index: int = 0):
    """One replay of the workload. Replay ``i`` draws its prompts' token ids with seed ``--seed + i``: the
    same arrivals and lengths (the workload is built from ``--seed`` alone), new contents, so a later replay
    does not hit the prefix cache the earlier ones filled (identical prompts would: TTFT 17 against 210 ms)."""
    async with aiohttp.ClientSession() as s:
        info = await fetch_server_info(s, url)
    wl = build_workload(spec_from_args(a, max_model_len=info.max_model_len))
    res = await replay(url, wl.requests, info, seed=a.seed + replay_index, ttft_slo_ms=a.ttft_slo_ms,
                       tpot_slo_ms=a.tpot_slo_ms, drain_timeout_s=a.drain_timeout, progress=False)
    return info, wl, res


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 3)


def compare_summaries(live: Summary | list[Summary], sim: Summary) -> list[dict]:
    """Rows ``{metric, stat, live_ms, sim_ms, rel_err}`` for :data:`STATS` (times in ms).

    ``live`` may be several replays of one workload on one node: then ``live_ms`` is the median of their
    statistics (the live node's central value; one replay alone carries its run-to-run spread, which reached
    28 % on timed devices), and each row also gets ``live_runs_ms`` and ``live_spread``, (max - min) / median.
    The simulation is deterministic for a request list, so it is compared once.
    """
    lives = live if isinstance(live, list) else [live]
    rows = []
    for metric, stat in STATS:
        vals = [getattr(getattr(lv, metric), stat) for lv in lives]
        lv = statistics.median(vals)
        sv = getattr(getattr(sim, metric), stat)
        row = {"metric": metric, "stat": stat, "live_ms": lv, "sim_ms": sv,
               "rel_err": (sv - lv) / lv if lv else float("inf")}
        if len(vals) > 1:
            row["live_runs_ms"] = vals
            row["live_spread"] = (max(vals) - min(vals)) / lv if lv else 0.0
        rows.append(row)
    return rows


def host_overheads(cost: CostModel, prefill: list[tuple[int, float]], decode: list[tuple[int, int, float]]
                   ) -> tuple[float, float]:
    """``(step overhead s, request overhead s)`` of a live node over a runner-measured cost model.

    From the node probe (:func:`bench.cost.calibrate_node.probe`): the step overhead is the median, over
    the probe's decode batches (1 to 16 concurrent sequences: a per-step cost does not depend on the
    batch, and one batch size alone is one noisy sample), of the inter-token gap minus the runner's
    decode step; the request overhead is the median, over the lone prefills, of the TTFT minus the runner's prefill
    step and one step overhead (what is left: HTTP, parsing, queueing to the device, first-chunk
    delivery). Both at least 0.
    """
    steps = [s - cost.decode_step_s(b, k) for b, k, s in decode]
    step = max(0.0, statistics.median(steps)) if steps else 0.0
    reqs = [t - cost.prefill_step_s(n) - step for n, t in prefill]
    return step, max(0.0, statistics.median(reqs)) if reqs else 0.0


FREE_ROLES = ("decode", "mixed")  # adaptive: switches between these share one configuration, no pause


def switch_swaps_ms(status: dict) -> list[float]:
    """The pause (ms) of every paid role switch in a ``GET /v1/node`` document: its devices' switch records,
    less the free ones (DECODE <-> MIXED in adaptive mode, recorded with zero pause), which the simulator
    does not charge and which would otherwise dilute the mean pause it is given."""
    return [float(r.get("pause_ms", 0.0)) for d in status["devices"] for r in d.get("switches") or []
            if not (r.get("from_role") in FREE_ROLES and r.get("to_role") in FREE_ROLES)]


def validate_mode(a: argparse.Namespace, mode: str, out: Path) -> dict:
    serve = ["--mode", mode, "--model", a.model, "--ttft-slo-ms", str(a.ttft_slo_ms),
             "--tpot-slo-ms", str(a.tpot_slo_ms), "--max-num-batched-tokens", str(a.max_num_batched_tokens),
             "--reconfig-pause-ms", str(a.reconfig_pause_ms), "--max-num-seqs", str(a.max_num_seqs)]
    devices = a.devices.split(",")
    if mode == "pooled":
        n = a.prefill_devices or max(1, len(devices) // 2)
        serve += ["--prefill-devices", ",".join(devices[:n]), "--decode-devices", ",".join(devices[n:])]
    else:
        serve += ["--devices", a.devices]
    for flag, value in (("--benchmark-model", a.benchmark_model), ("--kv-cache-memory", a.kv_cache_memory),
                        ("--link-gbps", a.link_gbps), ("--max-model-len", a.max_model_len)):
        if value is not None:
            serve += [flag, str(value)]
    env = {"OMP_NUM_THREADS": "1"} if a.devices.startswith("cpu") else {}
    cost_path = a.cost_model
    step_ms, request_ms, pause_ms = a.step_overhead_ms, a.request_overhead_ms, a.pause_ms
    measured: dict = {}
    with NodeServer(serve, log_path=out / f"validate_node_{mode}.log", env=env) as node:
        if a.calibrate == "node":
            cost_path = out / f"cost_model_node_{mode}.json"
            calibrate_node(node.url, cost_path, max_prompt_tokens=a.max_prompt_tokens or 256)
            node.wait_idle()
        elif a.calibrate in ("runner+node", "overheads"):
            prefill, decode = asyncio.run(probe(node.url, max_prompt_tokens=a.max_prompt_tokens or 256))
            step_s, req_s = host_overheads(load_cost_model(cost_path), prefill, decode)
            step_ms, request_ms = step_s * 1e3, req_s * 1e3
            measured = {"step_overhead_ms": round(step_ms, 3), "request_overhead_ms": round(request_ms, 3),
                        "probe_prefill": prefill, "probe_decode": decode}
            node.wait_idle()
        status0 = node.get_json("/v1/node")
        if a.calibrate in ("node", "runner+node", "overheads") and mode in ("time-shared", "adaptive") \
                and a.pause_ms is None:
            swaps = switch_swaps_ms(status0)  # the probe's switches: the node's own swap time
            pause_ms = statistics.mean(swaps) if swaps else 0.0
            measured["pause_ms"] = round(pause_ms, 3)
        switches0 = sum(d.get("switch_count", 0) for d in status0["devices"])
        lives = []
        for i in range(a.repeat):
            lives.append(asyncio.run(_live(node.url, a, i)))
            node.wait_idle()
        status = node.get_json("/v1/node")
    info, wl, res = lives[0]
    dev0 = status["devices"][0]
    model_cfg = load_config(a.model)
    per_token = kv_geometry(model_cfg, dtype=resolve_dtype(a.kv_dtype, model_cfg), block_size=status["block_size"],
                            kv_cache_bytes=1)[0]  # only the bytes per token: copies in the simulation
    cfg = SimConfig(mode=mode, devices=len(status["devices"]), kv_blocks=dev0["kv_blocks_total"],
                    prefill_devices=a.prefill_devices, kv_bytes_per_token=per_token,
                    link_gbps=a.link_gbps or 1e6, max_num_seqs=a.max_num_seqs,
                    block_size=status["block_size"], max_model_len=info.max_model_len or 2048,
                    max_num_batched_tokens=a.max_num_batched_tokens, ttft_slo_ms=a.ttft_slo_ms,
                    tpot_slo_ms=a.tpot_slo_ms, reconfig_pause_ms=a.reconfig_pause_ms,
                    step_overhead_ms=step_ms, request_overhead_ms=request_ms, pause_ms=pause_ms or 0.0)
    depths = [int(x) for x in str(a.step_pipeline).split(",")]
    sims = {d: simulate(wl.requests, replace(cfg, step_pipeline=d), load_cost_model(cost_path)) for d in depths}
    sim = sims[depths[0]]
    live_summaries = [lv[2].summary for lv in lives]  # every replay: the median is compared
    rows = compare_summaries(live_summaries, sim.summary)
    for d in depths[1:]:  # the same live runs against other pipeline depths (reported, not checked)
        for row, other in zip(rows, compare_summaries(live_summaries, sims[d].summary)):
            row.setdefault("other_pipelines", {})[d] = {"sim_ms": other["sim_ms"], "rel_err": other["rel_err"]}
    live_switches = (sum(d.get("switch_count", 0) for d in status["devices"]) - switches0) / len(lives)
    moved = [m for m in status.get("kv_transfers", []) if m["start_s"] >= status0["clock_s"]]  # the last 200
    live_moves = {r: sum(1 for m in moved if m["reason"] == r) / len(lives) for r in sorted({m["reason"] for m in moved})}
    sim_moves = {k.removeprefix("moves_"): v for k, v in sim.stats.items() if k.startswith("moves_")}
    if mode == "pooled":
        sim_moves = {"pooled": sim.stats.get("transfers", 0)}
    per_request = [{"arrival_s": r.arrival_s, "prompt": r.prompt_tokens, "output": r.output_tokens,
                    "live_ttft_ms": _ms(lv.ttft_s), "sim_ttft_ms": _ms(sv.ttft_s),
                    "live_tpot_ms": _ms(request_tpot_s(lv)), "sim_tpot_ms": _ms(request_tpot_s(sv))}
                   for r, lv, sv in zip(wl.requests, res.records, sim.records)]
    return {"mode": mode, "requests": len(wl.requests), "live_failed": res.summary.failed,
            "sim_failed": sim.summary.failed, "cost_model": str(cost_path), "sim_overheads": {
                "step_overhead_ms": step_ms, "request_overhead_ms": request_ms, "pause_ms": pause_ms or 0.0},
            "measured": measured, "live_switches": live_switches, "sim_switches": sim.stats.get("switches", 0),
            "sim_free_switches": sim.stats.get("free_switches", 0), "sim_switch_reasons": sim.stats.get("switch_reasons", {}),
            "live_moves": live_moves, "sim_moves": sim_moves,
            "rows": rows, "per_request": per_request,
            "ok": all(abs(r["rel_err"]) <= a.tolerance for r in rows if r["stat"] in CHECKED)}


def format_report(results: list[dict], tolerance: float) -> str:
    spread = any("live_spread" in r for res in results for r in res.get("rows", []))
    others = sorted({d for res in results for r in res.get("rows", []) for d in r.get("other_pipelines", {})})
    lines = ["| mode | metric | stat | live (ms) | sim (ms) | sim vs live |" + (" live run-to-run |" if spread else "")
             + "".join(f" sim, pipeline {d} |" for d in others),
             "|---|---|---|---:|---:|---:|" + ("---:|" if spread else "") + "---:|" * len(others)]
    for res in results:
        if "error" in res:
            lines.append(f"| {res['mode']} | — | — | — | — | {res['error']} |")
            continue
        for r in res["rows"]:
            flag = "" if r["stat"] not in CHECKED or abs(r["rel_err"]) <= tolerance else " ✗"
            extra = ""
            if spread:
                extra = f" {r.get('live_spread', 0):.0%} ({', '.join(f'{v:.1f}' for v in r.get('live_runs_ms', []))}) |"
            for d in others:
                o = r.get("other_pipelines", {}).get(d)
                extra += f" {o['sim_ms']:.1f} ({o['rel_err']:+.0%}) |" if o else " — |"
            lines.append(f"| {res['mode']} | {r['metric'][:-3].upper()} | {r['stat']} | {r['live_ms']:.1f} | "
                         f"{r['sim_ms']:.1f} | {r['rel_err']:+.0%}{flag} |{extra}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.studies.validate_sim", description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="time-shared", help="comma-separated: time-shared, colocated, pooled, adaptive")
    ap.add_argument("--devices", default="cpu:0")
    ap.add_argument("--model", default=str(shared_dir() / "models" / "stories260k"))
    ap.add_argument("--cost-model", default=None,
                    help="default: the timed device's file, else bench/cost_models/cpu_stories260k.json")
    ap.add_argument("--calibrate", default="none", choices=["none", "runner", "node", "runner+node", "overheads"],
                    help="cost model: none = --cost-model; runner = measure afresh with bench.cost.calibrate just "
                         "before the live runs; node = probe each mode's live node through its API first "
                         "(bench.cost.calibrate_node: the steps as the client sees them); runner+node = the runner's "
                         "model plus the node's host overheads per step and per request, measured by the probe; "
                         "overheads = --cost-model plus those overheads (timed devices)")
    ap.add_argument("--step-overhead-ms", type=float, default=0.0, help="simulated host time per step (ms)")
    ap.add_argument("--request-overhead-ms", type=float, default=0.0,
                    help="simulated time from send to the node's scheduler, added to TTFT (ms)")
    ap.add_argument("--pause-ms", type=float, default=None,
                    help="simulated switch pause (ms); default: measured from the probe's switches when probing")
    ap.add_argument("--repeat", type=int, default=1,
                    help="replay the workload this many times on each live node (the median of their statistics "
                         "is compared; they also give the live run-to-run spread)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=None, help="the node's --max-model-len")
    ap.add_argument("--benchmark-model", default=None,
                    help="the node's --benchmark-model, e.g. timed:bench/cost_models/h200_llama3_8b.json "
                         "(then --cost-model defaults to that file)")
    ap.add_argument("--kv-cache-memory", default=None, help="the node's --kv-cache-memory (needed by timed:)")
    ap.add_argument("--kv-dtype", default="auto",
                    help="KV dtype of --model's geometry, for copy sizes in the simulation (auto: the config's, as the node)")
    ap.add_argument("--link-gbps", type=float, default=None, help="the node's --link-gbps (copies between devices)")
    ap.add_argument("--prefill-devices", type=int, default=None, help="pooled: prefill devices (first of --devices)")
    ap.add_argument("--reconfig-pause-ms", type=float, default=0.0)
    ap.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    ap.add_argument("--tpot-slo-ms", type=float, default=100.0)
    ap.add_argument("--drain-timeout", type=float, default=60.0)
    ap.add_argument("--tolerance", type=float, default=0.25, help="largest |sim - live| / live for medians and p90s")
    ap.add_argument("--out", default=None, help="folder for the report JSON and node logs (default bench/out/validate)")
    ap.add_argument("--step-pipeline", default="2",
                    help="simulated steps in flight per device (SimConfig.step_pipeline; 2: the node's overlapped "
                         "steps); a list (2,1) simulates each against the same live run, the first is checked")
    add_workload_args(ap)
    a = ap.parse_args(argv)
    try:  # checked before any node starts: a bad value must not cost a whole live run
        depths = [int(x) for x in a.step_pipeline.split(",")]
    except ValueError:
        depths = []
    if not depths or min(depths) < 1:
        ap.error(f"--step-pipeline wants positive integers, comma-separated (got {a.step_pipeline!r})")
    out = Path(a.out) if a.out else REPO / "bench" / "out" / "validate"
    out.mkdir(parents=True, exist_ok=True)
    if a.cost_model is None:
        timed = (a.benchmark_model or "").startswith("timed:")
        a.cost_model = a.benchmark_model.removeprefix("timed:") if timed else str(
            REPO / "bench" / "cost_models" / "cpu_stories260k.json")
    if a.calibrate in ("runner", "runner+node"):
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
                  f"switches live {r['live_switches']} / sim {r['sim_switches']} ({r['sim_free_switches']} free), "
                  f"KV moves live {r['live_moves']} / sim {r['sim_moves']}")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
