"""Regressions found by trying to break the node: one bad request never hurts the others, expensive
inputs are refused cheaply, and start-up refuses flags and files it cannot run with."""

import concurrent.futures as cf
import json
import shutil
import socket
import time

import pytest

from support import STORIES, NodeProcess, dechunk
from test_api_errors import assert_error, post


@pytest.mark.quick
def test_tiny_temperature_is_greedy_and_never_fails_the_batch(stories_node):
    body = {"prompt": "Once upon a time", "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    with cf.ThreadPoolExecutor(6) as pool:
        greedy = [pool.submit(stories_node.client.post, "/v1/completions", json=body) for _ in range(5)]
        time.sleep(0.05)
        tiny = stories_node.client.post("/v1/completions", json={**body, "temperature": 1e-45})
        results = [f.result() for f in greedy]
    assert all(r.status_code == 200 for r in results) and tiny.status_code == 200
    assert tiny.json()["choices"][0]["text"] == results[0].json()["choices"][0]["text"]


@pytest.mark.quick
def test_huge_prompt_is_refused_without_stalling_others(stories_node):
    with cf.ThreadPoolExecutor(2) as pool:
        other = pool.submit(stories_node.client.post, "/v1/completions",
                            json={"prompt": "Once upon a time", "max_tokens": 100, "ignore_eos": True})
        t0 = time.monotonic()
        r = post(stories_node, "/v1/completions", {"prompt": "a " * (15 * 2**20 // 2)})
        assert_error(r, 400, "prompt")
        assert time.monotonic() - t0 < 5
        assert other.result().status_code == 200


@pytest.mark.quick
def test_stop_string_limits(stories_node):
    assert_error(post(stories_node, "/v1/completions", {"prompt": "x", "stop": ["a"] * 17}), 400, "stop")
    assert_error(post(stories_node, "/v1/completions", {"prompt": "x", "stop": ["a" * 513]}), 400, "stop")


@pytest.mark.quick
@pytest.mark.parametrize("headers,body,status", [
    ({}, b'{"prompt": "x"}', 415),  # valid JSON, no Content-Type: refused like a wrong one
    ({"Content-Type": "text/plain"}, b'{"prompt": "x"}', 415),
    ({"Content-Type": "application/x-www-form-urlencoded"}, b'{"prompt": "x"}', 415),
    ({"Content-Type": "application/json", "Content-Encoding": "gzip"}, b'{"prompt": "x"}', 400),
    ({"Content-Type": "application/json"}, b'{"x":' + b'{"a":' * 50000 + b"1" + b"}" * 50000 + b',"prompt":"a"}', 400),
])
def test_bad_headers_and_nesting(stories_node, headers, body, status):
    assert_error(stories_node.client.post("/v1/completions", content=body, headers=headers), status)


@pytest.mark.quick
def test_chat_without_content_type_is_415(stories_node):
    r = stories_node.client.post("/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": "x"}]}')
    assert "content-type" not in r.request.headers
    assert_error(r, 415)


@pytest.mark.quick
def test_error_param_names_the_field(stories_node):
    assert_error(post(stories_node, "/v1/completions", b"[1, 2]"), 400, None)
    assert post(stories_node, "/v1/completions", b"[1, 2]").json()["error"]["param"] is None
    assert_error(post(stories_node, "/v1/completions", {"max_tokens": 2}), 400, "prompt")
    assert_error(post(stories_node, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                                                             "top_logprobs": 21}), 400, "top_logprobs")
    assert_error(post(stories_node, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 600}]}), 400, "messages")
    assert_error(post(stories_node, "/v1/chat/completions", {"messages": [{"role": 5}]}), 400, "messages[0].role")


@pytest.mark.quick
def test_echo_logprob_tokens_index_into_the_text(stories_node):
    for stream in (False, True):
        body = {"prompt": "Once upon a time 😀", "echo": True, "logprobs": 1, "max_tokens": 6, "temperature": 0}
        if stream:
            with stories_node.client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
            text = "".join(c["text"] for e in events for c in e["choices"])
            lps = [c["logprobs"] for e in events for c in e["choices"] if c["logprobs"]]
            tokens = [t for lp in lps for t in lp["tokens"]]
            offsets = [o for lp in lps for o in lp["text_offset"]]
        else:
            choice = post(stories_node, "/v1/completions", body).json()["choices"][0]
            text, tokens, offsets = choice["text"], choice["logprobs"]["tokens"], choice["logprobs"]["text_offset"]
        # a byte piece of a character is named bytes:\xNN (vLLM); the others join to the text around it
        assert "".join(t for t in tokens if not t.startswith("bytes:")) == text.replace("😀", "")
        assert any(t.startswith("bytes:") for t in tokens)
        assert all(text[o:].startswith(t) for o, t in zip(offsets, tokens) if not t.startswith("bytes:"))


