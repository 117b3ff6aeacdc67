"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over paged KV memory.

One forward pass takes a packed varlen batch (prefill chunks and decode tokens mixed), writes the new
keys/values into their slots and attends through block tables; see ``kernels/shiftnode_kernels/reference.py`` for the
layout. Weights are fused at load time (q|k|v and gate|up) so each layer runs four matmuls; on the CPU
they run on oneDNN-packed copies of the weights (:mod:`node.worker.cpu_linear`).

Tensor parallelism (Megatron-LM column/row parallel, Shoeybi et al. 2019): a model is built for a
:class:`~node.worker.tensor_parallel.ShardLayout` (the fused weights stored in per-rank blocks for
its layout degree, possibly only one rank's part of them) and runs at the degree of the
:class:`~node.worker.tensor_parallel.TPGroup` given to :meth:`CausalLM.set_tensor_parallel`, on
views of the stored weights. At degree ``D`` a rank computes ``H/D`` query heads and ``K/D`` KV heads
(its KV pool is ``[layers, 2, num_blocks, block_size, K/D, head_dim]``), all-reduces (SUM, in place)
the ``[T, hidden]`` outputs of ``o_proj`` and of ``down_proj`` once each per layer, and all-gathers the
vocab-parallel logits. Degree 1 (the default) communicates nothing and, with the default layout,
stores and computes exactly the plain fused model. See :mod:`node.worker.tensor_parallel`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from node.worker.cpu_linear import PackedProjections, linear
from node.worker.model_config import ModelConfig, rope_inv_freq
from node.worker.tensor_parallel import LayerShard, ShardLayout, TPGroup, layer_shard, lm_head_rows, lm_head_shard
from shiftnode_kernels.reference import rope_cos_sin_cache


@dataclass
class AttentionMetadata:
    """Per-step inputs of paged attention (all on the model's device).

    Attributes:
        slot_mapping: ``[num_tokens]`` int64, flat cache slot of each new token (-1: padding).
        block_tables: ``[num_seqs, max_blocks]`` int32.
        seq_lens: ``[num_seqs]`` int32, context length per sequence including the new tokens.
        cu_seqlens_q: ``[num_seqs + 1]`` int32, prefix sums of new tokens per sequence.
        max_seqlen_q: largest number of new tokens of one sequence in this step.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    max_seqlen_q: int


class DecoderLayer(nn.Module):
    """One pre-norm transformer block: attention (GQA, RoPE, optional q/k bias or q/k norm) + SwiGLU.

    Stored parameters (``M`` = layout degree, ``nb`` = stored blocks, ``M`` when the device holds all
    weights; ``qb = H/M*head_dim``, ``kb = K/M*head_dim``, ``ib = I/M``), all in the model dtype:
    ``qkv_proj.weight [nb*(qb+2kb), hidden]`` (blocks ``[q_b|k_b|v_b]``), ``qkv_proj.bias`` likewise,
    ``o_proj.weight [hidden, nb*qb]``, ``gate_up_proj.weight [nb*2ib, hidden]`` (blocks
    ``[gate_b|up_b]``), ``down_proj.weight [hidden, nb*ib]``; norms ``[hidden]`` (q/k norms
    ``[head_dim]``) replicated. ``forward`` runs on :attr:`shard`, the views for the current degree.
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, layout: ShardLayout = ShardLayout()):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        m, nb = layout.layout_degree, layout.held_blocks
        q_block, kv_block, inter_block = cfg.num_heads // m * d, cfg.num_kv_heads // m * d, cfg.intermediate_size // m
        kw = dict(dtype=dtype, device=device)
        self.qkv_proj = nn.Linear(h, nb * (q_block + 2 * kv_block), bias=cfg.attention_bias, **kw)
        self.o_proj = nn.Linear(nb * q_block, h, bias=False, **kw)
        self.gate_up_proj = nn.Linear(h, nb * 2 * inter_block, bias=False, **kw)
        self.down_proj = nn.Linear(nb * inter_block, h, bias=False, **kw)
        self.input_layernorm = nn.Parameter(torch.ones(h, **kw))
        self.post_attention_layernorm = nn.Parameter(torch.ones(h, **kw))
        if cfg.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(d, **kw))
            self.k_norm = nn.Parameter(torch.ones(d, **kw))
        self.cfg = cfg
        self.shard: LayerShard | None = None  # set by CausalLM.set_tensor_parallel
        self.packed: PackedProjections | None = None  # the CPU's packed weights (node.worker.cpu_linear.pack_model)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        cos_sin: torch.Tensor,
        ops: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``/``residual`` ``[T, hidden]`` (replicated on every rank) → the layer's output and the new
        residual stream, both ``[T, hidden]`` and replicated (the row-parallel partial sums are
        all-reduced). ``k_cache``/``v_cache``: ``[num_blocks, block_size, local_kv_heads, head_dim]``."""
        cfg = self.cfg
        s = self.shard
        eps = cfg.rms_norm_eps
        d = cfg.head_dim
        t = x.shape[0]
        h, residual = ops.rms_norm(x, self.input_layernorm, eps, residual)
        # Column-parallel q|k|v: [T, blocks*(qb+2kb)] → per block [q_b|k_b|v_b] → local heads in order.
        # (One block, e.g. degree 1 on the plain layout: the very ops of the plain model, no extra view.)
        p = self.packed
        qkv = linear(h, s.qkv_weight, s.qkv_bias, p and p.qkv)
        if s.blocks > 1:
            qkv = qkv.view(t, s.blocks, s.q_block + 2 * s.kv_block)
        q, k, v = qkv.split([s.q_block, s.kv_block, s.kv_block], dim=-1)
        q = q.reshape(t, s.num_heads, d)
        k = k.reshape(t, s.num_kv_heads, d)
        v = v.reshape(t, s.num_kv_heads, d)
        if cfg.qk_norm:
            q = ops.rms_norm(q, self.q_norm, eps)[0]
            k = ops.rms_norm(k, self.k_norm, eps)[0]
        else:
            q, k = q.contiguous(), k.contiguous()
        ops.rotary_embedding(positions, q, k, cos_sin)
        fused = getattr(ops, "unified_attention", None)  # the compiled forward's custom op (node.worker.compiled_forward)
        if fused is not None:
            attn = fused(q, k, v, k_cache, v_cache, d**-0.5)
        elif isinstance(k_cache, tuple):  # KV heads owned by several devices' pools (node.worker.role_layouts)
            attn = _attention_over_pools(q, k, v, k_cache, v_cache, meta, ops, d**-0.5)
        else:
            ops.reshape_and_cache(k, v.contiguous(), k_cache, v_cache, meta.slot_mapping)
            attn = ops.paged_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q,
                meta.max_seqlen_q, d**-0.5,
            )
        # Row-parallel o_proj: partial [T, hidden] sums, all-reduced.
        x = linear(attn.reshape(t, s.num_heads * d), s.o_weight, None, p and p.o)
        if s.reduce is not None:
            s.reduce(x)
        h, residual = ops.rms_norm(x, self.post_attention_layernorm, eps, residual)
        # Column-parallel gate|up per block, SwiGLU → the local intermediate slice [T, blocks*ib].
        gate_up = linear(h, s.gate_up_weight, None, p and p.gate_up)
        if s.blocks > 1:
            act = ops.silu_and_mul(gate_up.view(t, s.blocks, 2 * s.inter_block)).view(t, s.blocks * s.inter_block)
        else:
            act = ops.silu_and_mul(gate_up)
        # Row-parallel down_proj: partial [T, hidden] sums, all-reduced.
        x = linear(act, s.down_weight, None, p and p.down)
        if s.reduce is not None:
            s.reduce(x)
        return x, residual


def _attention_over_pools(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_caches: tuple, v_caches: tuple,
                          meta: AttentionMetadata, ops: Any, scale: float) -> torch.Tensor:
    """Paged attention of a rank whose ``q [T, Hl, d]`` / ``k, v [T, Kl, d]`` heads are split in
    ``g = len(k_caches)`` head groups, group ``j`` cached in pool ``j`` (``[num_blocks, block_size,
    Kl/g, d]``, another device's): its KV is written there and read from there, with the same slot
    mapping and block tables (block ids are the group's). Query heads ``[j*Hl/g, (j+1)*Hl/g)`` read KV
    heads ``[j*Kl/g, (j+1)*Kl/g)``, the GQA mapping of the whole. Returns ``[T, Hl, d]``."""
    g = len(k_caches)
    qh, kh = q.shape[1] // g, k.shape[1] // g
    outs = []
    for j in range(g):
        ops.reshape_and_cache(k[:, j * kh : (j + 1) * kh].contiguous(), v[:, j * kh : (j + 1) * kh].contiguous(),
                              k_caches[j], v_caches[j], meta.slot_mapping)
        outs.append(ops.paged_attention(q[:, j * qh : (j + 1) * qh].contiguous(), k_caches[j], v_caches[j],
                                        meta.block_tables, meta.seq_lens, meta.cu_seqlens_q, meta.max_seqlen_q, scale))
    return torch.cat(outs, dim=1)


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head.

    ``forward`` maps ``input_ids [T] int64`` and ``positions [T] int64`` to final hidden states
    ``[T, hidden]`` (replicated on every rank); ``compute_logits`` maps selected hidden rows
    ``[N, hidden]`` to float32 logits ``[N, vocab]`` (vocab-parallel head, gathered on every rank).

    Args:
        layout: how the weights are stored (layout degree, held part); the plain layout by default.
            The embedding is replicated; an untied ``lm_head`` stores the held vocab rows
            (:func:`~node.worker.tensor_parallel.lm_head_rows`).

    A model holding all weights runs at degree 1 until :meth:`set_tensor_parallel` gives it a group;
    one holding a part (``layout.held_degree > 1``) needs its group before its first forward.
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int, ops: Any,
                 layout: ShardLayout = ShardLayout()):
        super().__init__()
        layout.validate(cfg)
        kw = dict(dtype=dtype, device=device)
        self.cfg = cfg
        self.ops = ops
        self.layout = layout
        # ``_weight``: no normal_ init, which build_model would overwrite anyway.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size, **kw))
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, device, layout) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size, **kw))
        head_start, head_stop = lm_head_rows(cfg, layout, cfg.tie_word_embeddings)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, head_stop - head_start, bias=False, **kw)
        # On the meta device (build_model) the table is only a placeholder, filled once on the device:
        # computing it there, like an init of the embedding, would run Python decompositions that
        # import torch._dynamo (seconds per process).
        table = (torch.empty(max_positions, cfg.head_dim, dtype=torch.float32, device=device) if device.type == "meta"
                 else rope_cos_sin_cache(rope_inv_freq(cfg).to(device), max_positions))
        self.register_buffer("cos_sin", table, persistent=False)
        self.tp = TPGroup.single()
        self._lm_shard: torch.Tensor | None = None
        self.head_packed: torch.Tensor | None = None  # its packed copy on the CPU (node.worker.cpu_linear.pack_model)
        self._vocab_width = cfg.vocab_size
        if layout.held_degree == 1:  # a device holding part of the weights runs once it has its group
            self.set_tensor_parallel(self.tp)

    def set_tensor_parallel(self, tp: TPGroup) -> None:
        """Run at ``tp.degree`` as ``tp.rank`` from now on: recompute every layer's views (no copies).

        The KV pool must then have ``cfg.num_kv_heads // tp.degree`` heads (:attr:`local_kv_heads`).

        Raises:
            TensorParallelError: the model cannot split at that degree, the layout does not allow it,
                or the rank's shard is not among the stored weights.
        """
        with torch.no_grad():  # plain views, no autograd history
            shards = [layer_shard(layer, self.cfg, self.layout, tp) for layer in self.layers]
            head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            self._lm_shard, self._vocab_width = lm_head_shard(head, self.cfg, self.layout, tp, self.lm_head is None)
        for layer, shard in zip(self.layers, shards):
            layer.shard = shard
            layer.packed = None  # packed copies (node.worker.cpu_linear) are of the old views
        self.head_packed = None
        self.tp = tp

    @property
    def head_weight(self) -> torch.Tensor:
        """The LM head rows this rank computes: ``[~vocab/degree, hidden]``, a view of the stored head
        (of the embedding when tied)."""
        return self._lm_shard

    @property
    def local_kv_heads(self) -> int:
        """KV heads this rank caches: ``num_kv_heads / degree``."""
        return self.cfg.num_kv_heads // self.tp.degree

    def _apply(self, fn: Any, recurse: bool = True) -> "CausalLM":
        # ``to_empty``/``to``/``half`` give parameters new storage: rebuild the views on it.
        out = super()._apply(fn, recurse)
        if self._lm_shard is not None or self.layers[0].shard is not None:
            self.set_tensor_parallel(self.tp)
        return out

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """``kv_cache``: ``[layers, 2, num_blocks, block_size, local_kv_heads, head_dim]``, or a tuple of
        ``g`` pools of ``local_kv_heads / g`` heads each, in head order (several devices' pools: a
        time-shared group's prefill layout, :mod:`node.worker.role_layouts`)."""
        return self.hidden_states(input_ids, positions, kv_cache, meta, self.ops)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                      meta: AttentionMetadata | None, ops: Any) -> torch.Tensor:
        """:meth:`forward` with explicit operators and no grad-mode context of its own (what
        ``torch.compile`` traces: :mod:`node.worker.compiled_forward`, whose ``ops`` attend through a
        custom op that reads the step's metadata from its context, ``meta`` None)."""
        x = self.embed_tokens(input_ids)
        residual = None
        pools = kv_cache if isinstance(kv_cache, tuple) else None
        for i, layer in enumerate(self.layers):
            if pools is None:
                k_cache, v_cache = kv_cache[i, 0], kv_cache[i, 1]
            else:
                k_cache, v_cache = tuple(p[i, 0] for p in pools), tuple(p[i, 1] for p in pools)
            x, residual = layer(x, residual, positions, k_cache, v_cache, meta, self.cos_sin, ops)
        return ops.rms_norm(x, self.norm, self.cfg.rms_norm_eps, residual)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, hidden]`` → float32 ``[N, vocab]``: this rank's vocab rows in the model dtype,
        all-gathered over the group (degree > 1), then cast."""
        logits = linear(hidden, self._lm_shard, None, self.head_packed)
        return self.tp.all_gather_logits(logits, self._vocab_width, self.cfg.vocab_size).float()
