"""The node's own (host) overhead per decode step, under streaming load (issue 11).

    python -m bench.load.host_overhead [--quick] [--layouts thread,process] [--duration S] [--json PATH]
                                  [--models zero,...] [--baseline DIR [--pairs N]]
                                  [--api-processes 1,2] [--concurrency 256]

Starts ``shiftnode serve`` subprocesses (:class:`bench.load.node_process.NodeServer`) for each model and
device setup and drives closed-loop streaming load: ``c`` client tasks each send
``POST /v1/completions`` (``stream``, ``ignore_eos``, ``max_tokens`` fixed, ``return_token_ids`` so
tokens are counted per chunk) back to back. Models: ``--benchmark-model zero`` (no compute),
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
* ``cli%``: the client's own CPU use in the interval (100 = one core): near 100 the client limits.

``--baseline DIR`` runs every node of the grid from another checkout as well (``git worktree add
/tmp/base <rev>``), ``--pairs`` times each, alternating with this one, and prints per grid point
this tree's ratio to the baseline run of the same round (node CPU per token, tok/s), each round's and
their median: an old-against-new comparison measured side by side in one run.

``--api-processes 1,2`` runs every node of the grid with each value, alternating per round
(``--pairs``), and prints per grid point the control process's CPU per token against the one-process
node's and the whole node's (issue 31: the control loop at 5 us per token or less, the whole node no
higher than one process). ``--concurrency`` keeps only the grid points of those client counts.

Targets (issue 11) are checked beside the figures: zero, one device, c=256: >= 30k tok/s; sleep:5 at
256 sequences per device: >= 95 % of 200 steps/s per device; two devices >= 1.6x one device (same
model, mode, sampling, 256 sequences per device); stories260k at c=1: ITL - runner step <= 1 ms;
llama3-vocab at c=256: t0.8 / top-p 0.95 <= 1.2x greedy ms per step; (issue 31) stories-c at c=1: ITL p50
<= 0.8 ms.

The client runs on the same machine as the node (uvloop + aiohttp, one process): on a small machine
its own CPU use is part of what the figures show.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from bench.load.host_compare import _cpu_by_role, _ok, against_baseline, api_against_single, sampled_vs_greedy, scaling
from bench.load.runner_step import engine_threads, runner_steps, table as runner_table
from bench.load.node_process import NodeServer, NodeUnavailable

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("SHIFTNODE_SHARED", REPO.parent / "shared"))
STORIES = SHARED / "models" / "stories260k"
SLEEP_MS = 5.0
_IDS = re.compile(rb'"token_ids":\s*\[([^\]]*)\]')
SAMPLING = {"greedy": {"temperature": 0.0}, "t0.8": {"temperature": 0.8, "top_p": 0.95}}
MODELS = {"zero": ["--benchmark-model", "zero"], "sleep:5": ["--benchmark-model", f"sleep:{SLEEP_MS:g}"],
          "stories": [], "stories-c": ["--compile", "inductor"], "llama3-vocab": ["--load-format", "dummy"]}
LLAMA3_VOCAB = 128256
"""``llama3-vocab``: stories260k's geometry and tokenizer with Llama-3's vocabulary, dummy weights (a real
forward; the LM head and the sampler work on 128,256 logits per row). Ids past the tokenizer's 512
decode to nothing: the text is empty, the token counts are real."""
SETUPS = {"1 ts": ["--devices", "cpu:0"], "1 col": ["--devices", "cpu:0", "--mode", "colocated"],
          "2 ts": ["--devices", "cpu:0,cpu:1"], "2 col": ["--devices", "cpu:0,cpu:1", "--mode", "colocated"]}


@dataclass
class Cell:
    """One measured load point. Times in seconds unless the name says ms."""

    layout: str
    model: str
    setup: str
    concurrency: int
    sampling: str
    wall_s: float = 0.0
    tokens: int = 0
    steps: list[int] = field(default_factory=list)  # per device, in the interval
    gap_s: float = 0.0  # sum of in-request chunk gaps in the interval
    gap_tokens: int = 0  # tokens of the chunks those gaps end at
    gaps: list[float] = field(default_factory=list, repr=False)  # each in-request gap / its chunk's tokens (s)
    startup_s: float | None = None  # the node's start-up (launch to healthy), compilation included
    requests: int = 0
    client_cpu_s: float = 0.0  # this (client) process's CPU time in the interval
    node_cpu_s: float = 0.0  # the node (control) process's CPU time (user + system, all threads) in the interval
    engine_cpu_s: float = 0.0  # its engine processes' CPU time in the interval
    api_cpu_s: float = 0.0  # its API front-end processes' CPU time (--api-processes > 1) in the interval
    api_processes: int = 1  # the node's --api-processes
    tree: str = "this"  # which checkout ran the node: "this" or "baseline" (--baseline)
    pair: int = 0  # with --baseline: which of the --pairs rounds
    errors: int = 0
    error: str | None = None  # the node did not start (or the cell failed), why

    @property
    def devices(self) -> int:
        return int(self.setup.split()[0])

    def tok_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0

    def ms_per_step(self) -> float | None:
        per = [self.wall_s * 1e3 / s for s in self.steps if s]
        return statistics.mean(per) if per else None

    def itl_ms(self) -> float | None:
        return self.gap_s * 1e3 / self.gap_tokens if self.gap_tokens else None

    def itl_p50_ms(self) -> float | None:
        return statistics.median(self.gaps) * 1e3 if self.gaps else None

    def node_us_per_token(self) -> float | None:
        return self.node_cpu_s * 1e6 / self.tokens if self.tokens else None

    def engine_us_per_token(self) -> float | None:
        return self.engine_cpu_s * 1e6 / self.tokens if self.tokens else None

    def api_us_per_token(self) -> float | None:
        return self.api_cpu_s * 1e6 / self.tokens if self.tokens else None

    def total_us_per_token(self) -> float | None:
        """The whole node's CPU per streamed token: control process, front ends and engines."""
        return (self.node_cpu_s + self.api_cpu_s + self.engine_cpu_s) * 1e6 / self.tokens if self.tokens else None


