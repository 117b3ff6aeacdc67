"""The ``compiled`` section of :mod:`bench.device.e2e`: the forward compiled per token-count bucket
(``--compile inductor``, :mod:`node.worker.compiled_forward`) against the eager one, on prefill and
mixed steps.

Over the runner's own model and KV pool, a :class:`~node.worker.compiled_forward.CompiledForward` of
``Profile.compiled_buckets`` is built, each bucket compiled once (one record per bucket: its compile
time). Then, per bucket ``T``:

* ``prefill T``: one prompt of ``T`` tokens from position 0;
* ``mixed T``: ``Profile.compiled_mixed_rows`` decode rows at context ``Profile.compiled_mixed_ctx``
  beside one prompt chunk filling the bucket;

each timed as ``ModelRunner.execute`` eagerly and compiled (decode graphs off in both; a compiled
timing fails if a step fell back to eager), with the roofline floor ``max(2 * layer params * T / matmul
rate, (weights without the embedding + KV read) / copy bandwidth)`` beside it (the table computes it
from the ``ceilings`` section), and a check. Its reference is the compiled graph's own operators run
eagerly (:meth:`~node.worker.compiled_forward.CompiledForward.reference`: the torch elementwise ops and the
attention op, no inductor). In bf16 two implementations of the same layer round differently, and over 32
layers of dummy weights the difference grows to a few percent (2026-12-04 on the H200: compiled against the
node's eager Triton kernels, 5 %). So the bound is the larger of :data:`MAX_REL_ERR` and the node's eager
step's own distance to that reference (Triton kernels against torch ops, both eager): inductor's fused
kernels may be no further from the operators they fuse than the node's hand-written kernels are. Never
NaN. The greedy token of up to :data:`CHECK_ROWS` rows (evenly spaced, the last one included) must equal
the reference's, or differ only where its top-2 gap is at most ``NEAR_TIE_NATS``. The exact check of the
compiled path is float32 in ``tests/test_compiled_forward_cuda.py``.

This module does not import :mod:`bench.device.e2e` (no import cycle): the section function there hands
itself over as ``kit`` (its ``timed_ms``, ``Blocks``, ``Eager``, ``rec``, ``greedy``, ``model_bytes``
and ``NEAR_TIE_NATS``).
"""

from __future__ import annotations

import math
import traceback
from typing import Any, Iterator

MAX_REL_ERR = 1e-2
"""Largest accepted ``||compiled - eager|| / ||eager||`` of a step's final hidden states (bf16)."""

CHECK_ROWS = 256
"""Rows whose greedy token is compared per step (their float32 logits are ``rows x vocab``)."""


def section(p: Any, runner: Any, kit: Any) -> Iterator[dict]:
    """The section's records (see the module doc). ``p``: the e2e ``Profile``; ``runner``: its
    ``ModelRunner``; ``kit``: the :mod:`bench.device.e2e` module."""
    from node.worker.compiled_forward import CompiledForward

    buckets = tuple(sorted(p.compiled_buckets))
    saved = runner.compiled
    cf = CompiledForward(runner.model, runner.kv_cache, buckets)
    mb = kit.model_bytes(runner)
    kv_token = runner.cfg.kv_bytes_per_token(runner.kv_cache.dtype)
    try:
        for t in buckets:  # each bucket measured right after its compile: a deadline keeps the earlier ones
            try:
                ms = cf.warm(t)
                yield kit.rec("compiled", f"compile bucket {t}", True, mode="compile", tokens=t, s=ms / 1e3)
            except Exception as e:
                yield kit.rec("compiled", f"compile bucket {t}", False, mode="compile", tokens=t,
                              error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(limit=8))
                continue
            for kind in ("prefill", "mixed"):
                rows = p.compiled_mixed_rows if kind == "mixed" else 0
                if kind == "mixed" and t <= rows:
                    continue
                step = _step(p, runner, kit, t, rows)
                kv_read = (rows * p.compiled_mixed_ctx + (t - rows)) * kv_token
                base = dict(kind=kind, tokens=t, shape=_shape(kind, t, rows, p.compiled_mixed_ctx),
                            flops=2.0 * mb["layer_params"] * t, floor_bytes=mb["weight_bytes"] - mb["embed_bytes"] + kv_read)
                yield from _timings(p, runner, kit, cf, step, f"{kind} {t}", base)
                yield _check(runner, kit, cf, step, f"{kind} {t}", base)
    finally:
        runner.compiled = saved


