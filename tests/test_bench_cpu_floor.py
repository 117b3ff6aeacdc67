"""bench.load.cpu_floor: the weights a decode step reads, and one tiny run against a baseline checkout."""

import json

import pytest
import torch

from bench.load.cpu_floor import main, weights_read_per_step
from node.worker.model_config import ModelConfig
from node.worker.weights import build_model

TINY = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 300,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "torch_dtype": "float32"}


@pytest.mark.quick
def test_weights_read_per_step_are_the_projections_and_the_head(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    model = build_model(ModelConfig.from_folder(tmp_path), folder=None, load_format="dummy", dtype=torch.float32,
                        device=torch.device("cpu"), max_positions=16, ops=None)
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n or "layernorm" in n)
    assert weights_read_per_step(tmp_path) == sum(p.numel() for p in model.parameters()) - \
        model.embed_tokens.weight.numel() - norms


def test_a_tiny_run_against_a_baseline_reports_both_floors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    out = tmp_path / "out.json"
    assert main(["--config", str(tmp_path), "--batches", "1,4", "--context", "20", "--rounds", "1", "--steps", "2",
                 "--baseline", ".", "--baseline-dtype", "float32", "--dtype", "bfloat16", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["copy_gbps"] > 0 and res["matmul_gflops"] > 0
    rows = {(r["worker"], r["batch"]): r for r in res["rows"]}
    assert set(rows) == {("new", 1), ("new", 4), ("old", 1), ("old", 4)}
    assert rows[("new", 4)]["dtype"] == "bfloat16" and rows[("old", 4)]["dtype"] == "float32"
    for r in rows.values():
        assert r["tokens_s"] > 0 and 0 < r["of_bandwidth_floor"] and 0 < r["of_roofline"]
        assert abs(r["tokens_s"] - r["batch"] / (r["step_ms"] / 1e3)) < 1e-6 * r["tokens_s"]
