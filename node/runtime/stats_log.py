"""The periodic stats line, in the manner of vLLM's logging stat logger: every ``--stats-interval-s``
while there is traffic, nothing while the node is idle.

Console::

    2026-12-07T10:40:00Z [info     ] stats    Avg prompt throughput: 51.2 tokens/s, Avg generation
    throughput: 203.9 tokens/s, Running: 4 reqs, Waiting: 0 reqs, KV cache usage: 0.3%, roles: cpu:0=decode,
    switches: 12

(one line). The JSON format writes the same numbers as fields (``prompt_tokens_per_s``,
``generation_tokens_per_s``, ``running``, ``waiting``, ``kv_usage_pct``, ``roles``, ``switches``,
``interval_s``) beside the ``summary`` text.

The numbers: prompt tokens of the requests admitted in the interval (not yet prefilled ones: a burst
admitted in one interval and prefilled in the next reads 0 prompt tokens/s in the second, where vLLM's
line counts prefill work done) and tokens generated in it, per
second of the interval (the node's ``shiftnode_prompt_tokens`` and ``shiftnode_generation_tokens``
counters); running and waiting sequences now (a request with ``n`` choices counts ``n``, as vLLM v1
counts its child requests); the share of the devices' KV blocks in use now (all devices together);
each device's role now; role switches completed in the interval (free DECODE↔MIXED ones included).
An interval is idle, and logs nothing, when no token was admitted or generated in it and nothing runs
or waits at its end; so the last line after a burst shows the burst's tail and then the console is quiet.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Callable

import structlog

log = structlog.get_logger("shiftnode.stats")


@dataclass(frozen=True)
class StatsSample:
    """The node's counters (cumulative) and state at one instant ``at_s`` (monotonic seconds)."""

    at_s: float
    prompt_tokens: float
    generation_tokens: float
    switches: float
    running: int
    waiting: int
    kv_used_blocks: int
    kv_total_blocks: int
    roles: dict[str, str]


def take_sample(node: Any, now_s: float) -> StatsSample:
    """Read ``node`` (a :class:`~node.runtime.interfaces.StateSource` with ``metrics``, a
    :class:`~node.runtime.metrics.NodeMetrics`) at ``now_s``."""
    m, engines = node.metrics, node.engines
    switches = sum(s.value for metric in m.role_switches.collect() for s in metric.samples if s.name.endswith("_total"))
    decoders = node.config.decode_group_ids()
    return StatsSample(
        at_s=now_s, prompt_tokens=m.registry.get_sample_value("shiftnode_prompt_tokens_total") or 0.0,
        generation_tokens=m.registry.get_sample_value("shiftnode_generation_tokens_total") or 0.0,
        switches=switches, running=sum(len(e.batcher.running) for e in engines), waiting=node.num_waiting,
        kv_used_blocks=sum(e.batcher.ledger.num_used for e in engines),
        kv_total_blocks=sum(e.batcher.ledger.num_blocks for e in engines),
        roles={e.device_id: node.role_of(e, decoders) for e in engines})


def stats_fields(prev: StatsSample, cur: StatsSample) -> dict | None:
    """The stats line's fields for the interval from ``prev`` to ``cur``, or None when it was idle
    (nothing admitted or generated in it, nothing running or waiting at its end)."""
    prompt, generated = cur.prompt_tokens - prev.prompt_tokens, cur.generation_tokens - prev.generation_tokens
    if prompt <= 0 and generated <= 0 and cur.running == 0 and cur.waiting == 0:
        return None
    span = max(cur.at_s - prev.at_s, 1e-9)
    fields = {
        "prompt_tokens_per_s": round(prompt / span, 1), "generation_tokens_per_s": round(generated / span, 1),
        "running": cur.running, "waiting": cur.waiting,
        "kv_usage_pct": round(100.0 * cur.kv_used_blocks / max(cur.kv_total_blocks, 1), 1),
        "roles": dict(cur.roles), "switches": int(cur.switches - prev.switches), "interval_s": round(span, 3),
    }
    roles = " ".join(f"{d}={r}" for d, r in cur.roles.items())
    fields["summary"] = (
        f"Avg prompt throughput: {fields['prompt_tokens_per_s']:.1f} tokens/s, "
        f"Avg generation throughput: {fields['generation_tokens_per_s']:.1f} tokens/s, "
        f"Running: {cur.running} reqs, Waiting: {cur.waiting} reqs, KV cache usage: {fields['kv_usage_pct']:.1f}%, "
        f"roles: {roles}, switches: {fields['switches']}")
    return fields


async def log_stats_periodically(node: Any, interval_s: float,
                                 clock: Callable[[], float] = time.monotonic) -> None:
    """Write the stats line every ``interval_s`` seconds while there is traffic (:func:`stats_fields`),
    until cancelled; ``interval_s <= 0``: return at once (no line). A failure to read the node is
    logged once per interval as a warning, never raised (the line is a view, not a duty)."""
    if interval_s <= 0:
        return
    prev: StatsSample | None = None
    while True:
        try:
            cur = take_sample(node, clock())
        except Exception as e:  # noqa: BLE001 - e.g. an engine replaced while it was read: try next time
            log.warning("stats_unavailable", error=f"{type(e).__name__}: {e}")
        else:
            fields = stats_fields(prev, cur) if prev is not None else None
            prev = cur
            if fields is not None:
                log.info("stats", **fields)
        await asyncio.sleep(interval_s)
