"""The per-token cost of structured output on the CPU (issue 44, 64 streams): the mask is applied by the
compiled loop of shiftnode_kernels.cpu_bitmask_numba, bit for bit as xgrammar's kernel does, and a
sequence's matcher is asked whether it terminated only when it accepts a stop token."""

from __future__ import annotations

import json

import pytest
import torch
from shiftnode_kernels import cpu_bitmask_numba

from node.core.grammar_spec import GrammarSpec
from node.worker import grammar as grammar_module
from node.worker.grammar import GrammarCache, SeqGrammar, apply_mask, fill_masks, tokenizer_info, xgrammar
from support import STORIES

SCHEMA = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 12},
                                           "mood": {"enum": ["happy", "sad"]}}, "required": ["title", "mood"]}


def _reference(logits: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    xgrammar().apply_token_bitmask_inplace(out, mask, vocab_size=out.shape[1], indices=rows)
    return out


@pytest.mark.quick
@pytest.mark.parametrize("vocab", [512, 77, 32])
def test_the_cpu_kernel_masks_exactly_as_xgrammar_does(vocab):
    """Random bitmasks (every bit pattern, bit 31 included; all-ones words, which the loop skips), a
    vocabulary that does not fill its last word, a subset of rows in any order: equal to xgrammar's
    kernel, and rows not listed untouched."""
    assert cpu_bitmask_numba.available()
    gen = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    mask = torch.randint(-(2**31), 2**31 - 1, (9, words), dtype=torch.int32, generator=gen)
    mask[2] = -1  # all allowed
    mask[4, 0] = 0  # a word of nothing allowed
    logits = torch.randn(7, vocab, generator=gen)
    rows = [5, 0, 2, 4]
    got = logits.clone()
    assert cpu_bitmask_numba.apply_bitmask(got, mask, rows)
    assert torch.equal(got, _reference(logits, mask, rows))
    assert torch.equal(got[[1, 3, 6]], logits[[1, 3, 6]])


@pytest.mark.quick
def test_apply_mask_on_the_cpu_does_not_take_xgrammars_kernel(monkeypatch):
    """xgrammar's CPU kernel cost 2.3 µs of CPU a row for a 512-token vocabulary with the logits in cache,
    the compiled loop a tenth of it: the sampler's path must use the loop."""
    calls = []
    monkeypatch.setattr(xgrammar(), "apply_token_bitmask_inplace", lambda *a, **k: calls.append(a))
    mask = torch.zeros(4, 16, dtype=torch.int32)
    mask[:, 0] = 0b101
    logits = torch.zeros(4, 512)
    apply_mask(logits, mask, [1, 3])
    assert not calls
    assert torch.isinf(logits[1, 1]) and logits[1, 0] == 0 and logits[1, 2] == 0 and torch.isinf(logits[3, 300])
    assert torch.equal(logits[0], torch.zeros(512))


@pytest.mark.quick
def test_kernel_refuses_what_it_cannot_mask():
    """Not float32 logits, or a mask too narrow for the vocabulary: False (the caller takes xgrammar's
    kernel); a row outside the logits: IndexError rather than a write out of bounds."""
    mask = torch.zeros(2, 16, dtype=torch.int32)
    assert not cpu_bitmask_numba.apply_bitmask(torch.zeros(2, 512, dtype=torch.float16), mask, [0])
    assert not cpu_bitmask_numba.apply_bitmask(torch.zeros(2, 513), mask, [0])
    with pytest.raises(IndexError):
        cpu_bitmask_numba.apply_bitmask(torch.zeros(2, 512), mask, [2])


class _CountingMatcher:
    """A matcher that counts the calls made into it."""

    def __init__(self, matcher):
        self._m = matcher
        self.calls: dict[str, int] = {}

    def __getattr__(self, name):
        attr = getattr(self._m, name)
        if not callable(attr):
            return attr

        def counted(*a, **k):
            self.calls[name] = self.calls.get(name, 0) + 1
            return attr(*a, **k)

        return counted


@pytest.mark.quick
def test_a_matcher_is_asked_whether_it_ended_only_at_a_stop_token():
    """A sequence walked through a schema to its EOS: ``active`` (read for every token, twice in a step)
    makes no call into xgrammar; ``is_terminated`` is asked once, at the stop token, and ``active`` turns
    False then and stays so."""
    from node.worker.tokenizer import TextTokenizer

    tok = TextTokenizer.from_folder(STORIES)
    cache = GrammarCache(tokenizer_info(tok, 512, tok.eos_token_ids))
    g = SeqGrammar(cache.get(GrammarSpec("json_schema", json.dumps(SCHEMA))), [])
    g.matcher = counting = _CountingMatcher(g.matcher)
    gen = torch.Generator().manual_seed(0)
    steps = 0
    while g.active and steps < 64:
        logits = torch.randn(1, 512, generator=gen)
        logits[0, tok.eos_token_ids] = 20.0  # stop as soon as the grammar lets it
        apply_mask(logits, fill_masks([g], [0], 1, 512), [0])
        g.accept(int(logits.argmax()))
        steps += 1
    assert not g.active and g.ended and not g.broken
    assert counting.calls.get("is_terminated", 0) == 1
    assert counting.calls["accept_token"] == steps
    g.accept(5)  # a token of a step already in flight: skipped, nothing asked
    assert counting.calls["accept_token"] == steps and g.consumed == steps + 1


def test_grammar_module_warms_the_kernel_with_its_cache(monkeypatch):
    """The first grammar cache a process builds also compiles (or loads) the mask kernel, in the thread
    that builds the cache (never a step's)."""
    from node.worker.tokenizer import TextTokenizer

    warmed = []
    monkeypatch.setattr(grammar_module.cpu_bitmask_numba, "available", lambda: warmed.append(1) or True)
    monkeypatch.setattr(grammar_module, "_caches", {})
    grammar_module.grammar_cache(TextTokenizer.from_folder(STORIES), 512, [2])
    assert warmed == [1]
