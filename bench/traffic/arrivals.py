"""Arrival processes for studies that need more than a trace's own clock: gamma renewal arrivals, the
Mooncake conversation trace's 3-second buckets spread out, and one request set thinned to lower rates.

All functions are pure and seeded (``random.Random(seed)``), so the same arguments give the same list.
Times in seconds; requests are :class:`bench.traffic.traces.TraceRequest`, returned in arrival order.

* :func:`gamma_gaps` — inter-arrival gaps of a gamma renewal process with mean 1 and a given coefficient of
  variation ``cv`` (shape ``k = 1 / cv**2``, scale ``cv**2``; ``cv = 1`` is Poisson, ``cv = 3`` bursty: most
  gaps tiny, a few very long). Scale them by ``1 / rate`` for a process at ``rate`` req/s.
* :func:`spread_buckets` — the Mooncake conversation timestamps are quantised to buckets of about 3 s
  (``shared/traces/README.md``); replayed as they are, every bucket is one burst. This spreads the requests
  of each bucket uniformly over the bucket (seeded), as the trace's README suggests.
* :func:`thin` — keeps each request with probability ``keep`` using one uniform draw per request, so that
  the sets kept at a smaller ``keep`` are subsets of those kept at a larger one (the same request set,
  thinned, at every rate; Lewis and Shedler, "Simulation of nonhomogeneous Poisson processes by thinning",
  1979). Thinning a Poisson process gives a Poisson process; it makes a burstier renewal process less
  bursty (the gaps' squared CV becomes ``keep * cv**2 + 1 - keep``), which is why bursty cells set their
  rate by rescaling time instead (:func:`rescaled`).
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Callable, Sequence

from bench.traffic.traces import TraceRequest

__all__ = ["gamma_gaps", "spread_buckets", "thin", "thin_by", "rescaled", "with_arrivals"]


def gamma_gaps(n: int, cv: float, seed: int) -> list[float]:
    """``n`` gamma inter-arrival gaps with mean 1 and coefficient of variation ``cv`` (see the module doc).

    Raises:
        ValueError: ``n`` negative or ``cv`` not positive.
    """
    if n < 0 or not cv > 0:
        raise ValueError("need n >= 0 and cv > 0")
    shape = 1.0 / (cv * cv)
    rng = random.Random(seed)
    return [rng.gammavariate(shape, 1.0 / shape) for _ in range(n)]


def with_arrivals(rows: Sequence[TraceRequest], gaps: Sequence[float], rate_rps: float) -> list[TraceRequest]:
    """``rows`` (their lengths, in order) with arrivals at the cumulative sums of ``gaps / rate_rps``, the
    first at 0. ``gaps`` must be at least as long as ``rows`` less one.

    Raises:
        ValueError: ``rate_rps`` not positive, or too few gaps.
    """
    if not rate_rps > 0:
        raise ValueError("rate_rps must be positive")
    if len(gaps) < len(rows) - 1:
        raise ValueError(f"{len(rows)} rows need {len(rows) - 1} gaps, got {len(gaps)}")
    out, t = [], 0.0
    for i, r in enumerate(rows):
        out.append(replace(r, arrival_s=t))
        if i < len(gaps):
            t += gaps[i] / rate_rps
    return out


def spread_buckets(rows: Sequence[TraceRequest], bucket_s: float, seed: int) -> list[TraceRequest]:
    """Each request moved to a uniform time in ``[its arrival, its arrival + bucket_s)`` (seeded), then the
    list sorted by arrival (see the module doc). ``bucket_s`` 0 leaves the arrivals as they are."""
    if bucket_s < 0:
        raise ValueError("bucket_s must be at least 0")
    rng = random.Random(seed)
    moved = [replace(r, arrival_s=r.arrival_s + rng.random() * bucket_s) for r in rows]
    return sorted(moved, key=lambda r: r.arrival_s)


def thin_by(rows: Sequence[TraceRequest], keep: Callable[[float], float], seed: int) -> list[TraceRequest]:
    """The requests kept by a time-varying share: request ``i`` stays when its uniform draw ``u_i`` (one per
    request, in order, ``random.Random(seed)``) is below ``keep(arrival_s)`` (clipped to [0, 1])."""
    rng = random.Random(seed)
    draws = [rng.random() for _ in rows]
    return [r for r, u in zip(rows, draws) if u < min(1.0, max(0.0, keep(r.arrival_s)))]


def thin(rows: Sequence[TraceRequest], keep: float, seed: int) -> list[TraceRequest]:
    """The requests kept with probability ``keep`` each (see the module doc; ``thin(rows, a, s)`` is a subset
    of ``thin(rows, b, s)`` when ``a <= b``).

    Raises:
        ValueError: ``keep`` outside [0, 1].
    """
    if not 0.0 <= keep <= 1.0:
        raise ValueError(f"keep must be in [0, 1], got {keep}")
    return thin_by(rows, lambda _t: keep, seed)


def rescaled(rows: Sequence[TraceRequest], factor: float) -> list[TraceRequest]:
    """``rows`` with every arrival multiplied by ``factor`` (2: half the rate, the same requests and bursts)."""
    if not factor > 0:
        raise ValueError("factor must be positive")
    return [replace(r, arrival_s=r.arrival_s * factor) for r in rows]
