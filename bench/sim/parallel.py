"""Tensor-parallel deployments in the simulator: step costs at any degree from one per-device model,
device memory per role layout, and each mode lowered onto the simulator's (virtual) devices.

A :class:`ParallelModel` is a model geometry on a hardware preset (:data:`bench.cost.derive_cost.H200_NVLINK`).
Passed to :func:`bench.sim.run.simulate` as the cost model, it turns a :class:`SimConfig` with degrees
(``decode_tp``, ``prefill_tp``) into what the simulator runs, on the live Batcher, ledger and policies:

* **time-shared** — ``devices / D`` groups of ``D = decode_tp`` devices, each ONE simulated device
  (one Batcher, one BlockLedger: block ids are group-wide, every device holds ``K/D`` heads of every
  block) under the live RoleScheduler. DECODE steps cost the degree-``D`` model; a PREFILL step runs
  ``D/P`` instances at ``P = prefill_tp`` side by side with ``BatchConfig(max_batched_tokens =
  token_budget x D/P, max_item_tokens = token_budget)`` (``RoleConfig.step_budget`` / ``item_cap`` of
  :func:`node.core.role_config.time_shared_roles`), items spread by ``assign_instances``, the step the
  longest instance plus its KV scatter (:class:`node.core.group_cost.GroupCost`). The policy's prefill
  budget is the group step's (:func:`node.core.group_cost.group_policy`, as the live node's). Moves of the imbalance fallback copy every device's share at once: the
  group's link is ``D x link_gbps``.
* **colocated** — ``devices / T`` instances at ``T = decode_tp``, MIXED steps at degree ``T``.
* **decode graphs** — an instance of degree above 1 (time-shared group, colocated or pooled decode instance)
  decodes eagerly (``max_graph_batch`` 0): the live node captures decode CUDA graphs for one-device
  instances only (``node.core.role_config``). ``SimConfig.group_decode_graphs`` gives groups graphs (the
  oracle the simulator had before issue 43).
* **pooled** (node scope) — ``prefill_devices / P`` prefill instances at ``P`` and ``(devices -
  prefill_devices) / D`` decode instances at ``D``; a hand-off moves the whole KV, each of
  ``min(P, D)`` devices sending (or receiving) its share over its own link: ``min(P, D) x link_gbps``.

Memory (:meth:`ParallelModel.kv_room_bytes`), per device, bytes: ``HBM x utilization - weights / W -
activations``, ``W`` the degree whose weight shard the device holds: time-shared ``P`` (its degree-``D``
shard is a view inside its prefill shard, :mod:`node.core.role_config`), colocated ``T``, pooled ``P``
on prefill devices and ``D`` on decode ones. ``weights`` = every parameter (embeddings included: the
node shards the vocabulary too) x dtype bytes. ``activations`` (an estimate of one step's largest live
tensors, not measured): ``tokens x (2 hidden + (2 q + 2 kv + 2 ffn) / W) x dtype_bytes + rows x vocab /
W x 4`` (residual and normed hidden, QKV and attention output, gate and up, fp32 logits of
``max_num_seqs`` rows of the instance), ``tokens`` the step budget (pooled decode instances: their
``max_num_seqs``, one token per sequence). An instance of degree ``I`` then holds ``I x room /
(block_size x kv_bytes_per_token)`` blocks (``kv_bytes_per_token`` of the whole model; one KV head per
device at most ``kv_heads`` ways). A layout whose room is not positive is refused
(:class:`DoesNotFit`): Llama-3-70B in bf16 (141 GB of weights) at ``P = 1`` on an H200.

A switch's pause stays the existing model (the cost model's ``pause_s``, 0.1 ms, and the configured
floors): changing degree on the live node swaps weight views without copies and its NCCL
communicators are made at start-up, so no measured reconfiguration cost exists to add.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import msgspec

from bench.cost.derive_cost import H200_NVLINK, HardwarePreset, derive_at
from bench.sim.config import SimConfig
from node.core.group_cost import GroupCost, group_policy
from node.core.role_config import time_shared_roles
from node.core.roofline import RooflineCost, kv_scatter_s
from node.plan import DTYPE_BYTES, Geometry, kv_bytes_per_token, param_count

__all__ = ["DoesNotFit", "ParallelModel", "PoolLayout"]


class DoesNotFit(ValueError):
    """A layout's weights (and activations) leave no room for KV on its devices."""


@dataclass(frozen=True)
class PoolLayout:
    """Pooled mode at degrees: prefill instances' model and blocks (the decode ones are the lowered
    config's ``kv_blocks`` and the cost passed beside it)."""

    prefill_cost: RooflineCost
    prefill_blocks: int


