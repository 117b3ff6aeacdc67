"""Dead engines come back: a device whose engine process died (or, for a tensor-parallel group, any
of its ranks: the group goes down whole) is started again with backoff, unless it is crash-looping.

What a restart does. The dead processes are reaped and their sockets closed
(:meth:`DeviceEngine.stop_runner <node.runtime.engine.DeviceEngine.stop_runner>`), a fresh engine is
started for the same devices (:func:`~node.worker.engine_group.launch_engine`: forked from the node's
fork server on the CPU, spawned on CUDA, :mod:`node.worker.engine_start`; it loads the weights
again and allocates a new KV pool), and the device serves again on it
(:meth:`DeviceEngine.revive <node.runtime.engine.DeviceEngine.revive>`): a new block ledger (the old
prefix cache pointed into the dead pool), the layout of the role the device has (time-shared and
adaptive roles, a group's prefill/decode layout), the same role, batch limits and listeners, so the
drivers place work on it again and peers see its blocks in the node's capacity reports. Sequences
that were waiting for it to come back (no other device was up: :mod:`node.runtime.resume`) are
queued on it. Every attempt is counted (``shiftnode_engine_restarts_total{device}``).

Backoff and crash loops. The first restart of a device comes :data:`BACKOFF_S` after its death, and
each further one within ``--engine-restart-window-s`` waits twice as long as the one before (at most
:data:`BACKOFF_MAX_S`), as Kubernetes backs off a crashing container (10 s doubling to 5 min: an
engine reloads in seconds, so the steps here are shorter). A device restarted
``--engine-restart-max`` times within the window is left down: a start that fails (the weights no
longer load, the device is gone) or an engine that dies again at once would otherwise cycle for
ever. The count uses only restarts within the window, so a device that dies once a day is always
restarted, and leaves out a death caused by a request recomputed alone in quarantine
(:mod:`node.runtime.resume`): that request is failed, so the device is not crash-looping. A restart whose engine has not loaded within ``--engine-start-timeout-s`` is stopped and
counts as a failed start. vLLM and SGLang do not restart an engine (the server exits); here the other devices
keep serving meanwhile.

Honesty. While a device is down :meth:`describe` says since when, why, and when the next try is
(or that it is starting, or why it will not be restarted): ``/health`` and ``/v1/node`` show it
(:mod:`node.runtime.health`). Only an engine *process* death is restarted: a step loop that ended
by a bug in the node's own code leaves the device down, since a new engine would not fix it.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections import deque
from contextlib import suppress
from dataclasses import dataclass
from typing import Callable

import structlog

from node.config import NodeConfig, group_id
from node.runtime.engine import DeviceEngine
from node.worker.engine_group import launch_engine

log = structlog.get_logger("shiftnode.engine_supervisor")

BACKOFF_S = 1.0  # wait before a device's first restart within the window (s); doubles with each further one
BACKOFF_MAX_S = 60.0  # the longest wait between restarts (s)


def _drop_pool(runner) -> None:
    """Drop this process's mapping of a dead engine's KV pool (each rank's, for a group) before a new
    engine allocates its own: a GPU frees the dead process's memory only once no process maps it."""
    for handle in getattr(runner, "ranks", None) or [runner]:
        if getattr(handle, "kv_cache", None) is not None:
            handle.kv_cache = None
    gc.collect()


@dataclass
class Outage:
    """One device's time down: why, since when (monotonic and wall-clock s), and what happens next."""

    reason: str
    since_s: float
    since_wall_s: float
    next_try_s: float | None = None  # when the next restart starts (monotonic s); None: starting, or left down
    starting: bool = False  # a new engine is loading now
    left_down: str | None = None  # why it will not be restarted (crash loop, restarts off, not an engine death)


class EngineSupervisor:
    """Restarts the node's dead engines (see the module docstring).

    Args:
        config: the node's; gives ``engine_restart_max`` (K) and ``engine_restart_window_s`` (W).
        engines: the node's devices (one per group of ``config.device_groups()``).
        clock: monotonic seconds.
    """

    def __init__(self, config: NodeConfig, engines: list[DeviceEngine], clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.clock = clock
        self.max = config.engine_restart_max
        self.window_s = config.engine_restart_window_s
        self.devices = {group_id(g): g for g in config.device_groups()}
        self.outages: dict[str, Outage] = {}  # device id → its current outage (none while it is up)
        self.total: dict[str, int] = {}  # device id → restarts attempted since the node started
        self._recent: dict[str, deque[float]] = {}  # device id → start times of its restarts within the window
        self._tasks: dict[str, asyncio.Task] = {}
        self.restart_listeners: list[Callable[[DeviceEngine], None]] = []  # called once a device serves again
        self.left_down_listeners: list[Callable[[DeviceEngine], None]] = []  # called when a device is given up
        self.closed = False
        for e in engines:
            e.down_listeners.append(self._on_down)

    # --- decisions --------------------------------------------------------------------------------
    def recent(self, device_id: str) -> deque[float]:
        """Start times (monotonic s) of the device's restarts within the last ``--engine-restart-window-s``."""
        q = self._recent.setdefault(device_id, deque())
        while q and q[0] <= self.clock() - self.window_s:
            q.popleft()
        return q

    def why_not(self, engine: DeviceEngine) -> str | None:
        """Why ``engine``'s device, now down, would not be restarted; None when it will be."""
        cfg = self.config
        if self.closed:
            return "the node is stopping"
        if cfg.engine_layout == "thread":
            return "not restarted: the thread layout (--engine-layout thread) runs the engine in the node's process"
        if not getattr(engine, "engine_died", False):
            return "not restarted: its step loop ended in the node's own code (a bug); restart the node"
        if self.max == 0:
            return "not restarted: --engine-restart-max 0"
        n = len(self.recent(engine.device_id))
        if n >= self.max:
            return (f"left down: crash loop, restarted {n} times within {self.window_s:g} s "
                    f"(--engine-restart-max {self.max}, --engine-restart-window-s {self.window_s:g})")
        return None

    def will_restart(self, engine: DeviceEngine) -> bool:
        """Whether ``engine``'s device, now down, is to be started again (work may wait for it): its
        restart is planned or under way, or (just died, not yet planned) it is to be planned."""
        out = self.outages.get(engine.device_id)
        return out.left_down is None if out is not None else self.why_not(engine) is None

    def coming_back(self, device_id: str) -> bool:
        """Whether ``device_id`` is down and its restart is planned or under way (work may wait for it)."""
        out = self.outages.get(device_id)
        return out is not None and out.left_down is None

    # --- restarts ---------------------------------------------------------------------------------
    def _on_down(self, engine: DeviceEngine) -> None:
        """A device went down: plan its restart after the backoff, or leave it down and say why."""
        d = engine.device_id
        now = self.clock()
        prev = self.outages.get(d)  # a restart that failed continues the same outage
        out = Outage(engine.failure or "down", prev.since_s if prev else now, prev.since_wall_s if prev else time.time())
        self.outages[d] = out
        why = self.why_not(engine)
        if why is not None:
            out.left_down = why
            log.error("engine_left_down", device=d, reason=out.reason, why=why)
            self._notify(self.left_down_listeners, engine)
            return
        delay = min(BACKOFF_MAX_S, BACKOFF_S * 2 ** len(self.recent(d)))
        out.next_try_s = now + delay
        log.warning("engine_restart_planned", device=d, reason=out.reason, in_s=delay,
                    attempt=len(self.recent(d)) + 1, of=self.max)
        self._tasks[d] = asyncio.get_running_loop().create_task(self._restart(engine, delay), name=f"restart-{d}")

    async def _restart(self, engine: DeviceEngine, delay_s: float) -> None:
        d = engine.device_id
        loop = asyncio.get_running_loop()
        await asyncio.sleep(delay_s)
        out = self.outages[d]
        out.next_try_s, out.starting = None, True
        blamed = getattr(engine, "fatal_alone", False)
        engine.fatal_alone = False  # read once: a start that fails counts again
        if not blamed:  # a death a quarantined request caused is not a crash loop: that request is failed
            self.recent(d).append(self.clock())
        self.total[d] = self.total.get(d, 0) + 1
        log.warning("engine_restarting", device=d, attempt=len(self.recent(d)), of=self.max)
        runner = None
        try:
            await engine.stop_runner()  # the dead processes reaped, their sockets closed
            _drop_pool(engine.runner)
            runner = await loop.run_in_executor(None, launch_engine, self.config, self.devices[d])
            await self._wait_ready(runner)
            runner.attach(loop)
            await engine.revive(runner)
        except asyncio.CancelledError:
            if runner is not None and engine.runner is not runner:
                await loop.run_in_executor(None, runner.stop)
            raise
        except Exception as e:  # noqa: BLE001 - a start that fails is one more death of the device
            log.error("engine_restart_failed", device=d, error=f"{type(e).__name__}: {e}")
            if runner is not None and engine.runner is not runner:
                await loop.run_in_executor(None, runner.stop)
            engine.failure = f"restart failed: {type(e).__name__}: {e}"
            out.starting = False
            self._tasks.pop(d, None)
            self._on_down(engine)
            return
        self._tasks.pop(d, None)
        self.outages.pop(d, None)
        log.warning("engine_restarted", device=d, pid=engine.runner.pid, down_s=round(self.clock() - out.since_s, 3))
        self._notify(self.restart_listeners, engine)

    async def _wait_ready(self, runner) -> None:
        """Wait for a restarted engine to load, at most ``--engine-start-timeout-s`` (0: no bound).

        Raises:
            TimeoutError: it did not load in time. Its processes are stopped first (which also ends the
                thread blocked in ``wait_ready``), so a start that hangs (a stuck driver, a weights
                volume that stopped answering) is a failed start like any other, not a device
                reported as "restarting now" for ever.
        """
        loop = asyncio.get_running_loop()
        waiting = loop.run_in_executor(None, runner.wait_ready)
        limit = self.config.engine_start_timeout_s
        if not limit:
            await waiting
            return
        done, _ = await asyncio.wait({waiting}, timeout=limit)
        if done:
            waiting.result()
            return
        await loop.run_in_executor(None, runner.stop)
        with suppress(Exception):  # the stopped engine's wait ends with EngineDied: expected
            await waiting
        raise TimeoutError(f"the engine did not load within --engine-start-timeout-s {limit:g}")

    def _notify(self, listeners: list[Callable], engine: DeviceEngine) -> None:
        for listener in listeners:
            try:
                listener(engine)
            except Exception:  # noqa: BLE001 - an observer's bug must not stop restarts
                log.exception("supervisor_listener_failed", device=engine.device_id)

    async def close(self) -> None:
        """Stop planning restarts and cancel those under way (before the node stops its engines)."""
        self.closed = True
        for task in list(self._tasks.values()):
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()

    # --- reporting --------------------------------------------------------------------------------
    def describe(self, device_id: str, now: float) -> str | None:
        """What happens to a down device, for ``/health`` (``now``: monotonic s); None while it is up."""
        out = self.outages.get(device_id)
        if out is None:
            return None
        down = f"down for {now - out.since_s:.1f} s"
        if out.left_down:
            return f"{down}; {out.left_down}"
        attempt = len(self.recent(device_id)) + (0 if out.starting else 1)
        if out.starting:
            return f"{down}; restarting now (attempt {attempt} of {self.max} within {self.window_s:g} s)"
        return f"{down}; restart {attempt} of {self.max} in {max(0.0, out.next_try_s - now):.1f} s"

    def status(self, device_id: str, now: float) -> dict:
        """``restart`` of a device in ``GET /v1/node``: restarts so far and within the window, the limits,
        and the current outage (null while up): reason, since (wall-clock s), next try (in s), state."""
        out = self.outages.get(device_id)
        body = {"restarts": self.total.get(device_id, 0), "restarts_in_window": len(self.recent(device_id)),
                "max": self.max, "window_s": self.window_s,
                "start_timeout_s": self.config.engine_start_timeout_s, "outage": None}
        if out is not None:
            body["outage"] = {
                "reason": out.reason, "since_wall_s": out.since_wall_s, "down_s": round(now - out.since_s, 3),
                "state": "left_down" if out.left_down else "starting" if out.starting else "waiting",
                "next_try_in_s": None if out.next_try_s is None else round(max(0.0, out.next_try_s - now), 3),
                "detail": self.describe(device_id, now),
            }
        return body
