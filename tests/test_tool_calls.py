"""Issue 44 item 2: tool calling.

* The parsers (hermes, llama3_json, mistral, and the grammar's list and named forms) read the same calls
  from a whole text as from its stream, split anywhere.
* Through the family-style chat templates of the tiny Llama 3, Qwen2 and Qwen3 configurations (random
  weights, ``--load-format dummy``): ``tool_choice: "required"`` forces a valid call, which the openai
  SDK's streaming helper assembles (name first, then argument fragments, ``finish_reason:
  "tool_calls"``); a second turn carrying the call and its result renders them into the prompt; a named
  choice gives that function's arguments. Bad choices get a 400, and no KV block is left behind.
"""

from __future__ import annotations

import json
import random
import shutil

import jsonschema
import openai
import pytest

from node.api.tool_parsers import PARSERS, ToolCallParser
from node.worker.tokenizer import TextTokenizer
from support import SHARED, STORIES, NodeProcess, require_shared
from tool_templates import FAMILIES

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"]}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a zone", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]

WHOLE = {
    "hermes": ('I will look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris", "n": [1, {"a": "}"}]}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
               "I will look.", [("get_weather", '{"city": "Pa\\"ris", "n": [1, {"a": "}"}]}'), ("get_time", "{}")]),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {"zone": "UTC"}}',
                    None, [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "UTC"}')]),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}]',
                None, [("get_weather", '{"city": "Rome"}'), ("get_time", '{"zone": "CET"}')]),
    "list": ('[{"name": "get_time", "parameters": {"zone": "PST"}}, {"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}]',
             None, [("get_time", '{"zone": "PST"}'), ("get_weather", '{"city": "Oslo", "unit": "c"}')]),
}


def _stream(parser: ToolCallParser, text: str, rng: random.Random) -> tuple[str, list[tuple[str, str]], list[dict]]:
    content, calls, deltas, i = "", {}, [], 0
    while i < len(text):
        j = min(len(text), i + rng.randint(1, 6))
        c, ds = parser.feed(text[i:j])
        content += c
        deltas += ds
        i = j
    content += parser.flush()
    for d in deltas:
        entry = calls.setdefault(d["index"], ["", ""])
        if "id" in d:
            assert entry == ["", ""] and d["function"]["arguments"] == "" and d["type"] == "function"
            entry[0] = d["function"]["name"]
        else:
            assert entry[0], "arguments before the name"
        entry[1] += d["function"]["arguments"]
    return content, [tuple(calls[k]) for k in sorted(calls)], deltas


@pytest.mark.quick
@pytest.mark.parametrize("kind", list(WHOLE))
def test_parsers_read_the_same_calls_whole_and_streamed(kind):
    text, content, calls = WHOLE[kind]
    assert ToolCallParser(kind).result() == ("", [])  # no text: no calls
    whole = ToolCallParser(kind)
    whole.feed(text)
    got_content, got = whole.result()
    assert got_content == content and [(c["function"]["name"], c["function"]["arguments"]) for c in got] == calls
    for seed in range(20):
        s_content, s_calls, _ = _stream(ToolCallParser(kind), text, random.Random(seed))
        assert s_calls == calls and s_content == (content or "")


