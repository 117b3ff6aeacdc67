"""``shiftnode`` command line: ``serve`` starts a node; ``plan`` sizes KV memory for a config."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys

from node.api.flags import add_stream_flags, stream_config
from node.config import DEFAULT_REQUEST_TIMEOUT_S, EMBEDDED_MODEL, NodeConfig
from node.serving_options import add_serving_arguments, serving_options_from_args
from node.speculative_flag import add_speculative_flag

DEFAULT_COMPILE = "none"
"""``--compile``'s default (docs/user-guide.md#compiled-steps---compile): eager steps. ``auto`` (compiled in the
background on CPU engines of dispatch-bound models) is not the default yet: on the shared 2-core machine (load
average 14-20) one stream's ITL p50 while a bucket compiled or loaded was ~2.3x eager's (bench/load/compile_start)."""

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
          "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``"512MiB"``, ``"2G"``, ``"1048576"`` → bytes. Raises ``argparse.ArgumentTypeError``."""
    m = _SIZE.match(text)
    if not m or (m.group(2) or "").lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 512MiB, 2GiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="start a node (OpenAI-compatible HTTP API)")
    p.add_argument("--model", default=EMBEDDED_MODEL,
                   help="Hugging Face model folder (default: the embedded stories260k, node/models/stories260k)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"])
    p.add_argument("--device", default=None, help="one device: cpu, cpu:N or cuda:N")
    p.add_argument("--devices", default=None, help="comma-separated devices, e.g. cuda:0,cuda:1 or cpu:0,cpu:1")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="D",
                   help="run each consecutive group of D --devices as one device: D engine processes, one tensor-parallel "
                        "rank each (colocated mode; no KV transfers or peers)")
    p.add_argument("--decode-tp", type=int, default=1, metavar="D",
                   help="time-shared mode: group each consecutive D --devices; a group decodes as one tensor-parallel "
                        "instance of degree D (no KV transfers to peers); pooled mode: --decode-devices form groups of D")
    p.add_argument("--prefill-tp", type=int, default=1, metavar="P",
                   help="time-shared mode: in the prefill role a group runs D/P instances of P devices side by side, "
                        "each writing its KV straight into the decode layout (P divides D); pooled mode: "
                        "--prefill-devices form groups of P")
    p.add_argument("--dtype", default="auto", help="auto, float32, float16, bfloat16")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--max-model-len", type=int, default=None, help="context length in tokens (default: the model's)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="recompute every prompt (default: reuse the cached KV blocks of repeated prefixes)")
    p.add_argument("--kv-cache-memory", type=parse_bytes, default=None, help="KV cache bytes per device, e.g. 2GiB")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="fraction of GPU memory for weights + KV")
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences per step")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="new tokens per step (the chunked-prefill budget; in adaptive mode an upper bound: MIXED steps "
                        "take the chunk the residents' TPOT deadlines allow)")
    p.add_argument("--max-queue", type=int, default=1024, help="queued requests before answering 503")
    p.add_argument("--request-timeout-s", type=float, default=DEFAULT_REQUEST_TIMEOUT_S,
                   help="end a request still running after this many seconds with an error (503 request_timeout), "
                        f"freeing its KV (default: {DEFAULT_REQUEST_TIMEOUT_S:g}; 0: no bound)")
    p.add_argument("--engine-restart-max", type=int, default=5,
                   help="start a dead engine process (or tensor-parallel group) again, with backoff, unless it was "
                        "restarted this many times within --engine-restart-window-s: then it stays down, reported "
                        "in /health (a crash loop); 0: never restart (default: 5)")
    p.add_argument("--engine-restart-window-s", type=float, default=600.0,
                   help="the window (s) --engine-restart-max counts restarts in (default: 600)")
    p.add_argument("--engine-start-timeout-s", type=float, default=600.0,
                   help="a restarted engine that has not loaded its weights after this long (s) is killed, and the "
                        "attempt counts as a failed start (backoff, then the next try or left down); 0: no bound "
                        "(default: 600)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "cpu", "triton"])
    p.add_argument("--engine-layout", default="process", choices=["process", "thread"],
                   help="process: one engine process per device (default); thread: models run in the node's process "
                        "(debugging, and the baseline of bench/load/host_overhead.py)")
    p.add_argument("--benchmark-model", default=None, metavar="zero|sleep:MS|timed:PATH",
                   help="BENCHMARK TOOL, outputs are meaningless: replace the model by one with no weights and fixed "
                        "logits (zero: no compute; sleep:MS: each step sleeps MS ms; timed:PATH: each step takes the "
                        "time the cost-model JSON PATH gives its work, KV blocks and transfers sized by --model's "
                        "geometry for --kv-cache-memory) to measure the node's own overhead or run it at GPU-like "
                        "step times")
    p.add_argument("--cpu-threads", type=int, default=None, metavar="N",
                   help="intra-op threads of each CPU engine (default: timed at start-up, the cores less one for the "
                        "node's loop where the model's steps are cheaper than the loop's work, else all of them; "
                        "docs/user-guide.md)")
    p.add_argument("--cpu-weight-packing", default="on", choices=["on", "off"],
                   help="on (default): CPU engines keep their projection weights packed for oneDNN; off: plain F.linear")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run every step eagerly (default on CUDA with the triton backend: decode steps replay CUDA graphs)")
    p.add_argument("--compile", default=DEFAULT_COMPILE, choices=["auto", "none", "inductor"],
                   help="inductor: torch.compile the model forward once per --compile-sizes bucket (CPU engines: in the "
                        "background while serving eagerly, each bucket compiled from the step after it is ready; CUDA "
                        "and --compile-wait: at start-up; on CUDA pure decode steps keep their CUDA graphs); auto: "
                        "inductor in the background on CPU engines of small (dispatch-bound) models, else eager; none: "
                        f"eager steps [{DEFAULT_COMPILE}]. See docs/user-guide.md")
    p.add_argument("--compile-sizes", default=None, type=_sizes_arg, metavar="N,N,...",
                   help="token-count buckets of --compile (default, up to --max-num-batched-tokens: 1,2,4,...,256 on "
                        "CPU, 16,64,256,512,1024,2048 on CUDA); a step is padded to the smallest that fits")
    p.add_argument("--compile-wait", action="store_true",
                   help="compile every bucket before the node serves (the node is not ready until then), not in the "
                        "background")
    p.add_argument("--compile-cache-dir", default=None, metavar="DIR",
                   help="where compiled steps persist between starts, one folder per model, configuration and "
                        "torch/triton/shiftnode versions [~/.cache/shiftnode]")
    add_speculative_flag(p)
    lg = p.add_argument_group("logs")
    lg.add_argument("--log-format", default="console", choices=["console", "json"],
                    help="console: one readable line per event; json: one JSON object per line with every field")
    lg.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                    help="info (default): start-up lines, the stats line, warnings and errors; debug adds the request lines")
    lg.add_argument("--log-requests", action="store_true",
                    help="a line per finished request, per role switch and per KV hand-off (also at --log-level debug)")
    lg.add_argument("--stats-interval-s", type=float, default=10.0, metavar="S",
                    help="the stats line (throughput, running and waiting requests, KV use, roles, switches) every S "
                         "seconds while there is traffic, none while idle (default: 10; 0: never)")
    add_stream_flags(p)
    p.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json", "mistral"],  # tool_parsers.PARSERS
                   help="reads tool calls of tool_choice auto (vLLM's names; default: the one the chat template names, if any)")
    g = p.add_argument_group("adaptive and time-shared modes")
    # colocated is the default since 2026-12-07: adaptive did not meet issue 43's targets on held-out
    # simulated cells and shifting traffic (docs/adaptive.md, "Why colocated is the default")
    g.add_argument("--mode", default="colocated", choices=["adaptive", "time-shared", "colocated", "pooled"],
                   help="colocated (default): mixed chunked-prefill batches under a fixed token budget "
                        "(--max-num-batched-tokens); adaptive: per device, decode, decode plus prompt chunks sized "
                        "online from the TPOT SLO, or a prefill window, whichever the cost model finds cheaper "
                        "(docs/adaptive.md); time-shared: devices switch between prefill and decode roles only; "
                        "pooled: fixed prefill and decode devices, KV handed over after prefill")
    g.add_argument("--prefill-devices", default=None, help="pooled mode: comma-separated prefill devices")
    g.add_argument("--decode-devices", default=None, help="pooled mode: comma-separated decode devices")
    g.add_argument("--link-gbps", type=float, default=None,
                   help="throttle KV moved between devices to this many Gb/s (emulates an interconnect)")
    g.add_argument("--max-retries", type=int, default=2,
                   help="recompute a sequence whose KV hand-off to a peer failed, or whose device's engine died, up "
                        "to this many times each, then fail it")
    g.add_argument("--imbalance-threshold", type=float, default=None,
                   help="time-shared fallback: move decoding sequences to another device when a prefill window would "
                        "make them miss --tpot-slo-ms, or when the slowest decoding device's estimated step exceeds "
                        "(1 + this) times the fastest's (0: off; default 1 in time-shared mode, 0 in adaptive mode, "
                        "where decode keeps flowing in MIXED steps and the moves cost more than they save)")
    g.add_argument("--max-unsent", type=int, default=64,
                   help="pooled mode: prompts in flight plus prefilled-but-unsent caches per prefill device")
    k = p.add_argument_group("KV transfer between nodes")
    k.add_argument("--node-id", default=None, help="this node's name for peers (default host:port)")
    k.add_argument("--kv-host", default=None, help="address of the KV transfer listener (default --host)")
    k.add_argument("--kv-port", type=int, default=None, help="listen for KV transfers from peers on this port")
    k.add_argument("--peers", default=None, help="comma-separated host:kv-port of nodes this node may send KV to")
    k.add_argument("--etcd", default=None, metavar="URL",
                   help="find peers through etcd (client URL, e.g. http://127.0.0.1:2379): this node registers its KV "
                        "endpoint under a lease of --etcd-lease-ttl-s and takes every other node under --etcd-prefix "
                        "with a KV listener as a peer, as they join and leave")
    k.add_argument("--etcd-prefix", default="/shiftnode/default", help="the deployment's key prefix in etcd")
    k.add_argument("--etcd-lease-ttl-s", type=float, default=10.0, help="a node killed without a clean stop leaves "
                   "every peer set within this long (at least 3 etcd keep-alive timeouts: 6 s)")
    k.add_argument("--advertise-host", default=None,
                   help="the address other nodes reach this node's KV listener at, as registered in etcd "
                        "(default --kv-host, else --host; the host name when that is a wildcard address)")
    k.add_argument("--peer-secret", default=os.environ.get("SHIFTNODE_PEER_SECRET"),
                   help="shared secret peers prove in the KV handshake (default $SHIFTNODE_PEER_SECRET)")
    k.add_argument("--kv-connect-timeout-s", type=float, default=5.0,
                   help="bound on opening a KV connection to a peer, and on its handshake (each)")
    k.add_argument("--kv-transfer-timeout-s", type=float, default=10.0,
                   help="bound on each wait inside a KV transfer (accept, every frame or payload chunk, commit) "
                        "and on a relay's silence (the receiver sends keep-alives every 2 s)")
    k.add_argument("--peer-stale-s", type=float, default=3.0,
                   help="a peer whose capacity report is older than this is not placed on")
    k.add_argument("--kv-transport", choices=("tcp", "nixl"), default="tcp",
                   help="how KV layers travel between nodes: tcp (the node's own data plane), or nixl (NIXL WRITEs "
                        "over UCX into the peer's registered KV pool; needs pip install 'shiftnode[nixl]'); the "
                        "handshake, offers, capacity reports and relays stay on the TCP channel, and a peer without "
                        "NIXL is sent to over TCP")
    g.add_argument("--reconfig-pause-ms", type=float, default=0.0, help="floor added to every role switch's measured cost")
    g.add_argument("--cost-model", default=None, metavar="PATH",
                   help="time-shared: the step-time model (bench/cost_models/*.json, linear or roofline) the role "
                        "policy plans with from the start; a linear one is refitted from measured steps, a roofline one "
                        "kept (default: CPU-sized coefficients, refitted; a timed device's own model)")
    g.add_argument("--ttft-slo-ms", type=float, default=1000.0, help="time-to-first-token target")
    g.add_argument("--tpot-slo-ms", type=float, default=100.0, help="time-per-output-token target")
    g.add_argument("--min-window-ms", type=float, default=20.0, help="shortest role window (hysteresis)")
    g.add_argument("--max-window-ms", type=float, default=500.0, help="longest prefill window")
    g.add_argument("--stagger", default="soft", choices=["hard", "soft", "off"],
                   help="keep another device decoding while one prefills (hard), unless a prompt is urgent (soft)")
    add_serving_arguments(p)


