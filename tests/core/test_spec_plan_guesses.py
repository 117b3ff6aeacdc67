"""Speculative decoding's scheduling half (node.core.spec_plan), pure: drafts after a guess of a placeholder
token, so a step planned over a plain step in flight speculates too, and which items get drafts."""

from __future__ import annotations

import pytest

from node.core.batcher import ScheduledSeq, StepKind, StepPlan
from node.core.ledger import BlockLedger
from node.core.ngram_proposer import propose_ngram
from node.core.sequence import PENDING, SamplingParams, Sequence
from node.core.spec_config import SpeculativeConfig
from node.core.spec_plan import PROPOSED_IN_ENGINE, DraftPlanner, guessed_drafts

pytestmark = pytest.mark.quick

NGRAM = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=2)
STORY = [5, 6, 7, 8, 9, 10, 11, 12, 30, 31, 5, 6, 7]  # "5 6 7" again: 8 9 10 11 followed it


def decoding(tokens: list[int], ledger: BlockLedger, pending: bool) -> Sequence:
    """A decoding sequence of prompt ``tokens[:4]``, every token computed but the last; ``pending``: the last is
    a plain step's placeholder (that step, in flight, computed the one before it)."""
    seq = Sequence("s", "r", 0, 0.0, tokens[:4], SamplingParams(max_tokens=64, temperature=0.0), 512)
    seq.token_ids = list(tokens) + ([PENDING] if pending else [])
    seq.num_pending = int(pending)
    seq.num_computed = len(seq.token_ids) - 1
    seq.block_ids = ledger.allocate(ledger.blocks_for(seq.num_computed + 1))
    return seq


def test_a_guessed_token_is_the_first_of_the_lookup_and_the_drafts_follow_it():
    assert propose_ngram(STORY, 4, 3, 2) == [8, 9, 10, 11]
    assert guessed_drafts(STORY, 3, 3) == [9, 10, 11]  # 8 is the guess for the placeholder
    assert guessed_drafts(STORY, 0, 3) == []
    assert guessed_drafts([1, 2, 3, 4], 3, 3) == []  # nothing repeats: no guess, no drafts
    assert propose_ngram([2, 2, 2], 4, 2, 2) == [2] and guessed_drafts([2, 2, 2], 3, 2) == []  # the guess only
    # only the longest suffix counts: "6 7" matches (a known last token would draft after it), "31 6 7" does not
    shorter = [5, 6, 7, 8, 9, 10, 11, 31, 6, 7]
    assert propose_ngram(shorter, 4, 3, 2) == [8, 9, 10, 11] and guessed_drafts(shorter, 3, 3) == []


@pytest.mark.parametrize("pending", [False, True])
def test_a_sequence_sampling_in_a_plain_step_in_flight_gets_drafts_after_the_guess(pending):
    ledger = BlockLedger(16, 4)
    # known tokens: the story up to "5 6 7 8" when the 8 is known, up to "5 6 7" and a placeholder when not
    seq = decoding(STORY + [8] if not pending else STORY, ledger, pending)
    plan = StepPlan(StepKind.DECODE, [ScheduledSeq(seq, 1)])
    planner = DraftPlanner(NGRAM)
    assert planner.add_drafts(plan, ledger, 64) == 3
    (it,) = plan.items
    # either way the drafts are what follows 8 (the known last token, or the guess of the placeholder)
    assert list(it.draft) == [9, 10, 11] and it.num_tokens == 4
    assert len(seq.block_ids) * ledger.block_size >= seq.num_computed + it.num_tokens  # slots for every draft
    assert it.samples


def test_draft_model_slots_wait_for_a_known_last_token():
    ledger = BlockLedger(16, 4)
    planner = DraftPlanner(SpeculativeConfig(model="/draft", num_speculative_tokens=2))
    busy = StepPlan(StepKind.DECODE, [ScheduledSeq(decoding(STORY, ledger, pending=True), 1)])
    assert planner.add_drafts(busy, ledger, 64) == 0 and busy.items[0].draft == ()
    known = StepPlan(StepKind.DECODE, [ScheduledSeq(decoding(STORY, ledger, pending=False), 1)])
    assert planner.add_drafts(known, ledger, 64) == 2 and list(known.items[0].draft) == [PROPOSED_IN_ENGINE] * 2


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_only_a_verify_step_in_flight_holds_the_next_one_for_ngram_drafts(method):
    """n-gram: a step is planned over a plain step in flight (its drafts follow a guess), never over a verify
    step. Draft model: its slots need a known last token, so while speculation's rule holds every step waits."""
    from types import SimpleNamespace

    from node.core.batcher import BatchConfig, Batcher
    from node.runtime.spec_decode import SpecDecoding
    from node.runtime.step_encoder import StepEncoder

    config = NGRAM if method == "ngram" else SpeculativeConfig(model="/draft", num_speculative_tokens=3)
    ledger = BlockLedger(16, 4)
    batcher = Batcher(ledger, BatchConfig())
    seq = decoding(STORY + [8], ledger, pending=False)
    batcher.running.append(seq)
    spec = SpecDecoding(config, batcher, StepEncoder())
    assert not spec.hold([])
    verify = StepPlan(StepKind.DECODE, [ScheduledSeq(seq, 1)])
    spec.draft(verify, known=True)
    assert verify.items[0].draft  # drafts (or slots): a verify step
    assert spec.hold([SimpleNamespace(plan=verify)])
    plain = SimpleNamespace(plan=StepPlan(StepKind.DECODE, [ScheduledSeq(seq, 1)]))
    assert spec.hold([plain]) is (method == "draft_model")


def test_tries_on_known_tokens_back_off_while_they_find_nothing():
    """n-gram in text that does not repeat: a try on known last tokens that finds nothing doubles the number of
    steps planned over steps in flight before the next one (1, 2, 4, 8, 8 ...); a try that finds drafts resets it."""
    from types import SimpleNamespace

    from node.core.batcher import BatchConfig, Batcher
    from node.runtime.spec_decode import MAX_EXACT_BACKOFF, SpecDecoding
    from node.runtime.step_encoder import StepEncoder

    ledger = BlockLedger(64, 4)
    batcher = Batcher(ledger, BatchConfig())
    seq = decoding([40 + i for i in range(12)], ledger, pending=False)  # nothing repeats
    batcher.running.append(seq)
    spec = SpecDecoding(NGRAM, batcher, StepEncoder())
    busy = [SimpleNamespace(plan=StepPlan(StepKind.DECODE, []))]  # a plain step in flight
    gaps = []
    for _ in range(6):
        assert spec.hold(busy)  # time for a try on known tokens: wait for the step in flight
        spec.draft(StepPlan(StepKind.DECODE, [ScheduledSeq(seq, 1)]), known=True)
        gap = 0
        while not spec.hold(busy):
            spec.draft(StepPlan(StepKind.DECODE, [ScheduledSeq(seq, 1)]), known=False)
            gap += 1
        gaps.append(gap)
    assert gaps == [2, 4, 8, 8, 8, 8] and MAX_EXACT_BACKOFF == 8
    seq.token_ids = [40, 41, 42, 43, 44, 45, 40, 41, 42]  # now it repeats: the next try finds drafts
    seq.num_computed = len(seq.token_ids) - 1
    spec.draft(StepPlan(StepKind.DECODE, [ScheduledSeq(seq, 1)]), known=True)
    assert spec._backoff == 1
