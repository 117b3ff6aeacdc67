"""Torch glue: KV cache ↔ layout, one layer's blocks ↔ payload bytes. The transport stays bytes-based;
only this module (and :mod:`node.transport.local`) touches tensors."""

from __future__ import annotations

import warnings

import torch

from shiftnode_kernels import reference
import node.transport.pool_sync as pool_sync
from node.transport.protocol import DTYPE_BYTES, Fingerprint, Layout


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"`` (the name in :class:`Layout`)."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"KV dtype {dtype} is not supported by the transfer protocol")
    return name


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def layout_of(kv_cache: torch.Tensor, model_id: str, fingerprint: Fingerprint | None = None) -> Layout:
    """The :class:`Layout` of ``kv_cache [num_layers, 2, num_blocks, block_size, Hkv, D]`` (with the
    model's ``fingerprint``, see :mod:`node.transport.fingerprint`)."""
    L, two, _, bs, h, d = kv_cache.shape
    if two != 2:
        raise ValueError(f"kv_cache dim 1 must be 2 (K, V), got shape {tuple(kv_cache.shape)}")
    return Layout(model_id=model_id, dtype=dtype_name(kv_cache.dtype), block_size=bs, num_layers=L,
                  num_kv_heads=h, head_dim=d, fingerprint=fingerprint)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A flat byte view of ``t`` (copied to host memory and made contiguous only if needed)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def gather_layer(kv_cache: torch.Tensor, layer: int, block_ids: torch.Tensor | list[int]) -> torch.Tensor:
    """One layer's blocks of a sequence, packed: ``[2, n, block_size, Hkv, D]`` on the cache's device."""
    ids = torch.as_tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    return reference.gather_kv_blocks(kv_cache[layer, 0], kv_cache[layer, 1], ids)


def scatter_layer(buffer: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                  block_ids: torch.Tensor | list[int]) -> None:
    """Write ``buffer [2, n, block_size, Hkv, D]`` into blocks ``block_ids`` of one layer, in place;
    returns once the write is done (:func:`~node.transport.pool_sync.sync_pool_writes`: the engine reads
    the pool on its own stream)."""
    ids = torch.as_tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    reference.scatter_kv_blocks(buffer.to(kv_cache.device), kv_cache[layer, 0], kv_cache[layer, 1], ids)
    pool_sync.sync_pool_writes(kv_cache)


def layer_from_bytes(data: bytes | bytearray | memoryview, layout: Layout, num_blocks: int) -> torch.Tensor:
    """View a received payload as ``[2, num_blocks, block_size, Hkv, D]`` of the layout's dtype (on the
    host, sharing ``data``'s memory: pass a bytearray, as the server does, to avoid a warning)."""
    want = layout.layer_bytes(num_blocks)
    if len(memoryview(data).cast("B")) != want:
        raise ValueError(f"payload has {len(memoryview(data).cast('B'))} bytes, the layout needs {want}")
    shape = (2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    if want == 0:
        return torch.empty(shape, dtype=torch_dtype(layout.dtype))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffers (bytes) are fine: we only read
        flat = torch.frombuffer(data, dtype=torch.uint8)
    return flat.view(torch_dtype(layout.dtype)).view(shape)


def scatter_layer_bytes(data: bytes | bytearray | memoryview, layout: Layout, kv_cache: torch.Tensor, layer: int,
                        block_ids: list[int]) -> None:
    """The receiver's ``on_layer`` body: write a received payload into the reserved blocks."""
    scatter_layer(layer_from_bytes(data, layout, len(block_ids)), kv_cache, layer, block_ids)
