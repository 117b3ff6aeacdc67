"""The node's configuration (built from argv by ``node.cli``)."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from node.identity import default_node_id, is_host_port, is_own_kv_address
from node.core.spec_config import SpeculativeConfig
from node.serving_options import ServingOptions


ETCD_KEEPALIVE_TIMEOUT_S = 2.0  # each etcd lease keep-alive call; a slower one is tried again (node.runtime.membership)
RELAY_KEEPALIVE_S = 2.0  # a peer relaying tokens sends a keep-alive after this much silence
DEFAULT_REQUEST_TIMEOUT_S = 600.0  # a finite default deadline: a wedged path cannot hold a request (and its KV) for good
MODES = ("adaptive", "time-shared", "colocated", "pooled")
ROLE_MODES = ("adaptive", "time-shared")  # devices switch roles under a pure role policy
EMBEDDED_MODEL = str(Path(__file__).resolve().parent / "models" / "stories260k")  # package data: the default --model


class ConfigError(ValueError):
    """A flag value the node cannot run with."""


def group_id(devices: list[str]) -> str:
    """The device id of a tensor-parallel group in the node (``/v1/node``, metrics, logs): its devices
    joined by ``+`` (``cpu:0+cpu:1``); a single device's own id."""
    return "+".join(devices)


