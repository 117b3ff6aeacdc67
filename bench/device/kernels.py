"""Check every Triton kernel against its torch reference on the GPU, then time it.

    python -m bench.device.kernels [--markdown bench/RESULTS.md] [--json out.json] [--groups decode,prefill]

Each kernel's output is compared with ``shiftnode_kernels.reference`` on the same device (norm-relative error
``||out - ref|| / ||ref||``: fp32 <= 1e-5, fp16/bf16 <= 1e-2, NaN fails; outputs are pre-filled with
NaN and unused cache slots hold NaN). Then ``triton.testing.do_bench`` (median, L2 flushed) times the
kernel and the reference, and the table shows achieved GB/s (memory-bound kernels) or TFLOP/s
(prefill attention) next to measured ceilings: a 1 GiB device-to-device copy and a bf16 8192^3 matmul.

Robustness (this runs unattended): cases run in child processes, one per group; a case that raises is
recorded and the next one runs; a child that dies (e.g. an illegal memory access poisons its CUDA
context) is restarted after the case it died on. The exit status is non-zero if anything failed.
``--device cpu --quick`` (with ``TRITON_INTERPRET=1``) runs small shapes through the interpreter to
test this script itself.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

GROUPS = ["ceilings", "decode", "prefill", "small", "sweep"]
TOL = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 1e-2}
# Llama-3-8B geometry
H, HKV, D, HIDDEN, INTER = 32, 8, 128, 4096, 14336


def log(msg: str) -> None:
    print(msg, flush=True)


# --------------------------------------------------------------------------------------------------
# helpers (child side: torch, triton and the kernels are imported lazily)


def rel_err(out, ref) -> float:
    """``||out - ref|| / ||ref||`` in float64; inf when ``out`` has NaN/inf that ``ref`` lacks."""
    import torch

    if out.shape != ref.shape:
        raise AssertionError(f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    if out.dtype != ref.dtype:
        raise AssertionError(f"dtype {out.dtype} != reference {ref.dtype}")
    if out.numel() == 0:
        return 0.0
    o, r = out.double(), ref.double()
    if not torch.isfinite(o).all() and torch.isfinite(r).all():
        return math.inf
    return (o - r).norm().item() / max(r.norm().item(), 1e-30)


def time_ms(fn: Callable, device: str) -> float:
    if device == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    times = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[1]


@dataclass
class Env:
    """What a case builder returns. ``check`` runs kernel and reference and returns the relative error."""

    check: Callable[[], float]
    triton: Callable[[], object]
    torch: Callable[[], object] | None = None
    bytes: float = 0.0  # memory traffic of one kernel call (for GB/s)
    flops: float = 0.0  # useful FLOPs of one call (for TFLOP/s)
    note: str = ""


@dataclass
class Case:
    name: str
    group: str
    shape: str
    dtype: str
    build: Callable[[], Env]
    timed: bool = True
    extra: dict = field(default_factory=dict)


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def paged_inputs(q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device, seed=0):
    """A varlen batch on shuffled cache blocks. Returns (kernel args, reference args): the kernel's
    cache holds NaN in every slot outside a context, the reference's holds zeros there; block tables
    hold -1 past each sequence's last block."""
    import torch

    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    blocks = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(blocks) + 2
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    table = torch.full((len(ctx_lens), max(blocks, default=0) + 1), -1, dtype=torch.int32)
    filled = torch.zeros(num_blocks, dtype=torch.long)  # valid tokens per physical block
    start = 0
    for s, (nb, ctx) in enumerate(zip(blocks, ctx_lens)):
        ids = perm[start : start + nb]
        table[s, :nb] = ids
        counts = torch.full((nb,), block_size, dtype=torch.long)
        if nb:
            counts[-1] = ctx - (nb - 1) * block_size
        filled[ids.long()] = counts
        start += nb
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.randn(shape, device=device, dtype=dtype)
    v = torch.randn(shape, device=device, dtype=dtype)
    unused = torch.arange(block_size).view(1, -1) >= filled.view(-1, 1)  # [num_blocks, block_size]
    unused = unused.to(device)
    k_nan, v_nan = k.clone(), v.clone()
    k_nan[unused] = float("nan")
    v_nan[unused] = float("nan")
    k[unused] = 0
    v[unused] = 0
    q = torch.randn(sum(q_lens), num_heads, head_dim, device=device, dtype=dtype)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0)
    meta = (table.to(device), torch.tensor(ctx_lens, dtype=torch.int32, device=device), cu.to(device))
    max_q = max(q_lens, default=0)
    scale = head_dim**-0.5
    return (q, k_nan, v_nan, *meta, max_q, scale), (q, k, v, *meta, max_q, scale)


