"""Unit checks of node.worker.grammar and node.api.structured: the mask in the sampler (EOS only where
the grammar accepts, on greedy and sampled rows), the matcher rebuilt from emitted tokens, the cache's
bounds over many distinct schemas, and the compile time bound."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
import torch

from node.api.errors import APIError
from node.api.structured import check_grammar
from node.core.grammar_spec import GrammarSpec
from node.core.sequence import SamplingParams
from node.worker.grammar import GrammarCache, SeqGrammar, fill_masks, tokenizer_info
from node.worker.sample_request import SampleRequest
from node.worker.sampler import sample
from node.worker.tokenizer import TextTokenizer
from support import STORIES

TOK = TextTokenizer.from_folder(STORIES)
VOCAB = 512
EOS = TOK.eos_token_ids


@pytest.fixture(scope="module")
def cache():
    return GrammarCache(tokenizer_info(TOK, VOCAB, EOS))


def _row(params: SamplingParams) -> SampleRequest:
    return SampleRequest(params, [1], 1, 0)


@pytest.mark.quick
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_eos_is_masked_until_the_grammar_accepts(cache, temperature):
    g = SeqGrammar(cache.get(GrammarSpec("regex", "ab")), [])
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=8, temperature=temperature)
    out = []
    for _ in range(8):
        logits = torch.randn(1, VOCAB)
        logits[0, EOS] = 50.0  # the model wants to stop at once
        if not g.active:
            break
        mask = fill_masks([g], [0], 1, VOCAB)
        [tok], _ = sample(logits, [_row(params)], gen, (mask, [0]))
        out.append(tok)
        g.accept(tok)
    assert TOK.decode(out[:-1]) == "ab" and out[-1] in EOS  # EOS only once "ab" is complete
    assert not g.active


@pytest.mark.quick
def test_unmasked_rows_of_a_batch_are_untouched(cache):
    g = SeqGrammar(cache.get(GrammarSpec("choice", json.dumps(["yes"]))), [])
    logits = torch.randn(3, VOCAB)
    logits[:, 7] = 99.0
    mask = fill_masks([g], [1], 3, VOCAB)
    toks, _ = sample(logits, [_row(SamplingParams(max_tokens=4, temperature=0.0))] * 3, torch.Generator(), (mask, [1]))
    assert toks[0] == toks[2] == 7 and toks[1] != 7


def test_a_matcher_rebuilt_from_emitted_tokens_continues_where_it_stood(cache):
    spec = GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}))
    grammar = cache.get(spec)
    fresh, emitted = SeqGrammar(grammar, []), []
    for _ in range(6):  # walk the grammar: the highest allowed id each time
        logits = torch.arange(VOCAB, dtype=torch.float32).view(1, -1)
        [tok], _ = sample(logits, [_row(SamplingParams(max_tokens=9, temperature=0.0))], torch.Generator(),
                          (fill_masks([fresh], [0], 1, VOCAB), [0]))
        fresh.accept(tok)
        emitted.append(tok)
    rebuilt = SeqGrammar(grammar, emitted)
    assert torch.equal(fill_masks([fresh], [0], 1, VOCAB), fill_masks([rebuilt], [0], 1, VOCAB))
    assert not rebuilt.broken
    assert SeqGrammar(grammar, TOK.encode("nope", add_special_tokens=False)).broken  # not the grammar's: unmasked


def test_the_cache_stays_within_its_bounds_over_many_distinct_schemas():
    small = GrammarCache(tokenizer_info(TOK, VOCAB, EOS), max_entries=40, max_bytes=60_000)
    seen_bytes = []
    for i in range(300):
        schema = {"type": "object", "properties": {f"k{i}": {"type": "integer"}, "v": {"enum": [str(i)]}}}
        small.get(GrammarSpec("json_schema", json.dumps(schema)))
        assert small.num_entries <= 40 and small.num_bytes <= 60_000
        seen_bytes.append(small.num_bytes)
    assert small.num_entries > 0 and max(seen_bytes) > 30_000  # it filled up to its bound, then evicted
    assert small.num_bytes == sum(e.nbytes for e in small._entries.values())


def test_a_compile_past_the_time_bound_is_a_400():
    node = SimpleNamespace(tokenizer=TOK, info=SimpleNamespace(cfg=SimpleNamespace(vocab_size=VOCAB, eos_token_ids=EOS)))
    schema = {"type": "object", "properties": {f"f{i}": {"type": "string", "pattern": "[a-z]{2,9}[0-9]{1,4}"} for i in range(300)}}

    async def go():
        await check_grammar(node, GrammarSpec("ebnf", 'root ::= "x"'), "guided_grammar")  # warm: the cache exists
        await check_grammar(node, GrammarSpec("json_schema", json.dumps(schema)), "guided_json", timeout_s=0.001)

    with pytest.raises(APIError) as e:
        asyncio.run(go())
    assert e.value.status == 400 and "did not compile within 0.001 s" in str(e.value)


def test_length_bounded_strings_exclude_raw_control_characters(cache):
    """xgrammar's class for strings with maxLength lets U+0000-U+001F through (its issue #800); JSON forbids
    them, so json.loads of such output failed. After the opening quote no control byte is allowed."""
    ids = {TOK.id_to_token(i): i for i in range(VOCAB)}
    g = SeqGrammar(cache.get(GrammarSpec("json_schema", '{"type": "string", "maxLength": 8}')), [])
    assert g.matcher.accept_string('"')
    allowed = torch.zeros(1, VOCAB)
    from node.worker.grammar import apply_mask

    apply_mask(allowed, fill_masks([g], [0], 1, VOCAB), [0])
    controls = [ids[f"<0x{b:02X}>"] for b in range(0x20)]
    assert all(allowed[0, t] == float("-inf") for t in controls)
    assert allowed[0, ids["▁the"]] == 0.0
