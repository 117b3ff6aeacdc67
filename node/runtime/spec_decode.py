"""Speculative decoding on one device (``--speculative-config``): the step loop's part.

Per step, on the node's event loop: while speculation's rule holds (:meth:`DraftPlanner.active`: at
most ``disable_by_batch_size`` sequences, running and waiting), the planned step's decode items get drafts
(:class:`~node.core.spec_plan.DraftPlanner`): n-gram lookups, after a guess of the last token where a plain
step in flight is still sampling it, so such a step overlaps the one before it as a plain step would; where
such guesses find nothing, the device waits for its steps now and then to try on known tokens
(:data:`MAX_EXACT_BACKOFF`).
The device plans nothing over a verify step in flight (:meth:`SpecDecoding.hold`): how many tokens it keeps is
known only when it comes back. The engine verifies them (:mod:`node.worker.spec_verify`) and replies with 1 to ``k + 1`` tokens per verify
item; :meth:`SpecDecoding.settle` appends the kept tokens, advances ``num_computed`` over them and
frees the blocks that held only rejected drafts (:func:`~node.core.spec_plan.roll_back`), before
anything else reads the sequence, so a move or a hand-off after it carries the accepted tokens' KV
only. :func:`join_kept` streams the kept tokens as one delta and stops at the first that ends the
choice (a stop token, EOS, ``max_tokens``, a stop string), dropping the tokens after it.

Above the batch rule the drafts stop.
"""

from __future__ import annotations

from node.core.batcher import Batcher, StepPlan
from node.core.sequence import Sequence
from node.core.spec_config import SpeculativeConfig
from node.core.spec_plan import DraftPlanner, SpecStats, roll_back
from node.runtime.output import SeqDelta
from node.runtime.step_encoder import StepEncoder
from node.runtime.token_output import TokenDelta
from node.worker.engine_core import StepReply
from node.worker.sample_request import TokenLogprobs


MAX_EXACT_BACKOFF = 8
"""Most steps planned over steps in flight (with guessed drafts only) between two n-gram tries on known last
tokens, for which the device waits for its steps in flight (:meth:`SpecDecoding.hold`). A try that finds no
draft doubles the gap, up to this; one that finds drafts brings it back to 1. So text that stops repeating costs
a wait once in 9 steps, not every other step, and a repeat of only ``prompt_lookup_min`` tokens is still found."""


