"""No request field is silently dropped (issue 44 item 4): every field of the request types, nested ones
included, is handled, refused with a 400 naming it, or on the structured-output/tool path; a field no
type declares is a 400 naming it."""

import msgspec
import pytest

from node.api.fields import HANDLED, MESSAGE_REFUSED, REFUSED, STRUCTURED_PATH
from node.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, StreamOptions, TextPart

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here

# The request types and the name prefix of their fields (as node.api.fields names them).
TYPES = [(CompletionRequest, ""), (ChatCompletionRequest, ""), (StreamOptions, "stream_options."),
         (ChatMessage, "messages[]."), (TextPart, "messages[].content[].")]


def declared() -> set[str]:
    return {prefix + f.name for kind, prefix in TYPES for f in msgspec.structs.fields(kind)}


def test_every_declared_field_is_in_exactly_one_table():
    tables = {"HANDLED": set(HANDLED), "REFUSED": set(REFUSED) | {"messages[]." + m for m in MESSAGE_REFUSED},
              "STRUCTURED_PATH": set(STRUCTURED_PATH)}
    for name in sorted(declared()):
        homes = [t for t, names in tables.items() if name in names]
        assert len(homes) == 1, f"{name} is in {homes or 'no table'}: handle it or refuse it (node/api/fields.py)"
    stale = (set(HANDLED) | set(REFUSED) | {"messages[]." + m for m in MESSAGE_REFUSED}) - declared()
    assert not stale, f"tables name fields no request type declares: {sorted(stale)}"


def test_every_request_type_refuses_unknown_fields():
    for kind, _ in TYPES:
        assert kind.__struct_config__.forbid_unknown_fields, kind.__name__


# A value each refused field does not accept (the test fails for a refused field without one).
REFUSED_VALUES = {
    "suffix": "tail", "best_of": 3, "use_beam_search": True, "length_penalty": 0.5,
    "spaces_between_special_tokens": False, "logits_processors": ["x"], "kv_transfer_params": {"a": 1},
    "vllm_xargs": {"a": 1}, "prompt_embeds": "AAAA", "chat_template": "{{ messages }}", "documents": [{"a": "b"}],
    "mm_processor_kwargs": {"a": 1}, "prediction": {"type": "content", "content": "x"},
    "web_search_options": {}, "verbosity": "low", "audio": {"voice": "alloy"}, "modalities": ["text", "audio"],
    "store": True, "service_tier": "flex",
}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "Once upon a time", "max_tokens": 2}


def _post(node, body: dict, chat: bool):
    return node.client.post("/v1/chat/completions" if chat else "/v1/completions", json=body)


def _declares(kind, name: str) -> bool:
    return name in {f.name for f in msgspec.structs.fields(kind)}


def test_every_refused_value_is_a_400_naming_the_field(stories_node):
    assert set(REFUSED_VALUES) == set(REFUSED), "give each refused field a value to send"
    for name, value in REFUSED_VALUES.items():
        for kind, base, chat in ((CompletionRequest, COMPLETION, False), (ChatCompletionRequest, CHAT, True)):
            if not _declares(kind, name):
                continue
            r = _post(stories_node, {**base, name: value}, chat)
            assert r.status_code == 400, (name, kind.__name__, r.text)
            assert r.json()["error"]["param"] == name, (name, r.text)


MESSAGE_VALUES = {"refusal": "I cannot", "annotations": [{"type": "url_citation"}], "audio": {"id": "a1"},
                  "function_call": {"name": "f", "arguments": "{}"}}


def test_every_refused_message_field_is_a_400_naming_it(stories_node):
    assert set(MESSAGE_VALUES) == set(MESSAGE_REFUSED)
    for name, value in MESSAGE_VALUES.items():
        msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "ok", name: value}]
        r = _post(stories_node, {**CHAT, "messages": msgs}, True)
        assert r.status_code == 400 and r.json()["error"]["param"] == f"messages[1].{name}", (name, r.text)
    # what the openai SDK sends back with an assistant message it returned: served
    back = {"role": "assistant", "content": "ok", "refusal": None, "annotations": [], "audio": None,
            "function_call": None, "reasoning_content": "thought"}
    assert _post(stories_node, {**CHAT, "messages": [CHAT["messages"][0], back, CHAT["messages"][0]]}, True).status_code == 200


