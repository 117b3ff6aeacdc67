"""``--benchmark-model``: a node with no weights that streams real text at no model cost (zero), or whose
steps take a fixed time (sleep:MS); a bad value is refused at start-up."""

import subprocess
import sys
import time

import pytest
import torch

from node.config import ConfigError, NodeConfig
from node.worker.benchmark_model import CYCLE, build_benchmark_model
from node.worker.model_config import ModelConfig
from node.worker.tokenizer import TextTokenizer
from support import BYTE_LEVEL_MODEL_CONFIG, REPO, STORIES, NodeProcess, require_shared, stream, stream_text


def test_zero_model_streams_max_tokens_of_text():
    require_shared()
    node = NodeProcess("--model", str(STORIES), "--benchmark-model", "zero")
    try:
        assert node.status()["benchmark_model"] == "zero"
        assert "BENCHMARK MODEL IN USE" in node.logs()
        for sampling in ({"temperature": 0}, {"temperature": 0.8, "top_p": 0.95, "seed": 1}):
            events = stream(node.client, "/v1/completions",
                            {"prompt": "Once upon a time", "max_tokens": 40, **sampling})
            chunks = [c for e in events if e != "[DONE]" for c in e["choices"]]
            assert chunks[-1]["finish_reason"] == "length"
            text = stream_text(events)[0]
            assert len(text.strip()) >= 40 and text.isprintable(), text  # every token is a word or a letter
        node.wait_idle()
    finally:
        node.close()


def test_sleep_model_steps_take_at_least_the_sleep():
    node = NodeProcess("--benchmark-model", "sleep:5")
    try:
        before = node.status()["devices"][0]["steps"]
        t0 = time.perf_counter()
        for _ in range(2):
            r = node.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 20, "temperature": 0})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 20
        wall_ms = (time.perf_counter() - t0) * 1e3
        steps = node.status()["devices"][0]["steps"] - before
        assert steps >= 40  # one prefill + 19 decode steps each, at least
        assert wall_ms / steps >= 5.0 * 0.95, (wall_ms, steps)
    finally:
        node.close()


@pytest.mark.quick
@pytest.mark.parametrize("value", ["fast", "sleep:", "sleep:x", "sleep:-1", "sleep:inf"])
def test_bad_value_is_a_startup_error(value):
    r = subprocess.run([sys.executable, "-m", "node.cli", "serve", "--benchmark-model", value],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shiftnode: cannot start: --benchmark-model"), r.stderr


@pytest.mark.quick
def test_config_accepts_zero_and_sleep():
    for value in ("zero", "sleep:5", "sleep:0.5"):
        NodeConfig(benchmark_model=value).validate()
    with pytest.raises(ConfigError, match="--benchmark-model"):
        NodeConfig(benchmark_model="sleep").validate()


@pytest.mark.quick
def test_logits_cycle_through_text_tokens_with_the_real_vocab():
    cfg = ModelConfig.from_dict({**BYTE_LEVEL_MODEL_CONFIG, "vocab_size": 128256, "eos_token_id": [2, 128001]})
    tok = TextTokenizer.byte_level()
    model = build_benchmark_model("zero", cfg, tok, torch.device("cpu"), rows=4)
    positions = torch.arange(2 * CYCLE, dtype=torch.int64)
    hidden = model(torch.zeros_like(positions), positions, None, None)
    assert hidden.shape == (2 * CYCLE, cfg.hidden_size)
    logits = model.compute_logits(hidden[positions])
    assert logits.shape == (2 * CYCLE, 128256) and logits.dtype == torch.float32
    top = logits.argmax(-1)
    assert torch.equal(top[:CYCLE], top[CYCLE:]) and len(set(top.tolist())) > 1
    assert all(tok.decode([t]).isalpha() for t in top.tolist())
    probs = torch.softmax(logits[0] / 0.8, -1)
    assert 0.05 < probs.max() < 0.99 and (probs > 1e-4).sum() > 10  # sampling has a real distribution
    assert probs[2] < 1e-9 and probs[128001] < 1e-9  # EOS practically never drawn
