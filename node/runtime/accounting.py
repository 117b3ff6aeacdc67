"""Consumer-side accounting of one delta: TTFT, ITL, TPOT, tokens sent, and the choice's end.

Shared by the node (one process: :meth:`Node.account <node.runtime.node.Node.account>`) and the API
front ends (``--api-processes`` > 1), so a token is timed by the same rule wherever it is consumed.
"""

from __future__ import annotations

from typing import Protocol

from node.runtime.output import SeqDelta


class _Observer(Protocol):
    def observe(self, value: float) -> None: ...


class _Counter(Protocol):
    def inc(self, amount: int = 1) -> None: ...


class LatencyMetrics(Protocol):
    """What :func:`account` writes: prometheus-client's or :class:`node.api.frontend_metrics.FrontendMetrics`."""

    ttft: _Observer
    itl: _Observer
    tpot: _Observer
    generation_tokens: _Counter


def account(m: LatencyMetrics, req, delta: SeqDelta, now: float) -> None:
    """Count ``delta`` of ``req`` (a request state with ``index0``, ``first_s``, ``last_s``, ``tokens``,
    ``reasons`` per choice and ``stats.arrival_s`` / ``stats.output_tokens``) taken at ``now`` (s,
    monotonic): TTFT on choice 0's first token, ITL between a choice's deltas, TPOT at its end."""
    i = delta.index - req.index0
    if delta.token_ids:
        k = len(delta.token_ids)
        if req.first_s[i] is None:
            req.first_s[i] = now
            if i == 0:
                m.ttft.observe(now - req.stats.arrival_s)
        else:
            m.itl.observe(now - req.last_s[i])
        req.last_s[i] = now
        req.tokens[i] += k
        req.stats.output_tokens += k
        m.generation_tokens.inc(k)
    if delta.finish_reason or delta.error:
        req.reasons[i] = delta.finish_reason or "error"
        if req.tokens[i] > 1:
            m.tpot.observe((req.last_s[i] - req.first_s[i]) / (req.tokens[i] - 1))
