"""The node's configuration (built from argv by ``node.cli``)."""

from __future__ import annotations

import msgspec


class NodeConfig(msgspec.Struct, kw_only=True):
    """Everything a node needs to start. Units are in the names (bytes, ms, tokens).

    ``model=None`` selects the embedded default model (random weights from ``seed``).
    """

    model: str | None = None
    served_model_name: str | None = None
    load_format: str = "auto"  # auto (safetensors, or dummy for the embedded model) | safetensors | dummy
    devices: list[str] = msgspec.field(default_factory=lambda: ["cpu:0"])
    dtype: str = "auto"
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_queue: int = 1024
    max_body_bytes: int = 16 * 1024 * 1024
    seed: int = 0
    log_format: str = "console"
    attention_backend: str = "auto"  # auto | torch | triton
    enforce_eager: bool = False  # no CUDA-graph decode (graphs are used on CUDA with the triton backend otherwise)
    mode: str = "time-shared"  # time-shared | colocated
    reconfig_pause_ms: float = 0.0  # floor added to every measured role switch
    ttft_slo_ms: float = 1000.0
    tpot_slo_ms: float = 100.0
    min_window_ms: float = 20.0
    max_window_ms: float = 500.0
    stagger: str = "soft"  # hard | soft | off (see node.core.roles)
    sse_keepalive_s: float = 10.0  # comment lines on a stream silent this long (e.g. through a role switch)

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.model is None:
            return "shiftnode-default"
        return self.model.rstrip("/").split("/")[-1]
