"""Speculative decoding's scheduling half (pure): which decode items get draft tokens, the KV blocks the
drafts need, the rollback of those a verify step rejected, and the acceptance counts.

A *verify item* is a decoding sequence's item that computes its last token plus ``k`` draft tokens as one
short query over its paged KV (as a prompt chunk does); the engine samples at each of its ``k + 1``
positions and keeps the longest prefix of drafts that match, plus the token sampled after it (the
*bonus*, or the correction at the first mismatch): 1 to ``k + 1`` tokens per step. The KV written for
rejected drafts is garbage past the sequence's end; :func:`roll_back` returns the blocks that hold only
such slots to the ledger, and the next step overwrites the rest before reading them (each step writes
its positions first).

With a draft model (``--speculative-config`` ``"model"``) the node does not know the draft tokens: it
plans each verify item with ``k`` :data:`PROPOSED_IN_ENGINE` slots (so blocks, token budget and rollback
are planned exactly as for n-gram drafts), and the engine's draft model fills them in before the target
verifies them (:mod:`node.worker.draft_model`).

After a verify step the node does not know how many tokens it kept, so it plans nothing over it until it
comes back (:mod:`node.runtime.spec_decode`); speculation therefore stops above
:attr:`~node.core.spec_config.SpeculativeConfig.max_batch` sequences (running and waiting), where a step already
fills the machine and the overlap pays more than the drafts. Over a plain step in flight the node does plan:
a decoding sequence's last token is then a placeholder, and its n-gram drafts are looked up as if the
placeholder were the token the known prefix predicts, where its longest suffix matches (:func:`guessed_drafts`). Any drafts keep the output
exact (the verify step keeps only tokens the target samples itself); a wrong guess costs the rejected drafts.
"""

from __future__ import annotations

from node.core.batcher import StepKind, StepPlan
from node.core.ledger import BlockLedger
from node.core.ngram_proposer import propose_ngram
from node.core.sequence import Sequence
from node.core.spec_config import SpeculativeConfig


PROPOSED_IN_ENGINE = -1
"""A draft slot whose token the engine's draft model proposes (never a token id: ids are ``>= 0``)."""


def guessed_drafts(known: list[int], k: int, n_max: int) -> list[int]:
    """N-gram drafts for a sequence whose last token is still being sampled (a placeholder after ``known``,
    its known tokens): the lookup over ``known`` proposes ``k + 1`` tokens, the first being the guess for
    the placeholder; the other ``k`` (or fewer, or none) are the drafts after it. Only a match of the
    longest suffix (``n_max`` tokens) counts: in text that does not repeat, shorter matches are mostly
    chance, and a verify step of rejected drafts costs more than the decode step it replaces and stops the
    next step from overlapping it (``bench.load.spec_decode`` on stories260k, one stream, a loaded machine:
    guesses from the shortest suffix, as a lookup of a known last token allows, kept 58-60 % of drafts against
    63-64 % without guesses, at a median 0.83x the plain node's CPU per token against 0.73x (4 rounds); from
    the longest suffix only, 67-71 % of drafts, 0.61x against 0.64x (6 rounds); the rounds' spread is wide)."""
    return propose_ngram(known, k + 1, n_max, n_max)[1:]


def speculates(seq: Sequence) -> bool:
    """Whether ``seq`` may get drafts: no grammar (a structured output's tokens are masked one by one by
    its matcher, which the drafts would have to pass through: not built, so grammar rows never speculate)."""
    return seq.params.grammar is None


class SpecStats:
    """Acceptance counts of one device (vLLM's ``spec_decode`` counters): verify items (``drafts``),
    draft tokens proposed, draft tokens accepted, and accepted tokens by draft position."""

    __slots__ = ("drafts", "draft_tokens", "accepted_tokens", "accepted_per_pos")

    def __init__(self, k: int):
        self.drafts = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.accepted_per_pos = [0] * k

    def record(self, proposed: int, accepted: int) -> None:
        """One verify item: ``proposed`` draft tokens of which the first ``accepted`` matched."""
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted over proposed draft tokens (0 before any)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verify item yields on average: 1 (the bonus) plus its accepted drafts (vLLM's
        "mean acceptance length"; 0 before any)."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 0.0


