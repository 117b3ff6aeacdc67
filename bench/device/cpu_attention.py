"""CPU attention: the reference (``--attention-backend torch``) against the CPU serving path (``cpu``).

``python -m bench.device.cpu_attention --out bench/out/cpu_attention.json``

Three parts, side by side in one run:

1. **Attention alone**: :func:`shiftnode_kernels.reference.paged_attention` and
   :func:`shiftnode_kernels.cpu_attention.paged_attention` on the same decode batches (1/16/64/256 sequences,
   contexts uniform in ``[1, max]`` for max 512 and 4,096, blocks scattered over the pool, block size
   16) for the stories260k attention geometry (8 query heads, 4 KV heads) at head_dim 8 and 32. Each
   cell is the best of ``--repeats`` calls (ms; the best, because the machine is shared) and the
   norm-relative difference of the two outputs.
2. **Streamed throughput**: a ``shiftnode serve`` node (:class:`bench.load.node_process.NodeServer`) per
   (model, backend), fed ``--streams`` concurrent streaming requests by :func:`bench.load.replay.replay`
   (all sent at t=0, seeded prompt lengths uniform in ``[16, 192]``, ``--output-tokens`` each,
   ``ignore_eos``); the figure is output tokens per second (first send to last token), the best of
   ``--stream-repeats`` runs (each run's figure is kept in the JSON), and the ratio of the two models
   both best against best and as the median of each repeat's back-to-back pair. The models are stories260k and
   its head_dim-32 copy (:func:`pad_head_dim`).
3. **The decode step by operator** (:func:`step_breakdown`, skipped with ``--skip-breakdown``): for
   each model and backend of part 2, one decode step of ``--streams`` sequences at part 2's mid-run
   contexts, in the bench process, the two models' steps alternating: ms per step and per operator
   (attention, cache writes, rotary, RMSNorm, SiLU-and-mul, all layers), the K/V bytes attention reads
   per layer, and the median of the per-turn step ratios. It says what
   part 2's ratio is made of. Beside it, the memory roofline (:func:`memory_roofline`): per model the
   K+V bytes a step's attention reads, the last-level cache, the time to stream those bytes at a
   measured read bandwidth, and the bandwidth the kernel achieved. Runs without part 2 as well
   (``--skip-stream``).

The head_dim-32 copy computes the same function as the original: each head's 8 dims are placed at
dims ``0..3`` and ``16..19`` of 32 (rotate-half pairs ``(i, i + D/2)`` stay pairs), the other dims
have zero q/k/v weights (zero rows) and zero ``o_proj`` columns. Rotary frequencies
``theta ** (-2i / D)`` stay the same for the live pairs when ``theta' = theta ** (D' / D)``
(``(theta ** (D'/D)) ** (-2i / D') = theta ** (-2i / D)``), and the scale ``D' ** -0.5`` is undone by
multiplying the q rows by ``sqrt(D' / D)`` (2 here, exact in float). Up to float rounding of the
rotary table the logits are unchanged; the bench checks greedy tokens on the stories260k reference
prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

from shiftnode_kernels import cpu_attention, reference

__all__ = ["pad_head_dim", "decode_batch", "time_attention", "stream_throughput", "step_breakdown", "memory_roofline",
           "main"]

SHARED = Path(os.environ.get("SHIFTNODE_SHARED", Path(__file__).resolve().parents[3] / "shared"))
STORIES = SHARED / "models" / "stories260k"


def pad_head_dim(src: Path, dst: Path, head_dim: int) -> Path:
    """Write a copy of the Llama checkpoint folder ``src`` with ``head_dim`` per head into ``dst``,
    computing the same function (see the module docstring for the layout and the rotary argument).

    Raises:
        ValueError: ``head_dim`` is not a larger even size, the model has biases or q/k norms (not
            handled), or ``rope_scaling`` is set.
    """
    from safetensors.torch import load_file, save_file

    cfg = json.loads((src / "config.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // heads
    if head_dim <= d or head_dim % 2:
        raise ValueError(f"head_dim {head_dim} must be even and above the model's {d}")
    if cfg.get("attention_bias") or cfg.get("rope_scaling") or cfg.get("model_type") == "qwen3":
        raise ValueError("pad_head_dim handles plain Llama attention only (no bias, q/k norm or rope scaling)")
    half, new_half = d // 2, head_dim // 2
    # old dim j -> new dim: the first rotate-half lane stays at j, the second moves to new_half + (j - half)
    where = torch.tensor([j if j < half else new_half + j - half for j in range(d)])

    def pad_rows(w: torch.Tensor, n_heads: int, gain: float = 1.0) -> torch.Tensor:  # [n*d, in] -> [n*D', in]
        out = w.new_zeros(n_heads, head_dim, w.shape[1])
        out[:, where] = w.view(n_heads, d, -1) * gain
        return out.reshape(n_heads * head_dim, -1)

    tensors = load_file(src / "model.safetensors")
    gain = math.sqrt(head_dim / d)  # undoes the scale change head_dim ** -0.5
    for name in list(tensors):
        w = tensors[name]
        if name.endswith("self_attn.q_proj.weight"):
            tensors[name] = pad_rows(w, heads, gain)
        elif name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
            tensors[name] = pad_rows(w, kv_heads)
        elif name.endswith("self_attn.o_proj.weight"):  # [hidden, heads*d] -> [hidden, heads*D']
            out = w.new_zeros(w.shape[0], heads, head_dim)
            out[:, :, where] = w.view(w.shape[0], heads, d)
            tensors[name] = out.reshape(w.shape[0], -1)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, dst / f.name)
    theta = float(cfg.get("rope_theta", 10000.0))
    cfg.update(head_dim=head_dim, rope_theta=theta ** (head_dim / d))
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, dst / "model.safetensors")
    return dst


def decode_batch(num_seqs: int, max_ctx: int, *, heads: int = 8, kv_heads: int = 4, head_dim: int = 8,
                 block_size: int = 16, seed: int = 0) -> tuple:
    """A random decode batch: contexts uniform in ``[1, max_ctx]``, each sequence's blocks drawn without
    replacement from a pool with some spare blocks. Returns the positional arguments of
    ``paged_attention`` up to ``max_seqlen_q``: ``(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q)``."""
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(1, max_ctx + 1, (num_seqs,), generator=g)
    n_blocks = ((ctx + block_size - 1) // block_size).tolist()
    pool = sum(n_blocks) + sum(n_blocks) // 8 + 1
    table = scattered_block_tables(n_blocks, pool, g)
    k_cache = torch.randn(pool, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(pool, block_size, kv_heads, head_dim, generator=g)
    q = torch.randn(num_seqs, heads, head_dim, generator=g)
    cu = torch.arange(num_seqs + 1, dtype=torch.int32)
    return q, k_cache, v_cache, table, ctx.int(), cu


def scattered_block_tables(n_blocks: list[int], pool: int, generator: torch.Generator) -> torch.Tensor:
    """Block tables ``[len(n_blocks), max(n_blocks)]`` int32: sequence ``i`` gets ``n_blocks[i]`` block
    ids drawn without replacement from ``range(pool)`` (one ``randperm``, in sequence order), the
    rest of its row -1 (never read)."""
    ids = torch.randperm(pool, generator=generator)[: sum(n_blocks)]
    table = torch.full((len(n_blocks), max(n_blocks)), -1, dtype=torch.int32)
    at = 0
    for i, nb in enumerate(n_blocks):
        table[i, :nb] = ids[at : at + nb].int()
        at += nb
    return table


def _best_ms(fn, repeats: int, budget_s: float) -> float:
    fn()  # warm-up
    best, spent = math.inf, 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        dt = time.perf_counter() - t
        best, spent = min(best, dt), spent + dt
        if spent > budget_s:
            break
    return best * 1e3


def _torch_chunks(args: tuple, scale: float) -> torch.Tensor:
    """The cpu backend's attention with its torch decode path (the fallback without Numba)."""
    saved, cpu_attention.DECODE_KERNEL = cpu_attention.DECODE_KERNEL, "torch"
    try:
        return cpu_attention.paged_attention(*args, 1, scale)
    finally:
        cpu_attention.DECODE_KERNEL = saved