@dataclass(frozen=True, eq=False)
class ParallelModel:
    """A model geometry (``config``, a ``config.json`` dict) on a hardware preset, in ``dtype``.

    ``seqs_per_device``: ``max_num_seqs`` counts per device, so an instance (group) of degree ``I``
    holds ``I x max_num_seqs`` sequences (pooled: ``D x``, the decode side's); the layouts then differ in
    how they spend the same per-device concurrency, not in a cap that shrinks with the degree. False:
    ``max_num_seqs`` per instance, as the node's ``--max-num-seqs`` per engine.

    The step cost at degree ``D`` is :func:`bench.cost.derive_cost.derive_at` (one per-device roofline, the
    geometry split ``D`` ways, the preset's link); see the module doc for memory and the lowering.
    """

    config: dict
    preset: HardwarePreset = H200_NVLINK
    dtype: str = "bf16"
    seqs_per_device: bool = True
    _costs: dict = field(default_factory=dict, repr=False)

    @property
    def geometry(self) -> Geometry:
        return Geometry.from_config(self.config)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV of one token, all layers and heads (bytes)."""
        return kv_bytes_per_token(self.geometry, DTYPE_BYTES[self.dtype])

    def cost(self, degree: int, decode_graphs: bool = True) -> RooflineCost:
        """The per-rank roofline model at ``degree`` (computed once per degree); ``decode_graphs`` False: its
        decode steps run eagerly (``max_graph_batch`` 0), as the live node's tensor-parallel groups do."""
        if degree not in self._costs:
            self._costs[degree] = derive_at(self.config, degree, self.preset, self.dtype)
        cost = self._costs[degree]
        return cost if decode_graphs else msgspec.structs.replace(cost, max_graph_batch=0)

    def activation_bytes(self, degree: int, step_tokens: int, rows: int) -> int:
        """Estimated peak activations of one step on one device at ``degree`` (bytes; module doc)."""
        g, nb = self.geometry, DTYPE_BYTES[self.dtype]
        q, kv = g.heads * g.head_dim, g.kv_heads * g.head_dim
        per_token = 2 * g.hidden + (2 * q + 2 * kv + 2 * g.intermediate) // degree
        return step_tokens * per_token * nb + rows * (g.vocab // degree) * 4

    def kv_room_bytes(self, weight_degree: int, step_tokens: int, rows: int) -> int:
        """KV bytes one device holds beside its ``1/weight_degree`` weight shard and activations.

        Raises:
            DoesNotFit: no room left.
        """
        g, nb = self.geometry, DTYPE_BYTES[self.dtype]
        weights = param_count(g) * nb / weight_degree
        room = self.preset.hbm_bytes * self.preset.memory_utilization - weights - self.activation_bytes(
            weight_degree, step_tokens, rows)
        if room <= 0:
            raise DoesNotFit(f"{weights / 1e9:.1f} GB of weights per device (1/{weight_degree} of the model) leave "
                             f"no KV room in {self.preset.memory_utilization:g} x {self.preset.hbm_bytes / 1e9:g} GB")
        return int(room)

    def instance_blocks(self, instance_degree: int, weight_degree: int, block_size: int, step_tokens: int,
                        rows: int) -> int:
        """KV blocks of one instance (or group) of ``instance_degree`` devices (module doc)."""
        room = self.kv_room_bytes(weight_degree, step_tokens, rows)
        ways = min(instance_degree, self.geometry.kv_heads)  # above kv_heads, devices replicate heads
        return ways * room // (block_size * self.kv_bytes_per_token)

    # --- lowering ------------------------------------------------------------------------------------
    def lower(self, cfg: SimConfig) -> tuple[SimConfig, RooflineCost | GroupCost, PoolLayout | None]:
        """``(config of the simulated devices, their cost model, pooled prefill layout or None)``.

        Raises:
            DoesNotFit: a layout's devices have no KV room.
            ValueError: pooled with cluster scope (not modelled at degrees).
        """
        d, p = cfg.decode_tp, cfg.prefill_tp
        graphs = cfg.group_decode_graphs or d == 1  # the node captures decode graphs for one-device instances only
        budget, bs = cfg.max_num_batched_tokens, cfg.block_size
        rows = cfg.max_num_seqs * (d if self.seqs_per_device else 1)
        plain = dict(decode_tp=1, prefill_tp=1, kv_bytes_per_token=self.kv_bytes_per_token, max_num_seqs=rows)
        if cfg.mode == "colocated":
            blocks = self.instance_blocks(d, d, bs, budget, rows)
            return dataclasses.replace(cfg, devices=cfg.devices // d, kv_blocks=blocks, **plain), self.cost(d, graphs), None
        if cfg.mode in ("time-shared", "adaptive"):
            prefill = time_shared_roles(d, p, budget, rows)["prefill"]  # the node's role configuration
            inst = prefill.instances
            blocks = self.instance_blocks(d, p, bs, budget, rows)
            cost: RooflineCost | GroupCost = self.cost(d, graphs)
            if inst > 1:
                pre = self.cost(p)
                scatter = kv_scatter_s(1, pre.kv_bytes_per_token, p, d, self.preset.link_Bps)
                cost = GroupCost(prefill=pre, decode=cost, instances=inst, scatter_s_per_token=scatter, pause_s=cost.pause_s)
            cost, step_budget = group_policy(cost, budget, prefill)  # what the live policy plans a group with
            out = dataclasses.replace(cfg, devices=cfg.devices // d, kv_blocks=blocks, link_gbps=cfg.link_gbps * d,
                                      max_num_batched_tokens=step_budget,
                                      max_item_tokens=prefill.item_cap or cfg.max_item_tokens, **plain)
            return out, cost, None
        if cfg.pool_scope != "node":
            raise ValueError("pooled mode at tensor-parallel degrees is modelled inside a node only")
        npre = cfg.num_prefill_devices
        front = npre // p
        back = (cfg.devices - npre) // d
        layout = PoolLayout(self.cost(p), self.instance_blocks(p, p, bs, budget, cfg.max_num_seqs))
        dec_blocks = self.instance_blocks(d, d, bs, rows, rows)  # a decode step: one token per sequence
        out = dataclasses.replace(cfg, devices=front + back, prefill_devices=front, kv_blocks=dec_blocks,
                                  link_gbps=cfg.link_gbps * min(p, d), **plain)
        return out, self.cost(d, graphs), layout
