"""With no --model the node serves the embedded stories260k (package data under node/models/), whose greedy
continuations are the reference's token for token; --load-format dummy gives random weights of its geometry."""

import fnmatch
import tomllib
from pathlib import Path

import pytest

from node.config import EMBEDDED_MODEL
from support import REPO, STORIES, NodeProcess, reference_cases, require_shared, stream, stream_text, up


@pytest.mark.quick
def test_the_embedded_default_is_the_shared_stories260k_and_ships_in_the_wheel():
    """Every file of the embedded folder is the shared folder's (same bytes) and is package data, so a
    non-editable install carries it: pyproject's package-data globs match each one."""
    require_shared()
    folder = Path(EMBEDDED_MODEL)
    names = sorted(p.name for p in folder.iterdir())
    for need in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "config.json", "generation_config.json", "chat_template.jinja", "LICENSE", "README.md"):
        assert need in names, need
    for name in names:
        if name != "README.md":  # the embedded folder's own README names its source
            assert (folder / name).read_bytes() == (STORIES / name).read_bytes(), name
    package_data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    for name in names:
        rel = (folder / name).relative_to(REPO / "node").as_posix()
        assert any(fnmatch.fnmatch(rel, g) for g in package_data.get("node", [])), f"{rel} is not package data"
    assert "MIT License" in (folder / "LICENSE").read_text()


def test_with_no_model_the_node_tells_the_reference_stories_and_dummy_keeps_random_weights():
    require_shared()
    node, dummy = up(NodeProcess(wait=False), NodeProcess("--load-format", "dummy", wait=False))
    try:
        (model,) = node.client.get("/v1/models").json()["data"]
        assert model["id"] == "stories260k" and model["root"] == EMBEDDED_MODEL and model["vocab_size"] == 512
        for case in reference_cases():  # greedy, float32: exact tokens and text
            r = node.client.post("/v1/completions", json={
                "prompt": case["prompt"], "max_tokens": case["max_new_tokens"], "temperature": 0,
                "return_token_ids": True})
            choice = r.json()["choices"][0]
            assert choice["token_ids"] == case["output_token_ids"], case["prompt"]
            assert choice["text"] == case["output_text"], case["prompt"]
        # the README's first curl, streamed: the first 32 tokens of the first story
        first = reference_cases()[0]
        text = stream_text(stream(node.client, "/v1/completions", {"prompt": first["prompt"], "max_tokens": 32, "temperature": 0}))[0]
        assert text.startswith(", there was a little girl named Lily.") and first["output_text"].startswith(text)
        chat = node.client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 8, "temperature": 0})
        assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 8
        assert "random_weights=False" in node.logs() and "weights are random" not in node.logs(), node.logs()

        # --load-format dummy: the embedded geometry and tokenizer, random weights (fixed seed), said so
        assert dummy.client.get("/v1/models").json()["data"][0]["id"] == "stories260k"
        body = {"prompt": first["prompt"], "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        a, b = (dummy.client.post("/v1/completions", json=body).json()["choices"][0] for _ in range(2))
        assert a["token_ids"] == b["token_ids"] and len(a["token_ids"]) == 16  # fixed seed, greedy
        assert a["token_ids"] != first["output_token_ids"][:16]
        assert "weights are random" in dummy.logs() and "random_weights=True" in dummy.logs()
    finally:
        node.close()
        dummy.close()