@pytest.mark.parametrize("where,body,param", [
    ("top", {**COMPLETION, "no_such_field": 1}, "no_such_field"),
    ("stream_options", {**COMPLETION, "stream": True, "stream_options": {"include_usage": True, "bogus": 1}},
     "stream_options.bogus"),
    ("message", {**CHAT, "messages": [{"role": "user", "content": "Hi", "bogus": 1}]}, "messages[0].bogus"),
    ("content part", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi", "x": 1}]}]},
     "messages[0].content[0].x"),
])
def test_an_unknown_field_is_a_400_naming_it(stories_node, where, body, param):
    r = _post(stories_node, body, "messages" in body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and "unknown field" in r.json()["error"]["message"]


# Fields vLLM's or OpenAI's request types have: each is declared here (and so in a table above), or a 400.
KNOWN_ELSEWHERE = [
    "guided_decoding_backend", "guided_whitespace_pattern", "structural_tag", "thinking_token_budget",
    "min_tokens", "priority", "cache_salt", "return_tokens_as_token_ids", "prompt_logprobs", "bad_words",
    "allowed_token_ids", "truncate_prompt_tokens", "include_stop_str_in_output", "skip_special_tokens",
    "add_special_tokens", "echo", "continue_final_message", "chat_template_kwargs", "include_reasoning",
    "reasoning_effort", "metadata", "store", "service_tier", "prediction", "parallel_tool_calls", "response_format",
    "tools", "tool_choice", "request_id", "safety_identifier", "prompt_cache_key", "verbosity",
]


@pytest.mark.parametrize("chat", [False, True])
def test_fields_other_servers_know_are_declared_or_refused(stories_node, chat):
    kind, base = (ChatCompletionRequest, CHAT) if chat else (CompletionRequest, COMPLETION)
    for name in KNOWN_ELSEWHERE:
        if _declares(kind, name):
            continue  # in a table: test_every_declared_field_is_in_exactly_one_table
        r = _post(stories_node, {**base, name: {"x": 1}}, chat)
        assert r.status_code == 400 and r.json()["error"]["param"] == name, (name, r.text)


# The structured-output and tool fields are read by that path (node/api/structured.py, tool_calls.py):
# a bad value of each is a 400 naming it, which a field accepted and dropped could never give.
STRUCTURED_BAD = {
    "response_format": {"type": "nope"}, "structured_outputs": {"regex": "("}, "guided_json": 5,
    "guided_regex": "(", "guided_choice": [], "guided_grammar": "root ::= (", "tools": [{"type": "nope"}],
    "tool_choice": "required", "parallel_tool_calls": "x", "functions": [{"name": "f", "parameters": {}}],
    "function_call": {"name": "f"},
}


def test_structured_path_fields_are_read_not_dropped(stories_node):
    assert set(STRUCTURED_BAD) | {"messages[].tool_calls", "messages[].tool_call_id"} == set(STRUCTURED_PATH)
    for name, value in STRUCTURED_BAD.items():
        for base, chat in ((COMPLETION, False), (CHAT, True)):
            r = _post(stories_node, {**base, name: value}, chat)
            param = r.json()["error"]["param"]  # the field, or a nested field of it (response_format.type)
            assert r.status_code == 400 and (param == name or param.startswith((name + ".", name + "["))), (name, chat, r.text)
    for msg, param in (({"role": "assistant", "content": "x", "tool_calls": [{"id": 1}]}, "messages[1].tool_calls[0].id"),
                       ({"role": "tool", "content": "a", "tool_call_id": 5}, "messages[1].tool_call_id")):
        r = _post(stories_node, {**CHAT, "messages": [CHAT["messages"][0], msg]}, True)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
