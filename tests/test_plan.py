"""node.plan against the seed note's figures and the shared configs' known parameter counts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from node.plan import (
    Geometry, kv_bytes_per_token, kv_token_capacity, load_config, main, make_plan, param_count, transfer_s,
    weight_bytes_per_device,
)

SHARED = Path(os.environ.get("SHIFTNODE_SHARED") or Path(__file__).resolve().parents[1].parent / "shared")
KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30


def llama(**kw) -> dict:
    cfg = dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=32, intermediate_size=11008, vocab_size=32000, tie_word_embeddings=False)
    cfg.update(kw)
    return cfg


@pytest.mark.quick
def test_seed_kv_per_token():
    assert kv_bytes_per_token(Geometry.from_config(llama()), 2) == 512 * KIB  # 2 x 32 x 4096 x 2
    assert kv_bytes_per_token(Geometry.from_config(llama(num_key_value_heads=8)), 2) == 128 * KIB


@pytest.mark.quick
def test_seed_prompt_and_transfer():
    mha = make_plan(llama(), dtype="bf16", prompt_tokens=4000, link_gbps=100)
    gqa = make_plan(llama(num_key_value_heads=8), dtype="bf16", prompt_tokens=4000, link_gbps=100)
    # the seed rounds: 4000 x 512 KiB = 1.95 GiB ("2 GiB"), 4000 x 128 KiB = 500 MiB ("512 MiB")
    assert mha.prompt_kv_bytes == 4000 * 512 * KIB and mha.prompt_kv_bytes == pytest.approx(2 * GIB, rel=0.03)
    assert gqa.prompt_kv_bytes == pytest.approx(512 * MIB, rel=0.03)
    # "roughly 160 ms" and "roughly 40 ms" at 100 Gb/s (12.5 GB/s)
    assert mha.prompt_transfer_s == pytest.approx(0.160, rel=0.10)
    assert gqa.prompt_transfer_s == pytest.approx(0.040, rel=0.10)
    assert transfer_s(12_500_000_000, 100) == pytest.approx(1.0)


@pytest.mark.quick
def test_llama3_8b_params():
    cfg = llama(num_key_value_heads=8, intermediate_size=14336, vocab_size=128256)
    n = param_count(Geometry.from_config(cfg))
    assert n == 8_030_261_248 and round(n / 1e9, 2) == 8.03


@pytest.mark.quick
@pytest.mark.parametrize("folder,params", [
    ("stories260k", 260_032),  # the safetensors file holds exactly this many (tied embeddings)
    ("stories260k/tiny_configs/llama3-style", 885_888),
    ("stories260k/tiny_configs/qwen2-style", 1_280_256),  # q/k/v biases
    ("stories260k/tiny_configs/qwen3-style", 557_952),  # q/k norms, head_dim 64 != hidden/heads
])
def test_shared_configs_param_counts(folder, params):
    path = SHARED / "models" / folder / "config.json"
    assert path.is_file(), f"shared data missing: {path} (set SHIFTNODE_SHARED)"
    assert param_count(Geometry.from_config(json.loads(path.read_text()))) == params


@pytest.mark.quick
def test_capacity_beside_weights():
    # 8B in bf16 = 16.06 GB of weights; 80 GiB x 0.9 leaves ~56.3 GiB = ~461k tokens at 128 KiB
    plan = make_plan(llama(num_key_value_heads=8, intermediate_size=14336, vocab_size=128256, torch_dtype="bfloat16"),
                     device_memory_gib=80, memory_fraction=0.9)
    assert plan.weight_bytes == 2 * 8_030_261_248
    assert plan.kv_tokens_fit == (int(80 * GIB * 0.9) - plan.weight_bytes) // (128 * KIB)
    assert kv_token_capacity(10 * GIB, 20 * GIB, 128 * KIB) == 0


@pytest.mark.quick
def test_main_prints_a_table(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(llama(num_key_value_heads=8, torch_dtype="bfloat16")))
    assert main(["--config", str(tmp_path), "--device-memory-gib", "80", "--hbm-tbps", "3.35"]) == 0
    out = capsys.readouterr().out
    assert "128.00 KiB" in out and "KV tokens beside weights" in out and "transfer at 100 Gb/s" in out
    assert main(["--config", str(tmp_path / "nope.json")]) == 2
    assert main(["--config", str(cfg), "--dtype", "int3"]) == 2


@pytest.mark.quick
def test_dtype_auto_is_the_models():
    """stories260k is float32: auto plans 4-byte weights and KV, as the node serves it."""
    cfg = json.loads((SHARED / "models" / "stories260k" / "config.json").read_text())
    plan = make_plan(cfg)
    g = Geometry.from_config(cfg)
    assert plan.dtype == "float32" and plan.kv_bytes_per_token == kv_bytes_per_token(g, 4)
    assert plan.weight_bytes == 4 * param_count(g)
    assert make_plan(cfg, dtype="bf16").kv_bytes_per_token * 2 == plan.kv_bytes_per_token
    assert make_plan(llama(dtype="float16")).dtype == "float16"  # transformers 5 writes "dtype"
    assert make_plan(llama()).dtype == "float32"  # none named: float32, the node's default too
    with pytest.raises(ValueError, match="config's dtype"):
        make_plan(llama(torch_dtype="int3"))


def test_main_auto_matches_the_node(capsys):
    """The plan's KV per token equals what the node's own ModelConfig computes for its auto dtype."""
    import torch

    from node.worker.model_config import ModelConfig
    from node.worker.weights import dtype_from_name

    folder = SHARED / "models" / "stories260k"
    assert main(["--config", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "weights (float32)" in out
    mc = ModelConfig.from_folder(folder)
    dt = dtype_from_name("auto", mc)
    assert dt == torch.float32
    assert make_plan(json.loads((folder / "config.json").read_text())).kv_bytes_per_token == mc.kv_bytes_per_token(dt)


@pytest.mark.quick
def test_degrees_per_device_match_the_loaded_shards():
    """Weights per device at a held degree equal what a rank of the node holds (``weight_bytes`` of a
    stories260k rank holding the 1/P shard: every parameter, by the loader's own count), KV per device
    divides by the decode degree, and degrees the node refuses are refused with the numbers."""
    import torch

    import shiftnode_kernels.reference as ref_ops
    from node.worker.model_config import ModelConfig
    from node.worker.runner import weight_bytes
    from node.worker.tensor_parallel import ShardLayout
    from node.worker.weights import build_model

    folder = SHARED / "models" / "stories260k"
    cfg = load_config(folder)
    g = Geometry.from_config(cfg)
    mcfg = ModelConfig.from_folder(folder)
    for held in (1, 2, 4):
        model = build_model(mcfg, folder=folder, load_format="safetensors", dtype=torch.float32,
                            device=torch.device("cpu"), max_positions=64, ops=ref_ops, layout=ShardLayout(4, held, 0))
        assert weight_bytes_per_device(g, 4, held) == weight_bytes(model), held
    assert weight_bytes_per_device(g, 4, 2) == 587008  # logged by a rank of --decode-tp 2 --prefill-tp 2
    p = make_plan(cfg, dtype="float32", decode_tp=2, prefill_tp=1, device_memory_gib=1)
    assert p.weight_bytes_per_device == p.weight_bytes  # P = 1: the whole model on every device
    assert p.kv_tokens_fit == int(GIB * 0.9 - p.weight_bytes) // (p.kv_bytes_per_token // 2)
    with pytest.raises(ValueError, match="--prefill-tp 3 must divide --decode-tp 2"):
        make_plan(cfg, decode_tp=2, prefill_tp=3)
    with pytest.raises(ValueError, match="degree 8 does not divide the model's num_key_value_heads 4"):
        make_plan(cfg, decode_tp=8)
