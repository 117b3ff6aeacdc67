"""Run a simulation: split the requests over the nodes, simulate each node in its mode, summarize.

Requests go to the ``nodes`` identical nodes round-robin in arrival order (no cross-node routing
policy: each node then places its share with its own policy). The exception is pooled mode with
``pool_scope="cluster"``: one pool spans every node, and the node's pooled router places every
request on a (prefill device, decode device) pair of the whole cluster (:mod:`bench.sim.pooled`).

``step_overhead_ms`` is added to both fixed costs of the cost model (every step pays it once, mixed
steps included), so the time-shared policy plans with it as the live node's refitted model would.
``request_overhead_ms`` delays every request's arrival at the node (not its recorded arrival), so it
adds to TTFT and E2E only.

Each request's token times become a :class:`bench.traffic.metrics.RequestRecord` (send time = arrival), so the
summary is :func:`bench.traffic.metrics.summarize`'s, the same as the live replay's: TTFT = first token −
arrival, ITLs = gaps between tokens, E2E = last token − arrival, duration = first arrival to last finish.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from msgspec.structs import replace as replace_struct

from bench.sim.batched import simulate_colocated
from bench.sim.config import SimConfig
from bench.sim.pooled import simulate_pooled
from bench.sim.timeshared import simulate_time_shared
from bench.traffic.metrics import RequestRecord, Summary, summarize
from bench.traffic.clients import with_client_max_tokens
from bench.traffic.traces import TraceRequest
from node.core.cost import CostModel
from node.core.roofline import RooflineCost
from node.core.group_cost import GroupCost
from bench.sim.trace import RequestTrace

__all__ = ["SimResult", "to_record", "simulate", "with_step_overhead", "with_mixed_graphs"]


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


def _merge(total: dict, part: dict, node: int | None) -> None:
    for k, v in part.items():
        if k == "busy_s":
            total.setdefault(k, {}).update({(dev if node is None else f"n{node}/{dev}"): s for dev, s in v.items()})
        elif isinstance(v, dict):  # counts by key (switch reasons): summed per key
            sub = total.setdefault(k, {})
            for key, n in v.items():
                sub[key] = sub.get(key, 0) + n
        else:
            total[k] = total.get(k, 0) + v


def with_step_overhead(cost: CostModel | RooflineCost, overhead_s: float) -> CostModel | RooflineCost:
    """``cost`` with ``overhead_s`` of host work added to every step (``with_host_overhead``)."""
    return cost.with_host_overhead(overhead_s)


def with_mixed_graphs(cost, mixed_graphs: str):
    """``cost`` with its prefill and mixed steps launched as ``mixed_graphs`` says (:class:`SimConfig`): unchanged
    for ``eager``; for ``piecewise``, every roofline model in it (a group's prefill and decode parts too)
    :meth:`RooflineCost.with_piecewise_graphs`.

    Raises:
        ValueError: ``piecewise`` on a model that is not a roofline (a linear fit has no launch term to change).
    """
    if mixed_graphs == "eager":
        return cost
    if isinstance(cost, RooflineCost):
        return cost.with_piecewise_graphs()
    if isinstance(cost, GroupCost):
        return replace_struct(cost, prefill=with_mixed_graphs(cost.prefill, mixed_graphs),
                              decode=with_mixed_graphs(cost.decode, mixed_graphs))
    raise ValueError(f"mixed_graphs {mixed_graphs!r} needs a roofline cost model, got {type(cost).__name__}")


def simulate(requests: list[TraceRequest], cfg: SimConfig, cost) -> SimResult:
    """Simulate ``requests`` on ``cfg`` with step times from ``cost``: a :class:`CostModel` or
    :class:`RooflineCost` (every instance one device; ``decode_tp`` and ``prefill_tp`` must be 1), or a
    :class:`bench.sim.parallel.ParallelModel`, which lowers ``cfg``'s degrees onto groups and instances
    first (its module doc).

    Raises:
        ValueError: degrees above 1 without a ParallelModel;
        bench.sim.parallel.DoesNotFit: a layout's weights leave no KV room.
    """
    from bench.sim.parallel import ParallelModel  # parallel imports this package's config and step costs

    layout = None
    if isinstance(cost, ParallelModel):
        cfg, cost, layout = cost.lower(cfg)
    elif cfg.decode_tp > 1 or cfg.prefill_tp > 1:
        raise ValueError("tensor-parallel degrees need a bench.sim.parallel.ParallelModel as the cost model")
    cost = with_step_overhead(with_mixed_graphs(cost, cfg.mixed_graphs), cfg.step_overhead_ms / 1e3)
    if layout is not None:
        layout = replace(layout, prefill_cost=with_mixed_graphs(layout.prefill_cost, cfg.mixed_graphs))
    if layout is not None and cfg.step_overhead_ms > 0:
        layout = replace(layout, prefill_cost=with_step_overhead(layout.prefill_cost, cfg.step_overhead_ms / 1e3))
    requests = with_client_max_tokens(requests, cfg.client_max_tokens, cfg.client_seed)  # what clients send
    arrivals = [r.arrival_s for r in requests]
    if cfg.request_overhead_ms > 0:
        requests = [replace(r, arrival_s=r.arrival_s + cfg.request_overhead_ms / 1e3) for r in requests]
    traces: list[RequestTrace | None] = [None] * len(requests)
    stats: dict = {}
    if cfg.mode == "pooled" and cfg.pool_scope == "cluster":
        traces, st = simulate_pooled(requests, cfg, cost, prefix="r", nodes=cfg.nodes)
        _merge(stats, st, None)
    else:
        run = {"time-shared": simulate_time_shared, "adaptive": simulate_time_shared, "colocated": simulate_colocated,
               "pooled": simulate_pooled}[cfg.mode]
        order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
        shares = [order[n::cfg.nodes] for n in range(cfg.nodes)]
        for n, idx in enumerate(shares):
            if not idx:
                continue
            extra = {"layout": layout} if layout is not None else {}
            got, st = run([requests[i] for i in idx], cfg, cost, prefix=f"n{n}r", **extra)
            for i, t in zip(idx, got):
                traces[i] = t
            _merge(stats, st, n)
    for t, a in zip(traces, arrivals):
        t.arrival_s = a  # the client's send time
    records = [to_record(t) for t in traces]
    summary = summarize(records, ttft_slo_ms=cfg.ttft_slo_ms, tpot_slo_ms=cfg.tpot_slo_ms)
    return SimResult(traces, records, summary, stats)