def time_attention(batches: list[int], contexts: list[int], head_dims: list[int], repeats: int,
                   budget_s: float) -> list[dict]:
    """Part 1: one row per (head_dim, max context, batch): the reference, the cpu backend (its compiled
    decode kernel where Numba is installed) and its torch-only decode path (ms), speed-up of the cpu
    backend over the reference and the norm-relative error of its output."""
    rows = []
    for d in head_dims:
        for max_ctx in contexts:
            for n in batches:
                args = decode_batch(n, max_ctx, head_dim=d)
                scale = d**-0.5
                ref_out = reference.paged_attention(*args, 1, scale)
                new_out = cpu_attention.paged_attention(*args, 1, scale)
                err = float((new_out - ref_out).norm() / ref_out.norm())
                ref_ms = _best_ms(lambda: reference.paged_attention(*args, 1, scale), repeats, budget_s)
                new_ms = _best_ms(lambda: cpu_attention.paged_attention(*args, 1, scale), repeats, budget_s)
                chunks_ms = _best_ms(lambda: _torch_chunks(args, scale), repeats, budget_s)
                row = dict(head_dim=d, max_context=max_ctx, batch=n, context_tokens=int(args[4].sum()),
                           reference_ms=round(ref_ms, 3), cpu_ms=round(new_ms, 3), torch_chunks_ms=round(chunks_ms, 3),
                           speedup=round(ref_ms / new_ms, 2), rel_err=err)
                print(f"attention head_dim={d} ctx<={max_ctx} batch={n}: reference {ref_ms:.2f} ms, "
                      f"cpu {new_ms:.2f} ms (x{ref_ms / new_ms:.1f}), torch chunks {chunks_ms:.2f} ms, err {err:.1e}",
                      flush=True)
                rows.append(row)
    return rows


