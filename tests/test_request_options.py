"""vLLM's per-request options on the real stories260k node (issue 44 items 4 and 5): each test fails
without its feature (the field was refused, or accepted and dropped)."""

import pytest
import uuid

from support import stream

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here

PROMPT = "Once upon a time"  # greedy: ", there was a little girl named Lily. ..."
BYTES_ZH = [231, 187, 176]  # "中" in stories260k's tokenizer: byte-fallback tokens <0xE4> <0xB8> <0xAD>


def complete(node, **body):
    r = node.client.post("/v1/completions", json={"prompt": PROMPT, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def chat(node, messages, **body):
    r = node.client.post("/v1/chat/completions", json={"messages": messages, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_logit_bias_forces_a_token(stories_node):
    out = complete(stories_node, max_tokens=6, logit_bias={"400": 100}, return_token_ids=True)
    assert out["choices"][0]["token_ids"] == [400] * 6
    r = stories_node.client.post("/v1/completions", json={"prompt": PROMPT, "logit_bias": {"99999": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"


def test_allowed_token_ids_limit_the_choice(stories_node):
    out = complete(stories_node, max_tokens=8, temperature=1.0, seed=3, allowed_token_ids=[300, 301],
                   return_token_ids=True)
    assert set(out["choices"][0]["token_ids"]) <= {300, 301}


def test_bad_words_are_never_completed(stories_node):
    plain = complete(stories_node, max_tokens=12)["choices"][0]["text"]
    assert " there" in plain and " girl" in plain
    out = complete(stories_node, max_tokens=12, bad_words=["there", "little girl"])["choices"][0]["text"]
    assert "there" not in out and "little girl" not in out and out != plain


def test_include_stop_str_in_output(stories_node):
    cut = complete(stories_node, max_tokens=12, stop=["girl"])["choices"][0]
    kept = complete(stories_node, max_tokens=12, stop=["girl"], include_stop_str_in_output=True)["choices"][0]
    assert cut["finish_reason"] == kept["finish_reason"] == "stop"
    assert not cut["text"].endswith("girl") and kept["text"] == cut["text"] + "girl"


def test_skip_special_tokens(stories_node):
    body = {"max_tokens": 3, "logit_bias": {"1": 100}, "ignore_eos": True}  # BOS <s>, a special token
    assert complete(stories_node, **body)["choices"][0]["text"] == ""
    assert complete(stories_node, **body, skip_special_tokens=False)["choices"][0]["text"] == "<s><s><s>"


def test_add_special_tokens_and_truncate_prompt_tokens(stories_node):
    full = complete(stories_node, max_tokens=1, return_token_ids=True)["choices"][0]["prompt_token_ids"]
    assert full[0] == 1  # BOS
    bare = complete(stories_node, max_tokens=1, return_token_ids=True, add_special_tokens=False)
    assert bare["choices"][0]["prompt_token_ids"] == full[1:]
    cut = complete(stories_node, max_tokens=1, return_token_ids=True, truncate_prompt_tokens=2)
    assert cut["choices"][0]["prompt_token_ids"] == full[-2:] and cut["usage"]["prompt_tokens"] == 2
    r = stories_node.client.post("/v1/completions", json={"prompt": PROMPT, "truncate_prompt_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


def test_continue_final_message_and_chat_echo(stories_node):
    msgs = [{"role": "user", "content": "Tell me a story"}, {"role": "assistant", "content": PROMPT}]
    body = {"max_tokens": 6, "add_generation_prompt": False, "continue_final_message": True, "return_token_ids": True}
    out = chat(stories_node, msgs, **body)
    prompt_text = stories_node.client.post("/detokenize", json={"tokens": out["choices"][0]["prompt_token_ids"]}).json()
    assert prompt_text["prompt"].endswith("Assistant: " + PROMPT)  # left open, no new turn after it
    text = out["choices"][0]["message"]["content"]
    assert text == complete(stories_node, max_tokens=6)["choices"][0]["text"]  # the story goes on
    echoed = chat(stories_node, msgs, **body, echo=True)["choices"][0]["message"]["content"]
    assert echoed == PROMPT + text
    events = stream(stories_node.client, "/v1/chat/completions",
                    {"messages": msgs, "temperature": 0, **body, "echo": True, "stream": True})
    assert "".join(c["delta"].get("content", "") for e in events[:-1] for c in e["choices"]) == PROMPT + text
    no_echo = chat(stories_node, msgs[:1], max_tokens=3, echo=True)["choices"][0]["message"]["content"]
    assert not no_echo.startswith("Tell me")  # a new assistant turn: nothing of the user's is echoed
    r = stories_node.client.post("/v1/chat/completions", json={"messages": msgs, "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


def test_continuous_usage_stats(stories_node):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = stream(stories_node.client, "/v1/chat/completions", body)[:-1]
    assert all(e["usage"] is not None for e in events)
    counts = [e["usage"]["completion_tokens"] for e in events if e["choices"]]
    assert counts[0] == 0 and counts[-1] == 4 and counts == sorted(counts)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4


def test_prompt_logprobs_keyed_by_token_id(stories_node):
    text = PROMPT + " 中"
    out = complete(stories_node, prompt=text, max_tokens=1, prompt_logprobs=2, return_token_ids=True)["choices"][0]
    ids, plp = out["prompt_token_ids"], out["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for tid, row in zip(ids[1:], plp[1:]):
        assert str(tid) in row and set(row[str(tid)]) == {"logprob", "rank", "decoded_token"}
        assert 2 <= len(row) <= 3  # the prompt's token and the top 2 (it may be one of them)
    assert [plp[ids.index(t)][str(t)]["decoded_token"] for t in BYTES_ZH] == ["bytes:\\xe4", "bytes:\\xb8", "bytes:\\xad"]
    echoed = complete(stories_node, prompt=text, max_tokens=1, prompt_logprobs=3, echo=True, logprobs=1)["choices"][0]
    assert all(len(t) == 1 for t in echoed["logprobs"]["top_logprobs"] if t)  # the echo lists logprobs=1
    assert all(len(row) >= 3 for row in echoed["prompt_logprobs"][1:])
    whole = chat(stories_node, [{"role": "user", "content": "Hi"}], max_tokens=1, prompt_logprobs=0)
    assert whole["prompt_logprobs"][0] is None and len(whole["prompt_logprobs"]) == whole["usage"]["prompt_tokens"]


def test_return_tokens_as_token_ids(stories_node):
    out = complete(stories_node, max_tokens=3, logprobs=2, return_tokens_as_token_ids=True, return_token_ids=True)
    c = out["choices"][0]
    assert c["logprobs"]["tokens"] == [f"token_id:{t}" for t in c["token_ids"]]
    assert all(k.startswith("token_id:") for top in c["logprobs"]["top_logprobs"] for k in top)


def test_partial_utf8_logprobs_are_byte_exact(stories_node):
    msgs = [{"role": "user", "content": "Hi"}]
    out = chat(stories_node, msgs, max_tokens=3, ignore_eos=True, logprobs=True, top_logprobs=2,
               allowed_token_ids=BYTES_ZH, logit_bias={"231": 100})
    first = out["choices"][0]["logprobs"]["content"][0]
    assert first["token"] == "bytes:\\xe4" and first["bytes"] == [0xE4]  # not U+FFFD's [239, 191, 189]
    body = {"prompt": PROMPT + " 中中", "max_tokens": 1, "echo": True, "logprobs": 1}
    lp = complete(stories_node, **body)["choices"][0]["logprobs"]
    assert lp["tokens"][-7:-1] == ["bytes:\\xe4", "bytes:\\xb8", "bytes:\\xad"] * 2  # vLLM's names, in tokens too
    assert "".join(t for t in lp["tokens"] if not t.startswith("bytes:")).startswith(PROMPT + " ")
    tops = [k for t in lp["top_logprobs"] if t for k in t]
    assert "\ufffd" not in "".join(tops)  # a partial character is named by its bytes, never by U+FFFD


def test_cache_salt_separates_prefix_cache_hits(stories_node):
    prompt = "Salted story " + uuid.uuid4().hex + " and a cat named Tom went to the park to play ball."

    def cached(**extra):
        return complete(stories_node, prompt=prompt, max_tokens=1, **extra)["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-a") > 0  # the same tenant hits its own prefix
    assert cached(cache_salt="tenant-b") == 0  # another tenant does not
    assert cached() == 0  # nor an unsalted request
    assert cached() > 0


def test_x_request_id_is_read_and_echoed(stories_node):
    c = stories_node.client
    r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, headers={"X-Request-Id": "trace-42"})
    assert r.headers["X-Request-Id"] == "trace-42" and r.json()["id"] == "cmpl-trace-42"
    r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                                             "request_id": "body-7"})
    assert r.headers["X-Request-Id"] == "body-7" and r.json()["id"] == "chatcmpl-body-7"
    with c.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "stream": True},
                  headers={"X-Request-Id": "s-1"}) as s:
        assert s.headers["X-Request-Id"] == "s-1" and '"id":"cmpl-s-1"' in s.read().decode()
    r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    assert r.headers["X-Request-Id"] == r.json()["id"]  # none given: the node's own id
    assert c.get("/health", headers={"X-Request-Id": "h"}).headers["X-Request-Id"] == "h"


def test_tokenize_and_detokenize(stories_node):
    c = stories_node.client
    t = c.post("/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()
    assert t["tokens"][0] == 1 and t["count"] == len(t["tokens"]) and t["max_model_len"] == 512
    assert t["token_strs"][1] == "\u2581Once"
    assert c.post("/detokenize", json={"tokens": t["tokens"]}).json() == {"prompt": PROMPT}
    bare = c.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()
    assert bare["tokens"] == t["tokens"][1:] and bare["token_strs"] is None
    msgs = [{"role": "user", "content": "Hi"}]
    ct = c.post("/tokenize", json={"messages": msgs}).json()
    gen = chat(stories_node, msgs, max_tokens=1, return_token_ids=True)["choices"][0]["prompt_token_ids"]
    assert ct["tokens"] == gen  # rendered as the chat endpoint renders it
    assert c.post("/detokenize", json={"tokens": [10**6]}).status_code == 400
    r = c.post("/tokenize", json={"prompt": PROMPT, "bogus": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bogus"


def test_through_the_openai_sdk(stories_node):
    from openai import OpenAI

    client = OpenAI(base_url=stories_node.url + "/v1", api_key="unused")
    out = client.completions.create(model="stories260k", prompt=PROMPT, max_tokens=12, temperature=0,
                                    stop=["girl"], extra_body={"bad_words": ["there"], "include_stop_str_in_output": True})
    assert "there" not in out.choices[0].text
    raw = client.chat.completions.with_raw_response.create(
        model="stories260k", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
        extra_headers={"X-Request-Id": "sdk-1"}, extra_body={"allowed_token_ids": BYTES_ZH, "skip_special_tokens": True})
    assert raw.headers["X-Request-Id"] == "sdk-1" and raw.parse().id == "chatcmpl-sdk-1"
    chunks = list(client.chat.completions.create(
        model="stories260k", messages=[{"role": "user", "content": "Hi"}], max_tokens=3, stream=True,
        stream_options={"include_usage": True}, extra_body={"stream_options": {"include_usage": True,
                                                                                "continuous_usage_stats": True}}))
    assert all(c.usage is not None for c in chunks)


def test_token_masks_beside_a_grammar_are_refused_not_broken(stories_node):
    """allowed_token_ids or bad_words beside a grammar could leave a step no token both allow; it drew
    token 0 then (``[0, 300, 300]`` for this body), breaking the grammar's guarantee."""
    body = {"prompt": "Once", "max_tokens": 3, "allowed_token_ids": [300], "guided_regex": "[0-9]+", "return_token_ids": True}
    r = stories_node.client.post("/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", r.text
    r = stories_node.client.post("/v1/completions", json={**body, "allowed_token_ids": None, "bad_words": ["1"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words", r.text
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    r = stories_node.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "tools": tools, "tool_choice": "required",
        "allowed_token_ids": [300, 301]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", r.text
    assert complete(stories_node, max_tokens=2, guided_regex="[0-9]+")["choices"][0]["text"].isdigit()
    word = stories_node.client.post("/detokenize", json={"tokens": [400]}).json()["prompt"]  # a one-token word
    r = stories_node.client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 2, "allowed_token_ids": [400],
                                                           "bad_words": [word]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words", r.text
    stories_node.wait_idle()  # nothing leaked: every device back to 0 KV blocks


def test_completion_logprob_tokens_of_partial_characters_match_their_keys(stories_node):
    """Tokens that are pieces of characters came back as "" with text_offset 0; and the echoed first
    token was "Once" while its top_logprobs key was " Once"."""
    out = complete(stories_node, prompt="Once", max_tokens=6, allowed_token_ids=[229, 131, 159], seed=1, temperature=1.0,
                   logprobs=2, return_token_ids=True)["choices"][0]
    lp = out["logprobs"]
    # stories260k's byte-fallback token of byte b is id b + 3 (BYTES_ZH); named as in top_logprobs keys
    assert lp["tokens"] == [f"bytes:\\x{t - 3:02x}" for t in out["token_ids"]], lp["tokens"]
    assert not any("\ufffd" in k or k == "" for top in lp["top_logprobs"] for k in top)
    assert all(0 <= o <= len(out["text"]) for o in lp["text_offset"]) and lp["text_offset"] == sorted(lp["text_offset"])
    echo = complete(stories_node, prompt="Once upon", max_tokens=1, echo=True, logprobs=1)["choices"][0]["logprobs"]
    # the chosen token is keyed by its own string ("Once"), never by another decoding of it (" Once")
    assert not any(k != tok and k.strip() == tok.strip() for tok, top in zip(echo["tokens"][1:], echo["top_logprobs"][1:])
                   for k in top), echo


def test_continuous_usage_stats_report_one_cached_count(stories_node):
    """The role chunk went out before the prefill and said cached_tokens 0, later chunks 16."""
    body = {"messages": [{"role": "user", "content": "Once upon a time there was a little dog named Max " * 3}],
            "max_tokens": 3, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    stream(stories_node.client, "/v1/chat/completions", body)  # fills the prefix cache
    events = stream(stories_node.client, "/v1/chat/completions", body)[:-1]
    assert events[0]["choices"][0]["delta"].get("role") == "assistant"
    cached = {e["usage"]["prompt_tokens_details"]["cached_tokens"] for e in events}
    assert len(cached) == 1 and cached.pop() > 0, events
