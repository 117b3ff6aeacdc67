"""Request traces: readers for the shared Azure and Mooncake files, and a seeded Poisson generator.

Formats (see ``shared/traces/README.md``):

* Azure LLM inference 2023 CSV — ``TIMESTAMP,ContextTokens,GeneratedTokens`` with absolute wall-clock
  times such as ``2023-11-16 18:17:03.9799600`` (100 ns ticks); arrivals become seconds from the first row.
* Mooncake FAST'25 JSONL — ``timestamp`` in milliseconds from the trace start, ``input_length``,
  ``output_length``, ``hash_ids`` (one per 512-token block); arrivals become ``timestamp / 1000`` s.

:func:`load_trace` picks the reader by suffix and applies, in this order: a window on the original time
axis (rows with ``start_s <= arrival < start_s + duration_s``, re-based to the window start), the time
scale (``arrival * time_scale``; 0.5 replays twice as fast), and caps on prompt/output lengths (clip, or
drop the row), e.g. to fit a small model's context.
"""

from __future__ import annotations

import csv
import json
import math
import random
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

__all__ = ["TraceRequest", "read_azure_csv", "read_mooncake_jsonl", "load_trace", "poisson_requests"]


@dataclass(frozen=True)
class TraceRequest:
    """One request: arrival (s from the trace start), prompt and output lengths (tokens).

    ``hash_ids``: Mooncake prefix-block hashes (512-token blocks), kept only when asked for.
    """

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()


_EPOCH = datetime(2000, 1, 1)


def _azure_ticks(stamp: str) -> int:
    """Absolute time in 100 ns ticks (exact: the fraction keeps all its digits)."""
    base, _, frac = stamp.strip().partition(".")
    delta = datetime.strptime(base, "%Y-%m-%d %H:%M:%S") - _EPOCH
    secs = delta.days * 86400 + delta.seconds
    frac = (frac + "0000000")[:7]
    return secs * 10_000_000 + int(frac)


def read_azure_csv(path: str | Path) -> list[TraceRequest]:
    """Rows of an Azure LLM inference CSV, arrivals in seconds from the first row, in file order."""
    out: list[TraceRequest] = []
    t0: int | None = None
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            ticks = _azure_ticks(row["TIMESTAMP"])
            t0 = ticks if t0 is None else t0
            out.append(TraceRequest((ticks - t0) / 1e7, int(row["ContextTokens"]), int(row["GeneratedTokens"])))
    return out


def read_mooncake_jsonl(path: str | Path, *, keep_hashes: bool = False) -> list[TraceRequest]:
    """Rows of a Mooncake JSONL trace, arrivals ``timestamp / 1000`` (s), in file order."""
    out: list[TraceRequest] = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            out.append(TraceRequest(r["timestamp"] / 1000.0, int(r["input_length"]), int(r["output_length"]),
                                    tuple(r.get("hash_ids", ())) if keep_hashes else ()))
    return out


def load_trace(path: str | Path, *, start_s: float = 0.0, duration_s: float | None = None,
               time_scale: float = 1.0, max_prompt_tokens: int | None = None,
               max_output_tokens: int | None = None, drop_over_cap: bool = False,
               keep_hashes: bool = False) -> list[TraceRequest]:
    """Read a trace (``.csv``: Azure, ``.jsonl``: Mooncake) and window, scale and cap it (see module doc)."""
    p = Path(path)
    if p.suffix == ".csv":
        rows = read_azure_csv(p)
    elif p.suffix == ".jsonl":
        rows = read_mooncake_jsonl(p, keep_hashes=keep_hashes)
    else:
        raise ValueError(f"unknown trace format: {p.name} (want .csv or .jsonl)")
    end = math.inf if duration_s is None else start_s + duration_s
    out: list[TraceRequest] = []
    for r in rows:
        if not start_s <= r.arrival_s < end:
            continue
        over = ((max_prompt_tokens is not None and r.prompt_tokens > max_prompt_tokens)
                or (max_output_tokens is not None and r.output_tokens > max_output_tokens))
        if over and drop_over_cap:
            continue
        out.append(replace(
            r, arrival_s=(r.arrival_s - start_s) * time_scale,
            prompt_tokens=min(r.prompt_tokens, max_prompt_tokens or r.prompt_tokens),
            output_tokens=min(r.output_tokens, max_output_tokens or r.output_tokens)))
    return out


def poisson_requests(rate_rps: float, *, lengths_from: list[TraceRequest], num_requests: int | None = None,
                     duration_s: float | None = None, seed: int = 0) -> list[TraceRequest]:
    """Poisson arrivals at ``rate_rps`` req/s (exponential gaps), lengths drawn with replacement.

    Stops after ``num_requests`` requests or at ``duration_s`` seconds (whichever is given first;
    one is required). The first arrival is at 0. Deterministic for a given ``seed``.
    """
    if rate_rps <= 0:
        raise ValueError("rate_rps must be positive")
    if num_requests is None and duration_s is None:
        raise ValueError("give num_requests or duration_s")
    if not lengths_from:
        raise ValueError("lengths_from is empty")
    rng = random.Random(seed)
    out: list[TraceRequest] = []
    t = 0.0
    while (num_requests is None or len(out) < num_requests) and (duration_s is None or t < duration_s):
        src = lengths_from[rng.randrange(len(lengths_from))]
        out.append(TraceRequest(t, src.prompt_tokens, src.output_tokens))
        t += rng.expovariate(rate_rps)
    return out