def _device_list(text: str | None) -> list[str]:
    return [d.strip() if ":" in d else f"{d.strip()}:0" for d in (text or "").split(",") if d.strip()]


_DEVICE = re.compile(r"^(cpu|cuda):(\d+)$")


def flag_errors(a: argparse.Namespace) -> str | None:
    """The first contradiction among the device and mode flags as given, or None.

    Checked before anything loads, so a wrong combination is one line at once rather than a flag
    silently ignored (``--devices`` in pooled mode) or an error after the model has loaded.
    """
    pooled_flags = [f for f, v in (("--prefill-devices", a.prefill_devices), ("--decode-devices", a.decode_devices)) if v]
    if a.mode != "pooled" and pooled_flags:
        verb = "needs" if len(pooled_flags) == 1 else "need"
        return f"{' and '.join(pooled_flags)} {verb} --mode pooled (the mode is {a.mode}, which takes --devices)"
    if a.mode == "pooled" and (a.devices or a.device):
        flag = "--devices" if a.devices else "--device"
        return (f"{flag} is not used with --mode pooled: name the devices with --prefill-devices and --decode-devices "
                f"(e.g. --prefill-devices cpu:0 --decode-devices cpu:1)")
    if a.device and a.devices:
        return "give --device or --devices, not both"
    prefill, decode = _device_list(a.prefill_devices), _device_list(a.decode_devices)
    both = sorted(set(prefill) & set(decode))
    if both:
        return f"{', '.join(both)} is in both --prefill-devices and --decode-devices; a device has one pool"
    for flag, text in (("--device", a.device), ("--devices", a.devices), ("--prefill-devices", a.prefill_devices),
                       ("--decode-devices", a.decode_devices)):
        for d in _device_list(text):
            if not _DEVICE.match(d):
                return f"{flag}: {d!r} is not a device (want cpu, cpu:N or cuda:N)"
    return _cuda_error(config_devices(a))