# --- the client ------------------------------------------------------------------------------------
class Load:
    """``c`` closed-loop streaming clients; counts tokens whose chunk arrives inside ``[t_a, t_b]``."""

    def __init__(self, url: str, body: dict, concurrency: int, vocab: int, seed: int = 0, pid: int | None = None):
        self.url, self.body, self.c = url, body, concurrency
        self.pid = pid  # the node's process: its and its children's CPU time are read at both ends
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.t_a = self.t_b = float("inf")
        self.cell: Cell | None = None
        self.stop = False

    def _window(self, t: float) -> bool:
        return self.t_a <= t <= self.t_b

    async def _one(self, session: aiohttp.ClientSession) -> None:
        body = {**self.body, "prompt": [1] + [self.rng.randrange(3, self.vocab) for _ in range(7)]}
        cell, last = self.cell, None
        async with session.post(self.url + "/v1/completions", json=body) as r:
            if r.status != 200:
                cell.errors += 1
                cell.error = cell.error or f"HTTP {r.status}: {(await r.text())[:160]}"
                await asyncio.sleep(0.05)
                return
            async for line in r.content:
                m = _IDS.search(line)
                if not m:
                    continue
                n = m.group(1).count(b",") + 1 if m.group(1).strip() else 0
                now = time.perf_counter()
                if n and self._window(now):
                    cell.tokens += n
                    if last is not None and self._window(last):
                        cell.gap_s += now - last
                        cell.gap_tokens += n
                        if len(cell.gaps) < 100_000:
                            cell.gaps.append((now - last) / n)
                last = now if n else last
        if self._window(time.perf_counter()):
            cell.requests += 1

    async def _worker(self, session: aiohttp.ClientSession) -> None:
        while not self.stop:
            try:
                await self._one(session)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                self.cell.errors += 1
                self.cell.error = self.cell.error or f"{type(e).__name__}: {e}"
                await asyncio.sleep(0.05)

    async def run(self, cell: Cell, warmup_s: float, duration_s: float) -> None:
        self.cell = cell
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as s:
            workers = [asyncio.create_task(self._worker(s)) for _ in range(self.c)]
            await asyncio.sleep(warmup_s)
            before, self.t_a = await _steps(s, self.url)
            cpu0, node0 = time.process_time(), _cpu_by_role(self.pid)
            await asyncio.sleep(duration_s)
            cell.client_cpu_s = time.process_time() - cpu0
            node1 = _cpu_by_role(self.pid)
            cell.node_cpu_s, cell.api_cpu_s, cell.engine_cpu_s = (b - a for a, b in zip(node0, node1))
            after, self.t_b = await _steps(s, self.url)
            self.stop = True
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
        cell.wall_s = self.t_b - self.t_a
        cell.steps = [b - a for a, b in zip(before, after)]


