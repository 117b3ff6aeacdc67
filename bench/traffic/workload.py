"""The request list of one benchmark run, shared by the replay client, the comparison and the simulator.

A workload is a list of :class:`~bench.traffic.traces.TraceRequest` (arrival s from the run start, prompt and
output tokens) built from a named trace of ``shared/traces`` (or a trace file path) by
:func:`build_workload`, in this order:

1. arrivals — either the trace's own, windowed from ``start_s`` on its time axis and replayed
   ``time_scale`` times slower (0.5: twice as fast) for ``duration_s`` seconds of arrivals
   (:func:`bench.traffic.traces.load_trace`); or, with ``rate_rps``, the first ``K = round(rate * duration)``
   rows from ``start_s``, their time axis rescaled so the mean rate is ``rate_rps`` (the trace's
   burstiness is kept: ``time_scale = K / (rate * span)`` with ``span`` the time from the first row to
   row ``K``); or ``trace="poisson"``: Poisson arrivals at ``rate_rps`` with lengths drawn from the
   ``lengths_from`` trace (:func:`bench.traffic.traces.poisson_requests`, seeded), or from a synthetic
   distribution (:func:`synthetic_lengths`: ``fixed:P:O``, ``uniform:LO:HI:O``, ``loguniform:LO:HI:O``);
2. lengths — with ``tokens_per_hash`` (Mooncake traces, whose ``hash_ids`` each stand for 512
   tokens), every hash is scaled down to that many tokens (:func:`bench.traffic.traces.scale_hash_blocks`:
   prompt and output shrink by ``tokens_per_hash / 512``) and the prompt is later built from the hash
   blocks (:func:`bench.traffic.traces.hash_prompt_ids`), so shared hashes give shared tokens; then
   multiplied by ``length_scale`` (rounded, at least 1 token; keeps a trace's length
   distribution when a small model's context cannot hold its prompts), then clipped to
   ``max_prompt_tokens`` / ``max_output_tokens``, then the prompt clipped so that prompt + output fits
   ``max_model_len`` (the served model's context).

The same arguments give the same list (the Poisson generator is seeded), so a live replay and a
simulation of "the same trace" see identical requests.
"""

from __future__ import annotations

import argparse
import math
import os
import random
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from bench.traffic.traces import TraceRequest, load_trace, poisson_requests, scale_hash_blocks

__all__ = ["TRACES", "synthetic_lengths", "WorkloadSpec", "Workload", "shared_dir", "trace_path", "build_workload",
           "fit_lengths", "add_workload_args", "spec_from_args"]

TRACES = {
    "azure-conv": "azure_llm_2023/AzureLLMInferenceTrace_conv.csv",
    "azure-code": "azure_llm_2023/AzureLLMInferenceTrace_code.csv",
    "mooncake-conv": "mooncake/conversation_trace.jsonl",
    "mooncake-synth": "mooncake/synthetic_trace.jsonl",
}


def shared_dir() -> Path:
    """The shared data folder: ``$SHIFTNODE_SHARED``, else ``../shared`` beside the checkout."""
    env = os.environ.get("SHIFTNODE_SHARED")
    return Path(env) if env else Path(__file__).resolve().parents[2].parent / "shared"


def trace_path(name: str) -> Path:
    """A trace name of :data:`TRACES` (or a ``.csv``/``.jsonl`` path) → the file."""
    if name in TRACES:
        p = shared_dir() / "traces" / TRACES[name]
    else:
        p = Path(name)
    if not p.is_file():
        raise FileNotFoundError(f"trace {name!r} not found at {p} (names: {', '.join(TRACES)}, poisson, or a file; "
                                "set SHIFTNODE_SHARED)")
    return p


@dataclass(frozen=True)
class WorkloadSpec:
    """What to replay. Times in seconds, lengths in tokens; ``None`` means no cap / not given."""

    trace: str = "azure-conv"
    duration_s: float = 20.0
    rate_rps: float | None = None
    time_scale: float = 1.0
    start_s: float = 0.0
    length_scale: float = 1.0
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None
    max_model_len: int | None = None
    lengths_from: str = "azure-conv"
    seed: int = 0
    tokens_per_hash: int | None = None  # Mooncake traces: keep hash ids, each scaled to this many tokens


