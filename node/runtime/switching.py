"""A device's role in time-shared mode and the reconfiguration that changes it.

A switch drains the step in flight, swaps the execution configuration (the role's
:class:`~node.core.role_config.RoleConfig`: step kind and batch limits; on CUDA the decode graphs; on a
time-shared tensor-parallel group the parallel layout, :mod:`node.worker.role_layouts`) and pays the
reconfiguration pause: the measured cost of the swap plus the configured floor ``--reconfig-pause-ms``
(which models heavier reconfigurations on any machine). Every switch is recorded with its timings and
reason.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass

from node.core.batcher import StepKind
from node.core.roles import Role

STALLED_STEP_S = float(os.environ.get("SHIFTNODE_STALLED_STEP_S", "120"))
"""A step in flight this long (s) marks its device stalled; ``$SHIFTNODE_STALLED_STEP_S``, read at
import, sets it (as vLLM's ``VLLM_ENGINE_ITERATION_TIMEOUT_S`` does its engine's). 120 s is far past
a GPU step and past the prefill steps of the models this node serves on a CPU, and soon enough for a
load balancer to stop routing to a node whose engines hang; a CPU node running a large model with
large prefill batches should raise it."""


_KIND = {Role.PREFILL: StepKind.PREFILL, Role.DECODE: StepKind.DECODE, Role.MIXED: StepKind.MIXED,
         Role.SWITCHING: None}
FREE = frozenset({Role.DECODE, Role.MIXED})  # one execution configuration: a switch between them costs nothing


@dataclass(frozen=True)
class SwitchRecord:
    """One completed switch. Times in seconds on the node's monotonic clock; durations in ms."""

    device: str
    start_s: float
    end_s: float
    from_role: str
    to_role: str
    drain_ms: float  # waiting for the step in flight
    swap_ms: float  # measured reconfiguration work
    pause_ms: float  # swap_ms + the configured floor
    reason: str

    def as_dict(self) -> dict:
        # the fields are flat: a shallow copy (dataclasses.asdict deep-copies: 9 µs a record against 0.3, and the
        # adaptive policy's free switches log two records per request)
        return dict(self.__dict__)


class SwitchAbandoned(RuntimeError):
    """A role switch that cannot finish: its device went down, or a step in flight never came back
    within ``STALLED_STEP_S``. The device keeps its previous role."""


class DeviceRole:
    """Role state of one device (``role`` is SWITCHING while a switch is under way)."""

    def __init__(self, device_id: str, role: Role, now_s: float, pause_floor_s: float, history: int = 1000):
        self.device_id = device_id
        self.role = role
        self.since_s = now_s
        self.switching_to: Role | None = None
        self.switch_started_s: float | None = None
        self.pause_floor_s = pause_floor_s
        self.records: deque[SwitchRecord] = deque(maxlen=history)
        self.count = 0
        self.pause_total_s = 0.0

    @property
    def step_kind(self) -> StepKind | None:
        """What a step may do in this role; ``None`` while switching (no step runs)."""
        return _KIND[self.role]

    @property
    def switch_done_est_s(self) -> float | None:
        if self.switch_started_s is None:
            return None
        return self.switch_started_s + self.pause_floor_s

    def begin(self, to_role: Role, now_s: float) -> Role:
        prev = self.role
        self.role, self.switching_to, self.switch_started_s = Role.SWITCHING, to_role, now_s
        return prev

    def switch_free(self, to_role: Role, now_s: float, reason: str) -> SwitchRecord:
        """Take ``to_role`` at once, between roles of the same configuration (DECODE and MIXED: :data:`FREE`):
        no drain, no swap, no pause. Recorded like any switch (zero durations), but ``since_s`` keeps the
        start of the decode configuration, which the policy's dwell counts from.

        Raises:
            ValueError: the device is switching, or the roles are not both in :data:`FREE`.
        """
        if self.role not in FREE or to_role not in FREE:
            raise ValueError(f"{self.device_id}: {self.role.value} -> {to_role.value} is not a free switch")
        record = SwitchRecord(self.device_id, now_s, now_s, self.role.value, to_role.value, 0.0, 0.0, 0.0, reason)
        self.role = to_role
        self.records.append(record)
        self.count += 1
        return record

    def finish(self, record: SwitchRecord) -> None:
        self.role = self.switching_to or self.role
        self.switching_to = self.switch_started_s = None
        self.since_s = record.end_s
        self.records.append(record)
        self.count += 1
        self.pause_total_s += record.pause_ms / 1e3
