"""Role switching of one device (time-shared and adaptive modes): a part of
:class:`node.runtime.engine.DeviceEngine` that owns the device's role and each role's configuration.

A switch between DECODE and MIXED is free (one configuration, :meth:`RoleSwitcher.switch_free`); a switch
to or from PREFILL drains the steps in flight, reconfigures the runner on the device's worker thread and
pays the measured pause (:meth:`RoleSwitcher.switch_role`). Each role's batch limits come from its
:class:`~node.core.role_config.RoleConfig` (:meth:`RoleSwitcher.configure_roles`). The step loop asks this
part what to plan (:meth:`RoleSwitcher.step_kind`, :meth:`RoleSwitcher.chunk_budget`) and how to split a
prefill step across instances (:meth:`RoleSwitcher.split_prefill`).
"""

from __future__ import annotations

import asyncio
import random
from concurrent.futures import Executor
from dataclasses import replace
from typing import Any, Callable

import structlog

from node.core.batcher import BatchConfig, Batcher, StepKind, StepPlan
from node.core.role_config import RoleConfig, assign_instances, scatter_bytes, shared_block_units
from node.core.roles import Role
from node.log import request_lines
from node.runtime.switching import STALLED_STEP_S, DeviceRole, SwitchAbandoned, SwitchRecord
from node.worker.engine_core import StepMsg
from node.worker.engine_process import EngineDied

log = structlog.get_logger("shiftnode.engine")


