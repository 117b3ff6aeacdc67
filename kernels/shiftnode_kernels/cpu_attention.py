"""Paged attention for CPU serving: work proportional to each sequence's real context, no repeated heads.

Same contract as :func:`shiftnode_kernels.reference.paged_attention` (the test oracle; see its docstring for the
paged layout and the varlen batch), tuned for the CPU:

* **Decode rows** (sequences with one new token) of the whole batch run in one call of the compiled
  kernel of :mod:`shiftnode_kernels.cpu_decode_numba`, which reads K/V in place through the block tables
  (block-wise online softmax, one job per sequence and KV head). Without Numba, or for caches that are
  neither float32 nor bfloat16, they run as a torch block-wise softmax over *chunks* (:func:`_decode_chunks`): a chunk
  is ``m`` consecutive logical blocks of one sequence (``C = m * block_size`` tokens), so each
  sequence covers ``ceil(L / C)`` chunks and the work is its context plus less than one chunk, never
  the batch's longest context. The chunks' blocks are gathered with one ``index_select`` per K and V
  (whole blocks, contiguous memcpy rows, in the cache's ``[block_size, kv_heads, head_dim]`` layout);
  then, per KV head, one batched GEMM ``q @ k^T`` (``[chunks, G, D] x [chunks, D, C]``, the
  ``G = heads / kv_heads`` query heads of a group as the GEMM's rows) reads the gathered K through a
  strided view, so grouped-query heads share K/V and nothing is repeated or permuted. The softmax is
  exact and two-pass: the per-sequence maximum is a scatter-max of the chunk maxima, ``exp(s - max)``
  is summed per chunk, ``p @ v`` is a second batched GEMM, and chunk numerators and denominators are
  added per sequence (the split-K combine of flash-decoding, Dao et al. 2023, with the global maximum
  taken first). ``C`` follows the batch's mean context (about half of it, so padding averages under a
  quarter of the real work) between one block and :data:`MAX_CHUNK_TOKENS`.
* **Short queries** (sequences with 2 to :data:`SHORT_QUERY_TOKENS` new tokens: speculative decoding's
  verify items, a last token plus its drafts) run as decode rows too: row ``j`` of a ``q_len``-token
  query at the end of a ``ctx``-token context sees the first ``ctx - q_len + 1 + j`` tokens, which is a
  decode row of that context over the same block table (its K/V are written before attention runs). So
  a verify item costs the decode kernel's per-row work, not a gather and an SDPA call per layer, and
  each of its rows is computed as the decode step at that position would compute it.
* **Prefill rows** (sequences with more new tokens: prompts, chunked prefill over a cached prefix)
  run one :func:`torch.nn.functional.scaled_dot_product_attention` call per sequence over its own
  gathered blocks (``enable_gqa``, no repeated heads), causal with ``is_causal`` when the chunk is the
  whole context and with a bottom-right causal mask when a cached prefix precedes it. A prompt is
  long enough that the per-call cost is noise beside its quadratic work.

Math is float32 whatever the cache dtype, as in the reference. Cache slots past a sequence's context
(the tail of its last block, unwritten or stale) are never used: the compiled kernel and the prefill
path do not read them, and the chunked path masks their scores and zeroes their gathered V rows, so
NaN or garbage in them cannot leak. Host-side bookkeeping reads ``seq_lens`` and ``cu_seqlens_q``
with ``tolist()``: meant for CPU tensors (on a GPU that would be a sync per layer; use Triton there).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from shiftnode_kernels import cpu_decode_numba

__all__ = ["paged_attention", "DECODE_KERNEL", "MAX_CHUNK_TOKENS", "GATHER_BUDGET_BYTES", "SHORT_QUERY_TOKENS"]

DECODE_KERNEL = os.environ.get("SHIFTNODE_CPU_DECODE", "auto")
"""Decode rows: ``"auto"`` runs the compiled kernel where it applies (Numba installed, a float32 or bfloat16 cache) and
the torch chunks otherwise; ``"torch"`` always runs the torch chunks. Read from
``$SHIFTNODE_CPU_DECODE`` at import (benches compare the two in a node); tests set it directly."""

SHORT_QUERY_TOKENS = 8
"""Sequences with at most this many new tokens run as decode rows (one per new token, module docstring):
speculative decoding's verify items (``1 + num_speculative_tokens``) and tiny prompt chunks. Measured at
stories260k's heads on 2 loaded CPU cores (``python -m bench.load.spec_step``, CPU time of one layer): a
1+4-token query over 30 / 100 / 250 tokens took 99 / 83 / 142 us through the prefill path and 55 / 63 / 152
us as decode rows, against 25 / 25 / 50 us for one decode row. Each decode row reads its context once, so
longer queries take the prefill path, whose one SDPA call amortises over their work."""

MAX_CHUNK_TOKENS = 256
"""Upper bound of the decode chunk (tokens): past it a GEMM is already long enough to amortise its
call, and a longer chunk only adds padding."""

GATHER_BUDGET_BYTES = 64 << 20
"""Gathered K+V (float32 bytes) per decode group: large batches of long contexts run in groups of
sequences so the working set stays bounded (a 256 x 4,096-token batch of an 8B model would otherwise
gather gigabytes)."""


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
    """Causal attention of packed varlen queries over the paged cache (CPU path).

    Args:
        q: ``[num_tokens, num_heads, head_dim]`` fp32/fp16/bf16.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32; entries past a sequence's last block
            may hold any value (they are never read).
        seq_lens: ``[num_seqs]`` int32 context lengths, new tokens included.
        cu_seqlens_q: ``[num_seqs + 1]`` int32 prefix sums of query lengths (a sequence may have 0,
            and then any context, 0 included).
        max_seqlen_q: the largest query length (unused here beyond the reference's contract).
        scale: softmax scale, usually ``head_dim ** -0.5``.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``q.dtype``.

    Raises:
        ValueError: ``num_heads`` not a multiple of ``num_kv_heads``, or a sequence with more new
            tokens than context (its context counts its new tokens, so a query row always sees itself).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    out = torch.empty_like(q)
    if num_tokens == 0 or seq_lens.shape[0] == 0:
        return out
    lens = seq_lens.tolist()
    cu = cu_seqlens_q.tolist()
    rows: list[int] = []  # decode rows: the query row, its sequence, the context it sees
    row_seqs: list[int] = []
    row_lens: list[int] = []
    one_each = True  # every sequence has exactly one new token (a pure decode step)
    for i, ctx in enumerate(lens):
        q_len = cu[i + 1] - cu[i]
        if q_len > ctx:
            raise ValueError(f"sequence {i} has {q_len} new tokens but a context of {ctx}")
        one_each = one_each and q_len == 1
        if q_len == 1:
            rows.append(cu[i])
            row_seqs.append(i)
            row_lens.append(ctx)
        elif 1 < q_len <= SHORT_QUERY_TOKENS:  # row j sees ctx - q_len + 1 + j tokens: a decode row there
            rows.extend(range(cu[i], cu[i + 1]))
            row_seqs.extend([i] * q_len)
            row_lens.extend(range(ctx - q_len + 1, ctx + 1))
        elif q_len > 1:
            _prefill_one(q[cu[i]:cu[i + 1]], k_cache, v_cache, block_tables[i], ctx, scale, out[cu[i]:cu[i + 1]])
    if not rows:
        return out
    dev = q.device
    if len(rows) == num_tokens:  # every row is a decode row, in order: no gather of q, no scatter of out
        if one_each:  # one per sequence (a pure decode step): the tables as they are
            _decode(q, k_cache, v_cache, block_tables, seq_lens, lens, scale, out)
        else:
            sel = torch.tensor(row_seqs, dtype=torch.long, device=dev)
            _decode(q, k_cache, v_cache, block_tables.index_select(0, sel),
                    torch.tensor(row_lens, dtype=torch.int32, device=dev), row_lens, scale, out)
        return out
    sel = torch.tensor(row_seqs, dtype=torch.long, device=dev)
    at = torch.tensor(rows, dtype=torch.long, device=dev)
    part = torch.empty((len(rows), num_heads, head_dim), dtype=q.dtype, device=dev)
    _decode(q.index_select(0, at), k_cache, v_cache, block_tables.index_select(0, sel),
            torch.tensor(row_lens, dtype=torch.int32, device=dev), row_lens, scale, part)
    out.index_copy_(0, at, part)
    return out


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
            seq_lens: torch.Tensor, lens: list[int], scale: float, out: torch.Tensor) -> None:
    """Decode rows ``q [S, H, D]`` (row ``i``: sequence ``i``'s token at position ``lens[i] - 1``)
    into ``out [S, H, D]``: the compiled kernel when it applies, else the torch chunks."""
    if DECODE_KERNEL == "auto" and cpu_decode_numba.paged_decode(q, k_cache, v_cache, block_tables, seq_lens,
                                                                 scale, out):
        return
    _decode_chunks(q, k_cache, v_cache, block_tables, lens, scale, out)


