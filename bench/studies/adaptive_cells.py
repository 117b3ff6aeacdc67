"""Adaptive (untuned) against the best tuned baseline, cell by cell: probes and the heat map.

``python -m bench.studies.adaptive_cells probe --cell tp:8b:azure-code:20:8 --rates 42.75,49.5``
runs adaptive mode, untuned (its defaults and the SLOs; ``--max-num-batched-tokens`` 8,192 only as the
upper bound), on one cell of :mod:`bench.studies.tp_study` (the H200 preset, 8 devices, the Azure traces,
256 sequences per device, runs of >= 300 requests) at each rate, and prints one JSON line per rate
(SLO attainment, p90 TTFT and TPOT). A cell's capacity is at least ``rate`` where attainment >= 0.9, so
probing 0.95x and 1.1x the best baseline's recorded capacity brackets adaptive / best baseline at one
search's cost. Crossover cells (4 H200s, short and wide prompts) are probed with
:mod:`bench.studies.attainment`.

``python -m bench.studies.adaptive_cells plot`` reads the recorded cells
(``bench/results/adaptive_cells.json``: per cell the best baseline, its setting and capacity, and
adaptive's probes or, where both were searched, adaptive's capacity) and draws the heat map ``bench/figures/adaptive_vs_best.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CELLS = REPO / "bench/results/adaptive_cells.json"
FIGURE = REPO / "bench/figures/adaptive_vs_best.png"
TARGET = 0.9  # SLO attainment at which a rate counts as within capacity

__all__ = ["bracket", "probe_tp", "plot", "main"]


def bracket(probes: list[dict], target: float = TARGET) -> tuple[float, float | None]:
    """Adaptive / best baseline as ``(low, high)`` from probes ``{"factor", "attainment"}``: ``low`` the
    largest factor passed (attainment >= ``target``; 0 if none), ``high`` the smallest factor above it
    that failed (None if none did)."""
    passed = [p["factor"] for p in probes if p["attainment"] >= target]
    low = max(passed, default=0.0)
    failed = [p["factor"] for p in probes if p["attainment"] < target and p["factor"] > low]
    return low, min(failed, default=None)


def probe_tp(model: str, trace: str, tpot_ms: float, devices: int, rates: list[float],
             imbalance_threshold: float = 0.0, mode: str = "adaptive", tokens: int = 8192, decode_tp: int = 1,
             prefill_tp: int | None = None, min_requests: int = 300, max_duration_s: float = 30.0,
             search_from: float | None = None, tolerance: float = 1.1, prefill_devices: int = 0) -> list[dict]:
    """``mode`` (adaptive: untuned, ``tokens`` only its bound) on one tp_study cell at each rate, in groups
    (instances) of ``decode_tp`` devices with prefill degree ``prefill_tp`` (default: ``decode_tp`` in the
    role modes, 1 otherwise: colocated's instances run at ``decode_tp``; pooled: ``prefill_devices`` of
    the devices prefill); runs
    of >= ``min_requests`` requests, at most ``max_duration_s`` of arrivals (70B: 200, as the TP study).
    With ``search_from`` (req/s) the capacity is bisected from there instead (to ``tolerance``,
    :func:`bench.studies.crossover.capacity`), every run printed. Returns one dict per rate (a search:
    ``[{"capacity_rps"}]``).

    Raises:
        bench.sim.parallel.DoesNotFit: the layout leaves no KV room (70B at degree 1)."""
    from bench.studies import tp_study as S
    a = S.parser().parse_args(["--devices", str(devices), "--min-requests", str(min_requests),
                               "--max-duration", str(max_duration_s), "--max-sim-s", str(max_duration_s + 300)])
    a.link_gbps = S.PRESETS[a.preset].link_Bps * 8 / 1e9
    pm = S.ParallelModel(S.load_config(S.MODELS[model]), S.PRESETS[a.preset])
    cfg = dataclasses.replace(S.base_config(a, mode, tpot_ms), max_num_batched_tokens=tokens,
                              imbalance_threshold=imbalance_threshold, decode_tp=decode_tp,
                              prefill_tp=prefill_tp or (decode_tp if mode in ("adaptive", "time-shared") else 1),
                              **({"prefill_devices": prefill_devices} if prefill_devices else {}))
    pm.lower(cfg)  # DoesNotFit before any run
    run = S.Runner(a, pm, trace)
    out = []
    if search_from is not None:  # bisect the capacity instead; rates: unused
        from bench.studies.crossover import capacity
        rates = []
        cap, _, _ = capacity(lambda r: run(cfg, r), search_from, target=TARGET, tolerance=tolerance)
        for r in sorted(run.runs, key=lambda r: r["rate"]):
            print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
                              if k in ("rate", "slo_attainment", "requests", "p90_ttft_ms", "p90_tpot_ms", "switches")}),
                  flush=True)
        print(json.dumps({"capacity_rps": cap, "tolerance": tolerance}), flush=True)
        return [{"capacity_rps": cap}]
    for rate in rates:
        r = run(cfg, rate)
        out.append({"rate": rate, "attainment": round(r["slo_attainment"], 3), "requests": r["requests"],
                    "p90_ttft_ms": round(r.get("p90_ttft_ms", float("nan")), 1),
                    "p90_tpot_ms": round(r.get("p90_tpot_ms", float("nan")), 2), "switches": r.get("switches"),
                    "wall_s": round(r["wall_s"])})
        print(json.dumps(out[-1]), flush=True)
    return out


def plot(cells_path: Path = CELLS, png: Path = FIGURE) -> Path:
    """The heat map of adaptive / best tuned baseline per recorded cell (rows: model and prompts;
    columns: TPOT SLO and devices). A cell's colour is the bracket's lower end; its text the bracket
    and the winning baseline."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    cells = json.loads(cells_path.read_text())["cells"]
    rows = sorted({(c["model"], c["prompts"]) for c in cells},
                  key=lambda r: (float(r[0].rstrip("b")), r[1].startswith("azure"), r[1]))
    cols = sorted({(c["devices"], c["tpot_slo_ms"]) for c in cells})
    val = np.full((len(rows), len(cols)), np.nan)
    fig, ax = plt.subplots(figsize=(2.2 * len(cols) + 2.5, 0.8 * len(rows) + 1.6))
    for c in cells:
        i, j = rows.index((c["model"], c["prompts"])), cols.index((c["devices"], c["tpot_slo_ms"]))
        b = c["baseline"]
        if "adaptive_capacity_rps" in c:  # both searched: the ratio of capacities
            val[i, j] = c["adaptive_capacity_rps"] / b["capacity_rps"]
            txt = f"{val[i, j]:.2f}x (search" + (f", adaptive {c['adaptive_setting']})" if "adaptive_setting" in c else ")")
        else:
            low, high = bracket(c["probes"])
            val[i, j] = low
            txt = f"{low:.2f}-{high:.2f}x" if high else f">= {low:.2f}x"
            if low == 0.0:
                txt = f"< {min(p['factor'] for p in c['probes']):.2f}x"
        ax.text(j, i, f"{txt}\nvs {b['mode']}\n{b.get('label', b['setting'])}", ha="center", va="center", fontsize=7)
    for i, j in zip(*np.where(np.isnan(val))):
        ax.text(j, i, "not run", ha="center", va="center", fontsize=7, color="grey")
    im = ax.imshow(val, cmap="RdYlGn", vmin=0.7, vmax=1.2, aspect="auto")
    ax.set_xticks(range(len(cols)), [f"{d} dev, TPOT {t:g} ms" for d, t in cols])
    ax.set_yticks(range(len(rows)), [f"{m} {p}" for m, p in rows])
    ax.set_title("adaptive (untuned) / best tuned baseline, capacity at >= 90% SLO attainment\n"
                 "simulated H200 cost models; short/wide: roofline crossover, azure: the TP study's H200 preset (4 or 8 devices)\n"
                 "bracket from probes at fractions of the baseline's capacity, or the ratio of two searches\n"
                 "(70B: adaptive's policy untuned, its layout D:P the best of those run, as the baselines' degrees)", fontsize=9)
    fig.colorbar(im, ax=ax, label="lower end of the bracket")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.studies.adaptive_cells", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("probe", help="adaptive on a tp_study cell at given rates")
    p.add_argument("--cell", required=True, help="tp:MODEL:TRACE:TPOT_MS:DEVICES, e.g. tp:8b:azure-code:20:8")
    p.add_argument("--rates", default=None, help="comma-separated req/s")
    p.add_argument("--search", type=float, default=None, metavar="GUESS",
                   help="bisect the capacity from GUESS req/s instead of probing --rates")
    p.add_argument("--tolerance", type=float, default=1.1, help="--search: stop at hi / lo <= this")
    p.add_argument("--imbalance-threshold", type=float, default=0.0)
    p.add_argument("--mode", default="adaptive", help="another mode, to check a baseline's setting")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--tp", type=int, default=1, help="devices per group (instance): the decode degree")
    p.add_argument("--prefill-tp", type=int, default=None, help="prefill degree (default: --tp)")
    p.add_argument("--prefill-devices", type=int, default=0, help="pooled: devices that prefill")
    p.add_argument("--min-requests", type=int, default=300)
    p.add_argument("--max-duration", type=float, default=30.0, help="seconds of arrivals at most (70B: 200)")
    q = sub.add_parser("plot", help="the heat map from the recorded cells")
    q.add_argument("--cells", type=Path, default=CELLS)
    q.add_argument("--png", type=Path, default=FIGURE)
    a = ap.parse_args(argv)
    if a.cmd == "plot":
        print(plot(a.cells, a.png))
        return 0
    study, model, trace, tpot, devices = a.cell.split(":")
    if study != "tp":
        ap.error("only tp_study cells (crossover cells: python -m bench.studies.attainment)")
    t = time.time()
    if (a.rates is None) == (a.search is None):
        ap.error("give --rates or --search")
    rates = [float(r) for r in a.rates.split(",")] if a.rates else []
    probe_tp(model, trace, float(tpot), int(devices), rates, a.imbalance_threshold, a.mode, a.max_num_batched_tokens,
             a.tp, a.prefill_tp, a.min_requests, a.max_duration, a.search, a.tolerance, a.prefill_devices)
    print(f"({time.time() - t:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
