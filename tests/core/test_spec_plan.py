"""Speculative decoding's pure half: the n-gram proposer, the configuration, drafts added to a planned step
(blocks, budget, max_len), the rollback of rejected drafts' blocks, and the acceptance counts."""

import pytest

from node.core.batcher import BatchConfig, Batcher, StepKind
from node.core.grammar_spec import GrammarSpec
from node.core.ledger import BlockLedger
from node.core.ngram_proposer import propose_ngram
from node.core.online_refit import OnlineRefit
from node.core.sequence import SamplingParams, Sequence
from node.core.spec_config import DEFAULT_DISABLE_BY_BATCH_SIZE, SpeculativeConfig, parse_speculative_config
from node.core.spec_plan import DraftPlanner, SpecStats, roll_back

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here


# --- the proposer ---------------------------------------------------------------------------------

def test_proposes_what_followed_the_latest_earlier_occurrence():
    toks = [5, 6, 7, 1, 5, 6, 8, 2, 9, 5, 6]
    # suffix [5, 6] occurs at 0 and 4; the latest (4) was followed by 8, 2, 9
    assert propose_ngram(toks, 3, 2, 2) == [8, 2, 9]
    assert propose_ngram(toks, 2, 2, 2) == [8, 2]
    assert propose_ngram(toks, 10, 2, 2) == [8, 2, 9, 5, 6]  # up to the end of the sequence


def test_the_longest_matching_suffix_wins():
    toks = [1, 2, 3, 40, 9, 2, 3, 50, 7, 1, 2, 3]
    # n = 3 ([1, 2, 3]) matches at 0 → 40; n = 2 ([2, 3]) would match later, at 5 → 50
    assert propose_ngram(toks, 1, 3, 2) == [40]
    assert propose_ngram(toks, 1, 2, 2) == [50]


def test_no_match_no_draft_and_the_suffix_itself_never_counts():
    assert propose_ngram([1, 2, 3, 4], 3, 3, 1) == []
    assert propose_ngram([1, 2], 3, 2, 1) == []  # "2" occurs only as the last token
    assert propose_ngram([4, 4], 3, 1, 1) == [4]  # the first 4 is followed by the second
    assert propose_ngram([1, 2, 1], 0, 2, 1) == []
    assert propose_ngram([], 3, 2, 1) == []


def test_byte_matches_that_straddle_two_ids_are_not_token_matches():
    # 256 packs as 00 01 00 00 and 1 as 01 00 00 00: the bytes of [1, 0] (01 00 00 00 00 00 00 00) also occur
    # straddling 256 and 0 at an unaligned offset, which must not count
    toks = [7, 256, 0, 0, 3, 1, 0]
    assert propose_ngram(toks, 2, 2, 2) == []
    toks = [1, 0, 9, 256, 0, 0, 3, 1, 0]
    assert propose_ngram(toks, 2, 2, 2) == [9, 256]


def test_large_ids():
    big = 128_000
    toks = [big, big + 1, big + 2, 3, big, big + 1]
    assert propose_ngram(toks, 2, 2, 1) == [big + 2, 3]


# --- the configuration ----------------------------------------------------------------------------

def test_config_follows_vllm_json_and_defaults():
    cfg = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                                   '"prompt_lookup_min": 2}')
    assert (cfg.num_speculative_tokens, cfg.lookup_max, cfg.lookup_min) == (4, 4, 2)
    assert cfg.max_batch == DEFAULT_DISABLE_BY_BATCH_SIZE
    cfg = parse_speculative_config('{"num_speculative_tokens": 3, "prompt_lookup_max": 3, "disable_by_batch_size": 9}')
    assert (cfg.kind, cfg.lookup_max, cfg.lookup_min, cfg.max_batch) == ("ngram", 3, 3, 9)
    cfg = parse_speculative_config('{"num_speculative_tokens": 3}')
    assert (cfg.lookup_max, cfg.lookup_min) == (5, 5)
    assert (cfg.kind, cfg.uses_draft_model) == ("ngram", False)