@pytest.mark.quick
def test_chat_text_parts_join_with_newlines(stories_node):
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    r = post(stories_node, "/v1/chat/completions", {"messages": [{"role": "user", "content": parts}], "max_tokens": 1,
                                                    "return_token_ids": True})
    ids = r.json()["choices"][0]["prompt_token_ids"]
    joined = post(stories_node, "/v1/chat/completions", {"messages": [{"role": "user", "content": "a\nb"}], "max_tokens": 1,
                                                         "return_token_ids": True}).json()["choices"][0]["prompt_token_ids"]
    assert ids == joined


def test_more_prompts_than_the_queue_is_a_400_and_slow_bodies_get_408(limits_node):
    """--max-queue 4 and --body-timeout-s 1 (the session's ``limits_node``)."""
    node = limits_node
    assert_error(post(node, "/v1/completions", {"prompt": ["a", "b", "c", "d", "e"], "max_tokens": 2}), 400,
                 "prompt")
    # the limit counts sequences: three prompts of n=2 are six
    r = post(node, "/v1/completions", {"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 2})
    assert_error(r, 400, "prompt")
    assert "6 sequences" in r.json()["error"]["message"]
    s = socket.create_connection(("127.0.0.1", node.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
    s.settimeout(10)
    reply = s.recv(4096)
    s.close()
    assert reply.startswith(b"HTTP/1.1 408"), reply[:100]
    node.wait_idle()


@pytest.mark.parametrize("flags,message", [
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
    (["--max-queue", "0"], "--max-queue"),
    (["--max-model-len", "0"], "--max-model-len"),
    (["--block-size", "0"], "--block-size"),
    (["--devices", "cpu:0,cpu:0"], "--devices"),
    (["--gpu-memory-utilization", "5"], "--gpu-memory-utilization"),
])
def test_startup_refuses_bad_flags(flags, message):
    with pytest.raises(RuntimeError, match=f"cannot start: {message}"):
        NodeProcess("--model", str(STORIES), *flags, timeout_s=60)


@pytest.mark.parametrize("file,content,message", [
    ("config.json", "{not json", "not valid JSON"),
    ("tokenizer_config.json", "[]", "must hold a JSON object"),
    ("generation_config.json", '{"eos_token_id": "x"}', "eos_token_id"),
    ("model.safetensors", "garbage", "not a readable safetensors file"),
    ("tokenizer.json", "garbage", "cannot be loaded"),
])
def test_startup_refuses_broken_model_files(tmp_path, file, content, message):
    folder = tmp_path / "m"
    shutil.copytree(STORIES, folder, ignore=shutil.ignore_patterns("tiny_configs"))
    (folder / file).write_text(content)
    with pytest.raises(RuntimeError, match=f"cannot start: .*{message}") as e:
        NodeProcess("--model", str(folder), timeout_s=60)
    assert "Traceback" not in str(e.value)


def _raw_post(port: int, version: str, body: dict, connection: str = "close") -> bytes:
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(f"POST /v1/completions {version}\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(data)}\r\nConnection: {connection}\r\n\r\n".encode() + data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


@pytest.mark.quick
@pytest.mark.parametrize("version,connection", [("HTTP/1.1", "close"), ("HTTP/1.0", "close"), ("HTTP/1.0", "keep-alive")])
def test_streams_are_framed_for_the_clients_http_version(stories_node, version, connection):
    """The SSE writer frames its own writes: HTTP/1.1 gets valid chunked encoding ending in the empty
    chunk; HTTP/1.0 (no chunked encoding) gets the bare events, ended by the connection's close, even
    when it asked to keep the connection (the read below would time out otherwise)."""
    body = {"prompt": "Once upon a time", "max_tokens": 12, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    head, _, payload = _raw_post(stories_node.port, version, body, connection).partition(b"\r\n\r\n")
    assert head.split(b" ")[1] == b"200", head
    chunked = b"transfer-encoding: chunked" in head.lower()
    assert chunked == (version == "HTTP/1.1")
    events = [line for line in (dechunk(payload) if chunked else payload).decode().split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    parsed = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert sum(len(p["choices"]) for p in parsed) == 12 and parsed[-1]["usage"]["completion_tokens"] == 12
