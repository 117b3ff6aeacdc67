"""An emulated link: a sleep-based token bucket so that N bytes take about ``N*8/(gbps*1e9)`` s.

Share one :class:`LinkThrottle` between every sender that uses the same physical link.
"""

from __future__ import annotations

import asyncio
import threading
import time


class LinkThrottle:
    """Pace sends to ``gbps`` gigabits per second (1 Gb/s = 1e9 bit/s = 125e6 bytes/s).

    Virtual-clock token bucket: each ``take(n)`` advances a "link busy until" time by
    ``n*8/(gbps*1e9)`` s and returns how long the caller must wait for it. An idle link banks at most
    ``burst_bytes`` of credit, so a sender that pauses can catch up that much, no more.
    """

    def __init__(self, gbps: float, burst_bytes: int = 0, clock=time.monotonic):
        if not gbps > 0:
            raise ValueError(f"link_gbps must be positive, got {gbps}")
        self.gbps = float(gbps)
        self.bytes_per_s = gbps * 1e9 / 8
        self.burst_s = burst_bytes / self.bytes_per_s
        self._clock = clock
        self._busy_until = clock()  # a new link has banked nothing

    def seconds_for(self, nbytes: int) -> float:
        """Line-rate time of ``nbytes`` on this link (s)."""
        return nbytes / self.bytes_per_s

    def take(self, nbytes: int) -> float:
        """Reserve ``nbytes`` of link time; returns the delay (s, >= 0) before they count as sent."""
        now = self._clock()
        self._busy_until = max(self._busy_until, now - self.burst_s) + self.seconds_for(nbytes)
        return max(0.0, self._busy_until - now)

    async def wait(self, nbytes: int) -> None:
        """Async pacing (sleeps on the event loop)."""
        delay = self.take(nbytes)
        if delay > 0:
            await asyncio.sleep(delay)

    def wait_sync(self, nbytes: int, abort: threading.Event | None = None) -> bool:
        """Blocking pacing (for the in-node copy, which runs off the event loop). With ``abort``, the
        wait ends early once it is set; returns False then (True: the bytes count as sent)."""
        delay = self.take(nbytes)
        if delay > 0:
            if abort is None:
                time.sleep(delay)
            elif abort.wait(delay):
                return False
        return True


SLEEP_SLACK_S = 0.002  # credit a paced sender may catch up: sleeps overshoot, and per-chunk overshoots would add up


def as_throttle(link: LinkThrottle | float | None) -> LinkThrottle | None:
    """``None`` (unthrottled), a Gb/s figure, or a shared throttle. A throttle made from a figure banks
    up to :data:`SLEEP_SLACK_S` of line time, so a sender paced chunk by chunk keeps line rate although
    each ``sleep`` overshoots a little (without it a 32-layer copy's overshoots, ~80 us each, added up)."""
    if link is None or isinstance(link, LinkThrottle):
        return link
    gbps = float(link)
    return LinkThrottle(gbps, burst_bytes=int(gbps * 1e9 / 8 * SLEEP_SLACK_S))
