"""Crossover study: where does pooled (disaggregated) serving beat time-shared, and where not?

``python -m bench.studies.crossover --models 1b,8b --lengths short,long,wide --links 10,25,100,400 --devices 4``

The seed note's claim: "the pool arrangement wins when traffic has a wide range of prompt lengths and
when interconnect is fast; the time-shared arrangement wins when the model is small enough that
transfer cost is a large fraction of total work". This sweeps the three axes on the simulator
(:mod:`bench.sim`, one node):

* **model** — ``NAME=CONFIG:COST_MODEL`` pairs; built in: ``8b`` (Llama-3-8B geometry) and ``1b``
  (Llama-3.2-1B geometry), both roofline cost models built by :mod:`bench.cost.derive_cost` (hardware
  terms fitted to the H200 8B run, byte and FLOP terms from each geometry: not measurements of the 1B);
  ``8b-fit`` is the measured linear 8B fit itself (``bench/cost_models/h200_llama3_8b.json``, no
  context term), as the 8 x H200 tables use;
* **prompt lengths** — ``NAME=SPEC`` with a :func:`bench.traffic.workload.synthetic_lengths` spec; built in:
  ``short`` (``fixed:128:128``), ``long`` (``fixed:4096:128``), ``wide``
  (``loguniform:32:7000:128``: prompts from 32 to 7,000 tokens, as many per decade, mean ~1,170);
  outputs 128 tokens throughout, Poisson arrivals; or a trace name of :data:`bench.traffic.workload.TRACES`
  (``azure-code``...): its arrivals rescaled to each rate (burstiness kept) and its own lengths;
* **link** — the KV link of each prefill device (Gb/s); only pooled mode uses it.

A run lasts ``--duration`` seconds of arrivals, stretched to hold at least ``--min-requests`` requests
(at most ``--max-duration`` s): at low rates a short window hides a slowly growing backlog — a KV link
that cannot keep up only delays decode a little more every second.

Every mode is tuned first (:mod:`bench.sim.tuning`, the tuning protocol): colocated runs every token
budget of its grid, time-shared every window bound and fallback setting, pooled every ``--splits``
prefill:decode split, and each keeps its best; the grid names the winning setting. ``--tune-grid
small`` searches fewer time-shared settings; ``--tune-grid none`` runs the base settings only.

In every cell each mode's *capacity* is searched: the highest Poisson rate whose SLO attainment
(TTFT and TPOT SLOs both met) reaches ``--target`` (90%), found by doubling/halving from a guess and
then bisecting (geometrically) until the bracket is within ``--tolerance`` (10%). Pooled runs every
``--splits`` prefill:decode split and keeps the best, so the comparison is against a tuned pool.
A run that is certainly below the target (more than ``(1 - target) x requests`` requests already
waited past the TTFT SLO) stops there and counts as a miss (``"aborted"`` in the JSON). The grid
reports capacities; the long table also the goodput at capacity, taken as rate x attainment
(requests meeting both SLOs per second of arrivals; ``goodput_run`` in the JSON divides by the run's
whole duration instead, drain included, which understates it for short runs). Time-shared and colocated do
not depend on the link, so they are searched once per (model, lengths) row.

Output: a grid per transfer model (rows model x lengths, columns link speeds; each cell the winner and
the capacities), a long table (``--markdown``), and JSON (``--out``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from bench.cost.calibrate import load_cost_model
from bench.sim import SimAborted, SimConfig, kv_geometry, simulate
from bench.sim.tuning import GRID
from bench.traffic.traces import load_trace
from bench.traffic.workload import TRACES, WorkloadSpec, build_workload, synthetic_lengths, trace_path
from node.plan import load_config

REPO = Path(__file__).resolve().parents[2]
MODELS = {
    "8b": (REPO / "bench/configs/llama3-8b", REPO / "bench/cost_models/h200_llama3_8b_roofline.json"),
    "8b-fit": (REPO / "bench/configs/llama3-8b", REPO / "bench/cost_models/h200_llama3_8b.json"),
    "1b": (REPO / "bench/configs/llama3.2-1b", REPO / "bench/cost_models/h200_llama3_1b_roofline.json"),
}
LENGTHS = {"short": "fixed:128:128", "long": "fixed:4096:128", "wide": "loguniform:32:7000:128"}

__all__ = ["Cell", "capacity", "run_study", "format_grid", "main"]


@dataclass(frozen=True)
class Cell:
    """One capacity search: a model, a length distribution, a mode (pooled: a split, a link)."""

    model: str
    lengths: str
    mode: str
    link_gbps: float | None = None
    prefill_devices: int | None = None
    transfer: str = "overlap"
    setting: tuple[tuple[str, float], ...] = ()  # tuned knobs (bench.sim.tuning) other than the split


def capacity(run, guess: float, *, target: float = 0.9, tolerance: float = 1.1, min_rate: float = 0.05,
             max_rate: float = 1e6, step: float = 1.5) -> tuple[float, dict | None, int]:
    """Highest rate with ``run(rate)["slo_attainment"] >= target``: ``(rate, its result, runs)``.

    ``run(rate)`` returns a dict with ``slo_attainment``. Multiplies (or divides) ``guess`` by ``step``
    until the target is bracketed, then bisects geometrically until ``hi / lo <= tolerance``.
    ``(0, None, n)`` when even ``min_rate`` misses the target. Assumes attainment falls with the rate.
    """
    seen: dict[float, dict] = {}

    def ok(rate: float) -> bool:
        if rate not in seen:
            seen[rate] = run(rate)
        return seen[rate]["slo_attainment"] >= target

    lo = hi = None
    r = guess
    if ok(r):
        lo = r
        while hi is None and r < max_rate:
            r *= step
            if ok(r):
                lo = r
            else:
                hi = r
        if hi is None:
            return lo, seen[lo], len(seen)
    else:
        hi = r
        while lo is None:
            r /= step
            if r < min_rate:
                return 0.0, None, len(seen)
            if ok(r):
                lo = r
            else:
                hi = r
    while hi / lo > tolerance:
        mid = math.sqrt(lo * hi)
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo, seen[lo], len(seen)


def _config(a: argparse.Namespace, cell: Cell) -> SimConfig:
    model_cfg = load_config(MODELS_SEEN[cell.model][0])
    per_token, blocks = kv_geometry(model_cfg, dtype="bf16", block_size=16, device_memory_gib=a.device_memory_gib)
    base = SimConfig(mode=cell.mode, devices=a.devices, prefill_devices=cell.prefill_devices, kv_blocks=blocks,
                     kv_bytes_per_token=per_token, link_gbps=cell.link_gbps or 100.0, transfer=cell.transfer,
                     max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
                     max_num_batched_tokens=a.max_num_batched_tokens, ttft_slo_ms=a.ttft_slo_ms,
                     tpot_slo_ms=a.tpot_slo_ms, max_sim_s=a.max_sim_s)
    return replace(base, **dict(cell.setting))


MODELS_SEEN: dict[str, tuple[Path, Path]] = dict(MODELS)


def guess_rate(a: argparse.Namespace, cell: Cell) -> float:
    """A starting rate: 70% of what the devices could do if each request cost its prefill plus its
    share of decode steps at a batch of 128 (rough; the search corrects it)."""
    cost = load_cost_model(MODELS_SEEN[cell.model][1])
    pool = length_pool(LENGTHS_SEEN[cell.lengths])
    p = sum(r.prompt_tokens for r in pool) / len(pool)
    o = sum(r.output_tokens for r in pool) / len(pool)
    b = min(128, a.max_num_seqs)
    per_req = cost.prefill_s(round(p), a.max_num_batched_tokens) + o * cost.decode_step_s(b, b * round(p + o / 2)) / b
    return max(1.0, round(0.7 * a.devices / per_req, 1))


LENGTHS_SEEN: dict[str, str] = dict(LENGTHS)


def length_pool(spec: str) -> list:
    """The requests a length spec draws from: a synthetic pool, or a trace's first 2,000 rows."""
    return synthetic_lengths(spec) or load_trace(trace_path(spec))[:2000]


