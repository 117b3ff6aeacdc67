"""Which bytes of two registered KV pools a NIXL layer write moves (pure arithmetic over numpy arrays).

A pool is ``[num_layers, 2, num_blocks, block_size, Hkv, D]``: the K (``kv = 0``) or V (``kv = 1``) half of
block ``b`` of layer ``l`` is ``half = layout.block_bytes / 2`` bytes at ``base + ((l*2 + kv)*num_blocks +
b)*half``. A layer's descriptors are those halves for the sequence's blocks, merged over runs of blocks
consecutive on both sides (:func:`block_runs`), so a contiguous sequence is two descriptors a layer
(:func:`layer_descs`), whatever its length. Used by :class:`node.transport.nixl_agent.NixlAgent`.
"""

from __future__ import annotations

import numpy as np

from node.transport.protocol import NixlPool


def block_runs(local: np.ndarray, remote: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge a block mapping into runs consecutive on both sides: ``(local_starts, remote_starts,
    lengths)`` (int64 arrays; ``local[i] -> remote[i]`` for every i)."""
    if len(local) != len(remote):
        raise ValueError(f"{len(local)} local blocks for {len(remote)} remote ones")
    if len(local) == 0:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty
    breaks = np.flatnonzero((np.diff(local) != 1) | (np.diff(remote) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [len(local)])))
    return local[starts], remote[starts], lengths


def layer_descs(pool: NixlPool, half_bytes: int, layer: int, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``[2*runs, 3]`` uint64 rows ``(address, bytes, device)``: the K then V halves of each run of
    blocks of ``layer`` in ``pool`` (see the module docstring for the address formula)."""
    rows = np.empty((2 * len(starts), 3), dtype=np.uint64)
    for kv in (0, 1):
        part = rows[kv * len(starts):(kv + 1) * len(starts)]
        part[:, 0] = pool.addr + ((layer * 2 + kv) * pool.num_blocks + starts) * half_bytes
        part[:, 1] = lengths * half_bytes
        part[:, 2] = pool.dev
    return rows
