"""Time-shared mode: the node's own role policy on a virtual node.

The requests replay through :class:`node.core.virtual.VirtualNode` (devices advanced by the cost
model, one step at a time) driven by :class:`node.core.roles.RoleScheduler` — the object the live node
runs — configured the way :class:`node.runtime.node.Node` configures it from the same flags, and told each
device's free sequence slots (``max_num_seqs`` minus resident and queued) as the live driver tells it. The
policy's cost model is the simulation's, with ``pause_s`` raised to the ``reconfig_pause_ms`` floor (the
live node adds that floor to every switch's measured swap) and to ``pause_ms`` (a measured swap).
"""

from __future__ import annotations

import msgspec

from bench.sim.batched import prompt_token_ids
from bench.sim.config import SimAborted, SimConfig, count_late
from bench.traces import TraceRequest
from node.core.cost import CostModel
from node.core.roofline import RooflineCost
from node.core.roles import NodeSnapshot, RoleScheduler, RoleSchedulerConfig
from node.core.virtual import RequestTrace, VirtualNode, VirtualRequest

__all__ = ["NODE_EXPECTED_OUTPUT_TOKENS", "simulate_time_shared"]

# What the live node's placement driver assumes of a request's output before it has seen requests end
# on their own (DEFAULT_EXPECTED_OUTPUT in node/runtime; not imported: that module pulls in torch);
# ignore_eos requests never end on their own.
NODE_EXPECTED_OUTPUT_TOKENS = 128


class CappedVirtualNode(VirtualNode):
    """:class:`VirtualNode` whose snapshot carries each device's free sequence slots.

    The live role driver tells the policy ``seq_slots_free = max_num_seqs - resident - queued`` per
    device (``RoleDriver.snapshot``), so the scheduler never places more sequences on a device than its
    batch cap; the plain virtual node leaves the field at its unbounded default.
    """

    def __init__(self, *args, max_num_seqs: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_num_seqs = max_num_seqs

    def snapshot(self, now_s: float) -> NodeSnapshot:
        snap = super().snapshot(now_s)
        cap = self.max_num_seqs
        devs = tuple(msgspec.structs.replace(st, seq_slots_free=max(0, cap - len(d.resident) - len(d.queue)))
                     for st, d in zip(snap.devices, self.devices))
        return msgspec.structs.replace(snap, devices=devs)


def simulate_time_shared(requests: list[TraceRequest], cfg: SimConfig, cost: CostModel | RooflineCost,
                         prefix: str = "r") -> tuple[list[RequestTrace], dict]:
    """Replay ``requests`` on one time-shared node; ``(traces in request order, stats)``."""
    policy = RoleSchedulerConfig(
        ttft_slo_ms=cfg.ttft_slo_ms, tpot_slo_ms=cfg.tpot_slo_ms, reconfig_pause_ms=cfg.reconfig_pause_ms,
        min_window_ms=cfg.min_window_ms, max_window_ms=cfg.max_window_ms,
        prefill_token_budget=cfg.max_num_batched_tokens, stagger=cfg.stagger)
    cost = msgspec.structs.replace(cost, pause_s=max(cost.pause_s, cfg.reconfig_pause_ms / 1e3,
                                                     cfg.pause_ms / 1e3))
    scheduler = RoleScheduler(policy, cost)
    vn = CappedVirtualNode(scheduler, cost, num_devices=cfg.devices, kv_blocks=cfg.kv_blocks,
                           block_size=cfg.block_size, max_num_seqs=cfg.max_num_seqs,
                           prefix_caching=cfg.prefix_caching)
    vreqs = []
    for i, r in enumerate(requests):
        expected = r.output_tokens if cfg.expected_output == "oracle" else min(r.output_tokens, NODE_EXPECTED_OUTPUT_TOKENS)
        rid = f"{prefix}{i}"
        ids = tuple(prompt_token_ids(rid, r, True)) if cfg.prefix_caching else ()
        vreqs.append(VirtualRequest(rid, r.arrival_s, r.prompt_tokens, r.output_tokens, expected, ids))
    t_end = (requests[0].arrival_s if requests else 0.0) + cfg.max_sim_s
    slo_s, limit = cfg.ttft_slo_ms / 1e3, cfg.abort_late

    def abort_when_late(now_s, snap, decisions):
        if count_late((w.arrival_s for w in snap.waiting), now_s, slo_s, limit) >= limit:
            raise SimAborted(f"{limit} requests waited past the TTFT SLO")

    traces = vn.run(vreqs, until_s=t_end, max_events=50_000_000,
                    on_decide=abort_when_late if limit is not None else None)
    pauses = [s for s in vn.steps if s.kind == "pause"]
    busy = {}
    for s in vn.steps:
        if s.kind != "pause":
            busy[s.device_id] = busy.get(s.device_id, 0.0) + (s.end_s - s.start_s)
    stats = {"switches": len(vn.switches), "pause_s": sum(s.end_s - s.start_s for s in pauses),
             "busy_s": busy, "transfers": 0, "transfer_bytes": 0, "preemptions": 0,
             "cached_tokens": sum(traces[v.request_id].cached_tokens for v in vreqs)}
    return [traces[v.request_id] for v in vreqs], stats
