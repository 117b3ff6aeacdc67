"""The model forward compiled by ``torch.compile`` (inductor), one graph per token-count bucket.

An eager forward of a small model is dispatch-bound: stories260k's decode step at batch 1 is a few
hundred tiny PyTorch ops, ~1-2 ms of per-op overhead for ~0.5 MFLOP of arithmetic (issue 31).
Inductor fuses the elementwise work (RMSNorm, RoPE, SwiGLU, residual adds) into a few generated C++
kernels per layer and calls the GEMMs directly, so a step is a short list of kernel calls.

* **Buckets.** A step of ``n`` tokens (any mix of decode rows and prompt chunks) runs the graph of
  the smallest bucket ``T >= n`` (``--compile-sizes``, like vLLM's capture sizes); the ``T - n``
  padding rows are token 0 at position 0, never written to the cache, and their output rows are
  dropped. A step larger than the largest bucket runs eagerly. Each bucket is compiled with static
  shapes (``dynamic=False``): the graph's only inputs are ``input_ids [T]``, ``positions [T]`` and the
  KV pool, because the attention metadata reaches the op out of band
  (:func:`shiftnode_kernels.custom_ops.step_metadata`), so the number of sequences and their
  contexts never shape the graph.
* **Attention stays opaque**: ``shiftnode::unified_attention`` (:mod:`shiftnode_kernels.custom_ops`)
  writes the layer's K/V and runs the backend's paged attention (the Numba decode kernel on the CPU);
  it mutates the pool in place (its schema says so, and inductor passes the pool's views, no copy).
* **Never compiled by a step.** The buckets are compiled by :meth:`CompiledForward.warm_all` at
  start-up, or one by one by a background thread while the engine serves
  (:mod:`node.worker.background_compile`; a bucket not compiled yet runs eagerly); inductor's caches on
  disk (:mod:`node.worker.compile_cache`) make a later start mostly a cache load. Until
  :meth:`CompiledForward.settle`, steps look their graph up in dynamo's run-only mode (no trace, no
  process-wide setting written while the compile thread works); after it, calls run under
  ``torch.compiler.set_stance("fail_on_recompile")``: a step that would need a new graph raises instead,
  is logged once and runs eagerly. Each instance compiles its own copy of the traced function, so its
  graphs are told apart by input shape alone and only those guards run per call.
* **Inductor options** (:func:`inductor_options`): on the CPU (:data:`INDUCTOR_OPTIONS`) the C++
  wrapper, no per-call size assertions, and OpenMP regions only at ATen's grain; on CUDA
  (:data:`CUDA_INDUCTOR_OPTIONS`) no size assertions and inductor's own CUDA graphs off.
* **Operators traced** (:func:`traced_ops`): on the CPU the backend's elementwise operators; on CUDA
  the torch references of RMSNorm, RoPE and SwiGLU (:mod:`shiftnode_kernels.reference`), which
  inductor fuses into Triton kernels of its own; the hand-written Triton launchers are never traced.
  Attention is the backend's (``triton`` on CUDA by default) inside the opaque op in both cases.
* Grad mode: the graphs are traced and run under ``no_grad`` outside inference mode (inductor's
  functionalisation of the pool's in-place update refuses inference tensors), so the step's input
  tensors are made there too.

Supported: CPU and CUDA devices, degree-1 models (no tensor parallelism), one KV pool (not a
time-shared group's multi-pool prefill layout, which runs eagerly). On CUDA a pure decode step that
fits a decode CUDA graph (:mod:`node.worker.cuda_graphs`) still replays that graph (the runner tries
the graphs first); the compiled buckets serve the other steps (prefill, mixed, larger decode batches).
Inductor's ``reduce-overhead`` mode (its own CUDA graphs) is not used: a replay would not see the
metadata that reaches the attention op out of band.
"""

from __future__ import annotations

import threading
import time
import types
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import structlog
import torch

from node.worker.cuda_graphs import pick_bucket
from node.worker.model import AttentionMetadata, CausalLM
from shiftnode_kernels import reference
from shiftnode_kernels.custom_ops import StepMetadata, step_metadata, unified_attention

log = structlog.get_logger("shiftnode.compiled_forward")

COMPILE_MODES = ("none", "inductor")
"""The values of ``--compile``."""

DEFAULT_COMPILE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
"""Token-count buckets compiled by default on a CPU device (capped by ``--max-num-batched-tokens``)."""

DEFAULT_CUDA_COMPILE_SIZES = (16, 64, 256, 512, 1024, 2048)
"""Token-count buckets compiled by default on a CUDA device (capped by ``--max-num-batched-tokens``):
prefill and mixed steps, whose eager forward issue 31 found launch-bound on an H200 for an 8B model;
pure decode steps replay the decode CUDA graphs instead. Not tuned: on an H200 (2026-12-04, Llama-3-8B
geometry) a bucket compiled in 31-39 s cold, and compiled steps ran 1.2-1.5x faster than eager at 64
tokens and no faster from 512 (bench/RESULTS.md)."""

