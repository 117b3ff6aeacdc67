"""Paged decode attention as one compiled CPU loop (Numba), reading K and V in place from the cache.

The torch formulation of :mod:`shiftnode_kernels.cpu_attention` must gather each sequence's blocks into a
contiguous buffer before its GEMMs, which copies every context byte once more than it reads it; on
this project's 2-core machine that copy and the per-op overheads are most of a decode step. This
kernel walks each sequence's block table and reads the K/V rows where they lie, with the block-wise
online softmax of FlashAttention (Dao et al. 2022; Milakov & Gimelshein 2018).

Layout of the work, chosen from profiles at the node's shapes (64 sequences, 8 query / 4 KV heads,
contexts up to ~320, block size 16; see the CPU attention section of ``bench/RESULTS.md``):

* **One sequence at a time, all heads per block.** A block's ``[block_size, kv_heads, head_dim]`` K
  (then V) is read front to back once, for every query head of the sequence (query head
  ``h * G + g`` reads KV head ``h``, ``G = heads / kv_heads``), instead of once per KV head with a
  stride. The running maximum, sum and ``[kv_heads, G, head_dim]`` accumulator of every head live
  in small buffers for the whole sequence.
* **Per block**: the ``block_size x heads`` scores (``head_dim``-long dot products, the inner loop
  the compiler vectorises); per head the block maximum and one rescale of the running sum and
  accumulator when it grows; then ``exp`` of the block's scores as one branch-free loop (Cephes
  ``expf``: ``2**n * p(r)``, the polynomial and the exponent bits computed apart so both loops
  vectorise; ~1e-7 relative error, scalar ``math.exp`` is a libm call per score); then the
  probability-weighted V rows added into the accumulators (vectorised over ``head_dim``).
* **Software prefetch** (``llvm.prefetch``) of the K and V rows of the block(s)
  :data:`PREFETCH_BYTES` ahead in (sequence, block) order, across sequence boundaries, one token
  row per token processed. The node's KV pool is far larger than the last-level cache and a
  sequence's blocks are scattered in it, so each block is a fresh stream the hardware prefetcher
  only catches up with after a few misses; at head_dim 32 the cache reads, not the arithmetic,
  bound the kernel.

Float32 math; the cache may be float32 or bfloat16 (read as int16 bits and widened in the loop, exactly,
so a bfloat16 cache is read in place too, at half the bytes); other cache dtypes take the torch path. Slots of a block past the
context are never read (a prefetch may cover them: a hint, it reads no value and cannot fault).

The loop runs on the calling thread, without a thread pool, on purpose: the node's event loop and
every emulated device's worker thread share the same cores, and on this project's 2-core machine a
2-thread ``prange`` version ran 1x to 8x slower than the serial one from run to run (a parallel
region waits for its slowest thread, and the other core is rarely free), while devices stepping in
their own threads still run their kernels side by side (``nogil``).

Numba is optional: :func:`available` is False when it cannot be imported (or finds no writable cache
folder), and the caller falls back. The kernel is compiled on first use (about 8 s, then cached on
disk next to this file, so later processes load it in about a second).
"""

from __future__ import annotations

import torch

from shiftnode_kernels._cephes import float32_constants
from shiftnode_kernels._numba_lazy import LazyKernel

__all__ = ["available", "paged_decode", "DecodePlan", "plan_decode", "PREFETCH_BYTES"]

_prefetch = _next_block = _widen = None  # compiled helpers of the kernel, set by _build

PREFETCH_BYTES = 16 << 10
"""How far ahead the kernel prefetches, in K+V bytes (whole blocks, at least one): about half the
32 KiB L1 data cache, so the lines arrive before their use and are not evicted before it (measured on
this project's 2-core VM: 1 block ahead was best at head_dim 32, 16 KiB of K+V a block; 2-4 blocks at
head_dim 8, 4 KiB; farther was slower for both)."""


