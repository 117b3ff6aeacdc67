"""The node's view of each device's compiled buckets, kept current while they compile in the background.

An engine compiling its buckets in the background (:mod:`node.worker.background_compile`) reports its
:class:`~node.worker.background_compile.CompileState` in ``Ready`` and, when it changed, in the next
step's reply; the device engine then calls its ``compile_listeners``. An idle device has no step to bring
the news, so :class:`CompileWatch` asks (a ``CompileStatus`` request, answered between steps) every
:data:`POLL_S` while a device has buckets pending and no step in flight, and calls the same listeners
with the answer. ``GET /v1/node`` shows :meth:`CompileWatch.state` per device (``compile``); the role
driver listens to restart its cost model's refit from the faster steps (:mod:`node.runtime.role_driver`).
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog

from node.worker.background_compile import CompileState
from node.worker.engine_messages import CompileReply, CompileStatus

log = structlog.get_logger("shiftnode.compile")

POLL_S = 1.0
"""Seconds between the polls of an idle device whose buckets are compiling (a bucket takes seconds to
minutes; a poll is one small request answered between steps)."""


class CompileWatch:
    """Each device's latest :class:`CompileState`, and the poll of idle compiling devices (module doc).

    Args:
        engines: the node's device engines (:class:`~node.runtime.engine.DeviceEngine`); each one's engine
            handle (``runner``) has ``compile_state`` (from its ``Ready``; None, or no such attribute: eager).
    """

    def __init__(self, engines: list[Any]):
        self.engines = engines
        self._latest: dict[str, tuple[Any, CompileState | None]] = {}  # device → (engine handle, its state)
        self._task: asyncio.Task | None = None
        for e in engines:
            e.compile_listeners.append(self._on_state)

    def state(self, engine: Any) -> CompileState | None:
        """``engine``'s compiled buckets as last heard; a restarted engine's (a new handle) from its ``Ready``."""
        handle, state = self._latest.get(engine.device_id, (None, None))
        if handle is not engine.runner:
            state = getattr(engine.runner, "compile_state", None)
            self._latest[engine.device_id] = (engine.runner, state)
        return state

    def status(self, engine: Any) -> dict | None:
        """``GET /v1/node``'s ``compile`` of ``engine``: the state with its ``pending`` buckets, or None (eager)."""
        s = self.state(engine)
        if s is None:
            return None
        return {"state": s.state, "buckets": s.buckets, "compiled": s.compiled, "pending": s.pending,
                "failed": s.failed, "error": s.error, "background": s.background,
                "bucket_ms": {str(k): v for k, v in s.bucket_ms.items()}, "cache_dir": s.cache_dir}

    def _on_state(self, engine: Any, state: CompileState) -> None:
        before = self.state(engine)
        self._latest[engine.device_id] = (engine.runner, state)
        new = sorted(set(state.compiled) - set(before.compiled if before is not None else ()))
        if new:
            log.info("buckets_compiled", device=engine.device_id, buckets=new, pending=state.pending, state=state.state)

    def start(self) -> None:
        """Start the poll on the running loop (when a device compiles at all); :meth:`stop` ends it."""
        if self._task is None and any(getattr(e.runner, "compile_state", None) is not None for e in self.engines):
            self._task = asyncio.get_running_loop().create_task(self._poll(), name="compile-watch")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    @staticmethod
    def _tell(engine: Any, state: CompileState) -> None:
        for listener in list(engine.compile_listeners):
            listener(engine, state)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            for e in self.engines:
                handle, _ = self._latest.get(e.device_id, (None, None))
                state = self.state(e)
                if handle is not None and handle is not e.runner and state is not None:
                    self._tell(e, state)  # a restarted engine compiles again: its steps are eager for now
                # a step in flight brings the state with its reply; a device down or restarting has no engine to ask
                if (state is None or state.state != "compiling" or e.step_started_s is not None
                        or e.failure is not None or not hasattr(e.runner, "async_submit")):
                    continue
                try:
                    reply = await e.runner.async_submit(CompileStatus())
                except Exception as err:  # noqa: BLE001 - the engine died or failed: its step loop sees it too
                    log.debug("compile_status_failed", device=e.device_id, error=f"{type(err).__name__}: {err}")
                    continue
                if isinstance(reply, CompileReply) and reply.state is not None and reply.state != self.state(e):
                    self._tell(e, reply.state)
