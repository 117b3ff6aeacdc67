"""Capacity planner: KV and weight arithmetic from a Hugging Face ``config.json`` (stdlib only).

``shiftnode plan --config PATH [--link-gbps G] [--prompt-tokens N] [--device-memory-gib M] [--dtype auto]
[--decode-tp D] [--prefill-tp P]``

``--dtype auto`` (the default) takes the checkpoint's ``torch_dtype`` (or ``dtype``), float32 when the
config names none, exactly as ``shiftnode serve --dtype auto`` loads the weights and sizes the KV cache.

Formulas (the seed note, *Prefill and Decode Disaggregation*, "The transfer that makes it possible"):

* KV bytes per token = ``2 (K and V) * layers * kv_heads * head_dim * dtype_bytes`` — 512 KiB for 32
  layers of 4096-wide multi-head attention in 16-bit, 128 KiB with 8 KV heads of width 128;
* KV bytes of a prompt = per token x prompt tokens;
* transfer time over a link = ``bytes * 8 / (gbps * 1e9)`` s (line rate, no protocol overhead);
* weight bytes = parameters x dtype bytes, with parameters counted from the geometry of the Llama
  family as implemented by Hugging Face transformers (``LlamaForCausalLM``, ``Qwen2ForCausalLM``,
  ``Qwen3ForCausalLM``): embeddings ``vocab*hidden``; per layer q/k/v/o projections
  ``hidden*heads*head_dim + 2*hidden*kv_heads*head_dim + heads*head_dim*hidden`` (+ q/k/v biases for
  Qwen2 or ``attention_bias``, + o bias for ``attention_bias``), Qwen3's per-head q/k RMSNorm
  ``2*head_dim``, gated MLP ``3*hidden*intermediate`` (+ biases for ``mlp_bias``), two RMSNorms
  ``2*hidden``; a final norm ``hidden``; an untied ``lm_head`` ``vocab*hidden``;
* KV tokens that fit = ``floor((device_bytes * memory_fraction - weight_bytes) / kv_bytes_per_token)``
  (the fraction plays the role of vLLM's ``gpu_memory_utilization``; activations are not modelled).

Tensor parallelism (``--decode-tp D --prefill-tp P``, time-shared groups; ``--tensor-parallel-size T``
is ``D = P = T``): each device holds the degree-``P`` shard (node.worker.tensor_parallel: the layers'
projections and an untied LM head split ``P`` ways; the embedding, a tied head and the norms
replicated), so weights per device = ``replicated + sharded / P``; it caches ``K / D`` KV heads, so KV
per token per device = ``kv_bytes_per_token / D`` and the tokens that fit are
``floor((device_bytes * memory_fraction - weights per device) / (kv_bytes_per_token / D))``, the same
for every device of the group (each holds its heads of every token).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DTYPE_BYTES", "resolve_dtype", "Geometry", "Plan", "kv_bytes_per_token", "param_count", "transfer_s",
           "weight_bytes_per_device", "check_degrees",
           "kv_token_capacity", "make_plan", "format_plan", "main"]

GIB = 1 << 30
DTYPE_BYTES = {"fp32": 4, "float32": 4, "float": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2,
               "half": 2, "fp8": 1, "float8": 1, "float8_e4m3fn": 1, "int8": 1}


def resolve_dtype(dtype: str, cfg: dict) -> str:
    """``auto`` → the config's ``torch_dtype``/``dtype`` (float32 if absent, as the node loads it); other
    names as given. Raises ValueError for a name not in :data:`DTYPE_BYTES`."""
    name = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32") if dtype == "auto" else dtype
    if name not in DTYPE_BYTES:
        where = " (the config's dtype)" if dtype == "auto" else ""
        raise ValueError(f"unknown dtype {name!r}{where}; one of auto, {', '.join(sorted(DTYPE_BYTES))}")
    return name


@dataclass(frozen=True)
class Geometry:
    """Model shape read from a config (counts, not bytes)."""

    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool

    @classmethod
    def from_config(cls, cfg: dict) -> Geometry:
        """Read a Hugging Face config dict (missing ``head_dim``: hidden/heads; missing KV heads: heads)."""
        mt = str(cfg.get("model_type", "llama"))
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        attn_bias = bool(cfg.get("attention_bias", False))
        return cls(
            model_type=mt, hidden=hidden, layers=int(cfg["num_hidden_layers"]), heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads), intermediate=int(cfg["intermediate_size"]),
            vocab=int(cfg["vocab_size"]), tied=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=attn_bias or mt == "qwen2", o_bias=attn_bias and mt != "qwen2",
            mlp_bias=bool(cfg.get("mlp_bias", False)), qk_norm=mt == "qwen3",
        )


def kv_bytes_per_token(g: Geometry, dtype_bytes: int) -> int:
    """Bytes of K and V per token across all layers: ``2 * layers * kv_heads * head_dim * dtype_bytes``."""
    return 2 * g.layers * g.kv_heads * g.head_dim * dtype_bytes


def param_count(g: Geometry) -> int:
    """Parameters of the model (see the module docstring for the terms)."""
    q, kv = g.heads * g.head_dim, g.kv_heads * g.head_dim
    attn = g.hidden * q + 2 * g.hidden * kv + q * g.hidden
    attn += (q + 2 * kv) * g.qkv_bias + g.hidden * g.o_bias + 2 * g.head_dim * g.qk_norm
    mlp = 3 * g.hidden * g.intermediate + (2 * g.intermediate + g.hidden) * g.mlp_bias
    layer = attn + mlp + 2 * g.hidden
    embed = g.vocab * g.hidden
    return embed + g.layers * layer + g.hidden + (0 if g.tied else embed)


def weight_bytes_per_device(g: Geometry, dtype_bytes: int, held_degree: int) -> int:
    """Weight bytes a device holding the degree-``held_degree`` shard stores: the replicated part
    (embedding, a tied head, norms) whole, the layers' projections (and biases) and an untied head
    divided by the degree (see the module docstring)."""
    q, kv = g.heads * g.head_dim, g.kv_heads * g.head_dim
    sharded = g.layers * (2 * g.hidden * q + 2 * g.hidden * kv + (q + 2 * kv) * g.qkv_bias
                          + 3 * g.hidden * g.intermediate + 2 * g.intermediate * g.mlp_bias)
    sharded += 0 if g.tied else g.vocab * g.hidden
    return (param_count(g) - sharded) * dtype_bytes + -(-sharded // held_degree) * dtype_bytes


def check_degrees(g: Geometry, decode_tp: int, prefill_tp: int) -> None:
    """Raises ValueError, naming the numbers, for degrees the node would refuse: ``P`` not dividing ``D``,
    or ``D`` not dividing the attention heads, KV heads or intermediate size."""
    if prefill_tp < 1 or decode_tp < 1 or decode_tp % prefill_tp:
        raise ValueError(f"--prefill-tp {prefill_tp} must divide --decode-tp {decode_tp}")
    bad = [f"{n} {v}" for n, v in (("num_attention_heads", g.heads), ("num_key_value_heads", g.kv_heads),
                                   ("intermediate_size", g.intermediate)) if v % decode_tp]
    if bad:
        raise ValueError(f"degree {decode_tp} does not divide the model's {', '.join(bad)}")


def transfer_s(nbytes: int, link_gbps: float) -> float:
    """Seconds to send ``nbytes`` over a ``link_gbps`` Gb/s link at line rate: ``bytes*8/(gbps*1e9)``."""
    return nbytes * 8 / (link_gbps * 1e9)


def kv_token_capacity(device_bytes: int, weight_bytes: int, kv_per_token: int, memory_fraction: float = 0.9) -> int:
    """Tokens of KV that fit beside the weights in ``memory_fraction`` of the device (0 if none)."""
    room = int(device_bytes * memory_fraction) - weight_bytes
    return max(0, room // kv_per_token)


@dataclass(frozen=True)
class Plan:
    """The planner's figures (bytes, seconds, tokens)."""

    geometry: Geometry
    dtype: str
    params: int
    weight_bytes: int
    kv_bytes_per_token: int
    prompt_tokens: int
    prompt_kv_bytes: int
    link_gbps: float
    prompt_transfer_s: float
    device_bytes: int | None
    memory_fraction: float
    kv_tokens_fit: int | None
    hbm_tbps: float | None
    decode_weight_read_s: float | None
    decode_tp: int = 1
    prefill_tp: int = 1
    weight_bytes_per_device: int = 0  # the held degree-prefill_tp shard


