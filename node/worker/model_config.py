"""Model geometry read from a Hugging Face ``config.json``, and the rotary frequencies it implies."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


class ModelConfigError(ValueError):
    """A checkpoint's config is missing, unsupported or inconsistent."""


@dataclass(frozen=True)
class ModelConfig:
    """Geometry of a Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3).

    All sizes are element counts; ``head_dim`` is explicit (Qwen3 sets it apart from hidden/heads).
    """

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Parse a config dict.

        Raises:
            ModelConfigError: unsupported architecture or rope scaling, or inconsistent head counts.
        """
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelConfigError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            kv_heads = int(cfg.get("num_key_value_heads") or heads)
            head_dim = int(cfg.get("head_dim") or hidden // heads)
            rope = dict(cfg.get("rope_parameters") or {})
            scaling = cfg.get("rope_scaling") or None
            theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
            if scaling is None and rope.get("rope_type", "default") != "default":
                scaling = rope
            eos = cfg.get("eos_token_id")
            mc = cls(
                architecture=arch,
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                vocab_size=int(cfg["vocab_size"]),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=scaling,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
                qk_norm=arch == "Qwen3ForCausalLM",
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=tuple(eos if isinstance(eos, list) else ([] if eos is None else [eos])),
                raw=cfg,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ModelConfigError(f"config.json is missing or has a bad field: {e}") from e
        if min(hidden, heads, kv_heads, head_dim, mc.num_layers, mc.vocab_size, mc.intermediate_size,
               mc.max_position_embeddings) < 1:
            raise ModelConfigError("config.json sizes (hidden, heads, layers, vocab, max_position_embeddings) must be positive")
        if any(not isinstance(t, int) or not 0 <= t < mc.vocab_size for t in mc.eos_token_ids):
            raise ModelConfigError(f"eos_token_id {list(mc.eos_token_ids)} must be token ids below vocab_size {mc.vocab_size}")
        if heads % kv_heads:
            raise ModelConfigError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        if head_dim % 2:
            raise ModelConfigError(f"head_dim {head_dim} must be even for rotary embeddings")
        rope_inv_freq(mc)  # validate the scaling type early
        return mc

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelConfig":
        """Read ``folder/config.json``. Raises :class:`ModelConfigError` when it is missing."""
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise ModelConfigError(f"no config.json in {folder}")
        try:
            cfg = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise ModelConfigError(f"{path} is not valid JSON: {e}") from e
        if not isinstance(cfg, dict):
            raise ModelConfigError(f"{path} must hold a JSON object")
        return cls.from_dict(cfg)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V per token over all layers: ``2 * layers * kv_heads * head_dim * elem``."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Rotary inverse frequencies ``[head_dim // 2]`` float32 (Su et al. 2021), with scaling.

    Supported ``rope_scaling`` types: none/"default", "linear" (frequencies divided by ``factor``)
    and "llama3" (Meta's Llama 3.1 rule: low frequencies divided by ``factor``, high kept, a smooth
    blend between, from ``original_max_position_embeddings`` and ``low/high_freq_factor``).

    Raises:
        ModelConfigError: another scaling type (yarn, dynamic, longrope) is requested.
    """
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    sc = cfg.rope_scaling
    if not sc:
        return inv
    kind = sc.get("rope_type", sc.get("type", "default"))
    if kind == "default":
        return inv
    factor = float(sc.get("factor", 1.0))
    if kind == "linear":
        return inv / factor
    if kind == "llama3":
        low = float(sc["low_freq_factor"])
        high = float(sc["high_freq_factor"])
        old_len = float(sc["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, blended, scaled)
    raise ModelConfigError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")