class _Poison:
    """Fill every kernel output with NaN before it is written (``shiftnode_kernels._common.POISON``)."""

    def __enter__(self):
        import shiftnode_kernels._common as c

        c.POISON = float("nan")

    def __exit__(self, *exc):
        import shiftnode_kernels._common as c

        c.POISON = None


# --------------------------------------------------------------------------------------------------
# cases


def attention_case(name, group, q_lens, ctx_lens, h, hkv, d, bs, dtype, device, num_splits=None,
                   timed=True, seed=0, shape=None, ref_cache=None) -> Case:
    def build() -> Env:
        import shiftnode_kernels.attention as A
        from shiftnode_kernels import reference as ref

        key = (tuple(q_lens), tuple(ctx_lens), h, hkv, d, bs, dtype, seed)
        if ref_cache is not None and key in ref_cache:
            kargs, rargs, expect = ref_cache[key]
        else:
            kargs, rargs = paged_inputs(q_lens, ctx_lens, h, hkv, d, bs, _torch_dtype(dtype), device, seed)
            expect = ref.paged_attention(*rargs)
            if ref_cache is not None:
                ref_cache.clear()  # keep one (large) case alive at a time
                ref_cache[key] = (kargs, rargs, expect)

        def run():
            return A.paged_attention_impl(*kargs, num_splits=num_splits)

        def check():
            with _Poison():
                return rel_err(run(), expect)

        elt = kargs[1].element_size()
        kv_bytes = sum(ctx_lens) * hkv * d * elt * 2
        q_bytes = 2 * sum(q_lens) * h * d * elt
        pairs = sum(ql * (c - ql) + ql * (ql + 1) // 2 for ql, c in zip(q_lens, ctx_lens))  # causal
        flops = 4.0 * h * d * pairs
        note = ""
        if max(q_lens) <= 1:
            max_ctx = kargs[3].shape[1] * bs
            auto = A.decode_num_splits(len(ctx_lens), hkv, max_ctx, kargs[0].device)
            note = f"splits={num_splits or auto}" + (" (auto)" if num_splits is None else "")
        time_ref = num_splits is None  # the split variants share inputs: time the reference once
        return Env(check=check, triton=run, torch=(lambda: ref.paged_attention(*rargs)) if time_ref else None,
                   bytes=kv_bytes + q_bytes, flops=flops, note=note)

    shape = shape or f"q={sum(q_lens)} ctx={sum(ctx_lens)} H={h}/{hkv} D={d} bs={bs}"
    return Case(name, group, shape, dtype, build, timed)


def norm_case(name, group, rows, hidden, dtype, device, residual=True, timed=True) -> Case:
    def build() -> Env:
        import torch

        from shiftnode_kernels import norm, reference as ref

        t = _torch_dtype(dtype)
        x = torch.randn(rows, hidden, device=device, dtype=t)
        w = (1 + 0.1 * torch.randn(hidden, device=device)).to(t)
        r = torch.randn(rows, hidden, device=device, dtype=t) if residual else None

        def check():
            with _Poison():
                out, h = norm.rms_norm(x, w, 1e-5, r)
            out_r, h_r = ref.rms_norm(x, w, 1e-5, r)
            return max(rel_err(out, out_r), rel_err(h, h_r))

        n = 4 if residual else 2
        return Env(check, lambda: norm.rms_norm(x, w, 1e-5, r), lambda: ref.rms_norm(x, w, 1e-5, r),
                   bytes=n * x.numel() * x.element_size())

    return Case(name, group, f"[{rows}, {hidden}]" + (" +residual" if residual else ""), dtype, build, timed)


def rotary_case(name, group, tokens, h, hkv, d, dtype, device, rot_dim=None, timed=True) -> Case:
    def build() -> Env:
        import torch

        from shiftnode_kernels import reference as ref, rotary

        t = _torch_dtype(dtype)
        rd = rot_dim or d
        inv = 1.0 / (500000 ** (torch.arange(0, rd, 2, device=device, dtype=torch.float32) / rd))
        cs = ref.rope_cos_sin_cache(inv, 8192)
        pos = torch.randint(0, 8192, (tokens,), device=device)
        q = torch.randn(tokens, h, d, device=device, dtype=t)
        k = torch.randn(tokens, hkv, d, device=device, dtype=t)

        def check():
            q1, k1, q2, k2 = q.clone(), k.clone(), q.clone(), k.clone()
            rotary.rotary_embedding(pos, q1, k1, cs)
            ref.rotary_embedding(pos, q2, k2, cs)
            return max(rel_err(q1, q2), rel_err(k1, k2))

        return Env(check, lambda: rotary.rotary_embedding(pos, q, k, cs),
                   lambda: ref.rotary_embedding(pos, q, k, cs),
                   bytes=2 * (q.numel() + k.numel()) * q.element_size() + tokens * rd * 4)

    return Case(name, group, f"T={tokens} H={h}/{hkv} D={d} rot={rot_dim or d}", dtype, build, timed)


def silu_case(name, group, rows, inter, dtype, device, timed=True) -> Case:
    def build() -> Env:
        import torch

        from shiftnode_kernels import activation, reference as ref

        x = torch.randn(rows, 2 * inter, device=device, dtype=_torch_dtype(dtype))

        def check():
            with _Poison():
                return rel_err(activation.silu_and_mul(x), ref.silu_and_mul(x))

        return Env(check, lambda: activation.silu_and_mul(x), lambda: ref.silu_and_mul(x),
                   bytes=3 * rows * inter * x.element_size())

    return Case(name, group, f"[{rows}, 2x{inter}]", dtype, build, timed)


def cache_case(name, group, tokens, hkv, d, bs, dtype, device, timed=True) -> Case:
    def build() -> Env:
        import torch

        from shiftnode_kernels import cache, reference as ref

        t = _torch_dtype(dtype)
        num_blocks = -(-tokens // bs) * 2
        key = torch.randn(tokens, hkv, d, device=device, dtype=t)
        val = torch.randn(tokens, hkv, d, device=device, dtype=t)
        kc = torch.randn(num_blocks, bs, hkv, d, device=device, dtype=t)
        vc = torch.randn_like(kc)
        slots = torch.randperm(num_blocks * bs, device=device)[:tokens]
        slots[::7] = -1

        def check():
            k1, v1, k2, v2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
            cache.reshape_and_cache(key, val, k1, v1, slots)
            ref.reshape_and_cache(key, val, k2, v2, slots)
            return max(rel_err(k1, k2), rel_err(v1, v2))

        return Env(check, lambda: cache.reshape_and_cache(key, val, kc, vc, slots),
                   lambda: ref.reshape_and_cache(key, val, kc, vc, slots),
                   bytes=4 * key.numel() * key.element_size())

    return Case(name, group, f"T={tokens} Hkv={hkv} D={d} bs={bs}", dtype, build, timed)


def transfer_case(name, group, n, hkv, d, bs, dtype, device, scatter: bool, timed=True) -> Case:
    def build() -> Env:
        import torch

        from shiftnode_kernels import kv_transfer, reference as ref

        t = _torch_dtype(dtype)
        num_blocks = 2 * n + 3
        kv = torch.randn(2, 2, num_blocks, bs, hkv, d, device=device, dtype=t)  # two layers
        kc, vc = kv[1, 0], kv[1, 1]
        ids = torch.randperm(num_blocks, device=device)[:n]
        buf = torch.randn(2, n, bs, hkv, d, device=device, dtype=t)
        nbytes = 2 * buf.numel() * buf.element_size()
        if not scatter:
            def check():
                with _Poison():
                    return rel_err(kv_transfer.gather_kv_blocks(kc, vc, ids), ref.gather_kv_blocks(kc, vc, ids))

            return Env(check, lambda: kv_transfer.gather_kv_blocks(kc, vc, ids),
                       lambda: ref.gather_kv_blocks(kc, vc, ids), bytes=nbytes)

        def check_scatter():
            kv1, kv2 = kv.clone(), kv.clone()
            kv_transfer.scatter_kv_blocks(buf, kv1[1, 0], kv1[1, 1], ids)
            ref.scatter_kv_blocks(buf, kv2[1, 0], kv2[1, 1], ids)
            return rel_err(kv1, kv2)

        return Env(check_scatter, lambda: kv_transfer.scatter_kv_blocks(buf, kc, vc, ids),
                   lambda: ref.scatter_kv_blocks(buf, kc, vc, ids), bytes=nbytes)

    return Case(name, group, f"n={n} blocks bs={bs} Hkv={hkv} D={d}", dtype, build, timed)


def ceiling_cases(device: str, quick: bool) -> list[Case]:
    def copy_build() -> Env:
        import torch

        n = (1 << 24) if quick else (1 << 30)
        src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
        dst = torch.empty_like(src)
        return Env(check=lambda: 0.0, triton=lambda: dst.copy_(src), bytes=2.0 * n)

    def mm_build() -> Env:
        import torch

        n = 512 if quick else 8192
        a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        return Env(check=lambda: 0.0, triton=lambda: a @ b, flops=2.0 * n**3)

    return [Case("copy (ceiling)", "ceilings", "1 GiB d2d" if not quick else "16 MiB", "uint8", copy_build),
            Case("matmul (ceiling)", "ceilings", "8192^3" if not quick else "512^3", "bfloat16", mm_build)]


def build_cases(device: str, quick: bool) -> list[Case]:
    cases = ceiling_cases(device, quick)
    ref_cache: dict = {}
    # decode: batch 64 x context 4096, Llama-3-8B heads, bf16, block 16; then small batch, long context
    b, ctx = (4, 300) if quick else (64, 4096)
    for splits in (None, 1, 2, 4, 8):
        label = "auto" if splits is None else f"splits={splits}"
        cases.append(attention_case(f"paged decode ({label})", "decode", [1] * b, [ctx] * b, H, HKV, D, 16,
                                    "bfloat16", device, num_splits=splits, ref_cache=ref_cache,
                                    shape=f"B={b} ctx={ctx} H={H}/{HKV} D={D} bs=16"))
    b2, ctx2 = (2, 900) if quick else (4, 32768)
    for splits in (None, 1):
        label = "auto" if splits is None else f"splits={splits}"
        cases.append(attention_case(f"paged decode long ({label})", "decode", [1] * b2, [ctx2] * b2, H, HKV, D,
                                    16, "bfloat16", device, num_splits=splits, ref_cache=ref_cache,
                                    shape=f"B={b2} ctx={ctx2} H={H}/{HKV} D={D} bs=16"))
    # prefill: one 4096-token prompt; a 512-token chunk on a 3584-token cached prefix
    lp = 256 if quick else 4096
    cases.append(attention_case("paged prefill", "prefill", [lp], [lp], H, HKV, D, 16, "bfloat16", device,
                                shape=f"1 prompt x {lp} H={H}/{HKV} D={D} bs=16"))
    cq, cp = (64, 128) if quick else (512, 3584)
    cases.append(attention_case("paged prefill chunk", "prefill", [cq], [cq + cp], H, HKV, D, 16, "bfloat16",
                                device, shape=f"{cq} new on {cp} cached H={H}/{HKV} D={D} bs=16"))
    t = 64 if quick else 4096
    cases += [
        cache_case("reshape_and_cache", "small", t, HKV, D, 16, "bfloat16", device),
        norm_case("rms_norm", "small", t, HIDDEN, "bfloat16", device),
        rotary_case("rotary_embedding", "small", t, H, HKV, D, "bfloat16", device),
        silu_case("silu_and_mul", "small", t, 1024 if quick else INTER, "bfloat16", device),
        transfer_case("gather_kv_blocks", "small", t // 16, HKV, D, 16, "bfloat16", device, scatter=False),
        transfer_case("scatter_kv_blocks", "small", t // 16, HKV, D, 16, "bfloat16", device, scatter=True),
    ]
    cases += sweep_cases(device)
    return cases


def sweep_cases(device: str) -> list[Case]:
    """Small edge cases, checked only: every dtype, block sizes 8/16, GQA 1/4/8, head dims 64/128/80,
    idle and single-token sequences, chunked prefill, split-K decode."""
    out = []
    configs = [(8, 8, 8, 64, 1), (16, 16, 2, 128, 3), (8, 12, 4, 80, 3), (16, 32, 8, 128, 1)]
    for dtype in ("float32", "bfloat16", "float16"):
        for bs, h, hkv, d, splits in configs[: 4 if dtype == "float32" else 3]:
            tag = f"{dtype} bs{bs} gqa{h // hkv} d{d}"
            out.append(attention_case(f"sweep decode s{splits} {tag}", "sweep", [1, 1, 0, 1, 1],
                                      [1, 37, 21, 300, 16], h, hkv, d, bs, dtype, device, num_splits=splits,
                                      timed=False, seed=1))
            out.append(attention_case(f"sweep varlen {tag}", "sweep", [5, 1, 0, 7, 1, 150], [5, 1, 10, 30, 19, 290],
                                      h, hkv, d, bs, dtype, device, timed=False, seed=2))
        out += [
            norm_case(f"sweep rms_norm {dtype}", "sweep", 7, 5120, dtype, device, timed=False),
            norm_case(f"sweep rms_norm nores {dtype}", "sweep", 3, 96, dtype, device, residual=False, timed=False),
            rotary_case(f"sweep rotary {dtype}", "sweep", 9, 12, 4, 80, dtype, device, timed=False),
            rotary_case(f"sweep rotary partial {dtype}", "sweep", 9, 8, 2, 128, dtype, device, rot_dim=64,
                        timed=False),
            silu_case(f"sweep silu {dtype}", "sweep", 5, 1100, dtype, device, timed=False),
            cache_case(f"sweep cache {dtype}", "sweep", 19, 2, 80, 8, dtype, device, timed=False),
            transfer_case(f"sweep gather {dtype}", "sweep", 5, 2, 64, 8, dtype, device, scatter=False, timed=False),
            transfer_case(f"sweep scatter {dtype}", "sweep", 5, 2, 64, 8, dtype, device, scatter=True, timed=False),
        ]
    return out


# --------------------------------------------------------------------------------------------------
# child: run the cases of one group, one JSON line per case


def run_case(case: Case, device: str) -> dict:
    import torch

    rec = {"name": case.name, "group": case.group, "shape": case.shape, "dtype": case.dtype, "ok": False,
           "rel_err": None, "tol": TOL.get(case.dtype), "triton_ms": None, "torch_ms": None, "bytes": None,
           "flops": None, "note": "", "error": None}
    t0 = time.time()
    try:
        env = case.build()
        rec.update(bytes=env.bytes or None, flops=env.flops or None, note=env.note)
        if case.group != "ceilings":
            err = env.check()
            rec["rel_err"] = err
            rec["ok"] = bool(err <= rec["tol"])
            if not rec["ok"]:
                rec["error"] = f"relative error {err:.3g} > {rec['tol']:.0e}"
        else:
            rec["ok"] = True
        if case.timed:
            rec["triton_ms"] = time_ms(env.triton, device)
            if env.torch is not None:
                try:
                    rec["torch_ms"] = time_ms(env.torch, device)
                except Exception as exc:  # the reference may run out of memory: not a kernel failure
                    rec["note"] += f" (torch timing failed: {type(exc).__name__})"
        if device == "cuda":
            torch.cuda.synchronize()
    except Exception as exc:
        rec["ok"] = False
        rec["error"] = f"{type(exc).__name__}: {exc}"
        rec["traceback"] = traceback.format_exc(limit=8)
    rec["wall_s"] = round(time.time() - t0, 2)
    return rec


def child_main(args) -> int:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    skip = set(json.loads(args.skip)) if args.skip else set()
    cases = [c for c in build_cases(args.device, args.quick) if c.group == args.child and c.name not in skip]
    with open(args.child_out, "a") as f:
        if args.device == "cuda":
            f.write(json.dumps({"device_name": torch.cuda.get_device_name(),
                                "sm_count": torch.cuda.get_device_properties(0).multi_processor_count}) + "\n")
        for case in cases:
            f.write(json.dumps({"start": case.name}) + "\n")
            f.flush()
            rec = run_case(case, args.device)
            f.write(json.dumps(rec) + "\n")
            f.flush()
            status = "ok  " if rec["ok"] else "FAIL"
            err = "" if rec["rel_err"] is None else f" err={rec['rel_err']:.2e}"
            ms = "" if rec["triton_ms"] is None else f" {rec['triton_ms']:.4f} ms"
            log(f"  [{status}] {case.name:36s} {case.shape:44s}{err}{ms} {rec['note']}"
                + (f"\n         {rec['error']}" if rec["error"] else ""))
            if not rec["ok"] and args.device == "cuda":
                try:
                    torch.cuda.synchronize()
                    torch.empty(1, device="cuda").fill_(0).item()
                except Exception:
                    log("  CUDA context is broken; restarting the group in a fresh process")
                    return 3
    return 0


# --------------------------------------------------------------------------------------------------
# parent: run groups in children, then report


def run_group(group: str, args, deadline: float) -> tuple[list[dict], dict]:
    """Run one group in child processes until every case has a record (or time is up)."""
    records: dict[str, dict] = {}
    info: dict = {}
    names = [c.name for c in _case_index(args) if c.group == group]
    for attempt in range(len(names) + 1):
        todo = [n for n in names if n not in records]
        left = deadline - time.time()
        if not todo or left < 10:
            break
        with tempfile.NamedTemporaryFile("w+", suffix=".jsonl", delete=False) as tmp:
            path = tmp.name
        cmd = [sys.executable, "-m", "bench.device.kernels", "--child", group, "--child-out", path,
               "--device", args.device, "--skip", json.dumps(sorted(records))] + (["--quick"] if args.quick else [])
        started = None
        try:
            proc = subprocess.run(cmd, timeout=left, cwd=Path(__file__).resolve().parents[2])
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        for line in Path(path).read_text().splitlines():
            rec = json.loads(line)
            if "device_name" in rec:
                info = rec
            elif "start" in rec:
                started = rec["start"]
            else:
                records[rec["name"]] = rec
                started = None
        os.unlink(path)
        if rc == 0:
            break
        why = "timed out (deadline)" if rc == "timeout" else f"child process died (exit {rc})"
        if started is not None:  # the child died (or hung) inside this case
            records[started] = {"name": started, "group": group, "ok": False, "error": why}
        elif len(records) == len(names) - len(todo):  # died before running anything: do not loop
            for n in todo:
                records[n] = {"name": n, "group": group, "ok": False, "error": why + " before the case ran"}
        if rc == "timeout":
            break
    for n in names:
        records.setdefault(n, {"name": n, "group": group, "ok": False, "error": "not run (deadline)"})
    by_name = {c.name: c for c in _case_index(args)}
    for n in names:  # crashed cases have no record of their own: name their shape and dtype
        records[n].setdefault("shape", by_name[n].shape)
        records[n].setdefault("dtype", by_name[n].dtype)
    return [records[n] for n in names], info


_CASES: list[Case] | None = None


def _case_index(args) -> list[Case]:
    global _CASES
    if _CASES is None:
        _CASES = build_cases(args.device, args.quick)  # builders are lazy: this allocates nothing
    return _CASES


def fmt_row(r: dict, ceil: dict) -> list[str]:
    ms = r.get("triton_ms")
    achieved = pct = "—"
    if ms:
        if r.get("flops") and (r["group"] in ("prefill",) or r["name"].startswith("matmul")):
            tf = r["flops"] / ms / 1e9
            achieved = f"{tf:.1f} TFLOP/s"
            if ceil.get("tflops") and not r["name"].startswith("matmul"):
                pct = f"{100 * tf / ceil['tflops']:.0f}%"
        elif r.get("bytes"):
            gbs = r["bytes"] / ms / 1e6
            achieved = f"{gbs:.0f} GB/s"
            if ceil.get("gbps") and not r["name"].startswith("copy"):
                pct = f"{100 * gbs / ceil['gbps']:.0f}%"
    torch_ms = r.get("torch_ms")
    speed = f"{torch_ms / ms:.1f}x" if ms and torch_ms else "—"
    if r["group"] == "ceilings":
        check = "—" if r["ok"] else "FAIL"
    elif r.get("rel_err") is not None:
        check = ("ok " if r["ok"] else "FAIL ") + f"{r['rel_err']:.1e}"
    else:
        check = "FAIL"
    return [r["name"], r.get("shape", ""), r.get("dtype", ""), check, f"{ms:.4f}" if ms else "—",
            f"{torch_ms:.4f}" if torch_ms else "—", speed, achieved, pct, r.get("note", "")]


def parent_main(args) -> int:
    groups = [g for g in (args.groups.split(",") if args.groups else GROUPS)]
    unknown = set(groups) - set(GROUPS)
    if unknown:
        log(f"unknown groups {sorted(unknown)}; known: {GROUPS}")
        return 2
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            log("bench.device.kernels: no CUDA device visible (torch.cuda.is_available() is False); "
                "use --device cpu --quick with TRITON_INTERPRET=1 to test the script itself")
            return 2
    t_start = time.time()
    deadline = t_start + args.deadline
    results: list[dict] = []
    info: dict = {}
    for g in groups:
        log(f"== {g} ({time.time() - t_start:.0f}s elapsed)")
        recs, inf = run_group(g, args, deadline)
        results += recs
        info = info or inf
    ceil = {}
    for r in results:
        if r["name"] == "copy (ceiling)" and r.get("triton_ms"):
            ceil["gbps"] = r["bytes"] / r["triton_ms"] / 1e6
        if r["name"] == "matmul (ceiling)" and r.get("triton_ms"):
            ceil["tflops"] = r["flops"] / r["triton_ms"] / 1e9
    failures = [r for r in results if not r["ok"]]
    device_name = info.get("device_name", args.device)
    header = ["kernel", "shape", "dtype", "check (rel err)", "triton ms", "torch ms", "vs torch", "achieved",
              "% of ceiling", "note"]
    timed = [r for r in results if r["group"] != "sweep"]
    sweep = [r for r in results if r["group"] == "sweep"]
    rows = [fmt_row(r, ceil) for r in timed]
    command = "python -m bench.device.kernels " + " ".join(sys.argv[1:])
    lines = [f"## {_dt_now()} — kernels on {device_name}", "", f"`{command}`", ""]
    shapes = {r["name"]: r.get("shape", "?") for r in results}
    lines.append(f"Ceilings: copy {ceil.get('gbps', float('nan')):.0f} GB/s ({shapes.get('copy (ceiling)', '-')} "
                 f"device-to-device, read+write counted), bf16 matmul {ceil.get('tflops', float('nan')):.0f} TFLOP/s "
                 f"({shapes.get('matmul (ceiling)', '-')}). Times are medians of `triton.testing.do_bench` "
                 "(L2 flushed before each run).")
    lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    if sweep:
        n_ok = sum(r["ok"] for r in sweep)
        lines += ["", f"Edge-case sweep (fp32/bf16/fp16, block sizes 8/16, GQA 1/3/4/8, head dims 64/80/128, idle "
                      f"and single-token sequences, chunked prefill, split-K): {n_ok}/{len(sweep)} passed."]
    if failures:
        lines += ["", "**Failures:**", ""]
        lines += [f"- {r['name']}: {r.get('error')}" for r in failures]
    lines.append("")
    table = "\n".join(lines)
    log("\n" + table)
    if args.markdown:
        p = Path(args.markdown)
        p.parent.mkdir(parents=True, exist_ok=True)
        prev = p.read_text() if p.exists() else "# Benchmark results\n"
        p.write_text(prev.rstrip("\n") + "\n\n" + table)
        log(f"appended to {p}")
    if args.json:
        p = Path(args.json)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps({"date": _dt_now(), "device": device_name, "command": command,
                                 "sm_count": info.get("sm_count"), "ceilings": ceil, "results": results,
                                 "failures": [r["name"] for r in failures],
                                 "wall_s": round(time.time() - t_start, 1)}, indent=1))
        log(f"wrote {p}")
    log(f"bench.device.kernels: {len(results) - len(failures)}/{len(results)} ok, {len(failures)} failed, "
        f"{time.time() - t_start:.0f}s")
    return 1 if failures else 0


def _dt_now() -> str:
    return datetime.datetime.now().strftime("%Y-%m-%d %H:%M")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--markdown", help="append a dated results section to this markdown file")
    p.add_argument("--json", help="write all results to this JSON file")
    p.add_argument("--groups", help=f"comma-separated subset of {GROUPS}")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--quick", action="store_true", help="small shapes (for the CPU interpreter)")
    p.add_argument("--deadline", type=float, default=330.0, help="seconds for everything (default 330)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    p.add_argument("--skip", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        os.environ["TRITON_INTERPRET"] = "1"  # children inherit it; set before any kernel is defined
    if args.device == "cuda":
        os.environ["TRITON_INTERPRET"] = "0"
    if args.child:
        return child_main(args)
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
