"""Triton SwiGLU activation (Shazeer 2020), same contract and rounding as
:func:`shiftnode_kernels.reference.silu_and_mul`: ``out = silu(x[..., :I]).to(dtype) * x[..., I:]``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shiftnode_kernels._common import new_empty

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    a = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(x_ptr + row * stride_x + N + offs, mask=mask, other=0.0).to(tl.float32)
    silu = (a / (1.0 + tl.exp(-a))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (silu * b).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x [..., 2*I]`` -> ``[..., I]`` in ``x.dtype``."""
    d = x.shape[-1] // 2
    out = new_empty((*x.shape[:-1], d), x.dtype, x.device)
    rows = out.numel() // d if d else 0
    if rows == 0:
        return out
    x2 = x.reshape(rows, 2 * d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out2 = out.view(rows, d)
    _silu_and_mul_kernel[(rows, triton.cdiv(d, _BLOCK))](
        x2, out2, x2.stride(0), out2.stride(0), d, BLOCK=_BLOCK, num_warps=4,
    )
    return out