def _build():
    # The helpers go into module globals, not the kernel's closure: Numba keys its disk cache on the
    # pickled closure, and an intrinsic or dispatcher pickles with a per-process id (no cache hit ever).
    global _prefetch, _next_block, _widen
    import math

    import numpy as np
    from llvmlite import ir
    from numba import njit, types
    from numba.core import cgutils
    from numba.extending import intrinsic

    @intrinsic
    def _prefetch(typingctx, arr, idx):
        """``llvm.prefetch`` (read, keep in all levels) of ``arr``'s element ``idx`` (flat, C order): a
        hint, never a fault, whatever the address."""
        if not isinstance(arr, types.Array) or not isinstance(idx, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            ary = context.make_array(signature.args[0])(context, builder, args[0])
            ptr = builder.gep(ary.data, [context.cast(builder, args[1], signature.args[1], types.intp)])
            i32 = ir.IntType(32)
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [ir.PointerType(), i32, i32, i32]), "llvm.prefetch.p0")
            builder.call(fn, [ptr, i32(0), i32(3), i32(1)])
            return context.get_dummy_value()

        return types.void(arr, idx), codegen

    @intrinsic
    def _widen(typingctx, x):
        """A cache element as float32: a float32 as it is; an int16 holding a bfloat16's bits (the
        cache viewed as int16, NumPy having no bfloat16) as the float32 with those 16 high bits, exact
        (bfloat16 is float32 with the low 16 mantissa bits dropped). Branch-free, so the loops that
        read K and V still vectorise."""
        if x == types.float32:
            return types.float32(x), lambda context, builder, signature, args: args[0]
        if x != types.int16:
            return None

        def codegen(context, builder, signature, args):
            i32 = ir.IntType(32)
            bits = builder.shl(builder.zext(args[0], i32), i32(16))
            return builder.bitcast(bits, ir.FloatType())

        return types.float32(x), codegen

    # Cephes expf (kernels/shiftnode_kernels/_cephes.py); the range used here is x <= 0, clamped at -87
    log2e, ln2_hi, ln2_lo, p0, p1, p2, p3, p4, p5, x_min = float32_constants()
    prefetch_bytes = PREFETCH_BYTES

    @njit(cache=True, nogil=True)
    def _next_block(lens, block_size, s, b):  # pragma: no cover - compiled
        # the (sequence, block) after (s, b), skipping sequences without blocks; s == len(lens) at the end
        b += 1
        while s < lens.shape[0] and b * block_size >= lens[s]:
            s += 1
            b = 0
        return s, b

    # No nnan/ninf: the running maximum starts at -inf and must compare as such.
    @njit(fastmath={"nsz", "arcp", "contract", "afn", "reassoc"}, cache=True, boundscheck=False, nogil=True)
    def decode(q, k, v, tables, lens, scale, out):  # pragma: no cover - compiled
        # q, out [S, Hkv, G, D] float32; k, v [num_blocks, bs, Hkv, D] float32, or int16 (bfloat16 bits);
        # tables [S, W] int32; lens [S] int32
        num_seqs, num_kv_heads, group, head_dim = q.shape
        block_size = k.shape[1]
        rows = num_kv_heads * group  # query heads, row r = h * group + g
        row_len = num_kv_heads * head_dim  # floats per token row of a block
        run_max = np.empty(rows, dtype=np.float32)
        run_sum = np.empty(rows, dtype=np.float32)
        acc = np.empty((num_kv_heads, group, head_dim), dtype=np.float32)
        qs = np.empty((num_kv_heads, group, head_dim), dtype=np.float32)
        scores = np.empty((rows, block_size), dtype=np.float32)
        pow2 = np.empty(block_size, dtype=np.int32)
        pow2f = pow2.view(np.float32)
        # Prefetch cursor: the block `dist` blocks ahead in (sequence, block) order, across sequences.
        dist = max(1, prefetch_bytes // (2 * block_size * row_len * k.itemsize))
        ps, pb = _next_block(lens, block_size, 0, -1)
        for _ in range(dist):
            ps, pb = _next_block(lens, block_size, ps, pb)
        for s in range(num_seqs):
            ctx = lens[s]
            if ctx <= 0:  # no context: zeros, as the reference
                for h in range(num_kv_heads):
                    for g in range(group):
                        for d in range(head_dim):
                            out[s, h, g, d] = 0.0
                continue
            for h in range(num_kv_heads):
                for g in range(group):
                    run_max[h * group + g] = -np.inf
                    run_sum[h * group + g] = 0.0
                    for d in range(head_dim):
                        qs[h, g, d] = q[s, h, g, d] * scale
                        acc[h, g, d] = 0.0
            for b in range((ctx + block_size - 1) // block_size):
                kb = k[tables[s, b]]
                vb = v[tables[s, b]]
                n = min(block_size, ctx - b * block_size)
                have_next = ps < num_seqs
                if have_next:
                    kf = k[tables[ps, pb]].ravel()
                    vf = v[tables[ps, pb]].ravel()
                else:
                    kf = kb.ravel()
                    vf = vb.ravel()
                # scores of the block's n tokens, every query head; token t also prefetches token row t
                # of the block ahead (one hint per 64-byte line: 16 floats)
                for t in range(n):
                    if have_next:
                        for i in range(t * row_len, (t + 1) * row_len, 16):
                            _prefetch(kf, i)
                            _prefetch(vf, i)
                    for h in range(num_kv_heads):
                        for g in range(group):
                            dot = np.float32(0.0)
                            for d in range(head_dim):
                                dot += qs[h, g, d] * _widen(kb[t, h, d])
                            scores[h * group + g, t] = dot
                if have_next:
                    for i in range(n * row_len, block_size * row_len, 16):
                        _prefetch(kf, i)
                        _prefetch(vf, i)
                    ps, pb = _next_block(lens, block_size, ps, pb)
                # online softmax: block maximum, one rescale when it grows, exp of the block's scores
                for h in range(num_kv_heads):
                    for g in range(group):
                        r = h * group + g
                        block_max = scores[r, 0]
                        for t in range(1, n):
                            block_max = max(block_max, scores[r, t])
                        if block_max > run_max[r]:
                            corr = math.exp(run_max[r] - block_max)
                            run_sum[r] *= corr
                            for d in range(head_dim):
                                acc[h, g, d] *= corr
                            run_max[r] = block_max
                        m = run_max[r]
                        for t in range(n):  # Cephes expf, one vectorisable loop: exp(r) and 2**n apart
                            x = max(scores[r, t] - m, x_min)
                            fx = np.floor(x * log2e + np.float32(0.5))
                            z = x - fx * ln2_hi - fx * ln2_lo
                            y = ((((p0 * z + p1) * z + p2) * z + p3) * z + p4) * z + p5
                            scores[r, t] = y * z * z + z + np.float32(1.0)
                            pow2[t] = (np.int32(fx) + np.int32(127)) << 23
                        total = np.float32(0.0)
                        for t in range(n):
                            p = scores[r, t] * pow2f[t]
                            scores[r, t] = p
                            total += p
                        run_sum[r] += total
                # weighted V rows
                for t in range(n):
                    for h in range(num_kv_heads):
                        for g in range(group):
                            p = scores[h * group + g, t]
                            for d in range(head_dim):
                                acc[h, g, d] += p * _widen(vb[t, h, d])
            for h in range(num_kv_heads):
                for g in range(group):
                    inv = np.float32(1.0) / run_sum[h * group + g]
                    for d in range(head_dim):
                        out[s, h, g, d] = acc[h, g, d] * inv

    return decode


def _warm(kernel) -> None:
    import numpy as np

    q = np.zeros((1, 1, 1, 2), dtype=np.float32)
    kv = np.zeros((1, 1, 1, 2), dtype=np.float32)
    kernel(q, kv, kv, np.zeros((1, 1), dtype=np.int32), np.ones(1, dtype=np.int32), 1.0, q.copy())


_lazy = LazyKernel(_build, _warm)


def available() -> bool:
    """True when the Numba kernel can run (Numba imports and has a writable cache folder). The first
    call compiles it (or loads it from the disk cache) by running it once on a one-token batch, so a
    node pays that at start-up (:func:`shiftnode_kernels.ops.get_ops` calls this for the ``cpu`` backend) rather
    than in its first step."""
    return _lazy.get() is not None


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, out: torch.Tensor) -> bool:
    """Decode attention of one query row per sequence, written into ``out``; False (nothing done) when
    this kernel does not apply: Numba missing, a cache dtype other than float32 or bfloat16 (or ``q``,
    ``out`` not of the cache's dtype), tables not int32, tensors not on the CPU or not contiguous.

    Args:
        q, out: ``[num_seqs, num_heads, head_dim]`` in the cache's dtype; row ``i`` is sequence ``i``'s
            new token (bfloat16 rows are widened to float32 for the kernel and the result rounded back).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` float32 or bfloat16.
        block_tables: ``[num_seqs, width]`` int32; the first ``ceil(seq_lens[i] / block_size)`` entries
            of row ``i`` must be valid block ids (they are read unchecked), the rest are never read.
        seq_lens: ``[num_seqs]`` int32 contexts; a sequence with 0 gets zeros.
        scale: softmax scale.
    """
    tensors = (q, k_cache, v_cache, block_tables, seq_lens, out)
    cache_dtype = k_cache.dtype
    if (cache_dtype not in (torch.float32, torch.bfloat16) or v_cache.dtype != cache_dtype
            or q.dtype != cache_dtype or out.dtype != cache_dtype
            or block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32
            or any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors) or not available()):
        return False
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    shape4 = (num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    if cache_dtype == torch.float32:
        _lazy.kernel(q.view(shape4).numpy(), k_cache.numpy(), v_cache.numpy(), block_tables.numpy(),
                     seq_lens.numpy(), float(scale), out.view(shape4).numpy())
        return True
    # bfloat16: the cache in place as int16 bits; the (small) query and output rows in float32
    q32 = q.float()
    out32 = torch.empty_like(q32)
    _lazy.kernel(q32.view(shape4).numpy(), k_cache.view(torch.int16).numpy(), v_cache.view(torch.int16).numpy(),
                 block_tables.numpy(), seq_lens.numpy(), float(scale), out32.view(shape4).numpy())
    out.copy_(out32)
    return True


class DecodePlan:
    """The host side of one pure decode step (one new token per sequence), converted and checked once
    and reused by every layer of the step (:func:`plan_decode`): the NumPy views of the slot mapping,
    block tables and contexts, and the kernel. Per layer, :meth:`run` is then the K/V write, the
    kernel call and four ``.numpy()`` views, about 10 us of host work on this project's CPU against
    about 30 us through :func:`paged_decode`'s per-call checks and the generic attention path
    (stories260k, batch 1: ~0.1 ms of a ~0.5 ms compiled step; ``bench.load.runner_step``)."""

    __slots__ = ("slots", "tables", "lens", "kernel")

    def __init__(self, slots, tables, lens, kernel):
        self.slots, self.tables, self.lens, self.kernel = slots, tables, lens, kernel

    def run(self, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """Write ``key, value [S, Hkv, D]`` at the plan's slots of ``k_cache, v_cache [num_blocks,
        block_size, Hkv, D]`` (float32, contiguous), then attend ``q [S, H, D]`` (float32, contiguous):
        returns ``[S, H, D]`` float32. The tensors must be those the plan was checked for: every layer of
        one step shares dtypes, devices and the pool's layout."""
        num_seqs, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        kc, vc = k_cache.numpy(), v_cache.numpy()
        kc.reshape(-1, num_kv_heads, head_dim)[self.slots] = key.numpy()
        vc.reshape(-1, num_kv_heads, head_dim)[self.slots] = value.numpy()
        out = torch.empty_like(q)
        # NumPy's reshape of a contiguous array is a view, and cheaper than torch's view then .numpy()
        shape4 = (num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
        self.kernel(q.numpy().reshape(shape4), kc, vc, self.tables, self.lens, float(scale),
                    out.numpy().reshape(shape4))
        return out


def plan_decode(q: torch.Tensor, key: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor,
                block_tables: torch.Tensor, seq_lens: torch.Tensor) -> DecodePlan | None:
    """A :class:`DecodePlan` for a step whose rows are one new token of each sequence, checked on its
    first layer's ``q [S, H, D]``, ``key [S, Hkv, D]`` and ``k_cache``; None when the kernel does not
    apply (Numba missing, not float32, int32 tables/contexts or int64 slots expected, not on the CPU or
    not contiguous, ``H`` not a multiple of ``Hkv``), and the caller takes the generic path.

    Raises:
        ValueError: a context of 0 (a decode row always sees itself: its context counts it).
    """
    tensors = (q, key, k_cache, slot_mapping, block_tables, seq_lens)
    if (q.dtype != torch.float32 or key.dtype != torch.float32 or k_cache.dtype != torch.float32
            or slot_mapping.dtype != torch.int64 or block_tables.dtype != torch.int32
            or seq_lens.dtype != torch.int32 or q.shape[1] % k_cache.shape[2]
            or any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors) or not available()):
        return None
    lens = seq_lens.numpy()
    if lens.size and int(lens.min()) < 1:
        raise ValueError(f"a decode row needs a context of at least 1, got {seq_lens.tolist()}")
    return DecodePlan(slot_mapping.numpy(), block_tables.numpy(), lens, _lazy.kernel)