def run_duration(rate: float, a: argparse.Namespace) -> float:
    """Seconds of arrivals of one run: ``--duration``, stretched to hold ``--min-requests`` requests
    (a slow backlog — a link that cannot keep up — must have time to show), at most ``--max-duration``."""
    return min(max(a.duration, a.min_requests / rate), max(a.duration, a.max_duration))


def workload_spec(spec: str, rate: float, a: argparse.Namespace) -> WorkloadSpec:
    """Poisson arrivals with synthetic lengths, or a trace rescaled to ``rate``."""
    dur = run_duration(rate, a)
    if synthetic_lengths(spec) is not None:
        return WorkloadSpec(trace="poisson", rate_rps=rate, duration_s=dur, lengths_from=spec,
                            max_model_len=a.max_model_len, seed=a.seed)
    return WorkloadSpec(trace=spec, rate_rps=rate, duration_s=dur, max_model_len=a.max_model_len)


def search(a: argparse.Namespace, cell: Cell, guess: float | None = None) -> dict:
    cfg = _config(a, cell)
    cost = load_cost_model(MODELS_SEEN[cell.model][1])
    runs: list[dict] = []

    def run(rate: float) -> dict:
        wl = build_workload(workload_spec(LENGTHS_SEEN[cell.lengths], rate, a))
        n = len(wl.requests)
        try:  # stop as soon as the target is certainly missed
            res = simulate(wl.requests, replace(cfg, abort_late=int(n * (1 - a.target)) + 1), cost)
        except SimAborted:
            out = {"rate": rate, "slo_attainment": 0.0, "goodput": 0.0, "requests": n,
                   "duration_s": wl.spec.duration_s, "aborted": True}
            runs.append(out)
            return out
        s = res.summary
        out = {"rate": rate, "slo_attainment": s.slo_attainment, "goodput": rate * s.slo_attainment,
               "goodput_run": s.goodput, "requests": len(wl.requests), "duration_s": wl.spec.duration_s,
               "p90_ttft_ms": s.ttft_ms.p90, "p90_tpot_ms": s.tpot_ms.p90, "switches": res.stats.get("switches", 0),
               "transfers": res.stats.get("transfers", 0)}
        runs.append(out)
        return out

    rate, best, n = capacity(run, guess or guess_rate(a, cell), target=a.target, tolerance=a.tolerance)
    return {"cell": cell.__dict__, "capacity_rps": rate, "at_capacity": best, "runs": runs}


