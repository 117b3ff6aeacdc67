"""Small faults a new user hit (issue 32, item 6): each is a clear answer now.

* ``Authorization: bearer KEY``: the scheme is case-insensitive (RFC 7235 §2.1), it was a 401;
* fields that change what is generated and are not implemented (structured output, beam search,
  tool choice, functions, audio) were silently ignored: now a 400 naming the field;
* logprobs of tokens that are part of a UTF-8 character: ``top_logprobs`` keys collided (each decodes
  to U+FFFD alone) and chat ``bytes`` were U+FFFD's; now the token's own bytes and distinct names;
* ``--peers`` naming an HTTP port: the KV handshake read "HTTP" as a frame length (FrameTooLarge);
  now ``/health`` and the log say the peer did not answer the shiftnode KV handshake;
* a node's own KV address as its peer: refused at start and by ``POST /v1/node/peers``.
"""

from __future__ import annotations

import time

import pytest

from node.api.responses import chat_logprobs, completion_logprobs
from node.config import ConfigError, NodeConfig
from node.worker.sample_request import TokenLogprobs
from node.worker.tokenizer import IncrementalDetokenizer, TextTokenizer
from support import STORIES, NodeProcess, free_port, require_shared
from test_api_errors import assert_error, post


def test_bearer_scheme_is_case_insensitive(keyed_node):
    node = keyed_node
    for header in ("bearer sekrit", "BEARER sekrit", "Bearer  sekrit"):
        r = node.client.get("/v1/models", headers={"Authorization": header})
        assert r.status_code == 200, (header, r.text)
    for header in ("bearer wrong", "Basic sekrit", "sekrit", "bearersekrit"):
        assert_error(node.client.get("/v1/models", headers={"Authorization": header}), 401)
    assert node.client.get("/dashboard", headers={"Authorization": "bearer sekrit"}).status_code == 200


@pytest.mark.quick
@pytest.mark.parametrize("path,field,value", [
    ("/v1/completions", "use_beam_search", True),
    ("/v1/completions", "logit_bias", {"5": 1000.0}),  # out of [-100, 100] (logit_bias itself works)
    ("/v1/chat/completions", "tool_choice", "required"),
    ("/v1/chat/completions", "functions", [{"name": "f", "parameters": {}}]),
    ("/v1/chat/completions", "function_call", {"name": "f"}),
    ("/v1/chat/completions", "modalities", ["text", "audio"]),
    ("/v1/chat/completions", "audio", {"voice": "alloy", "format": "wav"}),
])
def test_unsupported_fields_that_change_the_output_are_a_400(stories_node, path, field, value):
    body = {"prompt": "Once"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    r = post(stories_node, path, {**body, "max_tokens": 2, field: value})
    assert_error(r, 400, field)
    assert field in r.json()["error"]["message"] or field == "use_beam_search"


@pytest.mark.quick
def test_harmless_values_of_those_fields_are_served(stories_node):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for extra in ({"tool_choice": "none"}, {"modalities": ["text"]}, {"logit_bias": {}}):
        r = post(stories_node, "/v1/chat/completions", {**chat, **extra})
        assert r.status_code == 200, (extra, r.text)
    r = post(stories_node, "/v1/chat/completions", {**chat, "tool_choice": "auto"})  # asks for tools it lacks
    assert_error(r, 400, "tool_choice")


@pytest.mark.quick
def test_logprobs_of_partial_utf8_tokens_have_their_bytes_and_distinct_names():
    require_shared()
    tok = TextTokenizer.from_folder(STORIES)
    ids = {tok.id_to_token(i): i for i in range(tok.vocab_size)}
    e2, x80, x9c = ids["<0xE2>"], ids["<0x80>"], ids["<0x9C>"]  # "“" is E2 80 9C: three byte-fallback tokens
    word = next(i for p, i in ids.items() if p.startswith("▁") and len(p) > 3)
    assert tok.token_text(e2) == tok.token_text(x80) == "\ufffd"  # why the keys collided
    entry = TokenLogprobs(e2, -0.5, [(e2, -0.5), (x80, -1.0), (x9c, -2.0), (word, -3.0)])
    chat = chat_logprobs(tok, [entry])["content"][0]
    assert chat["token"] == "bytes:\\xe2" and chat["bytes"] == [0xE2]
    assert [t["bytes"] for t in chat["top_logprobs"]] == [[0xE2], [0x80], [0x9C], list(tok.token_text(word).encode())]
    assert chat["top_logprobs"][3]["token"] == tok.token_text(word)
    body, _ = completion_logprobs(tok, [entry], [e2], IncrementalDetokenizer(tok, []), 0)
    assert body["top_logprobs"][0] == {"bytes:\\xe2": -0.5, "bytes:\\x80": -1.0, "bytes:\\x9c": -2.0,
                                       tok.token_text(word): -3.0}


@pytest.mark.quick
def test_own_kv_address_is_refused_at_start():
    for peer in ("127.0.0.1:9100", "localhost:9100", "[::1]:9100", "0.0.0.0:9100"):
        with pytest.raises(ConfigError, match="own KV address"):
            NodeConfig(kv_port=9100, peers=[peer], peer_secret="s").validate()
    NodeConfig(kv_port=9100, peers=["127.0.0.1:9101", "10.0.0.7:9100"], peer_secret="s").validate()


def test_an_http_port_given_as_peer_is_named_in_health_and_logs(stories_node):
    """The peer list names another node's HTTP port; the node's own KV address is refused at run time."""
    kv_port = free_port()
    node = NodeProcess("--model", str(STORIES), "--mode", "adaptive", "--peer-secret", "s", "--kv-port", str(kv_port),
                       "--peers", f"127.0.0.1:{stories_node.port}")
    try:
        deadline = time.monotonic() + 20
        reasons: list[str] = []
        while time.monotonic() < deadline:
            reasons = node.client.get("/health").json().get("reasons", [])
            if any("did not answer the shiftnode KV handshake" in r for r in reasons):
                break
            time.sleep(0.1)
        [reason] = [r for r in reasons if f"127.0.0.1:{stories_node.port}" in r]
        assert "did not answer the shiftnode KV handshake" in reason and "HTTP" in reason, reasons
        assert "FrameTooLarge" not in node.logs() and "did not answer the shiftnode KV handshake" in node.logs()
        r = post(node, "/v1/node/peers", {"add": [f"127.0.0.1:{kv_port}"]})
        assert_error(r, 400, "add")
        assert "own KV address" in r.json()["error"]["message"]
    finally:
        node.close()
