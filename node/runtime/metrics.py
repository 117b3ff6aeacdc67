"""Prometheus metrics of one node (prometheus-client, a registry per node).

vLLM-compatible names (``vllm:*``) come beside these from :mod:`node.runtime.vllm_metrics`.

Counters and histograms are updated as requests and steps happen; gauges that describe current state
(queue depth, KV blocks, resident sequences, roles) are read from the node at scrape time, so they can
never lag behind an abort.
"""

from __future__ import annotations

import time
from typing import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from node.runtime.peer_state import PEER_STATES
from node.runtime.vllm_metrics import VllmCompatCollector

from node.runtime.interfaces import StateSource

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class NodeMetrics:
    """All metrics of a node; ``render()`` gives the Prometheus text format."""

    def __init__(self, node: StateSource):
        self.registry = CollectorRegistry()
        r = self.registry
        # One per request (a prompt with its n choices), labelled by its worst choice (REQUEST_OUTCOME_ORDER);
        # choices have their own counter, so n > 1 does not inflate the request count.
        self.requests = Counter("shiftnode_requests", "Finished requests (one per prompt, whatever n) by the "
                                "finish reason of their worst choice: error > abort > length > stop",
                                ["finish_reason"], registry=r)
        self.choices = Counter("shiftnode_request_choices", "Finished choices (n per request) by finish reason",
                               ["finish_reason"], registry=r)
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
        self.peer_refusals = Counter("shiftnode_peer_refusals", "Peer handshakes refused, by reason (auth, version, "
                                     "layout, config, weights, tokenizer, fingerprint) and direction (outbound: "
                                     "to a peer of ours; inbound: to our KV port)", ["reason", "direction"], registry=r)
        self.kv_recomputes = Counter("shiftnode_kv_recomputes", "Sequences recomputed here after their KV was lost "
                                     "on a peer (relay broken after the commit) or with a dead engine (resumed)", registry=r)
        self.kv_timeouts = Counter("shiftnode_kv_timeouts", "KV transfer waits that timed out, by stage (connect, "
                                   "handshake, accept, stall, commit, relay, status, idle) and side", ["stage", "side"],
                                   registry=r)
        self.request_timeouts = Counter("shiftnode_request_timeouts", "Requests ended by --request-timeout-s "
                                        "(their KV freed)", registry=r)
        self.rejected = Counter("shiftnode_rejected_requests", "Requests refused for overload (503)", registry=r)
        self.stalled_clients = Counter("shiftnode_stalled_clients", "Streams aborted because their client stopped "
                                       "reading (--sse-stall-bytes, --sse-stall-s; their KV freed)", registry=r)
        r.register(_StateCollector(node))
        r.register(VllmCompatCollector(node, self))  # vllm:* names for gateways and vLLM dashboards

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def latency_histograms(self) -> dict:
        """TTFT, ITL, TPOT and E2E as cumulative histograms, ``{"ttft": {"le": [upper bounds, s],
        "counts": [cumulative counts], "count": n, "sum": s}, ...}`` (``le`` ends with ``inf``, written
        as null in JSON): a client takes two snapshots and reads quantiles of the window between them,
        as PromQL's ``histogram_quantile`` over ``rate`` does."""
        out = {}
        for key in ("ttft", "itl", "tpot", "e2e"):
            samples = getattr(self, key).collect()[0].samples
            buckets = [s for s in samples if s.name.endswith("_bucket")]
            out[key] = {"le": [None if s.labels["le"] == "+Inf" else float(s.labels["le"]) for s in buckets],
                        "counts": [int(s.value) for s in buckets],
                        "count": int(next(s.value for s in samples if s.name.endswith("_count"))),
                        "sum": round(next(s.value for s in samples if s.name.endswith("_sum")), 6)}
        return out


DEVICE_ROLES = ("prefill", "decode", "mixed", "switching")  # the values of shiftnode_device_role's role label

REQUEST_OUTCOME_ORDER = ("error", "abort", "length", "stop")  # the first present labels a request