def _search_star(args):
    a, cell, models, lengths, guess = args
    MODELS_SEEN.update(models)
    LENGTHS_SEEN.update(lengths)
    return search(a, cell, guess)


def cells_for(a: argparse.Namespace) -> list[Cell]:
    """Per (model, lengths) row: time-shared, colocated, then pooled from the fastest link down."""
    cells = []
    for m in a.model_names:
        for ln in a.length_names:
            for mode in a.mode_list:
                if mode != "pooled":
                    cells += [Cell(m, ln, mode, setting=st) for st in settings_for(a, mode)]
            if "pooled" in a.mode_list:
                for t in a.transfer_list:
                    for link in sorted(a.link_list, reverse=True):
                        for p in a.split_list:
                            cells.append(Cell(m, ln, "pooled", link, p, t))
    return cells


TUNE_GRIDS = {
    "full": GRID,
    "small": {"colocated": {"max_num_batched_tokens": (1024, 2048, 8192)},
              "time-shared": {"max_window_ms": (250.0, 1000.0), "imbalance_threshold": (0.0, 1.0)}},
    "none": {},
}


def settings_for(a: argparse.Namespace, mode: str) -> list[tuple[tuple[str, float], ...]]:
    """The tuning grid's settings of ``mode`` (pooled's split is searched by ``--splits``)."""
    axes = TUNE_GRIDS[a.tune_grid].get(mode, {})
    names = sorted(axes)
    return [tuple(zip(names, values)) for values in itertools.product(*(axes[n] for n in names))] or [()]


def setting_label(cell: dict) -> str:
    parts = [f"{k}={v:g}" for k, v in cell.get("setting") or ()]
    if cell["mode"] == "pooled":
        parts.insert(0, f"prefill_devices={cell['prefill_devices']}")
    return ", ".join(parts) or "-"


