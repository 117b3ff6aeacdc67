"""Serving-benchmark metrics: what ``vllm bench serve`` reports, plus SLO attainment and goodput.

Pure (stdlib). Definitions, following vLLM's ``benchmarks/serve.py`` (``calculate_metrics``):

* TTFT: arrival to first output token; E2E (``e2el``): arrival to last token;
* TPOT of a request = ``(E2E - TTFT) / (output_tokens - 1)``; a request with one output token has no
  TPOT (it is left out of the TPOT statistics and counts as meeting a TPOT SLO, as vLLM's goodput does);
* ITL: gaps between consecutive output chunks, pooled over all gaps of all successful requests;
* request throughput = completed / duration; output throughput = output tokens / duration; total token
  throughput = (input + output tokens) / duration;
* statistics in ms: mean, median, std (population, ``numpy.std``), p90, p99 with ``numpy.percentile``'s
  default linear interpolation; an empty list gives 0 (vLLM's ``np.mean(x or 0)``).

SLO terms (DistServe, Zhong et al., OSDI 2024): a request *meets the SLO* when it succeeded with
``TTFT <= ttft_slo`` and ``TPOT <= tpot_slo``; *SLO attainment* is the share of all requests (failed ones
included) meeting it; *goodput* is requests meeting it per second of benchmark. Over a rate sweep,
:func:`max_rate_meeting` gives the highest rate whose attainment reaches a target (90% by default).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

__all__ = ["RequestRecord", "Stat", "Summary", "percentile", "stat_ms", "request_tpot_s", "meets_slo",
           "summarize", "max_rate_meeting", "format_summary"]


@dataclass(frozen=True)
class RequestRecord:
    """One request as a benchmark client saw it (seconds, tokens).

    ``start_s`` (send time on the client clock) is only needed to derive the benchmark duration.
    ``error``: ``None`` on success, else why it failed.
    """

    ttft_s: float | None
    itls_s: Sequence[float]
    e2e_s: float | None
    output_tokens: int
    prompt_tokens: int = 0
    error: str | None = None
    start_s: float = 0.0

    @property
    def success(self) -> bool:
        return self.error is None and self.ttft_s is not None and self.e2e_s is not None


@dataclass(frozen=True)
class Stat:
    """Summary statistics of one latency metric, in milliseconds."""

    mean: float = 0.0
    median: float = 0.0
    std: float = 0.0
    p90: float = 0.0
    p99: float = 0.0
    count: int = 0


@dataclass(frozen=True)
class Summary:
    """The benchmark summary (throughputs per second, latencies in ms)."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft_ms: Stat
    tpot_ms: Stat
    itl_ms: Stat
    e2el_ms: Stat
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    slo_attainment: float | None = None
    goodput: float | None = None
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def percentile(values: Sequence[float], q: float) -> float:
    """``numpy.percentile(values, q)`` with linear interpolation (``q`` in 0..100); 0 for no values."""
    if not values:
        return 0.0
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def stat_ms(values_s: Sequence[float]) -> Stat:
    """:class:`Stat` of values given in seconds, reported in milliseconds."""
    if not values_s:
        return Stat()
    ms = [v * 1e3 for v in values_s]
    mean = math.fsum(ms) / len(ms)
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in ms) / len(ms))
    return Stat(mean, percentile(ms, 50), std, percentile(ms, 90), percentile(ms, 99), len(ms))


def request_tpot_s(r: RequestRecord) -> float | None:
    """``(E2E - TTFT) / (output_tokens - 1)`` (s per token), or ``None`` with fewer than 2 tokens."""
    if not r.success or r.output_tokens < 2:
        return None
    return (r.e2e_s - r.ttft_s) / (r.output_tokens - 1)


def meets_slo(r: RequestRecord, ttft_slo_ms: float | None, tpot_slo_ms: float | None) -> bool:
    """Succeeded, TTFT <= its SLO and TPOT <= its SLO (no TPOT counts as meeting; ``None``: no SLO)."""
    if not r.success:
        return False
    if ttft_slo_ms is not None and r.ttft_s * 1e3 > ttft_slo_ms:
        return False
    tpot = request_tpot_s(r)
    return tpot_slo_ms is None or tpot is None or tpot * 1e3 <= tpot_slo_ms


