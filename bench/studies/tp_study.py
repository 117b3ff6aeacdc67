"""Capacity of the three modes with tensor-parallel degrees as tuned knobs, on a hardware preset.

``python -m bench.studies.tp_study --models 8b,70b --traces azure-code,azure-conv --tpot-slo-ms 20,50 --devices 8``

Every cell (model, trace, TPOT SLO) runs each mode's settings of :data:`bench.sim.tuning.TP_GRID` that are
valid and fit the preset's memory (:class:`bench.sim.parallel.ParallelModel`, :class:`DoesNotFit`),
and reports each mode's best setting by its *capacity*: the highest rate (the trace's arrivals
rescaled, burstiness kept) at which at least ``--target`` (90%) of requests meet both SLOs.

Searching every setting's capacity would take hours on two cores, so the tuning is a tournament
(coarser than a full search; say so when quoting it):

1. screen every setting at one rate (starting from a rough guess, divided by 1.5 until one setting
   meets the target); while more than ``--finalists`` settings meet it, multiply the rate by 1.5 and
   screen only those;
2. the finalists (those that met the target last, topped up by the best attainment) get a capacity
   search each (:func:`bench.studies.crossover.capacity`, bisected until ``hi / lo <= --tolerance``), and the
   best capacity is the mode's.

A run certainly below the target stops early (``abort_late``) and counts as a miss, as in
:mod:`bench.studies.crossover`. Output: one markdown table (each mode's capacity with its setting, and
time-shared over the best baseline) and, with ``--out``, every run as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from bench.cost.derive_cost import PRESETS
from bench.sim import SimAborted, SimConfig, simulate
from bench.sim.parallel import DoesNotFit, ParallelModel
from bench.sim.tuning import TP_GRID, candidates, setting_of
from bench.studies.crossover import capacity
from bench.traffic.workload import WorkloadSpec, build_workload
from node.plan import load_config

REPO = Path(__file__).resolve().parents[2]
MODELS = {"8b": REPO / "bench/configs/llama3-8b", "70b": REPO / "bench/configs/llama3-70b",
          "1b": REPO / "bench/configs/llama3.2-1b"}
MODES = ("time-shared", "colocated", "pooled")

__all__ = ["fits", "tune_mode", "run_cell", "format_table", "main"]


def fits(pm: ParallelModel, cfg: SimConfig) -> bool:
    """Whether ``cfg``'s layout leaves KV room on every device of ``pm``'s preset."""
    try:
        pm.lower(cfg)
    except DoesNotFit:
        return False
    return True


class Runner:
    """Runs one setting at one rate (workloads cached by rate), recording every run."""

    def __init__(self, a: argparse.Namespace, pm: ParallelModel, trace: str):
        self.a, self.pm, self.trace = a, pm, trace
        self._wl: dict[float, list] = {}
        self.runs: list[dict] = []

    def requests(self, rate: float) -> list:
        if rate not in self._wl:
            dur = min(max(self.a.duration, self.a.min_requests / rate), self.a.max_duration)
            self._wl[rate] = build_workload(WorkloadSpec(trace=self.trace, rate_rps=rate, duration_s=dur,
                                                         max_model_len=self.a.max_model_len)).requests
        return self._wl[rate]

    def __call__(self, cfg: SimConfig, rate: float) -> dict:
        reqs = self.requests(rate)
        n = len(reqs)
        t0 = time.perf_counter()
        out = {"mode": cfg.mode, "setting": setting_of(cfg, TP_GRID), "rate": rate, "requests": n}
        try:
            res = simulate(reqs, dataclasses.replace(cfg, abort_late=int(n * (1 - self.a.target)) + 1), self.pm)
        except SimAborted:
            out.update(slo_attainment=0.0, aborted=True)
        else:
            s = res.summary
            out.update(slo_attainment=s.slo_attainment or 0.0, p90_ttft_ms=s.ttft_ms.p90, p90_tpot_ms=s.tpot_ms.p90,
                       switches=res.stats.get("switches", 0), preemptions=res.stats.get("preemptions", 0))
        out["wall_s"] = time.perf_counter() - t0
        self.runs.append(out)
        return out


def _rank(r: dict) -> tuple:
    p90 = r.get("p90_ttft_ms", float("inf"))
    return (r["slo_attainment"], -(p90 if p90 == p90 else float("inf")))


def tune_mode(run: Runner, cands: list[SimConfig], guess: float, a: argparse.Namespace) -> dict:
    """The tournament of the module doc for one mode: ``{"setting", "capacity_rps", "finalists"}``."""
    rate, pool = guess, list(cands)
    while True:  # 1. a rate some setting meets
        res = [(c, run(c, rate)) for c in pool]
        if any(r["slo_attainment"] >= a.target for _, r in res) or rate < 0.05:
            break
        rate /= 1.5
    while True:  # ... then raise it while more than the finalists meet it
        passed = [(c, r) for c, r in res if r["slo_attainment"] >= a.target]
        if len(passed) <= a.finalists:
            break
        pool, rate = [c for c, _ in passed], rate * 1.5
        res = [(c, run(c, rate)) for c in pool]
    ranked = sorted(res, key=lambda cr: _rank(cr[1]), reverse=True)
    finalists = [c for c, r in passed] + [c for c, r in ranked if r["slo_attainment"] < a.target]
    finalists = finalists[: a.finalists]
    best = None
    out = []
    for c in finalists:
        cap, at, n = capacity(lambda r, c=c: run(c, r), rate, target=a.target, tolerance=a.tolerance)
        out.append({"setting": setting_of(c, TP_GRID), "capacity_rps": cap, "at_capacity": at, "runs": n})
        if best is None or cap > best["capacity_rps"]:
            best = out[-1]
    return {"setting": best["setting"], "capacity_rps": best["capacity_rps"], "at_capacity": best["at_capacity"],
            "candidates": len(cands), "finalists": out}


def base_config(a: argparse.Namespace, mode: str, tpot_ms: float) -> SimConfig:
    return SimConfig(mode=mode, devices=a.devices, block_size=16, link_gbps=a.link_gbps, max_model_len=a.max_model_len,
                     max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                     ttft_slo_ms=a.ttft_slo_ms, tpot_slo_ms=tpot_ms, max_window_ms=a.max_window_ms,
                     imbalance_threshold=a.imbalance_threshold, max_sim_s=a.max_sim_s)


def run_cell(a: argparse.Namespace, model: str, trace: str, tpot_ms: float, guess: float) -> dict:
    """Every mode of one (model, trace, TPOT SLO) cell."""
    pm = ParallelModel(load_config(MODELS[model]), PRESETS[a.preset])
    run = Runner(a, pm, trace)
    out = {"model": model, "trace": trace, "tpot_slo_ms": tpot_ms, "modes": {}}
    for mode in a.mode_list:
        cands = [c for c in candidates(base_config(a, mode, tpot_ms), TP_GRID) if fits(pm, c)]
        t0 = time.perf_counter()
        got = tune_mode(run, cands, guess, a)
        guess = max(guess, got["capacity_rps"]) or guess
        out["modes"][mode] = got
        print(f"{model} {trace} TPOT {tpot_ms:g}: {mode:<11} {got['capacity_rps']:8.1f} req/s [{got['setting']}] "
              f"({len(cands)} settings, {time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    out["runs"] = run.runs
    return out


def format_table(a: argparse.Namespace, cells: list[dict]) -> str:
    """One row per cell: each mode's capacity [best setting], and time-shared over the best baseline."""
    lines = ["| model | trace | TPOT SLO (ms) | time-shared | colocated | pooled | TS / best baseline |",
             "|---|---|---:|---|---|---|---:|"]
    for c in cells:
        m = c["modes"]
        parts = [f"{m[k]['capacity_rps']:.1f} [{m[k]['setting']}]" if k in m else "—" for k in MODES]
        base = max([m[k]["capacity_rps"] for k in ("colocated", "pooled") if k in m] or [0.0])
        ts = m.get("time-shared", {}).get("capacity_rps", 0.0)
        ratio = f"{ts / base:.2f}x" if base > 0 else "—"
        lines.append(f"| {c['model']} | {c['trace']} | {c['tpot_slo_ms']:g} | " + " | ".join(parts) + f" | {ratio} |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.studies.tp_study", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="8b,70b", help=f"of {', '.join(MODELS)}")
    ap.add_argument("--traces", default="azure-code,azure-conv")
    ap.add_argument("--tpot-slo-ms", default="20,50", help="comma-separated TPOT SLOs")
    ap.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--preset", default="h200", choices=sorted(PRESETS))
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--link-gbps", type=float, default=None,
                    help="per-device link for KV moves and hand-offs, Gb/s (default: the preset's, 450 GB/s = 3600)")
    ap.add_argument("--duration", type=float, default=3.0, help="seconds of arrivals per run (at least)")
    ap.add_argument("--min-requests", type=int, default=300)
    ap.add_argument("--max-duration", type=float, default=30.0)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=256, help="per instance (group)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048,
                    help="per instance (time-shared: per prefill instance); colocated tunes its own")
    ap.add_argument("--max-window-ms", type=float, default=250.0, help="time-shared window bound (fixed)")
    ap.add_argument("--imbalance-threshold", type=float, default=0.0, help="time-shared fallback (fixed; 0 off)")
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--tolerance", type=float, default=1.2)
    ap.add_argument("--finalists", type=int, default=2)
    ap.add_argument("--guess", type=float, default=20.0, help="first screening rate (req/s)")
    ap.add_argument("--max-sim-s", type=float, default=300.0)
    ap.add_argument("--out", default=None)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    a.mode_list = [m.strip() for m in a.modes.split(",") if m.strip()]
    if a.link_gbps is None:
        a.link_gbps = PRESETS[a.preset].link_Bps * 8 / 1e9
    cells = []
    for model in [m.strip() for m in a.models.split(",") if m.strip()]:
        for trace in [t.strip() for t in a.traces.split(",") if t.strip()]:
            guess = a.guess
            for tpot in [float(x) for x in a.tpot_slo_ms.split(",") if x.strip()]:
                cells.append(run_cell(a, model, trace, tpot, guess))
                guess = max(v["capacity_rps"] for v in cells[-1]["modes"].values()) or a.guess
                if a.out:
                    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
                    Path(a.out).write_text(json.dumps({"argv": argv if argv is not None else sys.argv[1:],
                                                       "cells": cells}, indent=1))
    print(format_table(a, cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
