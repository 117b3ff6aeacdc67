"""Checkpoint loading: sharded files, clear errors for bad folders, and the KV start-up check."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import shiftnode_kernels.reference as ops
from node.config import NodeConfig
from node.worker.loader import StartupError, build_runner, load_model_info
from node.worker.model_config import ModelConfig, ModelConfigError
from node.worker.weights import WeightLoadError, build_model
from support import REPO, STORIES, NodeProcess, require_shared


def _copy(tmp_path):
    require_shared()
    dst = tmp_path / "m"
    shutil.copytree(STORIES, dst, ignore=shutil.ignore_patterns("tiny_configs"))
    return dst


def _load(folder):
    cfg = ModelConfig.from_folder(folder)
    return build_model(cfg, folder=folder, load_format="safetensors", dtype=torch.float32,
                       device=torch.device("cpu"), max_positions=64, ops=ops)


@pytest.mark.quick
def test_sharded_checkpoint_loads_identically(tmp_path):
    folder = _copy(tmp_path)
    tensors = load_file(folder / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, folder / fname)
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    sharded = _load(folder)
    whole = _load(STORIES)
    for (n1, p1), (n2, p2) in zip(sharded.named_parameters(), whole.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)


@pytest.mark.quick
def test_clear_errors(tmp_path):
    folder = _copy(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelConfigError, match="unsupported architecture"):
        ModelConfig.from_folder(folder)
    (folder / "config.json").write_text(json.dumps({**cfg, "hidden_size": 72}))
    with pytest.raises(WeightLoadError, match="shape mismatch"):
        _load(folder)
    (folder / "config.json").write_text(json.dumps({**cfg, "rope_scaling": {"rope_type": "yarn", "factor": 4}}))
    with pytest.raises(ModelConfigError, match="yarn"):
        ModelConfig.from_folder(folder)
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "model.safetensors").unlink()
    with pytest.raises(WeightLoadError, match="no model.safetensors"):
        _load(folder)
    with pytest.raises(ModelConfigError, match="no config.json"):
        ModelConfig.from_folder(tmp_path / "nowhere")


@pytest.mark.quick
def test_refuses_kv_budget_below_one_sequence():
    config = NodeConfig(model=str(STORIES), kv_cache_memory_bytes=100_000)
    with pytest.raises(StartupError, match=r"holds 64 tokens .* 512 tokens"):
        build_runner(config, load_model_info(config), "cpu:0", ops)


def test_refuses_a_cpu_kv_pool_the_host_cannot_hold():
    """A --kv-cache-memory far above the host's memory is refused at start, not left to the out-of-memory
    killer (a fresh user's 10TiB took the whole machine down)."""
    from node.worker.loader import available_host_bytes

    avail = available_host_bytes()
    assert avail is not None and avail > 0
    config = NodeConfig(model=str(STORIES), kv_cache_memory_bytes=4 * avail)
    with pytest.raises(StartupError, match="available memory"):
        build_runner(config, load_model_info(config), "cpu:0", ops)


def test_cli_reports_startup_error_and_exits(tmp_path):
    with pytest.raises(RuntimeError, match="cannot start: .*fewer than one max-length sequence"):
        NodeProcess("--model", str(STORIES), "--kv-cache-memory", "100000", timeout_s=60)


def test_building_a_model_does_not_import_sympy():
    """Every engine process builds its model: allocating the meta-built modules must not run torch's
    Python decompositions (``to_empty``'s ``empty_like`` on meta tensors imports sympy, ~0.4 s a process)."""
    require_shared()
    code = ("import sys, torch\nfrom test_loading import _load, STORIES\n_load(STORIES)\n"
            "assert 'sympy' not in sys.modules, 'building the model imported sympy'\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "kernels"), str(REPO / "tests")])}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_a_config_only_folder_with_random_weights_gets_the_byte_level_tokenizer(tmp_path):
    from node.worker.tokenizer import TokenizerError

    shutil.copy(REPO / "bench/configs/llama-85m/config.json", tmp_path / "config.json")
    info = load_model_info(NodeConfig(model=str(tmp_path), load_format="dummy"))
    assert info.tokenizer.vocab_size == 259 and info.cfg.hidden_size == 768
    with pytest.raises(TokenizerError, match="no tokenizer.json"):  # real weights need their own tokenizer
        load_model_info(NodeConfig(model=str(tmp_path)))
