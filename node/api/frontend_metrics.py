"""The latency metrics an API front end measures, sent to the control process in increments.

In the front-end layout (``--api-processes`` > 1) the consumer side of a request (TTFT, ITL, TPOT,
tokens sent) lives in the front end that streams it, while ``/metrics`` is rendered by the control
process from its :class:`~node.runtime.metrics.NodeMetrics`. Each front end counts observations
into plain bucket arrays (cheaper per token than a prometheus-client histogram, and nothing else
reads them here) and sends what accrued as one :class:`~node.api.link_protocol.MetricsDelta` at
each request's end and at most every :data:`REPORT_S` while streams run; the control process adds
it into its own histograms (:func:`apply`), so ``shiftnode_*`` and ``vllm:*`` families and
``GET /v1/node``'s ``latency`` cover every front end, as they did with one process.
"""

from __future__ import annotations

from bisect import bisect_left

from node.api.link_protocol import HistogramDelta, MetricsDelta
from node.runtime.metrics import LATENCY_BUCKETS_S, NodeMetrics

REPORT_S = 0.5
"""Longest a front end holds observations before sending them (s)."""


class BucketHistogram:
    """Observations since the last :meth:`take`, per prometheus bucket (``le`` semantics: a value on a
    bound counts in that bound's bucket) and their sum. Same ``observe`` as prometheus-client's."""

    __slots__ = ("counts", "sum")

    def __init__(self):
        self.counts = [0] * (len(LATENCY_BUCKETS_S) + 1)  # the last: +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(LATENCY_BUCKETS_S, value)] += 1
        self.sum += value

    def take(self) -> HistogramDelta:
        out = HistogramDelta(self.counts, self.sum)
        self.counts = [0] * len(self.counts)
        self.sum = 0.0
        return out


class TokenCounter:
    """A counter with prometheus-client's ``inc``."""

    __slots__ = ("value",)

    def __init__(self):
        self.value = 0

    def inc(self, amount: int = 1) -> None:
        self.value += amount


class FrontendMetrics:
    """``ttft``, ``itl``, ``tpot`` and ``generation_tokens`` as :func:`node.runtime.accounting.account`
    uses them; :meth:`take` empties them into one message."""

    def __init__(self):
        self.ttft = BucketHistogram()
        self.itl = BucketHistogram()
        self.tpot = BucketHistogram()
        self.generation_tokens = TokenCounter()
        self.stalled_clients = TokenCounter()  # node/api/sse.py's backpressure

    @property
    def pending(self) -> bool:
        return (self.generation_tokens.value > 0 or self.stalled_clients.value > 0
                or any(sum(h.counts) for h in (self.ttft, self.itl, self.tpot)))

    def take(self) -> MetricsDelta:
        tokens, self.generation_tokens.value = self.generation_tokens.value, 0
        stalled, self.stalled_clients.value = self.stalled_clients.value, 0
        return MetricsDelta(self.ttft.take(), self.itl.take(), self.tpot.take(), tokens, stalled)


def apply(metrics: NodeMetrics, delta: MetricsDelta) -> None:
    """Add a front end's increments to the control process's histograms and counter.

    prometheus-client has no public call to add a bucket count, so the histogram's own bucket values
    (``_buckets``, non-cumulative like ours) and ``_sum`` are incremented; tests/test_api_processes.py
    checks the rendered result, so a client upgrade that moves them fails there, not silently.
    """
    for name in ("ttft", "itl", "tpot"):
        hist, d = getattr(metrics, name), getattr(delta, name)
        if len(d.counts) != len(hist._buckets):
            raise ValueError(f"{name}: {len(d.counts)} buckets from the front end, {len(hist._buckets)} here")
        for bucket, count in zip(hist._buckets, d.counts):
            if count:
                bucket.inc(count)
        if d.sum:
            hist._sum.inc(d.sum)
    if delta.generation_tokens:
        metrics.generation_tokens.inc(delta.generation_tokens)
    if delta.stalled_clients:
        metrics.stalled_clients.inc(delta.stalled_clients)