class NodeConfig(msgspec.Struct, kw_only=True):
    """Everything a node needs to start. Units are in the names (bytes, ms, tokens).

    ``model`` defaults to the embedded model (:data:`EMBEDDED_MODEL`, stories260k, real weights).
    """

    model: str = EMBEDDED_MODEL
    served_model_name: str | None = None
    load_format: str = "auto"  # auto, safetensors (read --model's weights) | dummy (random weights of its geometry)
    devices: list[str] = msgspec.field(default_factory=lambda: ["cpu:0"])
    dtype: str = "auto"
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_model_len: int | None = None
    block_size: int = 16
    prefix_caching: bool = True  # reuse cached full KV blocks of repeated prefixes (--no-prefix-caching: off)
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_queue: int = 1024
    # a request still running after this long (s) ends with an error and frees its KV; None or 0: no bound
    request_timeout_s: float | None = DEFAULT_REQUEST_TIMEOUT_S
    max_body_bytes: int = 16 * 1024 * 1024
    # a dead engine process (or tensor-parallel group) is started again, with backoff, unless it has been
    # restarted this many times within engine_restart_window_s (a crash loop: left down); 0: never restart
    engine_restart_max: int = 5
    engine_restart_window_s: float = 600.0
    # a restarted engine that has not loaded after this long (s) is killed and counts as a failed start; 0: no bound
    engine_start_timeout_s: float = 600.0
    seed: int = 0
    log_format: str = "console"
    log_level: str = "info"  # debug | info | warning | error
    log_requests: bool = False  # per-request and per-switch lines (node.log.request_lines: also at --log-level debug)
    stats_interval_s: float = 10.0  # the stats line's period while there is traffic (node.runtime.stats_log); 0: none
    attention_backend: str = "auto"  # auto | torch | cpu | triton
    cpu_threads: int | None = None  # intra-op threads per CPU engine; None: timed at start-up (node.worker.cpu_threads)
    cpu_weight_packing: bool = True  # CPU projections on oneDNN-packed weights (node.worker.cpu_linear); False: F.linear
    enforce_eager: bool = False  # no CUDA-graph decode (graphs are used on CUDA with the triton backend otherwise)
    # auto | none | inductor: torch.compile the forward per token-count bucket (node.worker.loader.attach_compiled_forward;
    # auto: in the background on CPU engines of dispatch-bound models); shiftnode serve's default is node.cli.DEFAULT_COMPILE
    compile: str = "none"
    compile_sizes: list[int] | None = None  # the buckets of --compile (None: the compiled runner's default buckets)
    compile_wait: bool = False  # compile every bucket before serving (else, on CPU engines, in the background)
    compile_cache_dir: str | None = None  # compiled artifacts (node.worker.compile_cache); None: ~/.cache/shiftnode
    speculative_config: SpeculativeConfig | None = None  # --speculative-config (node.core.spec_config); None: off
    tensor_parallel_size: int = 1  # colocated: devices per engine, --devices grouped in consecutive runs of this many
    decode_tp: int = 1  # time-shared: devices per group, one instance in the decode role; pooled: the decode pool's degree
    prefill_tp: int = 1  # time-shared: devices per instance in the prefill role (divides decode_tp); pooled: the prefill pool's
    engine_layout: str = "process"  # process: one engine process per device | thread: in the node's process (debugging, bench baseline)
    benchmark_model: str | None = None  # bench tool, not for serving: "zero" (fixed logits, no compute) | "sleep:MS" (each step sleeps MS ms) | "timed:PATH" (a cost model's step times)
    mode: str = "time-shared"  # colocated (shiftnode serve's default) | adaptive | time-shared | pooled
    prefill_devices: list[str] = msgspec.field(default_factory=list)  # pooled mode
    decode_devices: list[str] = msgspec.field(default_factory=list)  # pooled mode
    max_unsent: int = 64  # pooled: prompts in flight plus prefilled-but-unsent caches per prefill device
    link_gbps: float | None = None  # emulated link for KV moved between devices or nodes (Gb/s); None: unthrottled
    node_id: str | None = None  # name in peer handshakes and logs (default: NodeConfig.name)
    kv_host: str | None = None  # KV transfer listener (default: --host)
    kv_port: int | None = None  # KV transfer listener port; None: this node accepts no KV from peers
    peers: list[str] = msgspec.field(default_factory=list)  # host:kv_port of nodes this node may send KV to
    etcd: str | None = None  # etcd client URL: register under a lease and take the other nodes found there as peers
    etcd_prefix: str = "/shiftnode/default"  # one deployment's key prefix in etcd
    etcd_lease_ttl_s: float = 10.0  # the registration's lease: at least 3 ETCD_KEEPALIVE_TIMEOUT_S (node.runtime.membership)
    advertise_host: str | None = None  # the address peers reach this node's KV listener at (default: --kv-host/--host)
    peer_secret: str | None = None  # shared secret both ends of a KV connection prove (HMAC challenge)
    max_retries: int = 2  # recomputes of a sequence whose KV hand-off failed, or whose engine died (each), before an error
    kv_connect_timeout_s: float = 5.0  # opening a KV connection, and its handshake (each)
    kv_transfer_timeout_s: float = 10.0  # each wait inside a transfer (accept, frame/chunk, commit); relay silence
    peer_stale_s: float = 3.0  # a peer whose last capacity report is older is not placed on
    kv_transport: str = "tcp"  # how KV layers travel between nodes: tcp, or nixl (NIXL WRITEs; TCP stays the control channel)
    imbalance_threshold: float = 1.0  # time-shared fallback trigger (see node.core.imbalance); 0: off
    reconfig_pause_ms: float = 0.0  # floor added to every measured role switch
    cost_model: str | None = None  # time-shared: the step-time model JSON the role policy starts from (either kind)
    ttft_slo_ms: float = 1000.0
    tpot_slo_ms: float = 100.0
    min_window_ms: float = 20.0
    max_window_ms: float = 500.0
    stagger: str = "soft"  # hard | soft | off (see node.core.roles)
    stream_interval: int = 1  # a stream's event carries at least this many new tokens (the first token and the end go at once)
    sse_keepalive_s: float = 10.0  # comment lines on a stream silent this long (e.g. through a role switch)
    sse_buffer_bytes: int = 1 << 20  # backpressure (node/api/sse.py): a client with more unsent gets its deltas joined
    sse_stall_bytes: int = 64 << 20  # a client with more unsent and held is aborted as stalled (its KV freed)
    sse_stall_s: float = 60.0  # a client above sse_buffer_bytes that acknowledges nothing this long: aborted, too
    body_timeout_s: float = 30.0  # a request body slower than this is answered 408
    tool_call_parser: str | None = None  # reads tool calls of tool_choice "auto" (node.api.tool_parsers); None: refused
    api_processes: int = 1  # HTTP front-end processes (node.api.frontend); 1: the API runs in the node's process
    api_heartbeat_timeout_s: float = 10.0  # a front end silent this long (loop stuck, process stopped) is killed and restarted
    serving: ServingOptions = msgspec.field(default_factory=ServingOptions)  # chat template, reasoning, CORS, policy

    def is_own_kv_address(self, addr: str) -> bool:
        """Whether peer address ``addr`` is this node's own KV listener (:func:`node.identity.is_own_kv_address`)."""
        return is_own_kv_address(addr, self.kv_port, (self.kv_host, self.host, self.advertise_host))

    def validate(self) -> None:
        """Check values that would otherwise start a node that cannot serve.

        Raises:
            ConfigError: naming the flag and the accepted range.
        """
        checks = [
            (1 <= self.port <= 65535, f"--port must be in [1, 65535], got {self.port}"),
            (self.max_num_seqs >= 1, f"--max-num-seqs must be at least 1, got {self.max_num_seqs}"),
            (self.max_num_batched_tokens >= 1, f"--max-num-batched-tokens must be at least 1, got {self.max_num_batched_tokens}"),
            (self.max_queue >= 1, f"--max-queue must be at least 1, got {self.max_queue}"),
            (self.request_timeout_s is None or self.request_timeout_s >= 0, f"--request-timeout-s must be positive (0: no bound), got {self.request_timeout_s}"),
            (self.engine_restart_max >= 0, f"--engine-restart-max must be at least 0 (0: never restart), got {self.engine_restart_max}"),
            (self.engine_restart_window_s > 0, f"--engine-restart-window-s must be positive, got {self.engine_restart_window_s}"),
            (self.engine_start_timeout_s >= 0, f"--engine-start-timeout-s must be at least 0 (0: no bound), got {self.engine_start_timeout_s}"),
            (self.max_model_len is None or self.max_model_len >= 2, f"--max-model-len must be at least 2, got {self.max_model_len}"),
            (1 <= self.block_size <= 1024, f"--block-size must be in [1, 1024], got {self.block_size}"),
            (self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0, "--kv-cache-memory must be positive"),
            (0.0 < self.gpu_memory_utilization <= 1.0, f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}"),
            (len(set(self.devices)) == len(self.devices) and self.devices, f"--devices must list distinct devices, got {self.devices}"),
            (self.engine_layout in ("process", "thread"), f"--engine-layout must be process or thread, got {self.engine_layout!r}"),
            (_benchmark_model_error(self.benchmark_model) is None, _benchmark_model_error(self.benchmark_model)),
            (_cost_file_error("--cost-model", self.cost_model) is None, _cost_file_error("--cost-model", self.cost_model)),
            (self.cost_model is None or self.role_policy, f"--cost-model seeds the role policy (adaptive and time-shared modes): not with --mode {self.mode}"),
            (self.timed_error() is None, self.timed_error()),
            (self.tensor_parallel_error() is None, self.tensor_parallel_error()),
            (self.mode in MODES, f"--mode must be adaptive, time-shared, colocated or pooled, got {self.mode!r}"),
            (self.mode != "pooled" or bool(self.prefill_devices or self.decode_devices),
             "--mode pooled needs --prefill-devices and/or --decode-devices"),
            (self.mode != "pooled" or bool(self.decode_devices) or bool(self.peers) or bool(self.etcd),
             "--mode pooled with only --prefill-devices needs --peers or --etcd (to find the decode nodes)"),
            (self.mode != "pooled" or bool(self.prefill_devices) or self.kv_port is not None,
             "--mode pooled with only --decode-devices needs --kv-port (prefill nodes send KV to it)"),
            (not (self.peers or self.kv_port is not None or self.etcd) or bool(self.peer_secret),
             "--peers, --kv-port and --etcd need --peer-secret (or SHIFTNODE_PEER_SECRET)"),
            (not self.etcd or self.etcd.startswith(("http://", "https://")),
             f"--etcd must be an http:// or https:// client URL, got {self.etcd!r}"),
            (not self.etcd or self.mode != "colocated", "--etcd is for the adaptive, time-shared and pooled modes"),
            (self.etcd_lease_ttl_s >= 3 * ETCD_KEEPALIVE_TIMEOUT_S, f"--etcd-lease-ttl-s must be at least 3 keep-alive "
             f"timeouts ({3 * ETCD_KEEPALIVE_TIMEOUT_S:g} s), got {self.etcd_lease_ttl_s}: a shorter lease flaps under load"),
            (self.kv_port is None or 0 <= self.kv_port <= 65535, f"--kv-port must be in [0, 65535], got {self.kv_port}"),
            (all(is_host_port(p) for p in self.peers), f"--peers must be host:port entries, got {self.peers}"),
            (not self.peers or self.mode != "colocated", "--peers is for pooled and time-shared modes"),
            (not [p for p in self.peers if self.is_own_kv_address(p)],
             f"--peers names this node's own KV address ({', '.join(p for p in self.peers if self.is_own_kv_address(p))}, "
             f"--kv-port {self.kv_port}): a node cannot be its own peer"),
            (self.max_retries >= 0, "--max-retries must be at least 0"),
            (self.kv_connect_timeout_s > 0, f"--kv-connect-timeout-s must be positive, got {self.kv_connect_timeout_s}"),
            (self.kv_transfer_timeout_s > RELAY_KEEPALIVE_S,
             f"--kv-transfer-timeout-s must exceed the {RELAY_KEEPALIVE_S:g} s relay keep-alive, got {self.kv_transfer_timeout_s}"),
            (self.peer_stale_s > 0, f"--peer-stale-s must be positive, got {self.peer_stale_s}"),
            (self.kv_transport in ("tcp", "nixl"), f"--kv-transport must be tcp or nixl, got {self.kv_transport!r}"),
            (self.kv_transport == "tcp" or bool(self.peers or self.kv_port is not None or self.etcd),
             "--kv-transport nixl moves KV between nodes: it needs --kv-port, --peers or --etcd"),
            (self.imbalance_threshold >= 0, "--imbalance-threshold must be at least 0 (0 turns the fallback off)"),
            (self.max_unsent >= 1, "--max-unsent must be at least 1"),
            (self.link_gbps is None or self.link_gbps > 0, "--link-gbps must be positive"),
            (self.reconfig_pause_ms >= 0 and self.ttft_slo_ms > 0 and self.tpot_slo_ms > 0, "pause and SLO values must be positive"),
            (0 < self.min_window_ms <= self.max_window_ms, "need 0 < --min-window-ms <= --max-window-ms"),
            (self.compile in ("auto", "none", "inductor"), f"--compile must be auto, none or inductor, got {self.compile!r}"),
            (self.compile_sizes is None or (bool(self.compile_sizes) and min(self.compile_sizes) >= 1),
             f"--compile-sizes must list token counts of at least 1, got {self.compile_sizes}"),
            (self.stream_interval >= 1, f"--stream-interval must be at least 1, got {self.stream_interval}"),
            (self.sse_keepalive_s > 0 and self.body_timeout_s > 0, "--sse-keepalive-s and --body-timeout-s must be positive"),
            (0 < self.sse_buffer_bytes < self.sse_stall_bytes and self.sse_stall_s > 0, "need 0 < --sse-buffer-bytes < --sse-stall-bytes and a positive --sse-stall-s"),
            (1 <= self.api_processes <= 64, f"--api-processes must be in [1, 64], got {self.api_processes}"),
            (self.log_level in ("debug", "info", "warning", "error"), f"--log-level must be debug, info, warning or error, got {self.log_level!r}"),
            (self.stats_interval_s >= 0, f"--stats-interval-s must be at least 0 (0: no stats line), got {self.stats_interval_s}"),
            (self.api_heartbeat_timeout_s > 1.0,  # several WATCH_S pings fit in it
             f"--api-heartbeat-timeout-s must exceed 1 s, got {self.api_heartbeat_timeout_s}"),
            (self.cpu_threads is None or 1 <= self.cpu_threads <= 1024, f"--cpu-threads must be in [1, 1024], got {self.cpu_threads}"),
            (self.speculative_config is None or self.speculative_config.error() is None, self.speculative_config and self.speculative_config.error()),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

    @property
    def role_policy(self) -> bool:
        """Devices switch roles under a pure role policy: adaptive (:mod:`node.core.adaptive`) or
        time-shared (:mod:`node.core.roles`) mode; both run time-shared groups and their role configurations."""
        return self.mode in ROLE_MODES

    @property
    def group_size(self) -> int:
        """Devices per engine group: ``--decode-tp`` in adaptive and time-shared modes,
        ``--tensor-parallel-size`` otherwise (1: every device is its own engine)."""
        return self.decode_tp if self.role_policy else self.tensor_parallel_size

    def role_configs(self) -> dict:
        """Each role's execution configuration (:class:`node.core.role_config.RoleConfig`) by role name:
        ``prefill`` and ``decode`` in time-shared mode, ``mixed`` otherwise."""
        from node.core.role_config import RoleConfig, time_shared_roles

        # decode graphs: CUDA devices, the triton backend, no --enforce-eager, no benchmark model (loader)
        graphs = (not self.enforce_eager and not self.benchmark_model and self.attention_backend in ("auto", "triton")
                  and all(d.startswith("cuda") for d in self.devices))
        if self.role_policy:
            roles = time_shared_roles(self.decode_tp, self.prefill_tp, self.max_num_batched_tokens, self.max_num_seqs,
                                      cuda_graphs=graphs)
            if self.mode == "adaptive":  # MIXED: the decode configuration, its steps carrying prompt chunks
                roles["mixed"] = RoleConfig("mixed", self.decode_tp, 1, self.max_num_batched_tokens,
                                            cuda_graphs=roles["decode"].cuda_graphs)
            return roles
        return {"mixed": RoleConfig("mixed", self.group_size, 1, self.max_num_batched_tokens,
                                    cuda_graphs=graphs and self.group_size == 1)}

    def tensor_parallel_error(self) -> str | None:
        """Why the tensor-parallel flags cannot run with the other flags, or None (always None at 1).

        ``--tensor-parallel-size D`` runs a group of ``D`` devices as one engine in colocated mode;
        ``--decode-tp D --prefill-tp P`` runs time-shared groups of ``D`` devices (one instance at ``D``
        in the decode role, ``D / P`` instances at ``P`` in the prefill role), and in pooled mode a
        prefill pool of groups of ``P`` and a decode pool of groups of ``D`` (hand-offs re-shard the KV
        heads). KV transfers of a group's (sharded) pool to peers, the thread layout and the benchmark
        models come later. The model's side (heads, KV heads, intermediate size
        divisible by the degrees) is checked once its config is read
        (:meth:`node.runtime.node.Node.create`).
        """
        for flag, v in (("--tensor-parallel-size", self.tensor_parallel_size), ("--decode-tp", self.decode_tp),
                        ("--prefill-tp", self.prefill_tp)):
            if not isinstance(v, int) or v < 1:
                return f"{flag} must be a positive integer, got {v!r}"
        if self.tensor_parallel_size > 1 and self.mode != "colocated":
            return (f"--tensor-parallel-size {self.tensor_parallel_size} is colocated mode's degree (the mode is "
                    f"{self.mode}): time-shared and pooled modes take --decode-tp and --prefill-tp")
        if (self.decode_tp > 1 or self.prefill_tp > 1) and self.mode == "colocated":
            return ("--decode-tp and --prefill-tp are the per-role degrees of time-shared and pooled modes (the mode "
                    "is colocated): colocated mode takes --tensor-parallel-size")
        if self.role_policy and self.decode_tp % self.prefill_tp:
            return (f"--prefill-tp {self.prefill_tp} must divide --decode-tp {self.decode_tp} (a group of "
                    f"{self.decode_tp} devices prefills as --decode-tp / --prefill-tp instances)")
        if self.mode == "pooled":
            runs = [("--prefill-tp", self.prefill_tp, "--prefill-devices", self.prefill_devices),
                    ("--decode-tp", self.decode_tp, "--decode-devices", self.decode_devices)]
        else:
            flag = "--decode-tp" if self.role_policy else "--tensor-parallel-size"
            runs = [(flag, self.group_size, "--devices", self.devices)]
        if all(d == 1 for _, d, _, _ in runs):
            return None
        for flag, d, where, devices in runs:
            if len(devices) % d:
                return (f"{flag} {d} groups {where} in consecutive runs of {d}, but {len(devices)} "
                        f"device{'s' * (len(devices) != 1)} ({','.join(devices)}) is not a multiple of {d}")
        flag = " / ".join(f"{f} {d}" for f, d, _, _ in runs if d > 1)
        for group in self.device_groups():
            kinds = {dev.partition(":")[0] for dev in group}
            if len(kinds) > 1:
                return f"a tensor-parallel group mixes device kinds ({'+'.join(group)}): one group is all cpu or all cuda"
        if self.engine_layout != "process":
            return f"{flag} needs --engine-layout process (each rank is its own engine process)"
        if self.benchmark_model:
            return f"--benchmark-model is not supported with {flag} yet"
        if self.kv_port is not None or self.peers:
            return (f"--kv-port and --peers are not supported with {flag} yet: KV transfers "
                    f"of a tensor-parallel group's sharded KV pool come later")
        return None

    def timed_error(self) -> str | None:
        """Why ``--benchmark-model timed:PATH`` cannot run with the other flags, or None.

        A timed device allocates a pool of a few bytes per block, so its KV budget (and thus its block
        count) must be given: ``--kv-cache-memory``, the emulated device's KV bytes. KV to peers over
        TCP would carry that tiny pool's layout, not the geometry's: timed devices move KV between the
        node's own devices only (no ``--peers``, ``--kv-port`` or ``--peer-secret`` outside colocated mode).
        """
        if benchmark_cost_path(self.benchmark_model) is None:
            return None
        if self.kv_cache_memory_bytes is None:
            return ("--benchmark-model timed:PATH needs --kv-cache-memory (the emulated device's KV cache bytes, "
                    "e.g. 60GiB): its block count is that budget over the geometry's KV bytes per block")
        if self.peers or self.kv_port is not None or (self.peer_secret and self.mode != "colocated"):
            return ("--benchmark-model timed:PATH moves KV between this node's devices only: not with --peers, "
                    "--kv-port or --peer-secret (KV over TCP is not emulated at the geometry's size)")
        return None

    @property
    def policy_cost_model(self) -> str | None:
        """The cost-model file the time-shared policy starts from: ``--cost-model``, else a timed
        device's own, else None (CPU-sized defaults)."""
        return self.cost_model or benchmark_cost_path(self.benchmark_model)

    def device_groups(self) -> list[list[str]]:
        """``devices`` in consecutive groups of :attr:`group_size` (each one engine, one
        ``DeviceEngine``); one device per group at size 1. Pooled mode: ``--prefill-devices`` in groups
        of ``--prefill-tp``, then ``--decode-devices`` in groups of ``--decode-tp``."""
        if self.mode == "pooled":
            return self._runs(self.prefill_devices, self.prefill_tp) + self._runs(self.decode_devices, self.decode_tp)
        return self._runs(self.devices, self.group_size)

    @staticmethod
    def _runs(devices: list[str], d: int) -> list[list[str]]:
        d = max(1, d)
        return [devices[i : i + d] for i in range(0, len(devices), d)]

    def prefill_group_ids(self) -> list[str]:
        """Pooled mode: the device ids of the prefill pool's groups (``cpu:0+cpu:1``; single devices as named)."""
        return [group_id(g) for g in self._runs(self.prefill_devices, self.prefill_tp)]

    def decode_group_ids(self) -> list[str]:
        """Pooled mode: the device ids of the decode pool's groups."""
        return [group_id(g) for g in self._runs(self.decode_devices, self.decode_tp)]

    @property
    def name(self) -> str:
        """This node's id in peer handshakes, etcd and logs: ``--node-id``, else :func:`node.identity.default_node_id`."""
        return self.node_id or default_node_id(self.host, self.port)

    @property
    def model_name(self) -> str:
        """The id clients name the model by (``/v1/models``): ``--served-model-name``, else the folder's name."""
        if self.served_model_name:
            return self.served_model_name
        return self.model.rstrip("/").split("/")[-1]


_BENCHMARK_KINDS = "'zero', 'sleep:MS' (MS milliseconds >= 0) or 'timed:PATH' (PATH a cost-model JSON file)"


def benchmark_sleep_ms(value: str) -> float:
    """``--benchmark-model`` value → milliseconds each step sleeps: ``"zero"`` → 0.0, ``"sleep:MS"`` → MS,
    ``"timed:PATH"`` → 0.0 (its steps are paced by the cost model instead, :func:`benchmark_cost_path`).

    Raises:
        ConfigError: any other value, or MS not a finite number >= 0.
    """
    kind, sep, ms = value.partition(":")
    if value == "zero" or benchmark_cost_path(value) is not None:
        return 0.0
    try:
        sleep_ms = float(ms) if kind == "sleep" and sep else -1.0
    except ValueError:
        sleep_ms = -1.0
    if not 0.0 <= sleep_ms < 1e6:
        raise ConfigError(f"--benchmark-model must be {_BENCHMARK_KINDS}, got {value!r}")
    return sleep_ms


def benchmark_cost_path(value: str | None) -> str | None:
    """The cost-model path of ``--benchmark-model timed:PATH`` (a timed device), else None."""
    if value is None or not value.startswith("timed:"):
        return None
    return value.removeprefix("timed:")


def _cost_file_error(flag: str, path: str | None) -> str | None:
    """Why the cost-model file a flag names cannot be read, or None (no file named)."""
    if path is None:
        return None
    from node.timed_cost import CostFileError, load_step_cost

    try:
        load_step_cost(path)
    except CostFileError as e:
        return f"{flag}: {e}"
    return None


def _benchmark_model_error(value: str | None) -> str | None:
    """Why ``--benchmark-model value`` is refused, or None (a ``timed:PATH`` file is read here)."""
    try:
        value is None or benchmark_sleep_ms(value)
    except ConfigError as e:
        return str(e)
    path = benchmark_cost_path(value)
    if path == "":
        return f"--benchmark-model must be {_BENCHMARK_KINDS}, got {value!r}"
    return _cost_file_error(f"--benchmark-model {value}", path)


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask where the platform has one, else the count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

