"""Discrete-event simulator of shiftnode deployments, driving the node's own pure policy objects.

* time-shared — :class:`node.core.roles.RoleScheduler` and :class:`node.core.imbalance.ImbalancePolicy`
  over a :class:`node.core.batcher.Batcher` per device whose step kind follows its role
  (:mod:`bench.sim.timeshared`);
* colocated — :class:`node.core.batcher.Batcher` per device on a virtual clock (:mod:`bench.sim.batched`);
* pooled — :class:`node.core.pooled.PooledRouter` placing requests on prefill and decode devices
  (``Batcher`` each), KV transfers priced by :func:`node.plan.transfer_s` on per-link queues, inside
  a node or, with ``pool_scope="cluster"``, between nodes (:mod:`bench.sim.pooled`).

Step times come from a :class:`node.core.cost.CostModel` (linear; ``bench/cost/calibrate.py`` measures one)
or a :class:`node.core.roofline.RooflineCost` (bytes and FLOPs; ``bench/cost/derive_cost.py`` builds one for
a geometry from the H200 calibration), plus optional host overheads per step and per request
(:class:`SimConfig`);
With a :class:`bench.sim.parallel.ParallelModel` (a geometry on a hardware preset, e.g. H200 with
NVLink) as the cost model, each mode runs at tensor-parallel degrees (``SimConfig.decode_tp`` and
``prefill_tp``): time-shared groups that decode at ``D`` and prefill as ``D/P`` instances at ``P``,
colocated instances at ``T``, pooled prefill and decode instances at their own degrees, with the KV
each device's memory leaves beside its weight shard (:mod:`bench.sim.parallel`).
:mod:`bench.sim.run` splits requests over nodes and produces :mod:`bench.traffic.metrics` summaries, the same
ones the live replay prints. ``python -m bench.sim --help`` for the command line.
What the policies are told is what the live node gets (``SimConfig``, docs/adaptive.md "What the simulator
knows"): clients' ``max_tokens`` from a seeded mix (:mod:`bench.traffic.clients`) with EOS at the trace's
length, the node's own output estimate (:mod:`node.core.output_estimate`), a planning model refitted by the
node's code from the simulated steps or perturbed (:mod:`bench.sim.planning`), the decision rounds' CPU cost
on the node's loop (:mod:`bench.sim.control_cost` measures it), eager decode in tensor-parallel groups, and KV
copies at a share of the link's rate that slow the steps beside them; ``bench.sim.config.ORACLES`` restores
the oracles the simulator had before (``--oracles``).
:mod:`bench.sim.tuning` is the tuning protocol (each mode's best setting of its main knobs) that
``--tune`` and the studies follow. Imports :mod:`bench.traffic` and :mod:`bench.cost` (cost models).
"""

from bench.sim.config import MODES, SimAborted, SimConfig, kv_geometry
from bench.sim.run import SimResult, simulate, to_record

__all__ = ["MODES", "SimAborted", "SimConfig", "SimResult", "kv_geometry", "simulate", "to_record"]
