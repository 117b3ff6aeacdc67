"""Stop strings and hold-back in the per-sequence output state, against a reference on the whole text.

The output state keeps only the end of the text (what a stop string can still start in); these tests
check that the streamed deltas equal what a direct computation on the full decoded text gives, for
stop strings of every length that span tokens, start mid-token, or never occur.
"""

import random

import pytest

from node.core.sequence import SamplingParams, Sequence
from node.runtime.output import OutputState
from support import STORIES

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here


@pytest.fixture(scope="module")
def tok():
    from node.worker.tokenizer import TextTokenizer

    return TextTokenizer.from_folder(STORIES)


def _run(tok, prompt, outputs, stops, min_tokens=0, max_tokens=10_000):
    params = SamplingParams(max_tokens=max_tokens, stop=tuple(stops), min_tokens=min_tokens, ignore_eos=True)
    seq = Sequence("s-0", "s", 0, 0.0, prompt, params, 100_000)
    out = OutputState(seq, tok, eos_token_ids=[2])
    streamed, reason, used = [], None, 0
    for t in outputs:
        seq.token_ids.append(t)
        d = out.on_token(t, None)
        streamed.append(d.text)
        used += 1
        if d.finish_reason:
            reason = d.finish_reason
            break
    return "".join(streamed), reason, used


WORDS = ("Once upon a time there was a little girl named Lily . She loved to play outside in the big "
         "park , with her dog Max ! \"Look , a bird ,\" said Tim . They ran , and laughed ; the sun was warm").split()


def _story(tok, rng, n_words):
    """Token ids of real text (no byte-fallback pieces, so incremental and whole decoding agree)."""
    return tok.encode(" ".join(rng.choice(WORDS) for _ in range(n_words)))


def _reference(tok, prompt, outputs, stops):
    """The first token after which a stop string appears in the decoded text ends it, cut at the
    earliest start of the stop strings present then (a direct decode of every prefix)."""
    skip = len(tok.decode(prompt))
    for k in range(1, len(outputs) + 1):
        text = tok.decode(prompt + outputs[:k])[skip:]
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return text[: min(hits)], "stop"
    return tok.decode(prompt + outputs)[skip:], None


def test_streamed_text_equals_the_full_text_cut_at_the_first_stop(tok):
    rng = random.Random(7)
    checked = 0
    for trial in range(60):
        prompt = [1] + _story(tok, rng, 3)
        outputs = _story(tok, rng, rng.randrange(10, 80))
        full = tok.decode(prompt + outputs)[len(tok.decode(prompt)):]
        if len(full) < 12:
            continue
        stops = []
        for _ in range(rng.randrange(1, 4)):  # substrings of the text (may span tokens), and misses
            a = rng.randrange(len(full) // 3, len(full) - 1)
            stops.append(full[a : a + rng.randrange(1, 12)])
        stops.append("\u2603 never")
        want_text, want_reason = _reference(tok, prompt, outputs, stops)
        got_text, got_reason, _ = _run(tok, prompt, outputs, stops)
        assert got_reason == want_reason, (trial, stops)
        if want_reason == "stop":
            assert got_text == want_text, (trial, stops)
        else:
            assert full.startswith(got_text) and len(full) - len(got_text) < 12, (trial, stops)  # held back at most a stop prefix
        checked += 1
    assert checked >= 40


def test_without_stop_strings_every_character_is_streamed_and_nothing_is_kept(tok):
    rng = random.Random(3)
    prompt = [1] + _story(tok, rng, 2)
    outputs = _story(tok, rng, 300)
    got, reason, _ = _run(tok, prompt, outputs, [], max_tokens=len(outputs))
    full = tok.decode(prompt + outputs)[len(tok.decode(prompt)):]
    assert got == full and reason == "length"


def test_a_stop_before_min_tokens_is_streamed_and_a_later_one_ends_the_text(tok):
    rng = random.Random(11)
    prompt = [1] + _story(tok, rng, 2)
    outputs = _story(tok, rng, 60) + tok.encode(" zebra") + _story(tok, rng, 20)
    full = tok.decode(prompt + outputs)[len(tok.decode(prompt)):]
    word = "zebra"
    got, reason, used = _run(tok, prompt, outputs, [word], min_tokens=len(outputs))
    assert word in got  # before min_tokens a stop string is ordinary text
    got2, reason2, _ = _run(tok, prompt, outputs, [word])
    assert reason2 == "stop" and got2 == full[: full.find(word)]
