"""Bad input gets the right status and an OpenAI error body; the node stays alive (API-INPUT cases)."""

import json
import random
import re

import httpx
import pytest


def assert_error(r: httpx.Response, status: int, param: str | None = None):
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err


def post(node, path, body):
    return node.client.post(path, content=body if isinstance(body, (bytes, str)) else json.dumps(body),
                            headers={"Content-Type": "application/json"})


# B01: empty prompts are a 400 (an empty token list) or served (a string still has BOS), never a 5xx.
@pytest.mark.quick
@pytest.mark.parametrize("body,status", [
    ({"prompt": "", "max_tokens": 3}, 200),
    ({"prompt": [""], "max_tokens": 3}, 200),
    ({"prompt": [], "max_tokens": 3}, 400),
    ({"prompt": [[]], "max_tokens": 3}, 400),
])
def test_b01_empty_prompts(stories_node, body, status):
    r = post(stories_node, "/v1/completions", body)
    assert r.status_code == status, r.text
    if status == 400:
        assert_error(r, 400, "prompt")
    else:
        assert r.json()["usage"]["prompt_tokens"] == 1  # BOS only


@pytest.mark.quick
def test_b01_empty_chat_content(stories_node):
    r = post(stories_node, "/v1/chat/completions", {"messages": [{"role": "user", "content": ""}], "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert_error(post(stories_node, "/v1/chat/completions", {"messages": [], "max_tokens": 3}), 400, "messages")


# B02: the max_tokens matrix.
@pytest.mark.quick
@pytest.mark.parametrize("value,status", [(0, 400), (-1, 400), (2.5, 400), ("8", 400), (None, 200), (10**9, 400), (1e9, 400), (8, 200)])
def test_b02_max_tokens(stories_node, value, status):
    body = {"prompt": "Once upon a time", "temperature": 0}
    if value is not None:
        body["max_tokens"] = value
    r = post(stories_node, "/v1/completions", body)
    if status == 200:
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == (16 if value is None else value)
    else:
        assert_error(r, 400, "max_tokens")
        if value == 10**9 and isinstance(value, int):
            assert "512" in r.json()["error"]["message"] and "1000000005" in r.json()["error"]["message"]


# B03: prompts of L-1, L, L+1 tokens against the advertised limit.
@pytest.mark.quick
def test_b03_context_limit(stories_node):
    limit = stories_node.client.get("/v1/models").json()["data"][0]["max_model_len"]
    assert limit == 512
    ok = post(stories_node, "/v1/completions", {"prompt": [1] + [300] * (limit - 2), "max_tokens": 1})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 1
    for length in (limit, limit + 1):
        r = post(stories_node, "/v1/completions", {"prompt": [300] * length, "max_tokens": 1})
        assert_error(r, 400)
        assert str(limit) in r.json()["error"]["message"] and str(length) in r.json()["error"]["message"]
    r = post(stories_node, "/v1/completions", {"prompt": [300] * (limit - 10), "max_tokens": 11})
    assert_error(r, 400, "max_tokens")
    assert str(limit) in r.json()["error"]["message"] and str(limit - 10) in r.json()["error"]["message"]
    # Without max_tokens the default is capped by the room left.
    r = post(stories_node, "/v1/completions", {"prompt": [300] * (limit - 3), "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


# B05: malformed bodies and headers.
@pytest.mark.quick
@pytest.mark.parametrize("body,status", [
    (b"{not json", 400),
    (b"", 400),
    (b"[]", 400),
    (b"null", 400),
    (b'{"prompt": 5}', 400),
    (b'{"prompt": "hi", "max_tokens": "8"}', 400),
    (b'{"prompt": "hi", "temperature": "hot"}', 400),
    (b'{"prompt": "hi", "n": 0}', 400),
    (b'{"prompt": "hi", "stream": "yes"}', 400),
    (b'{"prompt": "\xff\xfe bad utf8"}', 400),
    (b'{"prompt": ["a", 1]}', 400),
    (b'{"prompt": [1, 99999]}', 400),
    (b'{"prompt": "hi", "top_p": 0}', 400),
    (b'{"prompt": "hi", "temperature": -1}', 400),
    (b'{"prompt": "hi", "logprobs": 50}', 400),
    (b'{"prompt": "hi", "stop": [""]}', 400),
    (b'{"prompt": "hi", "stop_token_ids": [-3]}', 400),
    (b'{"prompt": "hi", "logit_bias": {"5": 101}}', 400),  # out of [-100, 100]
    (b'{"prompt": "hi", "logit_bias": {"x": 1}}', 400),  # not a token id
    (b'{"prompt": "hi", "no_such_field": 1}', 400),  # unknown fields are refused, never ignored
    (b'{"prompt": "hi", "model": "gpt-4"}', 404),
    (b'{"messages": "hi"}', 400),
    (b'{"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}}', 400),
])
def test_b05_malformed(stories_node, body, status):
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    assert_error(post(stories_node, path, body), status)
    assert stories_node.alive()


@pytest.mark.quick
def test_b05_bad_chat_messages(stories_node):
    for messages in ([{"role": "wizard", "content": "x"}], [{"content": "x"}], [{"role": "user", "content": [{"type": "image_url"}]}]):
        assert_error(post(stories_node, "/v1/chat/completions", {"messages": messages}), 400)


@pytest.mark.quick
def test_unknown_route_and_method(stories_node):
    assert_error(stories_node.client.get("/v1/nothing"), 404)
    assert_error(stories_node.client.get("/v1/completions"), 405)


# B06: a 1-3 MiB body within context is accepted as a body (then judged on its content); 64 MiB is a quick 413.
@pytest.mark.quick
def test_b06_body_sizes(stories_node):
    padding = " " * (3 * 1024 * 1024)
    r = post(stories_node, "/v1/completions", '{"prompt": "Once upon a time", "max_tokens": 2,' + padding + '"temperature": 0}')
    assert r.status_code == 200, r.text
    r = post(stories_node, "/v1/completions", b'{"prompt": "' + b"a" * (64 * 1024 * 1024) + b'"}')
    assert_error(r, 413)
    assert stories_node.alive()


def test_fuzz_random_bodies_never_500(stories_node):
    rng = random.Random(1234)
    seeds = [b'{"prompt": "Once", "max_tokens": 2}', b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}',
             b'{"prompt": [1, 2, 3], "n": 2, "logprobs": 2, "echo": true, "max_tokens": 2}']
    for i in range(200):
        base = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 6)):
            op = rng.random()
            pos = rng.randrange(len(base) + 1)
            if op < 0.4 and base:
                base[min(pos, len(base) - 1)] = rng.randrange(256)
            elif op < 0.7:
                base[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
            elif base:
                del base[min(pos, len(base) - 1)]
        path = "/v1/chat/completions" if i % 2 else "/v1/completions"
        r = post(stories_node, path, bytes(base))
        assert r.status_code < 500, (bytes(base), r.text)
        if r.status_code != 200:
            assert "error" in r.json()
    assert stories_node.alive()
    stories_node.wait_idle()


def test_api_key_required(keyed_node):
    node = keyed_node
    assert_error(node.client.get("/v1/models"), 401)
    assert_error(node.client.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer wrong"}), 401)
    ok = node.client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 2},
                          headers={"Authorization": "Bearer sekrit"})
    assert ok.status_code == 200
    assert node.client.get("/health").status_code == 200  # health needs no key


@pytest.mark.quick
def test_plain_text_response_format_is_accepted(stories_node):
    r = post(stories_node, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                    "response_format": {"type": "text"}})
    assert r.status_code == 200, r.text


