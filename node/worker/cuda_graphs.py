"""CUDA-graph decode: one captured model forward per batch-size bucket, replayed over static inputs.

A pure decode step (every sequence computes exactly one new token) launches the same kernels with
the same shapes for a given batch size; only a few small index tensors change. :class:`DecodeGraphs`
captures the model forward of such a step (up to the final hidden states) once per bucket and then
replays it: the real batch of ``n`` sequences is padded to the smallest bucket ``B >= n``, copied
into static buffers, the graph is replayed and the first ``n`` output rows are returned. Logits and
sampling stay eager (they run on the real rows only).

Static buffers (sized for the largest bucket; bucket ``B`` uses the first ``B`` rows):

* ``input_ids [B] int64``, ``positions [B] int64``, ``slot_mapping [B] int64``
* ``block_tables [B, max_blocks_per_seq] int32`` with ``max_blocks_per_seq = ceil(max_model_len /
  block_size)``; only the first ``ceil(seq_len / block_size)`` entries of a row are ever read
* ``seq_lens [B] int32``, ``cu_seqlens_q [B + 1] int32`` (always ``0..B``: every row has one token)

Padding rows: token 0 at position 0, slot -1 (``reshape_and_cache`` skips the write), ``seq_len`` 1
and block 0 in the first column of the block table: attention of a padding row reads one key of
block 0 (read-only, whatever it holds) and its output row is discarded.

Graph safety: the Triton decode path of :mod:`shiftnode_kernels.attention` never syncs the host and sizes
everything from shapes (its split-K count comes from ``num_seqs``, the block-table width and the SM
count, never from tensor values), so its launches are fixed for a bucket. Because the static block
table is ``max_model_len`` wide, the kernel's automatic split count would be planned for the longest
context; when it splits at all, a graph uses :func:`graph_decode_splits` instead (chunks of about
``DECODE_MIN_SPLIT_TOKENS`` keys, so short contexts still fill the device). The torch reference
attention is *not* graph-safe (its shapes depend on ``seq_lens``): graphs are only captured with the
Triton backend on CUDA. With ``use_cuda_graph=False`` the same buffers and padding run eagerly (a
CPU/debug path with any backend), which is how the CPU tests cover this module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch

from node.worker.model import AttentionMetadata, CausalLM

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
WARMUP_RUNS = 2  # eager runs of a bucket before its capture (Triton compile + module load, cuBLAS workspace)


class DecodeSeq(Protocol):
    """What a decode step needs of one sequence (``node.worker.runner.SeqInput`` has these)."""

    token_ids: list[int]
    start: int
    block_ids: list[int]


def decode_buckets(max_num_seqs: int, largest: int = DEFAULT_BUCKETS[-1]) -> tuple[int, ...]:
    """Batch-size buckets: powers of two up to ``min(max_num_seqs, largest)``, plus ``max_num_seqs``
    itself when it is below ``largest`` and not a power of two (so every allowed batch has a bucket)."""
    cap = min(max(int(max_num_seqs), 1), largest)
    out = [b for b in DEFAULT_BUCKETS if b <= cap]
    b = out[-1] * 2 if out else 1
    while b <= cap:  # ``largest`` above 256
        out.append(b)
        b *= 2
    if out[-1] != cap:
        out.append(cap)
    return tuple(out)


def pick_bucket(num_seqs: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket ``>= num_seqs`` (``buckets`` ascending); None when none fits or ``num_seqs < 1``."""
    if num_seqs < 1:
        return None
    for b in buckets:
        if b >= num_seqs:
            return b
    return None


@dataclass
class DecodeBatch:
    """Host (CPU) tensors of one padded decode step; rows ``num_seqs..bucket-1`` are padding.

    Attributes:
        input_ids, positions, slot_mapping: ``[bucket]`` int64.
        seq_lens: ``[bucket]`` int32 (context length including the new token; 1 for padding).
        block_tables: ``[bucket, width]`` int32, ``width`` = the most blocks a real row needs.
    """

    num_seqs: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor

    @property
    def bucket(self) -> int:
        return int(self.input_ids.shape[0])


