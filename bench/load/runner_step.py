"""The runner's own decode step, eager against ``--compile inductor``, side by side in one process.

    python -m bench.load.runner_step [--batches 1,64] [--context 72] [--rounds 5] [--runs 200] [--threads N]

Runs with an engine process's torch threads (:func:`engine_threads`; 1 on a 2-CPU machine). Builds
one stories260k :class:`~node.worker.runner.ModelRunner` per ``--compile`` mode with the
node's loader (the compiled one compiles its buckets in the build: ``build s`` is the start-up cost,
the first run's figure a cold inductor cache, later runs' a warm one), then times
``ModelRunner.execute`` of a pure decode step (every sequence one token at ``--context``, greedy
sampling: packing, forward, logits, sampler, as a served step) at each batch size. The modes alternate
round by round (``--rounds``), each round ``--runs`` steps, so both see the same phases of a shared
machine; the figure is the median of the round medians. :func:`runner_steps` is what
``bench.load.host_overhead`` prints in its header.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

BLOCK = 16


def engine_threads(devices: int = 1) -> int:
    """The torch threads of a CPU engine process of a one-process node with ``devices`` devices: the
    node's own rule (:func:`node.worker.engine_process.engine_threads`)."""
    from node.config import NodeConfig, usable_cores
    from node.worker.engine_process import engine_threads as node_engine_threads

    return node_engine_threads(NodeConfig(devices=[f"cpu:{i}" for i in range(devices)]), usable_cores())


def _decode_step(batch: int, context: int, vocab: int):
    from node.core.sequence import SamplingParams
    from node.worker.runner import SeqInput, StepInput
    from node.worker.sampler import SampleRequest

    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    n = -(-context // BLOCK)
    return StepInput([SeqInput(f"s{i}", [3 + i % (vocab - 3)], context - 1, list(range(1 + i * n, 1 + (i + 1) * n)),
                               SampleRequest(greedy, [], 0, 0)) for i in range(batch)])


def build(folder: Path, mode: str, batches: list[int], context: int):
    """``(runner, seconds)``: a runner of ``folder`` built by the node's loader with ``--compile mode``
    (compile sizes: the node's default buckets), KV for ``max(batches)`` sequences of ``context``."""
    from node.config import NodeConfig
    from node.worker.loader import build_runner, load_model_info, select_ops

    t0 = time.perf_counter()
    blocks = max(batches) * -(-context // BLOCK) + 2
    cfg = NodeConfig(model=str(folder), compile=mode, max_model_len=max(context, 2))
    info = load_model_info(cfg)
    cfg.kv_cache_memory_bytes = blocks * BLOCK * info.cfg.kv_bytes_per_token(info.dtype)
    runner = build_runner(cfg, info, "cpu:0", select_ops("auto", "cpu"))
    return runner, time.perf_counter() - t0


def runner_steps(folder: Path, context: int, batches: list[int], modes: list[str], rounds: int = 5,
                 runs: int = 200) -> dict:
    """``{"build_s": {mode: s}, "step_ms": {(mode, batch): ms}}`` (median of round medians)."""
    runners, build_s = {}, {}
    for mode in modes:
        runners[mode], build_s[mode] = build(folder, mode, batches, context)
    vocab = runners[modes[0]].cfg.vocab_size
    per: dict[tuple[str, int], list[float]] = {}
    for batch in batches:
        step = _decode_step(batch, context, vocab)
        n = max(20, runs // batch)
        for _ in range(rounds):
            for mode in modes:
                r = runners[mode]
                for _ in range(3):
                    r.execute(step)
                times = []
                for _ in range(n):
                    t0 = time.perf_counter()
                    r.execute(step)
                    times.append(time.perf_counter() - t0)
                per.setdefault((mode, batch), []).append(statistics.median(times) * 1e3)
    for mode, r in runners.items():
        if r.compiled is not None:
            assert r.compiled.fallbacks == 0 and r.compiled.steps > 0, "compiled steps fell back to eager"
    return {"build_s": build_s, "step_ms": {k: statistics.median(v) for k, v in per.items()},
            "rounds": {k: v for k, v in per.items()}}


def table(res: dict, batches: list[int]) -> str:
    modes = list(res["build_s"])
    rows = [f"{'mode':9} {'build s':>8} " + " ".join(f"{'B=' + str(b) + ' ms':>9}" for b in batches)]
    for m in modes:
        rows.append(f"{m:9} {res['build_s'][m]:8.1f} " + " ".join(f"{res['step_ms'][(m, b)]:9.3f}" for b in batches))
    if len(modes) == 2:
        a, b = modes
        rows.append(f"{b}/{a}:          " + " ".join(f"{res['step_ms'][(b, x)] / res['step_ms'][(a, x)]:9.2f}"
                                                    for x in batches))
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.load.runner_step", description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="1,64")
    p.add_argument("--context", type=int, default=72, help="tokens per sequence (the new one included)")
    p.add_argument("--modes", default="none,inductor")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--runs", type=int, default=200, help="steps per round at batch 1 (fewer at larger batches)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: an engine process's, (CPUs - 1) / 1 device, at least 1)")
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads or engine_threads())
    from bench.traffic.workload import shared_dir

    batches = [int(x) for x in a.batches.split(",")]
    modes = [m.strip() for m in a.modes.split(",")]
    res = runner_steps(shared_dir() / "models" / "stories260k", a.context, batches, modes, a.rounds, a.runs)
    print(f"stories260k decode step (ModelRunner.execute, greedy), context {a.context}, {os.cpu_count()} CPUs, "
          f"{torch.get_num_threads()} torch threads, {a.rounds} alternating rounds")
    print(table(res, batches))
    return 0


if __name__ == "__main__":
    sys.exit(main())