def _cuda_error(devices: list[str]) -> str | None:
    """Why a ``cuda:N`` device in ``devices`` cannot be used here, or None (torch is imported only if one is named)."""
    cuda = [d for d in devices if d.startswith("cuda:")]
    if not cuda:
        return None
    import torch

    if not torch.cuda.is_available():
        reason = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        return f"{cuda[0]} requested but CUDA is not available ({reason}); use cpu:N devices"
    count = torch.cuda.device_count()
    for d in cuda:
        if int(d.partition(":")[2]) >= count:
            return f"{d} requested but this machine has {count} CUDA device{'s' * (count != 1)} (cuda:0..cuda:{count - 1})"
    return None


def config_devices(a: argparse.Namespace) -> list[str]:
    """The devices a node of these flags runs on: the pooled lists, else ``--devices``/``--device`` (cpu:0)."""
    if a.mode == "pooled":
        return _device_list(a.prefill_devices) + _device_list(a.decode_devices)
    return _device_list(a.devices or a.device or "cpu:0")


def _sizes_arg(text: str) -> list[int]:
    """argparse type of ``--compile-sizes``: ``"1,2,4"`` → ``[1, 2, 4]``."""
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated integers expected, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"token counts of at least 1 expected, got {text!r}")
    return sizes


def config_from_args(a: argparse.Namespace) -> NodeConfig:
    prefill, decode = _device_list(a.prefill_devices), _device_list(a.decode_devices)
    devices = config_devices(a)
    return NodeConfig(
        model=a.model, served_model_name=a.served_model_name, load_format=a.load_format, devices=devices,
        dtype=a.dtype, host=a.host, port=a.port, api_key=a.api_key, max_model_len=a.max_model_len,
        block_size=a.block_size, kv_cache_memory_bytes=a.kv_cache_memory, gpu_memory_utilization=a.gpu_memory_utilization,
        max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens, max_queue=a.max_queue,
        request_timeout_s=a.request_timeout_s or None,  # 0: no bound
        engine_restart_max=a.engine_restart_max, engine_restart_window_s=a.engine_restart_window_s,
        engine_start_timeout_s=a.engine_start_timeout_s,
        seed=a.seed, attention_backend=a.attention_backend, log_format=a.log_format, mode=a.mode,
        log_level=a.log_level, log_requests=a.log_requests, stats_interval_s=a.stats_interval_s,
        cpu_threads=a.cpu_threads, cpu_weight_packing=a.cpu_weight_packing == "on",
        enforce_eager=a.enforce_eager, compile=a.compile, compile_sizes=a.compile_sizes, compile_wait=a.compile_wait,
        compile_cache_dir=a.compile_cache_dir, speculative_config=a.speculative_config,
        engine_layout=a.engine_layout, prefix_caching=a.prefix_caching,
        tensor_parallel_size=a.tensor_parallel_size, decode_tp=a.decode_tp, prefill_tp=a.prefill_tp,
        benchmark_model=a.benchmark_model, tool_call_parser=a.tool_call_parser, serving=serving_options_from_args(a),
        reconfig_pause_ms=a.reconfig_pause_ms, cost_model=a.cost_model, ttft_slo_ms=a.ttft_slo_ms, tpot_slo_ms=a.tpot_slo_ms,
        min_window_ms=a.min_window_ms, max_window_ms=a.max_window_ms, stagger=a.stagger,
        **stream_config(a),
        prefill_devices=prefill, decode_devices=decode, max_unsent=a.max_unsent, link_gbps=a.link_gbps,
        node_id=a.node_id, kv_host=a.kv_host, kv_port=a.kv_port, peer_secret=a.peer_secret,
        peers=[p.strip() for p in (a.peers or "").split(",") if p.strip()],
        etcd=a.etcd, etcd_prefix=a.etcd_prefix, etcd_lease_ttl_s=a.etcd_lease_ttl_s, advertise_host=a.advertise_host,
        max_retries=a.max_retries,
        imbalance_threshold=a.imbalance_threshold if a.imbalance_threshold is not None else (0.0 if a.mode == "adaptive" else 1.0),
        kv_connect_timeout_s=a.kv_connect_timeout_s, kv_transfer_timeout_s=a.kv_transfer_timeout_s,
        peer_stale_s=a.peer_stale_s, kv_transport=a.kv_transport,
    )



