"""Tensor parallelism of the Llama-family decoder over ``torch.distributed`` (NCCL on CUDA, gloo on CPU).

The split is Megatron-LM's (Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter
Language Models Using Model Parallelism", section 3): per layer, the fused ``q|k|v`` and ``gate|up``
projections are *column-parallel* (each rank computes its heads' q/k/v and its slice of the
intermediate features, no communication), ``o_proj`` and ``down_proj`` are *row-parallel* (each rank
multiplies its slice of the input features by the matching columns of the weight and the partial
``[T, hidden]`` outputs are summed by **one all-reduce each**). Attention heads and KV heads split
across ranks: rank ``r`` of degree ``D`` owns query heads ``[r*H/D, (r+1)*H/D)`` and KV heads
``[r*K/D, (r+1)*K/D)``, so grouped-query attention stays rank-local (query head ``h`` reads KV head
``h // (H/K)`` in both numberings) and a rank's KV pool holds only its ``K/D`` heads:
``[layers, 2, num_blocks, block_size, K/D, head_dim]``. Norms, the rotary table and the embedding are
replicated (every rank holds and computes them; the residual stream ``[T, hidden]`` is replicated).

LM head: *vocab-parallel* with an all-gather of the logits. Rank ``r`` computes the logits of its vocab
rows ``[N, ~V/D]`` and :meth:`TPGroup.all_gather_logits` concatenates them into ``[N, V]`` on every
rank, so every rank samples from the same bytes (greedy and seeded sampling agree across ranks with
no broadcast). Chosen over a replicated head because the head is the largest single matmul of a
decode step for large vocabularies (Llama 3 8B: 128256 x 4096, about 6.5% of the weights read per
step); the vocab split divides its weight reads by ``D``, costs one all-gather of ``N x V`` logits in
the model dtype per ``compute_logits`` call (not per layer), and keeps an untied head at ``1/D`` per
rank. With tied embeddings the head shard is a row view of the (replicated) embedding. The input
embedding stays replicated (a lookup, no matmul): a vocab-parallel embedding would cost one more
all-reduce of ``[T, hidden]`` per step to save ``V x hidden`` bytes per rank on untied models.

Layout (shard-friendly fused weights). A model is built for a *layout degree* ``M``, the largest
degree the device may use. The fused weights are stored as ``M`` per-rank blocks::

    qkv_proj.weight:     [q_0|k_0|v_0 | q_1|k_1|v_1 | ... | q_{M-1}|k_{M-1}|v_{M-1}]   rows, x [hidden]
                         q_b = heads [b*H/M, (b+1)*H/M) x head_dim rows, k_b / v_b = KV heads likewise
    qkv_proj.bias:       same row order (Qwen2)
    gate_up_proj.weight: [gate_0|up_0 | ... | gate_{M-1}|up_{M-1}]   (I/M rows each) x [hidden]
    o_proj.weight:       [hidden, H*head_dim]   plain (its input features are head-major)
    down_proj.weight:    [hidden, I]            plain

so the shard of rank ``r`` at any degree ``D`` dividing ``M`` is the *contiguous* row range of blocks
``[r*M/D, (r+1)*M/D)`` of the fused weights, and a contiguous column range of ``o_proj``/``down_proj``
(a strided view that matmuls read in place). Within a shard the ``n = M/D`` blocks keep their order,
so its q heads, KV heads and intermediate features are the global ranges above, in order. At
``M = 1`` the layout is exactly the plain ``[q|k|v]`` / ``[gate|up]`` one.

A device may hold only part of the weights: the shard of rank ``held_rank`` at a *held degree* ``P``
(``P`` dividing ``M``), i.e. blocks ``[held_rank*M/P, (held_rank+1)*M/P)`` and the matching vocab rows
of an untied head (:class:`ShardLayout`). Its shard for any degree ``D`` with ``P | D | M`` (whose rank
lies inside the held part) is then a view of what it holds: no copy, no extra memory. Vocab rows are
split in units of ``ceil(V/M)`` rows per layout block so that the shards nest the same way.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from node.worker.model_config import ModelConfig


class TensorParallelError(ValueError):
    """A model or a group cannot run at a tensor-parallel degree (the message gives the numbers)."""


def check_tp_config(cfg: ModelConfig, degree: int) -> None:
    """Refuse a degree that does not divide the model's attention heads, KV heads or intermediate size.

    KV heads are split, never replicated, across ranks, so ``num_key_value_heads`` must be a multiple
    of the degree (and then ``num_attention_heads`` is too, GQA groups being whole).

    Raises:
        TensorParallelError: naming each quantity that the degree does not divide, with both numbers.
    """
    if not isinstance(degree, int) or degree < 1:
        raise TensorParallelError(f"tensor-parallel degree must be a positive integer, got {degree!r}")
    checks = [("num_attention_heads", cfg.num_heads), ("num_key_value_heads", cfg.num_kv_heads),
              ("intermediate_size", cfg.intermediate_size)]
    bad = [f"{name} {value}" for name, value in checks if value % degree]
    if bad:
        raise TensorParallelError(
            f"tensor-parallel degree {degree} does not divide the model's {', '.join(bad)} "
            f"(heads, KV heads and the MLP's intermediate features are split evenly across ranks; "
            f"KV heads are not replicated): use a degree that divides num_key_value_heads {cfg.num_kv_heads}"
        )


@dataclass(frozen=True)
class ShardLayout:
    """How a device stores its weights: interleaved for ``layout_degree`` ranks, holding the shard of
    ``held_rank`` at ``held_degree`` (``1, 1, 0``: the plain layout, all weights)."""

    layout_degree: int = 1
    held_degree: int = 1
    held_rank: int = 0

    def validate(self, cfg: ModelConfig) -> None:
        """Raises :class:`TensorParallelError` for an inconsistent layout or one the model cannot split."""
        m, p, r = self.layout_degree, self.held_degree, self.held_rank
        if p < 1 or m < 1 or m % p:
            raise TensorParallelError(f"held degree {p} must divide the layout degree {m}")
        if not 0 <= r < p:
            raise TensorParallelError(f"held rank {r} is outside 0..{p - 1} (held degree {p})")
        check_tp_config(cfg, m)

    @property
    def held_blocks(self) -> int:
        """Layout blocks stored on this device (``M / P``)."""
        return self.layout_degree // self.held_degree

    @property
    def first_block(self) -> int:
        """Global index of the first stored block."""
        return self.held_rank * self.held_blocks


def vocab_range(vocab_size: int, layout_degree: int, degree: int, rank: int) -> tuple[int, int, int]:
    """Vocab rows ``[start, stop)`` of ``rank`` at ``degree`` and the padded width of every shard.

    Shards are ``width = ceil(V / M) * M / D`` rows wide (the last ones shorter or empty when ``V`` is
    not a multiple of ``M``), so the shards of a degree nest inside those of any divisor of it.
    """
    width = -(-vocab_size // layout_degree) * layout_degree // degree
    start = min(rank * width, vocab_size)
    return start, min(start + width, vocab_size), width


@dataclass(frozen=True)
class TPGroup:
    """This process's place in a tensor-parallel group.

    Attributes:
        rank: rank within the group (``0 .. degree-1``), which selects the shard.
        degree: ranks in the group; 1 means no communication at all (``group`` is None).
        group: the ``torch.distributed`` process group of the ``degree`` ranks.
    """

    rank: int = 0
    degree: int = 1
    group: Any = None

    @classmethod
    def single(cls) -> "TPGroup":
        return cls()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group, in place (row-parallel outputs ``[T, hidden]``); returns ``x``."""
        if self.degree > 1:
            dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    def all_gather_logits(self, local: torch.Tensor, width: int, vocab_size: int) -> torch.Tensor:
        """Concatenate the ranks' vocab-shard logits ``[N, <=width]`` into ``[N, vocab_size]`` (same dtype).

        Each rank's block is padded to ``width`` columns (see :func:`vocab_range`) before the gather
        and the padding is cut afterwards.
        """
        if self.degree == 1:
            return local
        if local.shape[-1] != width:
            local = F.pad(local, (0, width - local.shape[-1]))
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.degree)]
        dist.all_gather(parts, local, group=self.group)
        out = torch.cat(parts, dim=-1)
        return out if out.shape[-1] == vocab_size else out[..., :vocab_size].contiguous()


