"""The node starts with no files (embedded default model) and serves a completion."""

from support import NodeProcess


def test_embedded_default_serves():
    node = NodeProcess()
    try:
        models = node.client.get("/v1/models").json()["data"]
        assert models[0]["id"] == "shiftnode-default"
        r = node.client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        again = node.client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert again.json()["choices"][0]["text"] == r.json()["choices"][0]["text"]  # fixed seed, greedy
        chat = node.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert chat.status_code == 200
        assert "weights are random" in node.logs()
    finally:
        node.close()
