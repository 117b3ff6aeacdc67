"""In-node KV transfer between two devices' caches (same process): layer by layer, in order.

Each layer: gather the sequence's blocks on the source, move the packed buffer to the destination
device (a device-to-device copy on CUDA), scatter it into the destination blocks, wait until the
write is done (:mod:`node.transport.pool_sync`: the engine reads on its own stream), optionally read it
back and compare bit for bit (the in-process analogue of the wire CRC, stronger and device-side), pace
it through an emulated link, then call ``on_layer(layer)``. Blocking: run it off the event loop
(``asyncio.to_thread``) or on the device worker's thread.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from shiftnode_kernels import reference
import node.transport.pool_sync as pool_sync
from node.transport.protocol import ChecksumMismatch, LayoutMismatch
from node.transport.throttle import LinkThrottle, as_throttle

GatherFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
ScatterFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass
class LocalCopyReport:
    """``nbytes``: payload bytes moved (all layers); ``layer_end_s``: per layer, seconds since start when
    the layer was in place (and verified, and paced); ``total_s``: seconds for the whole copy."""

    nbytes: int = 0
    layer_end_s: list[float] = field(default_factory=list)
    total_s: float = 0.0


class CopyAborted(RuntimeError):
    """The copy was stopped between layers (its ``abort`` event was set: the node is stopping); the
    destination blocks hold part of the sequence and must be freed."""


def _check(src_kv: torch.Tensor, src_blocks: list[int], dst_kv: torch.Tensor, dst_blocks: list[int]) -> None:
    if src_kv.dim() != 6 or dst_kv.dim() != 6 or src_kv.shape[1] != 2:
        raise ValueError(f"caches must be [layers, 2, blocks, block_size, Hkv, D]: {tuple(src_kv.shape)}, "
                         f"{tuple(dst_kv.shape)}")
    names = ["num_layers", "kv", "num_blocks", "block_size", "num_kv_heads", "head_dim"]
    diffs = [names[i] for i in (0, 1, 3, 4, 5) if src_kv.shape[i] != dst_kv.shape[i]]
    if src_kv.dtype != dst_kv.dtype:
        diffs.append("dtype")
    if diffs:
        raise LayoutMismatch(diffs, f"KV layout mismatch in {diffs}: {tuple(src_kv.shape)} {src_kv.dtype} vs "
                                    f"{tuple(dst_kv.shape)} {dst_kv.dtype}")
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(f"{len(src_blocks)} source blocks but {len(dst_blocks)} destination blocks")
    if len(set(dst_blocks)) != len(dst_blocks):
        raise ValueError("destination block ids repeat")
    for name, ids, n in (("source", src_blocks, src_kv.shape[2]), ("destination", dst_blocks, dst_kv.shape[2])):
        bad = [b for b in ids if not 0 <= b < n]
        if bad:
            raise ValueError(f"{name} block ids out of range 0..{n - 1}: {bad[:8]}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def copy_sequence_blocks(src_kv: torch.Tensor, src_blocks: list[int], dst_kv: torch.Tensor, dst_blocks: list[int],
                         *, on_layer: Callable[[int], None] | None = None, verify: bool = True,
                         link_gbps: LinkThrottle | float | None = None,
                         block_layer_bytes: int | None = None,
                         gather: GatherFn = reference.gather_kv_blocks,
                         scatter: ScatterFn = reference.scatter_kv_blocks,
                         fault_hook: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
                         abort: threading.Event | None = None) -> LocalCopyReport:
    """Copy blocks ``src_blocks`` of ``src_kv`` into ``dst_blocks`` of ``dst_kv`` (same logical order),
    every layer in order. Caches: ``[num_layers, 2, num_blocks, block_size, Hkv, D]``, same dtype and
    geometry (block counts may differ). ``link_gbps``: None, Gb/s or a shared :class:`LinkThrottle`;
    each layer then takes at least ``bytes*8/(gbps*1e9)`` s. ``block_layer_bytes``: bytes one block of
    one layer (K and V) stands for, paced and reported instead of the buffer's own (a timed benchmark
    device, whose pool holds a few bytes per block, emulates its geometry's
    ``2 * block_size * kv_heads * head_dim * dtype_bytes``); None: the buffer's. ``gather``/``scatter``: the kernels'
    ops (default: the torch reference; a cache in host memory always uses the reference).
    ``fault_hook(layer, buffer) -> buffer``: tests only, alters the buffer after it was gathered.
    ``abort``: once set, the copy stops before its next layer or during its link pacing
    (``CopyAborted``), so a stopping node never waits for a slow link.
    Raises ``ChecksumMismatch`` (verification failed: the destination blocks hold garbage for that
    layer; free them), ``LayoutMismatch``, ``ValueError``.
    """
    _check(src_kv, src_blocks, dst_kv, dst_blocks)
    if src_kv.device.type == "cpu":  # device kernels (Triton) cannot touch host memory
        gather = reference.gather_kv_blocks
    if dst_kv.device.type == "cpu":
        scatter = reference.scatter_kv_blocks
    link = as_throttle(link_gbps)
    src_ids = torch.as_tensor(src_blocks, dtype=torch.long, device=src_kv.device)
    dst_ids = torch.as_tensor(dst_blocks, dtype=torch.long, device=dst_kv.device)
    report = LocalCopyReport()
    t0 = time.monotonic()
    for layer in range(src_kv.shape[0]):
        if abort is not None and abort.is_set():
            raise CopyAborted(f"KV copy aborted before layer {layer}: the node is stopping")
        buf = gather(src_kv[layer, 0], src_kv[layer, 1], src_ids)  # [2, n, bs, Hkv, D]
        sent = buf.to(dst_kv.device, non_blocking=False)
        moved = fault_hook(layer, sent.clone()) if fault_hook is not None else sent
        scatter(moved, dst_kv[layer, 0], dst_kv[layer, 1], dst_ids)
        pool_sync.sync_pool_writes(dst_kv)  # landed before the engine (its own stream) may read it
        if verify:
            back = (gather if dst_kv.device == src_kv.device else reference.gather_kv_blocks)(
                dst_kv[layer, 0], dst_kv[layer, 1], dst_ids)
            if not torch.equal(_bits(back), _bits(sent)):
                raise ChecksumMismatch(f"layer {layer}: destination blocks differ from the source after the copy")
        nbytes = buf.numel() * buf.element_size() if block_layer_bytes is None else block_layer_bytes * len(src_blocks)
        report.nbytes += nbytes
        if link is not None and not link.wait_sync(nbytes, abort):
            raise CopyAborted(f"KV copy aborted at layer {layer}: the node is stopping")
        report.layer_end_s.append(time.monotonic() - t0)
        if on_layer is not None:
            on_layer(layer)
    report.total_s = time.monotonic() - t0
    return report


def head_overlaps(num_kv_heads: int, src_degree: int, dst_degree: int) -> list[tuple[int, int, int, int]]:
    """How KV heads move between two sharded pools: ``(src_rank, dst_rank, first_head, end_head)`` for
    every head range that source rank ``r`` (heads ``[r*K/S, (r+1)*K/S)`` at degree ``S``) and
    destination rank ``q`` (``[q*K/T, (q+1)*K/T)`` at degree ``T``) share, in head order; global head
    numbers. Degrees must divide ``K`` (node.worker.tensor_parallel's split of the KV heads)."""
    ks, kt = num_kv_heads // src_degree, num_kv_heads // dst_degree
    out = []
    for r in range(src_degree):
        for q in range(dst_degree):
            a, b = max(r * ks, q * kt), min((r + 1) * ks, (q + 1) * kt)
            if a < b:
                out.append((r, q, a, b))
    return out


def copy_sharded_blocks(src_pools: list[torch.Tensor], src_blocks: list[int], dst_pools: list[torch.Tensor],
                        dst_blocks: list[int], *, verify: bool = True, link_gbps: LinkThrottle | float | None = None,
                        block_layer_bytes: int | None = None, abort: threading.Event | None = None) -> LocalCopyReport:
    """:func:`copy_sequence_blocks` between two tensor-parallel groups' pools, re-sharding the KV heads.

    ``src_pools``/``dst_pools``: each rank's pool in rank order (``[layers, 2, blocks, block_size,
    K/degree, head_dim]``; one pool for a single device), so a group of degree ``S`` hands a sequence
    to one of degree ``T`` (a pooled hand-off from a prefill pool at ``P`` to a decode pool at ``D``, or
    a move between time-shared groups): for each head range a source and a destination rank share
    (:func:`head_overlaps`), those heads of every block are copied (views of both pools, no staging
    of the whole sequence). Pairs are copied one after another, through one shared link throttle: on
    GPUs each pair could use its own link, so the pacing errs long. ``block_layer_bytes`` is per
    single-device block (a timed device's emulated size) and is split by head range.

    Raises: as :func:`copy_sequence_blocks`; ``LayoutMismatch`` when the pools' heads do not add up to
    the same KV heads.
    """
    if len(src_pools) == 1 and len(dst_pools) == 1:
        return copy_sequence_blocks(src_pools[0], src_blocks, dst_pools[0], dst_blocks, verify=verify,
                                    link_gbps=link_gbps, block_layer_bytes=block_layer_bytes, abort=abort)
    heads = src_pools[0].shape[4] * len(src_pools)
    if dst_pools[0].shape[4] * len(dst_pools) != heads or heads % len(src_pools) or heads % len(dst_pools):
        raise LayoutMismatch(["num_kv_heads"], f"sharded pools of {len(src_pools)} x {src_pools[0].shape[4]} and "
                                               f"{len(dst_pools)} x {dst_pools[0].shape[4]} KV heads do not match")
    link = as_throttle(link_gbps)
    report = LocalCopyReport()
    t0 = time.monotonic()
    ks, kt = heads // len(src_pools), heads // len(dst_pools)
    for r, q, a, b in head_overlaps(heads, len(src_pools), len(dst_pools)):
        part = copy_sequence_blocks(
            src_pools[r][..., a - r * ks : b - r * ks, :], src_blocks, dst_pools[q][..., a - q * kt : b - q * kt, :],
            dst_blocks, verify=verify, link_gbps=link, abort=abort,
            block_layer_bytes=None if block_layer_bytes is None else block_layer_bytes * (b - a) // heads)
        report.nbytes += part.nbytes
    report.total_s = time.monotonic() - t0
    report.layer_end_s = [report.total_s] * src_pools[0].shape[0]  # pairs interleave layers: all end together
    return report
