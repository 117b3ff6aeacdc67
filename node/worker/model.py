"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over paged KV memory.

One forward pass takes a packed varlen batch (prefill chunks and decode tokens mixed), writes the new
keys/values into their slots and attends through block tables; see ``kernels/reference.py`` for the
layout. Weights are fused at load time (q|k|v and gate|up) so each layer runs four matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from node.worker.model_config import ModelConfig, rope_inv_freq
from kernels.reference import rope_cos_sin_cache


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
    """One pre-norm transformer block: attention (GQA, RoPE, optional q/k bias or q/k norm) + SwiGLU."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_size = cfg.num_heads * d
        self.kv_size = cfg.num_kv_heads * d
        kw = dict(dtype=dtype, device=device)
        self.qkv_proj = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias, **kw)
        self.o_proj = nn.Linear(self.q_size, h, bias=False, **kw)
        self.gate_up_proj = nn.Linear(h, 2 * cfg.intermediate_size, bias=False, **kw)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False, **kw)
        self.input_layernorm = nn.Parameter(torch.ones(h, **kw))
        self.post_attention_layernorm = nn.Parameter(torch.ones(h, **kw))
        if cfg.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(d, **kw))
            self.k_norm = nn.Parameter(torch.ones(d, **kw))
        self.cfg = cfg

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
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        t = x.shape[0]
        h, residual = ops.rms_norm(x, self.input_layernorm, eps, residual)
        qkv = self.qkv_proj(h)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, cfg.num_heads, cfg.head_dim)
        k = k.reshape(t, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(t, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = ops.rms_norm(q, self.q_norm, eps)[0]
            k = ops.rms_norm(k, self.k_norm, eps)[0]
        else:
            q, k = q.contiguous(), k.contiguous()
        ops.rotary_embedding(positions, q, k, cos_sin)
        ops.reshape_and_cache(k, v.contiguous(), k_cache, v_cache, meta.slot_mapping)
        attn = ops.paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q,
            meta.max_seqlen_q, cfg.head_dim**-0.5,
        )
        x = self.o_proj(attn.reshape(t, self.q_size))
        h, residual = ops.rms_norm(x, self.post_attention_layernorm, eps, residual)
        x = self.down_proj(ops.silu_and_mul(self.gate_up_proj(h)))
        return x, residual


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head.

    ``forward`` maps ``input_ids [T] int64`` and ``positions [T] int64`` to final hidden states
    ``[T, hidden]``; ``compute_logits`` maps selected hidden rows ``[N, hidden]`` to float32 logits
    ``[N, vocab]``.
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int, ops: Any):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.cfg = cfg
        self.ops = ops
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, **kw)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, device) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size, **kw))
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, **kw)
        self.register_buffer(
            "cos_sin", rope_cos_sin_cache(rope_inv_freq(cfg).to(device), max_positions), persistent=False
        )

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """``kv_cache``: ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``."""
        x = self.embed_tokens(input_ids)
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, positions, kv_cache[i, 0], kv_cache[i, 1], meta, self.cos_sin, self.ops)
        return self.ops.rms_norm(x, self.norm, self.cfg.rms_norm_eps, residual)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.nn.functional.linear(hidden, weight).float()