def greedy_check(original: Path, padded: Path, backend: str) -> dict:
    """Greedy tokens of both folders on the reference prompts (through :class:`ModelRunner`, no node):
    how many cases agree on every token."""
    from node.config import NodeConfig
    from node.worker.loader import select_ops
    from node.worker.loader import build_runner, load_model_info
    from node.worker.runner import SeqInput, StepInput
    from node.worker.sampler import SampleRequest
    from node.core.sequence import SamplingParams

    cases = json.loads((original / "reference_greedy.json").read_text())["cases"]
    outs = []
    for folder in (original, padded):
        config = NodeConfig(model=str(folder), kv_cache_memory_bytes=64 << 20)
        runner = build_runner(config, load_model_info(config), "cpu:0", select_ops(backend, "cpu"))
        bs = runner.block_size
        tokens_per_case = []
        for case in cases:
            ids = list(case["prompt_token_ids"])
            n_prompt = len(ids)
            total = n_prompt + case["max_new_tokens"]
            blocks = list(range((total + bs - 1) // bs))
            start = 0
            while len(ids) < total:
                req = SampleRequest(SamplingParams(max_tokens=total, temperature=0.0), ids[:n_prompt], ids[n_prompt:], len(ids) - n_prompt)
                out = runner.execute(StepInput([SeqInput("s", ids[start:], start, blocks, sample=req)]))
                start = len(ids)
                ids.append(out["s"].token_id)
            tokens_per_case.append(ids[n_prompt:])
        outs.append(tokens_per_case)
    same = sum(a == b for a, b in zip(*outs))
    return {"cases": len(cases), "identical": same,
            "original_matches_reference": sum(o == c["output_token_ids"] for o, c in zip(outs[0], cases))}


def stream_throughput(model: Path, backend: str, streams: int, output_tokens: int, log_dir: Path,
                      seed: int = 0, kv_cache_memory: str = "256MiB") -> dict:
    """Part 2: one node, ``streams`` concurrent streams; output tokens/s, TPOT (ms) and the node's
    preemptions. ``kv_cache_memory`` is the node's KV budget: the same bytes hold 4x fewer tokens of the
    head_dim-32 copy, so the default leaves both models room for every stream (64 MiB, the CPU
    default, makes the padded model preempt and recompute, which is not what part 2 compares)."""
    from bench.load.node_process import NodeServer
    from bench.load.replay import fetch_server_info, replay
    from bench.traffic.traces import TraceRequest
    import aiohttp

    rng = random.Random(seed)
    requests = [TraceRequest(0.0, rng.randint(16, 192), output_tokens) for _ in range(streams)]
    args = ["--model", str(model), "--attention-backend", backend, "--max-num-seqs", str(max(streams, 1)),
            "--kv-cache-memory", kv_cache_memory]
    with NodeServer(args, log_path=log_dir / f"{model.name}-{backend}.log") as node:
        async def go():
            async with aiohttp.ClientSession() as s:
                info = await fetch_server_info(s, node.url)
            # one short request first: the first steps of a fresh process are slower
            await replay(node.url, [TraceRequest(0.0, 16, 8)], info, progress=False)
            return await replay(node.url, requests, info, seed=seed, progress=False, drain_timeout_s=600)

        res = asyncio.run(go())
        preemptions = sum(d["preemptions"] for d in node.get_json("/v1/node")["devices"])
    s = res.summary
    row = dict(model=model.name, backend=backend, streams=streams, output_tokens=s.total_output_tokens,
               failed=s.failed, duration_s=round(s.duration_s, 2), tokens_per_s=round(s.output_throughput, 1),
               tpot_p50_ms=round(s.tpot_ms.median, 2), preemptions=preemptions, kv_cache_memory=kv_cache_memory)
    print(f"stream {model.name} backend={backend}: {row['tokens_per_s']} tokens/s, TPOT p50 "
          f"{row['tpot_p50_ms']} ms, {s.failed} failed, {preemptions} preemptions", flush=True)
    return row


def step_breakdown(folders: list[Path], backend: str, streams: int, output_tokens: int, seed: int = 0,
                   steps: int = 100) -> list[dict]:
    """Part 3: where a decode step of ``streams`` sequences goes, in this process (no node): each model's
    forward + logits + argmax, timed per operator of the backend (each summed over the layers), ms
    per step, medians over ``steps``. The models alternate (in turn, each runs an untimed step that
    brings its K/V back into the caches, then the timed one), so a drift of the machine's speed hits
    all of them alike; each row after the first also carries the median
    of the per-turn step ratios ``first / this``. Contexts are part 2's mid-run ones (prompt uniform
    in ``[16, 192]`` plus up to ``output_tokens``), blocks scattered over a pool sized like part 2's
    node's, on ``cores - 1`` torch threads as a one-device node's engine runs.
    """
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    names = ("paged_attention", "reshape_and_cache", "rotary_embedding", "rms_norm", "silu_and_mul")
    runs = [_decode_step(f, backend, streams, output_tokens, seed, names) for f in folders]
    per_step = [{"step": [], **{n: [] for n in names}} for _ in runs]
    with torch.inference_mode():
        for i in range(steps + 10):
            for run, acc in zip(runs, per_step):
                run["step"]()  # untimed: the other model's step has just flushed this one's K/V from the caches
                total, spent = run["step"]()
                if i >= 10:
                    acc["step"].append(total)
                    for n in names:
                        acc[n].append(spent.get(n, 0.0))
    rows = []
    for f, run, acc in zip(folders, runs, per_step):
        row = {"model": f.name, "backend": backend, "streams": streams, **run["info"],
               **{f"{n}_ms": round(1e3 * statistics.median(v), 3) for n, v in acc.items()}}
        if rows:
            row["step_ratio_to_first"] = round(statistics.median(
                a / b for a, b in zip(per_step[0]["step"], acc["step"])), 3)
        print(f"step {f.name} backend={backend}: {row['step_ms']} ms per decode step of {streams} sequences, "
              + ", ".join(f"{n} {row[n + '_ms']}" for n in names)
              + f" (ms, all layers; {row['kv_bytes_per_layer_step'] / 2**20:.1f} MiB of K+V read per layer)"
              + (f"; step ratio {folders[0].name} / this, median of alternating steps: {row['step_ratio_to_first']}"
                 if rows else ""), flush=True)
        rows.append(row)
    return rows


def _decode_step(folder: Path, backend: str, streams: int, output_tokens: int, seed: int, names: tuple) -> dict:
    """``{"step": fn, "info": {...}}``: ``fn()`` runs one decode step of ``folder``'s model and returns
    ``(seconds, {operator: seconds})``; ``info`` says the batch (mean context, layers, K+V bytes per layer)."""
    from dataclasses import replace

    from node.worker.loader import select_ops
    from node.worker.model import AttentionMetadata
    from node.worker.model_config import ModelConfig
    from node.worker.weights import build_model

    cfg = ModelConfig.from_folder(folder)
    spent: dict[str, float] = {}

    def timed(name, fn):
        def run(*args, **kw):
            t0 = time.perf_counter()
            out = fn(*args, **kw)
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
            return out
        return run

    base = select_ops(backend, "cpu")
    ops = replace(base, **{n: timed(n, getattr(base, n)) for n in names})
    model = build_model(cfg, folder=folder, load_format="safetensors", dtype=torch.float32, device=torch.device("cpu"),
                        max_positions=cfg.max_position_embeddings, ops=ops)
    rng = random.Random(seed)
    bs = 16
    ctx = [rng.randint(16, 192) + rng.randint(0, output_tokens) for _ in range(streams)]
    n_blocks = [-(-c // bs) for c in ctx]
    pool = max(sum(n_blocks), (256 << 20) // (2 * cfg.num_layers * bs * cfg.num_kv_heads * cfg.head_dim * 4))
    tables = scattered_block_tables(n_blocks, pool, torch.Generator().manual_seed(seed))
    slots = [int(tables[i, (c - 1) // bs]) * bs + (c - 1) % bs for i, c in enumerate(ctx)]
    kv = torch.randn(cfg.num_layers, 2, pool, bs, cfg.num_kv_heads, cfg.head_dim)
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots), block_tables=tables,
                             seq_lens=torch.tensor(ctx, dtype=torch.int32),
                             cu_seqlens_q=torch.arange(streams + 1, dtype=torch.int32), max_seqlen_q=1)
    ids, pos = torch.randint(3, cfg.vocab_size, (streams,)), torch.tensor(ctx) - 1

    def step() -> tuple[float, dict[str, float]]:
        spent.clear()
        t0 = time.perf_counter()
        model.compute_logits(model(ids, pos, kv, meta)).argmax(-1).tolist()
        return time.perf_counter() - t0, dict(spent)

    return {"step": step, "info": {"mean_context": round(sum(ctx) / streams, 1), "layers": cfg.num_layers,
                                   "kv_bytes_per_layer_step": 2 * sum(ctx) * cfg.num_kv_heads * cfg.head_dim * 4}}


def read_bandwidth_gbs(mib: int = 512, reps: int = 5) -> float:
    """Streaming read bandwidth in GB/s on the current torch threads: the best of ``reps`` sums of a
    float32 buffer of ``mib`` MiB (far past the last-level cache, so it streams from memory)."""
    buf = torch.ones(mib << 18)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best / 1e9


def llc_mib() -> float | None:
    """The last-level cache of CPU 0 in MiB, from Linux sysfs (None elsewhere)."""
    try:
        caches = sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"))
        size = (caches[-1] / "size").read_text().strip()
    except (OSError, IndexError):
        return None
    units = {"K": 1 / 1024, "M": 1.0, "G": 1024.0}
    return float(size[:-1]) * units[size[-1]] if size and size[-1] in units else None


def memory_roofline(rows: list[dict], bandwidth_gbs: float, cache_mib: float | None) -> list[dict]:
    """Part 3's roofline, per row: the K+V bytes one decode step's attention reads (all layers), the
    time streaming them from memory takes at ``bandwidth_gbs`` (the floor when they do not fit the
    last-level cache of ``cache_mib``), and the bandwidth the measured attention achieved
    (bytes / attention time): far under the measured bandwidth, the kernel is bound by its arithmetic."""
    out = []
    for r in rows:
        kv = r["kv_bytes_per_layer_step"] * r["layers"]
        row = {"model": r["model"], "backend": r["backend"], "kv_mib_per_step": round(kv / 2**20, 1),
               "llc_mib": cache_mib, "read_gb_per_s": round(bandwidth_gbs, 2),
               "memory_floor_ms": round(kv / (bandwidth_gbs * 1e9) * 1e3, 2),
               "attention_ms": r["paged_attention_ms"],
               "achieved_gb_per_s": round(kv / (r["paged_attention_ms"] * 1e-3) / 1e9, 2)}
        fits = cache_mib is not None and kv / 2**20 <= cache_mib
        print(f"roofline {r['model']} backend={r['backend']}: attention reads {row['kv_mib_per_step']} MiB of K+V per "
              f"step ({'fits' if fits else 'exceeds'} the {cache_mib} MiB last-level cache); from memory at "
              f"{bandwidth_gbs:.1f} GB/s (one thread, streaming) that is {row['memory_floor_ms']} ms, the kernel "
              f"took {row['attention_ms']} ms ({row['achieved_gb_per_s']} GB/s)", flush=True)
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.device.cpu_attention", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=STORIES, help="the unpadded model folder (stories260k)")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--contexts", default="512,4096", help="largest context of each batch (tokens)")
    ap.add_argument("--head-dims", default="8,32")
    ap.add_argument("--repeats", type=int, default=5, help="attention calls timed per cell (best kept)")
    ap.add_argument("--cell-budget-s", type=float, default=10.0, help="stop repeating a cell after this long")
    ap.add_argument("--padded-head-dim", type=int, default=32)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--stream-repeats", type=int, default=2, help="node runs per (model, backend); the best counts")
    ap.add_argument("--backends", default="torch,cpu", help="node backends of part 2")
    ap.add_argument("--kv-cache-memory", default="256MiB",
                    help="part 2: the nodes' --kv-cache-memory (room for every stream of both models)")
    ap.add_argument("--skip-attention", action="store_true")
    ap.add_argument("--skip-stream", action="store_true")
    ap.add_argument("--skip-breakdown", action="store_true", help="skip part 3 (the decode step by operator)")
    ap.add_argument("--work-dir", type=Path, default=Path("bench/out/cpu_attention"))
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    a = ap.parse_args(argv)
    if not (a.model / "config.json").is_file():
        print(f"model not found at {a.model} (set SHIFTNODE_SHARED, or pass --model)", file=sys.stderr)
        return 2
    doc = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.processor() or platform.machine()}, "
           f"{torch.get_num_threads()} torch threads, torch {torch.__version__}", "command": " ".join(sys.argv)}
    if not a.skip_attention:
        doc["attention"] = time_attention([int(x) for x in a.batches.split(",")], [int(x) for x in a.contexts.split(",")],
                                          [int(x) for x in a.head_dims.split(",")], a.repeats, a.cell_budget_s)
    if not (a.skip_stream and a.skip_breakdown):
        padded = pad_head_dim(a.model, a.work_dir / f"{a.model.name}-hd{a.padded_head_dim}", a.padded_head_dim)
        doc["greedy_check"] = greedy_check(a.model, padded, "cpu")
        print(f"greedy check (original vs head_dim {a.padded_head_dim}): {doc['greedy_check']}", flush=True)
    if not a.skip_breakdown:
        doc["breakdown"] = [row for b in a.backends.split(",")
                            for row in step_breakdown([a.model, padded], b, a.streams, a.output_tokens)]
        doc["roofline"] = memory_roofline(doc["breakdown"], read_bandwidth_gbs(), llc_mib())
    if not a.skip_stream:
        rows = [stream_throughput(m, b, a.streams, a.output_tokens, a.work_dir, seed=rep, kv_cache_memory=a.kv_cache_memory)
                for rep in range(a.stream_repeats) for m in (a.model, padded) for b in a.backends.split(",")]
        doc["stream"] = rows
        by: dict = {}
        for r in rows:  # best of the repeats: the machine is shared, slow runs measure the neighbours
            key = (r["model"], r["backend"])
            by[key] = max(by.get(key, 0.0), r["tokens_per_s"])
        doc["stream_best_tokens_per_s"] = {f"{m}/{b}": v for (m, b), v in by.items()}
        for (m, b), v in by.items():
            print(f"best {m} backend={b}: {v} tokens/s")
        for b in a.backends.split(","):
            ratio = by[(padded.name, b)] / by[(a.model.name, b)]
            # each repeat ran the two models back to back: their ratio is what the machine's drift spares
            mine = [x for x in rows if x["backend"] == b]  # per repeat: the unpadded model, then the padded one
            pairs = [mine[i + 1]["tokens_per_s"] / mine[i]["tokens_per_s"] for i in range(0, len(mine), 2)]
            print(f"backend {b}: head_dim {a.padded_head_dim} / unpadded throughput = {ratio:.2f} (best of each), "
                  f"{statistics.median(pairs):.2f} (median of the repeats' pairs: "
                  f"{' '.join(f'{x:.2f}' for x in pairs)})")
            doc.setdefault("padded_ratio", {})[b] = round(ratio, 3)
            doc.setdefault("padded_ratio_pairs", {})[b] = [round(x, 3) for x in pairs]
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