def _shape(kind: str, t: int, rows: int, ctx: int) -> str:
    return f"1 prompt x {t}" if kind == "prefill" else f"{rows} decode rows at ctx {ctx} + a {t - rows}-token chunk"


def _step(p: Any, runner: Any, kit: Any, tokens: int, rows: int):
    """One step of ``tokens`` tokens: ``rows`` decode rows at context ``p.compiled_mixed_ctx`` and one
    prompt chunk of the rest from position 0; every sequence samples greedily."""
    import random

    from node.worker.runner import SeqInput, StepInput
    from node.worker.sampler import SampleRequest

    rng = random.Random(tokens * 1000 + rows)
    vocab, bs = runner.cfg.vocab_size, p.block_size
    blocks = kit.Blocks(runner.num_blocks)
    req = lambda: SampleRequest(kit.greedy(), [], 0, 0)  # noqa: E731
    ctx = p.compiled_mixed_ctx
    seqs = [SeqInput(f"m{i}", [rng.randrange(vocab)], ctx - 1, blocks.take(ctx, bs), req()) for i in range(rows)]
    chunk = tokens - rows
    seqs.append(SeqInput("c", [rng.randrange(vocab) for _ in range(chunk)], 0, blocks.take(chunk, bs), req()))
    return StepInput(seqs)


def _timings(p: Any, runner: Any, kit: Any, cf: Any, step: Any, name: str, base: dict) -> Iterator[dict]:
    eager_ms = None
    for mode in ("eager", "compiled"):
        try:
            runner.compiled = cf if mode == "compiled" else None
            before = cf.steps
            with kit.Eager(runner):
                t = kit.timed_ms(lambda: runner.execute(step), p, warmup=min(p.warmup, 2))
            used, expect = cf.steps - before, (t["iters"] + min(p.warmup, 2)) if mode == "compiled" else 0
            ok = used == expect
            extra = {"vs_eager": eager_ms / t["ms"]} if mode == "compiled" and eager_ms else {}
            eager_ms = t["ms"] if mode == "eager" else eager_ms
            yield kit.rec("compiled", f"{name} {mode}", ok, mode=mode, **base, **t, **extra,
                          error=None if ok else f"compiled path used for {used} of {expect} steps")
        except Exception as e:
            yield kit.rec("compiled", f"{name} {mode}", False, mode=mode, **base, error=f"{type(e).__name__}: {e}",
                          traceback=traceback.format_exc(limit=8))
        finally:
            runner.compiled = None


