"""Paired fresh-instance comparisons: the order of runs within each pair, and each ratio's median with a
bootstrap 95 % interval (pure functions; :mod:`bench.studies.compare` ``--pairs`` runs them).

On a shared machine one node instance can read 1.5x slower than the next for reasons of its own (where
its pages and threads landed, what ran beside it), so a comparison that keeps one instance per mode and
interleaves rounds measures the instances as much as the modes. A *pair* here is one run of every entry,
each on a node started for that run alone; the pair's ratio (entry over baseline, same requests) is one
sample, and the samples of ``N`` pairs give a median and a percentile-bootstrap interval of that median.
The order of the entries alternates from pair to pair, so neither runs first (after the other's load)
in every pair.
"""

from __future__ import annotations

import statistics

import numpy as np

__all__ = ["METRICS", "pair_order", "bootstrap_median_ci", "paired_ratios", "interval_table", "per_pair_line"]

# (label, summary key, statistic): the ratios reported per pair (entry / baseline)
METRICS = (("TTFT p90", "ttft_ms", "p90"), ("ITL p90", "itl_ms", "p90"), ("tokens/s", "output_throughput", None))


def pair_order(entries: list[str], pair: int) -> list[str]:
    """The order ``entries`` run in within pair ``pair`` (0-based): as given on even pairs, reversed on
    odd ones, so over an even number of pairs every entry runs first and last equally often."""
    return list(entries) if pair % 2 == 0 else list(reversed(entries))


def bootstrap_median_ci(values: list[float], *, level: float = 0.95, resamples: int = 10_000,
                        seed: int = 0) -> tuple[float, float, float]:
    """``(median, low, high)`` of ``values``: the sample median and the percentile-bootstrap interval of the
    median at ``level`` (``resamples`` resamples with replacement from a ``numpy.random.default_rng(seed)``
    generator, so one seed gives one interval; Efron & Tibshirani, *An Introduction to the Bootstrap*,
    ch. 13). With fewer than 8 values the interval is wide and its coverage below ``level``: report the
    count beside it.

    Raises:
        ValueError: no values, ``level`` outside (0, 1), or ``resamples < 1``.
    """
    if not values:
        raise ValueError("bootstrap_median_ci needs at least one value")
    if not 0 < level < 1 or resamples < 1:
        raise ValueError("level must be in (0, 1) and resamples >= 1")
    x = np.asarray(values, dtype=np.float64)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(x), size=(resamples, len(x)))
    medians = np.median(x[idx], axis=1)
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(medians, [tail, 100 - tail])
    return float(np.median(x)), float(low), float(high)


def _value(summary: dict, key: str, stat: str | None) -> float | None:
    v = summary.get(key)
    if stat is not None:
        v = (v or {}).get(stat)
    return float(v) if v else None  # 0 or absent: no ratio


def paired_ratios(rows: list[dict], entry: str, baseline: str, rate: float) -> dict[str, list[float]]:
    """Per metric of :data:`METRICS`, ``entry``'s value over ``baseline``'s in each pair (rows keyed by
    ``mode``, ``rate`` and ``round`` = the pair) where both ran; pairs in order."""
    ok = {(r["mode"], r["rate"], r.get("round")): r["summary"] for r in rows if r.get("available")}
    pairs = sorted(k for m, q, k in ok if m == entry and q == rate and (baseline, rate, k) in ok)
    out: dict[str, list[float]] = {label: [] for label, _, _ in METRICS}
    for k in pairs:
        a, b = ok[(entry, rate, k)], ok[(baseline, rate, k)]
        for label, key, stat in METRICS:
            va, vb = _value(a, key, stat), _value(b, key, stat)
            if va is not None and vb is not None:
                out[label].append(va / vb)
    return out


def interval_table(rows: list[dict], baseline: str, *, seed: int = 0) -> str:
    """A markdown table of every other entry over ``baseline``, per rate: each metric's median ratio over
    the pairs with its bootstrap 95 % interval (:func:`bootstrap_median_ci` with ``seed``), the number
    of pairs, and how many of them had a run with failed requests (not finished within the drain timeout:
    an overloaded run, whose latencies say where the queue stood when arrivals stopped rather than what
    the mode does); below it, each pair's ratios."""
    ok = [r for r in rows if r.get("available")]
    lines = [f"| entry / {baseline} | rate (req/s) | pairs | pairs with failed requests | "
             + " | ".join(f"{m} ratio: median [95 % CI]" for m, _, _ in METRICS) + " |",
             "|---|---:|---:|---:|" + "---:|" * len(METRICS)]
    failed = {(r["mode"], r["rate"], r.get("round")) for r in ok if r["summary"].get("failed")}
    detail: list[str] = []  # each pair's ratios, for the record
    for entry in dict.fromkeys(r["mode"] for r in ok if r["mode"] != baseline):
        for rate in dict.fromkeys(r["rate"] for r in ok if r["mode"] == entry):
            ratios = paired_ratios(rows, entry, baseline, rate)
            n = max(len(v) for v in ratios.values())
            if n == 0:
                continue
            cells = []
            for label, _, _ in METRICS:
                v = ratios[label]
                if not v:
                    cells.append("—")
                    continue
                med, lo, hi = bootstrap_median_ci(v, seed=seed)
                cells.append(f"{med:.2f} [{lo:.2f}, {hi:.2f}]")
            pairs = {r.get("round") for r in ok if r["mode"] == entry and r["rate"] == rate} & {
                r.get("round") for r in ok if r["mode"] == baseline and r["rate"] == rate}
            bad = sum(1 for k in pairs if (entry, rate, k) in failed or (baseline, rate, k) in failed)
            lines.append(f"| {entry} | {rate:g} | {n} | {bad} | " + " | ".join(cells) + " |")
            detail.extend(f"- {entry} / {baseline}, {rate:g} req/s, {label}: {per_pair_line(v)}"
                          for label, v in ratios.items() if v)
    return "\n".join(lines + ([""] + detail if detail else [])) + "\n"


def per_pair_line(values: list[float]) -> str:
    """The per-pair ratios, comma-separated (for the record beside the interval)."""
    return ", ".join(f"{v:.2f}" for v in values) + (f" (median {statistics.median(values):.2f})" if values else "")
