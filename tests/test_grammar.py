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


@pytest.mark.quick
def test_the_reused_bitmask_equals_fresh_masks_and_only_its_rows_are_read(cache):
    """The engine's bitmask is one buffer kept across steps, filled in one xgrammar call: a step's rows
    equal a fresh mask's, and a later, smaller step neither reallocates it nor lets the rows it left
    stale mask anything."""
    from node.worker.grammar import BitmaskFiller, apply_mask

    grammar = cache.get(GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})))
    walked = [SeqGrammar(grammar, []) for _ in range(5)]
    for i, g in enumerate(walked):  # rows at different states: the start, inside the key, at the value
        assert g.matcher.accept_string('{"a":1'[: i + 1])
    filler = BitmaskFiller(VOCAB)
    rows = [0, 2, 3, 5, 6]
    buf = filler.fill(walked, rows)
    fresh = fill_masks(walked, rows, 7, VOCAB)
    assert buf.shape[0] >= 7 and torch.equal(buf[rows], fresh[rows])
    again = filler.fill(walked[:1], [1])
    assert again is buf  # reused, not reallocated
    assert torch.equal(buf[1], fresh[0])
    logits = torch.zeros(3, VOCAB)
    apply_mask(logits, again, [1])
    assert torch.equal(logits[0], torch.zeros(VOCAB)) and torch.equal(logits[2], torch.zeros(VOCAB))  # stale rows unread
    assert bool(torch.isinf(logits[1]).any())


@pytest.mark.quick
def test_a_matcher_catches_up_with_its_sequence_once(cache):
    """The engine's matcher takes a sequence's new output tokens when it next fills a mask (catch_up), each
    token once however often it is called, and stands where one built from the same tokens stands."""
    spec = GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "string"}}}))
    grammar = cache.get(spec)
    prompt = TOK.encode("Once upon a time")
    walker, out = SeqGrammar(grammar, []), []
    for _ in range(9):  # a valid output: the highest allowed id each time
        logits = torch.arange(VOCAB, dtype=torch.float32).view(1, -1)
        [tok], _ = sample(logits, [_row(SamplingParams(max_tokens=9, temperature=0.0))], torch.Generator(),
                          (fill_masks([walker], [0], 1, VOCAB), [0]))
        walker.accept(tok)
        out.append(tok)
    g = SeqGrammar(grammar, [])
    tokens = prompt + out[:2]
    g.catch_up(tokens, len(prompt))
    g.catch_up(tokens, len(prompt))  # nothing new: nothing accepted twice
    assert g.consumed == 2
    tokens += out[2:]
    g.catch_up(tokens, len(prompt))
    built = SeqGrammar(grammar, out)
    assert g.consumed == len(out) and not g.broken and not built.broken
    assert torch.equal(fill_masks([g], [0], 1, VOCAB), fill_masks([built], [0], 1, VOCAB))


def test_a_cached_spec_is_checked_without_the_compile_threads(monkeypatch):
    """A spec the node has compiled before is a cache hit, answered on the loop: no hop through the compile
    threads (two thread hand-offs per request, measurable at 64 streams of short JSON answers)."""
    import node.api.structured as structured

    node = SimpleNamespace(tokenizer=TOK, info=SimpleNamespace(cfg=SimpleNamespace(vocab_size=VOCAB, eos_token_ids=EOS)))
    spec = GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"hit": {"type": "boolean"}}}))
    asyncio.run(check_grammar(node, spec, "response_format"))  # compiles (in the threads) and caches

    class NoThreads:
        def submit(self, *a, **k):
            raise AssertionError("a cached spec went through the compile threads")

    monkeypatch.setattr(structured, "_compile_pool", NoThreads())
    asyncio.run(check_grammar(node, spec, "response_format"))
    with pytest.raises(AssertionError):  # a new spec still compiles in the threads
        asyncio.run(check_grammar(node, GrammarSpec("regex", "[0-9]{3}"), "structured_outputs"))


@pytest.mark.quick
def test_the_engine_fills_the_mask_in_the_steps_thread_and_replies_before_its_matcher_moves():
    """EngineCore with a grammar row: the runner resolves the pending mask in the step's own thread (no
    mask thread: on a 2-core CPU its GIL hand-offs cost more than the fill), and the step's reply does
    not wait for the matcher, which takes the step's token at the next fill. Output: the grammar's."""
    import threading

    from node.worker.engine_core import EngineCore, NewSeq, StepItem, StepMsg
    from node.worker.grammar_masks import GrammarMasks
    from node.worker.runner import SeqOutput

    class LowestAllowed:
        """A runner whose 'model' prefers the lowest token id: it samples the lowest one the mask allows."""

        num_blocks, kv_cache = 16, None

        def execute(self, step):
            mask = step.masks.result()  # joined here, as ModelRunner does after its forward
            logits = torch.zeros(len(step.seqs), VOCAB)
            logits -= torch.arange(VOCAB, dtype=torch.float32)
            toks, _ = sample(logits, [s.sample for s in step.seqs], torch.Generator(), mask)
            return {s.seq_id: SeqOutput(token_id=t) for s, t in zip(step.seqs, toks)}

    fills = []

    class Recording(GrammarMasks):
        def fill(self, seqs):
            fills.append(threading.current_thread())
            return super().fill(seqs)

    core = EngineCore(LowestAllowed(), grammars=Recording(TOK, VOCAB, EOS))
    choices = ["yes", "no"]
    params = SamplingParams(max_tokens=8, temperature=0.0, grammar=GrammarSpec("choice", json.dumps(choices)))
    prompt = TOK.encode("Once upon a time")
    threads_before = threading.active_count()
    reply = core.step(StepMsg([StepItem("a", 0, len(prompt), True)], new=[NewSeq("a", list(prompt), len(prompt), params, [0])]))
    out = [reply.outputs[0].token_id]
    while out[-1] not in EOS and len(out) < 8:  # the node ends the sequence at EOS
        state = core.seqs["a"]
        assert state.grammar.consumed == len(out) - 1  # the last token is taken at the next fill, not before the reply
        reply = core.step(StepMsg([StepItem("a", len(state.token_ids) - 1, 1, True)]))
        out.append(reply.outputs[0].token_id)
    assert fills and set(fills) == {threading.current_thread()} and threading.active_count() == threads_before
    assert out[-1] in EOS and TOK.decode(out[:-1]) in choices
