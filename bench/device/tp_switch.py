"""Decode step time at tensor-parallel degree 1 and 2, and the pause of a group's role switch, side by side.

``python -m bench.device.tp_switch --model ../shared/models/stories260k --batch 16 --tokens 96``

Two time-shared nodes in this process, one after the other on the same prompts (greedy,
``ignore_eos``-like fixed lengths):

* ``degree 1``: one device (``cpu:0``), ``--decode-tp 1``;
* ``degree 2``: a group ``cpu:0+cpu:1``, ``--decode-tp 2 --prefill-tp P`` (``--prefill-tp``, 1 by
  default: prefill as two instances of one device, a real change of layout at every switch).

For each it reports the median engine time of a decode step (``StepReply.busy_s``: the ranks' own
time, all-reduces included) at the batch reached, the median swap of switches to DECODE and to
PREFILL (``SwitchRecord.swap_ms``: for the group, rebuilding the weight views of the other degree on
every rank plus the barrier), and the ratios degree 2 / degree 1. Ratios only: the emulated devices
share this machine's cores, so a group of two cannot be faster than one device here (each rank gets
half the cores, and gloo all-reduces go through loopback TCP); the figures show what the layout
switch costs against a step, not a speed-up. Absolute figures belong to a GPU run.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

from node.config import NodeConfig
from node.core.batcher import StepKind
from node.core.sequence import SamplingParams
from node.runtime.node import Node


async def measure(config: NodeConfig, batch: int, tokens: int) -> dict:
    """Run ``batch`` requests of ``tokens`` output tokens at once on a node of ``config``; the
    median decode step (ms, engine time), the decode batch seen, and the median swaps (ms)."""
    node = await Node.create(config)
    node.start()
    decode: list[tuple[int, float]] = []
    engine = node.engines[0]
    engine.step_listeners.append(lambda e, plan, s: decode.append((len(plan.items), s))
                                 if plan.kind is StepKind.DECODE else None)
    try:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, min_tokens=tokens)
        prompt = node.tokenizer.encode("Once upon a time, there was a little dog")

        async def one(i: int) -> None:
            async for _, d in node.generate(f"r{i}", prompt, params):
                assert d.error is None, d.error

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(batch)))
        wall = time.perf_counter() - t0
        # a few more switches: one request at a time, each sends the device back to PREFILL
        for i in range(4):
            await one(batch + i)
        full = [s for b, s in decode if b == batch]
        recs = list(engine.role.records)
        return {"decode_step_ms": statistics.median(full or [s for _, s in decode]) * 1e3,
                "decode_batch": batch if full else max(b for b, _ in decode), "wall_s": wall,
                "to_decode_swap_ms": statistics.median([r.swap_ms for r in recs if r.to_role == "decode"]),
                "to_prefill_swap_ms": statistics.median([r.swap_ms for r in recs if r.to_role == "prefill"] or [0.0]),
                "switches": len(recs)}
    finally:
        await node.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="Hugging Face folder (stories260k: 4 KV heads, degree 2 divides them)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--prefill-tp", type=int, default=1, choices=[1, 2])
    a = ap.parse_args(argv)
    base = dict(model=a.model, mode="time-shared", min_window_ms=1, max_window_ms=20, kv_cache_memory_bytes=32 << 20)
    one = asyncio.run(measure(NodeConfig(devices=["cpu:0"], **base), a.batch, a.tokens))
    two = asyncio.run(measure(NodeConfig(devices=["cpu:0", "cpu:1"], decode_tp=2, prefill_tp=a.prefill_tp, **base),
                              a.batch, a.tokens))
    print(f"{'':28}{'degree 1':>12}{'degree 2':>12}{'2 / 1':>9}")
    for key, label in (("decode_step_ms", f"decode step (ms, batch {one['decode_batch']})"),
                       ("to_decode_swap_ms", "swap to DECODE (ms)"), ("to_prefill_swap_ms", "swap to PREFILL (ms)")):
        ratio = two[key] / one[key] if one[key] else float("nan")
        print(f"{label:28}{one[key]:12.3f}{two[key]:12.3f}{ratio:9.2f}")
    print(f"{'switches':28}{one['switches']:12d}{two['switches']:12d}")
    print(f"group switch swap / group decode step: {two['to_decode_swap_ms'] / two['decode_step_ms']:.2f} "
          f"(to DECODE), {two['to_prefill_swap_ms'] / two['decode_step_ms']:.2f} (to PREFILL); prefill-tp {a.prefill_tp}")
    print("(emulated devices share this machine's cores: degree 2 cannot be faster here; ratios, not a speed-up)",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
