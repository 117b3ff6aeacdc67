"""Shifting traffic (issue 43 item 6): the untuned default against every baseline at its single best static
setting, and against an oracle that retunes per segment, on traces whose mix changes over a (shortened) day.

``python -m bench.studies.shifting --model 8b --devices 4 --tpot-slo-ms 50 --segment-s 10 --seeds 3
--rates azure-conv=120,azure-code=14,mooncake-long=8,burst=60 --out bench/results/shifting/8b-4.json``

Each seed builds a trace with :func:`bench.traffic.shifting.shifting_trace` (its segments and diurnal curve)
and simulates it whole on the H200 preset without the simulator's oracles: adaptive once (untuned,
:func:`bench.studies.heldout.base_config`), and every setting of each baseline's grid
(:data:`bench.studies.heldout.GRIDS`, or the smaller ``--grid small``). Good requests (both SLOs met; TTFT SLO
1 s) are counted per segment by arrival; the first ``--warmup-s`` seconds are dropped.

* **best static** — per baseline, the one setting with the most good requests summed over all seeds (the
  setting an operator would pick for the whole trace);
* **per-segment oracle** — per seed and segment, the most good requests any baseline setting got in that
  segment, summed over segments. It is read from the whole-trace runs, so a segment starts from the state that
  setting left behind (a retune at the boundary would start from the previous setting's state instead).

Ratios (adaptive over each) are paired by seed with a 95 % t interval (:func:`bench.studies.seed_stats.ratio_interval`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from bench.cost.derive_cost import PRESETS
from bench.sim import simulate
from bench.sim.parallel import ParallelModel
from bench.sim.tuning import setting_of
from bench.studies.heldout import BUDGETS, GRIDS, MODELS, base_config, git_commit, label_of, tuning_configs
from bench.studies.seed_stats import ratio_interval
from bench.traffic.metrics import meets_slo
from bench.traffic.shifting import DEFAULT_SEGMENTS, KINDS, segment_of, shifting_trace
from node.plan import load_config

__all__ = ["SMALL_GRID", "good_by_segment", "summarize", "format_tables", "main"]

SMALL_GRID = {
    "colocated": {"max_num_batched_tokens": BUDGETS[::2], "max_num_seqs": (256,)},
    "colocated-piecewise": {"max_num_batched_tokens": BUDGETS[::2], "max_num_seqs": (256,)},
    "time-shared": {"max_window_ms": (250.0, 1000.0)},
    "pooled": {"prefill_share": (0.25, 0.5, 0.75)},
}
CONTEXT = 32768


def good_by_segment(records, *, segment_s: float, segments: int, warmup_s: float, ttft_slo_ms: float,
                    tpot_slo_ms: float) -> list[int]:
    """Requests meeting both SLOs per segment (by arrival ``start_s``), those arriving before ``warmup_s`` left out."""
    out = [0] * segments
    for r in records:
        if r.start_s >= warmup_s and meets_slo(r, ttft_slo_ms, tpot_slo_ms):
            out[segment_of(r.start_s, segment_s, segments)] += 1
    return out


def summarize(runs: list[dict]) -> dict:
    """From runs ``{"seed", "label", "setting", "good": [per segment]}``: the best static setting per
    baseline, the per-segment oracle per seed, and adaptive's ratios (module doc)."""
    seeds = sorted({r["seed"] for r in runs if r["label"] == "adaptive"})
    ad = {r["seed"]: sum(r["good"]) for r in runs if r["label"] == "adaptive"}
    totals: dict[tuple[str, str], dict[int, int]] = {}
    for r in runs:
        if r["label"] != "adaptive":
            totals.setdefault((r["label"], r["setting"]), {})[r["seed"]] = sum(r["good"])
    complete = {k: v for k, v in totals.items() if all(s in v for s in seeds)}
    best: dict[str, tuple[str, dict[int, int]]] = {}
    for (label, setting), per_seed in complete.items():
        if label not in best or sum(per_seed.values()) > sum(best[label][1].values()):
            best[label] = (setting, per_seed)
    oracle = {}
    for s in seeds:
        per = [r["good"] for r in runs if r["seed"] == s and r["label"] != "adaptive"]
        oracle[s] = sum(max(g[i] for g in per) for i in range(len(per[0]))) if per else 0
    out = {"seeds": seeds, "adaptive_good": [ad[s] for s in seeds], "oracle_good": [oracle[s] for s in seeds],
           "baselines": {}}
    for label, (setting, per_seed) in best.items():
        out["baselines"][label] = {"setting": setting, "good": [per_seed[s] for s in seeds],
                                   "ratio": ratio_interval([ad[s] for s in seeds], [per_seed[s] for s in seeds])}
    static = max(best.items(), key=lambda kv: sum(kv[1][1].values()))[0] if best else None
    out["best_static"] = static
    if static:
        out["vs_best_static"] = out["baselines"][static]["ratio"]
    out["vs_oracle"] = ratio_interval([ad[s] for s in seeds], [oracle[s] for s in seeds])
    return out


def _iv(d: dict) -> str:
    return f"{d['ratio']:.2f}x [{d['low']:.2f}, {d['high']:.2f}]"