def test_a_draft_model_config_is_inferred_from_model_as_vllm_does():
    cfg = parse_speculative_config('{"model": "some/draft", "num_speculative_tokens": 3}')
    assert (cfg.kind, cfg.uses_draft_model, cfg.model, cfg.num_speculative_tokens) == ("draft_model", True, "some/draft", 3)
    cfg = parse_speculative_config('{"method": "draft_model", "model": "d", "num_speculative_tokens": 2, '
                                   '"disable_by_batch_size": 6}')
    assert (cfg.kind, cfg.max_batch) == ("draft_model", 6)


@pytest.mark.parametrize("text, words", [
    ('{"method": "eagle", "num_speculative_tokens": 3}', "method must be"),
    ('{"method": "ngram", "model": "some/draft", "num_speculative_tokens": 3}', "takes no model"),
    ('{"method": "draft_model", "num_speculative_tokens": 3}', 'needs "model"'),
    ('{"model": "d", "num_speculative_tokens": 3, "prompt_lookup_max": 3}', 'ngram" only'),
    ('{"model": "d", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "ngram"}', "num_speculative_tokens"),
    ('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"num_speculative_tokens": 2, "prompt_lookup_max": 1, "prompt_lookup_min": 3}', "prompt_lookup_min"),
    ('{"num_speculative_tokens": 2, "typo": 1}', "typo"),
    ('{"num_speculative_tokens": "two"}', "num_speculative_tokens"),
    ('{"num_speculative_tokens": 2, "disable_by_batch_size": 0}', "disable_by_batch_size"),
    ("ngram", "JSON"),
])
def test_config_errors_name_the_key(text, words):
    with pytest.raises(ValueError, match=words):
        parse_speculative_config(text)


# --- drafts in a plan, rollback --------------------------------------------------------------------

def decoding(b: Batcher, toks: list[int], sid: str = "s0", max_tokens: int = 100, **params) -> Sequence:
    """A sequence whose prompt ``toks[:-1]`` is prefilled and whose first output token ``toks[-1]`` is known."""
    s = Sequence(sid, "r" + sid, 0, 0.0, toks[:-1], SamplingParams(max_tokens=max_tokens, **params), 4096)
    s.token_ids.append(toks[-1])
    s.num_computed = len(toks) - 1
    s.block_ids = b.ledger.allocate(b.ledger.blocks_for(s.num_computed))
    b.adopt(s)
    assert s.is_decoding
    return s


CFG = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)
REPEAT = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3]  # drafts [4, 5, 6, 7]


def test_drafts_extend_a_decode_item_with_blocks_and_commit_counts_only_its_last_token():
    led = BlockLedger(64, 4)
    b = Batcher(led, BatchConfig(max_batched_tokens=64))
    s = decoding(b, REPEAT)
    planner = DraftPlanner(CFG)
    plan = b.schedule(StepKind.DECODE)
    assert planner.add_drafts(plan, led, 64) == 4
    (it,) = plan.items
    assert it.draft == [4, 5, 6, 7] and it.num_tokens == 5 and it.samples and plan.num_tokens == 5
    # positions 12 .. 16 are computed: 17 slots, 5 blocks of 4
    assert len(s.block_ids) == 5
    b.commit(plan)
    assert s.num_computed == 13  # the last token only; the drafts count once accepted


@pytest.mark.parametrize("kept", [0, 1, 4])
def test_rollback_frees_the_blocks_of_rejected_drafts_and_leaves_none_cached(kept):
    led = BlockLedger(64, 4)
    b = Batcher(led, BatchConfig(max_batched_tokens=64))
    s = decoding(b, REPEAT)
    plan = b.schedule(StepKind.DECODE)
    DraftPlanner(CFG).add_drafts(plan, led, 64)
    b.commit(plan)
    b.settle(plan)
    s.token_ids.append(4)  # the first kept token (the placeholder's)
    s.token_ids.extend([5, 6, 7, 9][:kept])  # further kept tokens
    s.num_computed += kept
    used = led.num_used
    freed = roll_back(s, led)
    assert len(s.block_ids) == led.blocks_for(s.num_computed)
    assert freed == 5 - len(s.block_ids) and led.num_used == used - freed
    # only blocks of known tokens were offered to the prefix cache, and they are all still held
    assert s.num_registered <= len(s.block_ids)
    led.check()
    b.remove(s)
    assert led.num_used == 0
    led.check()


