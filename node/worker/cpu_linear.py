"""Projection weights packed once for oneDNN, so a CPU step's matmuls skip the per-call reorder.

``F.linear`` on the CPU hands a plain row-major weight to MKL or oneDNN on every call; oneDNN then
reorders it into its blocked layout, or runs a slower kernel on the plain one. Packing each
projection weight once at load time (``torch.ops.mkldnn._reorder_linear_weight``, what inductor's
CPU weight freezing uses) and calling ``torch.ops.mkldnn._linear_pointwise`` on it measured, on the
2-core AVX-512 machine of bench/RESULTS.md (the 12 layers and head of an 85M Llama, one thread, in
one interleaved run): float32 1.3x at batch 1, 2.1x at 16, 1.35x at 64; bfloat16 2.4x, 3.9x and 2.3x
the float32 ``F.linear`` (bf16 ``F.linear`` itself only 1.3x, 2.3x, 1.9x). A weight packed with no
batch-size hint serves every batch size.

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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [T, in] @ weight.T (+ bias)`` → ``[T, out]`` in ``x.dtype``; ``weight`` ``[out, in]`` either a
    plain tensor (``F.linear``) or one packed by :func:`pack_weight` (oneDNN's kernel on it)."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
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


def pack_model(model: Any) -> int:
    """Point every decoder layer's shard (:class:`~node.worker.tensor_parallel.LayerShard`) and the LM
    head of ``model`` (a :class:`~node.worker.model.CausalLM` at degree 1) at packed copies of their
    weights; returns the bytes packed. A later ``set_tensor_parallel`` (or ``.to``) rebuilds plain views.

    Raises:
        ValueError: the model runs at a tensor-parallel degree above 1 (its shards are views the
            group's layouts switch between).
    """
    if model.tp.degree != 1:
        raise ValueError(f"weight packing is for degree 1, the model runs at degree {model.tp.degree}")
    packed = 0
    with torch.no_grad():
        for layer in model.layers:
            s = layer.shard
            layer.shard = dataclasses.replace(
                s, qkv_weight=pack_weight(s.qkv_weight), o_weight=pack_weight(s.o_weight),
                gate_up_weight=pack_weight(s.gate_up_weight), down_weight=pack_weight(s.down_weight))
            packed += sum(w.numel() * w.element_size() for w in (s.qkv_weight, s.o_weight, s.gate_up_weight, s.down_weight))
        head = model.head_weight
        model._lm_shard = pack_weight(head)
        packed += head.numel() * head.element_size()
    return packed
