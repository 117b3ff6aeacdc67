"""Compare serving modes on one workload over a sweep of request rates.

``python -m bench.studies.compare --modes time-shared,colocated,pooled --devices cpu:0,cpu:1
--model ../shared/models/stories260k --rates 2,4,8 --duration 20 --trace azure-conv --out DIR``

For each mode it starts a node (``python -m node.cli serve --mode MODE ...`` on a free port, plus
``--node-args`` and that mode's ``--mode-args``; pooled splits ``--devices`` into prefill and decode halves
unless its ``--mode-args`` name them; a mode the node refuses at start-up — it exits with an
error — is reported as *not available*, never skipped), and for each rate: waits until the node is idle, replays the workload
(:func:`bench.load.replay.replay`, the same requests for every mode), then reads ``GET /v1/node`` (the
devices' switch records: the role timeline) and ``/metrics`` (counters, as differences across the run:
``shiftnode_role_switches_total``, and ``shiftnode_kv_transfers_total`` when the node has it, else 0).
The node is always stopped (``try``/``finally``), and every run is bounded (``--duration`` of
arrivals, then ``--drain-timeout``).

``--prefix-caching on|off|both`` runs each mode with the node's prefix cache on (the default), off
(``--no-prefix-caching``; rows ``MODE-nocache``) or both, side by side; each row gives the prefix hit
rate (cached prompt tokens over prompt tokens, from every request's usage chunk) and p50/p90 TTFT.
With ``--tokens-per-hash`` (Mooncake traces) each row also gives, in brackets, the replayed workload's
own infinite-cache token hit ratio (:func:`bench.traffic.traces.infinite_cache_hit_ratio`) to compare with.

Written to ``--out`` (default ``bench/out/<UTC timestamp>/``): ``results.md`` (the table: mode, rate,
goodput, SLO attainment, p90 TTFT, p90 TPOT, switches, transfers), ``results.json``, per run
``<mode>_r<rate>.json`` (replay document plus node status and counter deltas), per mode ``node_<mode>.log``,
and the plots ``goodput_vs_rate.png``, ``ttft_cdf.png``, ``tpot_cdf.png``,
``timeline_<mode>_r<rate>.png``. CPU devices run with ``OMP_NUM_THREADS=1`` per node process unless
``--omp-threads`` says otherwise (one torch thread per emulated device keeps step times stable).

**Variants and interleaved rounds.** An entry ``MODE@N`` of ``--modes`` is ``MODE`` with
``--max-num-batched-tokens N`` (its own row label, so one run can hold a budget grid:
``--modes adaptive,colocated@64,colocated@256``); ``--mode-args`` apply by bare mode or by the whole entry.
``--rounds K`` (K > 1) starts every entry's node first and keeps them all up (an idle node takes no CPU),
then runs K rounds, each replaying every entry once per rate, the entries in turn (reversed on odd rounds,
so no entry always runs first): every entry sees the same phase of a shared machine's load. Round ``k``
replays the workload of ``--seed`` + ``k`` (the same requests for every entry of a round; new prompts each
round, so a prefix cache does not carry hits from one round into the next). Rows carry
their round (files ``<entry>_r<rate>_k<round>.json``); ``--baseline A[,B]`` adds a table of every other
entry's p90 TTFT and p90 ITL over each baseline's in the same round and rate, per round and their median.

**Fresh-instance pairs** (``--pairs N``, N >= 8 to decide anything; :mod:`bench.studies.paired`). Rounds
on kept nodes cannot separate a mode from its instance on a shared machine (one instance read 1.45x
worse in two rounds, the next 0.69x). With ``--pairs`` every pair starts a new node for each entry in
turn, replays that pair's workload (seed ``--seed`` + pair) on it and stops it before the next entry's
node starts (no idle node beside the measured one); the order of the entries alternates between pairs.
Rows carry the pair as their round, and ``--baseline`` gives each entry's p90 TTFT, p90 ITL and output
tokens/s over each baseline's as a median over the pairs with a bootstrap 95 % interval. Clients as they
are: ``--natural-eos`` (``max_tokens`` a cap, e.g. ``--lengths-from fixed:32:448``, EOS ends the
request) and ``--temperature`` (sampled, seeded per request).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
from contextlib import ExitStack
from datetime import datetime, timezone
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bench.load.host_compare import cpu_by_role
from bench.load.node_process import REPO, NodeServer, NodeUnavailable
from bench.load.replay import add_replay_args, fetch_server_info, replay, result_json
from bench.studies import plots
from bench.studies.paired import interval_table, pair_order
from bench.studies.timeline import switches_in
from bench.traffic.metrics import request_tpot_s
from bench.traffic.traces import infinite_cache_hit_ratio
from bench.traffic.workload import add_workload_args, build_workload, shared_dir, spec_from_args

__all__ = ["counters", "split_entry", "node_args", "markdown_table", "ratio_table", "run_pairs", "main"]

COUNTERS = ("shiftnode_role_switches_total", "shiftnode_kv_transfers_total")


def counters(metrics_text: str) -> dict[str, float]:
    """Totals of the :data:`COUNTERS` in a Prometheus text page (summed over labels; absent: 0)."""
    out = dict.fromkeys(COUNTERS, 0.0)
    for fam in text_string_to_metric_families(metrics_text):
        for s in fam.samples:
            if s.name in out:
                out[s.name] += s.value
    return out


def split_entry(entry: str) -> tuple[str, int | None]:
    """A ``--modes`` entry → ``(mode, token budget or None)``: ``"colocated@256"`` → ``("colocated", 256)``.

    Raises ValueError when the part after ``@`` is not a positive integer.
    """
    mode, at, budget = entry.partition("@")
    if not at:
        return mode, None
    if not budget.isdigit() or int(budget) < 1:
        raise ValueError(f"mode entry {entry!r}: the token budget after '@' must be a positive integer")
    return mode, int(budget)


def node_args(a: argparse.Namespace, entry: str) -> list[str]:
    """``shiftnode serve`` flags for one ``--modes`` entry (``MODE`` or ``MODE@BUDGET``, see :func:`split_entry`).

    Pooled mode takes no ``--devices``: unless its ``--mode-args`` name the pools, the first half of
    ``--devices`` (at least one) prefills and the rest decode, the simulator's default split. An entry's
    budget replaces ``--max-num-batched-tokens``; ``--mode-args`` keyed by the bare mode or the entry apply.
    """
    mode, budget = split_entry(entry)
    extra = [x for v in a.mode_args or [] if v.partition("=")[0] in (mode, entry)
             for x in shlex.split(v.partition("=")[2])]
    if mode != "pooled":
        devices = ["--devices", a.devices]
    elif any(x.split("=")[0] in ("--prefill-devices", "--decode-devices") for x in extra):
        devices = []
    else:
        devs = [d.strip() for d in a.devices.split(",") if d.strip()]
        k = max(1, len(devs) // 2)
        devices = ["--prefill-devices", ",".join(devs[:k]), "--decode-devices", ",".join(devs[k:]) or devs[0]]
    args = ["--mode", mode, *devices, "--ttft-slo-ms", str(a.ttft_slo_ms), "--tpot-slo-ms", str(a.tpot_slo_ms)]
    if a.config:
        cfg = Path(a.config)
        args += ["--model", str(cfg.parent if cfg.is_file() else cfg), "--load-format", "dummy"]
    elif a.model:
        args += ["--model", a.model, "--load-format", a.load_format]
    budget = budget if budget is not None else a.max_num_batched_tokens
    for flag, value in (("--reconfig-pause-ms", a.reconfig_pause_ms), ("--max-num-batched-tokens", budget)):
        if value is not None:
            args += [flag, str(value)]
    return args + shlex.split(a.node_args or "") + extra


def _fmt(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def _cpu_per_token(row: dict) -> str:
    """``control / engines`` CPU µs per output token of a run (control includes in-process API work and
    API front ends), or — without a reading (no ``/proc``, or no token out)."""
    cpu, tokens = row.get("cpu_s"), row["summary"].get("total_output_tokens")
    if not cpu or not tokens or not any(cpu.values()):
        return "—"
    return f"{(cpu['control'] + cpu['api']) * 1e6 / tokens:.0f} / {cpu['engines'] * 1e6 / tokens:.0f}"


def markdown_table(rows: list[dict]) -> str:
    """The comparison table; unavailable modes get one row saying so, with the reason below. Rows of an
    interleaved run (:func:`run_rounds`) give their round after the mode."""
    lines = ["| mode | rate (req/s) | requests ok/failed | goodput (req/s) | SLO attainment | prefix hit "
             "(infinite cache) | p50 TTFT (ms) | p90 TTFT (ms) | p90 TPOT (ms) | p90 ITL (ms) | switches | transfers | "
             "node CPU per output token (µs: control / engines) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    notes = []
    for r in rows:
        if not r["available"]:
            notes.append(f"- `{r['mode']}`: {r['reason']}")
            lines.append(f"| {r['mode']} | {_fmt(r.get('rate'), 'g')} | not available | — | — | — | — | — | — | — | — | — | — |")
            continue
        s = r["summary"]
        hit, inf = r.get("prefix_hit_rate"), r.get("infinite_hit_rate")
        hit_s = ("—" if hit is None else format(hit, ".1%")) + ("" if inf is None else f" ({inf:.1%})")
        label = r["mode"] if r.get("round") is None else f"{r['mode']} (round {r['round']})"
        lines.append(f"| {label} | {r['rate']:g} | {s['completed']}/{s['failed']} | {s['goodput']:.2f} | "
                     f"{s['slo_attainment']:.1%} | {hit_s} | "
                     f"{s['ttft_ms']['median']:.0f} | {s['ttft_ms']['p90']:.0f} | {s['tpot_ms']['p90']:.1f} | "
                     f"{s['itl_ms']['p90']:.1f} | "
                     f"{r['switches']:.0f} | {r['transfers']:.0f} | {_cpu_per_token(r)} |")
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def ratio_table(rows: list[dict], baseline: str) -> str:
    """Every other entry's p90 TTFT and p90 ITL over ``baseline``'s, in the same round and rate.

    One line per (entry, rate): the median over rounds, then each round's ratios in brackets (TTFT/ITL).
    Rounds where either run is unavailable are left out; an entry with none gets no line.
    """
    ok = {(r["mode"], r["rate"], r.get("round")): r["summary"] for r in rows if r["available"]}
    lines = [f"| mode / {baseline} | rate (req/s) | p90 TTFT ratio | p90 ITL ratio | per round (TTFT/ITL) |",
             "|---|---:|---:|---:|---|"]
    for mode in dict.fromkeys(m for m, _, _ in ok if m != baseline):
        for rate in dict.fromkeys(q for m, q, _ in ok if m == mode):
            pairs = [(k, s, ok[(baseline, rate, k)]) for (m, q, k), s in ok.items()
                     if m == mode and q == rate and (baseline, rate, k) in ok]
            ttft = [s["ttft_ms"]["p90"] / b["ttft_ms"]["p90"] for _, s, b in pairs if b["ttft_ms"]["p90"]]
            itl = [s["itl_ms"]["p90"] / b["itl_ms"]["p90"] for _, s, b in pairs if b["itl_ms"]["p90"]]
            if not ttft or not itl:
                continue
            each = ", ".join(f"{s['ttft_ms']['p90'] / b['ttft_ms']['p90']:.2f}/{s['itl_ms']['p90'] / b['itl_ms']['p90']:.2f}"
                             for _, s, b in pairs if b["ttft_ms"]["p90"] and b["itl_ms"]["p90"])
            lines.append(f"| {mode} | {rate:g} | {statistics.median(ttft):.2f} | {statistics.median(itl):.2f} | {each} |")
    return "\n".join(lines) + "\n"


async def _server_info(url: str, vocab_size: int | None):
    async with aiohttp.ClientSession() as s:
        return await fetch_server_info(s, url, vocab_size)


def run_rate(node: NodeServer, a: argparse.Namespace, mode: str, rate: float, info, out: Path,
             round_: int | None = None) -> dict:
    """One replay at ``rate`` on a running node; the row (and the run's files). ``mode``: the row's
    label (the node's ``--modes`` entry, ``-nocache`` when its prefix cache is off); ``round_``: the round
    of an interleaved run (:func:`run_rounds`), else None."""
    if not node.wait_idle(a.idle_timeout):
        print(f"bench.studies.compare: {mode} node not idle after {a.idle_timeout} s; running anyway", file=sys.stderr)
    wl = build_workload(spec_from_args(a, rate_rps=rate, max_model_len=info.max_model_len))
    before = counters(node.get_text("/metrics"))
    pid = node.proc.pid if node.proc else None
    cpu0 = cpu_by_role(pid)
    res = asyncio.run(replay(node.url, wl.requests, info, seed=a.seed, ttft_slo_ms=a.ttft_slo_ms, tpot_slo_ms=a.tpot_slo_ms,
                             drain_timeout_s=a.drain_timeout, progress=not a.no_progress,
                             natural_eos=a.natural_eos, temperature=a.temperature))
    cpu = [b - a for a, b in zip(cpu0, cpu_by_role(pid))]
    status = node.get_json("/v1/node")
    delta = {k: v - before[k] for k, v in counters(node.get_text("/metrics")).items()}
    config = {"mode": mode, "rate": rate, "model": info.model, "workload": wl.describe(),
              "ttft_slo_ms": a.ttft_slo_ms, "tpot_slo_ms": a.tpot_slo_ms, "node_cmd": node.cmd}
    # CPU seconds over the replay and its drain: the node's control process (event loop, policy, API when
    # in-process), its API front ends, its engines. Per output token it is the figure a shared machine's
    # speed swings leave steadiest (bench.load.host_compare).
    cpu_s = {"control": cpu[0], "api": cpu[1], "engines": cpu[2]}
    doc = result_json(res, config, wl.requests) | {"node_status": status, "counters": delta, "cpu_s": cpu_s}
    name = f"{mode}_r{rate:g}" + ("" if round_ is None else f"_k{round_}")
    (out / f"{name}.json").write_text(json.dumps(doc))
    t0 = res.node_clock_start_s
    t1 = res.node_clock_end_s or status.get("clock_s")
    if t0 is not None and t1 is not None:
        total = delta["shiftnode_role_switches_total"]
        shown = sum(len(switches_in(d.get("switches", []), t0, t1)) for d in status["devices"])
        note = "" if shown >= total else f" (the node kept the last {shown} of {total:.0f} switches)"
        if round_ is None or round_ == 0:  # an interleaved run draws its first round's timelines
            plots.role_timeline(status, t0, t1, out / f"timeline_{name}.png",
                                title=f"{mode}, {rate:g} req/s: device roles{note}")
    ok = [r for r in res.records if r.success]
    return {"mode": mode, "rate": rate, "round": round_, "available": True, "summary": res.summary.as_dict(),
            "prefix_hit_rate": res.prefix_hit_rate,
            "infinite_hit_rate": infinite_cache_hit_ratio(wl.requests)[1] if any(r.hash_ids for r in wl.requests) else None,
            "switches": delta["shiftnode_role_switches_total"], "transfers": delta["shiftnode_kv_transfers_total"],
            "cpu_s": cpu_s, "ttft_ms": [r.ttft_s * 1e3 for r in ok],
            "tpot_ms": [t * 1e3 for t in (request_tpot_s(r) for r in ok) if t is not None]}


def run_mode(a: argparse.Namespace, mode: str, rates: list[float], out: Path, cache: bool = True) -> list[dict]:
    """Every rate on one node of ``mode`` (its prefix cache on or off); a node that will not start gives
    one 'not available' row."""
    env = {"OMP_NUM_THREADS": str(a.omp_threads)} if a.omp_threads else {}
    rows: list[dict] = []
    args = node_args(a, mode) + ([] if cache else ["--no-prefix-caching"])
    mode = mode if cache else f"{mode}-nocache"
    try:
        with NodeServer(args, log_path=out / f"node_{mode}.log", env=env,
                        startup_timeout_s=a.startup_timeout) as node:
            info = asyncio.run(_server_info(node.url, a.vocab_size))
            for rate in rates:
                if not node.alive():
                    rows.append({"mode": mode, "rate": rate, "available": False,
                                 "reason": f"node exited during the sweep: {node.log_tail()}"})
                    continue
                print(f"bench.studies.compare: {mode} at {rate:g} req/s", file=sys.stderr)
                rows.append(run_rate(node, a, mode, rate, info, out))
    except NodeUnavailable as e:
        rows.append({"mode": mode, "rate": None, "available": False, "reason": str(e)})
    return rows


def run_rounds(a: argparse.Namespace, entries: list[str], rates: list[float], out: Path, rounds: int) -> list[dict]:
    """``rounds`` interleaved rounds: every entry's node up at once, each round replaying every entry in
    turn at every rate (the order reversed on odd rounds; round ``k`` uses seed ``a.seed + k``). A node that will not start gives one 'not
    available' row; one that dies gives such a row for each replay it misses."""
    env = {"OMP_NUM_THREADS": str(a.omp_threads)} if a.omp_threads else {}
    rows: list[dict] = []
    with ExitStack() as stack:
        nodes: dict[str, tuple[NodeServer, object]] = {}
        for entry in entries:
            try:
                node = stack.enter_context(NodeServer(node_args(a, entry), log_path=out / f"node_{entry}.log",
                                                      env=env, startup_timeout_s=a.startup_timeout))
                nodes[entry] = (node, asyncio.run(_server_info(node.url, a.vocab_size)))
            except NodeUnavailable as e:
                rows.append({"mode": entry, "rate": None, "available": False, "reason": str(e)})
        for k in range(rounds):
            ak = argparse.Namespace(**{**vars(a), "seed": a.seed + k})  # fresh prompts: no cache hits across rounds
            for entry in (list(nodes) if k % 2 == 0 else list(reversed(nodes))):
                node, info = nodes[entry]
                rows += _replay_rates(node, ak, entry, rates, info, out, k, "round")
    return rows


def _replay_rates(node, ak: argparse.Namespace, entry: str, rates: list[float], info, out: Path, k: int,
                  unit: str) -> list[dict]:
    """One entry's runs at every rate on ``node`` in round or pair ``k``; a node that has exited gives
    'not available' rows for the rates it misses."""
    rows = []
    for rate in rates:
        if not node.alive():
            rows.append({"mode": entry, "rate": rate, "round": k, "available": False,
                         "reason": f"node exited during the run: {node.log_tail()}"})
            continue
        print(f"bench.studies.compare: {unit} {k}, {entry} at {rate:g} req/s", file=sys.stderr)
        rows.append(run_rate(node, ak, entry, rate, info, out, round_=k))
    return rows


def run_pairs(a: argparse.Namespace, entries: list[str], rates: list[float], out: Path, pairs: int) -> list[dict]:
    """``pairs`` fresh-instance pairs (module doc): in pair ``k`` each entry, in :func:`pair_order`, gets a
    node of its own that replays every rate with seed ``a.seed + k`` and is then stopped. A node that will
    not start or dies gives 'not available' rows for the runs it misses (that pair then has no ratio)."""
    env = {"OMP_NUM_THREADS": str(a.omp_threads)} if a.omp_threads else {}
    rows: list[dict] = []
    for k in range(pairs):
        ak = argparse.Namespace(**{**vars(a), "seed": a.seed + k})  # fresh prompts per pair, the same within it
        for entry in pair_order(entries, k):
            try:
                with NodeServer(node_args(a, entry), log_path=out / f"node_{entry}_k{k}.log", env=env,
                                startup_timeout_s=a.startup_timeout) as node:
                    info = asyncio.run(_server_info(node.url, a.vocab_size))
                    rows += _replay_rates(node, ak, entry, rates, info, out, k, "pair")
            except NodeUnavailable as e:
                rows += [{"mode": entry, "rate": rate, "round": k, "available": False, "reason": str(e)}
                         for rate in rates]
    return rows


def write_plots(rows: list[dict], a: argparse.Namespace, out: Path) -> None:
    ok = [r for r in rows if r["available"]]
    points: dict[str, list[tuple[float, float]]] = {}
    ttft: dict[float, dict[str, list[float]]] = {}
    tpot: dict[float, dict[str, list[float]]] = {}
    for r in ok:
        if r.get("round"):  # interleaved runs plot their first round
            continue
        points.setdefault(r["mode"], []).append((r["rate"], r["summary"]["goodput"]))
        ttft.setdefault(r["rate"], {})[r["mode"]] = r["ttft_ms"]
        tpot.setdefault(r["rate"], {})[r["mode"]] = r["tpot_ms"]
    plots.goodput_vs_rate(points, out / "goodput_vs_rate.png",
                          title=f"{a.trace}: goodput (TTFT<={a.ttft_slo_ms:g} ms, TPOT<={a.tpot_slo_ms:g} ms)")
    plots.latency_cdfs(ttft, out / "ttft_cdf.png", metric="TTFT", slo_ms=a.ttft_slo_ms)
    plots.latency_cdfs(tpot, out / "tpot_cdf.png", metric="TPOT", slo_ms=a.tpot_slo_ms)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.studies.compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="time-shared,colocated,pooled",
                    help="comma-separated node modes; MODE@N: that mode with --max-num-batched-tokens N")
    ap.add_argument("--rounds", type=int, default=1,
                    help="K > 1: every node up at once, K interleaved rounds of every mode at every rate")
    ap.add_argument("--pairs", type=int, default=0,
                    help="N > 0: N pairs of runs, a fresh node per entry and run, the order alternating "
                         "(ratios with bootstrap 95 %% intervals over each --baseline)")
    ap.add_argument("--baseline", default=None,
                    help="comma-separated --modes entries: add p90 TTFT and ITL ratios over each, per round")
    ap.add_argument("--devices", default="cpu:0,cpu:1")
    ap.add_argument("--model", default=None, help="model folder (default: stories260k from the shared folder)")
    ap.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"])
    ap.add_argument("--config", default=None, help="config.json (or its folder) served with random weights "
                    "(--load-format dummy; the folder needs a tokenizer.json too)")
    ap.add_argument("--ttft-slo-ms", type=float, default=1000.0, help="TTFT target: the node's, and the runs' scoring")
    ap.add_argument("--tpot-slo-ms", type=float, default=100.0, help="TPOT target: the node's, and the runs' scoring")
    ap.add_argument("--reconfig-pause-ms", type=float, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--node-args", default="", help="more 'shiftnode serve' flags for every mode, one string")
    ap.add_argument("--mode-args", action="append", metavar="MODE=ARGS",
                    help="serve flags for one mode, e.g. 'pooled=--prefill-devices cpu:0 --decode-devices cpu:1' (repeatable)")
    ap.add_argument("--omp-threads", type=int, default=None, help="OMP_NUM_THREADS of the node (default 1 on CPU devices)")
    ap.add_argument("--startup-timeout", type=float, default=180.0)
    ap.add_argument("--idle-timeout", type=float, default=60.0, help="wait for the node to drain between rates (s)")
    ap.add_argument("--prefix-caching", default="on", choices=["on", "off", "both"],
                    help="run each mode with the node's prefix cache on, off, or both side by side")
    ap.add_argument("--out", default=None, help="output folder (default bench/out/<timestamp>/)")
    add_replay_args(ap, slo=False)
    add_workload_args(ap, rates=True)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if not a.model and not a.config:
        stories = shared_dir() / "models" / "stories260k"
        a.model = str(stories) if stories.is_dir() else None
    if a.omp_threads is None and all(d.strip().startswith("cpu") for d in a.devices.split(",")):
        a.omp_threads = 1
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    try:
        for m in modes:
            split_entry(m)
    except ValueError as e:
        parser().error(str(e))
    if a.pairs and (a.rounds > 1 or a.prefix_caching != "on"):
        parser().error("--pairs replaces --rounds and runs each node with its prefix cache on")
    if a.rounds > 1 and a.prefix_caching != "on":
        parser().error("--rounds runs each node with its prefix cache on; --prefix-caching off/both needs --rounds 1")
    rates = [float(r) for r in a.rates.split(",") if r.strip()]
    stamp = datetime.now(timezone.utc)
    out = Path(a.out) if a.out else REPO / "bench" / "out" / stamp.strftime("%Y%m%dT%H%M%SZ")
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    caches = {"on": [True], "off": [False], "both": [True, False]}[a.prefix_caching]
    if a.pairs:
        rows = run_pairs(a, modes, rates, out, a.pairs)
    elif a.rounds > 1:
        rows = run_rounds(a, modes, rates, out, a.rounds)
    else:
        for mode in modes:
            for cache in caches:
                rows += run_mode(a, mode, rates, out, cache)
    write_plots(rows, a, out)
    args = argv if argv is not None else sys.argv[1:]
    command = "python -m bench.studies.compare " + " ".join(shlex.quote(x) for x in args)
    table = markdown_table(rows)
    for base in (b.strip() for b in (a.baseline or "").split(",") if b.strip()):
        table += "\n" + (interval_table(rows, base, seed=a.seed) if a.pairs else ratio_table(rows, base))
    (out / "results.md").write_text(f"Command: `{command}`\n\nDate: {stamp.isoformat(timespec='seconds')}\n\n{table}")
    slim = [{k: v for k, v in r.items() if k not in ("ttft_ms", "tpot_ms")} for r in rows]
    (out / "results.json").write_text(json.dumps({"command": command, "date": stamp.isoformat(), "rows": slim}, indent=1))
    print(table)
    print(f"bench.studies.compare: results in {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
