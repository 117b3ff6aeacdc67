"""Paged causal attention in Triton, same contract as :func:`shiftnode_kernels.reference.paged_attention`.

Two code paths, picked by :func:`paged_attention` from ``max_seqlen_q``:

* **decode** (``max_seqlen_q == 1``): one program per (sequence, KV head, split). It loads the query
  rows of all ``group = num_heads // num_kv_heads`` query heads that share the KV head, so every key
  and value is read once per group. With ``num_splits > 1`` the context is cut into equal chunks that
  run in parallel and a second kernel merges the partial results by their log-sum-exp
  (Flash-Decoding, Dao, Haziza, Massa & Sizov 2023). Split-K is chosen automatically when the
  batch is too small to fill the device and the context is long.
* **prefill / varlen** (``max_seqlen_q > 1``): FlashAttention-2 tiling (Dao 2023): one program per
  (query tile, KV head, sequence), online softmax over key tiles read through the block table. The
  M dimension of a tile packs ``BLOCK_M // group`` query tokens times the ``group`` query heads of one
  KV head (so keys/values are again read once per group), which also makes rows of decode-length
  sequences in a mixed batch cheap. Works for chunked prefill on top of a cached prefix: query row
  ``j`` of sequence ``i`` sits at position ``seq_lens[i] - q_len_i + j``.

Keys are gathered through the block table per key (``block_tables[s, pos // block_size]``), so a tile
may span several cache blocks and the block size only has to be a power of two. Scores are kept in
base-2 units (``qk * scale * log2(e)``, ``exp2``). Math is in float32; ``P @ V`` runs in the value
dtype (fp16/bf16 tensor cores) with fp32 accumulation, fp32 inputs use IEEE fp32 dots.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from shiftnode_kernels._common import interpreting, new_empty, next_pow2, sm_count

_LOG2E = 1.4426950408889634
_NEG_BIG = tl.constexpr(-1.0e30)  # finite "minus infinity" for running maxima: avoids inf - inf = NaN

# Decode split-K policy (Flash-Decoding): each split covers at least this many tokens, at most this many
# splits, and we split only while (seqs x kv heads) programs are fewer than TARGET_WAVES x SMs.
DECODE_MIN_SPLIT_TOKENS = 512
DECODE_MAX_SPLITS = 32
DECODE_TARGET_WAVES = 2


@triton.jit
def _load_2d(ptrs, row_ok, col_ok, MASK_ROWS: tl.constexpr, MASK_COLS: tl.constexpr):
    """Load a 2-D tile, masking rows and/or columns only where needed (unmasked loads vectorise)."""
    if MASK_ROWS and MASK_COLS:
        x = tl.load(ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    elif MASK_ROWS:
        x = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    elif MASK_COLS:
        x = tl.load(ptrs, mask=col_ok[None, :], other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _dot(a, b, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """``a @ b`` with fp32 accumulation. ``UPCAST``: multiply in fp32 instead. Only used under the
    interpreter for bf16, whose ``tl.dot`` multiplies raw bf16 bit patterns (triton-lang/triton#11584)."""
    if UPCAST:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a, b, input_precision=DOT_PREC)
    return c