def _guess(cell: Cell, done: dict) -> float | None:
    """A starting rate from searches already done: the same split at the next faster link (capacity
    does not grow as the link slows), else the best capacity found so far in the row."""
    if cell.mode == "pooled":
        faster = [(c.link_gbps, r) for c, r in done.items() if c.model == cell.model and c.lengths == cell.lengths
                  and c.mode == "pooled" and c.prefill_devices == cell.prefill_devices
                  and c.transfer == cell.transfer and c.link_gbps > cell.link_gbps]
        if faster:
            return min(faster)[1] or None
    row = [r for c, r in done.items() if c.model == cell.model and c.lengths == cell.lengths and r]
    return max(row) if row else None


def _run_row(args) -> list[dict]:
    """One (model, lengths) row's searches in order, each starting from what the earlier found;
    cells found in ``a.reused`` are taken from there."""
    a, cells, models, lengths = args
    done: dict[Cell, float] = {}
    out = []
    for c in cells:
        got = a.reused.get(c)
        out.append(got if got is not None else _search_star((a, c, models, lengths, _guess(c, done))))
        done[c] = out[-1]["capacity_rps"]
        if got is None:
            _progress(out[-1])
    return out


def load_reused(paths: list[str]) -> dict[Cell, dict]:
    """Results of earlier runs (their ``--out`` JSON), by cell. The caller must make sure they were
    run with the same settings (devices, duration, SLOs...): only the cell is compared."""
    out = {}
    for p in paths:
        for r in json.loads(Path(p).read_text())["results"]:
            c = dict(r["cell"])
            c["setting"] = tuple(tuple(kv) for kv in c.get("setting") or ())
            out[Cell(**c)] = r
    return out


def run_study(a: argparse.Namespace) -> list[dict]:
    """Every cell's search; rows run in parallel with ``--jobs`` > 1, cells of a row in order."""
    rows: dict[tuple[str, str], list[Cell]] = {}
    for c in cells_for(a):
        rows.setdefault((c.model, c.lengths), []).append(c)
    jobs = [(a, cells, MODELS_SEEN, LENGTHS_SEEN) for cells in rows.values()]
    if a.jobs > 1:
        with ProcessPoolExecutor(a.jobs) as ex:
            return [r for row in ex.map(_run_row, jobs) for r in row]
    return [r for job in jobs for r in _run_row(job)]


def _progress(r: dict) -> None:
    c = r["cell"]
    what = c["mode"] if c["mode"] != "pooled" else f"pooled {c['link_gbps']:g}G {c['transfer']}"
    what += f" [{setting_label(c)}]"
    print(f"{c['model']:>4} {c['lengths']:>6} {what:<60} capacity {r['capacity_rps']:9.1f} req/s "
          f"({len(r['runs'])} runs)", file=sys.stderr, flush=True)


def _goodput(r: dict | None) -> float:
    return (r["at_capacity"] or {}).get("goodput", 0.0) if r else 0.0


def best_by_cell(a: argparse.Namespace, results: list[dict]) -> dict:
    """``{(model, lengths, transfer, link): {mode: best result}}`` (pooled: its best split)."""
    idx: dict = {}
    for r in results:
        c = r["cell"]
        links = a.link_list if c["mode"] != "pooled" else [c["link_gbps"]]
        transfers = a.transfer_list if c["mode"] != "pooled" else [c["transfer"]]
        for t in transfers:
            for link in links:
                slot = idx.setdefault((c["model"], c["lengths"], t, link), {})
                cur = slot.get(c["mode"])
                if cur is None or (r["capacity_rps"], _goodput(r)) > (cur["capacity_rps"], _goodput(cur)):
                    slot[c["mode"]] = r
    return idx