CUDA_COMPILE_BUDGET_S = 300.0
"""Start-up compile time allowed on a CUDA device: once compiling the buckets so far took longer, the
larger ones are left out (their steps run eagerly; ``compile_budget_spent`` is logged). Buckets compile in
ascending order."""

PARALLEL_GRAIN = 32768
"""Elements per thread below which a generated C++ kernel runs on one thread (inductor's
``cpp.min_chunk_size``, 512 by default): ATen's own ``GRAIN_SIZE``, so compiled kernels split work
across threads where the eager ops would. With inductor's 512, an ``[8, 172]`` SwiGLU opened an
OpenMP parallel region, and on a busy 2-core machine each such region waited for a descheduled
thread: a stories260k step took ~300 ms instead of ~1 ms."""

INDUCTOR_OPTIONS = {"cpp.min_chunk_size": PARALLEL_GRAIN, "size_asserts": False, "cpp_wrapper": True}
"""Inductor options of every bucket: :data:`PARALLEL_GRAIN`; no shape/stride assertion of each input
and extern-kernel output per call (~40 per stories260k step; the buckets' shapes are fixed and the
inputs are built here); and a C++ wrapper instead of the Python one that calls the kernels (its ~150
Python-level calls per step were a third of a compiled stories260k step; measured here at batch 1,
under load: 0.61 ms against 0.77-0.92 ms; compiling a bucket takes about 1.5x longer)."""

CUDA_INDUCTOR_OPTIONS = {"size_asserts": False, "triton.cudagraphs": False}
"""Inductor options of every bucket on CUDA: no per-call size assertions (as on the CPU), and no CUDA
graphs of inductor's own (the attention metadata is read out of band, so a replay would reuse a stale
step's). No C++ wrapper: on CUDA it lengthens the compile (a C++ build per graph)."""


def inductor_options(device: torch.device) -> dict:
    """The inductor options for buckets on ``device``: a copy of :data:`INDUCTOR_OPTIONS` on the CPU,
    of :data:`CUDA_INDUCTOR_OPTIONS` elsewhere."""
    return dict(INDUCTOR_OPTIONS if device.type == "cpu" else CUDA_INDUCTOR_OPTIONS)


_COMPILE_LOCK = threading.Lock()  # dynamo compiles one graph at a time per process


def compile_sizes(max_num_batched_tokens: int, sizes: Sequence[int] | None = None,
                  device_type: str = "cpu") -> tuple[int, ...]:
    """The buckets to compile: ``sizes`` (default :data:`DEFAULT_COMPILE_SIZES`, or
    :data:`DEFAULT_CUDA_COMPILE_SIZES` for ``device_type == "cuda"``) at most ``max_num_batched_tokens``,
    ascending, without duplicates; at least ``(1,)``.

    Raises:
        ValueError: a size below 1.
    """
    default = DEFAULT_CUDA_COMPILE_SIZES if device_type == "cuda" else DEFAULT_COMPILE_SIZES
    sizes = default if sizes is None else tuple(sizes)
    if any(int(s) < 1 for s in sizes):
        raise ValueError(f"compile sizes must be at least 1, got {list(sizes)}")
    out = sorted({int(s) for s in sizes if int(s) <= max_num_batched_tokens})
    return tuple(out) or (1,)


def compile_unsupported(device: torch.device, model: Any) -> str | None:
    """None when the forward can be compiled here, else why not."""
    if device.type not in ("cpu", "cuda"):
        return f"--compile inductor runs on CPU and CUDA devices, not {device}"
    if not isinstance(model, CausalLM):
        return "a benchmark model has no forward to compile"
    if model.tp.degree != 1 or model.layout.held_degree != 1:
        return "tensor-parallel models run eagerly"
    return None


@dataclass(frozen=True)
class AttentionOpOps:
    """The operators the compiled forward traces: the backend's elementwise ones, and attention
    through ``shiftnode::unified_attention`` with the backend's kernels inside (see the module doc)."""

    backend: str
    rms_norm: Callable
    rotary_embedding: Callable
    silu_and_mul: Callable

    def unified_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        return unified_attention(q, k, v, k_cache, v_cache, scale, self.backend)


