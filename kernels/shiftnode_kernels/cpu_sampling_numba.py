"""Temperature / top-p / min-p sampling of whole rows without sorting, as one compiled CPU loop (Numba).

Why: the torch path (:mod:`node.worker.sampler`) finds a top-p nucleus by ordering the vocabulary
(``topk`` of a candidate set, a full sort when the nucleus is larger). On one core of this project's
CPU that costs 4.9 s for a 256-row step of Llama-3's 128,256 flat logits and 0.33 s for peaked ones,
against 38 ms for the greedy argmax; a plain temperature row pays three elementwise passes and a
cumsum (0.13 s per such step). This kernel reads each row once from memory and then works on one
4 KiB block at a time, vectorised, whatever the distribution (``python -m bench.device.sampler``).

Algorithm, per row (``x`` float32 logits, temperature ``T``, ``top_p``, ``min_p``):

1. Per block of :data:`BLOCK` tokens: its maximum ``m_b``, then ``w_i = exp((x_i - m_b) / T)`` while
   the block is in L1 (Cephes ``expf``, S. L. Moshier, Cephes Math Library: a degree-7 polynomial
   times ``2**n`` made from its exponent bits; ~1e-7 relative error; arguments below -87 give 0) and
   the block's sum. Then ``m = max_b m_b`` and each block's scale ``c_b = exp((m_b - m) / T)`` (its
   largest weight): token ``i``'s weight is ``g_i = w_i * c_b``, in ``(0, 1]``, 1 for the maximum, and
   ``Z = sum_i g_i``. Reading the row once this way, rather than a max pass then an exp pass, saves a
   trip to memory per row. A row with a NaN, an infinite maximum or ``m / T`` overflowing is flagged
   degenerate and left to the caller (the argmax fallback of the torch path).
2. The proposal set ``S = {g_i >= min_p}`` (min-p, Nguyen et al. 2024, arXiv:2407.01082:
   ``p_i >= min_p * p_max`` is ``g_i >= min_p``) and its mass per block, blocks with ``c_b < min_p``
   skipped.
3. Draw ``j`` from ``S`` by inverse CDF in vocabulary order with one uniform ``u``: the block whose
   cumulative mass first exceeds ``u * mass(S)`` (block sums), then the token inside it.
4. Top-p (Holtzman et al. 2020, arXiv:1904.09751) by **rejection**, the sorting-free top-p of
   FlashInfer (Ye et al. 2025, "Sorting-Free GPU Kernels for LLM Sampling"): the nucleus is
   ``{i : sum_{g_k > g_i} g_k < top_p * Z}``, an upper set of the weights. Accept ``j`` when its mass
   above is below ``top_p * Z`` (one vectorised pass over the blocks whose ``c_b`` exceeds ``g_j``);
   otherwise every token with ``g_i <= g_j`` is outside the nucleus too, so the proposal set shrinks to
   ``{g_i > g_j}`` and step 3 runs again with the row's next uniform. A draw from ``p`` restricted to a
   superset of the nucleus, kept only when it falls inside, is a draw from the renormalised nucleus
   (rejection sampling), so the result has exactly the nucleus distribution. The first draw is
   accepted with probability at least ``top_p`` and each rejection moves the pivot up, so a row takes
   about ``1 / top_p`` rounds on average and ``O(log V)`` for tiny ``top_p``; the maximum is always
   accepted, so the loop ends.

Ties with the boundary weight are kept together (the nucleus is defined by the mass strictly above a
token), where a sort keeps the tied tokens its order puts first. Plain temperature rows
(``top_p >= 1``) accept the first draw: the token of the torch path's vocabulary-order inverse CDF
for the same ``u``, up to float rounding at a CDF boundary.

Uniforms: round 0 uses the caller's ``u0`` (the sampler's documented per-row uniform); round ``k >= 1``
uses ``SplitMix64(key ^ k * C)`` (Steele, Lea & Flood 2014, OOPSLA; constants from Vigna's
splitmix64.c) of the row's 64-bit ``key``, so a seeded row's rounds depend only on its seed and output
index, never on the batch. The loop runs on the calling thread (nogil), for the reason given in
:mod:`shiftnode_kernels.cpu_decode_numba`. Compiled on first use, then cached on disk next to this file.
"""

from __future__ import annotations

import numpy as np
import torch

from shiftnode_kernels._cephes import float32_constants
from shiftnode_kernels._numba_lazy import LazyKernel

__all__ = ["available", "draw", "BLOCK", "ROUND_STRIDE"]

BLOCK = 1024
"""Tokens per block of partial sums: the draw scans one block after a walk over ``V / BLOCK`` sums."""

ROUND_STRIDE = 0xD6E8FEB86659FD93
"""Odd 64-bit multiplier separating a row's rounds: round ``k`` hashes ``key ^ (k * ROUND_STRIDE)``."""

# The kernel's compiled helpers are module globals, not closure cells, so Numba's disk cache can key on them.
_splitmix = _bits_to_float = _proposal_mass = _first_max = None


