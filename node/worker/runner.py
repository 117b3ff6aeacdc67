"""The model runner of one device: owns the weights and the KV tensor pool, runs one step at a time.

It is driven by :class:`~node.worker.engine_core.EngineCore`, in the device's engine process (or, with
``--engine-layout thread``, in that engine's own thread of the node's process), never on the node's
event loop. Its input is a plain-data :class:`StepInput` (built by the engine core from the node's
step diff), its output plain data too, so the node and the engine share no mutable state but the KV
pool, which the node writes only on blocks no step in flight uses
(:class:`~node.runtime.engine.DeviceEngine`).
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import msgspec
import structlog
import torch

from shiftnode_kernels import cpu_sampling_numba
from node.worker.background_compile import BackgroundCompile, StepGate
from node.worker.compiled_forward import CompiledForward
from node.worker.cuda_graphs import DecodeGraphs
from node.worker.model import AttentionMetadata, CausalLM
from node.worker.model_config import ModelConfig
from node.worker.sampler import SampleRequest, TokenLogprobs, logprobs_of, sample
from node.worker.spec_verify import accepted, verify_requests
from node.worker.timed_step import StepPacer

log = structlog.get_logger("shiftnode.runner")

KVAlloc = Callable[[tuple, torch.dtype, torch.device], torch.Tensor]  # (shape, dtype, device) → a zeroed KV pool


@dataclass
class SeqInput:
    """One sequence's part of a step.

    Attributes:
        seq_id: the sequence.
        token_ids: the new tokens to compute (``len == q_len``).
        start: position of the first new token (tokens already cached).
        block_ids: the block table, covering ``start + q_len`` tokens.
        sample: set when this step reaches the end of the known tokens and draws the next one.
        prompt_targets: for prompt logprobs, the prompt tokens at positions ``start+1 ..`` that the
            new rows predict (may be shorter than ``token_ids``); empty when not wanted.
        prompt_top: number of alternatives for prompt logprobs.
        draft: speculative tokens, the last ``len(draft)`` of ``token_ids`` (a verify item: every row
            from the one before them is sampled, :mod:`node.worker.spec_verify`); empty otherwise.
    """

    seq_id: str
    token_ids: list[int]
    start: int
    block_ids: list[int]
    sample: SampleRequest | None = None
    prompt_targets: list[int] = field(default_factory=list)
    prompt_top: int = 0
    draft: tuple[int, ...] | list[int] = ()


class PendingResult(Protocol):
    """A value computed when first asked for (:class:`~node.worker.grammar_masks.PendingMask`)."""

    def result(self) -> Any: ...


@dataclass
class StepInput:
    """A step's sequences, and (``masks``) the pending grammar mask of its sampled rows, whose
    ``result()`` is ``(mask [>= sampled rows, ceil(V / 32)] int32, masked row indices)`` or None
    (:mod:`node.worker.grammar_masks`); resolved after the forward pass and the logits are launched
    (on a GPU they are still running), before the logits are read. ``spec``: some sequence is a verify
    item (its mask rows are then numbered over every sampled row)."""

    seqs: list[SeqInput]
    masks: PendingResult | None = None
    spec: bool = False


class SeqOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """A sequence's result of one step: the sampled token (None: the step did not sample), its
    logprobs when asked, and prompt logprobs of the step's prompt rows. A positional struct with
    defaults left off, so a plain token travels in a step's reply as ``[id]`` and decodes in C (the
    node reads a reply of hundreds of them per step). A verify item's further kept tokens are not here
    (they would cost every plain token bytes): :attr:`ModelRunner.kept`."""

    token_id: int | None = None
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: list[TokenLogprobs] = []


class ModelRunner:
    """Weights, KV pool and step execution for one device.

    Args:
        model: the loaded :class:`CausalLM`.
        num_blocks, block_size: KV pool geometry; the pool is
            ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]`` in ``kv_dtype``, ``kv_heads``
            being the model's ``local_kv_heads`` (``num_kv_heads / degree`` under tensor parallelism).
        seed: seed of the generator used by unseeded sampling.
        kv_alloc: allocates the zeroed pool (e.g. in memory shared with the node); ``torch.zeros`` by default.
        kv_payload: ``(block_size, kv_heads, head_dim)`` actually allocated per block and layer; None:
            the geometry's. A timed benchmark device passes ``(1, 1, 1)``: its ledger indexes the
            geometry-sized block count (``num_blocks``) of a pool of a few bytes per block.

    ``graphs`` (set by the loader, None for eager only): pure decode steps that fit a bucket replay a
    captured CUDA graph (:class:`~node.worker.cuda_graphs.DecodeGraphs`); every other step runs eagerly.
    ``compiled`` (set by the loader for ``--compile``, else None): steps whose token count fits a
    compiled bucket run its graph (:class:`~node.worker.compiled_forward.CompiledForward`); ``background``
    (set by the engine when the buckets compile while it serves, else None): the
    :class:`~node.worker.background_compile.BackgroundCompile` doing it, and ``gate`` marks each step for it.
    ``pacer`` (set by the loader for ``--benchmark-model timed:PATH``, else None): makes every step
    last its modelled time (:class:`~node.worker.timed_step.StepPacer`).
    """

    def __init__(self, model: CausalLM, cfg: ModelConfig, device: torch.device, num_blocks: int,
                 block_size: int, kv_dtype: torch.dtype, seed: int = 0, kv_alloc: KVAlloc | None = None,
                 kv_payload: tuple[int, int, int] | None = None):
        self.model = model
        self.cfg = cfg
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        kv_heads = getattr(model, "local_kv_heads", cfg.num_kv_heads)  # this rank's KV heads under tensor parallelism
        shape = (cfg.num_layers, 2, num_blocks, *(kv_payload or (block_size, kv_heads, cfg.head_dim)))
        self.kv_cache = kv_alloc(shape, kv_dtype, device) if kv_alloc else torch.zeros(shape, dtype=kv_dtype, device=device)
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        if device.type == "cpu":
            cpu_sampling_numba.available()  # compile (or load) the sampling kernel now, not in a sampled step
        # One step at a time, and none during a graph capture. The node's KV copies do not take it: they
        # run in the node's process and keep off blocks of steps in flight (node.runtime.engine).
        self._lock = threading.Lock()
        self.graphs: DecodeGraphs | None = None
        self.graphs_error: str | None = None  # why a capture failed (graphs were then turned off)
        self.pacer: StepPacer | None = None
        self.compiled: CompiledForward | None = None  # --compile inductor (node.worker.compiled_forward)
        self.compiled_error: str | None = None  # why the compile failed on CUDA (steps then run eagerly)
        self.background: BackgroundCompile | None = None  # buckets compiling while serving (background_compile)
        self.gate = StepGate()  # parks a background compile thread while a step runs
        # The last step's verify items (node.worker.spec_verify): seq id -> (the tokens kept after the first,
        # their logprobs when asked); set by every step with one, read by the engine core right after it
        self.kept: dict[str, tuple[list[int], list[TokenLogprobs]]] = {}
        # A time-shared group rank in its prefill layout: the pools of the devices whose KV heads it
        # computes, its own among them (node.worker.role_layouts); None: its own pool only.
        self.kv_views: tuple[torch.Tensor, ...] | None = None

    @property
    def kv_pool_bytes(self) -> int:
        return self.kv_cache.numel() * self.kv_cache.element_size()

    def execute(self, step: StepInput) -> dict[str, SeqOutput]:
        """Run one forward pass over the packed batch and sample. Returns outputs by ``seq_id``."""
        with self._lock, self.gate.step(), torch.inference_mode():
            return self._execute(step)

    def prepare_decode(self) -> float:
        """Capture the decode graphs if they are not yet (the decode role's reconfiguration; later calls
        reuse them). Returns the capture time in ms, 0.0 when there was nothing to do. A failed capture
        is logged, turns graphs off (steps run eagerly) and leaves its reason in ``graphs_error``."""
        graphs = self.graphs
        if graphs is None or graphs.captured:
            return 0.0
        with self._lock:
            try:
                ms = graphs.capture_all()
            except Exception as e:  # a failed capture must not stop the node: run eagerly
                log.exception("decode_graph_capture_failed", device=str(self.device), error=str(e))
                graphs.release()
                self.graphs = None
                self.graphs_error = f"{type(e).__name__}: {e}"
                return 0.0
        log.info("decode_graphs_captured", device=str(self.device), buckets=list(graphs.buckets), ms=round(ms, 1))
        return ms

    def _execute(self, step: StepInput) -> dict[str, SeqOutput]:
        dev = self.device
        hidden = self.graphs.run(step.seqs) if self.graphs is not None else None
        if hidden is None:
            hidden = self._forward(step)
        cu = list(itertools.accumulate((len(s.token_ids) for s in step.seqs), initial=0))
        outputs = {s.seq_id: SeqOutput() for s in step.seqs}
        # Rows whose logits are needed: the last row of each sampling sequence.
        samplers = [(i, s) for i, s in enumerate(step.seqs) if s.sample is not None]
        if samplers and step.spec:
            self._sample_verify(hidden, cu, samplers, step, outputs)
        elif samplers:
            if len(samplers) == cu[-1]:  # a decode step: one row per sequence, every one sampled, in order
                logits = self.model.compute_logits(hidden)
            else:
                rows = torch.tensor([cu[i + 1] - 1 for i, _ in samplers], device=dev)
                logits = self.model.compute_logits(hidden[rows])
            # the grammar mask is filled here, before the logits are first read: on a GPU while the
            # forward's kernels still run (on the CPU after them; a mask thread cost more, see grammar_masks)
            mask = step.masks.result() if step.masks is not None else None
            tokens, logprobs = sample(logits, [s.sample for _, s in samplers], self.generator, mask)
            for (_, s), token, lp in zip(samplers, tokens, logprobs):
                out = outputs[s.seq_id]
                out.token_id, out.logprobs = token, lp
        for i, s in enumerate(step.seqs):
            if s.prompt_targets:
                rows = torch.arange(cu[i], cu[i] + len(s.prompt_targets), device=dev)
                logits = self.model.compute_logits(hidden[rows])
                targets = torch.tensor(s.prompt_targets, dtype=torch.int64, device=dev)
                outputs[s.seq_id].prompt_logprobs = logprobs_of(logits, targets, s.prompt_top)
        return outputs

    def _sample_verify(self, hidden: torch.Tensor, cu: list[int], samplers: list[tuple[int, SeqInput]],
                       step: StepInput, outputs: dict[str, SeqOutput]) -> None:
        """Sample a step with verify items: every row of a verify item (its last token's and its drafts'),
        the last row of the others, in one batch; each verify item keeps its matched drafts plus the
        token after them (:mod:`node.worker.spec_verify`): the first in ``outputs``, the others in :attr:`kept`."""
        rows: list[int] = []
        reqs: list[SampleRequest] = []
        for i, s in samplers:
            k = len(s.draft)
            rows.extend(range(cu[i + 1] - 1 - k, cu[i + 1]))
            reqs.extend(verify_requests(s.sample, list(s.draft)) if k else (s.sample,))
        # a step of verify items only (one stream speculating): every row is sampled, in order, no gather
        picked = hidden if len(rows) == hidden.shape[0] else hidden[torch.tensor(rows, device=self.device)]
        logits = self.model.compute_logits(picked)
        mask = step.masks.result() if step.masks is not None else None
        tokens, logprobs = sample(logits, reqs, self.generator, mask)
        at = 0
        kept = self.kept = {}
        for _, s in samplers:
            k = len(s.draft)
            out = outputs[s.seq_id]
            out.token_id, out.logprobs = tokens[at], logprobs[at]
            if k:
                a = accepted(list(s.draft), tokens[at : at + k + 1])
                lps = logprobs[at + 1 : at + a] if s.sample.params.logprobs is not None else []
                kept[s.seq_id] = (tokens[at + 1 : at + a], lps)
            at += k + 1

    def _forward(self, step: StepInput) -> torch.Tensor:
        """The forward of any step → final hidden states ``[num_tokens, hidden]``: through a compiled
        bucket when one fits (:attr:`compiled`), else eagerly."""
        ids, pos, meta = self._pack(step)
        if self.compiled is not None and self.kv_views is None:
            hidden = self.compiled.run(ids, pos, meta)
            if hidden is not None:
                return hidden
        dev = self.device
        return self.model(
            torch.tensor(ids, dtype=torch.int64, device=dev), torch.tensor(pos, dtype=torch.int64, device=dev),
            self.kv_cache if self.kv_views is None else self.kv_views, meta,
        )

    def _pack(self, step: StepInput) -> tuple[list[int], list[int], AttentionMetadata]:
        """A step's token ids and positions (lists, packed in sequence order) and its attention metadata."""
        dev = self.device
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        cu = [0]
        seq_lens: list[int] = []
        for s in step.seqs:
            n = len(s.token_ids)
            ids.extend(s.token_ids)
            p = range(s.start, s.start + n)
            pos.extend(p)
            slots.extend(s.block_ids[i // bs] * bs + i % bs for i in p)
            cu.append(cu[-1] + n)
            seq_lens.append(s.start + n)
        width = max(len(s.block_ids) for s in step.seqs)
        table = [s.block_ids + [0] * (width - len(s.block_ids)) for s in step.seqs]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor(table, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            max_seqlen_q=max(len(s.token_ids) for s in step.seqs),
        )
        return ids, pos, meta


def kv_bytes_per_token_per_rank(cfg: ModelConfig, kv_dtype: torch.dtype, tp_degree: int = 1) -> int:
    """KV bytes per token in one device's pool: ``kv_bytes_per_token / tp_degree`` (a rank of a
    tensor-parallel group holds ``num_kv_heads / tp_degree`` KV heads; the degree divides them)."""
    return cfg.kv_bytes_per_token(kv_dtype) // tp_degree


def plan_kv_blocks(cfg: ModelConfig, kv_dtype: torch.dtype, block_size: int, kv_bytes: int, tp_degree: int = 1) -> int:
    """Blocks that fit in ``kv_bytes`` of one device:
    ``kv_bytes // (block_size * kv_bytes_per_token / tp_degree)`` (see :func:`kv_bytes_per_token_per_rank`)."""
    return kv_bytes // (block_size * kv_bytes_per_token_per_rank(cfg, kv_dtype, tp_degree))


def free_device_bytes(device: torch.device) -> tuple[int, int]:
    """``(free, total)`` bytes of a CUDA device (``torch.cuda.mem_get_info``)."""
    return torch.cuda.mem_get_info(device)


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())

