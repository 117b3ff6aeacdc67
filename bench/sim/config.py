"""What a simulated deployment is: its mode, devices, memory, link and policy knobs.

KV geometry comes from the planner (:mod:`node.plan`): ``kv_bytes_per_token`` from a model's
``config.json`` and dtype, and the blocks per device either from a KV byte budget
(``bytes // (block_size * kv_bytes_per_token)``, as the node sizes its pool) or from the device memory
left beside the weights (:func:`node.plan.kv_token_capacity`).
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.traffic.clients import DEFAULT_CLIENT_MIX, TRUE_LENGTH, parse_client_mix
from node.plan import DTYPE_BYTES, Geometry, kv_bytes_per_token, kv_token_capacity, param_count

__all__ = ["CONTROL_COST_US", "MODES", "ORACLES", "PLANNING", "SimAborted", "SimConfig", "kv_geometry", "count_late"]

PLANNING = ("refit", "perturbed", "exact")
# CPU time of one role-policy decision round on the node's loop, per mode: (µs per round, µs per resident
# sequence), measured with `python -m bench.sim.control_cost --rate 20 --duration 5` (8B H200 roofline, azure-code,
# 8 devices; adaptive's figures agree at 50 req/s: 123 + 5.5) on the 2-core sandbox CPU (SimConfig.control_round_us)
CONTROL_COST_US = {"adaptive": (120.0, 5.3), "time-shared": (66.0, 2.1)}
# Every oracle the simulator had before issue 43, for comparisons and for tests pinned on figures computed
# with them: SimConfig(**ORACLES, ...). (expected_output stays "node": with max_tokens = the true length and
# ignore_eos, nothing ends by EOS, so the node's estimate stays at its prior and gives min(output, 128), the old
# "node" figure; expected_output="oracle" is the true length.)
ORACLES = dict(client_max_tokens=TRUE_LENGTH, planning="exact", control_round_us=0.0, control_per_resident_us=0.0,
               group_decode_graphs=True, copy_rate=1.0, copy_slowdown=0.0)

MODES = ("time-shared", "colocated", "pooled", "adaptive")
ROLE_MODES = ("time-shared", "adaptive")  # a role policy over time-shared groups (the node's role driver)


class SimAborted(RuntimeError):
    """A run stopped early: ``abort_late`` requests were certainly going to miss the TTFT SLO."""


def count_late(arrivals, now_s: float, ttft_slo_s: float, limit: int) -> int:
    """How many of ``arrivals`` (seconds, oldest first) are older than ``ttft_slo_s`` at ``now_s``;
    counts up to ``limit`` only."""
    n = 0
    for a in arrivals:
        if now_s - a <= ttft_slo_s or n >= limit:
            break
        n += 1
    return n


@dataclass(frozen=True)
class SimConfig:
    """One simulated deployment (per node; ``nodes`` identical nodes share the requests round-robin).

    Attributes:
        mode: time-shared | colocated | pooled | adaptive (the adaptive role policy,
            :mod:`node.core.adaptive`, on the time-shared devices; its knobs are the time-shared ones).
        devices: devices per node; pooled splits them into ``prefill_devices`` and the rest decode.
        kv_blocks, block_size: KV pool per device (blocks of ``block_size`` tokens).
        kv_bytes_per_token: KV of one token over all layers (bytes), for pooled transfers.
        link_gbps: per prefill device link rate for KV transfers inside a node (Gb/s, line rate).
        pool_scope: pooled only. ``node``: every node splits its own devices into
            ``prefill_devices`` + the rest and KV moves inside the node over ``link_gbps``;
            ``cluster``: one pool over all nodes, the first ``prefill_nodes`` nodes prefill only,
            the others decode only, and KV crosses nodes over ``internode_gbps``.
        prefill_nodes: pooled, cluster scope: nodes whose devices all prefill (default half).
        internode_gbps: pooled, cluster scope: each device's network link (one NIC per device, as
            GPU-direct RDMA nodes have; Gb/s, line rate). A KV transfer between nodes holds the
            source device's link and the destination device's link for its whole duration.
        transfer: pooled. ``overlap`` (the node's hand-offs, ``DeviceEngine.migrate(overlap=True)``):
            the copy runs on the link alone and the prefill device goes on; ``blocking``: the prefill
            device runs no step while it sends a KV cache (the node's copies before they overlapped).
        max_unsent: pooled: prompts in flight plus unsent caches per prefill device (the node's
            ``--max-unsent``, the :class:`node.core.pooled.PooledRouter` bound).
        step_overhead_ms: host time added to every step (the node's shell around a model step:
            batch forming, thread hop, output processing), on top of the cost model.
        request_overhead_ms: time from a client's send to the node's scheduler (HTTP, parsing,
            validation, first-chunk delivery): every request reaches the node this much after its
            arrival, so its TTFT grows by it and its TPOT does not.
        pause_ms: time-shared: a role switch's pause when the cost model's ``pause_s`` and the
            ``reconfig_pause_ms`` floor are smaller (the switch's measured swap on the live node).
        max_num_batched_tokens: per-step token budget (chunked prefill; the prefill budget in
            time-shared mode), as the node's ``--max-num-batched-tokens``.
        client_max_tokens: what clients send as ``max_tokens`` (:mod:`bench.traffic.clients`): a mix
            ``VALUE:SHARE,...`` drawn per request with ``client_seed`` (default 60 % at 4,096, 30 % at 1,024,
            10 % absent: the context left beside the prompt), each request ending by an EOS the node does not
            foresee at its true length (the trace's) or at its bound; ``true``: the oracle, ``max_tokens`` =
            the true length with ``ignore_eos`` (the simulator before issue 43).
        client_seed: seed of the ``max_tokens`` draws.
        expected_output: what placement and the role policies are told of each output length: ``node``
            (the node's own estimate, ``min(max_tokens, running estimate)``: the same
            :class:`node.core.output_estimate.OutputEstimator`, fed by the requests that ended by EOS) or
            ``oracle`` (the length the request will produce).
        planning: the cost model the role policies (time-shared, adaptive) plan with; steps are always
            timed by the true one. ``refit``: the node's start-up model
            (``node.runtime.role_policy.DEFAULT_CPU_COST``) refitted online from the simulated step times by
            the node's own code (:class:`node.core.online_refit.OnlineRefit`; a roofline start would be
            kept as it is, so the live node without ``--policy-cost-model`` is what this runs), the pause
            the mean measured one; ``perturbed``: the true model with each hardware coefficient off by
            ``cost_error`` (sign seeded by ``cost_error_seed``; :func:`bench.sim.planning.perturbed`);
            ``exact``: the true model (the oracle).
        cost_error, cost_error_seed: ``planning="perturbed"``: the relative error of every coefficient
            (0.2: each 20 % high or low) and the seed of their signs.
        control_round_us, control_per_resident_us: CPU time of one decision round of a role policy on the
            node's event loop (µs, plus µs per resident sequence): decisions and step sends wait for it,
            and rounds asked for while it runs are coalesced into one when it ends. None: the mode's
            figures measured on the 2-core sandbox CPU with :mod:`bench.sim.control_cost` (the real policy
            objects' snapshot and decide calls, CPU time; :data:`CONTROL_COST_US`); 0 and 0: free
            decisions (the oracle). Pooled and colocated placement is not charged.
        group_decode_graphs: tensor-parallel groups (degree > 1) replay decode CUDA graphs. The live node
            captures decode graphs for single-device instances only (``node.core.role_config``: a group's
            steps run eagerly), so False (default) runs their decode steps eagerly
            (:class:`bench.sim.parallel.ParallelModel`); True is the oracle.
        copy_rate: KV copies (moves, hand-offs, pooled transfers) run at this fraction of ``link_gbps``
            / ``internode_gbps`` (an assumed 0.8: no GPU copy rate is measured in this project; the CPU
            NIXL/TCP figures of bench/RESULTS.md are not GPU ones). The policies are still told the link's
            rate, as the node is by ``--link-gbps``.
        copy_slowdown: steps that start on a device while a copy from or to it runs last this much longer
            (0.05: 5 %, an assumption, not a measurement: copies share the device's memory bandwidth and,
            for NCCL or NIXL transfers, some of its SMs); 0: copies never touch the steps beside them.
        max_sim_s: requests not finished this long after the first arrival count as failed (s).
        prefix_caching: every device keeps the node's prefix cache (its block ledger's, and placement
            that follows it); prompts get token ids from their hash ids (Mooncake traces, see
            :func:`bench.sim.batched.prompt_token_ids`), others unique ones, so only the trace's own
            reuse hits. Off (the default), every prompt is computed from scratch, as before.
        imbalance_threshold: time-shared and adaptive: the node's ``--imbalance-threshold`` (the fallback that
            moves decoding sequences between devices; 0: off; None: the node's default for the mode, 1 in
            time-shared mode and 0 in adaptive mode, :attr:`fallback_threshold`).
        decode_tp, prefill_tp: tensor-parallel degrees (:mod:`bench.sim.parallel`; both 1: one device
            per instance, as before). Time-shared: groups of ``decode_tp`` devices decode as one
            instance at that degree and prefill as ``decode_tp / prefill_tp`` instances at
            ``prefill_tp``; colocated: every instance runs at ``decode_tp`` (``prefill_tp`` must be 1);
            pooled: prefill instances at ``prefill_tp``, decode instances at ``decode_tp``. Degrees
            above 1 need a :class:`bench.sim.parallel.ParallelModel` as the cost model.
        max_item_tokens: new tokens per sequence per step (``BatchConfig.max_item_tokens``; None: the
            step budget). Set by :mod:`bench.sim.parallel` for a group that prefills as several instances.
        step_pipeline: steps a device keeps in flight, as the node's device loop does (2: while the
            engine computes step N, step N+1 is already planned and queued behind it, so work that
            arrives during N joins N+2 at the earliest, and a drain — a switch, a blocking copy — waits
            for both; 1: every step is planned when the one before ends).
        mixed_graphs: how prefill and mixed steps launch: ``eager`` (the node today: every kernel issued,
            :attr:`node.core.roofline.RooflineCost.eager_launch_s`) or ``piecewise`` (vLLM V1's piecewise CUDA
            graphs, :meth:`node.core.roofline.RooflineCost.with_piecewise_graphs`; needs a roofline cost model).
        abort_late: stop the run (raise :class:`SimAborted`) as soon as this many requests are
            certainly late — still waiting for a device more than ``ttft_slo_ms`` after arriving — so
            that a capacity search does not simulate overloads to the end (``None``: never).
    """

    mode: str = "time-shared"
    devices: int = 1
    nodes: int = 1
    prefill_devices: int | None = None
    kv_blocks: int = 26214
    block_size: int = 16
    kv_bytes_per_token: int = 0
    link_gbps: float = 100.0
    pool_scope: str = "node"
    prefill_nodes: int | None = None
    internode_gbps: float = 400.0
    transfer: str = "overlap"
    max_unsent: int = 64
    step_overhead_ms: float = 0.0
    request_overhead_ms: float = 0.0
    pause_ms: float = 0.0
    max_model_len: int = 2048
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    ttft_slo_ms: float = 1000.0
    tpot_slo_ms: float = 100.0
    reconfig_pause_ms: float = 0.0
    min_window_ms: float = 20.0
    max_window_ms: float = 500.0
    stagger: str = "soft"
    client_max_tokens: str = DEFAULT_CLIENT_MIX
    client_seed: int = 0
    expected_output: str = "node"
    planning: str = "refit"
    cost_error: float = 0.2
    cost_error_seed: int = 0
    control_round_us: float | None = None
    control_per_resident_us: float | None = None
    group_decode_graphs: bool = False
    copy_rate: float = 0.8
    copy_slowdown: float = 0.05
    max_sim_s: float = 3600.0
    abort_late: int | None = None
    prefix_caching: bool = False
    imbalance_threshold: float | None = None
    decode_tp: int = 1
    prefill_tp: int = 1
    max_item_tokens: int | None = None
    step_pipeline: int = 2
    mixed_graphs: str = "eager"

    @property
    def control_us(self) -> tuple[float, float]:
        """``(µs per decision round, µs per resident sequence)`` charged to the node's loop: the fields, else the
        mode's measured defaults (:data:`CONTROL_COST_US`; ``(0, 0)`` for modes without a role policy)."""
        a, b = CONTROL_COST_US.get(self.mode, (0.0, 0.0))
        return (a if self.control_round_us is None else self.control_round_us,
                b if self.control_per_resident_us is None else self.control_per_resident_us)

    @property
    def fallback_threshold(self) -> float:
        """The imbalance fallback's threshold this deployment runs with (0: off): ``imbalance_threshold``,
        else the node's default for the mode (``shiftnode serve``: 0 in adaptive mode, 1 otherwise)."""
        if self.imbalance_threshold is not None:
            return self.imbalance_threshold
        return 0.0 if self.mode == "adaptive" else 1.0

    def __post_init__(self) -> None:
        if self.client_max_tokens != TRUE_LENGTH:
            parse_client_mix(self.client_max_tokens)  # raises ValueError on a bad mix
        if self.expected_output not in ("node", "oracle"):
            raise ValueError(f"expected_output must be node or oracle, got {self.expected_output!r}")
        if self.planning not in PLANNING:
            raise ValueError(f"planning must be one of {', '.join(PLANNING)}, got {self.planning!r}")
        if not (0 <= self.cost_error < 1) or min(self.control_us) < 0:
            raise ValueError("cost_error must be in [0, 1), control costs at least 0")
        if not (0 < self.copy_rate <= 1) or self.copy_slowdown < 0:
            raise ValueError("copy_rate must be in (0, 1], copy_slowdown at least 0")
        if self.mixed_graphs not in ("eager", "piecewise"):
            raise ValueError(f"mixed_graphs must be eager or piecewise, got {self.mixed_graphs!r}")
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r} ({', '.join(MODES)})")
        if self.devices < 1 or self.nodes < 1:
            raise ValueError("need at least one device and one node")
        if self.mode == "pooled" and self.pool_scope == "node" and self.devices < 2:
            raise ValueError("pooled mode needs at least 2 devices per node (prefill and decode)")
        if self.mode == "pooled" and self.pool_scope == "cluster" and self.nodes < 2:
            raise ValueError("pooled mode with --pool-scope cluster needs at least 2 nodes")
        if self.pool_scope not in ("node", "cluster"):
            raise ValueError(f"unknown pool scope {self.pool_scope!r} (node, cluster)")
        if self.step_pipeline < 1:
            raise ValueError("step_pipeline must be at least 1")
        if self.transfer not in ("blocking", "overlap"):
            raise ValueError(f"unknown transfer model {self.transfer!r} (blocking, overlap)")
        if not (self.link_gbps > 0 and self.internode_gbps > 0):
            raise ValueError("link rates must be positive")
        if self.imbalance_threshold is not None and self.imbalance_threshold < 0:
            raise ValueError("imbalance_threshold must be at least 0 (0 turns the fallback off)")
        if self.decode_tp < 1 or self.prefill_tp < 1:
            raise ValueError("decode_tp and prefill_tp must be at least 1")
        if self.mode in ROLE_MODES and (self.decode_tp % self.prefill_tp or self.devices % self.decode_tp):
            raise ValueError(f"time-shared: prefill_tp {self.prefill_tp} must divide decode_tp {self.decode_tp}, "
                             f"and decode_tp the {self.devices} devices")
        if self.mode == "colocated" and (self.prefill_tp != 1 or self.devices % self.decode_tp):
            raise ValueError(f"colocated: one degree (decode_tp {self.decode_tp}) dividing the {self.devices} "
                             "devices, prefill_tp 1")
        if self.mode == "pooled" and (self.decode_tp > 1 or self.prefill_tp > 1):
            p = self.num_prefill_devices
            if self.pool_scope != "node" or p % self.prefill_tp or (self.devices - p) % self.decode_tp:
                raise ValueError(f"pooled: prefill_tp {self.prefill_tp} must divide the {p} prefill devices and "
                                 f"decode_tp {self.decode_tp} the {self.devices - p} decode devices (node scope)")
        if self.max_unsent < 1 or min(self.step_overhead_ms, self.request_overhead_ms, self.pause_ms) < 0:
            raise ValueError("max_unsent must be at least 1, and overheads and pauses at least 0")

    @property
    def num_prefill_devices(self) -> int:
        """Pooled: prefill devices per node (default half, at least 1, leaving at least 1 to decode)."""
        n = self.prefill_devices if self.prefill_devices is not None else self.devices // 2
        return min(max(1, n), self.devices - 1)

    @property
    def num_prefill_nodes(self) -> int:
        """Pooled, cluster scope: prefill-only nodes (default half, at least 1, leaving 1 to decode)."""
        n = self.prefill_nodes if self.prefill_nodes is not None else self.nodes // 2
        return min(max(1, n), self.nodes - 1)


def kv_geometry(model_config: dict, *, dtype: str, block_size: int, kv_cache_bytes: int | None = None,
                device_memory_gib: float | None = None, memory_fraction: float = 0.9) -> tuple[int, int]:
    """``(kv_bytes_per_token, kv_blocks per device)`` for a model config (see the module doc).

    Give ``kv_cache_bytes`` (the node's ``--kv-cache-memory``) or ``device_memory_gib``.
    """
    g = Geometry.from_config(model_config)
    nb = DTYPE_BYTES[dtype]
    per_token = kv_bytes_per_token(g, nb)
    if kv_cache_bytes is not None:
        return per_token, kv_cache_bytes // (block_size * per_token)
    if device_memory_gib is None:
        raise ValueError("give kv_cache_bytes or device_memory_gib")
    tokens = kv_token_capacity(int(device_memory_gib * (1 << 30)), param_count(g) * nb, per_token, memory_fraction)
    return per_token, tokens // block_size
