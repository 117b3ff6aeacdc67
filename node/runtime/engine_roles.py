"""Role switching of one device (time-shared and adaptive modes): the role half of
:class:`node.runtime.engine.DeviceEngine` (a mixin over the engine's state).

A switch between DECODE and MIXED is free (one configuration, :meth:`RoleSwitching.switch_free`); a switch
to or from PREFILL drains the steps in flight, reconfigures the runner on the device's worker thread and
pays the measured pause (:meth:`RoleSwitching.switch_role`). Each role's batch limits come from its
:class:`~node.core.role_config.RoleConfig` (:meth:`RoleSwitching.configure_roles`).
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace

import structlog

from node.core.batcher import BatchConfig
from node.core.role_config import RoleConfig
from node.core.roles import Role
from node.log import request_lines
from node.runtime.switching import STALLED_STEP_S
from node.runtime.switching import SwitchAbandoned, SwitchRecord
from node.worker.engine_process import EngineDied

log = structlog.get_logger("shiftnode.engine")


class RoleSwitching:
    """The role switches of a :class:`~node.runtime.engine.DeviceEngine` (which holds the state these
    methods read: ``role``, ``batcher``, ``runner``, ``clock``, ``_idle``, ``_executor``, ``failure``)."""

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
            self.batcher.config = self._role_batch[self.role.role]

    @property
    def active_config(self) -> RoleConfig | None:
        """The configuration of the role the device is in (None while switching, or outside time-shared mode)."""
        return self.role_configs.get(self.role.role) if self.role is not None else None

    def set_chunk_budget(self, tokens: int) -> None:
        """Prompt tokens each MIXED step may take from now on (the adaptive policy's online budget)."""
        if tokens != self.chunk_tokens:
            self.chunk_tokens = tokens
            self.wake()

    def switch_free(self, to_role: Role, reason: str) -> SwitchRecord:
        """Switch between DECODE and MIXED (one configuration) at once, between steps: no drain, no
        pause (:meth:`DeviceRole.switch_free <node.runtime.switching.DeviceRole.switch_free>`); the next
        step planned is of the new kind. In the role's timeline at once; logged and reported to the
        switch listeners like any switch, from the next turn of the event loop.

        Raises:
            ValueError: not a switch between DECODE and MIXED.
        """
        assert self.role is not None, "role switches exist in adaptive and time-shared modes only"
        record = self.role.switch_free(to_role, self.clock(), reason)
        if to_role in self._role_batch:
            self.batcher.config = self._role_batch[to_role]
        self.wake()
        # The log line and the listeners (metrics) follow the step this switch opens: they cost ~0.1 ms
        # of a CPU node's loop, on the way from a prompt's arrival to its first step (the adaptive
        # policy makes two free switches per request). The record is in the role's timeline already.
        try:
            asyncio.get_running_loop().call_soon(self._report_free_switch, record)
        except RuntimeError:  # no loop running (a caller outside the node): report now
            self._report_free_switch(record)
        return record

    def _report_free_switch(self, record: SwitchRecord) -> None:
        if request_lines():  # per-switch lines: --log-requests (node.log)
            log.info("role_switch", **record.as_dict())
        self._notify(self.switch_listeners, record)

    async def switch_role(self, to_role: Role, reason: str) -> SwitchRecord:
        """Drain the step in flight, reconfigure for ``to_role`` and pay the pause; then take the role."""
        assert self.role is not None, "role switches exist in time-shared mode only"
        start = self.clock()
        prev = self.role.begin(to_role, start)
        try:  # bounded: a step that never returns marks the device stalled after as long (health.py)
            async with asyncio.timeout(STALLED_STEP_S):
                await self._idle.wait()
        except TimeoutError:
            pass  # the device may yet answer: /health reports it stalled, not down
        if self.failure is not None or not self._idle.is_set():
            self.role.role, self.role.switching_to, self.role.switch_started_s = prev, None, None
            why = f"down: {self.failure}" if self.failure else f"stalled: a step has run for {STALLED_STEP_S:g} s"
            raise SwitchAbandoned(f"switch of {self.device_id} to {to_role.value} abandoned: the device is {why}")
        drained = self.clock()
        try:
            await asyncio.get_running_loop().run_in_executor(self._executor, self.reconfigure, to_role)
        except Exception as e:  # noqa: BLE001 - the role still changes (its steps run in the layout the ranks are in)
            if isinstance(e, EngineDied):  # the device is down: its step loop reports it (no traceback here)
                log.info("reconfigure_skipped", device=self.device_id, to_role=to_role.value, reason=str(e))
            elif not self.runner.stopping:  # (a switch the node's closing cut short is no error)
                self.errors["reconfigure"] = self.errors.get("reconfigure", 0) + 1
                log.error("reconfigure_failed", device=self.device_id, to_role=to_role.value, error=str(e), exc_info=e)
        if to_role in self._role_batch:
            self.batcher.config = self._role_batch[to_role]
        swap_s = self.clock() - drained
        deadline = self.clock() + self.role.pause_floor_s
        while (left := deadline - self.clock()) > 0:  # event-loop timers may fire a little early
            await asyncio.sleep(left)
        end = self.clock()
        record = SwitchRecord(self.device_id, start, end, prev.value, to_role.value, round((drained - start) * 1e3, 3),
                              round(swap_s * 1e3, 3), round((swap_s + self.role.pause_floor_s) * 1e3, 3), reason)
        self.role.finish(record)
        if request_lines():
            log.info("role_switch", **record.as_dict())
        self._notify(self.switch_listeners, record)
        self.wake()
        return record

    def reconfigure(self, to_role: Role) -> None:
        """Swap the execution configuration (runs in the worker thread; its time is the switch's swap
        time). The step kind and the batch limits come from the role (:meth:`configure_roles`); a
        tensor-parallel group's ranks switch layout (degree, weight views, KV heads, then a barrier:
        :meth:`GroupLayouts.activate <node.worker.role_layouts.GroupLayouts.activate>`); the decode role
        also needs the runner's CUDA graphs, captured at start-up (``prepare_decode`` then only
        captures what a failed or skipped start-up capture left; a no-op without graphs)."""
        if self.runner.stopping:  # the node is closing: nothing will run in the new role
            return
        set_role = getattr(self.runner, "set_role", None)
        if set_role is not None and to_role in self.role_configs:
            set_role(to_role.value)
        if to_role is Role.DECODE:
            self.runner.prepare_decode()
