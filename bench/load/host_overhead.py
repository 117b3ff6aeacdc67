"""The node's own (host) overhead per decode step, under streaming load (issue 11).

    python -m bench.load.host_overhead [--quick | --scaling] [--layouts thread,process] [--duration S] [--json PATH]
                                  [--models zero,...] [--baseline DIR [--pairs N]]
                                  [--api-processes 1,2] [--concurrency 256] [--client-processes K|auto]
                                  [--time-limit S]

Starts ``shiftnode serve`` subprocesses (:class:`bench.load.node_process.NodeServer`) for each model and
device setup and drives closed-loop streaming load (:mod:`bench.load.stream_client`): ``c`` client tasks
each send ``POST /v1/completions`` (``stream``, ``ignore_eos``, ``max_tokens`` fixed,
``return_token_ids`` so tokens are counted per chunk) back to back, split over ``--client-processes``
processes (default 1; ``auto``: a quarter of the cores, 1 to 8). Models: ``--benchmark-model zero`` (no compute),
``--benchmark-model sleep:5`` (each step sleeps 5 ms), stories260k's real weights (``stories``, eager
steps, and ``stories-c``, ``--compile inductor``), and
``llama3-vocab`` (stories260k's geometry with Llama-3's 128,256-token vocabulary, dummy weights: the
sampler's case, at c=256 only); the benchmark models use stories260k's config and tokenizer, so
detokenization is the same. Setups: one device and
two (``--devices cpu:0,cpu:1``), time-shared (default) and ``--mode colocated``; greedy, and
temperature 0.8 / top_p 0.95. Each ``--layouts`` entry is passed as ``--engine-layout`` (a node that
refuses it gives an error row).

The full grid is every model x setup x concurrency 1, 64, 256 (and 512 = 256 per device on two
devices) x sampling. ``--quick`` (3–4 minutes on 2 CPUs, both layouts): zero on 1 and 2 devices
colocated (c=1, 256 greedy and t0.8; 512), sleep:5 likewise at 256 per device, stories and
stories-c at c=1 and 64, llama3-vocab at 256 greedy and t0.8.

Per cell, after ``--warmup`` seconds, the measured interval of ``--duration`` seconds is bounded by two
``GET /v1/node`` reads (each device's ``steps``). Columns (one table, all cells of the run):

* ``tok/s``: streamed tokens the client received in the interval / its wall time (whole node).
* ``steps/s``: steps of all devices / wall. ``ms/step``: wall / steps, per device, averaged over
  devices (each device runs its steps one after another: this is the critical path).
* ``host ms``: ``ms/step`` minus the runner's own step time: 0 for zero (its runner work is the
  sampler only), 5 for sleep:5, and for stories/stories-c on one device at c=1 and 64 the runner's
  decode step at that batch, eager or compiled, measured in this process before the nodes start
  (:mod:`bench.load.runner_step`, the table in the header, with each runner's build time: the compiled
  one's is its compilation, which also fills inductor's on-disk cache the nodes then load from).
* ``wait``: sleep:5 only, the share of wall time a device waits for the host: ``1 - steps*5ms/wall``.
* ``ITL ms``: mean gap between a request's token chunks, per token, as the client sees it; ``p50``
  its median. ``start s``: the node's start-up, launch to healthy (compilation included).
* ``node us/tok``, ``api us/tok``, ``eng us/tok``, ``all us/tok``: CPU time (user + system, ``/proc``)
  of the node's control process, of its API front ends (``--api-processes`` > 1, children named
  ``shiftnode-api-N``), of its engine processes, and of all of them, in the interval, per streamed
  token. On a shared machine whose speed drifts this is
  steadier than tok/s, and it says what the node's own path costs whatever CPU it was given.
* ``cli%``: the client processes' CPU use in the interval, summed (100 = one core), ``K`` of them: near
  ``100 * K`` the clients limit (the JSON has the busiest one's too, ``client_cpu_max_s``).

``--baseline DIR`` runs every node of the grid from another checkout as well (``git worktree add
/tmp/base <rev>``), ``--pairs`` times each, alternating with this one, and prints per grid point
this tree's ratio to the baseline run of the same round (node CPU per token, tok/s), each round's and
their median: an old-against-new comparison measured side by side in one run.

``--api-processes 1,2`` runs every node of the grid with each value, alternating per round
(``--pairs``), and prints per grid point the control process's CPU per token against the one-process
node's and the whole node's (issue 31: the control loop at 5 us per token or less, the whole node no
higher than one process), and per grid point tok/s at each value as a fraction of linear, ``tok/s(N) /
(N x tok/s(1))``. ``--concurrency`` keeps only the grid points of those client counts.

``--scaling`` (issue 31) is one grid point only: zero, one device, colocated, ``--engine-layout process``,
greedy and t0.8 at c=1024 (or ``--concurrency``), each node with ``--api-processes 1,2,4,8`` (or the
given values), ``--pairs 1``, ``--client-processes auto``, 2 s warm-up + 5 s measured per cell, and
``--time-limit 150``: a node whose cells (estimated at warm-up + measured + 1.5 s each) would end past
it is not started but an error row, so the run ends near the limit at worst (a node's start-up is
capped by what is left; about 90 s in all where every node starts in a few seconds). Its summary lines give tok/s per value, the fraction of linear (target:
>= 0.7 up to 4) and the control loop's CPU per token (target: <= 5 us, greedy and sampled). The table and
the JSON (rewritten after every cell) come out whatever fails: a node that does not start or a cell that
fails is an error row; SIGTERM (``timeout``) stops the nodes and prints what was measured.

Targets (issue 11) are checked beside the figures: zero, one device, c=256: >= 30k tok/s; sleep:5 at
256 sequences per device: >= 95 % of 200 steps/s per device; two devices >= 1.6x one device (same
model, mode, sampling, 256 sequences per device); stories260k at c=1: ITL - runner step <= 1 ms;
llama3-vocab at c=256: t0.8 / top-p 0.95 <= 1.2x greedy ms per step; (issue 31) stories-c at c=1: ITL p50
<= 0.8 ms.

The clients run on the same machine as the node (uvloop + aiohttp): on a small machine their own CPU
use is part of what the figures show; with too few client processes for the node's speed they limit it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from bench.load.host_cells import HEAD, SLEEP_MS, Cell, row
from bench.load.host_compare import (against_baseline, api_against_single, api_scaling, api_scaling_rows,
                                     sampled_vs_greedy, scaling)
from bench.load.runner_step import engine_threads, runner_steps, table as runner_table
from bench.load.node_process import NodeServer, NodeUnavailable
from bench.load.stream_client import auto_processes, run_load
from bench.traffic.workload import shared_dir
from node.config import usable_cores

REPO = Path(__file__).resolve().parents[2]
STORIES = shared_dir() / "models" / "stories260k"
SAMPLING = {"greedy": {"temperature": 0.0}, "t0.8": {"temperature": 0.8, "top_p": 0.95}}
MODELS = {"zero": ["--benchmark-model", "zero"], "sleep:5": ["--benchmark-model", f"sleep:{SLEEP_MS:g}"],
          "stories": ["--compile", "none"], "stories-c": ["--compile", "inductor"], "llama3-vocab": ["--load-format", "dummy"]}
LLAMA3_VOCAB = 128256
"""``llama3-vocab``: stories260k's geometry and tokenizer with Llama-3's vocabulary, dummy weights (a real
forward; the LM head and the sampler work on 128,256 logits per row). Ids past the tokenizer's 512
decode to nothing: the text is empty, the token counts are real."""
CELL_OVERHEAD_S = 1.5
"""Seconds a cell takes beyond its warm-up and measured time (client processes started, streams ended),
for ``--time-limit``'s estimate of whether a node's cells still fit."""
SETUPS = {"1 ts": ["--devices", "cpu:0"], "1 col": ["--devices", "cpu:0", "--mode", "colocated"],
          "2 ts": ["--devices", "cpu:0,cpu:1"], "2 col": ["--devices", "cpu:0,cpu:1", "--mode", "colocated"]}


# --- the grid ----------------------------------------------------------------------------------------
def grid(quick: bool, scaling_c: list[int] | None = None) -> dict[tuple[str, str], list[tuple[int, str]]]:
    """``(model, setup) -> [(concurrency, sampling), ...]``; a node is started per key (and layout).
    ``scaling_c`` (``--scaling``): zero, one device, colocated, at those client counts, greedy and t0.8."""
    if scaling_c:
        return {("zero", "1 col"): [(c, s) for c in scaling_c for s in SAMPLING]}
    if quick:
        return {("zero", "1 col"): [(1, "greedy"), (256, "greedy"), (256, "t0.8")],
                ("zero", "2 col"): [(512, "greedy")],
                ("sleep:5", "1 col"): [(256, "greedy")],
                ("sleep:5", "2 col"): [(512, "greedy")],
                ("stories", "1 ts"): [(1, "greedy"), (64, "greedy")],
                ("stories-c", "1 ts"): [(1, "greedy"), (64, "greedy")],
                ("llama3-vocab", "1 col"): [(256, "greedy"), (256, "t0.8")]}
    out = {("llama3-vocab", "1 col"): [(256, s) for s in SAMPLING]}  # what it is for: the sampler at 128k
    for model in (m for m in MODELS if m != "llama3-vocab"):
        for setup in SETUPS:
            cs = [1, 64, 256] + ([512] if setup.startswith("2") else [])
            out[(model, setup)] = [(c, s) for c in cs for s in SAMPLING]
    return out


def llama3_vocab_model(root: Path) -> Path:
    """A model folder under ``root``: stories260k's config with ``vocab_size`` = Llama-3's, its tokenizer
    files, no weights (served with ``--load-format dummy``)."""
    folder = root / "llama3-vocab-model"
    folder.mkdir(exist_ok=True)
    cfg = json.loads((STORIES / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {"vocab_size": LLAMA3_VOCAB}, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (STORIES / name).is_file():
            (folder / name).write_bytes((STORIES / name).read_bytes())
    return folder


def run_grid(args: argparse.Namespace, log_dir: Path, done=lambda cells: None) -> list[Cell]:
    """Every grid point for each layout; with ``--baseline``, each node runs ``--pairs`` times for each
    checkout, alternating (baseline first), so both see the same phases of a noisy machine. ``done(cells)``
    runs after each cell (the JSON so far); past ``--time-limit`` the nodes left become error rows."""
    cells, t0 = [], time.monotonic()
    trees = [("baseline", args.baseline), ("this", None)] if args.baseline else [("this", None)]
    base_api = bool(args.baseline) and "--api-processes" in (Path(args.baseline) / "node" / "cli.py").read_text()
    for layout in args.layouts:
        for (model, setup), points in grid(args.quick, args.scaling_c).items():
            if args.models and model not in args.models:
                continue
            points = [pt for pt in points if args.scaling_c or not args.concurrency or pt[0] in args.concurrency]
            if not points:
                continue
            folder = llama3_vocab_model(log_dir) if model == "llama3-vocab" else STORIES
            flags = ["--model", str(folder), *MODELS[model], *SETUPS[setup], "--engine-layout", layout]
            # --api-processes values other than 1 run on a baseline too where it has the flag (an older one lacks it)
            runs = [(tree, repo, 1) for tree, repo in trees] + [(tree, repo, n) for n in args.api_processes if n != 1
                                                                for tree, repo in trees if tree == "this" or base_api]
            if 1 not in args.api_processes:
                runs = [r for r in runs if r[2] != 1]
            for pair in range(args.pairs if args.baseline or len(runs) > 1 else 1):
                for tree, repo, api in runs:
                    tags = dict(tree=tree, pair=pair, api_processes=api, client_processes=args.client_processes)
                    left = args.time_limit - (time.monotonic() - t0) if args.time_limit else None
                    need = len(points) * (args.warmup + args.duration + CELL_OVERHEAD_S)  # the node's cells, start aside
                    if left is not None and left < need + 5:
                        cells.append(Cell(layout, model, setup, 0, "-", **tags, error="skipped: --time-limit reached"))
                        done(cells)
                        continue
                    log_path = log_dir / f"{tree}-{pair}-{layout}-api{api}-{model.replace(':', '')}-{setup.replace(' ', '')}.log"
                    api_flags = ["--api-processes", str(api)] if tree == "this" or base_api else []
                    print(f"# {time.monotonic() - t0:5.0f} s  {tree} {layout} {model} {setup}: {' '.join(flags + api_flags)}",
                          file=sys.stderr, flush=True)
                    timeout = 900 if "--compile" in flags else args.startup_timeout
                    try:
                        with NodeServer(flags + api_flags, log_path=log_path, repo=repo,
                                        startup_timeout_s=min(timeout, left - need) if left is not None else timeout) as node:
                            node.wait_compiled(timeout)  # buckets compiling in the background: measured once compiled
                            for c, sampling in points:
                                cells.append(_measure(args, node, Cell(layout, model, setup, c, sampling, **tags,
                                                                       startup_s=node.startup_s)))
                                print(f"#   {row(cells[-1], None)}", file=sys.stderr, flush=True)
                                done(cells)
                                if not node.alive():
                                    raise NodeUnavailable(f"node exited: {node.log_tail(2)}")
                    except NodeUnavailable as e:
                        cells.append(Cell(layout, model, setup, 0, "-", **tags, error=str(e)[:300]))
                        done(cells)
    return cells


def _measure(args: argparse.Namespace, node: NodeServer, cell: Cell) -> Cell:
    """One grid point against a running node (:func:`bench.load.stream_client.run_load`), into ``cell``;
    a failure becomes the cell's error."""
    body = {"max_tokens": args.max_tokens, "ignore_eos": True, "stream": True, "return_token_ids": True,
            **SAMPLING[cell.sampling]}
    try:
        r = run_load(node.url, body, cell.concurrency, processes=args.client_processes, warmup_s=args.warmup,
                     duration_s=args.duration, node_pid=node.proc.pid, vocab=512)
    except Exception as e:  # noqa: BLE001 - one bad cell must not lose the table
        cell.error = f"{type(e).__name__}: {e}"
        return cell
    k = r.counts
    cell.wall_s, cell.steps, (cell.node_cpu_s, cell.api_cpu_s, cell.engine_cpu_s) = r.wall_s, r.steps, r.cpu
    cell.steps_wall_s, cell.node_read_s = r.steps_wall_s, r.read_s
    cell.tokens, cell.gap_s, cell.gap_tokens, cell.gaps, cell.requests = k.tokens, k.gap_s, k.gap_tokens, k.gaps, k.requests
    cell.client_cpu_s, cell.client_cpu_max_s, cell.client_processes = k.cpu_s, k.cpu_max_s, k.processes
    cell.errors, cell.error = k.errors, k.error
    return cell