async def _steps(session: aiohttp.ClientSession, url: str) -> tuple[list[int], float]:
    """Each device's ``steps`` from ``GET /v1/node``, and the midpoint of the read (perf_counter s)."""
    t0 = time.perf_counter()
    async with session.get(url + "/v1/node") as r:
        st = await r.json()
    return [d["steps"] for d in st["devices"]], (t0 + time.perf_counter()) / 2


# --- the grid ----------------------------------------------------------------------------------------
def grid(quick: bool) -> dict[tuple[str, str], list[tuple[int, str]]]:
    """``(model, setup) -> [(concurrency, sampling), ...]``; a node is started per key (and layout)."""
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


def run_grid(args: argparse.Namespace, log_dir: Path) -> list[Cell]:
    """Every grid point for each layout; with ``--baseline``, each node runs ``--pairs`` times for each
    checkout, alternating (baseline first), so both see the same phases of a noisy machine."""
    cells, t0 = [], time.monotonic()
    trees = [("baseline", args.baseline), ("this", None)] if args.baseline else [("this", None)]
    base_api = bool(args.baseline) and "--api-processes" in (Path(args.baseline) / "node" / "cli.py").read_text()
    for layout in args.layouts:
        for (model, setup), points in grid(args.quick).items():
            if args.models and model not in args.models:
                continue
            points = [pt for pt in points if not args.concurrency or pt[0] in args.concurrency]
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
                    log_path = log_dir / f"{tree}-{pair}-{layout}-api{api}-{model.replace(':', '')}-{setup.replace(' ', '')}.log"
                    api_flags = ["--api-processes", str(api)] if tree == "this" or base_api else []
                    print(f"# {time.monotonic() - t0:5.0f} s  {tree} {layout} {model} {setup}: {' '.join(flags + api_flags)}",
                          file=sys.stderr, flush=True)
                    try:
                        with NodeServer(flags + api_flags, log_path=log_path, repo=repo,
                                        startup_timeout_s=900 if "--compile" in flags else 120) as node:
                            for c, sampling in points:
                                cell = Cell(layout, model, setup, c, sampling, tree=tree, pair=pair, api_processes=api,
                                            startup_s=node.startup_s)
                                body = {"max_tokens": args.max_tokens, "ignore_eos": True, "stream": True,
                                        "return_token_ids": True, **SAMPLING[sampling]}
                                try:
                                    asyncio.run(Load(node.url, body, c, vocab=512, pid=node.proc.pid).run(
                                        cell, args.warmup, args.duration))
                                except Exception as e:  # noqa: BLE001 - one bad cell must not lose the table
                                    cell.error = f"{type(e).__name__}: {e}"
                                cells.append(cell)
                                if not node.alive():
                                    raise NodeUnavailable(f"node exited: {node.log_tail(2)}")
                    except NodeUnavailable as e:
                        cells.append(Cell(layout, model, setup, 0, "-", tree=tree, pair=pair, api_processes=api,
                                          error=str(e)[:300]))
    return cells


