"""What a speculative verify step costs the engine against a decode step, and where (issue 46, item 3).

    python -m bench.load.spec_step [--context 100] [--runs 2000] [--k 1,4]

Builds a stories260k :class:`~node.worker.engine_core.EngineCore` with the node's loader (eager, one torch
thread: an engine process's on this machine), prefills one sequence of ``--context`` tokens, then times
:meth:`EngineCore.step` for a decode item (1 token) and verify items of ``1 + k`` tokens (greedy, drafts that
are rejected: the reply keeps one token), alternating call by call so every kind sees the same phases of a
shared machine. Each step is timed in the calling thread's CPU time (``time.thread_time_ns``, which load
changes less than wall time) and in wall time; the table gives medians and the ratio to the decode step.

The second table is the attention of one layer for the same shapes
(:func:`shiftnode_kernels.cpu_attention.paged_attention`): a decode row, and a ``1 + k``-token query through
the prefill path (``SHORT_QUERY_TOKENS`` 1) and as decode rows (the default).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

# this checkout's kernels, not those of the checkout installed in the environment (the node's own runs put
# them first too: bench.load.node_process)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "kernels"))


def _engine(context: int):
    from bench.load.runner_step import build
    from bench.traffic.workload import shared_dir
    from node.core.sequence import SamplingParams
    from node.worker.engine_core import EngineCore, NewSeq, StepItem, StepMsg

    runner, _ = build(shared_dir() / "models" / "stories260k", "none", [1], context + 40)
    core = EngineCore(runner)
    toks = [1] + [(7 * i) % 500 + 3 for i in range(context - 1)]
    blocks = list(range(1, runner.num_blocks))
    core.step(StepMsg([StepItem("s", 0, context, True)],
                      new=[NewSeq("s", toks, context, SamplingParams(max_tokens=64, temperature=0.0), blocks)]))
    return core


def step_times(context: int, ks: list[int], runs: int) -> dict[str, tuple[float, float]]:
    """``{kind: (cpu us, wall us)}`` medians of :meth:`EngineCore.step` for ``decode`` and ``verify{k}``."""
    from node.worker.engine_core import SeqTokens, StepItem, StepMsg

    core = _engine(context)
    cut = [SeqTokens("s", context + 1, [])]  # back to the prompt plus its first sampled token, every call

    def item(k: int) -> StepItem:
        draft = [(509 - j) for j in range(k)]  # tokens the model does not write here: rejected
        return StepItem("s", context, 1 + k, True, -1, draft) if k else StepItem("s", context, 1, True)

    kinds = {"decode": 0} | {f"verify{k}": k for k in ks}
    cpu: dict[str, list[int]] = {n: [] for n in kinds}
    wall: dict[str, list[int]] = {n: [] for n in kinds}
    for i in range(runs + 30):
        for name, k in kinds.items():
            msg = StepMsg([item(k)], tokens=cut)
            c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
            core.step(msg)
            if i >= 30:
                cpu[name].append(time.thread_time_ns() - c0)
                wall[name].append(time.perf_counter_ns() - w0)
    return {n: (statistics.median(cpu[n]) / 1e3, statistics.median(wall[n]) / 1e3) for n in kinds}


def attention_times(context: int, ks: list[int], runs: int) -> dict[str, float]:
    """``{case: cpu us}`` medians of one layer's :func:`paged_attention` at stories260k's heads (8 query,
    4 KV, head_dim 8), block size 16."""
    import torch

    from shiftnode_kernels import cpu_attention

    bs = 16
    n_blocks = -(-context // bs) + 1
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(n_blocks + 1, bs, 4, 8, generator=g), torch.randn(n_blocks + 1, bs, 4, 8, generator=g)
    table = torch.arange(1, n_blocks + 1, dtype=torch.int32).view(1, -1)
    short = cpu_attention.SHORT_QUERY_TOKENS
    cases = {"decode": (1, short)} | {f"verify{k} prefill path": (1 + k, 1) for k in ks} \
        | {f"verify{k} decode rows": (1 + k, short) for k in ks}
    calls = {}
    for name, (q_len, bound) in cases.items():
        q = torch.randn(q_len, 8, 8, generator=g)
        args = (q, k_cache, v_cache, table, torch.tensor([context], dtype=torch.int32),
                torch.tensor([0, q_len], dtype=torch.int32), q_len, 8**-0.5)
        calls[name] = (args, bound)
    times: dict[str, list[int]] = {n: [] for n in cases}
    try:
        for i in range(runs + 30):
            for name, (args, bound) in calls.items():
                cpu_attention.SHORT_QUERY_TOKENS = bound
                c0 = time.thread_time_ns()
                cpu_attention.paged_attention(*args)
                if i >= 30:
                    times[name].append(time.thread_time_ns() - c0)
    finally:
        cpu_attention.SHORT_QUERY_TOKENS = short
    return {n: statistics.median(v) / 1e3 for n, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.load.spec_step", description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=100, help="tokens of the sequence before the step")
    p.add_argument("--runs", type=int, default=2000, help="calls of each kind")
    p.add_argument("--k", default="1,4", help="draft counts of the verify items")
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    ks = [int(x) for x in a.k.split(",")]
    steps = step_times(a.context, ks, a.runs)
    d_cpu, d_wall = steps["decode"]
    print(f"stories260k EngineCore.step, context {a.context}, 1 torch thread, {a.runs} alternating calls each")
    print(f"{'step':10} {'cpu us':>8} {'x decode':>9} {'wall us':>8} {'x decode':>9}")
    for name, (c, w) in steps.items():
        print(f"{name:10} {c:8.1f} {c / d_cpu:9.3f} {w:8.1f} {w / d_wall:9.3f}")
    att = attention_times(a.context, ks, a.runs)
    print(f"\none layer's paged_attention (8 query / 4 KV heads, head_dim 8), context {a.context}")
    for name, c in att.items():
        print(f"{name:28} {c:8.1f} us cpu")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