class DraftPlanner:
    """Adds drafts to the decode items of a planned step: n-gram lookups, or (draft-model method) slots
    the engine's draft model fills (:data:`PROPOSED_IN_ENGINE`).

    Args:
        config: the node's speculative configuration.
    """

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.k = config.num_speculative_tokens
        self.in_engine = config.uses_draft_model
        self.stats = SpecStats(self.k)

    def active(self, running: list[Sequence], num_waiting: int = 0) -> bool:
        """Speculation's rule for a device's next step: it holds at most ``max_batch`` sequences, running
        and waiting together (vLLM's ``disable_by_batch_size`` counts the queue too: a burst of prompts
        turns speculation off until it is served), and one of them decodes and may speculate."""
        if len(running) + num_waiting > self.config.max_batch:
            return False
        return any(s.is_decoding and speculates(s) for s in running)

    def add_drafts(self, plan: StepPlan, ledger: BlockLedger, max_tokens: int) -> int:
        """Give each eligible decode item of ``plan`` (DECODE and MIXED steps) its drafts; returns the
        draft tokens added. Drafts stop at the sequence's ``max_len`` (the last accepted token may be the
        final one), at the step's token budget ``max_tokens``, and at the blocks the ledger can give
        without preempting anyone (speculation never evicts a sequence). A sequence whose last token is a
        placeholder (a plain step in flight samples it) gets n-gram drafts after a guess of that token
        (:func:`guessed_drafts`), and no draft-model slots (the engine's draft would run before the step in
        flight has come back to the node, which learns the kept count only then). Changes block tables and
        the items' ``num_tokens`` and ``draft``."""
        if plan.kind is StepKind.PREFILL:
            return 0
        cfg = self.config
        room = max_tokens - plan.num_tokens
        bs = ledger.block_size
        added = 0
        for it in plan.items:
            if room <= 0:
                break
            seq = it.seq
            toks = seq.token_ids
            pending = seq.num_pending
            if it.num_tokens != 1 or pending > 1 or (pending and self.in_engine) or not seq.is_decoding \
                    or not speculates(seq):
                continue
            k = min(self.k, room, seq.max_len - len(toks) - 1)
            if k <= 0:
                continue
            if self.in_engine:
                draft = [PROPOSED_IN_ENGINE] * k
            elif pending:  # the last token is the placeholder: draft after a guess of it
                draft = guessed_drafts(toks[:-1], k, cfg.lookup_max)
            else:
                draft = propose_ngram(toks, k, cfg.lookup_max, cfg.lookup_min)
            if not draft:
                continue
            need = ledger.blocks_for(seq.num_computed + 1 + len(draft)) - len(seq.block_ids)
            if need > 0 and (got := ledger.allocate(need)) is not None:
                seq.block_ids.extend(got)
            fits = len(seq.block_ids) * bs - seq.num_computed - 1  # draft slots the table holds now
            draft = draft[: max(0, fits)]
            if not draft:
                continue
            it.draft = draft
            it.num_tokens = 1 + len(draft)
            room -= len(draft)
            added += len(draft)
        return added


def roll_back(seq: Sequence, ledger: BlockLedger) -> int:
    """After a verify step: free the blocks of ``seq`` past those its computed tokens need
    (``ceil(num_computed / block_size)``: the next token's slot is allocated when it is planned, as for
    any decode); returns how many. Such blocks hold only rejected drafts' KV and were never offered to
    the prefix cache (only blocks of known tokens are)."""
    keep = ledger.blocks_for(seq.num_computed)
    surplus = seq.block_ids[keep:]
    if surplus:
        del seq.block_ids[keep:]
        ledger.free(surplus)
    return len(surplus)
