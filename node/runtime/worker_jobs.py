"""Jobs for a device's worker thread that must not race its steps: a part of
:class:`node.runtime.engine.DeviceEngine` (its ``jobs``).

A peer transfer's KV gather or scatter reads or writes the device's pool from the node's process, so it
runs on the device's one worker thread at a point where no step is in flight; the step loop gives the
queued jobs that point (:meth:`WorkerJobs.run_queued`) once the steps in flight have ended.
"""

from __future__ import annotations

import asyncio
from collections import deque
from concurrent.futures import Executor
from typing import Callable

from node.transport.errors import DeviceDown


def _nothing() -> None:
    return None


class WorkerJobs:
    """The queue of ``in_worker`` jobs of one device, in order with its steps.

    Args:
        device_id: the device's name (errors).
        executor: the device's one worker thread (the jobs run there, one after another).
        down: returns why the device is down, else None (a down device takes no job).
        wake: wakes the step loop (a job was queued).
    """

    def __init__(self, device_id: str, executor: Executor, down: Callable[[], str | None], wake: Callable[[], None]):
        self._device_id, self._executor, self._down, self._wake = device_id, executor, down, wake
        self._queued: deque[tuple[Callable, tuple, asyncio.Future]] = deque()

    @property
    def queued(self) -> bool:
        """Jobs wait for the worker (the step loop lets the steps in flight end, then runs them)."""
        return bool(self._queued)

    def submit(self, fn: Callable, *args) -> asyncio.Future:
        """Run ``fn(*args)`` on the worker thread at the next point where no step is in flight, in order
        with the steps (a KV gather or scatter for a transfer must not race a step writing the same pool).
        The future resolves to its result, or fails with its error, or with
        :class:`~node.transport.errors.DeviceDown` (a ``RuntimeError``) if the device is (or goes) down
        before it runs."""
        fut = asyncio.get_running_loop().create_future()
        failure = self._down()
        if failure is not None:
            fut.set_exception(DeviceDown(f"device {self._device_id} is down: {failure}"))
            return fut
        self._queued.append((fn, args, fut))
        self._wake()
        return fut

    def after_queued(self, then: Callable[[], None]) -> asyncio.Future:
        """Call ``then()`` on the event loop once every job queued now has ended (or at once, from the
        next turn of the loop, if the device is down): e.g. free blocks a queued gather still reads.
        A down device's failure of the marker job is taken here, not left on the future: callers
        (``free_pinned``) drop it, and an unretrieved failure is logged by asyncio as an error."""
        fut = self.submit(_nothing)

        def done(f: asyncio.Future) -> None:
            if not f.cancelled():
                f.exception()  # retrieved: the device died; ``then`` runs all the same
            then()

        fut.add_done_callback(done)
        return fut

    async def run_queued(self) -> None:
        """Run the queued jobs on the worker thread, in order (call with no step in flight)."""
        loop = asyncio.get_running_loop()
        while self._queued:
            fn, args, fut = self._queued.popleft()
            try:
                result = await loop.run_in_executor(self._executor, fn, *args)
            except Exception as e:  # noqa: BLE001 - the job's caller gets its own failure
                if not fut.done():
                    fut.set_exception(e)
                continue
            if not fut.done():
                fut.set_result(result)

    def fail_queued(self) -> None:
        """Fail the queued jobs with :class:`~node.transport.errors.DeviceDown` (the device is down: none will run)."""
        while self._queued:
            _fn, _args, fut = self._queued.popleft()
            if not fut.done():
                fut.set_exception(DeviceDown(f"device {self._device_id} is down: {self._down()}"))
