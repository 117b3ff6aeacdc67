"""The CPU serving implementations of the hot-path operators (backend ``cpu``), one name per function
of :mod:`shiftnode_kernels.reference` (same signatures, same semantics; the references stay the test oracle).

Only where the CPU profile showed a cheap win do they differ from the references:

* ``paged_attention``: :mod:`shiftnode_kernels.cpu_attention` (most of a decode step under the reference).
* ``reshape_and_cache``: one ``index_copy_`` per cache instead of boolean-mask indexing (half the
  time of the reference at 64 tokens); steps with padding slots (-1) keep the reference.
* ``rotary_embedding``: float32 tensors rotate in place with ``addcmul`` (a quarter fewer ops and
  temporaries); other dtypes keep the reference, which does the math in float32.

RMSNorm and SiLU-and-mul stay the references: ``F.rms_norm`` and an in-place multiply measured within
a few microseconds of them per call.
"""

import torch

from shiftnode_kernels.cpu_attention import paged_attention
from shiftnode_kernels.reference import gather_kv_blocks, rms_norm, scatter_kv_blocks, silu_and_mul
from shiftnode_kernels import reference

__all__ = [
    "reshape_and_cache",
    "paged_attention",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "gather_kv_blocks",
    "scatter_kv_blocks",
]


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """:func:`shiftnode_kernels.reference.reshape_and_cache`: ``key, value [T, Hkv, D]`` into the flat slots
    ``slot_mapping [T]`` int64 of ``k_cache, v_cache [num_blocks, block_size, Hkv, D]``, in place;
    negative slots are not written."""
    if slot_mapping.numel() == 0 or bool((slot_mapping < 0).any()):
        reference.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)
        return
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    flat_k.index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    flat_v.index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    """:func:`shiftnode_kernels.reference.rotary_embedding` (rotate-half layout, in place): ``positions [T]``
    int64, ``q [T, H, D]``, ``k [T, Hkv, D]``, ``cos_sin_cache [max_positions, D]`` float32."""
    if q.dtype != torch.float32 or k.dtype != torch.float32:
        reference.rotary_embedding(positions, q, k, cos_sin_cache)
        return
    half = cos_sin_cache.shape[-1] // 2
    cs = cos_sin_cache.index_select(0, positions)
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    for t in (q, k):
        x1, x2 = t[..., :half], t[..., half : 2 * half]
        o1 = torch.addcmul(x1 * cos, x2, sin, value=-1.0)  # x1 cos - x2 sin
        x2.mul_(cos).addcmul_(x1, sin)  # x2 cos + x1 sin, before x1 is overwritten
        x1.copy_(o1)