@dataclass(frozen=True)
class Workload:
    """The requests, and the time scale that was applied to the trace's arrivals (1 for Poisson)."""

    spec: WorkloadSpec
    requests: list[TraceRequest]
    time_scale: float

    def describe(self) -> dict:
        n = len(self.requests)
        return {**asdict(self.spec), "effective_time_scale": self.time_scale, "num_requests": n,
                "mean_prompt_tokens": sum(r.prompt_tokens for r in self.requests) / n if n else 0.0,
                "mean_output_tokens": sum(r.output_tokens for r in self.requests) / n if n else 0.0}


def fit_lengths(rows: list[TraceRequest], *, length_scale: float = 1.0, max_prompt_tokens: int | None = None,
                max_output_tokens: int | None = None, max_model_len: int | None = None) -> list[TraceRequest]:
    """Scale, cap and fit request lengths to a context (step 2 of the module doc); arrivals unchanged."""
    out = []
    for r in rows:
        p = max(1, round(r.prompt_tokens * length_scale))
        o = max(1, round(r.output_tokens * length_scale))
        if max_prompt_tokens is not None:
            p = min(p, max_prompt_tokens)
        if max_output_tokens is not None:
            o = min(o, max_output_tokens)
        if max_model_len is not None:
            o = min(o, max_model_len - 1)
            p = max(1, min(p, max_model_len - o))
        out.append(replace(r, prompt_tokens=p, output_tokens=o))
    return out


def _rate_scaled(rows: list[TraceRequest], rate_rps: float, duration_s: float) -> tuple[list[TraceRequest], float]:
    k = max(1, round(rate_rps * duration_s))
    if len(rows) < 2:
        raise ValueError("the trace window holds fewer than 2 requests")
    k = min(k, len(rows) - 1)
    span = rows[k].arrival_s - rows[0].arrival_s
    if span <= 0:
        raise ValueError(f"the first {k + 1} requests of the window arrive at once; cannot rescale to a rate")
    scale = k / (rate_rps * span)
    t0 = rows[0].arrival_s
    return [replace(r, arrival_s=(r.arrival_s - t0) * scale) for r in rows[:k]], scale


SYNTHETIC_DRAWS = 4096


def synthetic_lengths(text: str, seed: int = 0) -> list[TraceRequest] | None:
    """A length pool for Poisson arrivals from a spec, or ``None`` when ``text`` names a trace.

    ``fixed:P:O`` — every prompt ``P`` tokens, every output ``O``; ``uniform:LO:HI:O`` — prompts
    uniform on ``[LO, HI]``; ``loguniform:LO:HI:O`` — prompts log-uniform on ``[LO, HI]`` (a wide range:
    as many prompts in 100..1000 as in 1000..10000). ``SYNTHETIC_DRAWS`` draws, seeded.
    """
    kind, _, rest = text.partition(":")
    if kind not in ("fixed", "uniform", "loguniform"):
        return None
    try:
        nums = [int(x) for x in rest.split(":")]
    except ValueError:
        raise ValueError(f"bad length spec {text!r} (fixed:P:O, uniform:LO:HI:O, loguniform:LO:HI:O)") from None
    if (kind == "fixed" and len(nums) != 2) or (kind != "fixed" and len(nums) != 3) or min(nums) < 1:
        raise ValueError(f"bad length spec {text!r} (fixed:P:O, uniform:LO:HI:O, loguniform:LO:HI:O)")
    if kind == "fixed":
        return [TraceRequest(0.0, nums[0], nums[1])]
    lo, hi, out = nums
    if hi < lo:
        raise ValueError(f"bad length spec {text!r}: HI < LO")
    rng = random.Random(seed)
    if kind == "uniform":
        return [TraceRequest(0.0, rng.randint(lo, hi), out) for _ in range(SYNTHETIC_DRAWS)]
    return [TraceRequest(0.0, min(hi, max(lo, round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))), out)
            for _ in range(SYNTHETIC_DRAWS)]