def pack_decode_batch(token_ids: Sequence[int], starts: Sequence[int], block_ids: Sequence[Sequence[int]],
                      bucket: int, block_size: int, max_blocks: int) -> DecodeBatch | None:
    """Pad a decode step to ``bucket`` rows (a pure function of lists).

    Sequence ``i`` computes token ``token_ids[i]`` at position ``starts[i]`` (so ``seq_len = start + 1``)
    over the blocks ``block_ids[i]``; only the first ``ceil(seq_len / block_size)`` of them are used.

    Returns:
        The padded batch, or None when it cannot run as a graph: no sequence, more sequences than
        ``bucket``, a context longer than ``max_blocks * block_size``, or a block list too short for
        its context (the eager path then reports that error).
    """
    n = len(token_ids)
    if n == 0 or n > bucket or len(starts) != n or len(block_ids) != n:
        return None
    rows: list[list[int]] = []
    slots: list[int] = []
    for start, blocks in zip(starts, block_ids):
        need = start // block_size + 1  # blocks covering positions 0..start
        if start < 0 or need > max_blocks or need > len(blocks):
            return None
        rows.append(list(blocks[:need]))
        slots.append(blocks[start // block_size] * block_size + start % block_size)
    width = max(len(r) for r in rows)
    pad = bucket - n
    table = [r + [0] * (width - len(r)) for r in rows] + [[0] * width for _ in range(pad)]
    return DecodeBatch(
        num_seqs=n,
        input_ids=torch.tensor(list(token_ids) + [0] * pad, dtype=torch.int64),
        positions=torch.tensor(list(starts) + [0] * pad, dtype=torch.int64),
        slot_mapping=torch.tensor(slots + [-1] * pad, dtype=torch.int64),
        seq_lens=torch.tensor([s + 1 for s in starts] + [1] * pad, dtype=torch.int32),
        block_tables=torch.tensor(table, dtype=torch.int32),
    )


def decode_lists(seqs: Sequence[DecodeSeq]) -> tuple[list[int], list[int], list[list[int]]] | None:
    """``(token_ids, starts, block_ids)`` of a pure decode step, or None if some sequence has
    ``q_len != 1`` (a prefill chunk: the step runs eagerly)."""
    if any(len(s.token_ids) != 1 for s in seqs):
        return None
    return [s.token_ids[0] for s in seqs], [s.start for s in seqs], [s.block_ids for s in seqs]


class StaticDecodeInputs:
    """The static input buffers of all buckets (views of one allocation each; see the module doc)."""

    def __init__(self, max_bucket: int, max_blocks: int, device: torch.device):
        kw = dict(device=device)
        self.input_ids = torch.zeros(max_bucket, dtype=torch.int64, **kw)
        self.positions = torch.zeros(max_bucket, dtype=torch.int64, **kw)
        self.slot_mapping = torch.full((max_bucket,), -1, dtype=torch.int64, **kw)
        self.seq_lens = torch.ones(max_bucket, dtype=torch.int32, **kw)
        self.block_tables = torch.zeros((max_bucket, max_blocks), dtype=torch.int32, **kw)
        self.cu_seqlens_q = torch.arange(max_bucket + 1, dtype=torch.int32, **kw)

    def reset(self, bucket: int) -> None:
        """Make rows ``0..bucket-1`` padding (so a warm-up or capture run writes no KV slot)."""
        self.input_ids[:bucket].zero_()
        self.positions[:bucket].zero_()
        self.slot_mapping[:bucket].fill_(-1)
        self.seq_lens[:bucket].fill_(1)
        self.block_tables[:bucket].zero_()

    def load(self, batch: DecodeBatch) -> None:
        """Copy a padded batch into rows ``0..batch.bucket-1`` (block-table columns past its width keep
        stale ids, which the kernels never read)."""
        b, w = batch.bucket, batch.block_tables.shape[1]
        self.input_ids[:b].copy_(batch.input_ids, non_blocking=True)
        self.positions[:b].copy_(batch.positions, non_blocking=True)
        self.slot_mapping[:b].copy_(batch.slot_mapping, non_blocking=True)
        self.seq_lens[:b].copy_(batch.seq_lens, non_blocking=True)
        self.block_tables[:b, :w].copy_(batch.block_tables, non_blocking=True)

    def meta(self, bucket: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket], block_tables=self.block_tables[:bucket],
            seq_lens=self.seq_lens[:bucket], cu_seqlens_q=self.cu_seqlens_q[: bucket + 1], max_seqlen_q=1,
        )


def graph_decode_splits(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Split-K count of the decode attention in a graph of ``num_seqs`` rows whose block table spans
    ``max_context`` tokens: 1 where the kernel's automatic policy would not split (the batch fills the
    device), else ``min(max_context // DECODE_MIN_SPLIT_TOKENS, DECODE_MAX_SPLITS)`` (at least the
    automatic count): splits of ~512 keys, of which a short context runs only the first few (the others
    return at once), instead of a few splits sized for ``max_context``."""
    from shiftnode_kernels.attention import DECODE_MAX_SPLITS, DECODE_MIN_SPLIT_TOKENS, decode_num_splits

    auto = decode_num_splits(num_seqs, num_kv_heads, max_context, device)
    if auto <= 1:
        return 1
    return max(auto, min(max_context // DECODE_MIN_SPLIT_TOKENS, DECODE_MAX_SPLITS))


def decode_graphs_unsupported(device: torch.device, ops: Any) -> str | None:
    """None when decode graphs can be captured here, else why not."""
    if device.type != "cuda":
        return f"device {device} is not CUDA"
    if getattr(ops, "backend", None) != "triton":
        return "the attention backend is not 'triton' (the torch reference attention is not graph-safe)"
    return None


class _Replay:
    """A captured graph and its static output ``[bucket, hidden]`` (overwritten by every replay)."""

    def __init__(self, graph: "torch.cuda.CUDAGraph", output: torch.Tensor):
        self.graph, self.output = graph, output

    def __call__(self) -> torch.Tensor:
        self.graph.replay()
        return self.output


class DecodeGraphs:
    """Captured decode forwards of ``model`` over ``kv_cache``, one per bucket.

    Args:
        model: the :class:`CausalLM` (its ``ops`` are the Triton ones when capturing).
        kv_cache: ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``; must never be
            reallocated (graphs hold its address).
        block_size: tokens per KV block. max_model_len: longest context (tokens).
        max_num_seqs: largest batch; buckets come from :func:`decode_buckets`.
        use_cuda_graph: capture CUDA graphs (CUDA + Triton); False runs the padded static-buffer
            forward eagerly instead (any device/backend; tests and debugging).
        lazy: :meth:`run` captures a missing bucket on first use; otherwise it only uses buckets
            captured beforehand (:meth:`capture_all`) and returns None for the others.

    Outputs of :meth:`run`/:meth:`replay` are views of a static buffer: valid until the next replay.
    """

    def __init__(self, model: CausalLM, kv_cache: torch.Tensor, *, block_size: int, max_model_len: int,
                 max_num_seqs: int, use_cuda_graph: bool = True, lazy: bool = False,
                 buckets: Sequence[int] | None = None):
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.block_size = block_size
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.buckets = tuple(sorted(buckets)) if buckets else decode_buckets(max_num_seqs)
        self.use_cuda_graph = use_cuda_graph
        self.lazy = lazy
        if use_cuda_graph and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {self.device}")
        self.inputs = StaticDecodeInputs(self.buckets[-1], self.max_blocks_per_seq, self.device)
        self._steps: dict[int, Callable[[], torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle() if use_cuda_graph else None
        self._stream = torch.cuda.Stream(self.device) if use_cuda_graph else None
        self.replays = 0  # steps served by :meth:`run`
        self.capture_ms = 0.0  # total time spent capturing

    @property
    def captured(self) -> bool:
        """Every bucket is ready."""
        return all(b in self._steps for b in self.buckets)

    def is_captured(self, bucket: int) -> bool:
        return bucket in self._steps

    def release(self) -> None:
        """Drop every graph (their memory pool returns to the allocator once unreferenced)."""
        self._steps.clear()

    # --- capture ---------------------------------------------------------------------------------
    def _attention_ops(self, bucket: int) -> Any:
        """The model's ops with the graph's split-K count fixed (Triton); the model's own ops otherwise."""
        ops = self.model.ops
        if getattr(ops, "backend", None) != "triton":
            return ops
        from shiftnode_kernels.attention import paged_attention_impl

        num_kv_heads = self.kv_cache.shape[4]
        splits = graph_decode_splits(bucket, num_kv_heads, self.max_blocks_per_seq * self.block_size, self.device)
        return dataclasses.replace(ops, paged_attention=functools.partial(paged_attention_impl, num_splits=splits))

    def _forward(self, bucket: int, ops: Any) -> torch.Tensor:
        """Model forward over the first ``bucket`` static rows → hidden ``[bucket, hidden]``."""
        model, prev = self.model, self.model.ops
        model.ops = ops
        try:
            return model(self.inputs.input_ids[:bucket], self.inputs.positions[:bucket], self.kv_cache,
                         self.inputs.meta(bucket))
        finally:
            model.ops = prev

    def _on_device(self) -> contextlib.AbstractContextManager:
        """Make the graphs' device current (capture and replay use the current device's streams)."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    @torch.inference_mode()
    def capture(self, bucket: int) -> float:
        """Capture (or, without CUDA graphs, prepare) one bucket; returns the time it took in ms.

        The bucket's rows are reset to padding first, so warm-up and capture write no KV slot."""
        if bucket not in self.buckets:
            raise ValueError(f"{bucket} is not one of the buckets {self.buckets}")
        with self._on_device():
            return self._capture(bucket)

    def _capture(self, bucket: int) -> float:
        t0 = time.perf_counter()
        self.inputs.reset(bucket)
        ops = self._attention_ops(bucket)
        if not self.use_cuda_graph:
            self._forward(bucket, ops)  # the same warm-up as a capture would do
            self._steps[bucket] = functools.partial(self._forward, bucket, ops)
        else:
            main = torch.cuda.current_stream(self.device)
            self._stream.wait_stream(main)
            with torch.cuda.stream(self._stream):  # warm up on the capture stream
                for _ in range(WARMUP_RUNS):
                    self._forward(bucket, ops)
            main.wait_stream(self._stream)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            # thread_local: other threads (other devices' workers, the event loop) may use CUDA meanwhile.
            with torch.cuda.graph(graph, pool=self._pool, stream=self._stream, capture_error_mode="thread_local"):
                out = self._forward(bucket, ops)
            torch.cuda.synchronize(self.device)
            self._steps[bucket] = _Replay(graph, out)
        ms = (time.perf_counter() - t0) * 1e3
        self.capture_ms += ms
        return ms

    def capture_all(self) -> float:
        """Capture every missing bucket, largest first (smaller graphs reuse its pool memory).
        Returns the time it took in ms."""
        t0 = time.perf_counter()
        for b in sorted(self.buckets, reverse=True):
            if b not in self._steps:
                self.capture(b)
        return (time.perf_counter() - t0) * 1e3

    # --- replay ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def replay(self, bucket: int) -> torch.Tensor:
        """Replay a captured bucket over whatever the static buffers hold → ``[bucket, hidden]``."""
        with self._on_device():
            return self._steps[bucket]()

    @torch.inference_mode()
    def run(self, seqs: Sequence[DecodeSeq]) -> torch.Tensor | None:
        """Run a step through its bucket's graph → hidden ``[len(seqs), hidden]`` in the model dtype,
        or None when the step is not a pure decode step that fits (the caller runs it eagerly)."""
        lists = decode_lists(seqs)
        bucket = pick_bucket(len(seqs), self.buckets)
        if lists is None or bucket is None:
            return None
        batch = pack_decode_batch(*lists, bucket, self.block_size, self.max_blocks_per_seq)
        if batch is None:
            return None
        if bucket not in self._steps:
            if not self.lazy:
                return None
            self.capture(bucket)
        with self._on_device():
            self.inputs.load(batch)
            out = self._steps[bucket]()
        self.replays += 1
        return out[: batch.num_seqs]
