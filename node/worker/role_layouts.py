"""A time-shared group rank's two layouts: one instance at the decode degree, several at the prefill degree.

A group of ``D`` devices (``--decode-tp D``) decodes as one tensor-parallel instance; in the prefill
role it runs ``g = D / P`` instances of ``P`` devices (``--prefill-tp P``) side by side, strided
(instance ``s`` is the ranks ``s, s + g, ...``; :func:`node.core.role_config.instance_ranks`). A switch
is a real reconfiguration (:meth:`GroupLayouts.activate`): every layer's weight views are rebuilt for
the other degree (:meth:`CausalLM.set_tensor_parallel`, no copies: the device holds its degree-``P``
shard and its degree-``D`` shard is a view inside it), the attention heads and KV heads a rank computes
change, and the ranks meet in a barrier before the group's next step.

KV layout. Every device's pool holds, for every block id of the group's ledger, the ``K / D`` KV heads
it owns in decode. At degree ``P`` rank ``r`` computes ``K / P`` KV heads: its own and those of the
``g - 1`` other devices of its *column* (the ranks ``c*g .. c*g + g - 1``, ``c = r // g``, one per
instance). It writes each head group straight into the pool of the device that owns it and reads it
from there in attention (the pools of the column are mapped into every rank: memfd on the CPU, CUDA
IPC on GPUs), so the KV a prefill produces is in the decode layout as it is written: it never moves
again, and a chunked prefill or a prefix-cache hit reads earlier chunks where they lie. Instances
write disjoint block ids: each sequence of a step is on one instance, and a sequence that reuses a
block another item of the same step writes (a prefix hit registered in that step) is put on the
writer's instance (:func:`node.core.role_config.shared_block_units`), since only one instance orders a
write before a read. Every composite step ends
in one all-reduce of the sampled token ids over the whole group (:meth:`GroupLayouts.merge_tokens`),
which is also the barrier after which any rank may read what the others wrote.

Bytes. At degree ``P`` a rank writes ``(g - 1) / g`` of the KV it computes into other devices' pools:
``tokens * kv_bytes_per_token * (1 - P / D)`` per instance step
(:func:`node.core.role_config.scatter_bytes`), over the
device link on GPUs (NVLink peer writes), through shared memory on the CPU.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from node.core.role_config import column_ranks, instance_ranks
from node.worker.tensor_parallel import TPGroup


def new_instance_groups(degree: int, prefill_degree: int, rank: int) -> TPGroup:
    """This rank's prefill instance as a :class:`TPGroup` of ``prefill_degree`` ranks (strided).
    Collective: every rank of the world calls it with the same arguments (one ``new_group`` per
    instance, in instance order). Degree 1: no group."""
    mine = TPGroup.single()
    for ranks in instance_ranks(degree, prefill_degree):
        group = dist.new_group(ranks) if prefill_degree > 1 else None
        if rank in ranks:
            mine = TPGroup(rank=ranks.index(rank), degree=prefill_degree, group=group) if group is not None else mine
    return mine


class GroupLayouts:
    """The decode and prefill layouts of rank ``rank`` of a time-shared group, and the active one.

    Args:
        rank, degree: this rank in the group of ``degree`` devices (``--decode-tp``).
        prefill_degree: ``--prefill-tp`` (divides ``degree``).
        decode: the whole group (degree ``degree``).
        prefill: this rank's instance (degree ``prefill_degree``), from :func:`new_instance_groups`.
    """

    def __init__(self, rank: int, degree: int, prefill_degree: int, decode: TPGroup, prefill: TPGroup):
        self.rank, self.degree, self.prefill_degree = rank, degree, prefill_degree
        self.instances = degree // prefill_degree
        self.instance = rank % self.instances
        self.column = rank // self.instances
        self.decode, self.prefill = decode, prefill
        self.active = "decode"
        self.pools: dict[int, torch.Tensor] = {}  # rank → its KV pool, for the ranks of this rank's column

    @property
    def column_ranks(self) -> list[int]:
        """The ranks whose KV heads this rank computes at the prefill degree, in head order."""
        return column_ranks(self.rank, self.degree, self.prefill_degree)

    def activate(self, role: str, runner: Any) -> float:
        """Make ``role``'s layout the active one on this rank (``"prefill"`` or ``"decode"``), then wait
        for the whole group (a barrier); the milliseconds it took, barrier included.

        Raises:
            RuntimeError: the prefill layout needs the column's pools (:attr:`pools`) and they are missing.
        """
        t0 = time.perf_counter()
        model = runner.model
        if role == "prefill":
            if self.instances > 1:
                missing = [r for r in self.column_ranks if r not in self.pools]
                if missing:
                    raise RuntimeError(f"rank {self.rank}: the KV pools of ranks {missing} are not mapped")
                runner.kv_views = tuple(self.pools[r] for r in self.column_ranks)
            model.set_tensor_parallel(self.prefill)
        else:
            runner.kv_views = None
            model.set_tensor_parallel(self.decode)
        self.active = role
        dist.barrier(group=self.decode.group)
        return (time.perf_counter() - t0) * 1e3

    @property
    def composite(self) -> bool:
        """Whether steps of the active layout run several instances (each rank computes only its
        instance's items)."""
        return self.active == "prefill" and self.instances > 1

    def merge_tokens(self, mine: list[int], device: torch.device) -> list[int]:
        """Every item's sampled token id (-1: none), from the ranks of the items' instances: one
        all-reduce (MAX) of ``[items] int64`` over the whole group, each rank giving its own items'
        tokens and -1 for the others'. It is also the step's barrier (see the module docstring)."""
        t = torch.tensor(mine, dtype=torch.int64, device=device)
        if device.type == "cuda":  # this rank's peer writes are complete before the others may read them
            torch.cuda.current_stream(device).synchronize()
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.decode.group)
        return t.tolist()
