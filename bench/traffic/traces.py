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

__all__ = ["TraceRequest", "read_azure_csv", "read_mooncake_jsonl", "load_trace", "poisson_requests",
           "MOONCAKE_BLOCK_TOKENS", "scale_hash_blocks", "hash_prompt_ids", "infinite_cache_hit_ratio"]

MOONCAKE_BLOCK_TOKENS = 512  # tokens each Mooncake hash id stands for


@dataclass(frozen=True)
class TraceRequest:
    """One request: arrival (s from the trace start), prompt and output lengths (tokens).

    ``hash_ids``: Mooncake prefix-block hashes, kept only when asked for; ``hash_block_tokens``: the
    tokens each of them stands for in ``prompt_tokens`` (512 as read; fewer once scaled down by
    :func:`scale_hash_blocks`; 0 without hashes). ``output_tokens`` is the true length (where EOS ends
    the request); ``max_tokens`` what the client sends (:mod:`bench.traffic.clients`; None: absent, the
    node's context limit bounds the request).
    """

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()
    hash_block_tokens: int = 0
    max_tokens: int | None = None


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
            hashes = tuple(r.get("hash_ids", ())) if keep_hashes else ()
            out.append(TraceRequest(r["timestamp"] / 1000.0, int(r["input_length"]), int(r["output_length"]),
                                    hashes, MOONCAKE_BLOCK_TOKENS if hashes else 0))
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


def scale_hash_blocks(rows: list[TraceRequest], block_tokens: int) -> list[TraceRequest]:
    """Shrink requests with hash ids so each hash stands for ``block_tokens`` tokens instead of
    ``hash_block_tokens`` (e.g. 512 → 16 fits Mooncake prompts to a small model's context): the
    prompt keeps its whole hash blocks and the scaled share of its last, partial one,
    ``(n - 1) * block_tokens + ceil(last * block_tokens / 512)`` tokens; the output shrinks by the same
    factor (at least 1 token). Rows without hashes are returned unchanged."""
    out = []
    for r in rows:
        if not r.hash_ids or not r.hash_block_tokens:
            out.append(r)
            continue
        full = len(r.hash_ids) - 1
        last = r.prompt_tokens - full * r.hash_block_tokens
        prompt = full * block_tokens + max(1, math.ceil(last * block_tokens / r.hash_block_tokens))
        output = max(1, round(r.output_tokens * block_tokens / r.hash_block_tokens))
        out.append(replace(r, prompt_tokens=prompt, output_tokens=output, hash_block_tokens=block_tokens))
    return out


_HASH_BLOCKS: dict[tuple[int, int, int, int], tuple[int, ...]] = {}


def hash_prompt_ids(r: TraceRequest, vocab_size: int, *, first_id: int = 3, bos_id: int | None = 1,
                    seed: int = 0) -> list[int]:
    """The request's prompt as token ids built from its hash ids: each hash id maps to a fixed block
    of ``hash_block_tokens`` ids in ``[first_id, vocab_size)`` (seeded by the hash id and ``seed``),
    so requests sharing leading hashes share leading tokens, as the trace's prompts did; the blocks
    are concatenated and cut to ``prompt_tokens``; the first id is ``bos_id`` (when not ``None``).

    Raises:
        ValueError: no hash ids, or too few for ``prompt_tokens``.
    """
    n = r.hash_block_tokens
    if not r.hash_ids or n <= 0 or len(r.hash_ids) * n < r.prompt_tokens:
        raise ValueError(f"{len(r.hash_ids)} hash ids of {n} tokens cannot make a {r.prompt_tokens}-token prompt")
    ids: list[int] = []
    for h in r.hash_ids:
        key = (h, n, vocab_size, seed)
        block = _HASH_BLOCKS.get(key)
        if block is None:
            rng = random.Random(h * 1_000_003 + seed)
            block = _HASH_BLOCKS[key] = tuple(rng.randrange(first_id, vocab_size) for _ in range(n))
        ids.extend(block)
        if len(ids) >= r.prompt_tokens:
            break
    ids = ids[: r.prompt_tokens]
    if bos_id is not None:
        ids[0] = bos_id
    return ids


def infinite_cache_hit_ratio(rows: list[TraceRequest]) -> tuple[float, float]:
    """``(blocks, tokens)`` prefix-hit ratios of the rows replayed in arrival order on an infinite
    cache, as ``shared/traces/README.md`` defines them: a request's hit is its leading hash ids seen
    before (the hashes are prefix-chained), stopping at the first miss; tokens count
    ``min(hits * hash_block_tokens, prompt_tokens)`` over all prompt tokens."""
    seen: set[int] = set()
    blocks = hit_blocks = tokens = hit_tokens = 0
    for r in sorted(rows, key=lambda q: q.arrival_s):
        hits = 0
        for h in r.hash_ids:
            if h not in seen:
                break
            hits += 1
        seen.update(r.hash_ids)
        blocks += len(r.hash_ids)
        hit_blocks += hits
        tokens += r.prompt_tokens
        hit_tokens += min(hits * r.hash_block_tokens, r.prompt_tokens)
    return (hit_blocks / blocks if blocks else 0.0), (hit_tokens / tokens if tokens else 0.0)