def backend_for(device: torch.device) -> str:
    """``nccl`` for CUDA devices, ``gloo`` for the CPU (emulated devices run the same code)."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(rank: int, world_size: int, init_method: str, device: torch.device,
                     timeout_s: float = 300.0) -> None:
    """Join the default process group (``init_method``: ``file://...`` or ``tcp://host:port``).

    On CUDA the process's current device is set to ``device`` first (NCCL binds a rank to it).
    """
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(device), init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def new_tp_group(degree: int) -> TPGroup:
    """Split the default group into tensor-parallel groups of ``degree`` consecutive ranks
    (``[0..D-1], [D..2D-1], ...``) and return this process's one. Collective: every rank of the world
    must call it with the same degree. Degree 1 creates nothing."""
    if degree == 1:
        return TPGroup.single()
    world, me = dist.get_world_size(), dist.get_rank()
    if world % degree:
        raise TensorParallelError(f"world size {world} is not a multiple of the tensor-parallel degree {degree}")
    mine = None
    for first in range(0, world, degree):
        g = dist.new_group(list(range(first, first + degree)))
        if first <= me < first + degree:
            mine = g
    return TPGroup(rank=me % degree, degree=degree, group=mine)


@dataclass(frozen=True)
class LayerShard:
    """One decoder layer's weights at the current degree: views of the layer's stored parameters.

    ``blocks = M / D`` layout blocks per rank; within them the row order of :data:`qkv_weight` is
    ``blocks x [q (q_block) | k (kv_block) | v (kv_block)]`` and of :data:`gate_up_weight`
    ``blocks x [gate (inter_block) | up (inter_block)]``.

    Attributes:
        qkv_weight: ``[blocks*(q_block + 2*kv_block), hidden]``; qkv_bias the same rows, or None.
        o_weight: ``[hidden, num_heads*head_dim]`` (local heads, column view).
        gate_up_weight: ``[blocks*2*inter_block, hidden]``.
        down_weight: ``[hidden, blocks*inter_block]`` (column view).
        num_heads, num_kv_heads: local head counts (``H/D``, ``K/D``).
        reduce: ``TPGroup.all_reduce`` (in place, SUM) at degree > 1, None at degree 1.
    """

    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_weight: torch.Tensor
    gate_up_weight: torch.Tensor
    down_weight: torch.Tensor
    blocks: int
    q_block: int
    kv_block: int
    inter_block: int
    num_heads: int
    num_kv_heads: int
    reduce: Callable[[torch.Tensor], torch.Tensor] | None


def shard_offset(layout: ShardLayout, tp: TPGroup) -> int:
    """Index, among the stored blocks, of the first block of ``tp.rank`` at ``tp.degree``.

    Raises:
        TensorParallelError: the degree does not divide the layout degree, is not a multiple of the
            held degree, or the rank's shard is not inside the stored part.
    """
    m, p, d = layout.layout_degree, layout.held_degree, tp.degree
    if m % d:
        raise TensorParallelError(f"tensor-parallel degree {d} does not divide the weights' layout degree {m} "
                                  f"(load the model with a layout degree that is a multiple of {d})")
    if d % p:
        raise TensorParallelError(f"tensor-parallel degree {d} is not a multiple of the held degree {p}: "
                                  f"this device holds 1/{p} of the weights")
    if not 0 <= tp.rank < d:
        raise TensorParallelError(f"rank {tp.rank} is outside 0..{d - 1} (degree {d})")
    if tp.rank // (d // p) != layout.held_rank:
        raise TensorParallelError(f"rank {tp.rank} of degree {d} needs the weights of held rank "
                                  f"{tp.rank // (d // p)} of degree {p}; this device holds held rank {layout.held_rank}")
    return tp.rank * (m // d) - layout.first_block


def layer_shard(layer: Any, cfg: ModelConfig, layout: ShardLayout, tp: TPGroup) -> LayerShard:
    """The views of ``layer`` (a ``DecoderLayer`` built for ``layout``) for ``tp``; no copies."""
    off = shard_offset(layout, tp)
    n = layout.layout_degree // tp.degree
    m = layout.layout_degree
    qb, kb, ib = cfg.num_heads // m * cfg.head_dim, cfg.num_kv_heads // m * cfg.head_dim, cfg.intermediate_size // m
    rows = slice(off * (qb + 2 * kb), (off + n) * (qb + 2 * kb))
    bias = layer.qkv_proj.bias
    return LayerShard(
        qkv_weight=layer.qkv_proj.weight[rows],
        qkv_bias=None if bias is None else bias[rows],
        o_weight=layer.o_proj.weight[:, off * qb : (off + n) * qb],
        gate_up_weight=layer.gate_up_proj.weight[off * 2 * ib : (off + n) * 2 * ib],
        down_weight=layer.down_proj.weight[:, off * ib : (off + n) * ib],
        blocks=n, q_block=qb, kv_block=kb, inter_block=ib,
        num_heads=cfg.num_heads // tp.degree, num_kv_heads=cfg.num_kv_heads // tp.degree,
        reduce=tp.all_reduce if tp.degree > 1 else None,
    )


def lm_head_rows(cfg: ModelConfig, layout: ShardLayout, tied: bool) -> tuple[int, int]:
    """Vocab rows ``[start, stop)`` stored as the LM head: all of them when tied (the head is the
    replicated embedding), else the held shard's."""
    if tied:
        return 0, cfg.vocab_size
    start, stop, _ = vocab_range(cfg.vocab_size, layout.layout_degree, layout.held_degree, layout.held_rank)
    return start, stop


def lm_head_shard(weight: torch.Tensor, cfg: ModelConfig, layout: ShardLayout, tp: TPGroup,
                  tied: bool) -> tuple[torch.Tensor, int]:
    """Row view ``[rows, hidden]`` of the stored head ``weight`` for ``tp``, and the gather width."""
    shard_offset(layout, tp)  # validates the rank against the held part
    base, _ = lm_head_rows(cfg, layout, tied)
    start, stop, width = vocab_range(cfg.vocab_size, layout.layout_degree, tp.degree, tp.rank)
    return weight[start - base : stop - base], width


# --- checkpoint tensors -> stored parameters (the loader's side of the layout) -----------------------------


def fused_part(stored: torch.Tensor, layout: ShardLayout, sizes: list[int], part: int) -> torch.Tensor:
    """View of part ``part`` in every stored block of a fused parameter: ``[held_blocks, sizes[part], ...]``.

    ``sizes``: the per-block row counts of the parts (e.g. ``[q_block, kv_block, kv_block]``).
    """
    blocks = stored.view(layout.held_blocks, sum(sizes), *stored.shape[1:])
    start = sum(sizes[:part])
    return blocks[:, start : start + sizes[part]]


def held_row_blocks(tensor: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """A checkpoint tensor split in ``M`` row blocks, the stored ones: ``[held_blocks, rows/M, ...]``."""
    m = layout.layout_degree
    blocks = tensor.view(m, tensor.shape[0] // m, *tensor.shape[1:])
    return blocks[layout.first_block : layout.first_block + layout.held_blocks]


def held_columns(tensor: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """The stored column range of a row-parallel checkpoint weight ``[out, in]``: ``[out, in*nb/M]``."""
    width = tensor.shape[1] // layout.layout_degree
    return tensor[:, layout.first_block * width : (layout.first_block + layout.held_blocks) * width]
