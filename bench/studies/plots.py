"""Comparison plots (matplotlib, Agg backend: files only, no display).

* :func:`goodput_vs_rate` — goodput (req/s meeting both SLOs) against offered rate, one line per mode;
* :func:`latency_cdfs` — the empirical CDF of per-request TTFT or TPOT (ms), one panel per rate, one
  line per mode;
* :func:`role_timeline` — which role each device held when (prefill, decode, mixed), drains and
  reconfiguration pauses marked, from the node's own switch records (:mod:`bench.studies.timeline`);
* :func:`crossover_heatmap` — the crossover study's winner per (model, prompt lengths) x link speed.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from bench.studies.timeline import role_segments  # noqa: E402

__all__ = ["goodput_vs_rate", "latency_cdfs", "role_timeline", "crossover_heatmap", "COLORS"]

COLORS = {"prefill": "#1f77b4", "decode": "#2ca02c", "mixed": "#9467bd", "drain": "#bbbbbb", "pause": "#d62728"}


def goodput_vs_rate(points: dict[str, list[tuple[float, float]]], path: Path, *, title: str = "") -> None:
    """``points[mode] = [(rate req/s, goodput req/s), ...]``."""
    fig, ax = plt.subplots(figsize=(6, 4))
    top = 0.0
    for mode, pts in points.items():
        pts = sorted(pts)
        if pts:
            ax.plot([r for r, _ in pts], [g for _, g in pts], marker="o", label=mode)
            top = max(top, max(r for r, _ in pts))
    ax.plot([0, top], [0, top], ls=":", color="grey", label="offered rate")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("goodput (req/s meeting TTFT and TPOT SLOs)")
    ax.set_title(title or "Goodput vs rate")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _cdf(values: list[float]) -> tuple[list[float], list[float]]:
    xs = sorted(values)
    n = len(xs)
    return xs, [(i + 1) / n for i in range(n)]


def latency_cdfs(series: dict[float, dict[str, list[float]]], path: Path, *, metric: str, slo_ms: float | None = None) -> None:
    """``series[rate][mode] = per-request values (ms)``; one panel per rate, the SLO as a vertical line."""
    rates = sorted(series)
    if not rates:
        return
    fig, axes = plt.subplots(1, len(rates), figsize=(4.2 * len(rates), 3.6), squeeze=False)
    for ax, rate in zip(axes[0], rates):
        for mode, vals in series[rate].items():
            if vals:
                ax.step(*_cdf(vals), where="post", label=mode)
        if slo_ms is not None:
            ax.axvline(slo_ms, ls="--", color="grey", lw=1, label=f"SLO {slo_ms:g} ms")
        ax.set_title(f"{rate:g} req/s")
        ax.set_xlabel(f"{metric} (ms)")
        ax.set_ylim(0, 1.01)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("fraction of requests")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(f"{metric} CDF")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def role_timeline(status: dict, t0: float, t1: float, path: Path, *, title: str = "") -> None:
    """Per-device role bars over ``[t0, t1]`` (node clock, s) from a ``GET /v1/node`` document."""
    devices = status.get("devices", [])
    fig, ax = plt.subplots(figsize=(11, 1.3 + 0.5 * max(1, len(devices))))
    seen = set()
    for i, d in enumerate(devices):
        segs = role_segments(d.get("switches", []), t0, t1, d.get("role", "mixed"))
        for state in {s for _, _, s in segs}:
            bars = [(a, b - a) for a, b, s in segs if s == state]
            ax.broken_barh(bars, (i - 0.35, 0.7), facecolors=COLORS.get(state, "#7f7f7f"),
                           edgecolor="none" if state not in ("pause",) else COLORS["pause"], linewidth=0.6)
            seen.add(state)
    ax.set_yticks(range(len(devices)), [d["device"] for d in devices])
    ax.set_xlim(0, t1 - t0)
    ax.set_xlabel("time since the run started (s)")
    ax.invert_yaxis()
    ax.legend(handles=[Patch(color=COLORS.get(s, "#7f7f7f"), label=s) for s in COLORS if s in seen],
              loc="center left", bbox_to_anchor=(1.005, 0.5), fontsize=8, frameon=False)
    ax.set_title(title or "Role timeline")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


MODE_COLORS = {"time-shared": "#2ca02c", "colocated": "#9467bd", "pooled": "#1f77b4", "adaptive": "#d62728",
               "tie": "#bbbbbb"}
MODE_SHORT = {"time-shared": "TS", "colocated": "CO", "pooled": "PD", "adaptive": "AD"}


def crossover_heatmap(grid: dict[tuple[str, str], dict[float, dict[str, float]]], links: list[float], path: Path,
                      *, title: str = "", tie_ratio: float = 1.0) -> None:
    """The crossover study as a heat map: rows (model, prompt lengths), columns link speeds (Gb/s).

    ``grid[(model, lengths)][link][mode]`` = the mode's capacity (req/s, at its best setting). A cell's
    colour is the winner's, grey when the runner-up is within ``tie_ratio`` of it (the search's
    resolution: a tie); its shade, the winner's margin over the runner-up (``1 - runner-up / winner``,
    full colour at a 2x margin or more); the text gives every capacity (TS, CO, PD).
    """
    import textwrap

    rows = list(grid)
    fig, ax = plt.subplots(figsize=(1.9 * len(links) + 3.0, 0.62 * len(rows) + 1.9))
    for i, row in enumerate(rows):
        for j, link in enumerate(links):
            caps = grid[row].get(link, {})
            if not caps:
                continue
            ranked = sorted(caps.items(), key=lambda kv: -kv[1])
            win, top = ranked[0]
            second = ranked[1][1] if len(ranked) > 1 else 0.0
            tie = top > 0 and second * tie_ratio >= top
            margin = 1.0 if top <= 0 else min(1.0, 2 * (1 - second / top))
            ax.add_patch(plt.Rectangle((j, i), 1, 1, color=MODE_COLORS["tie" if tie else win],
                                       alpha=0.6 if tie else 0.2 + 0.7 * margin))
            text = "\n".join(f"{MODE_SHORT.get(m, m)} {c:.0f}" if c >= 100 else f"{MODE_SHORT.get(m, m)} {c:.3g}"
                             for m, c in ranked)
            ax.text(j + 0.5, i + 0.5, text, ha="center", va="center", fontsize=7)
    ax.set_xlim(0, len(links))
    ax.set_ylim(len(rows), 0)
    ax.set_xticks([j + 0.5 for j in range(len(links))], [f"{link:g} Gb/s" for link in links])
    ax.set_yticks([i + 0.5 for i in range(len(rows))], [f"{m} / {ln}" for m, ln in rows])
    ax.legend(handles=[Patch(color=c, label=m) for m, c in MODE_COLORS.items()], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=8, title="winner")
    ax.set_title("\n".join(textwrap.wrap(title or "Capacity (req/s at the SLO-attainment target), each mode tuned",
                                          70)), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