def traced_ops(ops: Any, device_type: str) -> AttentionOpOps:
    """The operators to trace for a model whose eager operators are ``ops`` (a
    :class:`~shiftnode_kernels.ops.KernelOps`): attention through the opaque op with ``ops``' backend;
    the elementwise operators ``ops``' own on the CPU, the torch references on CUDA (inductor generates
    fused Triton kernels from them; dynamo does not trace hand-written Triton launchers reliably)."""
    backend = getattr(ops, "backend", "torch")
    if device_type == "cpu":
        return AttentionOpOps(backend, ops.rms_norm, ops.rotary_embedding, ops.silu_and_mul)
    return AttentionOpOps(backend, reference.rms_norm, reference.rotary_embedding, reference.silu_and_mul)


def _hidden(model: CausalLM, ops: AttentionOpOps, input_ids: torch.Tensor, positions: torch.Tensor,
            kv_cache: torch.Tensor) -> torch.Tensor:
    return model.hidden_states(input_ids, positions, kv_cache, None, ops)


def _step_meta(n: int, meta: AttentionMetadata) -> StepMetadata:
    """The attention op's out-of-band metadata of a step of ``n`` real tokens described by ``meta``."""
    return StepMetadata(n, meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q, meta.max_seqlen_q)


def _own_code(fn: Callable) -> Callable:
    """``fn`` with a code object of its own. Dynamo keeps compiled graphs per code object: each
    :class:`CompiledForward` then holds only its own buckets (one graph per input shape), so at a
    call the only guards that tell its graphs apart are the input shapes, and those are the ones
    ``skip_guard_eval_unsafe`` keeps (see :meth:`CompiledForward.run`)."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _raise_recompile_limit(entries: int) -> None:
    """Dynamo keeps at most ``recompile_limit`` graphs per function (8 by default); every bucket of
    every device in this process is one."""
    import torch._dynamo.config as dc

    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(dc, name) and getattr(dc, name) < entries:
            setattr(dc, name, entries)


class CompiledForward:
    """Compiled forwards of ``model`` over ``kv_cache``, one per bucket of ``sizes``.

    Args:
        model: a degree-1 :class:`CausalLM` (its parameters are set to ``requires_grad=False``:
            serving never trains, and a traced view of a parameter that requires grad is refused; the
            weight views are rebuilt on the same storage, so captured decode graphs stay valid).
        kv_cache: ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``, never reallocated.
        sizes: token-count buckets (see :func:`compile_sizes`).
        mode: ``torch.compile`` mode (``None``: inductor's default; never ``reduce-overhead``, see the
            module doc).
        ops: the operators to trace (None: :func:`traced_ops` of the model's operators and device).
        budget_s: :meth:`warm_all` stops compiling further buckets once it took longer than this
            (None: no limit; the loader passes :data:`CUDA_COMPILE_BUDGET_S` on CUDA).
        options: inductor options (None: :func:`inductor_options` of the pool's device).
        settled: steps may use the fast, process-wide stance path from the start (:meth:`run`); False while
            another thread compiles buckets (:mod:`node.worker.background_compile`), until :meth:`settle`.

    Counters: ``steps`` (steps run compiled), ``fallbacks`` (steps that needed a recompile and ran
    eagerly), ``compile_ms`` (time spent in :meth:`warm_all`), ``compile_ms_by_size`` (per bucket).
    """

    def __init__(self, model: CausalLM, kv_cache: torch.Tensor, sizes: Sequence[int], mode: str | None = None,
                 ops: AttentionOpOps | None = None, budget_s: float | None = None, options: dict | None = None,
                 settled: bool = True):
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.sizes = tuple(sorted(sizes))
        self.ops = ops if ops is not None else traced_ops(model.ops, self.device.type)
        self.budget_s = budget_s
        model.requires_grad_(False)
        model.set_tensor_parallel(model.tp)  # rebuild the weight views without autograd
        self.options = inductor_options(self.device) if options is None else options
        traced = _own_code(_hidden)
        self._fn = torch.compile(traced, backend="inductor", fullgraph=True, dynamic=False, mode=mode, options=self.options)
        # the same code object's graphs, looked up without ever compiling (a miss runs the function eagerly)
        self._lookup = torch._dynamo.run(traced)
        self._settled = settled
        self._ready: set[int] = set()
        self.steps = 0
        self.fallbacks = 0
        self.compile_ms = 0.0
        self.compile_ms_by_size: dict[int, float] = {}

    @property
    def warmed(self) -> bool:
        return len(self._ready) == len(self.sizes)

    @property
    def ready_sizes(self) -> tuple[int, ...]:
        """The buckets compiled so far (ascending)."""
        return tuple(sorted(self._ready))

    @property
    def settled(self) -> bool:
        """No other thread compiles buckets any more: steps take the stance path (:meth:`run`)."""
        return self._settled

    def settle(self) -> None:
        """The background compile is over (:mod:`node.worker.background_compile`): from the next step on,
        calls run under ``fail_on_recompile`` with only the bucket-telling guards (:meth:`run`)."""
        self._settled = True

    def warm_all(self) -> float:
        """Compile (or load from inductor's cache) every bucket in ascending order (:meth:`warm`) until
        :attr:`budget_s` is spent: larger buckets are then left out (:attr:`warmed` False; their steps run
        eagerly; logged). Returns the time it took in ms."""
        t0 = time.perf_counter()
        for t in self.sizes:
            if self.budget_s is not None and time.perf_counter() - t0 > self.budget_s:
                log.warning("compile_budget_spent", budget_s=self.budget_s, compiled=self.ready_sizes,
                            left_out=[s for s in self.sizes if s not in self._ready])
                break
            self.warm(t)
        return (time.perf_counter() - t0) * 1e3

    def warm(self, size: int) -> float:
        """Compile (or load) the graph of bucket ``size`` (one of :attr:`sizes`) by running it once over
        padding only (no KV slot is written). Returns the time it took in ms (0.0 if it was ready).

        Raises:
            ValueError: ``size`` is not a bucket.
        """
        if size not in self.sizes:
            raise ValueError(f"{size} is not a bucket of {self.sizes}")
        if size in self._ready:
            return 0.0
        t0 = time.perf_counter()
        dev = self.device
        empty = StepMetadata(0, torch.zeros(0, dtype=torch.int64, device=dev),
                             torch.zeros((0, 1), dtype=torch.int32, device=dev), torch.zeros(0, dtype=torch.int32, device=dev),
                             torch.zeros(1, dtype=torch.int32, device=dev), 0)
        with _COMPILE_LOCK:
            _raise_recompile_limit(len(self.sizes) + 1)
            with torch.inference_mode(False), torch.no_grad(), step_metadata(empty):
                # two tensors: dynamo guards on aliasing, and a step's ids and positions never alias
                ids, pos = (torch.zeros(size, dtype=torch.int64, device=dev) for _ in range(2))
                self._fn(self.model, self.ops, ids, pos, self.kv_cache)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
        ms = (time.perf_counter() - t0) * 1e3
        self._ready.add(size)
        self.compile_ms_by_size[size] = ms
        self.compile_ms += ms
        return ms

    def run(self, input_ids: list[int], positions: list[int], meta: AttentionMetadata) -> torch.Tensor | None:
        """The final hidden states ``[n, hidden]`` of a step of ``n = len(input_ids)`` tokens through its
        bucket's graph, or None (the caller runs it eagerly) when no warmed bucket fits or the graph
        would have to be recompiled. ``meta``'s tensors describe the ``n`` real tokens."""
        n = len(input_ids)
        bucket = pick_bucket(n, self.sizes)
        if bucket is None or bucket not in self._ready:
            return None
        # Guards: only those that tell this runner's graphs apart (the bucket's shape) are checked
        # (skip_guard_eval_unsafe; ~0.1 ms of a 0.6 ms step otherwise, on ~30 weight tensors): the model,
        # its weights' shapes, the pool and the grad mode are those of the warm-up by construction.
        # While another thread compiles, the stance (process-wide) stays untouched: a run-only lookup with
        # every guard checked, which never compiles (a miss would run the function eagerly, still exact).
        pad = bucket - n
        sm = _step_meta(n, meta)
        with torch.inference_mode(False), torch.no_grad():
            ids = torch.tensor(input_ids + [0] * pad if pad else input_ids, dtype=torch.int64, device=self.device)
            pos = torch.tensor(positions + [0] * pad if pad else positions, dtype=torch.int64, device=self.device)
            if not self._settled:
                with step_metadata(sm):
                    out = self._lookup(self.model, self.ops, ids, pos, self.kv_cache)
                self.steps += 1
                return out[:n] if pad else out
            try:
                with step_metadata(sm), torch.compiler.set_stance("fail_on_recompile", skip_guard_eval_unsafe=True):
                    out = self._fn(self.model, self.ops, ids, pos, self.kv_cache)
            except RuntimeError as e:
                if "recompil" not in str(e).lower():
                    raise
                self.fallbacks += 1
                if self.fallbacks == 1:
                    log.warning("compiled_forward_recompile_refused", bucket=bucket, error=str(e)[:300])
                return None
        self.steps += 1
        return out[:n] if pad else out

    def reference(self, input_ids: list[int], positions: list[int], meta: AttentionMetadata) -> torch.Tensor:
        """What :meth:`run` computes, without inductor: the traced function run eagerly over the ``n`` real
        tokens with the same operators (the compiled graph's own reference; it writes the same K/V
        slots). Returns ``[n, hidden]`` in the model dtype."""
        n = len(input_ids)
        sm = _step_meta(n, meta)
        with torch.inference_mode(False), torch.no_grad(), step_metadata(sm):
            ids = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
            pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
            return _hidden(self.model, self.ops, ids, pos, self.kv_cache)