class SpecDecoding:
    """One device's speculative decoding.

    Args:
        config: the node's ``--speculative-config``.
        batcher: the device's batch former (its running sequences, ledger and token budget).
        encoder: the device's step encoder (told of the tokens the engine kept beyond the first).
    """

    def __init__(self, config: SpeculativeConfig, batcher: Batcher, encoder: StepEncoder):
        self.planner = DraftPlanner(config)
        self.batcher = batcher
        self.encoder = encoder
        self.rolled_back_blocks = 0  # blocks freed after verify steps (rejected drafts' KV)
        self._verifying: StepPlan | None = None  # the last step given drafts (at most one is ever in flight)
        self._kept: dict[str, tuple[list[int], list[TokenLogprobs]]] = {}  # the settled reply's, by seq id
        self._exact_in = 0  # steps to plan over steps in flight before the next try on known last tokens
        self._backoff = 1  # the gap after the last such try (MAX_EXACT_BACKOFF)

    @property
    def stats(self) -> SpecStats:
        return self.planner.stats

    def hold(self, inflight) -> bool:
        """Whether the next step must wait for the steps in flight (``inflight``: their records, with
        ``plan``): a verify step is among them (its sequences' token counts are unknown until it comes
        back, so no step may be planned over them), or speculation's rule holds and the next step is to
        draft on known last tokens: every step with a draft model (its slots are planned only then:
        :meth:`DraftPlanner.add_drafts`), and n-gram tries after :data:`MAX_EXACT_BACKOFF`'s gap. Otherwise
        the next step is planned over the steps in flight, its n-gram drafts following a guess of the tokens
        they sample (:func:`~node.core.spec_plan.guessed_drafts`)."""
        if any(r.plan is self._verifying for r in inflight):
            return True
        planner, b = self.planner, self.batcher
        if not inflight or not planner.active(b.running, len(b.waiting)):
            return False
        return planner.in_engine or self._exact_in <= 0

    def kept_of(self, seq_id: str) -> tuple[list[int], list[TokenLogprobs]]:
        """The tokens the last settled verify step kept after a sequence's first, and their logprobs."""
        return self._kept.get(seq_id, ([], []))

    def draft(self, plan: StepPlan, known: bool) -> None:
        """Add drafts to ``plan``'s decode items while speculation's rule holds on this device
        (:meth:`DraftPlanner.active`); a plan given any is the verify step :meth:`hold` waits for. ``known``:
        no step was in flight when ``plan`` was made (every last token is known): its n-gram try sets the
        gap to the next such try (:data:`MAX_EXACT_BACKOFF`)."""
        b = self.batcher
        if not self.planner.active(b.running, len(b.waiting)):
            return
        found = self.planner.add_drafts(plan, b.ledger, b.config.max_batched_tokens)
        if found:
            self._verifying = plan
        if known:
            self._backoff = 1 if found else min(2 * self._backoff, MAX_EXACT_BACKOFF)
            self._exact_in = self._backoff
        else:
            self._exact_in -= 1

    def settle(self, plan: StepPlan, reply: StepReply, held: dict) -> None:
        """A step's reply came back (its placeholders already hold the first tokens): each verify item's
        kept tokens join its sequence, and its blocks past them go back to the ledger. ``held``: the
        sequence ids still on the device (one aborted while the step ran has no blocks left to roll back).
        The kept tokens stay readable (:meth:`kept_of`) until the next reply settles."""
        self._kept = {}
        if plan is not self._verifying or not reply.kept:
            return
        stats, ledger = self.planner.stats, self.batcher.ledger
        lps = reply.kept_logprobs or [[]] * len(reply.kept)
        for it, more, more_lps in zip(plan.items, reply.kept, lps):
            if not it.draft:
                continue
            seq = it.seq
            self._kept[seq.seq_id] = (more, more_lps)
            stats.record(len(it.draft), len(more))
            if seq.seq_id not in held:
                continue
            if more:
                seq.token_ids.extend(more)
                seq.num_computed += len(more)
                self.encoder.accepted(seq.seq_id, len(more))
            self.rolled_back_blocks += roll_back(seq, ledger)


def join_kept(state, first, kept: tuple[list[int], list[TokenLogprobs]], position: int, seq: Sequence):
    """The delta of a verify item's first token (``first``, at ``position``) joined with those of its
    further kept tokens (``kept``: the tokens and their logprobs, or none), each accounted by the
    choice's output ``state`` at its own position, up to the first that ends the choice: one delta per
    step, as one sampled token gives (so ITL counts steps, and a stream gets one event of several
    tokens, as vLLM's does). The tokens after an end leave the sequence (never streamed). Works on both
    kinds of delta:
    :class:`~node.runtime.output.SeqDelta` (``OutputState``) and
    :class:`~node.runtime.token_output.TokenDelta` (``TokenOutputState``, API front ends)."""
    parts = [first]
    more, lps = kept
    for j, tok in enumerate(more):
        if parts[-1].finish_reason is not None:
            break
        position += 1
        parts.append(state.on_token(tok, lps[j] if lps else None, position))
    if parts[-1].finish_reason is not None:
        del seq.token_ids[position + 1 :]
    if isinstance(first, SeqDelta):
        return SeqDelta.joined(parts)
    return TokenDelta(first.key, first.index, [t for p in parts for t in p.token_ids], parts[-1].finish_reason,
                      first.cached_tokens, [lp for p in parts for lp in p.logprobs], first.prompt_logprobs,
                      device=first.device)