CHAT_X = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}


@pytest.mark.quick
@pytest.mark.parametrize("key", ["messages", "tools", "add_generation_prompt", "continue_final_message", "self",
                                 "chat_template", "bos_token"])
def test_reserved_chat_template_kwargs_are_a_400_on_chat_and_tokenize(stories_node, key):
    for path, body in (("/v1/chat/completions", CHAT_X), ("/tokenize", {"messages": CHAT_X["messages"]})):
        assert_error(post(stories_node, path, {**body, "chat_template_kwargs": {key: 5}}), 400, f"chat_template_kwargs.{key}")


@pytest.mark.quick
@pytest.mark.parametrize("body,param", [
    ({**CHAT_X, "stream_options": {"include_usage": True}}, "stream_options"),
    ({**CHAT_X, "stream": False, "stream_options": {"continuous_usage_stats": True}}, "stream_options"),
    ({**CHAT_X, "tool_choice": "auto"}, "tool_choice"),
    ({**CHAT_X, "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({**CHAT_X, "parallel_tool_calls": False}, "parallel_tool_calls"),
    ({**CHAT_X, "reasoning_effort": "ultra"}, "reasoning_effort"),
    ({**CHAT_X, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    ({**CHAT_X, "messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "4"}]}, "messages[1].tool_call_id"),
    ({**CHAT_X, "request_id": ""}, "request_id"),
    ({**CHAT_X, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
])
def test_fields_that_would_be_dropped_or_misread_are_a_400(stories_node, body, param):
    assert_error(post(stories_node, "/v1/chat/completions", body), 400, param)


@pytest.mark.quick
def test_the_accepted_forms_of_those_fields_still_serve(stories_node):
    for extra in ({"reasoning_effort": "low"}, {"stream": True, "stream_options": {"include_usage": True}},
                  {"tool_choice": "none"},  # without tools: served, as vLLM serves it (clients send it as a default)
                  {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}):
        r = post(stories_node, "/v1/chat/completions", {**CHAT_X, **extra})
        assert r.status_code == 200, (extra, r.text)
    r = post(stories_node, "/v1/completions", {"prompt": "Once", "max_tokens": 2, "stream": True,
                                               "stream_options": {"include_usage": True}})
    assert r.status_code == 200, r.text
    assert_error(post(stories_node, "/v1/completions", {"prompt": "Once", "max_tokens": 2,
                                                        "stream_options": {"include_usage": True}}), 400, "stream_options")


@pytest.mark.quick
def test_an_over_long_prompt_error_gives_its_length_in_tokens(stories_node):
    limit = post(stories_node, "/tokenize", {"prompt": "Once"}).json()["max_model_len"]
    text = "Once upon a time " * 400
    for path, body in (("/v1/completions", {"prompt": text, "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 2})):
        r = post(stories_node, path, body)
        assert_error(r, 400, "prompt" if "prompt" in body else "messages")
        msg = r.json()["error"]["message"]
        assert f"{limit} tokens" in msg and "characters" not in msg, msg
        assert int(re.search(r"However, your .* is (\d+) tokens", msg).group(1)) > limit, msg