@triton.jit
def _attend_keys(
    acc, m_i, l_i, q, q_pos,
    k_ptr, v_ptr, table_ptr, start, end,
    stride_kb, stride_ks, stride_vb, stride_vs, qk_scale, offs_d, d_ok,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, EVEN_D: tl.constexpr,
    MASKED: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    """Online-softmax update of ``(acc, m_i, l_i)`` with keys ``[start, end)`` of one sequence.

    ``q``: ``[M, HEAD_PAD]``; ``q_pos``: ``[M]`` query positions; ``k_ptr``/``v_ptr`` point at the KV
    head inside block 0; ``table_ptr`` at the sequence's block-table row. With ``MASKED=False`` the
    caller guarantees ``end - start`` is a multiple of ``BLOCK_N`` and every key is visible to every
    row, so loads and scores go unmasked; otherwise keys ``>= end`` and keys after a row's position are
    masked.
    """
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        if MASKED:
            blk = tl.load(table_ptr + offs_n // BLOCK_SIZE, mask=n_ok, other=0)
        else:
            blk = tl.load(table_ptr + offs_n // BLOCK_SIZE)
        blk = blk.to(tl.int64)
        in_blk = offs_n % BLOCK_SIZE
        k_rows = blk * stride_kb + in_blk * stride_ks
        v_rows = blk * stride_vb + in_blk * stride_vs
        k = _load_2d(k_ptr + k_rows[:, None] + offs_d[None, :], n_ok, d_ok, MASKED, not EVEN_D)
        v = _load_2d(v_ptr + v_rows[:, None] + offs_d[None, :], n_ok, d_ok, MASKED, not EVEN_D)
        s = _dot(q, tl.trans(k), DOT_PREC, UPCAST) * qk_scale  # [M, BLOCK_N], log2 units
        if MASKED:
            visible = (offs_n[None, :] <= q_pos[:, None]) & n_ok[None, :]
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PREC, UPCAST)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["num_splits"])
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, seq_lens_ptr, cu_q_ptr, out_ptr, part_o_ptr, part_ml_ptr,
    qk_scale, chunk, num_splits,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_tb, stride_ot, stride_oh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr, DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Grid ``(num_seqs, num_kv_heads, num_splits)``. Split ``z`` covers keys ``[z*chunk, (z+1)*chunk)``.

    ``SPLIT=False`` (one split): writes ``out[q_row, heads]`` directly. Otherwise writes the normalised
    partial output ``part_o[seq, head, z, :]`` (fp32) and ``part_ml[seq, head, z] = (max, sum)``
    (log2 units). ``num_splits`` is a runtime value so batch-size changes do not recompile.
    """
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    q_row = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_row
    seq_len = tl.load(seq_lens_ptr + seq)
    lo = split * chunk
    if (q_len == 0) | ((split > 0) & (lo >= seq_len)):
        return
    hi = tl.minimum(lo + chunk, seq_len)
    n_full = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_PAD)
    g_ok = offs_g < GROUP
    d_ok = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    q = _load_2d(q_ptr + q_row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                 g_ok, d_ok, True, HEAD_PAD != HEAD_DIM)
    q_pos = tl.zeros([BLOCK_G], dtype=tl.int32) + (seq_len - 1)

    acc = tl.zeros([BLOCK_G, HEAD_PAD], dtype=tl.float32)
    m_i = tl.zeros([BLOCK_G], dtype=tl.float32) + _NEG_BIG
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    table = table_ptr + seq.to(tl.int64) * stride_tb
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q, q_pos, k_base, v_base, table, lo, n_full,
                                 stride_kb, stride_ks, stride_vb, stride_vs, qk_scale, offs_d, d_ok,
                                 BLOCK_N, BLOCK_SIZE, HEAD_PAD == HEAD_DIM, False, DOT_PREC, UPCAST)
    acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q, q_pos, k_base, v_base, table, n_full, hi,
                                 stride_kb, stride_ks, stride_vb, stride_vs, qk_scale, offs_d, d_ok,
                                 BLOCK_N, BLOCK_SIZE, HEAD_PAD == HEAD_DIM, True, DOT_PREC, UPCAST)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    mask = g_ok[:, None] & d_ok[None, :]
    if not SPLIT:
        o_ptrs = out_ptr + q_row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        num_heads = tl.num_programs(1) * GROUP
        part = (seq * num_heads + heads).to(tl.int64) * num_splits + split  # [BLOCK_G]
        tl.store(part_o_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], o, mask=mask)
        tl.store(part_ml_ptr + part * 2, m_i, mask=g_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=g_ok)


@triton.jit(do_not_specialize=["num_splits"])
def _paged_decode_reduce_kernel(
    part_o_ptr, part_ml_ptr, seq_lens_ptr, cu_q_ptr, out_ptr, chunk, num_splits, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, SPLIT_PAD: tl.constexpr,
):
    """Grid ``(num_seqs, num_heads)``: merge the splits of one (sequence, head) by log-sum-exp weights
    ``w_z = l_z * 2^(m_z - max_z m_z)``; ``out = sum_z w_z o_z / sum_z w_z``."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_row = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_row
    if q_len == 0:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    n_valid = (seq_len + chunk - 1) // chunk  # splits that ran (the others returned early)
    offs_s = tl.arange(0, SPLIT_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    s_ok = (offs_s < n_valid) & (offs_s < num_splits)
    d_ok = offs_d < HEAD_DIM
    part = (seq * tl.num_programs(1) + head).to(tl.int64) * num_splits + offs_s
    m = tl.load(part_ml_ptr + part * 2, mask=s_ok, other=_NEG_BIG)
    l = tl.load(part_ml_ptr + part * 2 + 1, mask=s_ok, other=0.0)
    w = tl.exp2(m - tl.max(m, 0)) * l
    o = tl.load(part_o_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
                mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    total = tl.sum(w, 0)
    res = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + q_row * stride_ot + head * stride_oh + offs_d, res.to(out_ptr.dtype.element_ty),
             mask=d_ok)


@triton.jit
def _paged_prefill_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, seq_lens_ptr, cu_q_ptr, out_ptr, qk_scale,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_tb, stride_ot, stride_oh,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    """Grid ``(cdiv(max_seqlen_q, BLOCK_M // GROUP), num_kv_heads, num_seqs)``; tiles are issued last
    first because later query tiles see more keys. Row ``r`` of a tile is query token
    ``t0 + r // GROUP`` of query head ``kvh * GROUP + r % GROUP``."""
    TOKENS: tl.constexpr = BLOCK_M // GROUP
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.program_id(2)
    q_row0 = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_row0
    t0 = tile * TOKENS
    if t0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx0 = seq_len - q_len  # position of query row 0

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    tok = t0 + offs_m // GROUP
    heads = kvh * GROUP + offs_m % GROUP
    row_ok = (offs_m < TOKENS * GROUP) & (tok < q_len)
    d_ok = offs_d < HEAD_DIM
    rows = (q_row0 + tok).to(tl.int64)
    q = _load_2d(q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                 row_ok, d_ok, True, HEAD_PAD != HEAD_DIM)
    q_pos = ctx0 + tok

    # Keys [0, first_pos] are visible to every row of the tile: an unmasked bulk loop over whole
    # tiles, then masked tiles up to the last row's position (the causal diagonal).
    first_pos = ctx0 + t0
    last_pos = ctx0 + tl.minimum(t0 + TOKENS, q_len) - 1
    n_full = tl.maximum(first_pos + 1, 0) // BLOCK_N * BLOCK_N
    hi = tl.minimum(last_pos + 1, seq_len)

    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + _NEG_BIG
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    table = table_ptr + seq.to(tl.int64) * stride_tb
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q, q_pos, k_base, v_base, table, 0, n_full,
                                 stride_kb, stride_ks, stride_vb, stride_vs, qk_scale, offs_d, d_ok,
                                 BLOCK_N, BLOCK_SIZE, HEAD_PAD == HEAD_DIM, False, DOT_PREC, UPCAST)
    acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q, q_pos, k_base, v_base, table, n_full, hi,
                                 stride_kb, stride_ks, stride_vb, stride_vs, qk_scale, offs_d, d_ok,
                                 BLOCK_N, BLOCK_SIZE, HEAD_PAD == HEAD_DIM, True, DOT_PREC, UPCAST)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q):
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"bad shapes: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, "
                         f"v_cache {tuple(v_cache.shape)}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"q, k_cache, v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if q.shape[1] % k_cache.shape[2] != 0 or q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} does not fit the cache's heads {tuple(k_cache.shape[2:])}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache / v_cache need a unit stride on head_dim")
    bs = k_cache.shape[1]
    if bs & (bs - 1):
        raise ValueError(f"block_size must be a power of two, got {bs}")
    if cu_seqlens_q.shape[0] != seq_lens.shape[0] + 1 or block_tables.shape[0] < seq_lens.shape[0]:
        raise ValueError("cu_seqlens_q must have num_seqs + 1 entries and block_tables num_seqs rows")


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Flash-Decoding split count: 1 unless the (seq, kv head) programs underfill the device and the
    context is long enough that each split still gets ``DECODE_MIN_SPLIT_TOKENS`` tokens."""
    programs = max(num_seqs * num_kv_heads, 1)
    target = DECODE_TARGET_WAVES * sm_count(device)
    if programs >= target or max_context < 2 * DECODE_MIN_SPLIT_TOKENS:
        return 1
    return max(1, min(-(-target // programs), max_context // DECODE_MIN_SPLIT_TOKENS, DECODE_MAX_SPLITS))


def _decode_config(dtype: torch.dtype, head_pad: int) -> tuple[int, int]:
    """(BLOCK_N, num_warps) of the decode kernel, chosen so that nothing spills on sm_90."""
    if dtype == torch.float32:  # fp32 dots run on FMA units and hold whole tiles in registers
        return (16, 4) if head_pad <= 128 else (16, 8)
    return (64, 4) if head_pad <= 128 else (32, 4)


def _prefill_config(dtype: torch.dtype, head_pad: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the prefill kernel (FlashAttention-2-like tiles on sm_90)."""
    if dtype == torch.float32:
        return (32, 16, 8) if head_pad <= 128 else (16, 16, 4)
    return (128, 64, 8) if head_pad <= 128 else (64, 32, 8)