def run_serve(config: NodeConfig) -> int:
    """Validate, check the ports, then load and serve until stopped. Returns the exit status:
    0 after a clean stop, 2 for flags the node cannot run with, 1 when loading fails."""
    from node.config import ConfigError
    from node.ports import check_bindable

    try:  # before the heavy imports and the model load: a bad flag or a taken port is told at once
        config.validate()
        check_bindable(config.host, config.port, "--port")
        if config.kv_port:  # 0 is an ephemeral port: always free
            check_bindable(config.kv_host or config.host, config.kv_port, "--kv-port")
        if config.kv_transport == "nixl":
            from node.transport.nixl_agent import NixlUnavailable, load_nixl
            try:
                load_nixl()
            except NixlUnavailable as e:
                raise ConfigError(str(e)) from e
    except ConfigError as e:
        print(f"shiftnode: cannot start: {e}", file=sys.stderr)
        return 2

    import uvloop
    from node.api import serving
    from node.log import configure_logging
    from node.worker.loader import StartupError
    from node.worker.model_config import ModelConfigError
    from node.worker.tokenizer import TokenizerError
    from node.worker.weights import WeightLoadError

    from node.worker.engine_group import prelaunch

    if max(config.tensor_parallel_size, config.decode_tp, config.prefill_tp) > 1:  # before any rank starts
        from node.runtime.startup import check_tp_degrees
        from node.worker.model_config import ModelConfig

        try:
            check_tp_degrees(config, ModelConfig.from_folder(config.model))
        except StartupError as e:
            print(f"shiftnode: cannot start: {e}", file=sys.stderr)
            return 2
        except (ModelConfigError, OSError):
            pass  # reported with its context by the load below
    configure_logging(config.log_format, config.log_level, config.log_requests)
    frontends = None
    if config.api_processes > 1:  # forked first: no front end may hold an engine's socket open
        from node.api.frontend import launch_frontends

        frontends = launch_frontends(config, config.api_processes)
    prelaunched = prelaunch(config)  # forked now: before the event loop and any torch work in this process
    from node.api.app import create_app  # after the fork: its imports overlap the engines' start-up
    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    app = create_app(config, prelaunched=prelaunched)
    where = {"host": config.host, "port": config.port}
    if frontends is not None:  # the front ends listen on --port; this process's app answers them on a unix socket
        from node.api.frontend_link import link_ctx
        from node.api.openai import NODE_KEY

        app.cleanup_ctx.append(link_ctx(frontends.paths.link, frontends.procs, NODE_KEY, frontends.respawn,
                                        config.api_heartbeat_timeout_s))
        where = {"path": frontends.paths.http}
    try:
        serving.run(app, **where, loop=loop, shutdown_timeout=5,
                    on_ready=lambda: print(f"shiftnode: serving on http://{config.host}:{config.port}"
                                           + (f" ({config.api_processes} API processes)" if frontends else ""),
                                           file=sys.stderr))
    except (StartupError, ModelConfigError, WeightLoadError, TokenizerError, OSError) as e:
        print(f"shiftnode: cannot start: {e}", file=sys.stderr)
        return 1
    finally:
        if frontends is not None:
            frontends.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shiftnode", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser(sub)
    sub.add_parser("plan", help="KV/weight capacity arithmetic for a config (see 'shiftnode plan --help')", add_help=False)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plan"]:
        from node.plan import main as plan_main

        return plan_main(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "serve":
        problem = flag_errors(args)
        if problem:
            print(f"shiftnode: cannot start: {problem}", file=sys.stderr)
            return 2
        return run_serve(config_from_args(args))
    return 2


if __name__ == "__main__":
    sys.exit(main())