def summarize(records: Iterable[RequestRecord], duration_s: float | None = None, *,
              ttft_slo_ms: float | None = None, tpot_slo_ms: float | None = None) -> Summary:
    """Summarize a request log.

    ``duration_s``: benchmark wall time; ``None`` derives it as last finish minus first start from
    ``start_s`` and ``e2e_s``. SLO attainment and goodput are computed when either SLO is given.
    """
    recs = list(records)
    ok = [r for r in recs if r.success]
    if duration_s is None:
        ends = [r.start_s + r.e2e_s for r in ok]
        duration_s = (max(ends) - min(r.start_s for r in recs)) if ends else 0.0
    rate = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)
    tin = sum(r.prompt_tokens for r in ok)
    tout = sum(r.output_tokens for r in ok)
    tpots = [t for t in (request_tpot_s(r) for r in ok) if t is not None]
    itls = [g for r in ok for g in r.itls_s]
    attain = goodput = None
    if ttft_slo_ms is not None or tpot_slo_ms is not None:
        good = sum(1 for r in recs if meets_slo(r, ttft_slo_ms, tpot_slo_ms))
        attain = good / len(recs) if recs else 0.0
        goodput = rate(good)
    return Summary(
        completed=len(ok), failed=len(recs) - len(ok), duration_s=duration_s, total_input_tokens=tin,
        total_output_tokens=tout, request_throughput=rate(len(ok)), output_throughput=rate(tout),
        total_token_throughput=rate(tin + tout), ttft_ms=stat_ms([r.ttft_s for r in ok]), tpot_ms=stat_ms(tpots),
        itl_ms=stat_ms(itls), e2el_ms=stat_ms([r.e2e_s for r in ok]), ttft_slo_ms=ttft_slo_ms,
        tpot_slo_ms=tpot_slo_ms, slo_attainment=attain, goodput=goodput)


def max_rate_meeting(points: Iterable[tuple[float, float]], target: float = 0.9, *,
                     contiguous: bool = False) -> float | None:
    """Highest request rate (req/s) whose SLO attainment reaches ``target``, from ``(rate, attainment)``.

    ``contiguous=True`` stops at the first rate (in increasing order) that misses the target, so a noisy
    pass above a failure does not count. ``None`` when no rate qualifies.
    """
    best = None
    for rate, attainment in sorted(points):
        if attainment >= target:
            best = rate
        elif contiguous:
            break
    return best


def format_summary(s: Summary, title: str = "Serving Benchmark Result") -> str:
    """The summary as ``vllm bench serve`` prints it (one aligned line per figure)."""
    rows: list[tuple[str, str]] = [
        ("Successful requests:", f"{s.completed}"),
        ("Failed requests:", f"{s.failed}"),
        ("Benchmark duration (s):", f"{s.duration_s:.2f}"),
        ("Total input tokens:", f"{s.total_input_tokens}"),
        ("Total generated tokens:", f"{s.total_output_tokens}"),
        ("Request throughput (req/s):", f"{s.request_throughput:.2f}"),
        ("Output token throughput (tok/s):", f"{s.output_throughput:.2f}"),
        ("Total token throughput (tok/s):", f"{s.total_token_throughput:.2f}"),
    ]
    if s.slo_attainment is not None:
        rows += [(f"SLO attainment (TTFT<={s.ttft_slo_ms}ms, TPOT<={s.tpot_slo_ms}ms):", f"{s.slo_attainment:.3f}"),
                 ("Goodput (req/s):", f"{s.goodput:.2f}")]
    sections = (("ttft", "Time to First Token", s.ttft_ms), ("tpot", "Time per Output Token (excl. 1st token)", s.tpot_ms),
                ("itl", "Inter-token Latency", s.itl_ms), ("e2el", "End-to-end Latency", s.e2el_ms))
    for name, label, st in sections:
        rows.append((f"-- {label} --", ""))
        rows += [(f"Mean {name.upper()} (ms):", f"{st.mean:.2f}"), (f"Median {name.upper()} (ms):", f"{st.median:.2f}"),
                 (f"P90 {name.upper()} (ms):", f"{st.p90:.2f}"), (f"P99 {name.upper()} (ms):", f"{st.p99:.2f}")]
    width = max(len(k) for k, _ in rows) + 2
    lines = [f"{'=' * 14} {title} {'=' * 14}"]
    lines += [f"{k:<{width}}{v:>12}" if v else k for k, v in rows]
    lines.append("=" * len(lines[0]))
    return "\n".join(lines)