def make_plan(cfg: dict, *, dtype: str = "auto", prompt_tokens: int = 4000, link_gbps: float = 100.0,
              device_memory_gib: float | None = None, memory_fraction: float = 0.9,
              hbm_tbps: float | None = None, decode_tp: int = 1, prefill_tp: int | None = None) -> Plan:
    """All figures for one config, weights and KV in ``dtype`` (``auto``: the config's, see
    :func:`resolve_dtype`). ``hbm_tbps`` (TB/s) adds the weight-read lower bound of a decode step (of
    one device at degree ``decode_tp``). ``decode_tp``/``prefill_tp`` (default: ``decode_tp``): a
    group's degrees; the KV tokens that fit are then per group (module docstring).

    Raises:
        ValueError: an unknown dtype, or degrees the node would refuse; KeyError: a config without the
            geometry fields.
    """
    dtype = resolve_dtype(dtype, cfg)
    g = Geometry.from_config(cfg)
    prefill_tp = decode_tp if prefill_tp is None else prefill_tp
    check_degrees(g, decode_tp, prefill_tp)
    nb = DTYPE_BYTES[dtype]
    params = param_count(g)
    wbytes = params * nb
    w_dev = weight_bytes_per_device(g, nb, prefill_tp)
    per_tok = kv_bytes_per_token(g, nb)
    prompt_bytes = per_tok * prompt_tokens
    dev_bytes = int(device_memory_gib * GIB) if device_memory_gib is not None else None
    fit = kv_token_capacity(dev_bytes, w_dev, per_tok // decode_tp, memory_fraction) if dev_bytes is not None else None
    return Plan(g, dtype, params, wbytes, per_tok, prompt_tokens, prompt_bytes, link_gbps,
                transfer_s(prompt_bytes, link_gbps), dev_bytes, memory_fraction, fit, hbm_tbps,
                weight_bytes_per_device(g, nb, decode_tp) / (hbm_tbps * 1e12) if hbm_tbps else None,
                decode_tp, prefill_tp, w_dev)


def _bytes(n: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return str(n)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms" if seconds >= 0.1 else f"{seconds * 1e3:.3g} ms"


def format_plan(p: Plan) -> str:
    """A readable two-column table."""
    g = p.geometry
    rows = [
        ("model", f"{g.model_type}: hidden {g.hidden}, {g.layers} layers, {g.heads} heads / {g.kv_heads} KV heads "
                  f"x {g.head_dim}, ffn {g.intermediate}, vocab {g.vocab}, {'tied' if g.tied else 'untied'}"),
        ("parameters", f"{p.params:,} ({_count(p.params)})"),
        (f"weights ({p.dtype})", f"{_bytes(p.weight_bytes)} ({p.weight_bytes:,} B)"),
        ("KV per token", f"{_bytes(p.kv_bytes_per_token)} ({p.kv_bytes_per_token:,} B)"),
        (f"KV of a {p.prompt_tokens:,}-token prompt", _bytes(p.prompt_kv_bytes)),
        (f"  transfer at {p.link_gbps:g} Gb/s", _ms(p.prompt_transfer_s)),
    ]
    if p.decode_tp > 1 or p.prefill_tp > 1:
        rows.append((f"weights per device (1/{p.prefill_tp} shard held)", _bytes(p.weight_bytes_per_device)))
        rows.append((f"KV per token per device (1/{p.decode_tp} of the KV heads)", _bytes(p.kv_bytes_per_token // p.decode_tp)))
    if p.decode_weight_read_s is not None:
        rows.append((f"decode step weight read at {p.hbm_tbps:g} TB/s" + (f", degree {p.decode_tp}" if p.decode_tp > 1 else ""),
                     _ms(p.decode_weight_read_s)))
        rows.append(("  transfer / decode step", f"{p.prompt_transfer_s / p.decode_weight_read_s:,.1f}x"))
    if p.device_bytes is not None:
        group = f" (per group of {p.decode_tp})" if p.decode_tp > 1 else ""
        rows.append((f"KV tokens beside weights in {_bytes(p.device_bytes)} x {p.memory_fraction:g}{group}",
                     f"{p.kv_tokens_fit:,}" + ("  (weights do not fit)" if p.kv_tokens_fit == 0 else "")))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def load_config(path: str | Path) -> dict:
    """A config dict from ``config.json`` or a folder holding one."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    return json.loads(p.read_text())


def main(argv: list[str] | None = None) -> int:
    """``shiftnode plan``: print the table; 0 on success, 2 on a bad config or argument."""
    ap = argparse.ArgumentParser(prog="shiftnode plan", description="KV and weight capacity arithmetic.")
    ap.add_argument("--config", required=True, help="config.json, or a model folder holding one")
    ap.add_argument("--link-gbps", type=float, default=100.0, help="link rate for the KV transfer (Gb/s)")
    ap.add_argument("--prompt-tokens", type=int, default=4000, help="prompt length (tokens)")
    ap.add_argument("--device-memory-gib", type=float, default=None, help="device memory (GiB)")
    ap.add_argument("--memory-fraction", type=float, default=0.9, help="share of device memory usable")
    ap.add_argument("--hbm-tbps", type=float, default=None, help="memory bandwidth (TB/s) for a decode bound")
    ap.add_argument("--decode-tp", "--tensor-parallel-size", type=int, default=1, dest="decode_tp",
                    help="devices per group (time-shared --decode-tp, colocated --tensor-parallel-size)")
    ap.add_argument("--prefill-tp", type=int, default=None,
                    help="time-shared prefill degree (default: the decode degree): each device holds 1/P of the weights")
    ap.add_argument("--dtype", default="auto", choices=["auto", *sorted(DTYPE_BYTES)],
                    help="weight and KV dtype (default auto: the config's torch_dtype, float32 if it has none)")
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:  # --help, or a usage error already printed
        return int(e.code or 0)
    try:
        cfg = load_config(args.config)
        plan = make_plan(cfg, dtype=args.dtype, prompt_tokens=args.prompt_tokens, link_gbps=args.link_gbps,
                         device_memory_gib=args.device_memory_gib, memory_fraction=args.memory_fraction,
                         hbm_tbps=args.hbm_tbps, decode_tp=args.decode_tp, prefill_tp=args.prefill_tp)
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"shiftnode plan: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(format_plan(plan))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
