"""``python -m bench.studies.oracles``: what each oracle of the simulator was worth, on one cell.

Runs adaptive and colocated on one TP-study cell (:mod:`bench.studies.tp_study`: a model on the H200
preset, an Azure trace, ``--devices``, 256 sequences per device, 8,192-token context) at each rate, under:

* ``oracles``: every oracle the simulator had before issue 43 (:data:`bench.sim.config.ORACLES`);
* ``-clients``, ``-refit``, ``-perturbed``, ``-control``, ``-graphs``, ``-copies``: the oracles less one —
  clients' ``max_tokens`` mix with unforeseen EOS and the node's output estimate; the node's refit from its
  start-up model; each planning coefficient off by 20 %; the decision rounds' CPU cost; eager decode in
  tensor-parallel groups; copies at 0.8 of the link with a 5 % slowdown beside them;
* ``none``: every oracle removed (the defaults, planning by the refit), ``none+perturbed``, and ``none`` with one
  oracle kept back: ``none+exact``, ``none+true-clients``, ``none+free-control``.

One line per run (JSON with ``--json``): variant, mode, rate, goodput, SLO attainment, p50/p90 TTFT, p90 TPOT,
switches, decision rounds and their loop time. Colocated runs with ``--colocated-tokens`` as its token budget.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from concurrent.futures import ProcessPoolExecutor

from bench.sim import SimConfig, simulate
from bench.sim.config import ORACLES
from bench.sim.parallel import ParallelModel
from bench.traffic.clients import DEFAULT_CLIENT_MIX
from bench.traffic.workload import WorkloadSpec, build_workload

__all__ = ["VARIANTS", "main"]

VARIANTS = {
    "oracles": ORACLES,
    "-clients": ORACLES | {"client_max_tokens": DEFAULT_CLIENT_MIX},
    "-refit": ORACLES | {"planning": "refit"},
    "-perturbed": ORACLES | {"planning": "perturbed"},
    "-control": ORACLES | {"control_round_us": None, "control_per_resident_us": None},
    "-graphs": ORACLES | {"group_decode_graphs": False},
    "-copies": ORACLES | {"copy_rate": 0.8, "copy_slowdown": 0.05},
    "none": {},
    "none+perturbed": {"planning": "perturbed"},
    "none+exact": {"planning": "exact"},  # every oracle removed but the planning model's
    "none+true-clients": {"client_max_tokens": "true"},  # ... but the clients' max_tokens
    "none+free-control": {"control_round_us": 0.0, "control_per_resident_us": 0.0},  # ... but the rounds' cost
}


def _run(job: tuple) -> dict:
    variant, mode, rate, a = job
    from bench.studies.tp_study import MODELS
    from node.plan import load_config

    pm = ParallelModel(load_config(MODELS[a.model]))
    reqs = build_workload(WorkloadSpec(trace=a.trace, rate_rps=rate, duration_s=a.duration, max_model_len=8192,
                                       seed=a.seed)).requests
    tokens = a.colocated_tokens if mode == "colocated" else a.max_num_batched_tokens
    tp = {"decode_tp": a.decode_tp, "prefill_tp": a.decode_tp if mode == "adaptive" else 1}
    cfg = SimConfig(mode=mode, devices=a.devices, max_model_len=8192, max_num_seqs=256, max_num_batched_tokens=tokens,
                    ttft_slo_ms=1000.0, tpot_slo_ms=a.tpot_slo_ms, max_window_ms=250.0, imbalance_threshold=0.0,
                    link_gbps=450e9 * 8 / 1e9, max_sim_s=a.duration + 300, **tp, **VARIANTS[variant])
    res = simulate(reqs, cfg, pm)
    s, st = res.summary, res.stats
    return {"variant": variant, "mode": mode, "rate": rate, "requests": len(reqs), "goodput": round(s.goodput, 2),
            "attainment": round(s.slo_attainment or 0.0, 3), "p50_ttft_ms": round(s.ttft_ms.median, 1),
            "p90_ttft_ms": round(s.ttft_ms.p90, 1), "p90_tpot_ms": round(s.tpot_ms.p90, 2),
            "switches": st.get("switches", 0), "rounds": st.get("rounds", 0),
            "control_s": round(st.get("control_s", 0.0), 3), "refits": st.get("refits", 0)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.studies.oracles", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="8b")
    ap.add_argument("--trace", default="azure-code")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--decode-tp", type=int, default=1)
    ap.add_argument("--tpot-slo-ms", type=float, default=50.0)
    ap.add_argument("--rates", default="60,85")
    ap.add_argument("--duration", type=float, default=6.0, help="seconds of arrivals per run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default="adaptive,colocated")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192, help="adaptive's bound (untuned)")
    ap.add_argument("--colocated-tokens", type=int, default=1024, help="colocated's budget (the cell's best)")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    jobs = [(v, m, float(r), a) for v in a.variants.split(",") for m in a.modes.split(",") for r in a.rates.split(",")]
    if a.jobs > 1:
        with ProcessPoolExecutor(a.jobs) as ex:
            rows = ex.map(_run, jobs)
            rows = list(rows)
    else:
        rows = [_run(j) for j in jobs]
    if not a.json:
        print("| variant | mode | rate | goodput | SLO att. | p50 TTFT ms | p90 TTFT ms | p90 TPOT ms | switches | rounds | loop s |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(json.dumps(r) if a.json else
              f"| {r['variant']} | {r['mode']} | {r['rate']:g} | {r['goodput']} | {r['attainment']:.1%} | {r['p50_ttft_ms']} "
              f"| {r['p90_ttft_ms']} | {r['p90_tpot_ms']} | {r['switches']} | {r['rounds']} | {r['control_s']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
