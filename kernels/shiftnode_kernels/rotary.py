"""Triton rotary position embedding (RoPE, Su et al. 2021), in place, GPT-NeoX / Hugging Face
``rotate_half`` layout; same contract as :func:`shiftnode_kernels.reference.rotary_embedding`.

One program per token rotates all query and key heads: for ``i < rot_dim / 2``,
``x[i], x[i + rot_dim/2] = x1*cos - x2*sin, x2*cos + x1*sin`` with ``cos|sin`` read from the row
``positions[t]`` of the table; dims past ``rot_dim`` (partial rotary) are left untouched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shiftnode_kernels._common import next_pow2


@triton.jit
def _rotate_heads(ptr, stride_h, cos, sin, offs_i, i_ok,
                  NUM_HEADS: tl.constexpr, H_PAD: tl.constexpr, HALF: tl.constexpr):
    offs_h = tl.arange(0, H_PAD)
    mask = (offs_h[:, None] < NUM_HEADS) & i_ok[None, :]
    p1 = ptr + offs_h[:, None] * stride_h + offs_i[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(p1, o1.to(ptr.dtype.element_ty), mask=mask)
    tl.store(p1 + HALF, o2.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, cs_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, QH_PAD: tl.constexpr, KH_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_i = tl.arange(0, HALF_PAD)
    i_ok = offs_i < HALF
    cos = tl.load(cs_ptr + pos * stride_cs + offs_i, mask=i_ok, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + offs_i, mask=i_ok, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, cos, sin, offs_i, i_ok, NUM_Q_HEADS, QH_PAD, HALF)
    _rotate_heads(k_ptr + t * stride_kt, stride_kh, cos, sin, offs_i, i_ok, NUM_K_HEADS, KH_PAD, HALF)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> None:
    """``positions [T] int64``; ``q [T, H, D]`` and ``k [T, Hkv, D]`` rotated in place (any strides with
    a unit stride on ``D``); ``cos_sin_cache [max_positions, rot_dim] float32``."""
    num_tokens = q.shape[0]
    if num_tokens == 0:
        return
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("rotary_embedding works in place and needs a unit stride on head_dim")
    half = cos_sin_cache.shape[-1] // 2
    if half == 0:
        return
    cs = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    _rotary_kernel[(num_tokens,)](
        positions, q, k, cs,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cs.stride(0),
        NUM_Q_HEADS=q.shape[1], NUM_K_HEADS=k.shape[1], QH_PAD=next_pow2(q.shape[1]),
        KH_PAD=next_pow2(k.shape[1]), HALF=half, HALF_PAD=next_pow2(half), num_warps=4,
    )