def request_outcome(reasons: list[str]) -> str:
    """A request's finish reason from its choices' (``["stop", "length"]`` → ``"length"``): the first of
    :data:`REQUEST_OUTCOME_ORDER` present, else the first choice's (a reason outside the list)."""
    return next((r for r in REQUEST_OUTCOME_ORDER if r in reasons), reasons[0] if reasons else "abort")


class _StateCollector:
    def __init__(self, node: StateSource):
        self.node = node

    def collect(self) -> Iterable[GaugeMetricFamily]:
        n = self.node
        deadline = GaugeMetricFamily("shiftnode_request_timeout_seconds", "Deadline of every request "
                                     "(--request-timeout-s); 0: no bound")
        deadline.add_metric([], n.config.request_timeout_s or 0.0)
        yield deadline
        queue = GaugeMetricFamily("shiftnode_queue_depth", "Requests waiting for a device")
        queue.add_metric([], n.num_waiting)
        yield queue
        used = GaugeMetricFamily("shiftnode_kv_blocks_used", "KV blocks held by live sequences and transfers "
                                 "(cached, reclaimable blocks apart)", labels=["device"])
        cached = GaugeMetricFamily("shiftnode_kv_blocks_cached", "KV blocks findable in the prefix cache",
                                   labels=["device"])
        reclaimable = GaugeMetricFamily("shiftnode_kv_blocks_reclaimable", "Cached KV blocks no live sequence holds "
                                        "(free for allocation)", labels=["device"])
        queries = CounterMetricFamily("shiftnode_prefix_cache_queries", "Tokens of admitted sequences looked up in "
                                      "the prefix cache", labels=["device"], unit="tokens")
        hits = CounterMetricFamily("shiftnode_prefix_cache_hits", "Of those, tokens found cached (not computed)",
                                   labels=["device"], unit="tokens")
        total = GaugeMetricFamily("shiftnode_kv_blocks_total", "KV blocks of the device's pool", labels=["device"])
        usage = GaugeMetricFamily("shiftnode_kv_usage_ratio", "Share of KV blocks in use", labels=["device"])
        running = GaugeMetricFamily("shiftnode_running_sequences", "Resident sequences", labels=["device"])
        yield from _peer_gauges(n)
        oldest = GaugeMetricFamily("shiftnode_oldest_request_age_seconds", "Age of the oldest admitted request "
                                   "not yet finished (0 with none): a stuck request shows here")
        oldest.add_metric([], n.oldest_request_age_s(time.monotonic()))
        live = GaugeMetricFamily("shiftnode_live_requests", "Admitted requests not yet finished")
        live.add_metric([], len(n.live))
        errors = CounterMetricFamily("shiftnode_engine_errors", "Failures contained in a device's step loop, by "
                                     "stage (step, postprocess, listener, reconfigure): the requests they touched "
                                     "failed, the device went on", labels=["device", "stage"])
        down = GaugeMetricFamily("shiftnode_engine_down", "1 when the device's step loop has ended (it serves "
                                 "nothing; see /health)", labels=["device"])
        preempt = CounterMetricFamily("shiftnode_preemptions", "Sequences preempted for KV (recomputed later)",
                                      labels=["device"])
        restarts = CounterMetricFamily("shiftnode_engine_restarts", "Restarts of the device's engine after its "
                                       "process died (each attempt; see --engine-restart-max)", labels=["device"])
        in_step = CounterMetricFamily("shiftnode_grammar_in_step", "Grammars compiled and matchers rebuilt inside "
                                      "a device's steps (each stalls the step; 0 when every arrival was prepared "
                                      "off the step)", labels=["device"])
        supervisor = getattr(n, "supervisor", None)
        for e in n.engines:
            in_step.add_metric([e.device_id], getattr(e, "grammar_in_step", 0))
            for stage, count in e.errors.items():
                errors.add_metric([e.device_id, stage], count)
            down.add_metric([e.device_id], 1.0 if e.failure else 0.0)
            preempt.add_metric([e.device_id], e.batcher.num_preemptions)
            restarts.add_metric([e.device_id], supervisor.total.get(e.device_id, 0) if supervisor else 0)
        yield from (oldest, live, errors, down, preempt, restarts, in_step)
        for e in n.engines:
            led = e.batcher.ledger
            used.add_metric([e.device_id], led.num_used)
            total.add_metric([e.device_id], led.num_blocks)
            usage.add_metric([e.device_id], led.num_used / led.num_blocks)
            running.add_metric([e.device_id], len(e.batcher.running))
            cached.add_metric([e.device_id], led.num_cached)
            reclaimable.add_metric([e.device_id], led.num_reclaimable)
            queries.add_metric([e.device_id], e.batcher.prefix_query_tokens)
            hits.add_metric([e.device_id], e.batcher.prefix_hit_tokens)
        yield from (used, total, usage, running, cached, reclaimable, queries, hits)
        yield from _load_gauges(n)
        role = GaugeMetricFamily("shiftnode_device_role", "1 for the role each device (or tensor-parallel group) "
                                 "has now, 0 for the others: prefill, decode (time-shared roles; a pooled device's "
                                 "fixed one), mixed (colocated chunked prefill) or switching (a reconfiguration pause)", labels=["device", "role"])
        decoders = n.config.decode_group_ids()
        for e in n.engines:
            now_role = n.role_of(e, decoders)
            for r in DEVICE_ROLES:
                role.add_metric([e.device_id, r], 1.0 if r == now_role else 0.0)
        yield role


