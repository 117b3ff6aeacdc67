"""Measure a model's step times on this machine and fit a :class:`~node.core.cost.CostModel` to them.

``python -m bench.cost.calibrate --model ../shared/models/stories260k --device cpu:0
--out bench/cost_models/cpu_stories260k.json``

The weights and KV pool are built exactly as the node builds them (``node.worker.loader``; ``--model``
with ``--load-format dummy`` for random weights of any ``config.json``), and the steps run through
:meth:`ModelRunner.execute`, the call a device's worker thread makes. Timed (median of ``--reps`` after
``--warmup`` runs, all points interleaved in a shuffled order within each repetition, seconds,
``torch.cuda.synchronize`` on CUDA; ``--threads`` sets torch's intra-op threads, which should match the
node's — the CPU benchmarks run each node with ``OMP_NUM_THREADS=1``):

* prefill steps of ``n`` packed prompt tokens, ``n`` doubling from 16 up to the token budget, split into
  prompts of at most ``--max-prompt-tokens`` (default: the context), each sampling its first token;
* decode steps of ``b`` sequences (``b`` doubling up to ``--max-batch``) with ``c`` tokens cached each
  (``c`` in a few points up to the context), one token per sequence.

:func:`fit` fits the coefficients. ``--fit ols`` is :func:`node.core.cost.fit_cost_model` (least
squares on seconds), which lets the largest steps dominate and, on this CPU, where the torch reference
attention makes step time convex in the tokens, gives negative intercepts. ``--fit relative`` (the
default) minimises the *relative* errors instead — the small steps that dominate serving count as
much as the big ones — with every coefficient kept non-negative (a column whose coefficient comes out
negative is dropped and the rest refitted), solved by the same :func:`node.core.cost.least_squares`.
``pause_s`` is
``--pause-ms`` (the role switch's measured swap on the CPU is microseconds; the node adds its
``--reconfig-pause-ms`` floor). The JSON is the CostModel's fields plus a ``calibration`` record (the
samples, the machine, the config) that ``CostModel`` decoding ignores; :func:`load_cost_model` reads it.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import msgspec

from node.cli import parse_bytes
from node.config import EMBEDDED_MODEL
from node.core.cost import CostModel, fit_cost_model, least_squares
from node.core.roofline import RooflineCost, cost_model_from_dict, cost_model_to_dict

__all__ = ["measure", "relative_fit", "fit", "fit_errors", "doubling", "load_cost_model", "main"]


def load_cost_model(path: str | Path) -> CostModel | RooflineCost:
    """The cost model of a JSON file, by its ``"kind"`` (:func:`node.core.roofline.cost_model_from_dict`:
    ``roofline``, or ``linear``/absent); keys that are not fields, such as ``calibration``, are ignored.

    Raises:
        OSError: the file cannot be read; ValueError: not JSON, an unknown kind or bad fields.
    """
    return cost_model_from_dict(json.loads(Path(path).read_text()))


def _nonneg_relative(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Non-negative ``x`` minimising ``sum(((A x - y) / y)^2)`` (active set: drop the most negative column)."""
    active = list(range(len(rows[0])))
    while True:
        sub = [[r[j] / y for j in active] for r, y in zip(rows, ys)]
        coef = least_squares(sub, [1.0] * len(ys))
        worst = min(range(len(active)), key=lambda i: coef[i])
        if coef[worst] >= 0 or len(active) == 1:
            x = [0.0] * len(rows[0])
            for j, c in zip(active, coef):
                x[j] = max(0.0, c)
            return x
        active.pop(worst)


def relative_fit(prefill: list[tuple[int, float]], decode: list[tuple[int, int, float]], pause_s: float = 0.0,
                 quadratic: bool = False) -> CostModel:
    """The ``--fit relative`` CostModel (see the module doc); samples as for ``fit_cost_model``."""
    p = _nonneg_relative([[1.0, float(n)] + ([float(n) * n] if quadratic else []) for n, _ in prefill],
                         [s for _, s in prefill])
    d = _nonneg_relative([[1.0, float(b), float(k)] for b, k, _ in decode], [s for _, _, s in decode])
    return CostModel(prefill_fixed_s=p[0], prefill_per_token_s=p[1], prefill_per_token2_s=p[2] if quadratic else 0.0,
                     decode_fixed_s=d[0], decode_per_seq_s=d[1], decode_per_context_token_s=d[2], pause_s=pause_s)


def fit(prefill: list[tuple[int, float]], decode: list[tuple[int, int, float]], pause_s: float = 0.0, *,
        method: str = "relative", quadratic: bool = False) -> CostModel:
    """Fit a CostModel to measured steps by ``method`` (``relative`` or ``ols``)."""
    if method == "ols":
        return fit_cost_model(prefill, decode, [pause_s], quadratic=quadratic)
    return relative_fit(prefill, decode, pause_s, quadratic)


def fit_errors(cost: CostModel, prefill: list[tuple[int, float]], decode: list[tuple[int, int, float]]) -> list[float]:
    """Relative error of the model on each sample (prefill first, then decode)."""
    return ([(cost.prefill_step_s(n) - s) / s for n, s in prefill]
            + [(cost.decode_step_s(b, k) - s) / s for b, k, s in decode])


def doubling(lo: int, hi: int) -> list[int]:
    """``lo, 2 lo, 4 lo, ...`` below ``hi``, then ``hi``."""
    out, n = [], lo
    while n < hi:
        out.append(n)
        n *= 2
    return out + [hi]


