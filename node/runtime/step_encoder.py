"""Turn a ``StepPlan`` into the diff its engine needs (:class:`~node.worker.engine_core.StepMsg`).

The encoder remembers, per sequence, what the engine holds: a reference to the node's token list
and block table as last sent, and their lengths as the engine has them. The node only ever appends
to these lists in place or replaces them with new lists (preemption, migration, a hand-off coming
back), so an identity check plus a length tells an append from a replacement in O(1), and a step
message carries what changed and nothing else.

Lengths: the engine appends each token it samples to its own copy; the node appends a placeholder
when it sends the step and writes the token over it when the reply comes. :meth:`StepEncoder.sent`
advances the engine-side length of the sampling sequences, so neither is sent back.
"""

from __future__ import annotations

from node.core.batcher import StepPlan
from node.worker.engine_core import NewSeq, SeqBlocks, SeqTokens, StepItem, StepMsg


def _diff(current: list[int], sent: list[int], sent_len: int) -> tuple[int, list[int]] | None:
    """``(keep, add)`` that turns the engine's copy (``sent``'s first ``sent_len`` entries) into
    ``current``: an append, a cut of the same list, or the whole list when it was replaced; ``None``
    when nothing changed."""
    if current is not sent:
        return 0, list(current)
    if len(current) < sent_len:  # truncated in place (a verify step's rejected blocks, node.core.spec_plan)
        return len(current), []
    if len(current) > sent_len:
        return sent_len, current[sent_len:]
    return None


class _Sent:
    __slots__ = ("tokens", "num_tokens", "blocks", "num_blocks")

    def __init__(self, tokens: list[int], blocks: list[int]):
        self.tokens, self.num_tokens = tokens, len(tokens)
        self.blocks, self.num_blocks = blocks, len(blocks)


class StepEncoder:
    """Per-device memory of the engine's state; encodes plans as diffs.

    Call :meth:`encode` with the plan and the ids of the sequences the device still holds, then
    :meth:`sent` once the message is handed to the engine, and :meth:`reset` when a step failed (the
    engine's state is then unknown: the next message rebuilds it).
    """

    def __init__(self) -> None:
        self.known: dict[str, _Sent] = {}
        self._reset = True
        self._msg: StepMsg | None = None  # the last message encoded, and the records of its sampling items
        self._sampling: list[_Sent] = []

    def reset(self) -> None:
        self.known.clear()
        self._reset = True

    def encode(self, plan: StepPlan, held: dict) -> StepMsg:
        """The message for ``plan``; ``held``: the sequence ids still on the device (a mapping).

        The per-sequence work of a decode step whose sequences the engine already holds is one
        :class:`StepItem` and two identity-plus-length tests (nothing changed: no diff); the sequences
        that left are found by one set difference of the key views, not a loop per known sequence."""
        known = self.known
        drop = list(known.keys() - held.keys()) if len(known) else []
        for sid in drop:
            del known[sid]
        items, new, tokens, blocks = [], [], [], []
        sampling = self._sampling = []
        for it in plan.items:
            s = it.seq
            sid = s.seq_id
            toks = s.token_ids
            start = s.num_computed
            n = it.num_tokens
            draft = it.draft  # a verify item's speculative tokens (node.core.spec_plan), after the last token
            sample = start + n - len(draft) == len(toks)  # it.samples
            # prompt logprobs: a prompt chunk of a sequence with no output yet (params not read for a decode)
            top = s.params.prompt_logprobs if start < s.prompt_len == len(toks) else None
            items.append(StepItem(sid, start, n, sample, -1 if top is None else top, list(draft))
                         if draft else StepItem(sid, start, n, sample, -1 if top is None else top))
            sent = known.get(sid)
            if sent is None:
                new.append(NewSeq(sid, list(toks), s.prompt_len, s.params, list(s.block_ids)))
                sent = known[sid] = _Sent(toks, s.block_ids)
            else:
                if toks is not sent.tokens or len(toks) != sent.num_tokens:
                    d = _diff(toks, sent.tokens, sent.num_tokens)
                    if d is not None:
                        tokens.append(SeqTokens(sid, *d))
                        sent.tokens, sent.num_tokens = toks, len(toks)
                bl = s.block_ids
                if bl is not sent.blocks or len(bl) != sent.num_blocks:
                    d = _diff(bl, sent.blocks, sent.num_blocks)
                    if d is not None:
                        blocks.append(SeqBlocks(sid, *d))
                        sent.blocks, sent.num_blocks = bl, len(bl)
            if sample:
                sampling.append(sent)
        msg = StepMsg(items, new, tokens, blocks, drop, self._reset)
        self._reset = False
        self._msg = msg
        return msg

    def accepted(self, seq_id: str, n: int) -> None:
        """A verify item's reply kept ``n`` tokens beyond its first: the engine appended them as well (a
        sequence forgotten since, by a reset, is sent whole with the next message anyway)."""
        sent = self.known.get(seq_id)
        if sent is not None:
            sent.num_tokens += n

    def sent(self, msg: StepMsg) -> None:
        """``msg`` went to the engine: each sampling item's token will be appended there (and here as
        a placeholder), so both sides' lengths advance by one."""
        if msg is self._msg:  # the last encoded message (always, from the step loop): its samplers are known
            for sent in self._sampling:
                sent.num_tokens += 1
            return
        known = self.known
        for it in msg.items:
            if it.sample:
                known[it.seq_id].num_tokens += 1