class RoleSwitcher:
    """The role of one device and its switches.

    Args:
        device_id: the device's name (log lines, switch records).
        role: the device's role state; ``None`` runs MIXED steps (colocated: no switches).
        batcher: the device's batch former, whose limits (``config``) follow the active role.
        clock: monotonic seconds.
        runner: returns the device's engine now (a revive replaces it): reconfigured on a switch.
        executor: the device's one worker thread (a reconfiguration runs there, after the drain).
        idle: set while no step is in flight (the drain waits for it).
        failure: returns why the device is down, else None (a switch of a down device is abandoned).
        wake: wakes the step loop (the next step is of the new kind).
        on_switch: reports a switch's record (log and listeners are the engine's).
        on_error: counts a contained failure by stage (``"reconfigure"``).
    """

    def __init__(self, device_id: str, role: DeviceRole | None, batcher: Batcher, clock: Callable[[], float],
                 runner: Callable[[], Any], executor: Executor, idle: asyncio.Event,
                 failure: Callable[[], str | None], wake: Callable[[], None],
                 on_switch: Callable[[SwitchRecord], None], on_error: Callable[[str], None]):
        self.device_id = device_id
        self.role = role  # None: colocated (every step is MIXED)
        self._batcher, self._clock, self._runner, self._executor = batcher, clock, runner, executor
        self._idle, self._failure, self._wake, self._on_switch, self._on_error = idle, failure, wake, on_switch, on_error
        self.role_configs: dict[Role, RoleConfig] = {}  # time-shared: each role's configuration (configure_roles)
        self._role_batch: dict[Role, BatchConfig] = {}
        self._kv_bytes_per_token = 0
        self._rng = random.Random(0)  # seeds of composite steps (StepMsg.rng_seed)
        self.kv_scatter_bytes = 0  # KV written into other devices' pools by prefill instances (role_layouts)
        self.chunk_tokens = 0  # adaptive mode: prompt tokens a MIXED step may take (the policy's chunk budget)

    def configure_roles(self, configs: dict[Role, RoleConfig], base: BatchConfig, kv_bytes_per_token: int,
                        seed: int = 0) -> None:
        """Give each role its configuration (time-shared mode): the batcher's limits follow the
        active role from now on (a prefill role of several instances plans ``token_budget`` per
        instance and at most that per sequence, :class:`RoleConfig`); ``kv_bytes_per_token``: the
        model's whole-KV bytes per token (for :attr:`kv_scatter_bytes`)."""
        self.role_configs = dict(configs)
        self._role_batch = {r: replace(base, max_batched_tokens=c.step_budget, max_item_tokens=c.item_cap)
                            if r is Role.PREFILL else base for r, c in configs.items()}
        self._kv_bytes_per_token = kv_bytes_per_token
        self._rng = random.Random(seed)
        if self.role is not None and self.role.role in self._role_batch:
            self._batcher.config = self._role_batch[self.role.role]

    @property
    def active_config(self) -> RoleConfig | None:
        """The configuration of the role the device is in (None while switching, or outside time-shared mode)."""
        return self.role_configs.get(self.role.role) if self.role is not None else None

    def step_kind(self) -> StepKind | None:
        """The kind of step the device runs now: MIXED when colocated, else its role's (None while switching)."""
        return StepKind.MIXED if self.role is None else self.role.step_kind

    def chunk_budget(self, kind: StepKind | None) -> int | None:
        """Prompt tokens a step of ``kind`` may take: the adaptive policy's budget for its MIXED role,
        None (the batcher's own limits) otherwise."""
        return self.chunk_tokens if self.role is not None and kind is StepKind.MIXED else None

    def split_prefill(self, plan: StepPlan, msg: StepMsg) -> None:
        """Spread a prefill step of a role of several instances over them (``msg.instances``,
        ``msg.rng_seed``) and count the KV its instances scatter into other pools. A group whose
        switch failed runs in the layout it is in (``active_role``; getattr: only a group has one)."""
        rc = self.active_config
        if (rc is None or rc.instances <= 1 or plan.kind is not StepKind.PREFILL
                or getattr(self._runner(), "active_role", None) != "prefill"):
            return
        # a sequence reading a block another item writes now (a prefix hit registered this step) goes with it
        units = shared_block_units([(it.seq.block_ids, m.start, m.num_tokens) for it, m in zip(plan.items, msg.items)],
                                   self._batcher.ledger.block_size)
        msg.instances = assign_instances([it.num_tokens for it in plan.items], rc.instances, units)
        msg.rng_seed = self._rng.getrandbits(62)
        self.kv_scatter_bytes += scatter_bytes(plan.num_tokens, self._kv_bytes_per_token, rc.tp_degree, rc.group_size)

    def set_chunk_budget(self, tokens: int) -> None:
        """Prompt tokens each MIXED step may take from now on (the adaptive policy's online budget)."""
        if tokens != self.chunk_tokens:
            self.chunk_tokens = tokens
            self._wake()

    def switch_free(self, to_role: Role, reason: str) -> SwitchRecord:
        """Switch between DECODE and MIXED (one configuration) at once, between steps: no drain, no
        pause (:meth:`DeviceRole.switch_free <node.runtime.switching.DeviceRole.switch_free>`); the next
        step planned is of the new kind. In the role's timeline at once; logged and reported to the
        switch listeners like any switch, from the next turn of the event loop.

        Raises:
            ValueError: not a switch between DECODE and MIXED.
        """
        assert self.role is not None, "role switches exist in adaptive and time-shared modes only"
        record = self.role.switch_free(to_role, self._clock(), reason)
        if to_role in self._role_batch:
            self._batcher.config = self._role_batch[to_role]
        self._wake()
        # The log line and the listeners (metrics) follow the step this switch opens: they cost ~0.1 ms
        # of a CPU node's loop, on the way from a prompt's arrival to its first step (the adaptive
        # policy makes two free switches per request). The record is in the role's timeline already.
        try:
            asyncio.get_running_loop().call_soon(self._report, record)
        except RuntimeError:  # no loop running (a caller outside the node): report now
            self._report(record)
        return record

    def _report(self, record: SwitchRecord) -> None:
        if request_lines():  # per-switch lines: --log-requests (node.log)
            log.info("role_switch", **record.as_dict())
        self._on_switch(record)

    async def switch_role(self, to_role: Role, reason: str) -> SwitchRecord:
        """Drain the step in flight, reconfigure for ``to_role`` and pay the pause; then take the role.

        Raises:
            SwitchAbandoned: the device went down, or a step in flight ran past ``STALLED_STEP_S``.
        """
        assert self.role is not None, "role switches exist in time-shared mode only"
        clock = self._clock
        start = clock()
        prev = self.role.begin(to_role, start)
        try:  # bounded: a step that never returns marks the device stalled after as long (health.py)
            async with asyncio.timeout(STALLED_STEP_S):
                await self._idle.wait()
        except TimeoutError:
            pass  # the device may yet answer: /health reports it stalled, not down
        failure = self._failure()
        if failure is not None or not self._idle.is_set():
            self.role.role, self.role.switching_to, self.role.switch_started_s = prev, None, None
            why = f"down: {failure}" if failure else f"stalled: a step has run for {STALLED_STEP_S:g} s"
            raise SwitchAbandoned(f"switch of {self.device_id} to {to_role.value} abandoned: the device is {why}")
        drained = clock()
        try:
            await asyncio.get_running_loop().run_in_executor(self._executor, self.reconfigure, to_role)
        except Exception as e:  # noqa: BLE001 - the role still changes (its steps run in the layout the ranks are in)
            if isinstance(e, EngineDied):  # the device is down: its step loop reports it (no traceback here)
                log.info("reconfigure_skipped", device=self.device_id, to_role=to_role.value, reason=str(e))
            elif not self._runner().stopping:  # (a switch the node's closing cut short is no error)
                self._on_error("reconfigure")
                log.error("reconfigure_failed", device=self.device_id, to_role=to_role.value, error=str(e), exc_info=e)
        if to_role in self._role_batch:
            self._batcher.config = self._role_batch[to_role]
        swap_s = clock() - drained
        deadline = clock() + self.role.pause_floor_s
        while (left := deadline - clock()) > 0:  # event-loop timers may fire a little early
            await asyncio.sleep(left)
        end = clock()
        record = SwitchRecord(self.device_id, start, end, prev.value, to_role.value, round((drained - start) * 1e3, 3),
                              round(swap_s * 1e3, 3), round((swap_s + self.role.pause_floor_s) * 1e3, 3), reason)
        self.role.finish(record)
        if request_lines():
            log.info("role_switch", **record.as_dict())
        self._on_switch(record)
        self._wake()
        return record

    def reconfigure(self, to_role: Role) -> None:
        """Swap the execution configuration (runs in the worker thread; its time is the switch's swap
        time). The step kind and the batch limits come from the role (:meth:`configure_roles`); a
        tensor-parallel group's ranks switch layout (degree, weight views, KV heads, then a barrier:
        :meth:`GroupLayouts.activate <node.worker.role_layouts.GroupLayouts.activate>`); the decode role
        also needs the runner's CUDA graphs, captured at start-up (``prepare_decode`` then only
        captures what a failed or skipped start-up capture left; a no-op without graphs)."""
        runner = self._runner()
        if runner.stopping:  # the node is closing: nothing will run in the new role
            return
        set_role = getattr(runner, "set_role", None)
        if set_role is not None and to_role in self.role_configs:
            set_role(to_role.value)
        if to_role is Role.DECODE:
            runner.prepare_decode()

    def revived_role(self) -> Role | None:
        """The role a fresh engine must take the layout of: the role being taken in a switch's pause,
        else the role held; None when colocated."""
        if self.role is None:
            return None
        return self.role.switching_to or self.role.role
