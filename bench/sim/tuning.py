"""The tuning protocol: before modes are compared, each gets its best setting of its main knobs on the
same workload and SLOs, and the comparison names the setting that won.

Main knobs, searched on a grid (:data:`GRID`, overridable):

* colocated — the per-step token budget (``max_num_batched_tokens``): chunked prefill mixes prompt
  chunks into decode batches, so a large budget buys prefill throughput with TPOT, a small one the
  reverse (Sarathi-Serve, Agrawal et al., OSDI 2024, tunes exactly this);
* pooled — the prefill:decode split (``prefill_devices`` per node, or ``prefill_nodes`` with
  ``pool_scope="cluster"``): every split from 1 to ``devices - 1`` (DistServe, Zhong et al., OSDI
  2024, searches the same placement);
* time-shared — the window bounds (``max_window_ms``: how long a prefill window may hold decode back)
  and the imbalance fallback (``imbalance_threshold`` 0, off, or the node's default 1).

With tensor parallelism (:data:`TP_GRID`, on a :class:`bench.sim.parallel.ParallelModel`) the degrees
are knobs too: colocated its instances' degree ``T`` (``decode_tp``) and budget; time-shared its group
size ``D`` (``decode_tp``) and prefill degree ``P`` (``prefill_tp``); pooled its split and both pools'
degrees. Settings that are not valid configurations (``P`` not dividing ``D``, a degree not dividing
its devices) are left out; those whose weights do not fit are left out by the caller
(:class:`bench.sim.parallel.DoesNotFit`).

A setting's score is its goodput (requests meeting both SLOs per second), ties broken by SLO
attainment and then by the lower p90 TTFT. Pure apart from the simulations it is handed.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable, Iterable

from bench.sim.config import SimConfig

__all__ = ["GRID", "TP_GRID", "candidates", "setting_of", "score", "pick_best"]

GRID: dict[str, dict[str, tuple]] = {
    "colocated": {"max_num_batched_tokens": (512, 1024, 2048, 4096, 8192)},
    "pooled": {},  # every split: filled in from the device (or node) count by candidates()
    "time-shared": {"max_window_ms": (100.0, 250.0, 500.0, 1000.0), "imbalance_threshold": (0.0, 1.0)},
}

# Degrees as knobs (8 devices in mind; invalid combinations are dropped by candidates()). Pooled splits are
# shares of the devices (``prefill_share``, turned into ``prefill_devices`` by _axes): 2, 4, 6 of 8, 1, 2, 3 of 4.
TP_GRID: dict[str, dict[str, tuple]] = {
    "colocated": {"decode_tp": (1, 2, 4, 8), "max_num_batched_tokens": (1024, 4096)},
    "pooled": {"prefill_share": (0.25, 0.5, 0.75), "prefill_tp": (1, 2, 4), "decode_tp": (1, 2, 4)},
    # the per-instance prefill budget too: a group step of D/P instances lasts one instance's budget at
    # degree P, and decode waits for it (512: a shorter step when P < D)
    "time-shared": {"decode_tp": (1, 2, 4, 8), "prefill_tp": (1, 2, 4, 8), "max_num_batched_tokens": (512, 2048)},
}


def _axes(base: SimConfig, grid: dict[str, dict[str, tuple]]) -> dict[str, tuple]:
    axes = dict(grid.get(base.mode, {}))
    if "prefill_share" in axes:  # shares of the devices, each split at least one device on either side
        axes["prefill_devices"] = tuple(sorted({min(base.devices - 1, max(1, round(f * base.devices)))
                                                for f in axes.pop("prefill_share")}))
    if base.mode == "pooled" and not any(k in axes for k in ("prefill_devices", "prefill_nodes")):
        if base.pool_scope == "cluster":
            axes["prefill_nodes"] = tuple(range(1, base.nodes))
        else:
            axes["prefill_devices"] = tuple(range(1, base.devices))
    return axes


def candidates(base: SimConfig, grid: dict[str, dict[str, tuple]] = GRID) -> list[SimConfig]:
    """Every setting of ``base``'s mode's knobs (the grid's product), other fields as in ``base``.

    Raises ValueError for a knob that is not a :class:`SimConfig` field.
    """
    axes = _axes(base, grid)
    fields = {f.name for f in dataclasses.fields(SimConfig)}
    unknown = set(axes) - fields
    if unknown:
        raise ValueError(f"not SimConfig fields: {', '.join(sorted(unknown))}")
    names = sorted(axes)
    out = []
    for values in itertools.product(*(axes[n] for n in names)):
        try:
            out.append(dataclasses.replace(base, **dict(zip(names, values))))
        except ValueError:  # not a valid configuration (e.g. a degree that does not divide the devices)
            continue
    return out or [base]


def setting_of(cfg: SimConfig, grid: dict[str, dict[str, tuple]] = GRID) -> str:
    """The knob values of ``cfg``'s mode, e.g. ``max_num_batched_tokens=1024``."""
    names = sorted(_axes(cfg, grid))
    return ", ".join(f"{n}={getattr(cfg, n):g}" for n in names) or "-"


def score(summary) -> tuple[float, float, float]:
    """Sort key of a :class:`bench.traffic.metrics.Summary` (larger is better)."""
    p90 = summary.ttft_ms.p90 if summary.ttft_ms.p90 == summary.ttft_ms.p90 else float("inf")
    return (summary.goodput or 0.0, summary.slo_attainment or 0.0, -p90)


def pick_best(results: Iterable[tuple[SimConfig, object]], key: Callable = lambda r: score(r.summary)):
    """The ``(config, result)`` whose result scores highest; the first of equals (grid order)."""
    best = None
    for cfg, res in results:
        if best is None or key(res) > key(best[1]):
            best = (cfg, res)
    if best is None:
        raise ValueError("no results to choose from")
    return best
