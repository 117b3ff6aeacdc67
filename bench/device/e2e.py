"""End-to-end benchmark of the node's model runner on one CUDA GPU (Llama-3-8B geometry, dummy weights).

    python -m bench.device.e2e [--deadline S] [--markdown bench/RESULTS.md] [--json PATH]
    python -m bench.device.e2e --device cpu --quick      # a tiny model on the CPU: tests this script

The model is built by the node's own loader (``build_runner``: ``load_format="dummy"``, bf16, Triton
kernels, decode CUDA graphs attached as ``shiftnode serve`` would). Sections, in this order:

* ``ceilings``: device-to-device copy of a 4 GiB buffer (GB/s, read + write counted) and a bf16
  8192^3 matmul (TFLOP/s).
* ``load``: building the runner (weights, KV pool).
* ``switch``: role switches through ``DeviceEngine.switch_role``: PREFILL→DECODE the first time
  (captures every decode graph) vs later (reuses them); the swap time is what the pause pays.
* ``decode``: ``ModelRunner.execute`` of one decode step at batch 1/16/64/256, context 1024 tokens
  per sequence, eager vs CUDA graph, against the floor ``(weight bytes without the embedding table +
  KV bytes read) / copy bandwidth``; for graphs also the bare replay (device time only).
* ``sanity``: 16 greedy decode steps after a prefill, eager vs graphs, token ids compared (a batch
  that fills its bucket, and a padded one).
* ``prefill``: one 4096-token prompt against ``2 * params * tokens / matmul rate`` (params: the decoder
  layers' weights; the LM head runs on one row).
* ``compiled``: the forward compiled per token-count bucket (``--compile inductor``) against eager on
  prefill and mixed steps of 64/512/2048 tokens, compile time per bucket, and compiled vs eager hidden
  states and greedy tokens (:mod:`bench.device.e2e_compiled`). Last, so that a slow compile costs only
  its own results.

Times are CUDA-event medians of >= 20 runs after warm-up (wall clock on the CPU).

Robustness (this runs unattended, once): the sections run in a child process that writes one JSON line
per result; a section that raises is recorded and the next one runs; if the child dies (e.g. an
illegal memory access poisons its CUDA context) or its CUDA context breaks, a new child runs the
remaining sections. The parent stops the child at ``--deadline``, then always prints the table,
appends the markdown section and writes the JSON. Exit status 1 if anything failed or did not run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from bench.device import e2e_compiled

SECTIONS = ["ceilings", "load", "switch", "decode", "sanity", "prefill", "compiled"]
NEAR_TIE_NATS = 0.1  # a greedy divergence where eager's top-2 logprobs are closer than this is rounding noise
REPORT_RESERVE_S = 8.0  # kept back from the child for the report

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}
TINY = {**LLAMA3_8B, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 512, "max_position_embeddings": 512,
        "rope_scaling": {**LLAMA3_8B["rope_scaling"], "original_max_position_embeddings": 256},
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}


def log(msg: str) -> None:
    print(msg, flush=True)


# --------------------------------------------------------------------------------------------------
# configuration


@dataclass
class Profile:
    """Sizes of one run (the full GPU run, or ``--quick`` on the CPU)."""

    device: str  # "cuda" | "cpu"
    model: dict
    dtype: str  # torch dtype name
    backend: str  # kernels: "triton" | "torch"
    block_size: int = 16
    max_model_len: int = 8192
    max_num_seqs: int = 256
    decode_batches: tuple[int, ...] = (1, 16, 64, 256)
    decode_ctx: int = 1024
    prefill_tokens: int = 4096
    sanity_batches: tuple[int, ...] = (64, 5)  # one fills its bucket, one is padded
    sanity_steps: int = 16
    sanity_prompt: tuple[int, int] = (16, 48)  # prompt lengths (tokens), inclusive range
    compiled_buckets: tuple[int, ...] = (64, 512, 2048)
    compiled_mixed_rows: int = 32  # decode rows of a mixed step, beside a prompt chunk filling the bucket
    compiled_mixed_ctx: int = 1024
    iters: int = 20
    warmup: int = 3
    copy_bytes: int = 4 << 30
    matmul_n: int = 8192

    @property
    def device_id(self) -> str:
        return f"{self.device}:0"

    @property
    def num_blocks(self) -> int:
        """Blocks for the largest section (sections run one after another and reuse blocks), plus block 0
        (kept out of the sequences: padded graph rows read it)."""
        bs = self.block_size
        decode = max(self.decode_batches) * -(-self.decode_ctx // bs)
        sanity = max(self.sanity_batches) * -(-(self.sanity_prompt[1] + self.sanity_steps + 1) // bs)
        prefill = -(-self.prefill_tokens // bs)
        return 1 + max(decode, sanity, prefill, e2e_compiled.num_blocks(self), -(-self.max_model_len // bs))


def make_profile(device: str, quick: bool) -> Profile:
    if not quick:
        return Profile(device=device, model=LLAMA3_8B, dtype="bfloat16",
                       backend="triton" if device == "cuda" else "torch")
    return Profile(device=device, model=TINY, dtype="float32" if device == "cpu" else "bfloat16",
                   backend="triton" if device == "cuda" else "torch", max_model_len=512, max_num_seqs=8,
                   decode_batches=(1, 4), decode_ctx=64, prefill_tokens=128, sanity_batches=(4, 3), sanity_steps=4,
                   sanity_prompt=(5, 20), iters=3, warmup=1, copy_bytes=16 << 20, matmul_n=256,
                   compiled_buckets=(32,), compiled_mixed_rows=4, compiled_mixed_ctx=64)


# --------------------------------------------------------------------------------------------------
# child helpers


def timed_ms(fn: Callable[[], object], p: Profile, iters: int | None = None, warmup: int | None = None) -> dict:
    """Median/min/max milliseconds of ``fn`` over ``iters`` runs after ``warmup`` runs (CUDA events on
    the GPU: start/end recorded around each call on the current stream)."""
    import torch

    iters = p.iters if iters is None else iters
    warmup = p.warmup if warmup is None else warmup
    for _ in range(warmup):
        fn()
    times = []
    if p.device == "cuda":
        torch.cuda.synchronize()
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return {"ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "iters": iters}


class Blocks:
    """A bump allocator of KV block ids from 1 (block 0 stays out of the sequences)."""

    def __init__(self, num_blocks: int):
        self.num_blocks, self.next = num_blocks, 1

    def take(self, tokens: int, block_size: int) -> list[int]:
        n = -(-tokens // block_size)
        if self.next + n > self.num_blocks:
            raise RuntimeError(f"KV pool too small: need block {self.next + n} of {self.num_blocks}")
        ids = list(range(self.next, self.next + n))
        self.next += n
        return ids


def greedy(max_tokens: int = 1, logprobs: int | None = None):
    from node.core.sequence import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=logprobs)


class Eager:
    """``with Eager(runner):`` runs every step eagerly (the runner's graphs are put back afterwards)."""

    def __init__(self, runner):
        self.runner, self.graphs = runner, None

    def __enter__(self):
        self.graphs, self.runner.graphs = self.runner.graphs, None

    def __exit__(self, *exc):
        self.runner.graphs = self.graphs


def rec(section: str, name: str, ok: bool, **kw) -> dict:
    return {"section": section, "name": name, "ok": bool(ok), "error": None, **kw}


# --------------------------------------------------------------------------------------------------
# sections (generators of result records; ``state`` carries the runner between sections)


def sec_ceilings(p: Profile, state: dict) -> Iterator[dict]:
    import torch

    dev = p.device
    n = p.copy_bytes
    src = torch.empty(n, dtype=torch.uint8, device=dev).fill_(1)
    dst = torch.empty_like(src)
    t = timed_ms(lambda: dst.copy_(src), p)
    yield rec("ceilings", "copy", True, shape=f"{n / 2**30:g} GiB d2d", bytes=2 * n, gbps=2 * n / t["ms"] / 1e6, **t)
    del src, dst
    m = p.matmul_n
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    a = torch.randn(m, m, device=dev, dtype=dtype)
    b = torch.randn(m, m, device=dev, dtype=dtype)
    t = timed_ms(lambda: a @ b, p)
    yield rec("ceilings", "matmul", True, shape=f"{m}^3 {str(dtype).removeprefix('torch.')}", flops=2.0 * m**3,
              tflops=2.0 * m**3 / t["ms"] / 1e9, **t)
    del a, b
    if dev == "cuda":
        torch.cuda.empty_cache()


def get_runner(p: Profile, state: dict):
    """Build the runner through the node's loader once (a failure is remembered and re-raised)."""
    if "runner" in state:
        return state["runner"]
    if "runner_error" in state:
        raise RuntimeError(f"no runner: {state['runner_error']}")
    try:
        return _build_runner(p, state)
    except Exception as e:
        state["runner_error"] = f"{type(e).__name__}: {e}"
        raise


def _build_runner(p: Profile, state: dict):
    import torch

    from shiftnode_kernels.ops import get_ops
    from node.config import NodeConfig
    from node.worker.cuda_graphs import DecodeGraphs
    from node.worker.loader import LoadedModel, build_runner
    from node.worker.model_config import ModelConfig
    from node.worker.tokenizer import TextTokenizer

    t0 = time.perf_counter()
    cfg = ModelConfig.from_dict(p.model)
    dtype = getattr(torch, p.dtype)
    kv_bytes = p.num_blocks * p.block_size * cfg.kv_bytes_per_token(dtype)
    config = NodeConfig(load_format="dummy", devices=[p.device_id], dtype=p.dtype, max_model_len=p.max_model_len,
                        block_size=p.block_size, kv_cache_memory_bytes=kv_bytes, max_num_seqs=p.max_num_seqs,
                        attention_backend=p.backend, mode="time-shared", seed=0)
    # The tokenizer is never used here: the byte-level one stands in for Llama 3's.
    info = LoadedModel(cfg, TextTokenizer.byte_level(), p.max_model_len, dtype)
    runner = build_runner(config, info, p.device_id, get_ops(p.backend))
    if p.device == "cpu":  # no CUDA graphs: the same static buffers and padding, run eagerly
        runner.graphs = DecodeGraphs(runner.model, runner.kv_cache, block_size=p.block_size,
                                     max_model_len=p.max_model_len, max_num_seqs=p.max_num_seqs, use_cuda_graph=False)
    if p.device == "cuda":
        torch.cuda.synchronize()
    state["runner"] = runner
    state["load_s"] = time.perf_counter() - t0
    return runner


def model_bytes(runner) -> dict:
    """Weight bytes: all, the embedding table, and the decoder layers + final norm (the prefill matmuls)."""
    m = runner.model
    size = lambda ps: sum(x.numel() * x.element_size() for x in ps)  # noqa: E731
    total = size(m.parameters())
    embed = size(m.embed_tokens.parameters())
    head = size(m.lm_head.parameters()) if m.lm_head is not None else 0
    elt = next(m.parameters()).element_size()
    return {"weight_bytes": total, "embed_bytes": embed, "lm_head_bytes": head,
            "layer_params": (total - embed - head) // elt}


def sec_load(p: Profile, state: dict) -> Iterator[dict]:
    import torch

    runner = get_runner(p, state)
    g = runner.graphs
    ok = g is not None
    extra = {"error": None if ok else "no decode graphs attached (see the loader's decode_graphs_off log line)"}
    mem = torch.cuda.memory_allocated() if p.device == "cuda" else None
    yield {**rec("load", "build_runner (dummy weights, KV pool)", ok, s=state["load_s"], kv_bytes=runner.kv_pool_bytes,
                 num_blocks=runner.num_blocks, buckets=list(g.buckets) if g else None, cuda_allocated_bytes=mem,
                 **model_bytes(runner)), **extra}


def _switches(runner, device_id: str):
    """First PREFILL→DECODE switch, back to PREFILL, and DECODE again, through the engine. Returns
    ``(record, graphs' total capture ms after it)`` per switch."""
    import asyncio

    from node.core.batcher import BatchConfig, Batcher
    from node.core.ledger import BlockLedger
    from node.core.roles import Role
    from node.runtime.engine import DeviceEngine
    from node.runtime.switching import DeviceRole
    from node.worker.engine_core import EngineCore
    from node.worker.local_engine import LocalEngine

    async def go():
        role = DeviceRole(device_id, Role.PREFILL, time.monotonic(), 0.0)
        batcher = Batcher(BlockLedger(runner.num_blocks, runner.block_size), BatchConfig())
        # the engine drives an engine handle (the thread layout here), which runs the runner on its thread
        engine = DeviceEngine(device_id, LocalEngine(EngineCore(runner)), batcher, time.monotonic, role)
        captured = lambda: runner.graphs.capture_ms if runner.graphs is not None else None  # noqa: E731
        out = []
        try:
            for to, why in ((Role.DECODE, "bench: first decode switch"), (Role.PREFILL, "bench"),
                            (Role.DECODE, "bench: second decode switch")):
                out.append((await engine.switch_role(to, why), captured()))
        finally:
            await engine.stop()
        return out

    return asyncio.run(go())


def sec_switch(p: Profile, state: dict) -> Iterator[dict]:
    import torch

    from node.worker.runner import SeqInput, StepInput

    runner = get_runner(p, state)
    if runner.graphs is None:
        raise RuntimeError("the runner has no decode graphs")
    if runner.graphs.captured:
        raise RuntimeError("decode graphs are already captured (the switch section must run before decode)")
    cuda = p.device == "cuda"
    # A node switches to decode after serving prefill: compile the kernels eagerly first, so the first
    # switch pays the capture, not the first-use compilation of the common kernels.
    with Eager(runner):
        warm = decode_step(p, 2, 2 * p.block_size + 3, Blocks(runner.num_blocks), runner.cfg.vocab_size)
        prompt = [[s.token_ids[0]] * (s.start + 1) for s in warm.seqs]
        runner.execute(StepInput([SeqInput(s.seq_id, pr, 0, s.block_ids, s.sample)
                                  for s, pr in zip(warm.seqs, prompt)]))
        runner.execute(warm)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # so that the reserved-memory delta is about the graphs' pool
    reserved0 = torch.cuda.memory_reserved() if cuda else 0
    (first, cap1), (back, _), (again, cap3) = _switches(runner, p.device_id)
    g = runner.graphs
    if g is None or not g.captured:
        raise RuntimeError(f"capture failed: {runner.graphs_error or 'graphs not captured'}")
    pool = torch.cuda.memory_reserved() - reserved0 if cuda else None
    yield rec("switch", "PREFILL→DECODE, first (captures all graphs)", True, swap_ms=first.swap_ms,
              capture_ms=cap1, buckets=list(g.buckets), graph_reserved_bytes=pool)
    yield rec("switch", "DECODE→PREFILL", True, swap_ms=back.swap_ms)
    reused = cap3 == cap1
    yield rec("switch", "PREFILL→DECODE, again (reuses graphs)", reused, swap_ms=again.swap_ms,
              error=None if reused else f"the second switch captured again ({cap3 - cap1:.1f} ms)")


def decode_step(p: Profile, batch: int, ctx: int, blocks: Blocks, vocab: int):
    """``batch`` sequences computing the token at position ``ctx - 1`` (so ``seq_len == ctx``)."""
    import random

    from node.worker.runner import SeqInput, StepInput
    from node.worker.sampler import SampleRequest

    rng = random.Random(batch)
    params = greedy()
    return StepInput([SeqInput(f"d{i}", [rng.randrange(vocab)], ctx - 1, blocks.take(ctx, p.block_size),
                               SampleRequest(params, [], 0, 0)) for i in range(batch)])


def sec_decode(p: Profile, state: dict) -> Iterator[dict]:
    from node.worker.cuda_graphs import pick_bucket

    runner = get_runner(p, state)
    runner.prepare_decode()  # a no-op after the switch section
    mb = model_bytes(runner)
    kv_per_token = runner.cfg.kv_bytes_per_token(runner.kv_cache.dtype)
    for batch in p.decode_batches:
        step = decode_step(p, batch, p.decode_ctx, Blocks(runner.num_blocks), runner.cfg.vocab_size)
        floor_bytes = mb["weight_bytes"] - mb["embed_bytes"] + batch * p.decode_ctx * kv_per_token
        base = dict(shape=f"B={batch} ctx={p.decode_ctx}", batch=batch, ctx=p.decode_ctx, floor_bytes=floor_bytes)
        try:
            with Eager(runner):
                t = timed_ms(lambda: runner.execute(step), p)
            yield rec("decode", f"decode B={batch} eager", True, mode="eager", **base, **t)
        except Exception as e:
            yield rec("decode", f"decode B={batch} eager", False, mode="eager", **base,
                      error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(limit=6))
        try:
            g = runner.graphs
            if g is None or not g.captured:
                raise RuntimeError(f"no captured decode graphs ({runner.graphs_error or 'not captured'})")
            r0 = g.replays
            t = timed_ms(lambda: runner.execute(step), p)
            used = g.replays - r0
            expect = p.iters + p.warmup
            bucket = pick_bucket(batch, g.buckets)
            replay = timed_ms(lambda: g.replay(bucket), p)  # the buffers still hold this step
            ok = used == expect
            yield rec("decode", f"decode B={batch} graph", ok, mode="graph", bucket=bucket, replay_ms=replay["ms"],
                      **base, **t, error=None if ok else f"graph path used for {used} of {expect} steps")
        except Exception as e:
            yield rec("decode", f"decode B={batch} graph", False, mode="graph", **base,
                      error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(limit=6))


def greedy_generate(runner, prompts: list[list[int]], blocks: list[list[int]], steps: int):
    """Prefill ``prompts`` (one eager step) and decode ``steps`` greedy tokens. Returns ``(tokens,
    margins)`` per sequence: ``steps + 1`` token ids and the top-2 logprob gap (nats) of each."""
    from node.worker.runner import SeqInput, StepInput
    from node.worker.sampler import SampleRequest

    params = greedy(steps + 1, logprobs=2)
    toks: list[list[int]] = [[] for _ in prompts]
    gaps: list[list[float]] = [[] for _ in prompts]
    for t in range(steps + 1):
        seqs = []
        for i, pr in enumerate(prompts):
            new, start = (pr, 0) if t == 0 else ([toks[i][-1]], len(pr) + t - 1)
            seqs.append(SeqInput(f"g{i}", new, start, blocks[i], SampleRequest(params, pr + toks[i], len(pr), t)))
        outs = runner.execute(StepInput(seqs))
        for i in range(len(prompts)):
            o = outs[f"g{i}"]
            toks[i].append(o.token_id)
            top = o.logprobs.top if o.logprobs else []
            gaps[i].append(top[0][1] - top[1][1] if len(top) >= 2 else math.inf)
    return toks, gaps


def compare_greedy(eager: list[list[int]], graph: list[list[int]], gaps: list[list[float]],
                   tol: float = NEAR_TIE_NATS) -> dict:
    """Token-by-token comparison per sequence. ``exact``: all identical. Otherwise every sequence that
    diverges is judged at its first divergence: a *near tie* when eager's top-2 logprob gap there is at
    most ``tol`` nats (bf16 rounding may flip such a choice; everything after it differs legitimately).
    ``ok``: exact, or every divergence is a near tie."""
    total = sum(len(t) for t in eager)
    same = sum(a == b for ea, ga in zip(eager, graph) for a, b in zip(ea, ga))
    diverged = []  # (step, seq, gap)
    for i, (ea, ga) in enumerate(zip(eager, graph)):
        for step, a in enumerate(ea):
            if step >= len(ga) or ga[step] != a:
                diverged.append((step, i, gaps[i][step]))
                break
    worst = max(diverged, key=lambda d: d[2]) if diverged else None
    return {"exact": not diverged, "ok": all(g <= tol for _, _, g in diverged), "tokens": total, "matching": same,
            "diverged_seqs": len(diverged), "first_divergence": min(diverged)[:2] if diverged else None,
            "worst_divergence": worst[:2] if worst else None, "gap_nats": worst[2] if worst else None}


def sec_sanity(p: Profile, state: dict) -> Iterator[dict]:
    import random

    runner = get_runner(p, state)
    runner.prepare_decode()
    for batch, kind in zip(p.sanity_batches, ("fills its bucket", "padded")):
        name = f"greedy B={batch} ({kind}), {p.sanity_steps} steps"
        try:
            g = runner.graphs
            if g is None or not g.captured:
                raise RuntimeError(f"no captured decode graphs ({runner.graphs_error or 'not captured'})")
            rng = random.Random(batch)
            lo, hi = p.sanity_prompt
            prompts = [[rng.randrange(runner.cfg.vocab_size) for _ in range(rng.randint(lo, hi))] for _ in range(batch)]
            pool = Blocks(runner.num_blocks)
            blocks = [pool.take(len(pr) + p.sanity_steps + 1, p.block_size) for pr in prompts]
            with Eager(runner):
                eager, gaps = greedy_generate(runner, prompts, blocks, p.sanity_steps)
            r0 = g.replays
            graph, _ = greedy_generate(runner, prompts, blocks, p.sanity_steps)
            used = g.replays - r0
            cmp = compare_greedy(eager, graph, gaps)
            ok = cmp.pop("ok") and used == p.sanity_steps
            err = None
            if used != p.sanity_steps:
                err = f"graph path used for {used} of {p.sanity_steps} decode steps"
            elif not ok:
                step, i = cmp["worst_divergence"]
                err = (f"tokens differ at step {step} of sequence {i} (eager {eager[i][step]}, graph {graph[i][step]}) "
                       f"where eager's top-2 gap is {cmp['gap_nats']:.3g} nats > {NEAR_TIE_NATS} (not a near tie)")
            yield rec("sanity", name, ok, shape=f"B={batch} prompts {lo}-{hi}", graph_steps=used, **cmp, error=err,
                      eager_tokens=eager[:4], graph_tokens=graph[:4])
        except Exception as e:
            yield rec("sanity", name, False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(limit=6))


def sec_prefill(p: Profile, state: dict) -> Iterator[dict]:
    import random

    from node.worker.runner import SeqInput, StepInput
    from node.worker.sampler import SampleRequest

    runner = get_runner(p, state)
    rng = random.Random(7)
    n = p.prefill_tokens
    toks = [rng.randrange(runner.cfg.vocab_size) for _ in range(n)]
    step = StepInput([SeqInput("p0", toks, 0, Blocks(runner.num_blocks).take(n, p.block_size),
                               SampleRequest(greedy(), toks, len(toks), 0))])
    t = timed_ms(lambda: runner.execute(step), p, warmup=min(p.warmup, 2))
    cfg = runner.cfg
    params = model_bytes(runner)["layer_params"]
    attn = 4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * (n * (n + 1) / 2)  # causal QK^T and PV
    yield rec("prefill", f"prefill 1 x {n} tokens", True, shape=f"1 prompt x {n}", tokens=n, flops=2.0 * params * n,
              attn_flops=attn, layer_params=params, **t)


def sec_compiled(p: Profile, state: dict) -> Iterator[dict]:
    yield from e2e_compiled.section(p, get_runner(p, state), sys.modules[__name__])


SECTION_FNS: dict[str, Callable[[Profile, dict], Iterator[dict]]] = {
    "ceilings": sec_ceilings, "load": sec_load, "switch": sec_switch, "decode": sec_decode, "sanity": sec_sanity,
    "prefill": sec_prefill, "compiled": sec_compiled,
}


# --------------------------------------------------------------------------------------------------
# child


def cuda_healthy() -> bool:
    import torch

    try:
        torch.cuda.synchronize()
        torch.zeros(1, device="cuda").add_(1).item()
        return True
    except Exception:
        return False


def child_main(args) -> int:
    import torch

    p = make_profile(args.device, args.quick)
    sections = [s for s in args.sections.split(",") if s]
    with open(args.child_out, "a") as f:
        def emit(obj: dict) -> None:
            f.write(json.dumps(obj, default=str) + "\n")
            f.flush()

        if p.device == "cuda":
            props = torch.cuda.get_device_properties(0)
            emit({"info": {"device_name": torch.cuda.get_device_name(), "sm_count": props.multi_processor_count,
                           "memory_bytes": props.total_memory, "torch": torch.__version__,
                           "cuda": torch.version.cuda}})
        else:
            emit({"info": {"device_name": "cpu", "torch": torch.__version__}})
        state: dict = {}
        for s in sections:
            emit({"start": s})
            log(f"== {s}")
            if os.environ.get("BENCH_E2E_CRASH_IN") == s:  # tests of the restart path
                os._exit(139)
            t0 = time.time()
            try:
                for r in SECTION_FNS[s](p, state):
                    r["wall_s"] = round(time.time() - t0, 2)
                    emit(r)
                    log(f"  [{'ok  ' if r['ok'] else 'FAIL'}] {r['name']}: {brief(r)}")
            except Exception as e:
                r = rec(s, s, False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(limit=8))
                emit(r)
                log(f"  [FAIL] {s}: {r['error']}\n{r['traceback']}")
            emit({"end": s})
            if p.device == "cuda" and not cuda_healthy():
                log("  CUDA context is broken; the remaining sections run in a fresh process")
                return 3
    return 0


def brief(r: dict) -> str:
    keys = ("ms", "gbps", "tflops", "s", "swap_ms", "replay_ms", "matching", "tokens", "error")
    return ", ".join(f"{k}={r[k]:.4g}" if isinstance(r[k], float) else f"{k}={r[k]}"
                     for k in keys if r.get(k) is not None)


# --------------------------------------------------------------------------------------------------
# parent


def run_children(args, sections: list[str], deadline: float) -> tuple[list[dict], dict]:
    """Run ``sections`` in child processes until each has ended (or the deadline). Returns the records
    and the device info."""
    records: list[dict] = []
    info: dict = {}
    todo = list(sections)
    for attempt in range(len(sections) + 1):
        left = deadline - time.time() - REPORT_RESERVE_S
        if not todo or left < 10:
            break
        with tempfile.NamedTemporaryFile("w+", suffix=".jsonl", delete=False) as tmp:
            path = tmp.name
        cmd = [sys.executable, "-m", "bench.device.e2e", "--child", "--child-out", path, "--device", args.device,
               "--sections", ",".join(todo)] + (["--quick"] if args.quick else [])
        try:
            rc: int | str = subprocess.run(cmd, timeout=left, cwd=Path(__file__).resolve().parents[2]).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        started, ended = None, set()
        for line in Path(path).read_text().splitlines():
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a kill
                continue
            if "info" in obj:
                info = info or obj["info"]
            elif "start" in obj:
                started = obj["start"]
            elif "end" in obj:
                ended.add(obj["end"])
                started = None
            else:
                records.append(obj)
        os.unlink(path)
        if started is not None:  # died, hung or was stopped inside this section
            why = "stopped at the deadline" if rc == "timeout" else f"child process died (exit {rc})"
            records.append(rec(started, started, False, error=f"{why} during this section"))
            ended.add(started)
        if not ended and rc != 0:  # died before any section (e.g. import error): do not loop
            records.append(rec(todo[0], todo[0], False, error=f"child process failed before running (exit {rc})"))
            ended.add(todo[0])
        todo = [s for s in todo if s not in ended]
        if rc == "timeout":
            break
    for s in todo:
        records.append(rec(s, s, False, error="not run (deadline)"))
    return records, info


def _f(x: float | None, fmt: str, suffix: str = "") -> str:
    return "—" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:{fmt}}{suffix}"


def ceilings_of(records: list[dict]) -> dict:
    c = {}
    for r in records:
        if r.get("section") == "ceilings" and r.get("ok"):
            if r["name"] == "copy":
                c["gbps"] = r["gbps"]
            elif r["name"] == "matmul":
                c["tflops"] = r["tflops"]
    return c


def table_rows(records: list[dict], ceil: dict) -> list[list[str]]:
    """One row per record: section, case, measured, floor/ideal, % of it, check, note."""
    gbps, tflops = ceil.get("gbps"), ceil.get("tflops")
    eager_ms = {r["batch"]: r["ms"] for r in records if r.get("mode") == "eager" and r.get("ms") and "batch" in r}
    compiled_eager = {r["name"].rsplit(" ", 1)[0]: r["ms"] for r in records
                      if r.get("section") == "compiled" and r.get("mode") == "eager" and r.get("ms")}
    rows = []
    for r in records:
        sec, measured, ref, pct, note = r.get("section", "?"), "—", "—", "—", ""
        if sec == "ceilings" and r.get("ms"):
            measured = f"{r['gbps']:.0f} GB/s" if r["name"] == "copy" else f"{r['tflops']:.0f} TFLOP/s"
            note = f"{r.get('shape', '')}, {r['ms']:.3f} ms"
        elif sec == "load" and r.get("s") is not None:
            measured = f"{r['s']:.1f} s"
            note = (f"weights {r['weight_bytes'] / 1e9:.2f} GB (embedding {r['embed_bytes'] / 1e9:.2f} GB), "
                    f"KV pool {r['kv_bytes'] / 2**30:.1f} GiB, buckets {r.get('buckets')}")
        elif sec == "switch" and r.get("swap_ms") is not None:
            measured = f"{r['swap_ms']:.1f} ms swap"
            if r.get("capture_ms") is not None:
                pool = r.get("graph_reserved_bytes")
                note = f"capture_all {r['capture_ms']:.1f} ms, {len(r['buckets'])} buckets" + (
                    f", +{pool / 2**20:.0f} MiB reserved" if pool is not None else "")
        elif sec == "decode" and r.get("ms"):
            measured = f"{r['ms']:.3f} ms"
            if gbps:
                floor = r["floor_bytes"] / gbps / 1e6
                ref, pct = f"{floor:.3f} ms", f"{100 * floor / r['ms']:.0f}%"
            note = f"{r['floor_bytes'] / 1e9:.2f} GB read"
            if r.get("mode") == "graph":
                note += f"; replay only {r['replay_ms']:.3f} ms (bucket {r['bucket']})"
                if eager_ms.get(r["batch"]):
                    note += f"; {eager_ms[r['batch']] / r['ms']:.2f}x vs eager"
        elif sec == "sanity" and r.get("tokens"):
            measured = f"{r['matching']}/{r['tokens']} tokens equal"
            note = "identical" if r.get("exact") else (
                f"{r['diverged_seqs']} sequences diverge, first at (step, seq) {r['first_divergence']}; largest "
                f"eager top-2 gap at a divergence {r['gap_nats']:.3g} nats (near tie: <= {NEAR_TIE_NATS})")
        elif sec == "prefill" and r.get("ms"):
            measured = f"{r['ms']:.2f} ms"
            if tflops:
                ideal = r["flops"] / tflops / 1e9
                ref, pct = f"{ideal:.2f} ms", f"{100 * ideal / r['ms']:.0f}%"
            note = (f"{r['flops'] / r['ms'] / 1e9:.0f} TFLOP/s on 2·{r['layer_params'] / 1e9:.2f}B·tokens; "
                    f"attention adds {r['attn_flops'] / 1e12:.1f} TFLOP (not in the ideal)")
        elif sec == "compiled":
            measured, ref, pct, note = e2e_compiled.table_row(r, gbps, tflops, compiled_eager)
        check = "ok" if r.get("ok") else "FAIL"
        if r.get("error"):
            note = (note + "; " if note else "") + str(r["error"])[:300]
        rows.append([sec, r.get("name", "?"), measured, ref, pct, check, note.replace("|", "/")])
    return rows


def report(records: list[dict], info: dict, args, command: str, wall_s: float) -> str:
    ceil = ceilings_of(records)
    header = ["section", "case", "measured", "floor / ideal", "% of it", "check", "note"]
    rows = table_rows(records, ceil)
    failures = [r for r in records if not r.get("ok")]
    device = info.get("device_name", args.device)
    date = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    lines = [f"## {date} — end to end on {device}", "", f"`{command}`", "",
             "Llama-3-8B geometry (32 layers, hidden 4096, 32/8 heads, ffn 14336, vocab 128256), dummy bf16 weights "
             "built by the node's loader, Triton kernels, block size 16. Decode floor = (weights without the "
             "embedding table + KV read) / copy bandwidth; prefill ideal = 2·layer params·tokens / matmul rate. "
             "Times: CUDA-event medians of >= 20 runs after warm-up; a decode step is `ModelRunner.execute` "
             "(inputs, forward, logits, greedy sampling)." if not args.quick else
             "Quick run (tiny model): tests the script, numbers mean nothing.",
             "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    if failures:
        lines += ["", "**Failures:**", ""]
        lines += [f"- {r.get('section')} / {r.get('name')}: {r.get('error')}" for r in failures]
    lines += ["", f"{len(records) - len(failures)}/{len(records)} ok, {wall_s:.0f} s.", ""]
    return "\n".join(lines)


def parent_main(args) -> int:
    t0 = time.time()
    deadline = t0 + args.deadline
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            log("bench.device.e2e: no CUDA device visible (torch.cuda.is_available() is False); "
                "use --device cpu --quick to test the script itself")
            return 2
    sections = [s for s in (args.sections.split(",") if args.sections else SECTIONS) if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        log(f"unknown sections {sorted(unknown)}; known: {SECTIONS}")
        return 2
    records, info = run_children(args, sections, deadline)
    command = "python -m bench.device.e2e " + " ".join(sys.argv[1:])
    wall = time.time() - t0
    table = report(records, info, args, command, wall)
    log("\n" + table)
    if args.markdown:
        p = Path(args.markdown)
        p.parent.mkdir(parents=True, exist_ok=True)
        prev = p.read_text() if p.exists() else "# Benchmark results\n"
        p.write_text(prev.rstrip("\n") + "\n\n" + table)
        log(f"appended to {p}")
    failures = [r for r in records if not r.get("ok")]
    if args.json:
        p = Path(args.json)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps({"date": datetime.datetime.now().isoformat(timespec="seconds"), "device": info,
                                 "command": command, "ceilings": ceilings_of(records), "results": records,
                                 "failures": [f"{r.get('section')}/{r.get('name')}" for r in failures],
                                 "wall_s": round(wall, 1)}, indent=1, default=str))
        log(f"wrote {p}")
    log(f"bench.device.e2e: {len(records) - len(failures)}/{len(records)} ok, {len(failures)} failed, {wall:.0f}s")
    return 1 if failures else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--deadline", type=float, default=240.0, help="seconds for everything (default 240)")
    ap.add_argument("--markdown", help="append a dated results section to this markdown file")
    ap.add_argument("--json", help="write all results to this JSON file")
    ap.add_argument("--sections", help=f"comma-separated subset of {SECTIONS} (in this order)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--quick", action="store_true", help="a tiny model (for --device cpu)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.device == "cuda":
        os.environ["TRITON_INTERPRET"] = "0"
    if args.child:
        return child_main(args)
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