def format_grid(a: argparse.Namespace, results: list[dict]) -> str:
    """Per transfer model: rows (model, lengths), columns links; cell = winner and capacities."""
    idx = best_by_cell(a, results)
    short = {"time-shared": "TS", "colocated": "CO", "pooled": "PD", "adaptive": "AD"}
    out = []
    for t in a.transfer_list:
        out.append(f"Transfers: {t}. Capacity = highest rate with >= {a.target:.0%} SLO attainment "
                   f"(TTFT {a.ttft_slo_ms:g} ms, TPOT {a.tpot_slo_ms:g} ms), req/s, of {a.devices} devices; TS = "
                   f"time-shared, CO = colocated, PD = pooled; each mode at its best setting (in brackets); "
                   f"winner first.\n")
        out.append("| model | prompts | " + " | ".join(f"{link:g} Gb/s" for link in a.link_list) + " |")
        out.append("|---|---|" + "---|" * len(a.link_list))
        for m in a.model_names:
            for ln in a.length_names:
                cells = []
                for link in a.link_list:
                    slot = idx.get((m, ln, t, link), {})
                    ranked = sorted(slot.items(), key=lambda kv: (-kv[1]["capacity_rps"], -_goodput(kv[1])))
                    parts = []
                    for mode, r in ranked:
                        parts.append(f"{short.get(mode, mode)} {r['capacity_rps']:.0f} ({setting_label(r['cell'])})")
                    if len(ranked) > 1 and ranked[0][1]["capacity_rps"] <= ranked[1][1]["capacity_rps"] * a.tolerance:
                        parts[0] = "≈ " + parts[0]  # within the search's resolution: a tie
                    else:
                        parts[0] = f"**{parts[0]}**"
                    cells.append(", ".join(parts))
                out.append(f"| {m} | {ln} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def heatmap(a: argparse.Namespace, results: list[dict], path: Path) -> list[Path]:
    """One PNG per transfer model (``path``, or ``STEM-TRANSFER.png`` with several): the grid's capacities."""
    from bench.studies.plots import crossover_heatmap  # matplotlib only when a plot is asked for

    idx = best_by_cell(a, results)
    out = []
    for t in a.transfer_list:
        grid = {(m, ln): {link: {mode: r["capacity_rps"] for mode, r in idx.get((m, ln, t, link), {}).items()}
                          for link in a.link_list}
                for m in a.model_names for ln in a.length_names}
        p = path if len(a.transfer_list) == 1 else path.with_name(f"{path.stem}-{t}{path.suffix}")
        crossover_heatmap(grid, a.link_list, p, title=f"Capacity (req/s at {a.target:.0%} SLO attainment; TTFT "
                          f"{a.ttft_slo_ms:g} ms, TPOT {a.tpot_slo_ms:g} ms), {a.devices} devices, {t} transfers; "
                          f"each mode tuned; grey: a tie within the search's {a.tolerance:g}x resolution",
                          tie_ratio=a.tolerance)
        out.append(p)
    return out


def format_long(results: list[dict]) -> str:
    lines = ["| model | prompts | mode | setting | link (Gb/s) | transfers | capacity (req/s) | goodput (req/s) | "
             "SLO attainment | p90 TTFT (ms) | p90 TPOT (ms) | switches | runs |",
             "|---|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]  # goodput = rate x attainment
    for r in results:
        c, b = r["cell"], r["at_capacity"] or {}
        mode = f"{c['mode']} | {setting_label(c)}"
        link = f"{c['link_gbps']:g}" if c["link_gbps"] else "—"
        tr = c["transfer"] if c["mode"] == "pooled" else "—"
        lines.append(f"| {c['model']} | {c['lengths']} | {mode} | {link} | {tr} | {r['capacity_rps']:.1f} | "
                     f"{b.get('goodput', 0):.1f} | {b.get('slo_attainment', 0):.1%} | {b.get('p90_ttft_ms', 0):.0f} | "
                     f"{b.get('p90_tpot_ms', 0):.1f} | {b.get('switches', 0)} | {len(r['runs'])} |")
    return "\n".join(lines)


def _named(items: str, table: dict, parse, bare=None) -> list[str]:
    names = []
    for item in [x.strip() for x in items.split(",") if x.strip()]:
        name, eq, val = item.partition("=")
        if eq:
            table[name] = parse(val)
        elif name not in table and bare is not None and bare(name):
            table[name] = name
        elif name not in table:
            raise ValueError(f"unknown name {name!r} (known: {', '.join(table)}; or NAME=VALUE)")
        names.append(name)
    return names


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.studies.crossover", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="1b,8b", help="names, or NAME=CONFIG:COST_MODEL")
    ap.add_argument("--lengths", default="short,long,wide",
                    help="names, NAME=SPEC (bench.traffic.workload.synthetic_lengths), or trace names")
    ap.add_argument("--links", default="10,25,100,400", help="pooled KV link per prefill device (Gb/s)")
    ap.add_argument("--modes", default="time-shared,colocated,pooled")
    ap.add_argument("--splits", default=None, help="pooled prefill devices to try (default 1..devices-1)")
    ap.add_argument("--tune-grid", default="full", choices=sorted(TUNE_GRIDS),
                    help="settings searched per mode besides pooled's splits (bench.sim.tuning)")
    ap.add_argument("--transfers", default="overlap",
                    help="pooled transfer models, comma-separated: overlap (the node's hand-offs), blocking "
                         "(e.g. overlap,blocking runs both)")
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--duration", type=float, default=5.0, help="seconds of Poisson arrivals per run (at least)")
    ap.add_argument("--min-requests", type=int, default=0,
                    help="stretch a run's duration to hold this many requests (up to --max-duration)")
    ap.add_argument("--max-duration", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device-memory-gib", type=float, default=141.0)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    ap.add_argument("--tpot-slo-ms", type=float, default=50.0)
    ap.add_argument("--target", type=float, default=0.9, help="SLO attainment that counts as meeting the SLOs")
    ap.add_argument("--tolerance", type=float, default=1.1, help="stop bisecting when hi/lo is within this ratio")
    ap.add_argument("--max-sim-s", type=float, default=600.0)
    ap.add_argument("--jobs", type=int, default=1, help="processes")
    ap.add_argument("--markdown", action="store_true", help="also print the long table")
    ap.add_argument("--out", default=None, help="JSON of every run")
    ap.add_argument("--png", default=None, help="write the grid as a heat map (bench.studies.plots.crossover_heatmap)")
    ap.add_argument("--reuse", default=None,
                    help="comma-separated --out JSONs of earlier runs with the same settings: their cells are "
                         "not searched again")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    try:
        a.model_names = _named(a.models, MODELS_SEEN, lambda v: tuple(Path(p) for p in v.split(":", 1)))
        a.length_names = _named(a.lengths, LENGTHS_SEEN, lambda v: v, bare=lambda n: n in TRACES)
        for ln in a.length_names:
            if synthetic_lengths(LENGTHS_SEEN[ln]) is None and LENGTHS_SEEN[ln] not in TRACES:
                raise ValueError(f"{ln}: {LENGTHS_SEEN[ln]!r} is neither a length spec nor a trace name")
        a.link_list = [float(x) for x in a.links.split(",") if x.strip()]
        a.mode_list = [m.strip() for m in a.modes.split(",") if m.strip()]
        a.split_list = ([int(x) for x in a.splits.split(",")] if a.splits else list(range(1, a.devices)))
        a.transfer_list = [t.strip() for t in a.transfers.split(",") if t.strip()]
        a.reused = load_reused([p for p in (a.reuse or "").split(",") if p.strip()])
        for c in cells_for(a):
            _config(a, c)  # SimConfig checks every cell before any run
    except (ValueError, OSError) as e:
        print(f"bench.studies.crossover: {e}", file=sys.stderr)
        return 2
    results = run_study(a)
    print(format_grid(a, results))
    if a.markdown:
        print(format_long(results))
    if a.png:
        Path(a.png).parent.mkdir(parents=True, exist_ok=True)
        for p in heatmap(a, results, Path(a.png)):
            print(f"heat map: {p}", file=sys.stderr)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        doc = {"argv": argv if argv is not None else sys.argv[1:],
               "models": {k: [str(p) for p in v] for k, v in MODELS_SEEN.items()},
               "lengths": LENGTHS_SEEN, "results": results}
        Path(a.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
