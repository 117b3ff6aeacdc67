"""A grammar's token bitmask applied to CPU logits in place, as one compiled loop (Numba).

Structured output (:mod:`node.worker.grammar`) masks each constrained row's disallowed tokens to
``-inf`` before sampling. The bitmask is xgrammar's: ``[M, ceil(V / 32)]`` int32, bit ``t % 32`` of word
``t // 32`` of a row set when token ``t`` is allowed. xgrammar's own CPU kernel
(``apply_token_bitmask_inplace``) took 149 µs of CPU for 64 rows of stories260k's 512-token vocabulary
with the logits in cache, this loop 12-16 µs (5 µs for one row: the call's fixed cost); in the engine's
step it fell from 2.0% to 0.4% of the engine's samples at 64 constrained streams (py-spy). Where the
logits are not in cache (``python -m bench.load.structured``'s in-process walk, between xgrammar's fill
and a fresh ``randn``), both take about 2 µs a token (2.2 against 2.0; why both are slower there was not
isolated).
A logit is kept by an ``and`` with all ones or replaced by ``-inf``'s bits, without a branch on the
mask's bits, and words whose 32 tokens are all allowed are skipped. The result is the same as
xgrammar's: a masked logit becomes ``-inf``, the others are left as they were.

It runs on the calling thread without the GIL (``nogil``), as the other CPU kernels do
(:mod:`shiftnode_kernels.cpu_decode_numba`). Compiled on first use, then cached on disk next to this file.
"""

from __future__ import annotations

import numpy as np
import torch

from shiftnode_kernels._numba_lazy import LazyKernel

__all__ = ["available", "apply_bitmask"]


def _build():
    from numba import njit

    ninf_bits = np.int32(np.array(-np.inf, dtype=np.float32).view(np.int32))  # 0xFF800000

    @njit(cache=True, boundscheck=False, nogil=True)
    def kernel(xi, mask, rows, vocab):  # pragma: no cover - compiled
        # xi [N, V] int32, the float32 logits' bits (written); mask [M, W] int32; rows [R] int64 (each < N
        # and < M); vocab <= V, <= 32 W. A logit is kept by an and with all ones, or replaced by -inf's bits
        full = vocab // 32
        for r in rows:
            xr = xi[r]
            mr = mask[r]
            for w in range(full):
                bits = mr[w]
                if bits == -1:  # all 32 allowed
                    continue
                base = w * 32
                for j in range(32):
                    keep = -((bits >> j) & 1)  # all ones where allowed (arithmetic shift: bit 31 read right)
                    xr[base + j] = (xr[base + j] & keep) | (ninf_bits & ~keep)
            if full * 32 < vocab:
                bits = mr[full]
                base = full * 32
                for j in range(vocab - base):
                    keep = -((bits >> j) & 1)
                    xr[base + j] = (xr[base + j] & keep) | (ninf_bits & ~keep)

    return kernel


def _warm(kernel) -> None:
    kernel(np.zeros((1, 2), dtype=np.int32), np.ones((1, 1), dtype=np.int32), np.zeros(1, dtype=np.int64), 2)


_lazy = LazyKernel(_build, _warm)


def available() -> bool:
    """True when the kernel can run (Numba imports and has a writable cache folder); the first call
    compiles it or loads it from disk."""
    return _lazy.get() is not None


def apply_bitmask(logits: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> bool:
    """Set the disallowed logits of ``rows`` of ``logits`` to ``-inf`` in place; False (nothing done)
    when the kernel does not apply: Numba missing, or not float32 ``[N, V]`` contiguous CPU logits and
    an int32 ``[M, >= ceil(V / 32)]`` contiguous CPU mask, the caller then takes xgrammar's kernel.

    Args:
        logits: ``[N, V]`` float32, CPU.
        mask: ``[M, W]`` int32, CPU, ``W >= ceil(V / 32)``; row ``r`` of the mask masks row ``r`` of the
            logits (only ``rows`` are read).
        rows: the rows to mask, each below ``N`` and ``M``.

    Raises:
        IndexError: a row outside the logits or the mask (checked here: the loop does not check).
    """
    if (logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.dim() != 2
            or not logits.is_contiguous() or mask.dtype != torch.int32 or mask.device.type != "cpu"
            or mask.dim() != 2 or not mask.is_contiguous() or mask.shape[1] * 32 < logits.shape[1]
            or not available()):
        return False
    if not rows:
        return True
    if min(rows) < 0 or max(rows) >= min(logits.shape[0], mask.shape[0]):
        raise IndexError(f"rows {min(rows)}..{max(rows)} outside logits [{logits.shape[0]}] or mask [{mask.shape[0]}]")
    _lazy.kernel(logits.numpy().view(np.int32), mask.numpy(), np.asarray(rows, dtype=np.int64), logits.shape[1])
    return True
