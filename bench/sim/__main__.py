"""``python -m bench.sim``: simulate a workload on a deployment and print the replay's summary.

``python -m bench.sim --mode time-shared,colocated,pooled --devices 8 --nodes 1 --trace azure-conv
--rate 20 --duration 60 --link-gbps 100 --cost-model bench/cost_models/cpu_stories260k.json
--model-config ../shared/models/stories260k``

``--tune`` follows the tuning protocol (:mod:`bench.sim.tuning`): each mode runs every setting of its main
knobs on the same workload, and only its best one is reported, named in the table's last column
(``--jobs N`` runs the settings in N processes).

``--prefix-caching on|off|both`` simulates each mode with the devices' prefix cache on, off, or both
(rows ``MODE +cache``); with ``--tokens-per-hash`` on a Mooncake trace the prompts share tokens as the
trace's hash ids do, and the output gives the simulated prefix hit rate next to the workload's own
infinite-cache ratio (:func:`bench.traffic.traces.infinite_cache_hit_ratio`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from bench.cost.calibrate import load_cost_model
from bench.sim.config import MODES, ORACLES, PLANNING, SimConfig, kv_geometry
from bench.traffic.clients import DEFAULT_CLIENT_MIX
from bench.sim.run import simulate
from bench.sim.tuning import candidates, pick_best, setting_of
from bench.traffic.metrics import format_summary
from bench.traffic.traces import infinite_cache_hit_ratio
from bench.traffic.workload import add_workload_args, build_workload, shared_dir, spec_from_args
from node.cli import parse_bytes
from node.plan import DTYPE_BYTES, load_config

REPO = Path(__file__).resolve().parents[2]
DEFAULT_COST = REPO / "bench" / "cost_models" / "cpu_stories260k.json"
CPU_KV_BYTES = 512 * 1024 * 1024  # the node's KV budget per CPU device (node.worker.loader)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.sim", description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", default="time-shared", help=f"comma-separated: {', '.join(MODES)}")
    ap.add_argument("--devices", type=int, default=1, help="devices per node")
    ap.add_argument("--nodes", type=int, default=1, help="nodes (requests spread round-robin)")
    ap.add_argument("--prefill-devices", default=None,
                    help="pooled: prefill devices per node (default half); a comma list runs each split")
    ap.add_argument("--link-gbps", type=float, default=100.0,
                    help="pooled: KV link per prefill device in a node (Gb/s)")
    ap.add_argument("--pool-scope", default="node", choices=["node", "cluster"],
                    help="pooled: each node splits its own devices (node), or prefill nodes hand KV to decode "
                         "nodes (cluster)")
    ap.add_argument("--prefill-nodes", default=None,
                    help="pooled, cluster scope: prefill-only nodes (default half); a comma list runs each")
    ap.add_argument("--internode-gbps", type=float, default=400.0,
                    help="pooled, cluster scope: network link per device between nodes (Gb/s)")
    ap.add_argument("--transfer", default="overlap", choices=["blocking", "overlap"],
                    help="pooled: a prefill device goes on while its KV is sent, as the node's hand-offs do "
                         "(overlap), or waits for each send (blocking)")
    ap.add_argument("--step-pipeline", type=int, default=2,
                    help="steps in flight per device (2: the node's overlapped steps; 1: each planned when "
                         "the one before ends)")
    ap.add_argument("--mixed-graphs", default="eager", choices=["eager", "piecewise"],
                    help="prefill and mixed steps: eager launches (the node today) or vLLM V1's piecewise CUDA graphs "
                         "(roofline cost models only)")
    ap.add_argument("--max-unsent", type=int, default=64, help="pooled: the node's --max-unsent")
    ap.add_argument("--step-overhead-ms", type=float, default=0.0, help="host time added to every step (ms)")
    ap.add_argument("--request-overhead-ms", type=float, default=0.0, help="send-to-scheduler time added to TTFT (ms)")
    ap.add_argument("--pause-ms", type=float, default=0.0, help="time-shared: least switch pause (ms)")
    ap.add_argument("--cost-model", default=str(DEFAULT_COST), help="CostModel JSON (bench/cost/calibrate.py)")
    ap.add_argument("--model-config", default=None, help="config.json or model folder (default: stories260k)")
    ap.add_argument("--dtype", default=None, help="KV dtype (default: the config's torch_dtype, else bf16)")
    ap.add_argument("--kv-cache-memory", type=parse_bytes, default=None, help="KV bytes per device (default 512MiB)")
    ap.add_argument("--device-memory-gib", type=float, default=None, help="device memory; KV = what the weights leave")
    ap.add_argument("--memory-fraction", type=float, default=0.9)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=None, help="context (default: the config's)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    ap.add_argument("--tpot-slo-ms", type=float, default=100.0)
    ap.add_argument("--reconfig-pause-ms", type=float, default=0.0)
    ap.add_argument("--min-window-ms", type=float, default=20.0)
    ap.add_argument("--max-window-ms", type=float, default=500.0)
    ap.add_argument("--stagger", default="soft", choices=["hard", "soft", "off"])
    ap.add_argument("--imbalance-threshold", type=float, default=None,
                    help="time-shared and adaptive: the node's fallback that moves decoding sequences (0: off; "
                         "default the node's: 1 in time-shared mode, 0 in adaptive mode)")
    ap.add_argument("--expected-output", default="node", choices=["node", "oracle"],
                    help="output length placement and the role policies are told (node: the node's own estimate, "
                         "min(max_tokens, running mean of EOS-ended outputs); oracle: the true length)")
    ap.add_argument("--client-max-tokens", default=DEFAULT_CLIENT_MIX,
                    help="clients' max_tokens mix VALUE:SHARE,... (none: absent), or 'true' (the oracle: the true "
                         f"length, ignore_eos); default {DEFAULT_CLIENT_MIX}")
    ap.add_argument("--client-seed", type=int, default=0, help="seed of the max_tokens draws")
    ap.add_argument("--planning", default="refit", choices=list(PLANNING),
                    help="the role policies' cost model: the node's start refitted from the simulated steps (refit), "
                         "the true one off by --cost-error (perturbed), or the true one (exact: the oracle)")
    ap.add_argument("--cost-error", type=float, default=0.2, help="--planning perturbed: each coefficient's error")
    ap.add_argument("--cost-error-seed", type=int, default=0, help="--planning perturbed: seed of the errors' signs")
    ap.add_argument("--control-round-us", type=float, default=None,
                    help="CPU µs of a role-policy decision round on the node's loop (default: the mode's measured)")
    ap.add_argument("--control-per-resident-us", type=float, default=None,
                    help="... plus this per resident sequence (default: the mode's measured)")
    ap.add_argument("--group-decode-graphs", action="store_true",
                    help="tensor-parallel groups replay decode CUDA graphs (the live node's run eagerly)")
    ap.add_argument("--copy-rate", type=float, default=0.8, help="KV copies run at this fraction of the link rate")
    ap.add_argument("--copy-slowdown", type=float, default=0.05,
                    help="steps beside a KV copy last this much longer (0.05: 5 %%; an assumption)")
    ap.add_argument("--oracles", action="store_true",
                    help="every oracle of the simulator before issue 43 (bench.sim.config.ORACLES); overrides the above")
    ap.add_argument("--max-sim-s", type=float, default=3600.0, help="simulated seconds before unfinished requests fail")
    ap.add_argument("--prefix-caching", default="off", choices=["on", "off", "both"],
                    help="the devices' prefix cache (and placement that follows it): on, off, or both side by side")
    ap.add_argument("--out", default=None, help="write the summaries and stats as JSON")
    ap.add_argument("--table", action="store_true", help="print one markdown table row per (rate, mode) instead")
    add_workload_args(ap)
    ap.add_argument("--rates", default=None, help="comma-separated rates to run in turn (overrides --rate)")
    ap.add_argument("--tune", action="store_true",
                    help="run every setting of each mode's main knobs (bench.sim.tuning.GRID) and report the best")
    ap.add_argument("--jobs", type=int, default=1, help="--tune: processes running settings side by side")
    return ap


def _ints(text: str | None) -> list[int | None]:
    return [int(x) for x in text.split(",") if x.strip()] if text else [None]


def config_for(args: argparse.Namespace, mode: str, model_cfg: dict, prefill_devices: int | None = None,
               prefill_nodes: int | None = None) -> SimConfig:
    dtype = args.dtype or str(model_cfg.get("torch_dtype") or "bf16")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}")
    kv_bytes = None if args.device_memory_gib is not None else (args.kv_cache_memory or CPU_KV_BYTES)
    per_token, blocks = kv_geometry(model_cfg, dtype=dtype, block_size=args.block_size, kv_cache_bytes=kv_bytes,
                                    device_memory_gib=args.device_memory_gib, memory_fraction=args.memory_fraction)
    return SimConfig(
        mode=mode, devices=args.devices, nodes=args.nodes, prefill_devices=prefill_devices, kv_blocks=blocks,
        block_size=args.block_size, kv_bytes_per_token=per_token, link_gbps=args.link_gbps,
        pool_scope=args.pool_scope, prefill_nodes=prefill_nodes, internode_gbps=args.internode_gbps,
        transfer=args.transfer, step_pipeline=getattr(args, "step_pipeline", 2), max_unsent=args.max_unsent,
        step_overhead_ms=args.step_overhead_ms, request_overhead_ms=args.request_overhead_ms, pause_ms=args.pause_ms,
        max_model_len=args.max_model_len or int(model_cfg.get("max_position_embeddings", 2048)),
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        ttft_slo_ms=args.ttft_slo_ms, tpot_slo_ms=args.tpot_slo_ms, reconfig_pause_ms=args.reconfig_pause_ms,
        min_window_ms=args.min_window_ms, max_window_ms=args.max_window_ms, stagger=args.stagger,
        expected_output=args.expected_output, max_sim_s=args.max_sim_s,
        **_oracle_args(args),
        imbalance_threshold=getattr(args, "imbalance_threshold", None),
        prefix_caching=getattr(args, "prefix_caching", "off") == "on",
        mixed_graphs=getattr(args, "mixed_graphs", "eager"))


def _oracle_args(args: argparse.Namespace) -> dict:
    """The SimConfig fields of the oracles' flags (``--oracles``: :data:`bench.sim.config.ORACLES`)."""
    got = dict(client_max_tokens=getattr(args, "client_max_tokens", DEFAULT_CLIENT_MIX),
               client_seed=getattr(args, "client_seed", 0), planning=getattr(args, "planning", "refit"),
               cost_error=getattr(args, "cost_error", 0.2), cost_error_seed=getattr(args, "cost_error_seed", 0),
               control_round_us=getattr(args, "control_round_us", None),
               control_per_resident_us=getattr(args, "control_per_resident_us", None),
               group_decode_graphs=getattr(args, "group_decode_graphs", False),
               copy_rate=getattr(args, "copy_rate", 0.8), copy_slowdown=getattr(args, "copy_slowdown", 0.05))
    return got | (ORACLES if getattr(args, "oracles", False) else {})