@pytest.mark.quick
def test_text_without_calls_is_content_and_a_named_choice_streams_its_arguments():
    for kind in PARSERS:
        for text in ("Just words, a <tool and a [TOOL_ and {braces}.", "   "):
            content, calls, _ = _stream(ToolCallParser(kind), text, random.Random(1))
            assert content == text and calls == []
    content, calls, deltas = _stream(ToolCallParser("named", "get_time"), '{"zone": "UTC"}', random.Random(2))
    assert content == "" and calls == [("get_time", '{"zone": "UTC"}')] and deltas[0]["id"].startswith("call_")


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_node(request, tmp_path_factory):
    require_shared()
    template, parser = FAMILIES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    shutil.copy(SHARED / "models" / "stories260k" / "tiny_configs" / request.param / "config.json", folder / "config.json")
    for f in ("tokenizer.json", "special_tokens_map.json"):
        shutil.copy(STORIES / f, folder / f)
    cfg = json.loads((STORIES / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    node = NodeProcess("--model", str(folder), "--load-format", "dummy", "--max-model-len", "2048",
                       "--tool-call-parser", parser)
    yield request.param, node, TextTokenizer.from_folder(folder)
    node.close()


def _client(node) -> openai.OpenAI:
    return openai.OpenAI(base_url=node.url + "/v1", api_key="none", max_retries=0)


def test_required_streams_a_valid_call_and_the_second_turn_renders_it(family_node):
    name, node, tok = family_node
    client = _client(node)
    for seed in range(3):
        raw = list(client.chat.completions.create(model=None, messages=ASK, tools=TOOLS, tool_choice="required",
                                                  parallel_tool_calls=False, max_tokens=400, seed=seed, stream=True))
        calls = [tc for ch in raw for c in ch.choices for tc in (c.delta.tool_calls or [])]
        assert calls and calls[0].id and calls[0].function.name in SCHEMAS and calls[0].function.arguments == ""
        assert all(tc.id is None and tc.function.name is None for tc in calls[1:])  # later: argument fragments only
        assert raw[-1].choices[0].finish_reason == "tool_calls", raw[-1]
        with client.chat.completions.stream(model=None, messages=ASK, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=400, seed=seed) as stream:
            done = stream.get_final_completion()
        msg = done.choices[0].message
        assert done.choices[0].finish_reason == "tool_calls" and len(msg.tool_calls) == 1, msg
        call = msg.tool_calls[0]
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
    # the second turn: the call and its result reach the template
    result = "RESULT-17-degrees"
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": result}]
    r = node.client.post("/v1/chat/completions", json={"messages": history, "tools": TOOLS, "tool_choice": "none",
                                                       "max_tokens": 4, "return_token_ids": True})
    assert r.status_code == 200, r.text
    prompt = tok.decode(r.json()["choices"][0]["prompt_token_ids"], skip_special_tokens=False)
    assert result in prompt and call.function.name in prompt and json.dumps(args) in prompt, prompt
    assert "get_time" in prompt  # the tools themselves are rendered
    assert ("ipython" if name.startswith("llama") else "<tool_response>") in prompt
    assert node.wait_idle()["live_requests"] == 0


def test_parallel_calls_a_named_choice_and_bad_choices(family_node):
    _, node, _ = family_node
    body = {"messages": ASK, "tools": TOOLS, "max_tokens": 600, "seed": 3}
    r = node.client.post("/v1/chat/completions", json={**body, "tool_choice": "required", "n": 2}).json()
    for c in r["choices"]:
        if c["finish_reason"] == "tool_calls":
            for call in c["message"]["tool_calls"]:
                jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
        else:  # many calls can run past max_tokens: a cut-off list
            assert c["finish_reason"] == "length"
    named = {"type": "function", "function": {"name": "get_time"}}
    r = node.client.post("/v1/chat/completions", json={**body, "tool_choice": named}).json()
    c = r["choices"][0]
    assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None, c
    [call] = c["message"]["tool_calls"]
    assert call["function"]["name"] == "get_time"
    jsonschema.validate(json.loads(call["function"]["arguments"]), TIME)
    for choice, param, words in (({"type": "function", "function": {"name": "nope"}}, "tool_choice", "not among the tools"),
                                 ("sometimes", "tool_choice", "tool_choice")):
        r = node.client.post("/v1/chat/completions", json={**body, "tool_choice": choice})
        assert r.status_code == 400 and r.json()["error"]["param"] == param and words in r.json()["error"]["message"], r.text
    r = node.client.post("/v1/chat/completions", json={**body, "tool_choice": "required", "guided_regex": "a"})
    assert r.status_code == 400 and "cannot be combined" in r.json()["error"]["message"]
    # a stop string inside the calls' JSON would hand the raw JSON back as content (a fresh user's find)
    r = node.client.post("/v1/chat/completions", json={**body, "tool_choice": "required", "stop": ["a"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text
    # a function without parameters takes none: its arguments are {}
    bare = [{"type": "function", "function": {"name": "ping"}}]
    r = node.client.post("/v1/chat/completions", json={**body, "tools": bare, "tool_choice": "required",
                                                          "parallel_tool_calls": False}).json()
    c = r["choices"][0]
    if c["finish_reason"] == "tool_calls":
        assert [json.loads(x["function"]["arguments"]) for x in c["message"]["tool_calls"]] == [{}], c
    assert node.wait_idle()["live_requests"] == 0


@pytest.mark.quick
def test_auto_needs_a_parser_and_streams_plain_content(stories_node):
    body = {"messages": ASK, "tools": TOOLS, "max_tokens": 8}
    r = stories_node.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and "--tool-call-parser" in r.json()["error"]["message"]
    r = stories_node.client.post("/v1/chat/completions", json={**body, "tool_choice": "none", "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    r = stories_node.client.post("/v1/chat/completions", json={**body, "tool_choice": {"type": "function", "function": {"name": "x"}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


def test_auto_with_a_parser_gives_content_when_the_model_calls_nothing(family_node):
    _, node, _ = family_node
    client = _client(node)
    whole = client.chat.completions.create(model=None, messages=ASK, tools=TOOLS, max_tokens=24, temperature=0)
    streamed = client.chat.completions.create(model=None, messages=ASK, tools=TOOLS, max_tokens=24, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    msg = whole.choices[0].message
    if msg.tool_calls:  # a random model may write a call by chance: then both agree on it
        assert whole.choices[0].finish_reason == "tool_calls"
    else:
        assert msg.content == text and whole.choices[0].finish_reason in ("stop", "length")


@pytest.mark.quick
def test_the_flag_offers_exactly_the_parsers():
    import argparse

    from node.cli import config_from_args, serve_parser

    sub = argparse.ArgumentParser().add_subparsers()
    serve_parser(sub)
    serve = sub.choices["serve"]
    flag = next(a for a in serve._actions if "--tool-call-parser" in a.option_strings)
    assert tuple(flag.choices) == PARSERS
    assert config_from_args(serve.parse_args(["--tool-call-parser", "mistral"])).tool_call_parser == "mistral"


@pytest.mark.quick
def test_the_parser_is_detected_from_unambiguous_templates():
    from node.api.tool_parsers import detect_parser

    assert [detect_parser(FAMILIES[f][0]) for f in FAMILIES] == [FAMILIES[f][1] for f in FAMILIES]
    assert detect_parser((STORIES / "chat_template.jinja").read_text()) is None
    assert detect_parser(None) is None
    assert detect_parser(FAMILIES["qwen2-style"][0] + "[TOOL_CALLS]") is None  # two families' markers: ambiguous


BROKEN = {  # (text, declared names, content, calls): a call that is not valid JSON, or names no declared tool, is content
    "hermes": [
        ('<tool_call>{"name": "get_weather", "arguments": {"city": Paris}}</tool_call>', None,
         '<tool_call>{"name": "get_weather", "arguments": {"city": Paris}}</tool_call>', []),
        ('Hi<tool_call>{"name": "nope", "arguments": {}}</tool_call><tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>',
         {"get_time"}, 'Hi{"name": "nope", "arguments": {}}', [("get_time", '{"zone": "UTC"}')]),
        ('<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call><tool_call>{"name": "get_time", "arguments": [1]}',
         None, '{"name": "get_time", "arguments": [1]}', [("get_time", '{"zone": "UTC"}')]),
        ('<tool_call>{"name": "get_time"}</tool_call><tool_call>{"name": "get_time", "arguments": {"zone"',
         None, '{"name": "get_time", "arguments": {"zone"', [("get_time", "{}")]),
    ],
    "llama3_json": [('{"name": "get_weather", "parameters": {"city": Paris}}', None,
                     '{"name": "get_weather", "parameters": {"city": Paris}}', []),
                    ('{"name": "rm_rf", "parameters": {}}', {"get_time"}, '{"name": "rm_rf", "parameters": {}}', [])],
    "mistral": [('[TOOL_CALLS][{"name": "get_time", "arguments": "{zone"}, {"name": "get_time", "arguments": {"zone": "CET"}}]',
                 None, '{"name": "get_time", "arguments": "{zone"}', [("get_time", '{"zone": "CET"}')])],
}


@pytest.mark.quick
@pytest.mark.parametrize("kind", list(BROKEN))
def test_invalid_or_undeclared_calls_stay_content_whole_and_streamed(kind):
    for text, declared, content, calls in BROKEN[kind]:
        names = None if declared is None else frozenset(declared)
        whole = ToolCallParser(kind, declared=names)
        whole.feed(text)
        got_content, got = whole.result()
        assert (got_content or "") == content and [(c["function"]["name"], c["function"]["arguments"]) for c in got] == calls
        for c in got:
            assert isinstance(json.loads(c["function"]["arguments"]), dict)
        for seed in range(20):  # a stream never sends a call the whole reply rejects, and agrees on the content
            s_content, s_calls, _ = _stream(ToolCallParser(kind, declared=names), text, random.Random(seed))
            assert s_calls == calls and s_content == content, (seed, s_content, s_calls)


def test_tokenize_renders_tools_as_chat_does(family_node):
    """/tokenize refused tools ("not supported yet"); it renders them into the template as chat does."""
    _, node, _ = family_node
    with_tools = node.client.post("/tokenize", json={"messages": ASK, "tools": TOOLS})
    assert with_tools.status_code == 200, with_tools.text
    without = node.client.post("/tokenize", json={"messages": ASK}).json()
    chat = node.client.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "tool_choice": "none",
                                                         "max_tokens": 1}).json()
    assert with_tools.json()["count"] == chat["usage"]["prompt_tokens"] > without["count"]
