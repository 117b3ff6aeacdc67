"""``python -m bench.sim``: simulate a workload on a deployment and print the replay's summary.

``python -m bench.sim --mode time-shared,colocated,pooled --devices 8 --nodes 1 --trace azure-conv
--rate 20 --duration 60 --link-gbps 100 --cost-model bench/cost_models/cpu_stories260k.json
--model-config ../shared/models/stories260k``
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.calibrate import load_cost_model
from bench.metrics import format_summary
from bench.sim.config import MODES, SimConfig, kv_geometry
from bench.sim.run import simulate
from bench.workload import add_workload_args, build_workload, shared_dir, spec_from_args
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
    ap.add_argument("--prefill-devices", type=int, default=None, help="pooled: prefill devices per node (default half)")
    ap.add_argument("--link-gbps", type=float, default=100.0, help="pooled: KV link per prefill device (Gb/s)")
    ap.add_argument("--cost-model", default=str(DEFAULT_COST), help="CostModel JSON (bench/calibrate.py)")
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
    ap.add_argument("--expected-output", default="node", choices=["node", "oracle"],
                    help="time-shared: output length the policy is told (node: min(max_tokens, 128))")
    ap.add_argument("--max-sim-s", type=float, default=3600.0, help="simulated seconds before unfinished requests fail")
    ap.add_argument("--out", default=None, help="write the summaries and stats as JSON")
    add_workload_args(ap)
    return ap


def config_for(args: argparse.Namespace, mode: str, model_cfg: dict) -> SimConfig:
    dtype = args.dtype or str(model_cfg.get("torch_dtype") or "bf16")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}")
    kv_bytes = None if args.device_memory_gib is not None else (args.kv_cache_memory or CPU_KV_BYTES)
    per_token, blocks = kv_geometry(model_cfg, dtype=dtype, block_size=args.block_size, kv_cache_bytes=kv_bytes,
                                    device_memory_gib=args.device_memory_gib, memory_fraction=args.memory_fraction)
    return SimConfig(
        mode=mode, devices=args.devices, nodes=args.nodes, prefill_devices=args.prefill_devices, kv_blocks=blocks,
        block_size=args.block_size, kv_bytes_per_token=per_token, link_gbps=args.link_gbps,
        max_model_len=args.max_model_len or int(model_cfg.get("max_position_embeddings", 2048)),
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        ttft_slo_ms=args.ttft_slo_ms, tpot_slo_ms=args.tpot_slo_ms, reconfig_pause_ms=args.reconfig_pause_ms,
        min_window_ms=args.min_window_ms, max_window_ms=args.max_window_ms, stagger=args.stagger,
        expected_output=args.expected_output, max_sim_s=args.max_sim_s)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        model_cfg = load_config(args.model_config or shared_dir() / "models" / "stories260k")
        cost = load_cost_model(args.cost_model)
        modes = [m.strip() for m in args.mode.split(",") if m.strip()]
        configs = [config_for(args, m, model_cfg) for m in modes]
        wl = build_workload(spec_from_args(args, max_model_len=configs[0].max_model_len))
    except (OSError, ValueError, KeyError) as e:
        print(f"bench.sim: {e}", file=sys.stderr)
        return 2
    out = {"workload": wl.describe(), "cost_model": json.loads(Path(args.cost_model).read_text()), "runs": []}
    out["cost_model"].pop("calibration", None)
    for cfg in configs:
        res = simulate(wl.requests, cfg, cost)
        title = f"Simulated: {cfg.mode}, {cfg.nodes} node(s) x {cfg.devices} device(s)"
        print(format_summary(res.summary, title))
        st = res.stats
        print(f"switches {st.get('switches', 0)}, pause {st.get('pause_s', 0.0):.3f} s, transfers {st.get('transfers', 0)} "
              f"({st.get('transfer_bytes', 0) / 2**20:.1f} MiB), preemptions {st.get('preemptions', 0)}\n")
        out["runs"].append({"config": vars(cfg) | {"num_prefill_devices": cfg.num_prefill_devices},
                            "summary": res.summary.as_dict(), "stats": st})
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
