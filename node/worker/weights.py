"""Build a :class:`CausalLM` and fill it from Hugging Face safetensors, or with seeded random weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import SafetensorError, safe_open

from node.worker.model import CausalLM
from node.worker.model_config import ModelConfig, ModelConfigError, rope_inv_freq
from node.worker.tensor_parallel import ShardLayout, TPGroup, fused_part, held_columns, held_row_blocks, lm_head_rows
from shiftnode_kernels.reference import rope_cos_sin_cache


class WeightLoadError(ValueError):
    """Checkpoint files are missing, or a tensor is missing or has the wrong shape."""


def build_model(
    cfg: ModelConfig,
    *,
    folder: str | Path | None,
    load_format: str,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    ops: Any,
    seed: int = 0,
    layout: ShardLayout = ShardLayout(),
    tp: TPGroup | None = None,
) -> CausalLM:
    """Create the model on ``device`` without initialising it, then load or randomise weights.

    Args:
        load_format: ``"safetensors"`` (read ``folder``) or ``"dummy"`` (normal(0, 0.02) weights from
            ``seed``; norms set to 1), as vLLM's ``--load-format dummy``. Dummy weights are drawn on
            the model's device (a CPU generator on the CPU, a CUDA generator on a GPU, so that an 8B
            model takes seconds, not minutes): the same seed gives different weights on the two.
        max_positions: rows of the rotary table (tokens).
        layout: the stored layout (:class:`~node.worker.tensor_parallel.ShardLayout`): fused weights
            interleaved for ``layout.layout_degree`` ranks, only the held part read from the
            checkpoint. Dummy weights are drawn per stored tensor, so they depend on the layout.
        tp: the tensor-parallel group to run with (degree 1 when None; required when the device holds
            part of the weights).

    Raises:
        WeightLoadError: missing files, tensors, or shape mismatch.
        TensorParallelError: the model cannot be split for ``layout`` or ``tp``.
    """
    with torch.device("meta"):
        model = CausalLM(cfg, dtype, torch.device("meta"), max_positions, ops, layout)
    # Fresh contiguous storage per tensor (every parameter and buffer is contiguous), as ``to_empty``
    # gives, without its ``empty_like`` on meta tensors, whose Python decomposition imports sympy
    # (~0.4 s in every engine process).
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    model.cos_sin = rope_cos_sin_cache(rope_inv_freq(cfg).to(device), max_positions)
    if load_format == "dummy":
        _randomise(model, seed)
    elif load_format == "safetensors":
        if folder is None:
            raise WeightLoadError("--load-format safetensors needs a model folder")
        _load_safetensors(model, cfg, Path(folder))
    else:
        raise WeightLoadError(f"unknown load format {load_format!r} (safetensors, dummy)")
    if tp is not None:
        model.set_tensor_parallel(tp)
    return model.eval()


@torch.no_grad()
def _randomise(model: CausalLM, seed: int) -> None:
    device = next(model.parameters()).device
    on_cpu = device.type == "cpu"
    gen = torch.Generator(device="cpu" if on_cpu else device).manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() == 1 and "bias" not in name:  # norm weights
            p.fill_(1.0)
        elif on_cpu:
            p.copy_((torch.randn(p.shape, generator=gen) * 0.02).to(p.dtype))
        else:
            p.normal_(0.0, 0.02, generator=gen)


def _tensor_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise WeightLoadError(f"{index} is not a valid safetensors index: {e}") from e
        files = [folder / n for n in names]
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    else:
        raise WeightLoadError(f"no model.safetensors or model.safetensors.index.json in {folder}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise WeightLoadError(f"checkpoint shards missing: {missing}")
    return files


def _iter_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for f in _tensor_files(folder):
        try:
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():
                    yield name, fh.get_tensor(name)
        except (SafetensorError, OSError, ValueError) as e:
            raise WeightLoadError(f"{f} is not a readable safetensors file: {e}") from e


class _Target:
    """Where one checkpoint tensor goes: ``dst`` (a view of a stored parameter) receives
    ``take(tensor)``, the stored part of a checkpoint tensor of shape ``shape``."""

    __slots__ = ("dst", "shape", "take")

    def __init__(self, dst: torch.Tensor, shape: tuple[int, ...], take: Any = None):
        self.dst, self.shape, self.take = dst, tuple(shape), take or (lambda t: t)


@torch.no_grad()
def _load_safetensors(model: CausalLM, cfg: ModelConfig, folder: Path) -> None:
    """Copy HF-named tensors into the fused layout of ``model.layout``, checking every shape."""
    lay = model.layout
    m = lay.layout_degree
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    qkv_parts = [q // m, kv // m, kv // m]  # rows of q_b, k_b, v_b per layout block
    gu_parts = [inter // m, inter // m]

    def fused(stored: torch.Tensor, parts: list[int], i: int, shape: tuple[int, ...]) -> _Target:
        return _Target(fused_part(stored, lay, parts, i), shape, lambda t: held_row_blocks(t, lay))

    def columns(stored: torch.Tensor, shape: tuple[int, ...]) -> _Target:
        return _Target(stored, shape, lambda t: held_columns(t, lay))

    targets: dict[str, _Target] = {
        "model.embed_tokens.weight": _Target(model.embed_tokens.weight, (cfg.vocab_size, h)),
        "model.norm.weight": _Target(model.norm, (h,)),
    }
    for i, layer in enumerate(model.layers):
        w, b = layer.qkv_proj.weight, layer.qkv_proj.bias
        pre = f"model.layers.{i}."
        targets.update({
            pre + "self_attn.q_proj.weight": fused(w, qkv_parts, 0, (q, h)),
            pre + "self_attn.k_proj.weight": fused(w, qkv_parts, 1, (kv, h)),
            pre + "self_attn.v_proj.weight": fused(w, qkv_parts, 2, (kv, h)),
            pre + "self_attn.o_proj.weight": columns(layer.o_proj.weight, (h, q)),
            pre + "mlp.gate_proj.weight": fused(layer.gate_up_proj.weight, gu_parts, 0, (inter, h)),
            pre + "mlp.up_proj.weight": fused(layer.gate_up_proj.weight, gu_parts, 1, (inter, h)),
            pre + "mlp.down_proj.weight": columns(layer.down_proj.weight, (h, inter)),
            pre + "input_layernorm.weight": _Target(layer.input_layernorm, (h,)),
            pre + "post_attention_layernorm.weight": _Target(layer.post_attention_layernorm, (h,)),
        })
        if cfg.attention_bias:
            targets.update({
                pre + "self_attn.q_proj.bias": fused(b, qkv_parts, 0, (q,)),
                pre + "self_attn.k_proj.bias": fused(b, qkv_parts, 1, (kv,)),
                pre + "self_attn.v_proj.bias": fused(b, qkv_parts, 2, (kv,)),
            })
        if cfg.qk_norm:
            targets[pre + "self_attn.q_norm.weight"] = _Target(layer.q_norm, (d,))
            targets[pre + "self_attn.k_norm.weight"] = _Target(layer.k_norm, (d,))
    if model.lm_head is not None:
        start, stop = lm_head_rows(cfg, lay, tied=False)
        targets["lm_head.weight"] = _Target(model.lm_head.weight, (cfg.vocab_size, h), lambda t: t[start:stop])
    seen: set[str] = set()
    for name, tensor in _iter_tensors(folder):
        target = targets.get(name)
        if target is None:
            if name == "lm_head.weight" or "rotary_emb" in name:
                continue  # tied head stored anyway, or precomputed rotary buffers
            raise WeightLoadError(f"unexpected tensor {name!r} in checkpoint {folder}")
        if tuple(tensor.shape) != target.shape:
            raise WeightLoadError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, model {target.shape}")
        target.dst.copy_(target.take(tensor).to(target.dst.dtype))
        seen.add(name)
    missing = sorted(set(targets) - seen)
    if missing:
        raise WeightLoadError(f"checkpoint {folder} lacks {len(missing)} tensors, e.g. {missing[:3]}")


def dtype_from_name(name: str, cfg: ModelConfig | None = None) -> torch.dtype:
    """Map ``auto|float32|float16|bfloat16`` (and short forms) to a torch dtype.

    ``auto`` takes the checkpoint's ``torch_dtype``/``dtype``. Raises :class:`ModelConfigError`.
    """
    table = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
             "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if name == "auto":
        raw = (cfg.raw if cfg else {}).get("torch_dtype") or (cfg.raw if cfg else {}).get("dtype") or "float32"
        name = raw
    if name not in table:
        raise ModelConfigError(f"unknown dtype {name!r} (auto, float32, float16, bfloat16)")
    return table[name]
