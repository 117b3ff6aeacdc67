"""Paged decode attention as one compiled CPU loop (Numba), reading K and V in place from the cache.

The torch formulation of :mod:`kernels.cpu_attention` must gather each sequence's blocks into a
contiguous buffer before its GEMMs, which copies every context byte once more than it reads it; on
this project's 2-core machine that copy and the per-op overheads are most of a decode step. This
kernel walks each sequence's block table and reads the K/V rows where they lie, with the block-wise
online softmax of FlashAttention (Dao et al. 2022; Milakov & Gimelshein 2018): per block, the
``block_size`` scores, the block maximum, one rescale of the running sum and accumulator when the
maximum grows, then ``exp`` and the weighted V rows. One job per (sequence, KV head) computes its
``G = heads / kv_heads`` query heads, so grouped-query heads share each K/V row they read. Float32
only (the CPU serving dtype); other dtypes take the torch path.

The loop runs on the calling thread, without a thread pool, on purpose: the node's event loop and
every emulated device's worker thread share the same cores, and on this project's 2-core machine a
2-thread ``prange`` version ran 1x to 8x slower than the serial one from run to run (a parallel
region waits for its slowest thread, and the other core is rarely free), while devices stepping in
their own threads still run their kernels side by side (``nogil``).

Numba is optional: :func:`available` is False when it cannot be imported, and the caller falls back.
The kernel is compiled on first use (about 3 s, then cached on disk next to this file, so later
processes load it in well under a second).
"""

from __future__ import annotations

import threading

import torch

__all__ = ["available", "paged_decode"]

_lock = threading.Lock()  # one compile, whichever device thread asks first
_kernel = None
_import_error: str | None = None


def _build():
    import math

    import numpy as np
    from numba import njit

    @njit(fastmath=True, cache=True, boundscheck=False, nogil=True)
    def decode(q, k, v, tables, lens, scale, out):  # pragma: no cover - compiled
        # q, out [S, Hkv, G, D]; k, v [num_blocks, bs, Hkv, D]; tables [S, W] int32; lens [S] int32
        num_seqs, num_kv_heads, group, head_dim = q.shape
        block_size = k.shape[1]
        run_max = np.empty(group, dtype=np.float32)
        run_sum = np.empty(group, dtype=np.float32)
        acc = np.empty((group, head_dim), dtype=np.float32)
        scores = np.empty((group, block_size), dtype=np.float32)
        qs = np.empty((group, head_dim), dtype=np.float32)
        for job in range(num_seqs * num_kv_heads):
            s = job // num_kv_heads
            h = job - s * num_kv_heads
            ctx = lens[s]
            if ctx <= 0:  # no context: zeros, as the reference
                for g in range(group):
                    for d in range(head_dim):
                        out[s, h, g, d] = 0.0
                continue
            run_max[:] = -np.inf
            run_sum[:] = 0.0
            acc[:] = 0.0
            for g in range(group):
                for d in range(head_dim):
                    qs[g, d] = q[s, h, g, d] * scale
            for b in range((ctx + block_size - 1) // block_size):
                blk = tables[s, b]
                n = min(block_size, ctx - b * block_size)
                for g in range(group):
                    block_max = np.float32(-np.inf)
                    for t in range(n):
                        dot = np.float32(0.0)
                        for d in range(head_dim):
                            dot += qs[g, d] * k[blk, t, h, d]
                        scores[g, t] = dot
                        if dot > block_max:
                            block_max = dot
                    if block_max > run_max[g]:  # rescale what was summed under the old maximum
                        corr = math.exp(run_max[g] - block_max)
                        run_sum[g] *= corr
                        for d in range(head_dim):
                            acc[g, d] *= corr
                        run_max[g] = block_max
                    m = run_max[g]
                    for t in range(n):
                        p = math.exp(scores[g, t] - m)
                        run_sum[g] += p
                        for d in range(head_dim):
                            acc[g, d] += p * v[blk, t, h, d]
            for g in range(group):
                inv = np.float32(1.0) / run_sum[g]
                for d in range(head_dim):
                    out[s, h, g, d] = acc[g, d] * inv

    return decode


def available() -> bool:
    """True when the Numba kernel can run (Numba imports). The first call compiles it (or loads it from
    the disk cache) by running it once on a one-token batch, so a node pays that at start-up
    (:func:`kernels.ops.get_ops` calls this for the ``cpu`` backend) rather than in its first step."""
    global _kernel, _import_error
    if _kernel is not None:
        return True
    if _import_error is not None:
        return False
    with _lock:
        if _kernel is None and _import_error is None:
            try:
                kernel = _build()
            except ImportError as e:
                _import_error = str(e)
                return False
            import numpy as np

            q = np.zeros((1, 1, 1, 2), dtype=np.float32)
            kv = np.zeros((1, 1, 1, 2), dtype=np.float32)
            kernel(q, kv, kv, np.zeros((1, 1), dtype=np.int32), np.ones(1, dtype=np.int32), 1.0, q.copy())
            _kernel = kernel
    return _kernel is not None


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, out: torch.Tensor) -> bool:
    """Decode attention of one query row per sequence, written into ``out``; False (nothing done) when
    this kernel does not apply: Numba missing, a dtype other than float32 or int32 tables, tensors
    not on the CPU or not contiguous.

    Args:
        q, out: ``[num_seqs, num_heads, head_dim]`` float32; row ``i`` is sequence ``i``'s new token.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` float32.
        block_tables: ``[num_seqs, width]`` int32; the first ``ceil(seq_lens[i] / block_size)`` entries
            of row ``i`` must be valid block ids (they are read unchecked), the rest are never read.
        seq_lens: ``[num_seqs]`` int32 contexts; a sequence with 0 gets zeros.
        scale: softmax scale.
    """
    tensors = (q, k_cache, v_cache, block_tables, seq_lens, out)
    if (q.dtype != torch.float32 or k_cache.dtype != torch.float32 or v_cache.dtype != torch.float32
            or out.dtype != torch.float32 or block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32
            or any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors) or not available()):
        return False
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    shape4 = (num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    _kernel(q.view(shape4).numpy(), k_cache.numpy(), v_cache.numpy(), block_tables.numpy(),
            seq_lens.numpy(), float(scale), out.view(shape4).numpy())
    return True
