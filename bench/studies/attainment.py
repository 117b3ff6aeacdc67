"""SLO attainment of one crossover cell at given rates (a capacity search's single probes).

``python -m bench.studies.attainment --model 1b --lengths wide --mode adaptive --rates 564,653``

Runs :mod:`bench.studies.crossover`'s configuration and workload for one (model, lengths, mode) at each
rate, with crossover's flags (``--devices``, ``--max-num-seqs``, ``--duration``, ``--min-requests``,
``--tpot-slo-ms``...; pass them after ``--``), and prints SLO attainment, p50/p90 TTFT and TPOT and the
switch reasons. A cell's capacity is at least ``rate`` when attainment >= 0.9 there: checking a rate at
0.95x a baseline's capacity is a pass/fail test of the ">= 0.95x" target at one search's cost.
``--set KEY=VALUE`` sets a tuned knob (e.g. ``max_num_batched_tokens=2048`` for colocated).
"""

from __future__ import annotations

import argparse
import sys
import time

from bench.cost.calibrate import load_cost_model
from bench.sim import simulate
from bench.studies import crossover as X
from bench.traffic.workload import build_workload


def moves(stats: dict) -> dict:
    """The imbalance fallback's completed moves per trigger and the KV they copied (GB)."""
    out = {k: v for k, v in stats.items() if k.startswith("moves_")}
    return {**out, "GB": round(stats.get("transfer_bytes", 0) / 1e9, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.studies.attainment", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="1b")
    ap.add_argument("--lengths", default="short")
    ap.add_argument("--mode", default="adaptive")
    ap.add_argument("--rates", required=True, help="comma-separated req/s")
    ap.add_argument("--set", action="append", default=[], help="KEY=VALUE of a SimConfig knob")
    a0, rest = ap.parse_known_args(argv)
    a = X.parser().parse_args([x for x in rest if x != "--"])
    X.LENGTHS_SEEN.setdefault(a0.lengths, a0.lengths)
    setting = []
    for kv in a0.set:
        k, _, v = kv.partition("=")
        setting.append((k, float(v) if "." in v else int(v)))
    cfg = X._config(a, X.Cell(a0.model, a0.lengths, a0.mode, setting=tuple(setting)))
    cost = load_cost_model(X.MODELS_SEEN[a0.model][1])
    for rate in [float(r) for r in a0.rates.split(",")]:
        wl = build_workload(X.workload_spec(X.LENGTHS_SEEN[a0.lengths], rate, a))
        t = time.time()
        res = simulate(wl.requests, cfg, cost)
        s = res.summary
        print(f"{a0.model} {a0.lengths} {a0.mode} {setting or ''} {rate:g} req/s ({len(wl.requests)} requests): "
              f"attainment {s.slo_attainment:.3f}, TTFT p50/p90 {s.ttft_ms.median:.0f}/{s.ttft_ms.p90:.0f} ms, "
              f"TPOT p50/p90 {s.tpot_ms.median:.1f}/{s.tpot_ms.p90:.1f} ms, switches "
              f"{res.stats.get('switch_reasons', {})}, moves {moves(res.stats)} ({time.time() - t:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
