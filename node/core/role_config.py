"""What differs between a device group's roles, as data (pure: no torch, no I/O).

A time-shared *group* is ``D`` devices (``--decode-tp D``) that decode as one tensor-parallel model
instance and, in the prefill role, prefill as ``D / P`` independent instances of ``P`` devices each
(``--prefill-tp P``): prefill is compute-bound, and an all-reduce per layer over fewer ranks costs
less (the design note; Seesaw, Su et al., MLSys 2025, re-shards between the two layouts the same way).
A :class:`RoleConfig` says everything a role changes; a switch swaps the active one on every device of
the group (:mod:`node.runtime.switching`).

Instances are *strided* over the group: instance ``s`` of a prefill layout is the ranks
``{s + j * (D/P) : j = 0 .. P-1}`` and rank ``r`` is its rank ``r // (D/P)`` at degree ``P``. Then the
KV heads rank ``r`` computes at degree ``P`` (heads ``[(r // (D/P)) * K/P, ...)``) contain the heads
it owns at degree ``D`` (``[r * K/D, ...)``), and its degree-``D`` weight shard lies inside its
degree-``P`` one, so it holds only the ``P`` shard and every other layout is a view of it
(:class:`node.worker.tensor_parallel.ShardLayout`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class RoleConfig:
    """One role's execution configuration for a group of ``tp_degree * instances`` devices.

    Attributes:
        role: ``"prefill"``, ``"decode"`` or ``"mixed"`` (colocated mode).
        tp_degree: devices per model instance (the tensor-parallel degree of its steps).
        instances: model instances the group runs side by side in this role; each step gives each
            instance its own sequences (:func:`assign_instances`).
        token_budget: new tokens per step *per instance* (the chunked-prefill budget); a step of the
            group computes up to ``token_budget * instances``, no sequence more than ``token_budget``.
        cuda_graphs: decode steps may replay captured CUDA graphs (CUDA, triton backend, degree 1,
            no ``--enforce-eager``); otherwise steps run eagerly.
    """

    role: str
    tp_degree: int = 1
    instances: int = 1
    token_budget: int = 2048
    cuda_graphs: bool = False

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode", "mixed"):
            raise ValueError(f"role must be prefill, decode or mixed, got {self.role!r}")
        if self.tp_degree < 1 or self.instances < 1 or self.token_budget < 1:
            raise ValueError(f"tp_degree, instances and token_budget must be >= 1, got {self}")

    @property
    def group_size(self) -> int:
        return self.tp_degree * self.instances

    @property
    def step_budget(self) -> int:
        """New tokens per step of the whole group."""
        return self.token_budget * self.instances

    @property
    def item_cap(self) -> int | None:
        """New tokens per sequence per step (``BatchConfig.max_item_tokens``): one instance's budget
        when the group runs several, None otherwise."""
        return self.token_budget if self.instances > 1 else None

    def as_dict(self) -> dict:
        return asdict(self)


def time_shared_roles(group_size: int, prefill_tp: int, token_budget: int, max_num_seqs: int,
                      cuda_graphs: bool = False) -> dict[str, RoleConfig]:
    """The prefill and decode configurations of a time-shared group of ``group_size`` devices.

    Prefill: ``group_size / prefill_tp`` instances at degree ``prefill_tp``, ``token_budget`` each.
    Decode: one instance at degree ``group_size``; its step computes one token per resident sequence,
    so its budget is ``max_num_seqs``; graphs only at degree 1 (collectives are not captured yet).

    Raises:
        ValueError: ``prefill_tp`` does not divide ``group_size``.
    """
    if prefill_tp < 1 or group_size % prefill_tp:
        raise ValueError(f"--prefill-tp {prefill_tp} must divide --decode-tp {group_size}")
    return {
        "prefill": RoleConfig("prefill", prefill_tp, group_size // prefill_tp, token_budget),
        "decode": RoleConfig("decode", group_size, 1, max_num_seqs, cuda_graphs=cuda_graphs and group_size == 1),
    }


def instance_ranks(group_size: int, degree: int) -> list[list[int]]:
    """The group's ranks of each instance at ``degree``, strided (see the module docstring):
    ``instance_ranks(4, 2) == [[0, 2], [1, 3]]``; ``degree == group_size``: ``[[0, 1, ...]]``.

    Raises:
        ValueError: ``degree`` does not divide ``group_size``.
    """
    if degree < 1 or group_size % degree:
        raise ValueError(f"degree {degree} does not divide the group size {group_size}")
    n = group_size // degree
    return [[s + j * n for j in range(degree)] for s in range(n)]


def column_ranks(rank: int, group_size: int, prefill_tp: int) -> list[int]:
    """The ranks whose decode KV heads ``rank`` computes at degree ``prefill_tp``, in head order: its
    *column* ``c*g .. c*g + g - 1`` (``g = group_size / prefill_tp``, ``c = rank // g``), one rank of
    each instance, itself among them (see the module docstring)."""
    g = group_size // prefill_tp
    c = rank // g
    return [c * g + t for t in range(g)]


def scatter_bytes(tokens: int, kv_bytes_per_token: int, prefill_tp: int, decode_tp: int) -> int:
    """KV bytes an instance's prefill of ``tokens`` at degree ``prefill_tp`` writes into the pools of
    other devices of a ``decode_tp`` group: of the ``K`` heads its devices compute, each keeps ``K/D``
    of its ``K/P``, so ``tokens * kv_bytes_per_token * (1 - P/D)`` (``kv_bytes_per_token``: all heads,
    all layers)."""
    return tokens * kv_bytes_per_token * (decode_tp - prefill_tp) // decode_tp


def assign_instances(tokens: Sequence[int], instances: int, together: Sequence[int] | None = None) -> list[int]:
    """The instance each step item runs on: longest unit first to the least loaded instance (Graham's
    LPT rule, "Bounds on multiprocessing timing anomalies", SIAM J. Appl. Math. 1969: the step's
    longest instance is within 4/3 of the best split); ties go to the lower instance.

    Args:
        tokens: new tokens of each item, in step order.
        instances: instances to spread them over.
        together: a unit key per item (None: every item its own unit); items with the same key run on
            the same instance (a sequence that reads a block another item of the step writes must run
            where it is written: instances run side by side, so only one instance orders a write
            before a read; :func:`shared_block_units`).

    Returns:
        ``[instance index of item i]``, in item order.
    """
    if instances <= 1:
        return [0] * len(tokens)
    keys = list(range(len(tokens))) if together is None else list(together)
    units: dict[int, list[int]] = {}
    for i, k in enumerate(keys):
        units.setdefault(k, []).append(i)
    size = {k: sum(tokens[i] for i in items) for k, items in units.items()}
    load = [0] * instances
    out = [0] * len(tokens)
    for k in sorted(units, key=lambda k: (-size[k], units[k][0])):
        s = min(range(instances), key=lambda j: load[j])
        for i in units[k]:
            out[i] = s
        load[s] += size[k]
    return out


def shared_block_units(spans: Sequence[tuple[Sequence[int], int, int]], block_size: int) -> list[int]:
    """Unit keys for :func:`assign_instances`: items that share a KV block one of them writes in the
    step get the same key (union-find over the written blocks).

    Args:
        spans: per item, ``(block table, first new position, new tokens)``: it writes the blocks of
            positions ``[start, start + n)`` and reads those of ``[0, start + n)`` (prefix-cache hits
            registered by an earlier item of the same step are among the read ones).
        block_size: tokens per block.

    Returns:
        ``[unit key of item i]`` (the smallest item index of its unit).
    """
    parent = list(range(len(spans)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    writer: dict[int, int] = {}
    for i, (table, start, n) in enumerate(spans):
        if n > 0:
            for b in table[start // block_size : (start + n - 1) // block_size + 1]:
                writer.setdefault(b, i)
    for i, (table, start, n) in enumerate(spans):
        for b in table[: (start + n - 1) // block_size + 1 if n > 0 else 0]:
            w = writer.get(b)
            if w is not None and w != i:
                a, c = root(i), root(w)
                parent[max(a, c)] = min(a, c)
    return [root(i) for i in range(len(spans))]