def configs_for(args: argparse.Namespace, model_cfg: dict) -> list[SimConfig]:
    """One config per mode; pooled once per ``--prefill-devices`` (or ``--prefill-nodes``) value."""
    out = []
    for mode in [m.strip() for m in args.mode.split(",") if m.strip()]:
        if mode != "pooled":
            out.append(config_for(args, mode, model_cfg))
        elif args.pool_scope == "cluster":
            out += [config_for(args, mode, model_cfg, prefill_nodes=n) for n in _ints(args.prefill_nodes)]
        else:
            out += [config_for(args, mode, model_cfg, prefill_devices=n) for n in _ints(args.prefill_devices)]
    if getattr(args, "prefix_caching", "off") == "both":
        out = [c for cfg in out for c in (dataclasses.replace(cfg, prefix_caching=True), cfg)]
    return out


def mode_label(cfg: SimConfig) -> str:
    """``time-shared``, ``colocated``, ``pooled 4P:4D`` (per node) or ``pooled 4P:4D nodes`` (cluster),
    with `` +cache`` when the prefix cache is on."""
    cache = " +cache" if cfg.prefix_caching else ""
    if cfg.mode != "pooled":
        return cfg.mode + cache
    if cfg.pool_scope == "cluster":
        p = cfg.num_prefill_nodes
        return f"pooled {p}P:{cfg.nodes - p}D nodes{cache}"
    p = cfg.num_prefill_devices
    return f"pooled {p}P:{cfg.devices - p}D{cache}"


