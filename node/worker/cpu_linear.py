"""Projection weights packed once for oneDNN, so a CPU step's matmuls skip the per-call reorder.

``F.linear`` on the CPU hands a plain row-major weight to MKL or oneDNN on every call; oneDNN then
reorders it into its blocked layout, or runs a slower kernel on the plain one. Packing each
projection weight once at load time (``torch.ops.mkldnn._reorder_linear_weight``, what inductor's
CPU weight freezing uses) and calling ``torch.ops.mkldnn._linear_pointwise`` on it measured, on the
2-core AVX-512 machine of bench/RESULTS.md (the 12 layers and head of an 85M Llama, one thread, in
one interleaved run): float32 1.3x at batch 1, 2.1x at 16, 1.35x at 64; bfloat16 2.4x, 3.9x and 2.3x
the float32 ``F.linear`` (bf16 ``F.linear`` itself only 1.3x, 2.3x, 1.9x). A weight packed with no
batch-size hint serves every batch size.

A single float32 row (a one-stream decode step) is the exception: there ``F.linear`` on the weight
stored column-major (``weight.T`` contiguous: a vector-matrix product that streams whole rows)
measured 1.2x the packed kernel and 1.2x ``F.linear`` on the row-major weight, so :func:`pack_model`
also re-lays the float32 projection weights out that way (same values, no extra memory).

The packed tensors are opaque oneDNN tensors held beside the model's parameters (which the
fingerprint, tensor parallelism and ``--compile`` keep reading), so a packed model holds its
projection weights twice: host memory the CPU has to spare next to the bandwidth it saves per step.
``--cpu-weight-packing off`` turns it off. Results differ from ``F.linear`` by accumulation order
only (float32: ~1e-6 absolute on unit-scale outputs).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.nn import functional as F

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
"""Dtypes oneDNN packs on any AVX-512 CPU (float16 needs AVX512-FP16 or AVX-NE-CONVERT)."""

PACK_MIN_ELEMENTS = 1 << 18
"""Weights with fewer elements stay plain: on small matrices oneDNN's per-call cost outweighs what the
layout saves (one ``[3h, h]`` projection at 16-64 rows, one thread: ``F.linear`` 2-3x faster at h = 64,
even at h = 256 (197K elements), the packed kernel 1.2-1.5x faster from h = 384 (442K) up; stories260k's
decode step at batch 16 ran 1.4x slower with every weight packed)."""


@dataclasses.dataclass(frozen=True)
class PackedProjections:
    """One decoder layer's projection weights packed by :func:`pack_weight` (opaque oneDNN tensors of
    the shapes of :class:`~node.worker.tensor_parallel.LayerShard`'s ``qkv_weight``, ``o_weight``,
    ``gate_up_weight`` and ``down_weight``), None for a weight under :data:`PACK_MIN_ELEMENTS`."""

    qkv: torch.Tensor | None
    o: torch.Tensor | None
    gate_up: torch.Tensor | None
    down: torch.Tensor | None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """``x [T, in] @ weight.T (+ bias)`` → ``[T, out]`` in ``x.dtype``, ``weight`` ``[out, in]``.

    With ``packed`` (:func:`pack_weight` of ``weight``) oneDNN's kernel runs on it, except for a
    single float32 row: there ``F.linear`` on the column-major weight that :func:`pack_model` leaves
    (a vector-matrix product streaming whole rows of ``weight.T``) measured 1.2x the packed kernel."""
    if packed is not None and (x.shape[0] != 1 or x.dtype != torch.float32):
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


def packing_unsupported(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why weights on ``device`` in ``dtype`` cannot be packed, or None when they can."""
    if device.type != "cpu":
        return f"device {device.type} (packing is for the CPU)"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN"
    if dtype not in PACKABLE_DTYPES:
        return f"dtype {str(dtype).removeprefix('torch.')} (float32 and bfloat16 are packed)"
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "the CPU has no bfloat16 support in oneDNN"
    return None


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A packed copy of ``weight [out, in]`` (float32 or bfloat16, CPU) for :func:`linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def _worth_packing(weight: torch.Tensor) -> bool:
    return weight.numel() >= PACK_MIN_ELEMENTS


def pack_model(model: Any) -> int:
    """Give every decoder layer of ``model`` (a :class:`~node.worker.model.CausalLM` at degree 1) its
    :class:`PackedProjections` (``layer.packed``) and the LM head its packed copy (``model.head_packed``),
    for the weights of at least :data:`PACK_MIN_ELEMENTS` elements (None where none is), and store
    those of them in float32 column-major (same values, ``weight.T`` contiguous: see :func:`linear`);
    returns the bytes packed (0: nothing was). ``set_tensor_parallel`` (or ``.to``) drops the packed copies.

    Raises:
        ValueError: the model runs at a tensor-parallel degree above 1 (its shards are views the
            group's layouts switch between).
    """
    if model.tp.degree != 1:
        raise ValueError(f"weight packing is for degree 1, the model runs at degree {model.tp.degree}")
    packed = 0
    with torch.no_grad():
        heads = [] if model.lm_head is None else [model.lm_head]  # a tied head is the embedding: rows stay rows
        for proj in [m for layer in model.layers for m in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj,
                                                             layer.down_proj)] + heads:
            if proj.weight.dtype == torch.float32 and _worth_packing(proj.weight):
                proj.weight.data = proj.weight.data.t().contiguous().t()
        model.set_tensor_parallel(model.tp)  # the shards' views, on the new storage

        def pack(w: torch.Tensor) -> torch.Tensor | None:
            nonlocal packed
            if not _worth_packing(w):
                return None
            packed += w.numel() * w.element_size()
            return pack_weight(w)

        for layer in model.layers:
            s = layer.shard
            p = PackedProjections(pack(s.qkv_weight), pack(s.o_weight), pack(s.gate_up_weight), pack(s.down_weight))
            layer.packed = None if p == PackedProjections(None, None, None, None) else p
        model.head_packed = pack(model.head_weight)
    return packed