def _prefill_one(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                 ctx: int, scale: float, out: torch.Tensor) -> None:
    """One sequence's ``q_len = q.shape[0]`` new rows over its ``ctx`` tokens, written into ``out``."""
    q_len, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    n_blocks = -(-ctx // block_size)
    ids = table[:n_blocks].long()
    k = k_cache.index_select(0, ids).view(n_blocks * block_size, num_kv_heads, head_dim)[:ctx]
    v = v_cache.index_select(0, ids).view(n_blocks * block_size, num_kv_heads, head_dim)[:ctx]
    # [1, heads, len, D] views; SDPA reads the strided K/V as they are.
    qh = q.float().transpose(0, 1).unsqueeze(0)
    kh = k.float().transpose(0, 1).unsqueeze(0)
    vh = v.float().transpose(0, 1).unsqueeze(0)
    if q_len == ctx:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:  # bottom-right causal: row j sits at position ctx - q_len + j
        pos = torch.arange(ctx - q_len, ctx, device=q.device)
        mask = torch.arange(ctx, device=q.device).view(1, -1) <= pos.view(-1, 1)
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    out.copy_(o[0].transpose(0, 1))


def chunk_blocks_for(mean_ctx: float, block_size: int) -> int:
    """Blocks per decode chunk ``m`` (a power of two): ``m * block_size`` is about half the mean
    context, at least one block and at most :data:`MAX_CHUNK_TOKENS` tokens (or one block when the
    block itself is larger)."""
    m = 1
    while 2 * m * block_size <= min(mean_ctx / 2, MAX_CHUNK_TOKENS):
        m *= 2
    return m


def _decode_chunks(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                   lens: list[int], scale: float, out: torch.Tensor) -> None:
    """The torch decode path, in groups of sequences that fit :data:`GATHER_BUDGET_BYTES`."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    m = chunk_blocks_for(sum(lens) / len(lens), block_size)
    chunk = m * block_size
    bytes_per_chunk = 2 * chunk * num_kv_heads * head_dim * 4
    start, chunks = 0, 0
    for i, ctx in enumerate(lens):
        n = -(-ctx // chunk)
        if chunks and (chunks + n) * bytes_per_chunk > GATHER_BUDGET_BYTES:
            _decode_group(q[start:i], k_cache, v_cache, block_tables[start:i], lens[start:i], m, scale, out[start:i])
            start, chunks = i, 0
        chunks += n
    _decode_group(q[start:], k_cache, v_cache, block_tables[start:], lens[start:], m, scale, out[start:])


def _decode_group(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  lens: list[int], m: int, scale: float, out: torch.Tensor) -> None:
    """The chunked two-pass softmax over one group of decode sequences (see the module docstring)."""
    dev = q.device
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    chunk = m * block_size
    ctx = torch.tensor(lens, dtype=torch.long, device=dev)  # [S]
    n_chunks_max = -(-max(lens) // chunk)
    width = n_chunks_max * m
    # Logical block table [S, width] with entries past each sequence's blocks pointed at block 0
    # (any value is allowed there; their positions are masked below).
    table = block_tables[:, :width].long()
    if table.shape[1] < width:
        table = F.pad(table, (0, width - table.shape[1]))
    n_blocks = (ctx + block_size - 1) // block_size
    table = torch.where(torch.arange(width, device=dev).view(1, -1) < n_blocks.view(-1, 1), table, 0)
    # Chunks in sequence-major order: (sequence, chunk index) pairs and their m block ids.
    n_chunks = (ctx + chunk - 1) // chunk
    pairs = (torch.arange(n_chunks_max, device=dev).view(1, -1) < n_chunks.view(-1, 1)).nonzero()
    chunk_seq, chunk_idx = pairs[:, 0], pairs[:, 1]
    num_chunks = chunk_seq.shape[0]
    block_ids = table.view(num_seqs, n_chunks_max, m)[chunk_seq, chunk_idx].reshape(-1)
    k = k_cache.index_select(0, block_ids).view(num_chunks, chunk, num_kv_heads, head_dim)
    v = v_cache.index_select(0, block_ids).view(num_chunks, chunk, num_kv_heads, head_dim)
    if k.dtype != torch.float32:
        k, v = k.float(), v.float()
    # valid[c, t]: token t of chunk c lies inside its sequence's context.
    valid = (chunk_idx.view(-1, 1) * chunk + torch.arange(chunk, device=dev)) < ctx[chunk_seq].view(-1, 1)
    invalid_rows = (~valid).view(-1).nonzero().view(-1)
    if invalid_rows.numel():  # 0 * NaN is NaN: clear V past the context instead of trusting it
        v.view(num_chunks * chunk, -1).index_fill_(0, invalid_rows, 0.0)
    one_chunk_each = num_chunks == num_seqs
    # Queries per KV head: [Hkv, S, G, D] (query head h reads KV head h // G), then per chunk.
    qs = (q.float() * scale).view(num_seqs, num_kv_heads, group, head_dim).transpose(0, 1)
    qc = qs if one_chunk_each else qs.index_select(1, chunk_seq)
    scores = torch.empty((num_kv_heads, num_chunks, group, chunk), device=dev)
    for h in range(num_kv_heads):
        torch.bmm(qc[h], k[:, :, h].transpose(1, 2), out=scores[h])
    scores.masked_fill_(~valid.view(1, num_chunks, 1, chunk), float("-inf"))
    chunk_max = scores.amax(-1, keepdim=True)  # [Hkv, NC, G, 1], finite: every chunk holds a token
    if one_chunk_each:
        seq_max = chunk_max
    else:
        seq_max = torch.full((num_kv_heads, num_seqs, group, 1), float("-inf"), device=dev)
        seq_max.scatter_reduce_(1, chunk_seq.view(1, -1, 1, 1).expand_as(chunk_max), chunk_max, "amax")
        seq_max = seq_max.index_select(1, chunk_seq)
    probs = scores.sub_(seq_max).exp_()
    denom = probs.sum(-1, keepdim=True)  # [Hkv, NC, G, 1]
    numer = torch.empty((num_kv_heads, num_chunks, group, head_dim), device=dev)
    for h in range(num_kv_heads):
        torch.bmm(probs[h], v[:, :, h], out=numer[h])
    if not one_chunk_each:
        numer = torch.zeros((num_kv_heads, num_seqs, group, head_dim), device=dev).index_add_(1, chunk_seq, numer)
        denom = torch.zeros((num_kv_heads, num_seqs, group, 1), device=dev).index_add_(1, chunk_seq, denom)
    o = numer.div_(denom)  # [Hkv, S, G, D]
    out.copy_(o.permute(1, 0, 2, 3).reshape(num_seqs, num_heads, head_dim))