def table_row(trace: str, rate: float | None, cfg: SimConfig, summary, stats: dict, setting: str | None = None) -> str:
    """A markdown row: trace, rate, mode, goodput, SLO attainment, p90 TTFT/TPOT, switches, transfers
    (and, tuned, the winning setting)."""
    gib = stats.get("transfer_bytes", 0) / 2**30
    r = "—" if rate is None else f"{rate:g}"
    hit = stats.get("prefix_hit_rate")
    return (f"| {trace} | {r} | {mode_label(cfg)} | {summary.goodput:.2f} | "
            f"{summary.slo_attainment:.1%} | {'—' if hit is None else format(hit, '.1%')} | "
            f"{summary.ttft_ms.median:.1f} | {summary.ttft_ms.p90:.1f} | {summary.tpot_ms.p90:.2f} | "
            f"{stats.get('switches', 0)} | {stats.get('transfers', 0)} ({gib:.0f} GiB) |"
            + ("" if setting is None else f" {setting} |"))


TABLE_HEAD = ("| trace | rate (req/s) | mode | goodput (req/s) | SLO attainment | prefix hit | p50 TTFT (ms) | "
              "p90 TTFT (ms) | p90 TPOT (ms) | switches | transfers |\n|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
TUNED_HEAD = TABLE_HEAD.replace(" transfers |\n", " transfers | best setting (of the grid) |\n") + "---|"


def _simulate_star(args):
    return simulate(*args)


def run_configs(requests, configs: list[SimConfig], cost, tune: bool, jobs: int) -> list[tuple[SimConfig, object, str | None]]:
    """``(config, result, setting)`` per mode (per config without ``tune``; the best setting with it)."""
    groups = [candidates(cfg) if tune else [cfg] for cfg in configs]
    flat = [c for g in groups for c in g]
    if jobs > 1 and len(flat) > 1:
        with ProcessPoolExecutor(jobs) as ex:
            results = list(ex.map(_simulate_star, [(requests, c, cost) for c in flat]))
    else:
        results = [simulate(requests, c, cost) for c in flat]
    out, i = [], 0
    for g in groups:
        part = list(zip(g, results[i : i + len(g)]))
        i += len(g)
        if tune:
            cfg, res = pick_best(part)
            out.append((cfg, res, f"{setting_of(cfg)} (of {len(g)})"))
        else:
            out.append((part[0][0], part[0][1], None))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        model_cfg = load_config(args.model_config or shared_dir() / "models" / "stories260k")
        cost = load_cost_model(args.cost_model)
        configs = configs_for(args, model_cfg)
        rates = [float(x) for x in args.rates.split(",")] if args.rates else [args.rate]
        workloads = [build_workload(spec_from_args(args, rate_rps=r, max_model_len=configs[0].max_model_len))
                     for r in rates]
    except (OSError, ValueError, KeyError) as e:
        print(f"bench.sim: {e}", file=sys.stderr)
        return 2
    out = {"cost_model": json.loads(Path(args.cost_model).read_text()), "runs": []}
    out["cost_model"].pop("calibration", None)
    rows = []
    for rate, wl in zip(rates, workloads):
        for cfg, res, setting in run_configs(wl.requests, configs, cost, args.tune, args.jobs):
            st = res.stats
            prompt = sum(r.prompt_tokens for r in wl.requests)
            st["prefix_hit_rate"] = st.get("cached_tokens", 0) / prompt if cfg.prefix_caching and prompt else None
            if args.table:
                rows.append(table_row(args.trace, rate, cfg, res.summary, st, setting))
                print(rows[-1], file=sys.stderr, flush=True)  # progress
            else:
                title = f"Simulated: {mode_label(cfg)}, {cfg.nodes} node(s) x {cfg.devices} device(s)" + (
                    "" if setting is None else f", best setting {setting}")
                print(format_summary(res.summary, title))
                hit = st["prefix_hit_rate"]
                print(f"switches {st.get('switches', 0)}, pause {st.get('pause_s', 0.0):.3f} s, transfers "
                      f"{st.get('transfers', 0)} ({st.get('transfer_bytes', 0) / 2**20:.1f} MiB), "
                      f"preemptions {st.get('preemptions', 0)}"
                      + ("" if hit is None else f", prefix hit {hit:.1%}") + "\n")
            out["runs"].append({"workload": wl.describe(), "mode": mode_label(cfg), "setting": setting,
                                "config": vars(cfg) | {"num_prefill_devices": cfg.num_prefill_devices},
                                "summary": res.summary.as_dict(), "stats": st})
    if args.table:
        print(TUNED_HEAD if args.tune else TABLE_HEAD)
        print("\n".join(rows))
    if getattr(args, "tokens_per_hash", None):
        for rate, wl in zip(rates, workloads):
            blocks, tokens = infinite_cache_hit_ratio(wl.requests)
            print(f"infinite-cache prefix hit of the workload at {rate} req/s: blocks {blocks:.1%}, tokens {tokens:.1%}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