def table(cells: list[Cell], runner_ms: float | None) -> str:
    head = (f"{'tree':8} {'layout':8} {'api':>3} {'model':8} {'devs':6} {'c':>4} {'sampling':8} {'tok/s':>8} {'steps/s':>8} "
            f"{'ms/step':>8} {'host ms':>8} {'wait':>6} {'ITL ms':>7} {'p50':>6} {'node us/tok':>11} {'api us/tok':>10} "
            f"{'eng us/tok':>10} {'all us/tok':>10} {'cli%':>5} {'start s':>7} {'err':>4}  target")
    rows = [head, "-" * len(head)]
    for x in cells:
        if x.wall_s == 0:
            rows.append(f"{x.tree:8} {x.layout:8} {x.api_processes:>3} {x.model:8} {x.setup:6} {x.concurrency:>4} "
                        f"{x.sampling:8} ERROR: {x.error}")
            continue
        ms = x.ms_per_step()
        runner = {"zero": 0.0, "sleep:5": SLEEP_MS}.get(x.model, _runner_ms(runner_ms, x))
        host = ms - runner if ms is not None and runner is not None else None
        wait = (statistics.mean(1 - s * SLEEP_MS / 1e3 / x.wall_s for s in x.steps)
                if x.model == "sleep:5" and x.steps else None)
        rows.append(f"{x.tree:8} {x.layout:8} {x.api_processes:>3} {x.model:8} {x.setup:6} {x.concurrency:>4} {x.sampling:8} "
                    f"{x.tok_s():8.0f} {sum(x.steps) / x.wall_s:8.1f} {_f(ms, 8, 2)} {_f(host, 8, 2)} {_f(wait, 6, 3)} "
                    f"{_f(x.itl_ms(), 7, 2)} {_f(x.itl_p50_ms(), 6, 2)} {_f(x.node_us_per_token(), 11, 1)} "
                    f"{_f(x.api_us_per_token(), 10, 1)} {_f(x.engine_us_per_token(), 10, 1)} "
                    f"{_f(x.total_us_per_token(), 10, 1)} {100 * x.client_cpu_s / x.wall_s:5.0f} "
                    f"{_f(x.startup_s, 7, 1)} {x.errors:>4}  {target(x, runner_ms)}"
                    + (f"  [{x.error[:80]}]" if x.error else ""))
    rows += scaling(cells) + sampled_vs_greedy(cells) + against_baseline(cells) + api_against_single(cells)
    return "\n".join(rows)


def _runner_ms(runner_ms: dict | None, x: Cell) -> float | None:
    """The in-process runner step of a stories cell's mode and batch (c = batch on one device), if measured."""
    mode = "inductor" if x.model == "stories-c" else "none"
    return (runner_ms or {}).get((mode, x.concurrency)) if x.devices == 1 else None


def target(x: Cell, runner_ms: dict | None) -> str:
    per_dev = x.concurrency // x.devices
    if x.model == "zero" and x.devices == 1 and x.concurrency == 256:
        return f">=30000 tok/s: {_ok(x.tok_s() >= 30000)}"
    if x.model == "sleep:5" and per_dev == 256:
        rate = min(x.steps) / x.wall_s
        return f">=190 steps/s/dev: {_ok(rate >= 190)} ({rate:.0f})"
    if x.model == "stories-c" and x.concurrency == 1 and x.itl_p50_ms() is not None:
        return f"ITL p50 <=0.8 ms: {_ok(x.itl_p50_ms() <= 0.8)}"
    step = _runner_ms(runner_ms, x)
    if x.model == "stories" and x.concurrency == 1 and step is not None and x.itl_ms() is not None:
        extra = x.itl_ms() - step
        return f"ITL-runner <=1 ms: {_ok(extra <= 1.0)} ({extra:.2f})"
    return ""