def format_tables(result: dict) -> str:
    """Markdown: adaptive against each baseline's best static setting and the oracle; then per segment."""
    s = result["summary"]
    n = len(s["seeds"])
    lines = ["| against | its setting | its good requests (mean of seeds) | adaptive's | adaptive / it [95 %] |",
             "|---|---|---:|---:|---|"]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    for label, b in sorted(s["baselines"].items(), key=lambda kv: -sum(kv[1]["good"])):
        star = " (best static)" if label == s["best_static"] else ""
        lines.append(f"| {label}{star} | {b['setting']} | {mean(b['good']):.0f} | {mean(s['adaptive_good']):.0f} | "
                     f"{_iv(b['ratio'])} |")
    lines.append(f"| per-segment oracle | best of every setting, per segment | {mean(s['oracle_good']):.0f} | "
                 f"{mean(s['adaptive_good']):.0f} | {_iv(s['vs_oracle'])} |")
    segs = result["segments"]
    lines += ["", "| segment | kind | requests | adaptive good | best static good | oracle's pick (good) |",
              "|---:|---|---:|---:|---:|---|"]
    runs = result["runs"]
    static = s["best_static"]
    for i, kind in enumerate(segs):
        def seg_mean(pred):
            vals = [r["good"][i] for r in runs if pred(r)]
            return sum(vals) / len(vals) if vals else 0.0
        reqs = sum(r["requests"][i] for r in runs if r["label"] == "adaptive") / n
        ad = seg_mean(lambda r: r["label"] == "adaptive")
        st = seg_mean(lambda r: r["label"] == static and r["setting"] == s["baselines"][static]["setting"])
        picks = {}
        for r in runs:
            if r["label"] != "adaptive":
                picks.setdefault((r["label"], r["setting"]), []).append(r["good"][i])
        (pl, ps), pv = max(picks.items(), key=lambda kv: sum(kv[1]))
        lines.append(f"| {i} | {kind} | {reqs:.0f} | {ad:.0f} | {st:.0f} | {pl} {ps} ({sum(pv) / len(pv):.0f}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.studies.shifting", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="8b", choices=sorted(MODELS))
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--tpot-slo-ms", type=float, default=50.0)
    ap.add_argument("--rates", required=True, help="KIND=REQ_PER_S,... peak rates per kind "
                                                   f"({', '.join(KINDS)})")
    ap.add_argument("--segments", default=",".join(DEFAULT_SEGMENTS))
    ap.add_argument("--segment-s", type=float, default=10.0, help="seconds per segment (a shortened hour)")
    ap.add_argument("--floor", type=float, default=0.4, help="the diurnal curve's lowest multiplier")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=0, help="seeds first-seed .. first-seed + seeds - 1")
    ap.add_argument("--warmup-s", type=float, default=1.0)
    ap.add_argument("--grid", default="small", choices=["small", "heldout"])
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    rates = {k: float(v) for k, v in (p.split("=") for p in a.rates.split(","))}
    segs = [s.strip() for s in a.segments.split(",") if s.strip()]
    pm = ParallelModel(load_config(MODELS[a.model]), PRESETS["h200"])
    grid = SMALL_GRID if a.grid == "small" else GRIDS[a.model]
    total = a.segment_s * len(segs)
    out = {"commit": git_commit(), "argv": sys.argv[1:] if argv is None else argv, "segments": segs, "rates": rates,
           "segment_s": a.segment_s, "runs": []}
    for seed in range(a.first_seed, a.first_seed + a.seeds):
        reqs = shifting_trace(rates, segments=segs, segment_s=a.segment_s, seed=seed, floor=a.floor,
                              long_context=CONTEXT)
        counts = [0] * len(segs)
        for r in reqs:
            counts[segment_of(r.arrival_s, a.segment_s, len(segs))] += 1
        bases = {m: base_config(m, a.model, a.tpot_slo_ms, a.devices, CONTEXT, seed, total)
                 for m in ("colocated", "time-shared", "pooled")}
        cfgs = [base_config("adaptive", a.model, a.tpot_slo_ms, a.devices, CONTEXT, seed, total)]
        cfgs += [c for cands in tuning_configs(a.model, bases, pm, grid).values() for c in cands]
        for cfg in cfgs:
            t0 = time.perf_counter()
            res = simulate(reqs, cfg, pm)
            good = good_by_segment(res.records, segment_s=a.segment_s, segments=len(segs), warmup_s=a.warmup_s,
                                   ttft_slo_ms=cfg.ttft_slo_ms, tpot_slo_ms=cfg.tpot_slo_ms)
            label = "adaptive" if cfg.mode == "adaptive" else label_of(cfg)
            run = {"seed": seed, "label": label, "setting": "-" if label == "adaptive" else setting_of(cfg, grid),
                   "good": good, "requests": counts, "switches": res.stats.get("switches", 0),
                   "wall_s": round(time.perf_counter() - t0, 1)}
            out["runs"].append(run)
            print(json.dumps(run), file=sys.stderr, flush=True)
            if a.out:
                Path(a.out).parent.mkdir(parents=True, exist_ok=True)
                Path(a.out).write_text(json.dumps(out, indent=1))
    out["summary"] = summarize(out["runs"])
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))
    print(format_tables(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
