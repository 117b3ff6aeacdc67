"""Run a simulation: split the requests over the nodes, simulate each node in its mode, summarize.

Requests go to the ``nodes`` identical nodes round-robin in arrival order (no routing policy yet).
Each request's token times become a :class:`bench.metrics.RequestRecord` (send time = arrival), so the
summary is :func:`bench.metrics.summarize`'s, the same as the live replay's: TTFT = first token −
arrival, ITLs = gaps between tokens, E2E = last token − arrival, duration = first arrival to last finish.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.metrics import RequestRecord, Summary, summarize
from bench.sim.batched import simulate_batched
from bench.sim.config import SimConfig
from bench.sim.timeshared import simulate_time_shared
from bench.traces import TraceRequest
from node.core.cost import CostModel
from node.core.virtual import RequestTrace

__all__ = ["SimResult", "to_record", "simulate"]


@dataclass
class SimResult:
    traces: list[RequestTrace]  # in request order
    records: list[RequestRecord]
    summary: Summary
    stats: dict  # switches, pause_s, busy_s per device, transfers, transfer_bytes, preemptions


def to_record(t: RequestTrace) -> RequestRecord:
    """A simulated request as the replay client would have recorded it."""
    if t.rejected:
        return RequestRecord(None, [], None, 0, t.prompt_tokens, "rejected: prompt does not fit a device", t.arrival_s)
    if not t.token_times_s or not t.done:
        return RequestRecord(None, [], None, len(t.token_times_s), t.prompt_tokens,
                             "not finished within the simulated time", t.arrival_s)
    return RequestRecord(t.ttft_s, t.itls_s, t.e2e_s, len(t.token_times_s), t.prompt_tokens, None, t.arrival_s)


def _merge(total: dict, part: dict, node: int) -> None:
    for k, v in part.items():
        if k == "busy_s":
            total.setdefault(k, {}).update({f"n{node}/{dev}": s for dev, s in v.items()})
        else:
            total[k] = total.get(k, 0) + v


def simulate(requests: list[TraceRequest], cfg: SimConfig, cost: CostModel) -> SimResult:
    """Simulate ``requests`` on ``cfg`` with step times from ``cost``."""
    run = simulate_time_shared if cfg.mode == "time-shared" else simulate_batched
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    shares = [order[n::cfg.nodes] for n in range(cfg.nodes)]
    traces: list[RequestTrace | None] = [None] * len(requests)
    stats: dict = {}
    for n, idx in enumerate(shares):
        if not idx:
            continue
        got, st = run([requests[i] for i in idx], cfg, cost, prefix=f"n{n}r")
        for i, t in zip(idx, got):
            traces[i] = t
        _merge(stats, st, n)
    records = [to_record(t) for t in traces]
    summary = summarize(records, ttft_slo_ms=cfg.ttft_slo_ms, tpot_slo_ms=cfg.tpot_slo_ms)
    return SimResult(traces, records, summary, stats)