def _f(v: float | None, width: int, digits: int) -> str:
    return f"{v:{width}.{digits}f}" if v is not None else f"{'-':>{width}}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.load.host_overhead", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a reduced grid (about 2-3 minutes)")
    p.add_argument("--layouts", default="thread,process", help="comma-separated --engine-layout values to run")
    p.add_argument("--engine-layout", default=None, help="run this one layout (overrides --layouts)")
    p.add_argument("--duration", type=float, default=None, help="measured seconds per cell (default 2 quick, 6)")
    p.add_argument("--warmup", type=float, default=None, help="seconds of load before measuring (default 1 quick, 2)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per request (ignore_eos)")
    p.add_argument("--json", default=None, help="write the cells as JSON here")
    p.add_argument("--log-dir", default=None, help="node logs (default: a temporary folder)")
    p.add_argument("--baseline", default=None, metavar="DIR",
                   help="another checkout (e.g. 'git worktree add /tmp/base <rev>') whose node runs every grid point "
                        "too, alternating with this one")
    p.add_argument("--pairs", type=int, default=3, help="with --baseline or several --api-processes: rounds of each "
                   "node (default 3)")
    p.add_argument("--concurrency", default=None, help="only grid points of these client counts, comma-separated")
    p.add_argument("--api-processes", default="1", help="comma-separated --api-processes values: each grid node runs "
                   "with each, alternating per round (default 1)")
    p.add_argument("--models", default=None, help=f"only these models of the grid, comma-separated ({', '.join(MODELS)})")
    a = p.parse_args(argv)
    a.models = [m.strip() for m in a.models.split(",")] if a.models else None
    a.api_processes = [int(x) for x in a.api_processes.split(",") if x.strip()]
    a.concurrency = [int(x) for x in a.concurrency.split(",")] if a.concurrency else None
    if a.models and not set(a.models) <= set(MODELS):
        p.error(f"--models: one of {', '.join(MODELS)}")
    if a.pairs < 1:
        p.error("--pairs must be at least 1")
    if a.baseline and not (Path(a.baseline) / "node" / "cli.py").is_file():
        p.error(f"--baseline {a.baseline}: not a shiftnode checkout (no node/cli.py)")
    a.layouts = [a.engine_layout] if a.engine_layout else [x.strip() for x in a.layouts.split(",") if x.strip()]
    a.duration = a.duration or (2.0 if a.quick else 6.0)
    a.warmup = a.warmup or (1.0 if a.quick else 2.0)
    if not (STORIES / "model.safetensors").is_file():
        print(f"stories260k not found at {STORIES} (set SHIFTNODE_SHARED)", file=sys.stderr)
        return 2
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    import torch

    torch.set_num_threads(engine_threads())  # as a one-device node's engine process runs its steps
    steps = runner_steps(STORIES, 8 + a.max_tokens // 2, [1, 64], ["none", "inductor"], rounds=3)
    runner_ms = steps["step_ms"]  # the compiled runner's build also fills inductor's cache for the nodes
    log_dir = Path(a.log_dir or tempfile.mkdtemp(prefix="host_overhead-"))
    t0 = time.monotonic()
    cells = run_grid(a, log_dir)
    print(f"host overhead: {a.max_tokens} tokens/request, {a.warmup:g} s warm-up + {a.duration:g} s measured per cell, "
          f"{os.cpu_count()} CPUs; node logs in {log_dir}; {time.monotonic() - t0:.0f} s")
    print("stories260k runner decode step (in-process, ModelRunner.execute; stories-c = --compile inductor, "
          "build s = start-up with compilation):")
    print(runner_table(steps, [1, 64]))
    print(table(cells, runner_ms))
    if a.json:
        Path(a.json).write_text(json.dumps({"runner_ms": {f"{m} B={b}": v for (m, b), v in runner_ms.items()},
                                            "build_s": steps["build_s"],
                                            "cells": [asdict(c) | {"gaps": None} for c in cells]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