def _load_gauges(n: StateSource) -> Iterable[GaugeMetricFamily]:
    """The scaling signals, prefill and decode load apart (docs/operations.md#scaling-prefill-and-decode-apart):
    prompt tokens still to compute (requests not yet placed, and each device's queued and partly computed
    prompts; with ``rate(shiftnode_prompt_tokens_total)``, the prefill load) and sequences decoding on
    each device (with ``shiftnode_kv_usage_ratio``, the decode load)."""
    queued = GaugeMetricFamily("shiftnode_prefill_queued_tokens", "Prompt tokens not yet computed: requests "
                               "waiting to be placed, and each device's queued and partly computed prompts "
                               "(prefill load)", labels=["device"])
    pending = getattr(n.driver, "pending", None) or ()
    queued.add_metric(["unplaced"], sum(s.num_uncomputed for r in pending for s in r.seqs))
    decoding = GaugeMetricFamily("shiftnode_decoding_sequences", "Resident sequences past their prompt, "
                                 "generating tokens (decode load)", labels=["device"])
    for e in n.engines:
        queued.add_metric([e.device_id], e.batcher.prefill_queue().tokens)
        decoding.add_metric([e.device_id], e.batcher.num_decoding)
    yield from (queued, decoding)


def _peer_gauges(n: StateSource) -> Iterable[GaugeMetricFamily]:
    """Peers by state, and requests waiting for remote KV by stage: ``unsent`` (prefilled here,
    waiting for a peer to take them), ``sending`` (a hand-off under way), ``receiving`` (a peer's
    transfer into this node)."""
    # Exported (as zeros) without peer links too, so one dashboard query fits every node.
    peers = GaugeMetricFamily("shiftnode_peers", "Peer nodes by state", labels=["state"])
    now = time.monotonic()
    states = [p.state(now, n.peers.stale_s)[0] for p in list(n.peers.peers.values())] if n.peers is not None else []
    for s in PEER_STATES:
        peers.add_metric([s], states.count(s))
    yield peers
    waiting = GaugeMetricFamily("shiftnode_remote_kv_waiting_requests", "Sequences waiting for KV to or from a "
                                "peer node, by stage", labels=["stage"])
    unsent = getattr(n.driver, "unsent_to_peers", None)
    waiting.add_metric(["unsent"], unsent() if unsent is not None else 0)
    waiting.add_metric(["sending"], len(n.peers.sending) if n.peers is not None else 0)
    waiting.add_metric(["receiving"], len(n.receiver.incoming) if n.receiver is not None else 0)
    yield waiting
