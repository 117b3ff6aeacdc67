"""vLLM-compatible metric names beside shiftnode's own, for the tools that only know vLLM's.

Kubernetes inference gateways (the Gateway API inference extension's endpoint picker, llm-d's
inference scheduler) route and scale on ``vllm:num_requests_waiting``, ``vllm:num_requests_running``,
``vllm:kv_cache_usage_perc`` and ``vllm:cache_config_info``; vLLM dashboards read its TTFT / ITL /
E2E histograms and token counters. Names, types, units and the ``model_name`` label follow vLLM's v1
``/metrics`` (docs.vllm.ai, "Production Metrics"; vllm/v1/metrics/loggers.py).

Nothing here is counted twice: the histograms and counters are shiftnode's own, renamed at scrape time
(same buckets, same values, so ``vllm:x`` and ``shiftnode_x`` never disagree), and the gauges are
read from the node like :mod:`node.runtime.metrics`'s. The hot path pays nothing for the second name.
"""

from __future__ import annotations

from typing import Iterable

from prometheus_client.metrics_core import Metric
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from node.runtime.interfaces import StateSource

# vLLM name -> (shiftnode attribute of NodeMetrics, help text, label renames). vLLM calls the finish
# reason label ``finished_reason``; shiftnode's is ``finish_reason``.
ALIASES: dict[str, tuple[str, str, dict[str, str]]] = {
    "vllm:time_to_first_token_seconds": ("ttft", "Histogram of time to first token in seconds.", {}),
    "vllm:inter_token_latency_seconds": ("itl", "Histogram of inter-token latency in seconds.", {}),
    "vllm:request_time_per_output_token_seconds": (
        "tpot", "Histogram of time_per_output_token_seconds per request (per choice here).", {}),
    "vllm:e2e_request_latency_seconds": ("e2e", "Histogram of e2e request latency in seconds.", {}),
    "vllm:request_success": ("requests", "Count of processed requests by finish reason (one per prompt, "
                             "labelled by its worst choice).", {"finish_reason": "finished_reason"}),
    "vllm:prompt_tokens": ("prompt_tokens", "Number of prompt tokens, counted when their request is admitted "
                           "(vLLM counts them as its prefills are processed).", {}),
    "vllm:generation_tokens": ("generation_tokens", "Number of generation tokens processed.", {}),
}
"""Renamed copies of shiftnode's histograms and counters (see docs/dashboard.md for the table)."""

GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
          "vllm:cache_config_info")
COUNTERS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions")
SPEC_DECODE = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens",
               "vllm:spec_decode_num_accepted_tokens_per_pos", "vllm:spec_decode_draft_acceptance_rate")
"""Speculative decoding's families (only with ``--speculative-config``): vLLM v1's counters, whose ratios
give the acceptance rate (accepted / draft tokens) and the mean accepted length (1 + accepted / drafts),
and v0's acceptance-rate gauge, read from every device's :class:`~node.core.spec_plan.SpecStats`."""


class VllmCompatCollector:
    """A prometheus-client collector that yields the ``vllm:`` families of one node, each with the
    label ``model_name`` (the served model name)."""

    def __init__(self, node: StateSource, metrics: object):
        self.node = node
        self.metrics = metrics

    def collect(self) -> Iterable[Metric]:
        model = self.node.config.model_name
        for name, (attr, doc, renames) in ALIASES.items():
            for family in getattr(self.metrics, attr).collect():
                yield _renamed(family, name, doc, model, renames)
        yield from _state(self.node, model)
        yield from _spec_decode(self.node, model)


def _renamed(family: Metric, name: str, doc: str, model: str, renames: dict[str, str]) -> Metric:
    """``family`` under ``name``: each sample keeps its suffix (``_bucket``, ``_total``, ...), its
    labels are renamed by ``renames`` and ``model_name`` is added."""
    out = Metric(name, doc, family.type)
    for s in family.samples:
        labels = {"model_name": model, **{renames.get(k, k): v for k, v in s.labels.items()}}
        out.add_sample(name + s.name[len(family.name):], labels, s.value, s.timestamp, s.exemplar)
    return out


def _state(n: StateSource, model: str) -> Iterable[Metric]:
    """The gauges and per-device counters, read now and summed over the node's devices (a gateway
    sees one endpoint per node; shiftnode's own families keep the ``device`` label)."""
    ledgers = [e.batcher.ledger for e in n.engines]
    running = GaugeMetricFamily("vllm:num_requests_running", "Number of requests in model execution batches "
                                "(resident sequences, all devices).", labels=["model_name"])
    running.add_metric([model], sum(len(e.batcher.running) for e in n.engines))
    waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Number of requests waiting to be processed "
                                "(sequences not yet admitted to a step).", labels=["model_name"])
    waiting.add_metric([model], n.num_waiting)
    total = sum(led.num_blocks for led in ledgers)
    usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage, 1 means 100 percent (blocks in use "
                              "over blocks of all devices).", labels=["model_name"])
    usage.add_metric([model], sum(led.num_used for led in ledgers) / total if total else 0.0)
    # The endpoint picker reads block_size and num_gpu_blocks from this info gauge's labels.
    info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig.",
                             labels=["model_name", "block_size", "num_gpu_blocks", "enable_prefix_caching"])
    info.add_metric([model, str(n.config.block_size), str(total), str(n.config.prefix_caching)], 1.0)
    queries = CounterMetricFamily("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of "
                                  "queried tokens.", labels=["model_name"])
    queries.add_metric([model], sum(e.batcher.prefix_query_tokens for e in n.engines))
    hits = CounterMetricFamily("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
                               "tokens.", labels=["model_name"])
    hits.add_metric([model], sum(e.batcher.prefix_hit_tokens for e in n.engines))
    preempt = CounterMetricFamily("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                                  labels=["model_name"])
    preempt.add_metric([model], sum(e.batcher.num_preemptions for e in n.engines))
    return running, waiting, usage, info, queries, hits, preempt


def _spec_decode(n: StateSource, model: str) -> Iterable[Metric]:
    """The speculative-decoding families, summed over the devices; none when speculation is off."""
    stats = [e.spec.stats for e in n.engines if getattr(e, "spec", None) is not None]
    if not stats:
        return ()
    out = []
    for name, attr, doc in (
            ("vllm:spec_decode_num_drafts", "drafts", "Number of spec decoding drafts (verify items)."),
            ("vllm:spec_decode_num_draft_tokens", "draft_tokens", "Number of draft tokens."),
            ("vllm:spec_decode_num_accepted_tokens", "accepted_tokens", "Number of accepted tokens.")):
        fam = CounterMetricFamily(name, doc, labels=["model_name"])
        fam.add_metric([model], sum(getattr(s, attr) for s in stats))
        out.append(fam)
    per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft's "
                                  "position.", labels=["model_name", "position"])
    for pos in range(max(len(s.accepted_per_pos) for s in stats)):
        per_pos.add_metric([model, str(pos)], sum(s.accepted_per_pos[pos] for s in stats if pos < len(s.accepted_per_pos)))
    drafted, accepted = sum(s.draft_tokens for s in stats), sum(s.accepted_tokens for s in stats)
    rate = GaugeMetricFamily("vllm:spec_decode_draft_acceptance_rate", "Speculative token acceptance rate (accepted "
                             "over draft tokens; 0 before any).", labels=["model_name"])
    rate.add_metric([model], accepted / drafted if drafted else 0.0)
    return out + [per_pos, rate]