def table(cells: list[Cell], runner_ms: dict | None) -> str:
    """Every cell's row, then the summary lines that pair cells (:mod:`bench.load.host_compare`)."""
    rows = [HEAD, "-" * len(HEAD), *(row(x, runner_ms) for x in cells)]
    rows += (scaling(cells) + sampled_vs_greedy(cells) + against_baseline(cells) + api_against_single(cells)
             + api_scaling(cells))
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.load.host_overhead", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a reduced grid (about 2-3 minutes)")
    p.add_argument("--scaling", action="store_true", help="issue 31's grid point: zero, one device, colocated, "
                   "greedy and t0.8 at --concurrency (default 1024), --api-processes 1,2,4,8, --client-processes auto, "
                   "--pairs 1, --engine-layout process, --time-limit 150 unless given")
    p.add_argument("--layouts", default=None, help="comma-separated --engine-layout values to run (default thread,process)")
    p.add_argument("--engine-layout", default=None, help="run this one layout (overrides --layouts)")
    p.add_argument("--duration", type=float, default=None, help="measured seconds per cell (default 2 quick, 5 scaling, 6)")
    p.add_argument("--warmup", type=float, default=None, help="seconds of load before measuring (default 1 quick, 2)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per request (ignore_eos)")
    p.add_argument("--json", default=None, help="write the cells as JSON here (rewritten after every cell)")
    p.add_argument("--log-dir", default=None, help="node logs (default: a temporary folder)")
    p.add_argument("--baseline", default=None, metavar="DIR",
                   help="another checkout (e.g. 'git worktree add /tmp/base <rev>') whose node runs every grid point "
                        "too, alternating with this one")
    p.add_argument("--pairs", type=int, default=None, help="with --baseline or several --api-processes: rounds of each "
                   "node (default 3; 1 with --scaling)")
    p.add_argument("--concurrency", default=None, help="only grid points of these client counts, comma-separated "
                   "(with --scaling: the client counts to run)")
    p.add_argument("--api-processes", default=None, help="comma-separated --api-processes values: each grid node runs "
                   "with each, alternating per round (default 1; 1,2,4,8 with --scaling)")
    p.add_argument("--client-processes", default=None, help="load client processes the streams are split over, or "
                   f"'auto' (a quarter of the cores, 1-8: {auto_processes()} here); default 1 (auto with --scaling)")
    p.add_argument("--time-limit", type=float, default=None, help="seconds: a node whose cells would end past it is "
                   "not started (an error row) (default none; 150 with --scaling)")
    p.add_argument("--startup-timeout", type=float, default=120.0, help="seconds for a node to become healthy "
                   "(--compile nodes: 900)")
    p.add_argument("--models", default=None, help=f"only these models of the grid, comma-separated ({', '.join(MODELS)})")
    a = p.parse_args(argv)
    sc = a.scaling
    a.models = [m.strip() for m in a.models.split(",")] if a.models else (["zero"] if sc else None)
    a.api_processes = [int(x) for x in (a.api_processes or ("1,2,4,8" if sc else "1")).split(",") if x.strip()]
    a.concurrency = [int(x) for x in a.concurrency.split(",")] if a.concurrency else None
    a.scaling_c = (a.concurrency or [1024]) if sc else None
    cp = a.client_processes or ("auto" if sc else "1")
    a.client_processes = auto_processes() if cp == "auto" else int(cp) if cp.isdigit() and int(cp) >= 1 else None
    if a.client_processes is None:
        p.error("--client-processes: a positive number or 'auto'")
    if a.models and not set(a.models) <= set(MODELS):
        p.error(f"--models: one of {', '.join(MODELS)}")
    a.pairs = a.pairs or (1 if sc else 3)
    if a.pairs < 1:
        p.error("--pairs must be at least 1")
    if a.baseline and not (Path(a.baseline) / "node" / "cli.py").is_file():
        p.error(f"--baseline {a.baseline}: not a shiftnode checkout (no node/cli.py)")
    layouts = a.engine_layout or a.layouts or ("process" if sc else "thread,process")
    a.layouts = [x.strip() for x in layouts.split(",") if x.strip()]
    a.duration = a.duration or (2.0 if a.quick else 5.0 if sc else 6.0)
    a.warmup = a.warmup or (1.0 if a.quick else 2.0)
    a.time_limit = a.time_limit or (150.0 if sc else None)
    if not (STORIES / "config.json").is_file() or (not sc and not (STORIES / "model.safetensors").is_file()):
        print(f"stories260k not found at {STORIES} (set SHIFTNODE_SHARED)", file=sys.stderr)
        return 2
    _raise_open_files()  # 1,024 streams: a socket each in the client and in the node (children inherit the limit)
    signal.signal(signal.SIGTERM, _terminated)  # a `timeout` still stops the nodes and prints what was measured
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    steps = {"step_ms": {}, "build_s": {}}
    if any(m in (a.models or MODELS) for m in ("stories", "stories-c")):
        import torch

        torch.set_num_threads(engine_threads())  # as a one-device node's engine process runs its steps
        steps = runner_steps(STORIES, 8 + a.max_tokens // 2, [1, 64], ["none", "inductor"], rounds=3)
    runner_ms = steps["step_ms"]  # the compiled runner's build also fills inductor's cache for the nodes
    log_dir = Path(a.log_dir or tempfile.mkdtemp(prefix="host_overhead-"))
    t0, cells = time.monotonic(), []

    def done(so_far: list[Cell]) -> None:
        cells[:] = so_far
        if a.json:
            Path(a.json).write_text(json.dumps({
                "runner_ms": {f"{m} B={b}": v for (m, b), v in runner_ms.items()}, "build_s": steps["build_s"],
                "cpus": usable_cores(), "client_processes": a.client_processes, "api_scaling": api_scaling_rows(so_far),
                "cells": [asdict(c) | {"gaps": None} for c in so_far]}, indent=1))

    interrupted = False
    try:
        done(run_grid(a, log_dir, done))
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the nodes are stopped; what was measured is printed below
        interrupted = True
    finally:
        print(f"host overhead: {a.max_tokens} tokens/request, {a.warmup:g} s warm-up + {a.duration:g} s measured per "
              f"cell, {usable_cores()} CPUs, {a.client_processes} client process(es); node logs in {log_dir}; "
              f"{time.monotonic() - t0:.0f} s")
        if runner_ms:
            print("stories260k runner decode step (in-process, ModelRunner.execute; stories-c = --compile inductor, "
                  "build s = start-up with compilation):")
            print(runner_table(steps, [1, 64]))
        print(table(cells, runner_ms) + ("\ninterrupted: the cells above are all that was measured" if interrupted
                                         else ""), flush=True)
    return 130 if interrupted else 0


def _raise_open_files() -> None:
    """The soft limit on open files up to the hard one (a 1,024 default cannot hold 1,024 streams)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else max(soft, 65536), hard))


def _terminated(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


if __name__ == "__main__":
    sys.exit(main())
