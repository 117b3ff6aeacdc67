"""The node's running estimate of a request's output length, from the requests that ended on their own.

Placement reserves KV for a prompt plus its expected output, and the role policies size windows and
gaps with it, before the request has produced a token. A client's ``max_tokens`` bounds the output but
is usually far above it (or absent, leaving the context limit), so the node learns the length from
what it sees: the output of every request that ended by a stop (EOS, a stop token or string), per
choice. Requests cut by ``max_tokens`` or the context limit are not samples: their length is the
bound, not the model's.

The estimate is the mean of the last :data:`WINDOW` samples plus one (the token that ends a request is
counted by the node's stop), or the prior :data:`PRIOR_TOKENS` until :data:`MIN_SAMPLES` have been seen.
The prior (128 tokens) is a round figure between chat and code completions' typical outputs, chosen
before any trace was read; it matters only for the first few requests of a node's life. A windowed
mean rather than an EWMA: its sum is kept, so the estimate is O(1) per call, and it forgets a
workload's old mix after ``WINDOW`` ends.

The live node's drivers (``node.runtime.driver.Driver``) and the simulator (:mod:`bench.sim`) run this
same class, each fed the finished requests it sees. Pure: no I/O.
"""

from __future__ import annotations

from collections import deque

__all__ = ["MIN_SAMPLES", "OutputEstimator", "PRIOR_TOKENS", "WINDOW"]

WINDOW = 256  # most recent samples kept
MIN_SAMPLES = 8  # samples before the mean replaces the prior
PRIOR_TOKENS = 128  # expected output per choice before MIN_SAMPLES requests have ended on their own


class OutputEstimator:
    """Windowed mean of naturally-ended requests' output tokens per choice (module doc).

    Args:
        window: samples kept (at least 1).
        prior_tokens: the estimate before ``min_samples`` samples (tokens, at least 1).
        min_samples: samples needed before the mean is used.
    Raises:
        ValueError: a window, prior or sample count below 1.
    """

    def __init__(self, window: int = WINDOW, prior_tokens: int = PRIOR_TOKENS, min_samples: int = MIN_SAMPLES):
        if window < 1 or prior_tokens < 1 or min_samples < 1:
            raise ValueError("window, prior_tokens and min_samples must be at least 1")
        self.prior_tokens, self.min_samples = prior_tokens, min_samples
        self._samples: deque[int] = deque(maxlen=window)
        self._sum = 0  # the samples' running sum: estimate() is asked once per snapshot and placement

    def __len__(self) -> int:
        return len(self._samples)

    def observe(self, output_tokens: int, choices: int = 1) -> None:
        """Record a request that ended on its own with ``output_tokens`` over its ``choices`` (tokens;
        the sample is the per-choice share, at least 1)."""
        if len(self._samples) == self._samples.maxlen:
            self._sum -= self._samples[0]  # the sample the append below drops
        n = max(1, output_tokens // max(1, choices))
        self._samples.append(n)
        self._sum += n

    def estimate(self) -> int:
        """Expected output tokens per choice before a request's own bound (module doc)."""
        if len(self._samples) < self.min_samples:
            return self.prior_tokens
        return int(self._sum / len(self._samples)) + 1

    def expected(self, max_tokens: int) -> int:
        """Expected output of a request allowed ``max_tokens`` (its own or the context's bound):
        ``min(max_tokens, estimate())``."""
        return min(max_tokens, self.estimate())
