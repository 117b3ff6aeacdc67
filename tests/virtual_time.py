"""An asyncio event loop on a virtual clock, for tests of code that waits on timers (asyncio.sleep,
asyncio.timeout): when nothing is ready, the clock jumps to the next timer instead of the test sleeping.
A wait of 60 s takes microseconds, and what a test asserts about timing cannot depend on how loaded the
machine is.

Only for code whose every wait is a timer or another task of the same loop: no sockets, no executor
threads (their results arrive through the loop's self-pipe, in real time, which this clock does not see).
"""

from __future__ import annotations

import asyncio
import selectors
from typing import Any, Coroutine


class _JumpingSelector(selectors.DefaultSelector):
    """Polls without blocking; a wait that would block moves the loop's virtual clock forward instead."""

    def __init__(self, loop: "VirtualTimeLoop"):
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None):
        ready = super().select(0)
        if ready or timeout is None or timeout <= 0:
            if not ready and timeout is None:
                # nothing ready and no timer to wait for: in real time this loop would hang for ever
                raise RuntimeError("virtual-time loop: every task waits and no timer is set (a deadlock)")
            return ready
        self._loop.advance(timeout)
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """A selector event loop whose ``time()`` (seconds) starts at 0 and moves only by :meth:`advance`,
    which the loop calls itself whenever it would otherwise wait for its next timer."""

    def __init__(self) -> None:
        self._now = 0.0
        super().__init__(_JumpingSelector(self))

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        """Move the clock forward by ``seconds`` (>= 0)."""
        assert seconds >= 0, seconds
        self._now += seconds


def run_virtual(main: Coroutine[Any, Any, Any]) -> Any:
    """``asyncio.run(main)`` on a :class:`VirtualTimeLoop`; returns ``main``'s result."""
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(main)
