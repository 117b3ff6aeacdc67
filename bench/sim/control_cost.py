"""``python -m bench.sim.control_cost``: the CPU time of a role policy's decision round, per round and per resident.

Runs the simulator's time-shared node (:class:`bench.sim.timeshared.TimeSharedSim`: the node's own
snapshot function, role scheduler and fallback objects of :mod:`node.core`) on one workload with free
decisions, and times every round on this machine's CPU (``time.thread_time``, the thread's CPU time, around
the snapshot, the fallback's and the scheduler's ``decide`` and the decisions' bookkeeping), with the
resident sequences at that round. The rounds are grouped by their resident count, and a least-squares line
``us = a + b x residents`` through each group's median (weighted by the group's rounds; medians, so that
a garbage collection or a cache miss in a few rounds does not tilt it) gives ``SimConfig.control_round_us``
(``a``) and ``control_per_resident_us`` (``b``).

What it measures is the policy objects' CPU cost, not the live node's whole round: the live snapshot reads
engines (``RoleDriver.views``) rather than simulated devices, and the live loop also streams tokens and
handles HTTP. It is a lower bound of the live round, measured on whatever CPU runs it (state the machine
with the numbers); the 2-core shared sandbox of this project is slower and noisier than a serving host.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

from bench.sim.config import SimConfig
from bench.sim.parallel import ParallelModel
from bench.sim.timeshared import simulate_time_shared
from bench.traffic.clients import with_client_max_tokens
from bench.traffic.workload import WorkloadSpec, build_workload

__all__ = ["fit_line", "measure", "main"]

REPO = Path(__file__).resolve().parents[2]
CONFIGS = {"8b": "llama3-8b", "70b": "llama3-70b", "1b": "llama3.2-1b"}  # bench/configs/, as bench.studies.tp_study


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """``(a, b)`` of ``y = a + b x``: weighted least squares through the median ``y`` of each distinct ``x``
    (weights: how many points share it); ``b`` 0 when every ``x`` is the same.

    Raises:
        ValueError: no points.
    """
    groups: dict[float, list[float]] = {}
    for x, y in zip(xs, ys):
        groups.setdefault(x, []).append(y)
    if not groups:
        raise ValueError("no points to fit")
    pts = [(x, statistics.median(g), len(g)) for x, g in groups.items()]
    w = sum(n for *_, n in pts)
    mx, my = sum(x * n for x, _, n in pts) / w, sum(y * n for _, y, n in pts) / w
    sxx = sum(n * (x - mx) ** 2 for x, _, n in pts)
    b = sum(n * (x - mx) * (y - my) for x, y, n in pts) / sxx if sxx else 0.0
    return my - b * mx, b


def measure(cfg: SimConfig, cost, requests) -> dict:
    """Time every decision round of ``cfg`` (a role mode; its control costs set to 0) on ``requests``.
    ``cost``: a ParallelModel (lowered first) or a step cost model. Returns the fit and the rounds' spread."""
    cfg = dataclasses.replace(cfg, control_round_us=0.0, control_per_resident_us=0.0)
    if isinstance(cost, ParallelModel):
        cfg, cost, _ = cost.lower(cfg)
    rounds: list[tuple[int, float]] = []
    requests = with_client_max_tokens(requests, cfg.client_max_tokens, cfg.client_seed)
    simulate_time_shared(requests, cfg, cost, round_timer=lambda n, s: rounds.append((n, s * 1e6)))
    xs, ys = [float(n) for n, _ in rounds], [us for _, us in rounds]
    a, b = fit_line(xs, ys)
    return {"mode": cfg.mode, "rounds": len(rounds), "round_us": round(a, 2), "per_resident_us": round(b, 4),
            "median_us": round(statistics.median(ys), 1), "p90_us": round(statistics.quantiles(ys, n=10)[-1], 1),
            "residents_mean": round(statistics.fmean(xs), 1), "residents_max": int(max(xs))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sim.control_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="8b", choices=sorted(CONFIGS), help="a geometry of bench/configs on the H200 preset")
    ap.add_argument("--trace", default="azure-code")
    ap.add_argument("--rate", type=float, default=20.0)
    ap.add_argument("--duration", type=float, default=10.0, help="seconds of arrivals")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--modes", default="adaptive,time-shared")
    ap.add_argument("--tpot-slo-ms", type=float, default=50.0)
    args = ap.parse_args(argv)
    from node.plan import load_config

    pm = ParallelModel(load_config(REPO / "bench" / "configs" / CONFIGS[args.model]))
    reqs = build_workload(WorkloadSpec(trace=args.trace, rate_rps=args.rate, duration_s=args.duration,
                                       max_model_len=8192)).requests
    for mode in args.modes.split(","):
        cfg = SimConfig(mode=mode, devices=args.devices, max_model_len=8192, max_num_batched_tokens=2048,
                        tpot_slo_ms=args.tpot_slo_ms, imbalance_threshold=0.0, max_window_ms=250.0)
        print(json.dumps({"model": args.model, "trace": args.trace, "rate": args.rate, **measure(cfg, pm, reqs)}),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
