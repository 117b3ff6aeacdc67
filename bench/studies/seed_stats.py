"""Statistics of seeded simulation runs: steady-state goodput with the warm-up dropped, and a 95 % interval on
the ratio of two modes' figures paired by seed (pure functions; :mod:`bench.studies.heldout` and
:mod:`bench.studies.shifting` use them).

* **Steady state** — a run's first requests meet an empty node, so they flatter whichever mode holds work back
  least. :func:`steady_metrics` keeps the requests whose arrival lies in ``[warmup_s, end_s)`` and reports their
  goodput as requests meeting both SLOs per second of that window (not of the run's duration: the drain after
  the last arrival is not part of the offered load), their SLO attainment and latency percentiles. A request
  that never finished counts as missing its SLOs.
* **Ratio intervals** — with ``n`` seeds the per-seed ratios ``a_i / b_i`` of two modes run on the same
  requests are paired. :func:`ratio_interval` gives their geometric mean and the Student-t 95 % interval of
  the mean log ratio, ``exp(mean ± t(0.975, n - 1) * sd / sqrt(n))`` (a t interval on log ratios, as for
  paired ratio data; the quantiles are the standard two-sided 95 % table, :data:`T_975`).
"""

from __future__ import annotations

import math
from typing import Sequence

from bench.traffic.metrics import RequestRecord, meets_slo, percentile, request_tpot_s

__all__ = ["T_975", "t_quantile", "steady_metrics", "ratio_interval"]

# two-sided 95 % quantiles of Student's t, t(0.975, df) for df = 1..30 (any statistics table); beyond, 1.96
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


def t_quantile(df: int) -> float:
    """t(0.975, ``df``) from :data:`T_975` (the normal 1.96 above 30 degrees of freedom).

    Raises:
        ValueError: ``df`` below 1.
    """
    if df < 1:
        raise ValueError("need at least 1 degree of freedom (2 samples)")
    return T_975[df - 1] if df <= len(T_975) else 1.96


def steady_metrics(records: Sequence[RequestRecord], *, warmup_s: float, end_s: float, ttft_slo_ms: float,
                   tpot_slo_ms: float) -> dict:
    """The steady-state figures of one run (see the module doc): ``requests`` (arrivals in the window),
    ``good`` (of those, meeting both SLOs), ``goodput`` (``good / (end_s - warmup_s)``, req/s),
    ``attainment`` (``good / requests``), ``p50_ttft_ms``, ``p90_ttft_ms`` and ``p90_tpot_ms`` over the
    window's finished requests (0 when none finished).

    Raises:
        ValueError: an empty window (``end_s <= warmup_s``).
    """
    if end_s <= warmup_s:
        raise ValueError(f"empty steady-state window [{warmup_s}, {end_s})")
    kept = [r for r in records if warmup_s <= r.start_s < end_s]
    good = sum(1 for r in kept if meets_slo(r, ttft_slo_ms, tpot_slo_ms))
    ttfts = [r.ttft_s * 1e3 for r in kept if r.success]
    tpots = [t * 1e3 for t in (request_tpot_s(r) for r in kept) if t is not None]
    return {"requests": len(kept), "good": good, "goodput": good / (end_s - warmup_s),
            "attainment": good / len(kept) if kept else 0.0, "p50_ttft_ms": percentile(ttfts, 50),
            "p90_ttft_ms": percentile(ttfts, 90), "p90_tpot_ms": percentile(tpots, 90)}


def ratio_interval(num: Sequence[float], den: Sequence[float]) -> dict:
    """Paired ratio ``num[i] / den[i]`` over seeds: ``{"n", "ratio", "low", "high"}`` with ``ratio`` the
    geometric mean of the per-seed ratios and ``[low, high]`` its 95 % t interval (module doc); with one seed
    the interval is that ratio alone. Pairs where both are 0 (neither mode served anything) are left out; a
    pair with exactly one 0 makes the ratio 0 or infinite, and then ``low``/``high`` are the extreme per-seed
    ratios instead of a t interval (``"t_interval": False``).

    Raises:
        ValueError: lengths differ, a value is negative, or no pair is left.
    """
    if len(num) != len(den):
        raise ValueError(f"{len(num)} numerators against {len(den)} denominators")
    if any(v < 0 for v in (*num, *den)):
        raise ValueError("ratios of negative figures")
    pairs = [(a, b) for a, b in zip(num, den) if a > 0 or b > 0]
    if not pairs:
        raise ValueError("no pair with a positive figure")
    ratios = [a / b if b > 0 else math.inf for a, b in pairs]
    if any(r == 0 or math.isinf(r) for r in ratios):
        finite = sorted(ratios)
        return {"n": len(ratios), "ratio": sorted(ratios)[len(ratios) // 2], "low": finite[0], "high": finite[-1],
                "t_interval": False}
    logs = [math.log(r) for r in ratios]
    n = len(logs)
    mean = math.fsum(logs) / n
    if n == 1:
        return {"n": 1, "ratio": ratios[0], "low": ratios[0], "high": ratios[0], "t_interval": False}
    sd = math.sqrt(math.fsum((x - mean) ** 2 for x in logs) / (n - 1))
    half = t_quantile(n - 1) * sd / math.sqrt(n)
    return {"n": n, "ratio": math.exp(mean), "low": math.exp(mean - half), "high": math.exp(mean + half),
            "t_interval": True}
