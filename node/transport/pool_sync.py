"""The fence every node-side write into an engine's KV pool ends with.

An engine runs its steps in its own process (or thread) on its own CUDA stream; the node writes into the
same pool (CUDA IPC memory) when it receives a peer's KV (:func:`node.transport.tensors.scatter_layer`)
or copies a sequence between two of its devices (:func:`node.transport.local.copy_sequence_blocks`).
Those writes are queued asynchronously on the node process's stream, which nothing orders before the
engine's next step: the engine could read the blocks before the copy landed. So every such writer ends
with :func:`sync_pool_writes`, which returns only when the writes are done, before the sequence is
adopted (or the next layer announced). A no-op on the CPU, where a write is done when it returns.
"""

from __future__ import annotations

import torch

__all__ = ["sync_pool_writes"]


def sync_pool_writes(pool: torch.Tensor) -> None:
    """Block until every kernel and copy this process queued on ``pool``'s device has finished
    (``torch.cuda.synchronize(device)``: all of this process's streams on it, whichever the writer
    used); nothing for a pool in host memory."""
    if pool.device.type == "cuda":
        torch.cuda.synchronize(pool.device)