def _rel(a: Any, b: Any) -> float:
    """``||a - b|| / ||b||`` in float32 (inf when either is not finite)."""
    import torch

    a, b = a.float(), b.float()
    if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
        return math.inf
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _check(runner: Any, kit: Any, cf: Any, step: Any, name: str, base: dict) -> dict:
    """Compiled vs eager hidden states and greedy tokens of ``step`` (see the module doc)."""
    import torch

    try:
        ids, pos, meta = runner._pack(step)
        dev = runner.device
        with torch.inference_mode():
            eager = runner.model(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), runner.kv_cache, meta)
        ref = cf.reference(ids, pos, meta)  # the compiled graph's operators, run eagerly
        comp = cf.run(ids, pos, meta)
        if comp is None:
            raise RuntimeError("the step did not run compiled")
        with torch.inference_mode():
            rel, floor, kernels = _rel(comp, ref), _rel(eager, ref), _rel(comp, eager)
            n = ref.shape[0]
            count = min(CHECK_ROWS, n)
            rows = sorted({round(i * (n - 1) / max(count - 1, 1)) for i in range(count)} | {n - 1})
            idx = torch.tensor(rows, device=dev)
            lr, lc = runner.model.compute_logits(ref[idx]), runner.model.compute_logits(comp[idx])
            top = lr.topk(2, dim=-1)
            differ = (lc.argmax(-1) != top.indices[:, 0]).nonzero().flatten().tolist()
            gaps = (top.values[:, 0] - top.values[:, 1]).tolist()
        first = differ[0] if differ else None
        worst = max(gaps[i] for i in differ) if differ else None
        bound = max(MAX_REL_ERR, floor)
        finite = math.isfinite(rel)
        ok = finite and rel <= bound and (worst is None or worst <= kit.NEAR_TIE_NATS)
        err = None
        if not finite:
            err = "non-finite hidden states"
        elif rel > bound:
            err = f"relative error {rel:.3g} > {bound:.3g}"
        elif not ok:
            err = (f"greedy tokens differ at {len(differ)} rows, first at row {rows[first]}, largest top-2 gap "
                   f"{worst:.3g} nats > {kit.NEAR_TIE_NATS} (not a near tie)")
        return kit.rec("compiled", f"{name} check", ok, mode="check", kind=base["kind"], tokens=base["tokens"],
                       shape=base["shape"], rel_err=rel, rel_err_eager_kernels=floor, rel_err_vs_eager=kernels,
                       rows_checked=len(rows), matching=len(rows) - len(differ),
                       first_diff_row=rows[first] if first is not None else None,
                       first_diff_gap_nats=gaps[first] if first is not None else None, worst_gap_nats=worst, error=err)
    except Exception as e:
        return kit.rec("compiled", f"{name} check", False, mode="check", kind=base["kind"], tokens=base["tokens"],
                       error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(limit=8))


def table_row(r: dict, gbps: float | None, tflops: float | None, eager_ms: dict) -> tuple[str, str, str, str]:
    """``(measured, floor, % of it, note)`` of one ``compiled`` record for the e2e table (``eager_ms``:
    the eager median of each step name, e.g. ``"prefill 512"``)."""
    measured, ref, pct, note = "—", "—", "—", ""
    mode = r.get("mode")
    if mode == "compile" and r.get("s") is not None:
        measured, note = f"{r['s']:.1f} s", f"compile (or cache load) of the {r['tokens']}-token bucket"
    elif mode in ("eager", "compiled") and r.get("ms"):
        measured = f"{r['ms']:.2f} ms"
        floors = [x for x in (r["flops"] / tflops / 1e9 if tflops else None,
                              r["floor_bytes"] / gbps / 1e6 if gbps else None) if x is not None]
        if floors:
            ref, pct = f"{max(floors):.2f} ms", f"{100 * max(floors) / r['ms']:.0f}%"
        note = r.get("shape", "")
        key = r["name"].rsplit(" ", 1)[0]
        if mode == "compiled" and eager_ms.get(key):
            note += f"; {eager_ms[key] / r['ms']:.2f}x vs eager"
    elif mode == "check" and r.get("rows_checked"):
        measured = f"{r['matching']}/{r['rows_checked']} rows' tokens equal"
        note = f"hidden rel err {r['rel_err']:.2g} vs the same ops eager (<= max({MAX_REL_ERR}, eager kernels' {r.get('rel_err_eager_kernels', 0):.2g}))"
        if r.get("first_diff_row") is not None:
            note += f"; first differing row {r['first_diff_row']}, eager top-2 gap there {r['first_diff_gap_nats']:.3g} nats"
    return measured, ref, pct, note


def num_blocks(p: Any) -> int:
    """KV blocks the section's largest step needs (blocks are reused by every step)."""
    bs = p.block_size
    return max(p.compiled_buckets) // bs + 1 + p.compiled_mixed_rows * -(-p.compiled_mixed_ctx // bs)
