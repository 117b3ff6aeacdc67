"""Reasoning (issue 44 item 3): ``--reasoning-parser`` (vLLM's names) splits ``<think>…</think>`` into
``reasoning_content``, whole and streamed; ``chat_template_kwargs`` reach the template (Qwen3's
``enable_thinking``); ``--chat-template`` replaces the checkpoint's template. The parser on text units
(the real tokenizer's detokenized deltas, every split), then a live node of the tiny Qwen3 config."""

import shutil

import pytest

from node.api.reasoning import PARSERS, ReasoningSplitter, prompt_opens_thinking
from node.serving_options import REASONING_PARSERS
from node.worker.tokenizer import IncrementalDetokenizer, TextTokenizer
from support import SHARED, STORIES, NodeProcess, require_shared, stream

pytestmark = pytest.mark.slow_only("its live test starts a tiny Qwen3 node of its own with a reasoning parser")

CASES = [  # parser, prompt opens thinking, output, (reasoning_content, content)
    ("qwen3", False, "<think>She thinks.</think>\n\nOnce upon a time", ("She thinks.", "\n\nOnce upon a time")),
    ("qwen3", False, "\n<think>a</think>b", ("a", "b")),
    ("qwen3", False, "Once upon a time", (None, "Once upon a time")),
    ("qwen3", False, "<think>cut by max_tokens", ("cut by max_tokens", None)),
    ("qwen3", False, "x <think>y</think>", (None, "x <think>y</think>")),  # only a leading <think> opens
    ("qwen3", True, "thought</think>said", ("thought", "said")),
    ("deepseek_r1", False, "thought</think>said", ("thought", "said")),
    ("deepseek_r1", False, "<think>thought</think>said", ("thought", "said")),
    ("deepseek_r1", False, "no end tag", ("no end tag", None)),
    ("deepseek_r1", False, "a </thin", ("a </thin", None)),  # a partial tag at the end is text
]


def test_parser_names_are_vllms():
    assert PARSERS == REASONING_PARSERS == ("deepseek_r1", "qwen3")
    with pytest.raises(ValueError):
        ReasoningSplitter("granite")


@pytest.mark.parametrize("parser,opened,text,expected", CASES)
def test_stream_of_any_split_equals_the_whole(parser, opened, text, expected):
    assert ReasoningSplitter(parser, opened).split(text) == expected
    for cut in range(len(text) + 1):
        for pieces in ([text[:cut], text[cut:]], list(text)):
            sp = ReasoningSplitter(parser, opened)
            out = [sp.feed(p) for p in pieces] + [sp.finish()]
            reasoning, content = "".join(r for r, _ in out), "".join(c for _, c in out)
            assert (reasoning or None, content or None) == expected, (cut, pieces)


def test_on_the_real_tokenizers_deltas():
    tok = TextTokenizer.from_folder(STORIES)
    text = "<think>Lily thinks about the sun.</think> Once upon a time 中"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [])
    sp = ReasoningSplitter("qwen3")
    out = [sp.feed(detok.add(t)) for t in ids] + [sp.feed(detok.flush()), sp.finish()]
    assert "".join(r for r, _ in out) == "Lily thinks about the sun."
    assert "".join(c for _, c in out) == " Once upon a time 中"


def test_prompt_opens_thinking():
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n")


# A Qwen3-style template (the thinking models' form: the prompt opens <think> unless enable_thinking is false).
TEMPLATE = (
    "{% if reasoning_effort is defined %}effort={{ reasoning_effort }}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def qwen3_node(tmp_path_factory):
    require_shared()
    folder = tmp_path_factory.mktemp("qwen3-style")
    shutil.copy(SHARED / "models" / "stories260k" / "tiny_configs" / "qwen3-style" / "config.json", folder)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):  # with stories' own template
        shutil.copy(STORIES / f, folder / f)
    template = folder / "qwen3.jinja"
    template.write_text(TEMPLATE)
    node = NodeProcess("--model", str(folder), "--load-format", "dummy", "--max-model-len", "512",
                       "--chat-template", str(template), "--reasoning-parser", "qwen3")
    yield node
    node.close()


def _chat(node, **body):
    r = node.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                       "temperature": 0, "max_tokens": 8, "ignore_eos": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_template_flag_and_kwargs_reach_the_template(qwen3_node):
    c = qwen3_node.client
    msgs = [{"role": "user", "content": "Hi"}]
    text = c.post("/detokenize", json={"tokens": c.post("/tokenize", json={"messages": msgs}).json()["tokens"]}).json()
    assert text["prompt"] == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"  # not stories' template
    off = c.post("/tokenize", json={"messages": msgs, "chat_template_kwargs": {"enable_thinking": False}}).json()
    text = c.post("/detokenize", json={"tokens": off["tokens"]}).json()
    assert text["prompt"].endswith("<think>\n\n</think>\n\n")
    history = msgs + [{"role": "assistant", "content": "Hello", "reasoning_content": "greet"}]
    ids = c.post("/tokenize", json={"messages": history, "add_generation_prompt": False,
                                    "reasoning_effort": "low"}).json()["tokens"]
    text = c.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text.startswith("effort=low\n") and "<|im_start|>assistant\n<think>greet</think>Hello" in text


def test_reasoning_content_whole_and_streamed(qwen3_node):
    thinking = _chat(qwen3_node)["choices"][0]["message"]
    assert thinking["reasoning_content"] and thinking["content"] is None  # the prompt opened <think>; no end came
    plain = _chat(qwen3_node, chat_template_kwargs={"enable_thinking": False})["choices"][0]["message"]
    assert plain["reasoning_content"] is None and plain["content"]
    hidden = _chat(qwen3_node, include_reasoning=False)["choices"][0]["message"]
    assert hidden["reasoning_content"] is None and hidden["content"] is None
    events = stream(qwen3_node.client, "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "max_tokens": 8,
                     "ignore_eos": True, "stream": True})
    deltas = [c["delta"] for e in events[:-1] for c in e["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == thinking["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == ""
