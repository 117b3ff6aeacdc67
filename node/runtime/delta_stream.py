"""The one queue between a device's step and the HTTP handler that streams its tokens.

A step's post-processing pushes each sequence's :class:`~node.runtime.output.SeqDelta` here; the
consumer (an API handler, or :meth:`Node.generate`) takes everything pushed since its last take in
one batch. So a step wakes each consumer once, however many deltas it produced for it, and a
request with several prompts (all its engine requests share one stream) needs no merging task.

The keep-alive is one lazy timer per stream, not one per wait: it fires every ``keepalive_s`` and
re-arms itself while deltas flow, so in steady decode the timer costs nothing per token.
"""

from __future__ import annotations

import asyncio
import time

from node.runtime.output import SeqDelta


class DeltaStream:
    """Deltas of one consumer, in production order, taken in batches.

    Args:
        keepalive_s: after this long (s) with nothing pushed, a waiting :meth:`take` returns ``[]``
            (the caller sends a keep-alive); ``None`` never does.
    """

    __slots__ = ("_items", "_waiter", "_keepalive_s", "_last_s", "_timer", "_idle")

    def __init__(self, keepalive_s: float | None = None):
        self._items: list[SeqDelta] = []
        self._waiter: asyncio.Future | None = None
        self._keepalive_s = keepalive_s
        self._last_s = time.monotonic()  # last push or keep-alive
        self._timer: asyncio.TimerHandle | None = None
        self._idle = False  # the keep-alive timer found ``keepalive_s`` of silence

    def push(self, delta: SeqDelta) -> None:
        """Append one delta (never blocks); wakes the consumer if it waits."""
        self._items.append(delta)
        self._last_s = time.monotonic()
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def __len__(self) -> int:
        return len(self._items)

    async def take(self) -> list[SeqDelta]:
        """Every delta pushed since the last take (at least one), or ``[]`` after ``keepalive_s`` of
        silence. Raises ``CancelledError`` if the consumer is cancelled while waiting."""
        while not self._items:
            if self._idle:
                self._idle = False
                self._last_s = time.monotonic()
                return []
            loop = asyncio.get_running_loop()
            if self._keepalive_s is not None and self._timer is None:
                self._timer = loop.call_at(loop.time() + self._keepalive_s, self._on_timer)
            self._waiter = loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        return items

    def _on_timer(self) -> None:
        self._timer = None
        if self._waiter is None:  # nobody waits: the next take arms a fresh timer
            return
        silent = time.monotonic() - self._last_s
        if silent >= self._keepalive_s - 1e-3:  # event-loop timers may fire a little early
            self._idle = True
            if not self._waiter.done():
                self._waiter.set_result(None)
        else:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_at(loop.time() + self._keepalive_s - silent, self._on_timer)

    def close(self) -> None:
        """Stop the keep-alive timer (the consumer is done)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
