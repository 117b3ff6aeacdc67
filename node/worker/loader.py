"""Turn a :class:`NodeConfig` into a loaded model runner per device (weights, tokenizer, KV pool)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from node.config import NodeConfig, benchmark_cost_path
from node.worker.background_compile import BackgroundCompile
from node.worker.compile_cache import compile_lock
from node.worker.compiled_forward import (CUDA_COMPILE_BUDGET_S, CompiledForward, compile_sizes, compile_unsupported,
                                         inductor_options)
from node.worker.cuda_graphs import DecodeGraphs, decode_graphs_unsupported
from node.worker.model_config import ModelConfig
from node.worker.runner import (KVAlloc, ModelRunner, free_device_bytes, kv_bytes_per_token_per_rank, plan_kv_blocks,
                                weight_bytes)
from node.worker.tensor_parallel import ShardLayout, TPGroup
from node.worker.tokenizer import TextTokenizer
from node.worker.weights import build_model, dtype_from_name

log = structlog.get_logger("shiftnode.loader")

CPU_DEFAULT_KV_BYTES = 512 * 1024 * 1024


class StartupError(RuntimeError):
    """The node cannot start with this configuration (the message gives the numbers)."""


@dataclass
class LoadedModel:
    cfg: ModelConfig
    tokenizer: TextTokenizer
    max_model_len: int
    dtype: torch.dtype


def load_model_info(config: NodeConfig) -> LoadedModel:
    """Read the model's config and tokenizer (no weights yet) from ``config.model`` (by default the
    embedded stories260k folder, :data:`node.config.EMBEDDED_MODEL`). A folder without ``tokenizer.json``
    run with random weights (``--load-format dummy``) or a benchmark model gets the byte-level tokenizer."""
    cfg = ModelConfig.from_folder(config.model)
    if (config.benchmark_model or config.load_format == "dummy") and not (Path(config.model) / "tokenizer.json").is_file():
        # a config-only folder (bench/configs/*) with no real weights either: bytes are text enough
        tok = TextTokenizer.byte_level()
    else:
        tok = TextTokenizer.from_folder(config.model)
    try:
        override = config.serving.template_text()  # --chat-template replaces the checkpoint's
    except ValueError as e:
        raise StartupError(str(e)) from e
    if override is not None:
        tok.chat_template = override
    if tok.vocab_size > cfg.vocab_size:
        raise StartupError(f"tokenizer has {tok.vocab_size} tokens but the model's vocab_size is {cfg.vocab_size}")
    max_len = config.max_model_len or cfg.max_position_embeddings
    if max_len > cfg.max_position_embeddings:
        raise StartupError(f"--max-model-len {max_len} exceeds the model's max_position_embeddings {cfg.max_position_embeddings}")
    return LoadedModel(cfg, tok, max_len, dtype_from_name(config.dtype, cfg))


def available_host_bytes() -> int | None:
    """Bytes of host memory the kernel could give this process now (``MemAvailable`` of /proc/meminfo), or
    None where that is not readable (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


HOST_ROOM_SHARE = 0.9  # a CPU KV pool may take at most this share of the memory available at its start


def check_host_room(pool_bytes: int, device_id: str) -> None:
    """Refuse a CPU device's KV pool that the host cannot hold: allocating it would not fail cleanly but have
    the kernel's out-of-memory killer end this process (and perhaps others) once the pool's pages are touched.

    Raises:
        StartupError: ``pool_bytes`` above :data:`HOST_ROOM_SHARE` of :func:`available_host_bytes`.
    """
    avail = available_host_bytes()
    if avail is not None and pool_bytes > HOST_ROOM_SHARE * avail:
        raise StartupError(
            f"the KV pool of {pool_bytes} bytes on {device_id} exceeds {HOST_ROOM_SHARE:.0%} of the host's "
            f"available memory ({avail} bytes); lower --kv-cache-memory")


def torch_device(device_id: str) -> torch.device:
    """``cpu:N`` (an emulated device on the CPU) → ``cpu``; ``cuda:N`` → that GPU."""
    kind, _, _ = device_id.partition(":")
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise StartupError(f"device {device_id} requested but CUDA is not available")
        return torch.device(device_id)
    raise StartupError(f"unknown device {device_id!r} (cpu:N or cuda:N)")


def select_ops(backend: str, device_type: str) -> object:
    """The operator set for the model: under ``auto`` Triton kernels on CUDA, the CPU serving path
    (``shiftnode_kernels.cpu_ops``) elsewhere (:func:`shiftnode_kernels.ops.resolve_backend`)."""
    try:
        from shiftnode_kernels.ops import get_ops, resolve_backend
    except ImportError:  # shiftnode_kernels.ops not present: references only
        import shiftnode_kernels.reference as ref

        return ref
    return get_ops(resolve_backend(backend, device_type))


def build_runner(config: NodeConfig, info: LoadedModel, device_id: str, ops: object,
                 kv_alloc: KVAlloc | None = None, tp: TPGroup | None = None,
                 held_degree: int | None = None, background: bool = False) -> ModelRunner:
    """Load weights on one device and size its KV pool.

    The KV budget is ``--kv-cache-memory`` bytes when given; on CUDA otherwise
    ``gpu_memory_utilization * total - (total - free after loading)``; on the CPU 512 MiB.
    On CUDA with the triton backend (and without ``--enforce-eager``) the runner gets decode CUDA
    graphs, captured here, at start-up, in every mode (never lazily while requests wait; their memory
    comes out of the ``1 - gpu_memory_utilization`` headroom).

    ``tp`` (degree ``D > 1``): this device is rank ``tp.rank`` of a tensor-parallel group. It loads
    only its shard (``ShardLayout(D, D, rank)``: its heads, KV heads, MLP features and vocab rows of
    an untied head), its pool holds its ``num_kv_heads / D`` KV heads
    (``[layers, 2, num_blocks, block_size, K/D, head_dim]``), so the budget is divided by
    ``kv_bytes_per_token / D``; the ranks then agree on the smallest ``num_blocks`` of the group (one
    all-reduce MIN: CUDA devices may have different free memory), which the node's one block ledger
    of the group indexes on every rank. ``held_degree`` ``P`` (a time-shared group's ``--prefill-tp``,
    dividing ``D``): the device holds the degree-``P`` shard that contains its degree-``D`` one
    (``ShardLayout(D, P, rank // (D / P))``, ``1/P`` of the weights), so both layouts are views. Decode CUDA graphs are off at ``D > 1`` (eager steps) in
    this slice. Collective: every rank of the group must call it.

    ``background``: the caller is an engine process that will serve while the buckets of ``--compile``
    compile (:func:`attach_compiled_forward`); it starts ``runner.background`` itself once it serves.

    ``--benchmark-model timed:PATH``: the block count is the geometry's for ``--kv-cache-memory``
    (the emulated device's KV bytes), but the pool allocated holds one element per block, layer and
    K/V (``kv_payload=(1, 1, 1)``); the runner gets a :class:`~node.worker.timed_step.StepPacer` and
    no decode graphs (its steps run eagerly and sleep).

    Raises:
        StartupError: the budget holds fewer than ``max_model_len`` tokens (one full sequence).
        TensorParallelError: the model cannot be split ``D`` ways (the numbers in the message).
    """
    degree = tp.degree if tp is not None else 1
    dev = torch_device(device_id)
    cfg = info.cfg
    fmt = "safetensors" if config.load_format == "auto" else config.load_format
    if config.benchmark_model:  # bench tool: no weights, fixed logits (node.worker.benchmark_model)
        from node.worker.benchmark_model import build_benchmark_model

        model = build_benchmark_model(config.benchmark_model, cfg, info.tokenizer, dev, ops=ops, seed=config.seed,
                                      rows=config.max_num_batched_tokens + config.max_num_seqs, device_id=device_id)
    else:
        held = held_degree or degree
        layout = ShardLayout(degree, held, tp.rank // (degree // held)) if degree > 1 else ShardLayout()
        model = build_model(cfg, folder=config.model, load_format=fmt, dtype=info.dtype, device=dev,
                            max_positions=info.max_model_len, ops=ops, seed=config.seed, layout=layout,
                            tp=tp if degree > 1 else None)
    wbytes = weight_bytes(model)
    if config.kv_cache_memory_bytes is not None:
        kv_bytes = config.kv_cache_memory_bytes
    elif dev.type == "cuda":
        free, total = free_device_bytes(dev)
        kv_bytes = int(config.gpu_memory_utilization * total) - (total - free)
    else:
        kv_bytes = CPU_DEFAULT_KV_BYTES
    num_blocks = plan_kv_blocks(cfg, info.dtype, config.block_size, max(kv_bytes, 0), degree)
    per_token = kv_bytes_per_token_per_rank(cfg, info.dtype, degree)
    if degree > 1:  # every rank indexes the same blocks: the group's pool is as large as its smallest rank's
        import torch.distributed as dist

        agreed = torch.tensor([num_blocks], dtype=torch.int64, device=dev)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=tp.group)
        num_blocks = int(agreed.item())
    if num_blocks * config.block_size < info.max_model_len:
        raise StartupError(
            f"KV budget of {kv_bytes} bytes on {device_id} holds {num_blocks * config.block_size} tokens "
            f"(in whole blocks of {config.block_size} at {per_token} bytes/token; the {wbytes} bytes of weights "
            f"are apart from it), fewer than one max-length sequence "
            f"of {info.max_model_len} tokens; lower --max-model-len or raise the KV budget"
        )
    log.info(
        "model_loaded", device=device_id, model=config.model_name, architecture=cfg.architecture,
        load_format=fmt, random_weights=fmt == "dummy", dtype=str(info.dtype).removeprefix("torch."),
        weight_bytes=wbytes, kv_blocks=num_blocks, block_size=config.block_size, kv_bytes_per_token=per_token,
        max_model_len=info.max_model_len, **({"tp_rank": tp.rank, "tp_degree": degree} if degree > 1 else {}),
    )
    if fmt == "dummy":
        log.warning("random_weights", device=device_id, seed=config.seed,
                    message="weights are random (fixed seed): outputs are meaningless text")
    cost_path = benchmark_cost_path(config.benchmark_model)  # a timed device: tiny pool, paced steps
    if dev.type == "cpu" and cost_path is None:
        check_host_room(num_blocks * config.block_size * per_token, device_id)
    try:
        runner = ModelRunner(model, cfg, dev, num_blocks, config.block_size, info.dtype, seed=config.seed,
                             kv_alloc=kv_alloc, kv_payload=(1, 1, 1) if cost_path is not None else None)
    except (RuntimeError, MemoryError) as e:  # the KV pool could not be allocated
        raise StartupError(f"cannot allocate a KV pool of {num_blocks * config.block_size * per_token} bytes "
                           f"on {device_id}: {e}") from e
    if degree > 1:
        if dev.type == "cuda":
            log.info("decode_graphs_off", device=device_id, reason=f"tensor-parallel degree {degree} (eager steps)")
        return runner
    if cost_path is not None:  # a timed device: eager steps, each paced to the cost model's time
        from node.timed_cost import load_step_cost
        from node.worker.timed_step import StepPacer

        runner.pacer = StepPacer(load_step_cost(cost_path))
        log.info("timed_device", device=device_id, cost_model=cost_path, kv_blocks=num_blocks,
                 emulated_kv_bytes=num_blocks * config.block_size * per_token, allocated_kv_bytes=runner.kv_pool_bytes,
                 decode_graphs="off (timed steps run eagerly)")
        return runner
    attach_decode_graphs(runner, config, info.max_model_len, ops, device_id)
    attach_compiled_forward(runner, config, device_id, background=background)
    attach_packed_weights(runner, config, device_id)
    return runner


def attach_packed_weights(runner: ModelRunner, config: NodeConfig, device_id: str) -> None:
    """On a CPU device at degree 1 with eager steps, point the model's projections at oneDNN-packed
    copies of their weights (:mod:`node.worker.cpu_linear`) unless ``--cpu-weight-packing off``;
    logs why not where it does not apply on a CPU."""
    from node.worker.cpu_linear import PACK_MIN_ELEMENTS, pack_model, packing_unsupported

    if runner.device.type != "cpu" or not config.cpu_weight_packing or config.benchmark_model:
        return
    reason = ("--compile (inductor packs its own)" if runner.compiled is not None
              else packing_unsupported(runner.device, runner.model.embed_tokens.weight.dtype))
    nbytes = pack_model(runner.model) if reason is None else 0
    if nbytes:
        log.info("weights_packed", device=device_id, bytes=nbytes)
    else:
        reason = reason or f"every projection under {PACK_MIN_ELEMENTS} elements (plain F.linear is faster there)"
        log.info("weights_not_packed", device=device_id, reason=reason)


def auto_compile_off(runner: ModelRunner, background: bool) -> str | None:
    """Why ``--compile auto`` leaves ``runner``'s steps eager, or None where it compiles them in the
    background: a CPU device (CUDA: ``--compile inductor``), an engine process serving while it compiles
    (not steps in the node's process, ``--engine-layout thread``, whose loop the compile would slow), and
    a dispatch-bound model, whose projections are all too small for oneDNN packing (under
    :data:`~node.worker.cpu_linear.PACK_MIN_ELEMENTS`: a step of a few hundred tiny ops, which inductor
    fuses; a larger model's step is bound by its weights' bandwidth, which packing serves and compiling
    has not been measured to)."""
    from node.worker.cpu_linear import PACK_MIN_ELEMENTS

    if runner.device.type != "cpu":
        return f"--compile auto compiles on CPU devices (on {runner.device.type}: --compile inductor)"
    if not background:
        return "--compile auto compiles in engine processes (steps run in the node's process here)"
    model = runner.model
    weights = [w for layer in model.layers for w in (layer.qkv_proj.weight, layer.o_proj.weight,
                                                     layer.gate_up_proj.weight, layer.down_proj.weight)]
    biggest = max((w.numel() for w in weights + [model.head_weight]), default=0)
    if biggest >= PACK_MIN_ELEMENTS:
        return (f"projections of up to {biggest} elements run on packed weights (--compile inductor to "
                "compile anyway)")
    return None


def _use_compile_cache(runner: ModelRunner, config: NodeConfig, options: dict) -> tuple[str | None, str | None]:
    """Point this process's inductor cache into ``--compile-cache-dir`` (:mod:`node.worker.compile_cache`):
    ``(the model's directory, the root)``, or ``(None, None)`` (logged) where it cannot be written (inductor's
    default directory then, and no lock between engines)."""
    from node.worker.compile_cache import cache_facts, default_cache_root, use_cache_dir

    root = config.compile_cache_dir or str(default_cache_root())
    facts = cache_facts(config.model, runner.kv_cache.dtype, tuple(runner.kv_cache.shape),
                        getattr(runner.model.ops, "backend", "torch"), options, runner.device)
    try:
        return str(use_cache_dir(root, facts)), root
    except OSError as e:
        log.warning("compile_cache_unusable", root=str(root), error=str(e))
        return None, None


def attach_compiled_forward(runner: ModelRunner, config: NodeConfig, device_id: str, background: bool = False) -> None:
    """``--compile``: give ``runner`` a compiled forward per ``--compile-sizes`` bucket
    (:mod:`node.worker.compiled_forward`), its artifacts in the compile cache
    (:mod:`node.worker.compile_cache`).

    * ``background`` on a CPU device without ``--compile-wait``: nothing is compiled (nor imported) here;
      the buckets compile while the engine serves (``runner.background``, :mod:`node.worker.background_compile`,
      which the engine starts; ``runner.compiled`` is set by its thread). ``--compile auto`` compiles only
      there, and only a dispatch-bound model (:func:`auto_compile_off`).
    * Otherwise (``--compile inductor``) every bucket compiles now, before the node serves. On CUDA the
      decode graphs attached before keep the pure decode steps that fit them, the compile time is bounded by
      :data:`~node.worker.compiled_forward.CUDA_COMPILE_BUDGET_S`, and a compile that fails is logged
      (``compile_failed``, the reason in ``runner.compiled_error``) and leaves the steps eager.

    Where compiling is not supported (a benchmark model, tensor parallelism) steps stay eager, with a
    warning (``--compile inductor``) or a note (``auto``)."""
    if config.compile == "none":
        return
    reason = compile_unsupported(runner.device, runner.model)
    if config.compile == "auto":
        reason = reason or auto_compile_off(runner, background)
        if reason is not None:
            log.info("compile_off", device=device_id, mode="auto", reason=reason)
            return
    elif reason is not None:
        log.warning("compile_off", device=device_id, reason=reason)
        return
    cuda = runner.device.type == "cuda"
    sizes = compile_sizes(config.max_num_batched_tokens, config.compile_sizes, runner.device.type)
    options = inductor_options(runner.device)
    cache_dir, root = _use_compile_cache(runner, config, options)
    if background and not cuda and not config.compile_wait:
        runner.background = BackgroundCompile(runner, sizes, options, device_id, cache_dir, root)
        log.info("compile_in_background", device=device_id, sizes=list(sizes), cache_dir=cache_dir)
        return
    try:
        runner.compiled = CompiledForward(runner.model, runner.kv_cache, sizes, options=options,
                                          budget_s=CUDA_COMPILE_BUDGET_S if cuda else None)
        with compile_lock(root):  # engines starting together compile in turn: the later ones load the cache
            ms = runner.compiled.warm_all()
    except Exception as e:
        if not cuda:
            raise
        # A compile that fails on CUDA must not stop the node (as a failed decode-graph capture): eager steps.
        log.exception("compile_failed", device=device_id, error=str(e)[:500])
        runner.compiled = None
        runner.compiled_error = f"{type(e).__name__}: {e}"
        return
    log.info("forward_compiled", device=device_id, backend="inductor", sizes=list(runner.compiled.ready_sizes),
             ms=round(ms), bucket_ms={t: round(v) for t, v in runner.compiled.compile_ms_by_size.items()},
             cache_dir=cache_dir)


def attach_decode_graphs(runner: ModelRunner, config: NodeConfig, max_model_len: int, ops: object,
                         device_id: str) -> None:
    """Give ``runner`` decode graphs where they are supported and not ``--enforce-eager``; capture
    them now, before the node serves (a time-shared switch to the decode role then finds them captured:
    its ``prepare_decode`` is a round trip that does nothing, and each pure decode step picks its
    bucket's graph when it runs)."""
    reason = "--enforce-eager" if config.enforce_eager else decode_graphs_unsupported(runner.device, ops)
    if reason is not None:
        if runner.device.type == "cuda":
            log.info("decode_graphs_off", device=device_id, reason=reason)
        return
    runner.graphs = DecodeGraphs(runner.model, runner.kv_cache, block_size=config.block_size,
                                 max_model_len=max_model_len, max_num_seqs=config.max_num_seqs)
    runner.prepare_decode()
