"""What a simulated deployment is: its mode, devices, memory, link and policy knobs.

KV geometry comes from the planner (:mod:`node.plan`): ``kv_bytes_per_token`` from a model's
``config.json`` and dtype, and the blocks per device either from a KV byte budget
(``bytes // (block_size * kv_bytes_per_token)``, as the node sizes its pool) or from the device memory
left beside the weights (:func:`node.plan.kv_token_capacity`).
"""

from __future__ import annotations

from dataclasses import dataclass

from node.plan import DTYPE_BYTES, Geometry, kv_bytes_per_token, kv_token_capacity, param_count

__all__ = ["MODES", "SimConfig", "kv_geometry"]

MODES = ("time-shared", "colocated", "pooled")


@dataclass(frozen=True)
class SimConfig:
    """One simulated deployment (per node; ``nodes`` identical nodes share the requests round-robin).

    Attributes:
        mode: time-shared | colocated | pooled.
        devices: devices per node; pooled splits them into ``prefill_devices`` and the rest decode.
        kv_blocks, block_size: KV pool per device (blocks of ``block_size`` tokens).
        kv_bytes_per_token: KV of one token over all layers (bytes), for pooled transfers.
        link_gbps: per prefill device link rate for KV transfers (Gb/s, line rate).
        max_num_batched_tokens: per-step token budget (chunked prefill; the prefill budget in
            time-shared mode), as the node's ``--max-num-batched-tokens``.
        expected_output: what time-shared placement is told of each output length: ``node`` (what
            the live node assumes for ``ignore_eos`` requests: ``min(max_tokens, 128)``) or ``oracle``.
        max_sim_s: requests not finished this long after the first arrival count as failed (s).
    """

    mode: str = "time-shared"
    devices: int = 1
    nodes: int = 1
    prefill_devices: int | None = None
    kv_blocks: int = 26214
    block_size: int = 16
    kv_bytes_per_token: int = 0
    link_gbps: float = 100.0
    max_model_len: int = 2048
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    ttft_slo_ms: float = 1000.0
    tpot_slo_ms: float = 100.0
    reconfig_pause_ms: float = 0.0
    min_window_ms: float = 20.0
    max_window_ms: float = 500.0
    stagger: str = "soft"
    expected_output: str = "node"
    max_sim_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r} ({', '.join(MODES)})")
        if self.devices < 1 or self.nodes < 1:
            raise ValueError("need at least one device and one node")
        if self.mode == "pooled" and self.devices < 2:
            raise ValueError("pooled mode needs at least 2 devices per node (prefill and decode)")

    @property
    def num_prefill_devices(self) -> int:
        """Pooled: prefill devices per node (default half, at least 1, leaving at least 1 to decode)."""
        n = self.prefill_devices if self.prefill_devices is not None else self.devices // 2
        return min(max(1, n), self.devices - 1)


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