def test_drafts_stop_at_max_len_budget_and_free_blocks_and_skip_grammars_and_prefill():
    led = BlockLedger(64, 4)
    b = Batcher(led, BatchConfig(max_batched_tokens=64))
    short = decoding(b, REPEAT, "a", max_tokens=3)  # 1 output so far, 2 more allowed: 1 draft at most
    plan = b.schedule(StepKind.DECODE)
    DraftPlanner(CFG).add_drafts(plan, led, 64)
    assert plan.items[0].draft == [4]
    b.discard(plan)
    b.remove(short)

    s = decoding(b, REPEAT, "b")
    plan = b.schedule(StepKind.DECODE)
    DraftPlanner(CFG).add_drafts(plan, led, 3)  # a budget of 3 tokens: the decode token and 2 drafts
    assert plan.items[0].draft == [4, 5]
    b.discard(plan)
    b.remove(s)

    tight = BlockLedger(4, 4)  # 16 slots: 12 computed tokens and the decode token's slot take all 4 blocks
    bt = Batcher(tight, BatchConfig(max_batched_tokens=64))
    s = decoding(bt, REPEAT, "c")
    plan = bt.schedule(StepKind.DECODE)
    assert DraftPlanner(CFG).add_drafts(plan, tight, 64) == 3  # slots 13 .. 15 of the last block: 3 drafts fit
    assert plan.items[0].draft == [4, 5, 6] and tight.num_free == 0

    g = decoding(b, REPEAT, "d", grammar=GrammarSpec("json", "{}"))
    plan = b.schedule(StepKind.DECODE)
    assert DraftPlanner(CFG).add_drafts(plan, led, 64) == 0 and not plan.items[0].draft
    assert not DraftPlanner(CFG).active([g])
    b.discard(plan)
    b.remove(g)

    s = decoding(b, REPEAT, "e")
    plan = b.schedule(StepKind.MIXED)
    plan.kind = StepKind.PREFILL
    assert DraftPlanner(CFG).add_drafts(plan, led, 64) == 0


def test_the_batch_size_rule():
    b = Batcher(BlockLedger(256, 4), BatchConfig(max_batched_tokens=64))
    planner = DraftPlanner(SpeculativeConfig(num_speculative_tokens=2, disable_by_batch_size=2))
    assert not planner.active(b.running)  # nothing decodes
    decoding(b, REPEAT, "a")
    decoding(b, REPEAT, "b")
    assert planner.active(b.running)
    assert not planner.active(b.running, num_waiting=1)  # queued prompts count: a burst turns it off
    decoding(b, REPEAT, "c")
    assert not planner.active(b.running)


def test_stats_and_the_cost_samples_count_the_drafts():
    st = SpecStats(3)
    st.record(3, 3)
    st.record(3, 0)
    st.record(2, 1)
    assert (st.drafts, st.draft_tokens, st.accepted_tokens, st.accepted_per_pos) == (3, 8, 4, [2, 1, 1])
    assert st.acceptance_rate == pytest.approx(0.5) and st.mean_accepted_length == pytest.approx(1 + 4 / 3)

    led = BlockLedger(64, 4)
    b = Batcher(led, BatchConfig(max_batched_tokens=64))
    decoding(b, REPEAT)
    plan = b.schedule(StepKind.DECODE)
    DraftPlanner(CFG).add_drafts(plan, led, 64)
    refit = OnlineRefit()
    refit.record(plan, 0.01, None, in_role=True)
    assert refit.decode[-1][:2] == (4, 1)  # 4 draft tokens as prompt-like work beside 1 decode