def build_workload(spec: WorkloadSpec) -> Workload:
    """The request list of ``spec`` (see the module doc). Raises ``ValueError``/``FileNotFoundError``."""
    if spec.duration_s <= 0:
        raise ValueError("duration must be positive")
    if spec.trace == "poisson":
        if not spec.rate_rps:
            raise ValueError("--trace poisson needs --rate")
        src = synthetic_lengths(spec.lengths_from, spec.seed) or load_trace(trace_path(spec.lengths_from))
        rows = poisson_requests(spec.rate_rps, lengths_from=src, duration_s=spec.duration_s, seed=spec.seed)
        scale = 1.0
    elif spec.rate_rps:
        rows, scale = _rate_scaled(load_trace(trace_path(spec.trace), start_s=spec.start_s,
                                              keep_hashes=bool(spec.tokens_per_hash)), spec.rate_rps, spec.duration_s)
    else:
        scale = spec.time_scale
        rows = load_trace(trace_path(spec.trace), start_s=spec.start_s, duration_s=spec.duration_s / scale,
                          time_scale=scale, keep_hashes=bool(spec.tokens_per_hash))
    if spec.tokens_per_hash:
        rows = scale_hash_blocks(rows, spec.tokens_per_hash)
    rows = fit_lengths(rows, length_scale=spec.length_scale, max_prompt_tokens=spec.max_prompt_tokens,
                       max_output_tokens=spec.max_output_tokens, max_model_len=spec.max_model_len)
    return Workload(spec, rows, scale)


def add_workload_args(p: argparse.ArgumentParser, *, rates: bool = False) -> None:
    """The workload flags (``--rates`` instead of ``--rate`` for sweeps)."""
    g = p.add_argument_group("workload")
    g.add_argument("--trace", default="azure-conv", help=f"{', '.join(TRACES)}, poisson, or a .csv/.jsonl path")
    if rates:
        g.add_argument("--rates", default="2,4,8", help="comma-separated request rates (req/s)")
    else:
        g.add_argument("--rate", type=float, default=None,
                       help="mean request rate (req/s): Poisson rate, or the rate a trace is rescaled to")
    g.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals")
    g.add_argument("--time-scale", type=float, default=1.0,
                   help="trace arrivals x F when no rate is given (0.5 replays twice as fast)")
    g.add_argument("--start-s", type=float, default=0.0, help="window start on the trace's time axis (s)")
    g.add_argument("--length-scale", type=float, default=1.0, help="multiply prompt and output lengths (before caps)")
    g.add_argument("--max-prompt-tokens", type=int, default=None, help="clip prompts to N tokens")
    g.add_argument("--max-output-tokens", type=int, default=None, help="clip outputs to N tokens")
    g.add_argument("--lengths-from", default="azure-conv",
                   help="trace whose lengths Poisson requests draw, or fixed:P:O, uniform:LO:HI:O, loguniform:LO:HI:O")
    g.add_argument("--seed", type=int, default=0, help="seed of Poisson arrivals, length draws and prompt ids")
    g.add_argument("--tokens-per-hash", type=int, default=None,
                   help="Mooncake traces: build prompts from their hash ids, each scaled from 512 to N tokens "
                        "(shared hashes give shared tokens; prompt and output shrink by N/512)")


def spec_from_args(a: argparse.Namespace, *, rate_rps: float | None = None,
                   max_model_len: int | None = None) -> WorkloadSpec:
    """A :class:`WorkloadSpec` from :func:`add_workload_args` flags (``rate_rps`` overrides ``--rate``)."""
    rate = rate_rps if rate_rps is not None else getattr(a, "rate", None)
    return WorkloadSpec(trace=a.trace, duration_s=a.duration, rate_rps=rate, time_scale=a.time_scale,
                        start_s=a.start_s, length_scale=a.length_scale, max_prompt_tokens=a.max_prompt_tokens,
                        max_output_tokens=a.max_output_tokens, max_model_len=max_model_len,
                        lengths_from=a.lengths_from, seed=a.seed, tokens_per_hash=getattr(a, "tokens_per_hash", None))
