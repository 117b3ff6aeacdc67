"""Triton block gather/scatter for KV-cache transfer, same contract as
:func:`shiftnode_kernels.reference.gather_kv_blocks` / :func:`shiftnode_kernels.reference.scatter_kv_blocks`.

A cache block ``[block_size, Hkv, D]`` must be contiguous (it is in the node's
``[layers, 2, num_blocks, block_size, Hkv, D]`` layout); the block stride is free. Grid
``(n, 2, cdiv(block_numel, BLOCK))``: block ``i``, keys (0) or values (1), one chunk each.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shiftnode_kernels._common import new_empty

_BLOCK = 2048


@triton.jit
def _copy_chunk(src, dst, offs, mask):
    x = tl.load(src + offs, mask=mask)
    tl.store(dst + offs, x.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _gather_kernel(k_ptr, v_ptr, ids_ptr, buf_ptr, stride_kb, stride_vb, n, numel, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    kv = tl.program_id(1)
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    blk = tl.load(ids_ptr + i).to(tl.int64)
    dst = buf_ptr + (kv * n + i).to(tl.int64) * numel
    if kv == 0:
        _copy_chunk(k_ptr + blk * stride_kb, dst, offs, mask)
    else:
        _copy_chunk(v_ptr + blk * stride_vb, dst, offs, mask)


@triton.jit
def _scatter_kernel(buf_ptr, k_ptr, v_ptr, ids_ptr, stride_kb, stride_vb, n, numel, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    kv = tl.program_id(1)
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    blk = tl.load(ids_ptr + i).to(tl.int64)
    src = buf_ptr + (kv * n + i).to(tl.int64) * numel
    if kv == 0:
        _copy_chunk(src, k_ptr + blk * stride_kb, offs, mask)
    else:
        _copy_chunk(src, v_ptr + blk * stride_vb, offs, mask)


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    if not (k_cache[0].is_contiguous() and v_cache[0].is_contiguous()):
        raise ValueError("each cache block [block_size, Hkv, D] must be contiguous")
    return k_cache[0].numel()


def gather_kv_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """``k_cache, v_cache [num_blocks, block_size, Hkv, D]``, ``block_ids [n]`` -> contiguous
    ``[2, n, block_size, Hkv, D]`` (keys then values) in the cache dtype."""
    numel = _check_cache(k_cache, v_cache)
    n = block_ids.shape[0]
    buf = new_empty((2, n, *k_cache.shape[1:]), k_cache.dtype, k_cache.device)
    if n == 0 or numel == 0:
        return buf
    _gather_kernel[(n, 2, triton.cdiv(numel, _BLOCK))](
        k_cache, v_cache, block_ids, buf, k_cache.stride(0), v_cache.stride(0), n, numel,
        BLOCK=_BLOCK, num_warps=4,
    )
    return buf


def scatter_kv_blocks(buffer: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Write ``buffer [2, n, block_size, Hkv, D]`` into blocks ``block_ids [n]``, in place, cast to the
    cache dtype."""
    numel = _check_cache(k_cache, v_cache)
    n = block_ids.shape[0]
    if n == 0 or numel == 0:
        return
    if tuple(buffer.shape) != (2, n, *k_cache.shape[1:]):
        raise ValueError(f"buffer {tuple(buffer.shape)} does not match (2, {n}, *{tuple(k_cache.shape[1:])})")
    buffer = buffer.contiguous()
    _scatter_kernel[(n, 2, triton.cdiv(numel, _BLOCK))](
        buffer, k_cache, v_cache, block_ids, k_cache.stride(0), v_cache.stride(0), n, numel,
        BLOCK=_BLOCK, num_warps=4,
    )
