"""Greedy completions through the HTTP API equal the llama2.c reference token for token."""

import openai
import pytest

from support import reference_cases, stream, stream_text

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here


@pytest.mark.parametrize("case", reference_cases(), ids=lambda c: c["prompt"])
def test_reference_greedy_non_stream(stories_node, case):
    r = stories_node.client.post("/v1/completions", json={
        "prompt": case["prompt"], "max_tokens": case["max_new_tokens"], "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["prompt_token_ids"] == case["prompt_token_ids"]
    assert choice["token_ids"] == case["output_token_ids"]
    assert choice["text"] == case["output_text"]
    assert choice["finish_reason"] == "length"
    use = r.json()["usage"]
    cached = use.pop("prompt_tokens_details")["cached_tokens"]  # the shared node may have seen the prompt
    assert 0 <= cached < len(case["prompt_token_ids"])
    assert use == {"prompt_tokens": len(case["prompt_token_ids"]),
                   "completion_tokens": case["max_new_tokens"],
                   "total_tokens": len(case["prompt_token_ids"]) + case["max_new_tokens"]}


@pytest.mark.parametrize("case", reference_cases()[:2], ids=lambda c: c["prompt"])
def test_reference_greedy_stream_and_token_ids_prompt(stories_node, case):
    events = stream(stories_node.client, "/v1/completions", {
        "prompt": case["prompt_token_ids"], "max_tokens": case["max_new_tokens"], "temperature": 0,
        "return_token_ids": True})
    ids = [t for e in events[:-1] for c in e["choices"] for t in c["token_ids"]]
    assert ids == case["output_token_ids"]
    assert stream_text(events)[0] == case["output_text"]
    finals = [c["finish_reason"] for e in events[:-1] for c in e["choices"] if c["finish_reason"]]
    assert finals == ["length"]


def test_openai_client(stories_node):
    case = reference_cases()[0]
    client = openai.OpenAI(base_url=stories_node.url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt=case["prompt"], max_tokens=50, temperature=0)
    ref_text = stories_node.client.post("/v1/completions", json={
        "prompt": case["prompt"], "max_tokens": 50, "temperature": 0}).json()["choices"][0]["text"]
    assert out.choices[0].text == ref_text
    assert case["output_text"].startswith(ref_text)
    pieces = [c.choices[0].text for c in client.completions.create(
        model=model, prompt=case["prompt"], max_tokens=50, temperature=0, stream=True) if c.choices]
    assert "".join(pieces) == ref_text
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Tell a story"}],
                                          max_tokens=20, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    assert chat.usage.completion_tokens == 20
    chunks = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Tell a story"}],
                                                 max_tokens=20, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 20 and chunks[-1].usage.prompt_tokens == chat.usage.prompt_tokens
