"""The one queue between a device's step and the HTTP handler that streams its tokens.

A step's post-processing pushes each sequence's :class:`~node.runtime.output.SeqDelta` here. A
consumer takes everything pushed since it last looked, in one batch, in one of two ways:

* :meth:`DeltaStream.take` (await): an API handler of a non-streamed request, :meth:`Node.generate`.
* :meth:`DeltaStream.consume` (a plain callback): a streaming handler. The first push after a
  delivery schedules one ``loop.call_soon``; the callback then gets every delta pushed meanwhile (a
  whole step's, however many sequences of the request it ran) and writes its SSE events at once. No
  task wakes per step and no coroutine runs per write: at 256 streams that hand-off was a task switch
  and two coroutine frames per stream per step on the node's one event loop.

The keep-alive is one lazy timer per stream, not one per wait: it fires every ``keepalive_s`` and
re-arms itself while deltas flow, so in steady decode the timer costs nothing per token.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from node.runtime.output import SeqDelta


class DeltaStream:
    """Deltas of one consumer, in production order, taken in batches.

    Args:
        keepalive_s: after this long (s) with nothing pushed, a waiting :meth:`take` returns ``[]``
            (the caller sends a keep-alive), or a :meth:`consume` callback gets ``[]``; ``None``
            never does.
    """

    __slots__ = ("_items", "_waiter", "_keepalive_s", "_last_s", "_timer", "_idle", "_consumer", "_loop",
                 "_scheduled")

    def __init__(self, keepalive_s: float | None = None):
        self._items: list[SeqDelta] = []
        self._waiter: asyncio.Future | None = None
        self._keepalive_s = keepalive_s
        self._last_s = time.monotonic()  # last push or keep-alive
        self._timer: asyncio.TimerHandle | None = None
        self._idle = False  # the keep-alive timer found ``keepalive_s`` of silence
        self._consumer: Callable[[list[SeqDelta]], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scheduled = False  # a delivery to the consumer is queued on the loop

    def push(self, delta: SeqDelta) -> None:
        """Append one delta (never blocks); wakes the consumer if it waits. Call on the event loop."""
        self._items.append(delta)
        self._last_s = time.monotonic()
        if self._consumer is not None:
            if not self._scheduled:
                self._scheduled = True
                self._loop.call_soon(self._deliver)
            return
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

    def consume(self, callback: Callable[[list[SeqDelta]], None]) -> None:
        """From now on hand every batch to ``callback`` on the running loop (instead of :meth:`take`):
        deltas already here go in the first call; ``[]`` means ``keepalive_s`` of silence. The callback
        must not raise (it runs as a loop callback: an exception would only be logged) and is called
        until :meth:`close`."""
        self._consumer = callback
        self._loop = asyncio.get_running_loop()
        if self._keepalive_s is not None and self._timer is None:
            self._timer = self._loop.call_at(self._loop.time() + self._keepalive_s, self._on_timer)
        if self._items and not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._deliver)

    def _deliver(self) -> None:
        self._scheduled = False
        items, self._items = self._items, []
        if items and self._consumer is not None:
            self._consumer(items)

    def _on_timer(self) -> None:
        self._timer = None
        if self._waiter is None and self._consumer is None:  # nobody waits: the next take arms a fresh timer
            return
        silent = time.monotonic() - self._last_s
        loop = asyncio.get_running_loop()
        if silent >= self._keepalive_s - 1e-3:  # event-loop timers may fire a little early
            if self._consumer is not None:
                self._last_s = time.monotonic()
                self._timer = loop.call_at(loop.time() + self._keepalive_s, self._on_timer)
                self._consumer([])
                return
            self._idle = True
            if not self._waiter.done():
                self._waiter.set_result(None)
        else:
            self._timer = loop.call_at(loop.time() + self._keepalive_s - silent, self._on_timer)

    def close(self) -> None:
        """Stop the keep-alive timer and any consumer callback (the consumer is done)."""
        self._consumer = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
