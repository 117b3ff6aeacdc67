"""What a simulation takes and records: requests to replay, each request's token times, each step.

Plain records, shared by every simulated mode (:mod:`bench.sim.batched`, :mod:`bench.sim.pooled`,
:mod:`bench.sim.timeshared`) and turned into :class:`bench.traffic.metrics.RequestRecord` by
:func:`bench.sim.run.to_record`. Times in seconds on the simulation's virtual clock.
"""

from __future__ import annotations

import msgspec

__all__ = ["SimRequest", "RequestTrace", "StepRecord"]


class SimRequest(msgspec.Struct, frozen=True):
    """A request to replay: arrival (s), prompt and output length (tokens: what it produces).

    ``expected_output_tokens`` is what placement is told of its output; ``None``: the node's own estimate,
    ``min(max_tokens, running estimate)`` (:class:`node.core.output_estimate.OutputEstimator`), where
    ``max_tokens`` (the client's bound) is given, else the true length. ``ends_by_eos``: the output ends by
    an EOS the node does not foresee (it then feeds the node's estimate); else by ``max_tokens``.
    ``token_ids``: the prompt's token ids, for the prefix cache (``()``: none given; the prompt is
    then ``prompt_tokens`` ids unique to the request, never shared).
    """

    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    expected_output_tokens: int | None = None
    token_ids: tuple[int, ...] = ()
    max_tokens: int | None = None
    ends_by_eos: bool = False


class RequestTrace(msgspec.Struct):
    """What happened to one request: its (first) device, and the time of each output token (s).
    ``output_tokens``: what it produces (the true length, or the client's bound where that comes first)."""

    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    device_id: str | None = None
    token_times_s: list[float] = []
    rejected: bool = False
    cached_tokens: int = 0  # prompt tokens found in the device's prefix cache when admitted
    ends_by_eos: bool = False  # its last token is an EOS the node did not foresee (else max_tokens or the context ends it)

    @property
    def done(self) -> bool:
        return len(self.token_times_s) >= self.output_tokens

    @property
    def ttft_s(self) -> float:
        return self.token_times_s[0] - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return self.token_times_s[-1] - self.arrival_s

    @property
    def itls_s(self) -> list[float]:
        t = self.token_times_s
        return [b - a for a, b in zip(t, t[1:])]


class StepRecord(msgspec.Struct, frozen=True):
    """One interval of device time: ``kind`` is prefill | decode | pause | transfer; ``tokens`` computed
    (0 for a pause or a transfer)."""

    device_id: str
    kind: str
    start_s: float
    end_s: float
    tokens: int = 0