def measure(args: argparse.Namespace) -> tuple[list[tuple[int, float]], list[tuple[int, int, float]], dict]:
    """Build the runner and time the steps: ``(prefill samples, decode samples, machine/config info)``."""
    import torch

    from node.config import NodeConfig
    from node.core.ledger import BlockLedger
    from node.core.sequence import SamplingParams
    from node.worker.loader import select_ops
    from node.worker.loader import build_runner, load_model_info
    from node.worker.runner import SeqInput, StepInput
    from node.worker.sampler import SampleRequest

    config = NodeConfig(model=args.model, load_format=args.load_format, devices=[args.device], dtype=args.dtype,
                        max_model_len=args.max_model_len, kv_cache_memory_bytes=args.kv_cache_memory,
                        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size)
    if args.threads:
        torch.set_num_threads(args.threads)
    info = load_model_info(config)
    runner = build_runner(config, info, args.device, select_ops(config.attention_backend, args.device.partition(":")[0]))
    ledger = BlockLedger(runner.num_blocks, config.block_size)
    ctx = info.max_model_len
    vocab = info.cfg.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0.0)
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)

    def seq(i: int, cached: int, new: int) -> SeqInput:
        blocks = ledger.allocate(ledger.blocks_for(cached + new))
        if blocks is None:
            raise RuntimeError("KV pool too small for the calibration batch; raise --kv-cache-memory")
        ids = [(7 * i + j) % (vocab - 3) + 3 for j in range(new)]
        return SeqInput(f"s{i}", ids, cached, blocks, SampleRequest(params, ids, len(ids), 0))

    prefill_steps = []
    for n in doubling(16, args.max_num_batched_tokens):
        per = min(ctx - 1, args.max_prompt_tokens or ctx - 1)
        sizes = [per] * (n // per) + ([n % per] if n % per else [])
        prefill_steps.append((n, StepInput([seq(i, 0, m) for i, m in enumerate(sizes)])))
    decode_steps = []
    for b in doubling(1, args.max_batch):
        for c in sorted({16, ctx // 4, ctx // 2, ctx - 1}):
            if c >= 2:
                decode_steps.append(((b, b * c), StepInput([seq(i, c - 1, 1) for i in range(b)])))
    # Interleave the points within each repetition, so a burst of load from elsewhere on the machine
    # spreads over all of them instead of skewing one.
    steps = prefill_steps + decode_steps
    times: list[list[float]] = [[] for _ in steps]
    rng = random.Random(0)
    for rep in range(args.warmup + args.reps):
        order = list(range(len(steps)))
        rng.shuffle(order)
        for i in order:
            sync()
            t = time.perf_counter()
            runner.execute(steps[i][1])
            sync()
            if rep >= args.warmup:
                times[i].append(time.perf_counter() - t)
    med = [statistics.median(ts) for ts in times]
    prefill = [(n, m) for (n, _), m in zip(prefill_steps, med)]
    decode = [(b, k, m) for ((b, k), _), m in zip(decode_steps, med[len(prefill_steps):])]
    for n, m in prefill:
        print(f"prefill {n:6d} tokens: {m * 1e3:8.3f} ms", file=sys.stderr)
    for b, k, m in decode:
        print(f"decode  {b:4d} seqs, {k:7d} ctx tokens: {m * 1e3:8.3f} ms", file=sys.stderr)
    machine = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
               "torch": torch.__version__, "threads": torch.get_num_threads(),
               "device": torch.cuda.get_device_name(runner.device) if runner.device.type == "cuda" else "cpu"}
    return prefill, decode, machine


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cost.calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=EMBEDDED_MODEL, help="model folder (default: the embedded stories260k)")
    ap.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"])
    ap.add_argument("--device", default="cpu:0")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--kv-cache-memory", type=parse_bytes, default=None, help="KV pool bytes, e.g. 2GiB (default: the node's)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048, help="largest prefill step (tokens)")
    ap.add_argument("--max-prompt-tokens", type=int, default=None,
                    help="longest prompt a prefill step packs (default: the context); match the workload's cap")
    ap.add_argument("--max-batch", type=int, default=64, help="largest decode batch (sequences)")
    ap.add_argument("--pause-ms", type=float, default=0.0, help="role-switch pause to record (ms)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (the benchmarks run CPU nodes with OMP_NUM_THREADS=1: use 1)")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--quadratic", action="store_true", help="also fit the tokens**2 prefill term")
    ap.add_argument("--fit", default="relative", choices=["relative", "ols"], help="see the module doc")
    ap.add_argument("--out", required=True, help="CostModel JSON to write")
    args = ap.parse_args(argv)
    prefill, decode, machine = measure(args)
    cost = fit(prefill, decode, args.pause_ms / 1e3, method=args.fit, quadratic=args.quadratic)
    errs = [abs(e) for e in fit_errors(cost, prefill, decode)]
    worst, mean = max(errs), sum(errs) / len(errs)
    command = " ".join(["python -m bench.cost.calibrate", *(argv if argv is not None else sys.argv[1:])])
    doc = {**cost_model_to_dict(cost), "calibration": {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": command,
        "model": args.model, "load_format": args.load_format, "device": args.device,
        "machine": machine, "fit": args.fit, "quadratic": args.quadratic,
        "max_relative_fit_error": round(worst, 4), "mean_relative_fit_error": round(mean, 4),
        "prefill_samples": prefill, "decode_samples": decode}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(msgspec.structs.asdict(cost), indent=1))
    print(f"relative fit error over the samples: mean {mean:.1%}, largest {worst:.1%}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
