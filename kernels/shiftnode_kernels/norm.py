"""Triton RMSNorm with fused residual add (Zhang & Sennrich 2019), same contract and rounding steps as
:func:`shiftnode_kernels.reference.rms_norm`.

One program per row holds the whole row (``hidden`` rounded up to a power of two) in registers:
``h = x + residual`` (rounded to ``h``'s dtype, as torch does), ``var = mean(h^2)`` in fp32,
``out = weight * (h * rsqrt(var + eps)).to(x.dtype)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shiftnode_kernels._common import new_empty, next_pow2


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, h_ptr, eps,
    stride_x, stride_r, stride_o, stride_h,
    N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        h = (x.to(tl.float32) + r.to(tl.float32)).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + row * stride_h + offs, h, mask=mask)
    else:
        h = x
    hf = h.to(tl.float32)
    var = tl.sum(hf * hf, 0) / N
    normed = (hf * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    out = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., hidden]``, ``weight [hidden]``, ``residual`` like ``x`` or None. Returns
    ``(out, h)``: ``out`` in ``promote(weight.dtype, x.dtype)``; ``h = x + residual`` (``x`` itself
    when ``residual`` is None)."""
    hidden = x.shape[-1]
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = new_empty(x.shape, out_dtype, x.device)
    if residual is None:
        h = x
    else:
        h = new_empty(x.shape, torch.promote_types(x.dtype, residual.dtype), x.device)
    rows = x.numel() // hidden if hidden else 0
    if rows == 0:
        if residual is not None:
            torch.add(x, residual, out=h)
        return out, h
    x2 = x.reshape(rows, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    r2 = x2
    if residual is not None:
        r2 = residual.expand_as(x).reshape(rows, hidden)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
    w = weight.contiguous()
    out2 = out.view(rows, hidden)
    h2 = h.view(rows, hidden) if residual is not None else out2  # unused when there is no residual
    block = next_pow2(hidden)
    _rms_norm_kernel[(rows,)](
        x2, r2, w, out2, h2, float(eps),
        x2.stride(0), r2.stride(0), out2.stride(0), h2.stride(0),
        N=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None,
        num_warps=min(max(block // 256, 1), 16),
    )
    return out, h
