"""Special tokens in prompts against transformers' own tokenizer on stories260k, and one BOS at most.

transformers parses special-token text in a prompt (``"<s>"``) as the special id; so do we. Where a
text already begins with BOS, transformers adds a second one with ``add_special_tokens=True`` (the
double BOS of vLLM #9519); we add none, so a pre-rendered chat prompt through ``/v1/completions``
equals the same conversation through ``/v1/chat/completions``.
"""

import json

import pytest
import transformers

from model_copies import copy_model
from node.worker.tokenizer import TextTokenizer
from support import STORIES, require_shared
from test_api_errors import post

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here

PROMPTS = ["Hello", "Once upon a time", " leading space", "", "a<unk>b", "Hi</s>there <s>x", "</s>", "x <s>",
           "User: hi\nAssistant:", "tab\tand\nnewline", "émoji 🙂 and 中文"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about a cat."},
            {"role": "assistant", "content": "Tom was a cat."}, {"role": "user", "content": "And then?"}]


@pytest.fixture(scope="module")
def pair():
    require_shared()
    return TextTokenizer.from_folder(STORIES), transformers.AutoTokenizer.from_pretrained(str(STORIES))


@pytest.mark.parametrize("text", PROMPTS)
def test_same_ids_as_transformers(pair, text):
    ours, hf = pair
    assert ours.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False).input_ids
    assert ours.encode(text) == hf(text).input_ids  # BOS added: the text does not begin with it


@pytest.mark.parametrize("text", PROMPTS)
def test_leading_bos_text_gets_no_second_bos(pair, text):
    ours, hf = pair
    with_bos = "<s>" + text
    assert hf(with_bos).input_ids[:2] == [1, 1]  # transformers' double BOS, which we do not copy
    assert ours.encode(with_bos) == hf(with_bos, add_special_tokens=False).input_ids
    assert ours.encode(with_bos) == ours.encode(text) == hf(text).input_ids


def test_bos_written_twice_is_kept(pair):
    ours, hf = pair
    assert ours.encode("<s><s>a") == hf("<s><s>a", add_special_tokens=False).input_ids == [1, 1, 261]


def test_chat_template_matches_transformers(pair):
    ours, hf = pair
    text = ours.apply_chat_template(MESSAGES)
    assert text == hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    hf_ids = hf.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    hf_ids = hf_ids["input_ids"] if isinstance(hf_ids, dict) or hasattr(hf_ids, "keys") else hf_ids
    assert ours.encode(text, add_special_tokens=False) == list(hf_ids)
    assert ours.encode(text) == list(hf_ids)  # the pre-rendered prompt through completions: one BOS


def _edit_json(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_special_tokens_only_in_tokenizer_config_are_parsed(tmp_path):
    """A tokenizer.json without added tokens: the config's special tokens are added, as transformers does."""
    require_shared()
    folder = copy_model(tmp_path, "no-added")
    _edit_json(folder / "tokenizer.json", added_tokens=[])
    ours, hf = TextTokenizer.from_folder(folder), transformers.AutoTokenizer.from_pretrained(str(folder))
    for text in ("Hi</s>there <s>x", "a<unk>b", "plain"):
        assert ours.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False).input_ids
        assert 2 in ours.encode("Hi</s>there") and 1 in ours.encode("x <s>", add_special_tokens=False)


def test_post_processor_eos_is_added_once(tmp_path):
    """A post-processor that adds BOS and EOS: ours equals transformers', and neither is doubled."""
    require_shared()
    folder = copy_model(tmp_path, "eos")
    data = json.loads((folder / "tokenizer.json").read_text())
    data["post_processor"] = {"type": "TemplateProcessing",
                              "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                                         {"SpecialToken": {"id": "</s>", "type_id": 0}}],
                              "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                              "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]},
                                                 "</s>": {"id": "</s>", "ids": [2], "tokens": ["</s>"]}}}
    (folder / "tokenizer.json").write_text(json.dumps(data))
    ours, hf = TextTokenizer.from_folder(folder), transformers.AutoTokenizer.from_pretrained(str(folder))
    for text in ("Hello", "Hi</s>there <s>x", ""):
        assert ours.encode(text) == hf(text).input_ids
    assert ours.encode("Hello")[0] == 1 and ours.encode("Hello")[-1] == 2
    assert ours.encode("<s>Hello</s>") == ours.encode("Hello")


def test_byte_level_default_tokenizer_one_bos():
    tok = TextTokenizer.byte_level()
    assert tok.encode("<s>hi") == tok.encode("hi") == [1, *tok.encode("hi", add_special_tokens=False)]
    assert tok.encode("a</s>b", add_special_tokens=False)[1] == 2


# Through the API: the chat conversation and its pre-rendered text as a completion are one request.
def test_chat_equals_prerendered_completion(stories_node, pair):
    ours, _ = pair
    text = ours.apply_chat_template(MESSAGES)
    assert text.startswith("<s>")
    chat = post(stories_node, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 24, "temperature": 0,
                                                        "return_token_ids": True})
    cmpl = post(stories_node, "/v1/completions", {"prompt": text, "max_tokens": 24, "temperature": 0,
                                                  "return_token_ids": True})
    assert chat.status_code == cmpl.status_code == 200, (chat.text, cmpl.text)
    c, k = chat.json(), cmpl.json()
    assert c["usage"]["prompt_tokens"] == k["usage"]["prompt_tokens"]
    assert c["choices"][0]["prompt_token_ids"] == k["choices"][0]["prompt_token_ids"]
    assert k["choices"][0]["prompt_token_ids"][:2] != [1, 1]
    assert c["choices"][0]["message"]["content"] == k["choices"][0]["text"]
    assert c["choices"][0]["token_ids"] == k["choices"][0]["token_ids"]


def test_completion_with_and_without_bos_text(stories_node):
    bodies = [{"prompt": p, "max_tokens": 16, "temperature": 0, "return_token_ids": True}
              for p in ("Once upon a time", "<s>Once upon a time")]
    a, b = (post(stories_node, "/v1/completions", body).json() for body in bodies)
    assert a["choices"][0]["prompt_token_ids"] == b["choices"][0]["prompt_token_ids"]
    assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
