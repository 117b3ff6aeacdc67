"""Issue 44 item 1: structured outputs through the real openai SDK against a live stories260k node.

Every form (``response_format`` json_schema/json_object, ``structured_outputs`` json/regex/choice/
grammar, the ``guided_*`` aliases) yields text its constraint accepts; ``n > 1``, seeds, stop strings,
logprobs and a ``max_tokens`` cut-off work beside a grammar; bad specs get a 400 naming the field; no
KV block is left behind and the grammar cache stays within its bounds.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "friends": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        "mood": {"enum": ["happy", "sad"]},
        "tall": {"type": "boolean"},
    },
    "required": ["name", "age", "friends", "mood", "tall"],
}
RF = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
PROMPT = "Once upon a time, there was a little girl named Lily."


class Pet(BaseModel):
    name: str = Field(max_length=12)
    kind: Literal["cat", "dog", "bird"]
    age: int = Field(ge=0, le=30)


@pytest.fixture(scope="module")
def client(stories_node):
    return openai.OpenAI(base_url=stories_node.url + "/v1", api_key="none", max_retries=0)


def post(node, path: str, body: dict):
    return node.client.post(path, json=body, timeout=120)


def test_sdk_parse_returns_a_parsed_pydantic_object(client):
    done = client.chat.completions.parse(model=None, messages=[{"role": "user", "content": "Tell me about a pet."}],
                                         response_format=Pet, temperature=0, max_tokens=80)
    msg = done.choices[0].message
    assert isinstance(msg.parsed, Pet), msg
    assert Pet.model_validate_json(msg.content) == msg.parsed
    assert done.choices[0].finish_reason == "stop"


def test_json_schema_on_completions_validates_for_50_seeds(stories_node, client):
    def one(seed: int):
        return client.completions.create(model=None, prompt=PROMPT, max_tokens=120, seed=seed, temperature=1.0,
                                         extra_body={"response_format": RF})

    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(one, range(50)))
    texts = [o.choices[0].text for o in outs]
    for o, text in zip(outs, texts):
        assert o.choices[0].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 25  # seeds really sample: the outputs differ
    assert stories_node.wait_idle()["live_requests"] == 0


@pytest.mark.quick
@pytest.mark.parametrize("field", ["structured_outputs", "guided"])
def test_regex_choice_and_ebnf_match(stories_node, field):
    forms = {"regex": r"[0-9]{3}-[a-z]{2,6}( [A-Z][a-z]+)?", "choice": ["happy ending", "sad ending", "no ending"],
             "grammar": 'root ::= "The " animal " is " color "."\nanimal ::= "cat" | "dog"\ncolor ::= "red" | "blue"'}
    for seed in range(6):
        for key, value in forms.items():
            extra = {"structured_outputs": {key: value}} if field == "structured_outputs" else {f"guided_{key}": value}
            r = post(stories_node, "/v1/completions", {"prompt": PROMPT, "max_tokens": 40, "seed": seed, **extra})
            assert r.status_code == 200, r.text
            text = r.json()["choices"][0]["text"]
            if key == "regex":
                assert re.fullmatch(value, text), text
            elif key == "choice":
                assert text in value, text
            else:
                assert re.fullmatch(r"The (cat|dog) is (red|blue)\.", text), text


@pytest.mark.quick
def test_json_object_on_chat_and_guided_json(stories_node):
    r = post(stories_node, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
                                                    "temperature": 0, "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    if c["finish_reason"] == "stop":
        assert isinstance(json.loads(c["message"]["content"]), dict)
    else:  # cut at max_tokens: a JSON object's prefix
        assert c["finish_reason"] == "length" and c["message"]["content"].startswith("{")
    r = post(stories_node, "/v1/completions", {"prompt": PROMPT, "max_tokens": 120, "temperature": 0,
                                               "guided_json": json.dumps(SCHEMA)})
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), SCHEMA)


def test_structural_tags_new_and_old_forms(stories_node):
    inner = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}
    new = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "Answer: "}, {"type": "regex", "pattern": "[0-9]{2}[a-z]{3}"}]}}
    r = post(stories_node, "/v1/completions", {"prompt": PROMPT, "max_tokens": 30, "temperature": 0, "response_format": new})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert re.fullmatch("Answer: [0-9]{2}[a-z]{3}", text), text
    old = {"type": "structural_tag", "structures": [{"begin": "<n>", "schema": inner, "end": "</n>"}], "triggers": ["<n>"]}
    r = post(stories_node, "/v1/completions", {"prompt": PROMPT, "max_tokens": 30, "temperature": 0, "response_format": old})
    assert r.status_code == 200, r.text  # free text, with a JSON body inside any <n>...</n> it writes
    for body in re.findall(r"<n>(.*?)</n>", r.json()["choices"][0]["text"]):
        jsonschema.validate(json.loads(body), inner)


def test_n_seed_stop_and_logprobs_beside_a_grammar(stories_node):
    body = {"prompt": PROMPT, "max_tokens": 120, "n": 3, "seed": 7, "temperature": 1.0, "logprobs": 2,
            "response_format": RF}
    a, b = post(stories_node, "/v1/completions", body).json(), post(stories_node, "/v1/completions", body).json()
    assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]  # the seed reproduces
    for c in a["choices"]:
        jsonschema.validate(json.loads(c["text"]), SCHEMA)
        lp = c["logprobs"]
        assert "".join(lp["tokens"]) == c["text"] and all(len(t) == 2 for t in lp["top_logprobs"])
        assert all(x <= 0.0 for x in lp["token_logprobs"])
    # a stop string ends the output inside the JSON (the text is then not valid JSON, as documented)
    r = post(stories_node, "/v1/completions", {**body, "n": 1, "logprobs": None, "stop": ['"age"']}).json()
    c = r["choices"][0]
    assert c["finish_reason"] == "stop" and c["text"].startswith('{"name": "') and '"age"' not in c["text"]


def test_max_tokens_cut_off_is_length_and_eos_waits_for_the_grammar(stories_node):
    r = post(stories_node, "/v1/completions", {"prompt": PROMPT, "max_tokens": 5, "temperature": 0,
                                               "response_format": RF}).json()
    c = r["choices"][0]
    assert c["finish_reason"] == "length" and c["text"].startswith("{") and r["usage"]["completion_tokens"] == 5
    # a pattern of exactly 30 letters: EOS is masked until the 30th, then it is the only choice
    for seed in range(4):
        r = post(stories_node, "/v1/completions", {"prompt": PROMPT, "max_tokens": 60, "seed": seed,
                                                   "structured_outputs": {"regex": "[a-z]{30}"}}).json()
        c = r["choices"][0]
        assert c["finish_reason"] == "stop" and re.fullmatch("[a-z]{30}", c["text"]), c


@pytest.mark.quick
@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format", "does not compile"),
    ({"guided_json": {"type": "integer", "minimum": 5, "maximum": 3}}, "guided_json", "minimum greater than maximum"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs", "does not compile"),
    ({"structured_outputs": {"regex": "[^\\x00-\\U0010FFFF]"}}, "structured_outputs", "accepts no output"),
    ({"guided_grammar": 'root ::= "a" b'}, "guided_grammar", "does not compile"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "one of"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "only one structured-output form"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "Invalid enum value 'xml'"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs.regexp", "unknown field `regexp`"),
    ({"guided_regex": "[a-z]+", "ignore_eos": True}, "ignore_eos", "grammar decides"),
    ({"guided_regex": "[a-z]+", "min_tokens": 3}, "min_tokens", "grammar decides"),
    # keywords the grammar engine compiles without enforcing (a fresh user got strings for these): refused
    ({"guided_json": {"not": {"type": "string"}}}, "guided_json", "keyword at not is not supported"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"n": {"allOf": [{"type": "integer"}, {"maximum": 5}]}}}}}},
     "response_format", "properties.n.allOf"),
    ({"structured_outputs": {"json": {"$ref": "http://example.com/s.json"}}}, "structured_outputs", "$ref"),
])
def test_bad_specs_get_a_clear_400(stories_node, body, param, words):
    for path, base in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        r = post(stories_node, path, {**base, "max_tokens": 8, **body})
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert err["param"] == param and words in err["message"], err


def test_unenforced_keywords_are_found_only_where_they_are_keywords():
    from node.api.structured import unenforced_keyword

    assert unenforced_keyword({"type": "object", "properties": {"not": {"type": "string"}, "if": {"enum": ["allOf"]}},
                               "required": ["not"], "$defs": {"a": {"type": "integer"}}, "items": {"$ref": "#/$defs/a"}}) is None
    assert unenforced_keyword({"anyOf": [{"type": "string"}, {"type": "object", "properties": {
        "a": {"if": {"type": "string"}}}}]}) == "anyOf[1].properties.a.if"
    assert unenforced_keyword({"$defs": {"x": {"not": {}}}}) == "$defs.x.not"
    # a string's length bounds beside a pattern or format are dropped by xgrammar: refused; alone they hold
    assert unenforced_keyword({"type": "object", "properties": {"id": {"type": "string", "pattern": "[a-z]+",
                                                                       "maxLength": 8}}}) == "properties.id.maxLength"
    assert unenforced_keyword({"type": "string", "format": "email", "minLength": 3}) == "minLength"
    assert unenforced_keyword({"type": "string", "minLength": 3, "maxLength": 8}) is None
    assert unenforced_keyword({"type": "object", "properties": {"pattern": {"type": "string", "maxLength": 4}}}) is None
    # multipleOf: enforced on an integer, dropped on a number (xgrammar accepts 0.3 for multipleOf 0.5)
    assert unenforced_keyword({"type": "integer", "multipleOf": 3}) is None
    assert unenforced_keyword({"type": "object", "properties": {"x": {"type": "number", "multipleOf": 0.5}}}) == \
        "properties.x.multipleOf"
    assert unenforced_keyword({"type": "object", "properties": {"multipleOf": {"type": "number"}}}) is None
    # a pattern's lookaround is ignored by xgrammar's regex: refused; an escaped "(?" is a literal
    assert unenforced_keyword({"type": "string", "pattern": "(?!admin)[a-z]+"}) == "pattern"
    assert unenforced_keyword({"type": "string", "pattern": "a(?<=a)"}) == "pattern"
    assert unenforced_keyword({"type": "string", "pattern": "(?:ab)+\\(?=x"}) is None


def test_a_regex_with_lookaround_gets_a_400_naming_the_field(stories_node):
    r = stories_node.client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 4,
                                                          "guided_regex": "(?=[0-9])[a-z0-9]+"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "guided_regex" and "lookahead" in err["message"], err
    r = stories_node.client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 4, "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object", "properties": {
            "x": {"type": "number", "multipleOf": 0.5}}}}}})
    assert r.status_code == 400 and "properties.x.multipleOf" in r.json()["error"]["message"], r.text


def test_a_1mb_schema_gets_a_clear_400(stories_node):
    schema = {"type": "object", "properties": {f"field_{i:06d}": {"type": "string", "description": "x" * 40}
                                               for i in range(20000)}}
    r = post(stories_node, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "guided_json": schema})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "guided_json" and "more than the limit of 262144 bytes" in err["message"], err


def test_nothing_leaks_and_the_grammar_cache_is_bounded(stories_node):
    st = stories_node.wait_idle()
    cache = st["grammar_cache"]
    assert 0 < cache["entries"] <= cache["max_entries"] and 0 < cache["bytes"] <= cache["max_bytes"], cache
    assert st["live_requests"] == 0
