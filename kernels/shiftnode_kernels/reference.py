"""Torch reference implementations of the hot-path operators.

These functions define the semantics that every Triton kernel in ``kernels/`` must reproduce, and
they are the CPU execution path of the node. They never import ``node``.

Paged KV layout (one tensor per device, all layers, so a layer's blocks are contiguous for
layer-by-layer transfer)::

    kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    k_cache = kv_cache[layer, 0]   # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache = kv_cache[layer, 1]

A token at logical position ``p`` of a sequence lives in block ``block_table[p // block_size]`` at
offset ``p % block_size``; its flat *slot* is ``block_id * block_size + offset`` (the slot mapping).

Varlen batches: the new (query) tokens of all sequences are packed along dim 0. Sequence ``i`` owns
query rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``; its context length (cached tokens plus the new ones,
already written to the cache) is ``seq_lens[i]``, so its query row ``j`` sits at position
``seq_lens[i] - q_len_i + j`` and attends causally to positions ``0..that position``. A decode step is
the case ``q_len_i == 1`` for all ``i``; a prefill chunk after a cached prefix (chunked prefill, a
migrated sequence) is the case ``q_len_i < seq_lens[i]``.
"""

from __future__ import annotations

import torch

__all__ = [
    "reshape_and_cache",
    "paged_attention",
    "rms_norm",
    "rotary_embedding",
    "rope_cos_sin_cache",
    "silu_and_mul",
    "gather_kv_blocks",
    "scatter_kv_blocks",
]


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new keys and values into their cache slots, in place.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, the cache's dtype.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        slot_mapping: ``[num_tokens]`` int64 flat slots; a negative slot means "do not write"
            (padding rows).
    """
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    flat_k = k_cache.view(num_blocks * block_size, *k_cache.shape[2:])
    flat_v = v_cache.view(num_blocks * block_size, *v_cache.shape[2:])
    flat_k[slots] = key[valid].to(k_cache.dtype)
    flat_v[slots] = value[valid].to(v_cache.dtype)


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
    """Causal attention of packed varlen queries over keys/values read through block tables.

    Grouped-query attention: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.

    Args:
        q: ``[num_tokens, num_heads, head_dim]`` (fp32/fp16/bf16).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32; entries past a sequence's last
            block are ignored (any value; this reference still gathers them up to the batch's longest
            context, so they must be negative or valid block ids here, while the Triton kernels never
            read them). ``max_blocks_per_seq * block_size`` bounds every context: the Triton decode
            path sizes its split-K partitions from it without a device sync.
        seq_lens: ``[num_seqs]`` int32 context length per sequence, new tokens included.
        cu_seqlens_q: ``[num_seqs + 1]`` int32 prefix sums of query lengths.
        max_seqlen_q: the largest query length (tokens), used to size the padded batch.
        scale: softmax scale, usually ``head_dim ** -0.5``.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``q.dtype``. Math is done in float32.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    single = q_lens == 1
    if max_seqlen_q > 1 and bool(single.any()):
        # A mixed step: decode rows would be padded to the longest prompt chunk (a B x Lq x C score
        # tensor), so the two kinds of rows run separately.
        for part in (single, ~single):
            rows = torch.repeat_interleave(part, q_lens)
            part_lens = q_lens[part]
            cu = torch.zeros(int(part.sum()) + 1, dtype=cu_seqlens_q.dtype, device=q.device)
            cu[1:] = torch.cumsum(part_lens, 0)
            out[rows] = paged_attention(q[rows], k_cache, v_cache, block_tables[part], seq_lens[part], cu,
                                        int(part_lens.max()) if part_lens.numel() else 0, scale)
        return out
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    seq_lens_l = seq_lens.long()
    max_ctx = int(seq_lens_l.max())
    n_blocks = (max_ctx + block_size - 1) // block_size
    # Gather every sequence's context: [S, n_blocks*block_size, Hkv, D].
    table = block_tables[:, :n_blocks].long().clamp(min=0)
    k = k_cache[table].reshape(num_seqs, n_blocks * block_size, num_kv_heads, head_dim)
    v = v_cache[table].reshape(num_seqs, n_blocks * block_size, num_kv_heads, head_dim)
    k = k[:, :max_ctx].float().repeat_interleave(group, dim=2)  # [S, C, H, D]
    v = v[:, :max_ctx].float().repeat_interleave(group, dim=2)
    # Pad queries: [S, max_q, H, D].
    seq_idx = torch.repeat_interleave(torch.arange(num_seqs, device=q.device), q_lens)
    row_in_seq = torch.arange(num_tokens, device=q.device) - cu_seqlens_q[:-1].long()[seq_idx]
    qp = q.new_zeros((num_seqs, max_seqlen_q, num_heads, head_dim), dtype=torch.float32)
    qp[seq_idx, row_in_seq] = q.float()
    # Query positions [S, max_q] and the causal/length mask [S, max_q, C].
    q_pos = (seq_lens_l - q_lens).unsqueeze(1) + torch.arange(max_seqlen_q, device=q.device)
    k_pos = torch.arange(max_ctx, device=q.device)
    mask = (k_pos.view(1, 1, -1) <= q_pos.unsqueeze(2)) & (k_pos.view(1, 1, -1) < seq_lens_l.view(-1, 1, 1))
    scores = torch.einsum("sqhd,skhd->shqk", qp, k) * scale
    scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # padded query rows are all -inf
    o = torch.einsum("shqk,skhd->sqhd", probs, v)
    out[:] = o[seq_idx, row_in_seq].to(q.dtype)
    return out


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm with an optional fused residual add (Zhang & Sennrich 2019; Llama's pre-norm).

    ``h = x + residual`` (or ``x`` when ``residual`` is None); ``out = h / sqrt(mean(h^2) + eps) * weight``,
    the mean taken in float32 over the last dim and the result cast back to ``x.dtype``, as Hugging
    Face's ``LlamaRMSNorm`` does.

    Args:
        x: ``[..., hidden]``. weight: ``[hidden]``. residual: like ``x`` or None.

    Returns:
        ``(out, h)``: the normalised tensor and the new residual stream (``h``), both like ``x``.
    """
    h = x if residual is None else x + residual
    hf = h.float()
    var = hf.pow(2).mean(-1, keepdim=True)
    out = (hf * torch.rsqrt(var + eps)).to(x.dtype)
    return weight * out, h


def rope_cos_sin_cache(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
    """Precompute the rotary table ``[max_positions, rot_dim]`` float32: cos in the first half of the
    last dim, sin in the second. ``inv_freq``: ``[rot_dim // 2]`` float32 (already scaled, e.g. by
    Llama-3's rule)."""
    t = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)
    freqs = torch.outer(t, inv_freq.float())
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> None:
    """Apply rotary position embedding in place, GPT-NeoX/HF layout (``rotate_half``: pairs
    ``(i, i + D/2)``), as in Su et al. 2021 and Hugging Face ``apply_rotary_pos_emb``.

    Args:
        positions: ``[num_tokens]`` int64 absolute positions.
        q: ``[num_tokens, num_heads, head_dim]``; k: ``[num_tokens, num_kv_heads, head_dim]``.
        cos_sin_cache: ``[max_positions, head_dim]`` float32 from :func:`rope_cos_sin_cache`.
    """
    half = cos_sin_cache.shape[-1] // 2
    cs = cos_sin_cache[positions]
    cos = cs[:, :half].unsqueeze(1)
    sin = cs[:, half:].unsqueeze(1)
    for t in (q, k):
        x1 = t[..., :half].float()
        x2 = t[..., half : 2 * half].float()
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        t[..., :half] = o1.to(t.dtype)
        t[..., half : 2 * half] = o2.to(t.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation (Shazeer 2020): ``silu(x[..., :I]) * x[..., I:]`` for ``x: [..., 2*I]``;
    returns ``[..., I]`` in ``x.dtype``."""
    d = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :d]) * x[..., d:]


def gather_kv_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Pack one layer's blocks of a sequence into a contiguous buffer for transfer.

    Args:
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        block_ids: ``[n]`` int64 in the sequence's logical order.

    Returns:
        ``[2, n, block_size, num_kv_heads, head_dim]`` (keys then values), contiguous.
    """
    ids = block_ids.long()
    return torch.stack([k_cache[ids], v_cache[ids]]).contiguous()


def scatter_kv_blocks(buffer: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Inverse of :func:`gather_kv_blocks`: write ``buffer[2, n, block_size, Hkv, D]`` into the blocks
    ``block_ids[n]`` of one layer, in place."""
    ids = block_ids.long()
    k_cache[ids] = buffer[0].to(k_cache.dtype)
    v_cache[ids] = buffer[1].to(v_cache.dtype)

