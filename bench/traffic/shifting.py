"""Shifting traffic (issue 43 item 6): a trace whose mix changes segment by segment while its rate follows a
diurnal curve, built from the shared traces, seeded.

:func:`shifting_trace` lays ``segments`` (kinds of :data:`KINDS`) end to end, each ``segment_s`` seconds long:

* ``azure-conv`` / ``azure-code`` — consecutive rows of the Azure 2023 conversation / code trace from a
  seeded offset, their own arrivals rescaled to the segment's rate (the trace's burstiness kept), context
  8,192 (the code prompts stop at 7,437);
* ``mooncake-long`` — consecutive rows of the Mooncake conversation trace (its 3-s buckets spread,
  :func:`bench.traffic.arrivals.spread_buckets`), prompts clipped to ``long_context`` tokens (32,768 by
  default: long-context requests, a mean of several thousand prompt tokens);
* ``burst`` — Azure conversation lengths with gamma inter-arrivals of CV 3 (:func:`bench.traffic.arrivals.gamma_gaps`).

The rate of kind ``k`` at time ``t`` is ``rates[k] x diurnal(t)``: ``rates`` the kind's peak rate (req/s; a
kind's requests cost very different amounts, so each has its own), and :func:`diurnal` a day compressed
into the trace: ``floor + (1 - floor) x sin²(π t / T)``, lowest (``floor``) at both ends, 1 in the middle.
Each segment is generated at its peak ``rates[k] x max diurnal`` over the segment and thinned
(:func:`bench.traffic.arrivals.thin_by`) to follow the curve. :func:`segment_of` maps an arrival back to its
segment. An hour of traffic is shortened to ``len(segments) x segment_s`` seconds (the studies say by how much).
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Sequence

from bench.traffic.arrivals import gamma_gaps, spread_buckets, thin_by, with_arrivals
from bench.traffic.traces import TraceRequest, load_trace
from bench.traffic.workload import fit_lengths, trace_path

__all__ = ["KINDS", "DEFAULT_SEGMENTS", "diurnal", "segment_of", "shifting_trace"]

KINDS = {  # kind: (trace, arrivals, context)
    "azure-conv": ("azure-conv", "trace", 8192),
    "azure-code": ("azure-code", "trace", 8192),
    "mooncake-long": ("mooncake-conv", "trace", None),
    "burst": ("azure-conv", "gamma", 8192),
}
# an "hour": conversation in the morning, long-context work, code, an evening of bursts, conversation at night
DEFAULT_SEGMENTS = ("azure-conv", "mooncake-long", "azure-code", "burst", "mooncake-long", "azure-conv")
GAMMA_CV = 3.0
MOONCAKE_BUCKET_S = 3.0


def diurnal(t: float, total_s: float, floor: float = 0.4) -> float:
    """The diurnal multiplier at ``t`` seconds into a trace of ``total_s`` (module doc), in ``[floor, 1]``."""
    return floor + (1.0 - floor) * math.sin(math.pi * min(max(t / total_s, 0.0), 1.0)) ** 2


def segment_of(arrival_s: float, segment_s: float, segments: int) -> int:
    """The segment (0-based) an arrival at ``arrival_s`` belongs to (the last one for the trace's end)."""
    return min(segments - 1, max(0, int(arrival_s // segment_s)))


def _peak(start: float, end: float, total: float, floor: float) -> float:
    mid = total / 2  # the curve peaks in the middle and falls off monotonically on either side
    t = mid if start <= mid <= end else (end if end < mid else start)
    return diurnal(t, total, floor)


def _segment(kind: str, rate: float, seconds: float, seed: int, long_context: int) -> list[TraceRequest]:
    """``seconds`` of ``kind`` at a mean ``rate`` req/s from 0, rows from a seeded offset of the trace."""
    trace, how, context = KINDS[kind]
    rows = load_trace(trace_path(trace))
    n = max(2, math.ceil(rate * seconds * 1.05) + 2)  # a little over the window, cut to it below
    if n + 1 >= len(rows):
        raise ValueError(f"{kind}: {n} requests asked of a {len(rows)}-row trace; lower the rate or the segment")
    start = random.Random(seed).randrange(len(rows) - n - 1)
    window = rows[start:start + n + 1]
    if how == "gamma":
        window = with_arrivals(window[:n], gamma_gaps(n - 1, GAMMA_CV, seed), rate)
    else:
        if trace == "mooncake-conv":
            window = spread_buckets(window, MOONCAKE_BUCKET_S, seed)
        t0, span = window[0].arrival_s, window[-1].arrival_s - window[0].arrival_s
        window = [dataclasses.replace(r, arrival_s=(r.arrival_s - t0) * n / (rate * span)) for r in window[:n]]
    kept = [r for r in window if r.arrival_s < seconds]
    return fit_lengths(kept, max_model_len=context or long_context)


def shifting_trace(rates: dict[str, float], *, segments: Sequence[str] = DEFAULT_SEGMENTS, segment_s: float = 20.0,
                   seed: int = 0, floor: float = 0.4, long_context: int = 32768) -> list[TraceRequest]:
    """The shifting trace of the module doc, in arrival order (s from 0).

    Raises:
        ValueError: an unknown kind, a kind without a rate, a non-positive rate or segment length, or a
            segment asking more rows of its trace than it has.
    """
    if segment_s <= 0 or not segments:
        raise ValueError("need at least one segment of positive length")
    unknown = [k for k in segments if k not in KINDS]
    if unknown:
        raise ValueError(f"unknown segment kinds {unknown} ({', '.join(KINDS)})")
    if any(not rates.get(k, 0) > 0 for k in segments):
        raise ValueError(f"every segment kind needs a positive rate, got {rates}")
    total = segment_s * len(segments)
    out: list[TraceRequest] = []
    for i, kind in enumerate(segments):
        t0 = i * segment_s
        peak = _peak(t0, t0 + segment_s, total, floor)
        rows = _segment(kind, rates[kind] * peak, segment_s, seed * 1000 + i, long_context)
        rows = [dataclasses.replace(r, arrival_s=r.arrival_s + t0) for r in rows]
        out += thin_by(rows, lambda t: diurnal(t, total, floor) / peak, seed * 1000 + i)
    return out