def _build():
    global _splitmix, _bits_to_float, _proposal_mass, _first_max
    import math

    from llvmlite import ir
    from numba import njit, types
    from numba.extending import intrinsic

    @intrinsic
    def _bits_to_float(typingctx, bits):
        """The float32 whose bits are the low 32 of the integer ``bits`` (an LLVM bitcast: vectorises)."""
        if not isinstance(bits, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            low = args[0] if bits.bitwidth == 32 else builder.trunc(args[0], ir.IntType(32))
            return builder.bitcast(low, ir.FloatType())

        return types.float32(bits), codegen

    log2e, ln2_hi, ln2_lo, p0, p1, p2, p3, p4, p5, x_min = float32_constants()  # Cephes expf
    block = BLOCK
    golden = np.uint64(0x9E3779B97F4A7C15)
    mix1, mix2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
    stride = np.uint64(ROUND_STRIDE)
    s30, s27, s31, s11 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(11)

    @njit(cache=True, nogil=True)
    def _splitmix(x):  # pragma: no cover - compiled
        z = x + golden
        z = (z ^ (z >> s30)) * mix1
        z = (z ^ (z >> s27)) * mix2
        return z ^ (z >> s31)

    fast = {"nsz", "arcp", "contract", "afn", "reassoc"}  # no nnan/ninf: NaN and -inf must compare as such

    @njit(fastmath=fast, cache=True, boundscheck=False, nogil=True)
    def _proposal_mass(w, scale, pivot, mp, bsum):  # pragma: no cover - compiled
        # bsum[b] = mass of block b's tokens with g > pivot and g >= mp (g = w * c_b); blocks whose maximum
        # weight c_b fails either test are skipped
        vocab = w.shape[0]
        for b in range(bsum.shape[0]):
            c = scale[b]
            if c <= pivot or c < mp:
                bsum[b] = 0.0
                continue
            part = np.float32(0.0)
            for i in range(b * block, min(vocab, (b + 1) * block)):
                g = w[i] * c
                part += g if (g > pivot and g >= mp) else np.float32(0.0)
            bsum[b] = part

    @njit(cache=True, boundscheck=False, nogil=True)
    def _first_max(xr, bmax, m):  # pragma: no cover - compiled
        # the first token whose logit is the row's maximum m (blocks found by their maxima bmax)
        for b in range(bmax.shape[0]):
            if bmax[b] == m:
                for i in range(b * block, min(xr.shape[0], (b + 1) * block)):
                    if xr[i] == m:
                        return i
        return 0

    @njit(fastmath=fast, cache=True, boundscheck=False, nogil=True)
    def kernel(x, rows, temp, top_p, min_p, u0, keys, out, bad):  # pragma: no cover - compiled
        # x [N, V] float32; rows [R] int64; temp/top_p/min_p [R] float32; u0 [R] float64; keys [R] uint64;
        # out [R] int64 (tokens); bad [R] bool (degenerate rows, out left unset)
        vocab = x.shape[1]
        nblocks = (vocab + block - 1) // block
        w = np.empty(vocab, dtype=np.float32)  # g_i / c_b: each weight relative to its block's maximum
        bmax = np.empty(nblocks, dtype=np.float32)
        scale = np.empty(nblocks, dtype=np.float32)  # c_b = exp((max_b - max) / T), a block's largest weight
        bsum = np.empty(nblocks, dtype=np.float64)  # proposal mass per block
        for r in range(rows.shape[0]):
            xr = x[rows[r]]
            inv_t = np.float32(1.0) / temp[r]
            nan = False
            # one read of the row: per block its maximum, then the weights relative to it (L1-resident)
            for b in range(nblocks):
                lo, hi = b * block, min(vocab, (b + 1) * block)
                mb = xr[lo]
                for i in range(lo, hi):  # NaNs never win a comparison: they are caught by the sum below
                    v = xr[i]
                    mb = v if v > mb else mb
                bmax[b] = mb
                if not np.isfinite(mb):  # all -inf (no weight), +inf or a NaN first (the row is degenerate)
                    nan |= mb != mb
                    scale[b] = 0.0
                    bsum[b] = 0.0
                    continue
                # Cephes expf, vectorised: the polynomial times 2**n built from its exponent bits; a NaN
                # logit keeps its NaN (``+ (a - a)``) so the block sum shows it; -inf gives 0
                full = np.float32(0.0)
                for i in range(lo, hi):
                    a = (xr[i] - mb) * inv_t
                    c = max(a, x_min)
                    fx = np.floor(c * log2e + np.float32(0.5))
                    z = c - fx * ln2_hi - fx * ln2_lo
                    y = ((((p0 * z + p1) * z + p2) * z + p3) * z + p4) * z + p5
                    e = (y * z * z + z + np.float32(1.0) + (a - a)) * _bits_to_float((np.int32(fx) + np.int32(127)) << 23)
                    wi = np.float32(0.0) if a < x_min else e
                    w[i] = wi
                    full += wi
                nan |= full != full
                bsum[b] = full
                scale[b] = 1.0
            m = bmax[0]
            for b in range(1, nblocks):
                m = max(m, bmax[b])
            if nan or not np.isfinite(m) or not np.isfinite(m * inv_t) or not (temp[r] > 0):
                bad[r] = True
                continue
            bad[r] = False
            # global weights g_i = w_i * c_b (float32 products, the one form every test below uses)
            z_full = 0.0
            for b in range(nblocks):
                if scale[b] > 0.0:
                    scale[b] = math.exp((np.float64(bmax[b]) - m) * inv_t)
                    bsum[b] *= scale[b]
                z_full += bsum[b]
            mp = min_p[r]
            pivot = np.float32(0.0)  # proposal set: g > pivot and g >= min_p (zero weights never drawn)
            if mp > 0:
                _proposal_mass(w, scale, pivot, mp, bsum)
            tp = top_p[r]
            limit = np.float64(tp) * z_full
            u = u0[r]
            k = 0
            while True:
                total = 0.0
                for b in range(nblocks):
                    total += bsum[b]
                if not total > 0.0:  # an empty proposal set (min_p > 1, top_p <= 0 past the API's checks)
                    j = _first_max(xr, bmax, m)
                    break
                target = min(u * total, np.nextafter(total, 0.0))
                # the block whose cumulative mass first exceeds the target, then the token inside it
                acc = 0.0
                b = 0
                while b < nblocks - 1 and acc + bsum[b] <= target:
                    acc += bsum[b]
                    b += 1
                j = -1
                for bb in range(b, -1, -1):  # float rounding may leave the target past a block's tokens:
                    if bsum[bb] <= 0.0:  # then the last proposal token at or before it
                        continue
                    c = scale[bb]
                    for i in range(bb * block, min(vocab, (bb + 1) * block)):
                        g = w[i] * c
                        if g > pivot and g >= mp:
                            j = i
                            acc += g
                            if acc > target and bb == b:
                                break
                    if j >= 0:
                        break
                if tp >= np.float32(1.0):
                    break
                # accept when the mass strictly above g_j is under top_p * Z (a block whose maximum weight,
                # c_b, is not above g_j holds none of it)
                gj = w[j] * scale[j // block]
                above = 0.0
                for b2 in range(nblocks):
                    if scale[b2] <= gj:
                        continue
                    c = scale[b2]
                    part = np.float32(0.0)
                    for i in range(b2 * block, min(vocab, (b2 + 1) * block)):
                        g = w[i] * c
                        part += g if g > gj else np.float32(0.0)
                    above += part
                if above < limit:
                    break
                # rejected: every token at or below g_j is outside the nucleus too
                pivot = gj
                _proposal_mass(w, scale, pivot, mp, bsum)
                k += 1
                u = np.float64(_splitmix(keys[r] ^ (np.uint64(k) * stride)) >> s11) * 2.0**-53
            out[r] = j

    return kernel


def _warm(kernel) -> None:
    one = np.ones(1, dtype=np.float32)
    kernel(np.zeros((1, 2), dtype=np.float32), np.zeros(1, dtype=np.int64), one, one * 0.5, one * 0,
           np.zeros(1), np.zeros(1, dtype=np.uint64), np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.bool_))


_lazy = LazyKernel(_build, _warm)


def available() -> bool:
    """True when the kernel can run (Numba imports and has a writable cache folder); the first call
    compiles it or loads it from disk."""
    return _lazy.get() is not None


def draw(logits: torch.Tensor, rows: list[int], temperature: list[float], top_p: list[float], min_p: list[float],
         u0: torch.Tensor, keys: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Sample one token for each of ``rows`` of ``logits``, or ``None`` when the kernel does not apply
    (Numba missing, logits not float32 contiguous on the CPU).

    Args:
        logits: ``[N, V]`` float32 CPU, penalised; only ``rows`` are read, nothing is written.
        rows: indices of the rows to sample (none with top-k).
        temperature: per row, > 0. top_p: per row, in ``(0, 1]`` (1: off). min_p: per row, in ``[0, 1]``.
        u0: ``[len(rows)]`` float64 uniforms in ``[0, 1)`` for each row's first draw.
        keys: per row, the 64-bit key of its later rounds (``0 <= key < 2**64``).

    Returns:
        ``(tokens, bad)``: ``[len(rows)]`` int64 token ids and ``[len(rows)]`` bool, True for degenerate rows
        (NaN, infinite maximum, temperature overflow) whose token is left for the caller to choose.
    """
    if (logits.dtype != torch.float32 or logits.device.type != "cpu" or not logits.is_contiguous()
            or logits.dim() != 2 or not available()):
        return None
    n = len(rows)
    out = np.empty(n, dtype=np.int64)
    bad = np.empty(n, dtype=np.bool_)
    _lazy.kernel(logits.numpy(), np.asarray(rows, dtype=np.int64), np.asarray(temperature, dtype=np.float32),
            np.asarray(top_p, dtype=np.float32), np.asarray(min_p, dtype=np.float32),
            u0.numpy().astype(np.float64, copy=False), np.asarray(keys, dtype=np.uint64), out, bad)
    return torch.from_numpy(out), torch.from_numpy(bad)
