"""Prometheus metrics of one node (prometheus-client, a registry per node).

Counters and histograms are updated as requests and steps happen; gauges that describe current state
(queue depth, KV blocks, resident sequences, roles) are read from the node at scrape time, so they can
never lag behind an abort.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

if TYPE_CHECKING:
    from node.runtime.node import Node

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class NodeMetrics:
    """All metrics of a node; ``render()`` gives the Prometheus text format."""

    def __init__(self, node: "Node"):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("shiftnode_requests", "Finished requests by finish reason", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("shiftnode_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("shiftnode_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("shiftnode_time_to_first_token_seconds", "TTFT", buckets=LATENCY_BUCKETS_S, registry=r)
        self.itl = Histogram("shiftnode_inter_token_latency_seconds", "Gap between consecutive tokens of a choice",
                             buckets=LATENCY_BUCKETS_S, registry=r)
        self.tpot = Histogram("shiftnode_time_per_output_token_seconds", "(E2E - TTFT) / (output tokens - 1)",
                              buckets=LATENCY_BUCKETS_S, registry=r)
        self.e2e = Histogram("shiftnode_e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=LATENCY_BUCKETS_S, registry=r)
        self.role_switches = Counter("shiftnode_role_switches", "Completed role switches", ["device", "direction"], registry=r)
        self.switch_pause = Histogram("shiftnode_role_switch_pause_seconds", "Reconfiguration pause per switch",
                                      ["device", "direction"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.decode_stall = Counter("shiftnode_decode_stall_seconds", "Time resident decode sequences waited, by cause",
                                    ["device", "cause"], registry=r)
        self.kv_transfers = Counter("shiftnode_kv_transfers", "Sequences whose KV moved between devices or to peer nodes",
                                    ["src", "dst", "reason"], registry=r)
        self.kv_transfer_bytes = Counter("shiftnode_kv_transfer_bytes", "KV bytes moved between devices", registry=r)
        self.kv_transfer_seconds = Histogram("shiftnode_kv_transfer_seconds", "Duration of one sequence's KV transfer",
                                             buckets=LATENCY_BUCKETS_S, registry=r)
        self.kv_handoff_failures = Counter("shiftnode_kv_handoff_failures", "KV hand-offs to peers that failed "
                                           "(each counted against --max-retries)", registry=r)
        self.kv_received = Counter("shiftnode_kv_received_sequences", "Sequences adopted from peer nodes", registry=r)
        self.rejected = Counter("shiftnode_rejected_requests", "Requests refused for overload (503)", registry=r)
        r.register(_StateCollector(node))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StateCollector:
    def __init__(self, node: "Node"):
        self.node = node

    def collect(self) -> Iterable[GaugeMetricFamily]:
        n = self.node
        queue = GaugeMetricFamily("shiftnode_queue_depth", "Requests waiting for a device")
        queue.add_metric([], n.num_waiting)
        yield queue
        used = GaugeMetricFamily("shiftnode_kv_blocks_used", "KV blocks held by live sequences", labels=["device"])
        total = GaugeMetricFamily("shiftnode_kv_blocks_total", "KV blocks of the device's pool", labels=["device"])
        usage = GaugeMetricFamily("shiftnode_kv_usage_ratio", "Share of KV blocks in use", labels=["device"])
        running = GaugeMetricFamily("shiftnode_running_sequences", "Resident sequences", labels=["device"])
        for e in n.engines:
            led = e.batcher.ledger
            used.add_metric([e.device_id], led.num_used)
            total.add_metric([e.device_id], led.num_blocks)
            usage.add_metric([e.device_id], led.num_used / led.num_blocks)
            running.add_metric([e.device_id], len(e.batcher.running))
        yield from (used, total, usage, running)
