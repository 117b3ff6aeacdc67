"""Discrete-event simulator of shiftnode deployments, driving the node's own pure policy objects.

* time-shared — :class:`node.core.roles.RoleScheduler` on :class:`node.core.virtual.VirtualNode`
  (:mod:`bench.sim.timeshared`);
* colocated and pooled — :class:`node.core.batcher.Batcher` per device on a virtual clock, with KV
  transfers priced by :func:`node.plan.transfer_s` for pooled (:mod:`bench.sim.batched`).

Step times come from a :class:`node.core.cost.CostModel` (``bench/calibrate.py`` measures one);
:mod:`bench.sim.run` splits requests over nodes and produces :mod:`bench.metrics` summaries, the same
ones the live replay prints. ``python -m bench.sim --help`` for the command line.
"""

from bench.sim.config import MODES, SimConfig, kv_geometry
from bench.sim.run import SimResult, simulate, to_record

__all__ = ["MODES", "SimConfig", "SimResult", "kv_geometry", "simulate", "to_record"]