def _dot_prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp16/bf16 ignore it; fp32 must not use tf32


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
) -> torch.Tensor:
    """Triton :func:`shiftnode_kernels.reference.paged_attention` (same arguments, same result).

    ``q [T, H, D]``, caches ``[num_blocks, block_size, Hkv, D]`` (same dtype as ``q``; fp32/fp16/bf16),
    ``block_tables [S, max_blocks] int32``, ``seq_lens [S] int32``, ``cu_seqlens_q [S+1] int32``.
    Returns ``[T, H, D]`` in ``q.dtype``. Never synchronises with the device: the longest context is
    bounded by ``block_tables.shape[1] * block_size``.
    """
    return paged_attention_impl(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, max_seqlen_q, scale)


def paged_attention_impl(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, max_seqlen_q, scale,
                         num_splits: int | None = None) -> torch.Tensor:
    """:func:`paged_attention` with the decode split count exposed (``None``: automatic) for tests and
    benchmarks."""
    _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q)
    out = new_empty(q.shape, q.dtype, q.device)
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    head_pad = max(next_pow2(head_dim), 16)
    qk_scale = float(scale) * _LOG2E
    prec = _dot_prec(q.dtype)
    upcast = interpreting() and q.dtype == torch.bfloat16
    common_strides = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                      v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
                      out.stride(0), out.stride(1))

    if max_seqlen_q <= 1:
        block_n, warps = _decode_config(q.dtype, head_pad)
        block_g = max(next_pow2(group), 16)
        max_context = block_tables.shape[1] * block_size
        splits = num_splits or decode_num_splits(num_seqs, num_kv_heads, max_context, q.device)
        chunk = math.ceil(max(max_context, 1) / splits / block_n) * block_n
        splits = max(1, math.ceil(max_context / chunk))  # drop splits that could never hold a key
        if splits > 1:
            part_o = new_empty((num_seqs, num_heads, splits, head_dim), torch.float32, q.device)
            part_ml = new_empty((num_seqs, num_heads, splits, 2), torch.float32, q.device)
        else:
            part_o = part_ml = out  # unused
        _paged_decode_kernel[(num_seqs, num_kv_heads, splits)](
            q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out, part_o, part_ml,
            qk_scale, chunk, splits, *common_strides,
            GROUP=group, BLOCK_G=block_g, HEAD_DIM=head_dim, HEAD_PAD=head_pad, BLOCK_N=block_n,
            BLOCK_SIZE=block_size, SPLIT=splits > 1, DOT_PREC=prec, UPCAST=upcast, num_warps=warps, num_stages=2,
        )
        if splits > 1:
            _paged_decode_reduce_kernel[(num_seqs, num_heads)](
                part_o, part_ml, seq_lens, cu_seqlens_q, out, chunk, splits, out.stride(0), out.stride(1),
                HEAD_DIM=head_dim, HEAD_PAD=head_pad, SPLIT_PAD=next_pow2(splits),
                num_warps=4,
            )
        return out

    block_m, block_n, warps = _prefill_config(q.dtype, head_pad)
    if interpreting():
        block_m = 32  # the interpreter pays per element: small tiles waste less on short test prompts
    block_m = max(block_m, next_pow2(group))
    tokens_per_tile = block_m // group
    grid = (triton.cdiv(max_seqlen_q, tokens_per_tile), num_kv_heads, num_seqs)
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out, qk_scale, *common_strides,
        GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=head_dim, HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size, DOT_PREC=prec, UPCAST=upcast, num_warps=warps, num_stages=2,
    )
    return out
