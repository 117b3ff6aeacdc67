"""Paged attention as a registered ``torch.library`` op, so ``torch.compile`` keeps it opaque.

``shiftnode::unified_attention`` writes a layer's new keys and values into the paged cache and
attends through the block tables, as a backend's ``reshape_and_cache`` then ``paged_attention``
(:mod:`shiftnode_kernels.reference` gives their contracts). Inductor compiles everything around it and
calls it as an external kernel (vLLM's ``unified_attention`` custom op is the model): the backend's
host-side bookkeeping (``tolist``, per-sequence loops, the Numba kernel) would otherwise be traced
into the graph, or break it.

The per-step attention inputs (slot mapping, block tables, sequence and query lengths) are not
arguments of the op: they reach it through :func:`step_metadata`, a thread-local context the caller
sets around the compiled call (vLLM's forward context). The compiled graph's inputs are then only
``input_ids [T]``, ``positions [T]`` and the KV pool, whose shapes depend on the padded token count
``T`` alone, so one compiled graph serves every step of ``T`` tokens whatever its number of sequences
or context lengths. Rows ``num_tokens .. T-1`` of a padded step are padding: nothing is written for
them, their output rows are zeros.

The op is registered with the low-level :class:`torch.library.Library` API (a schema and a
``CompositeExplicitAutograd`` kernel), not ``torch.library.custom_op``: the latter's Python wrapper
costs about 10 us per call on this project's CPU, the former about 2 us (measured in this slice), and
a stories260k step calls the op once per layer.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Iterator

import torch

__all__ = ["StepMetadata", "step_metadata", "unified_attention", "LIBRARY"]


@dataclass
class StepMetadata:
    """The attention inputs of one (possibly padded) step; tensors on the model's device.

    Attributes:
        num_tokens: real tokens of the step (rows ``0 .. num_tokens-1`` of q/k/v); the rest is padding.
        slot_mapping: ``[num_tokens]`` int64 flat cache slot of each real token, all valid (padding
            rows are the ones past ``num_tokens``, not negative slots).
        block_tables: ``[num_seqs, max_blocks]`` int32.
        seq_lens: ``[num_seqs]`` int32 contexts, new tokens included.
        cu_seqlens_q: ``[num_seqs + 1]`` int32 prefix sums of new tokens (ends at ``num_tokens``).
        max_seqlen_q: the largest number of new tokens of one sequence.
    """

    num_tokens: int
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    max_seqlen_q: int
    decode_plan: object = field(default=None, compare=False, repr=False)
    """Set by the first layer of a pure decode step on the ``cpu`` backend: its
    :class:`~shiftnode_kernels.cpu_decode_numba.DecodePlan` (False: none applies), reused by the
    step's other layers."""


_local = threading.local()  # each device's runner steps in its own thread


@contextlib.contextmanager
def step_metadata(meta: StepMetadata) -> Iterator[None]:
    """Make ``meta`` the metadata every ``shiftnode::unified_attention`` call of this thread reads."""
    prev = getattr(_local, "meta", None)
    _local.meta = meta
    try:
        yield
    finally:
        _local.meta = prev


def _current() -> StepMetadata:
    meta = getattr(_local, "meta", None)
    if meta is None:
        raise RuntimeError("shiftnode::unified_attention called outside step_metadata(...)")
    return meta


_OPS: dict[str, object] = {}


def _backend_ops(backend: str):
    ops = _OPS.get(backend)
    if ops is None:
        from shiftnode_kernels.ops import get_ops

        ops = _OPS[backend] = get_ops(backend)
    return ops


LIBRARY = torch.library.Library("shiftnode", "FRAGMENT")
LIBRARY.define(
    "unified_attention(Tensor query, Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
    "float scale, str backend) -> Tensor"
)


def _unified_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, scale: float, backend: str) -> torch.Tensor:
    meta = _current()
    rows, n = query.shape[0], meta.num_tokens
    if backend == "cpu" and meta.max_seqlen_q == 1 and n == meta.seq_lens.shape[0] and n:
        # A pure decode step: the checks and conversions are done once per step, not per layer.
        plan = meta.decode_plan
        if plan is None:
            plan = meta.decode_plan = _decode_plan(query, key, k_cache, meta) or False
        if plan:
            if n < rows:
                query, key, value = query[:n], key[:n], value[:n]
            out = plan.run(query.contiguous(), key.contiguous(), value.contiguous(), k_cache, v_cache, scale)
            return out if n == rows else torch.cat((out, out.new_zeros((rows - n, *out.shape[1:]))))
    ops = _backend_ops(backend)
    if n < rows:
        query, key, value = query[:n], key[:n], value[:n]
    if n:  # the backends' reshape_and_cache, minus their check for negative slots (there are none here)
        if key.dtype != k_cache.dtype:
            key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, meta.slot_mapping, key)
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, meta.slot_mapping, value)
    out = ops.paged_attention(query.contiguous(), k_cache, v_cache, meta.block_tables, meta.seq_lens,
                              meta.cu_seqlens_q, meta.max_seqlen_q, scale)
    if n < rows:  # padding rows: zeros (never NaN from uninitialised memory: rows stay apart in a GEMM, but stay clean)
        full = out.new_zeros((rows, *out.shape[1:]))
        full[:n] = out
        return full
    return out


def _decode_plan(query: torch.Tensor, key: torch.Tensor, k_cache: torch.Tensor, meta: StepMetadata):
    from shiftnode_kernels import cpu_decode_numba

    return cpu_decode_numba.plan_decode(query, key, k_cache, meta.slot_mapping, meta.block_tables, meta.seq_lens)


LIBRARY.impl("unified_attention", _unified_attention, "CompositeExplicitAutograd")


@torch.library.register_fake("shiftnode::unified_attention")
def _unified_attention_fake(query, key, value, k_cache, v_cache, scale, backend):
    # Contiguous, as every backend's result is (not ``empty_like``, which keeps a dense permuted
    # query's strides): inductor plans the consumers' indexing from these strides, and with
    # ``size_asserts`` off a mismatch would go unnoticed.
    return query.new_empty(query.shape)


def unified_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, scale: float, backend: str) -> torch.Tensor:
    """Write ``key, value [T, Hkv, D]`` into ``k_cache, v_cache [num_blocks, block_size, Hkv, D]`` at the
    slots of :func:`step_metadata`, then attend ``query [T, H, D]`` through its block tables with
    ``backend``'s kernels (``"torch"``, ``"cpu"`` or ``"triton"``). Returns ``[T, H, D]`` in
    ``query.dtype``, zeros in padding rows.

    Raises:
        RuntimeError: called outside :func:`step_metadata`.
    """
    return torch.ops.shiftnode.unified_attention.default(query, key, value, k_cache, v_cache, scale, backend)
