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

    def reset(self) -> None:
        self.known.clear()
        self._reset = True

    def encode(self, plan: StepPlan, held: dict) -> StepMsg:
        """The message for ``plan``; ``held``: the sequence ids still on the device (a mapping)."""
        known = self.known
        drop = [sid for sid in known if sid not in held]
        for sid in drop:
            del known[sid]
        items, new, tokens, blocks = [], [], [], []
        for it in plan.items:
            s = it.seq
            sid = s.seq_id
            p = s.params
            top = p.prompt_logprobs if (p.prompt_logprobs is not None and s.num_computed < s.prompt_len
                                        and s.num_output == 0) else -1
            items.append(StepItem(sid, s.num_computed, it.num_tokens, it.samples, top))
            sent = known.get(sid)
            if sent is None:
                new.append(NewSeq(sid, list(s.token_ids), s.prompt_len, p, list(s.block_ids)))
                known[sid] = _Sent(s.token_ids, s.block_ids)
                continue
            toks = s.token_ids
            if toks is not sent.tokens or len(toks) < sent.num_tokens:
                tokens.append(SeqTokens(sid, 0, list(toks)))
                sent.tokens, sent.num_tokens = toks, len(toks)
            elif len(toks) > sent.num_tokens:
                tokens.append(SeqTokens(sid, sent.num_tokens, toks[sent.num_tokens:]))
                sent.num_tokens = len(toks)
            bl = s.block_ids
            if bl is not sent.blocks or len(bl) < sent.num_blocks:
                blocks.append(SeqBlocks(sid, 0, list(bl)))
                sent.blocks, sent.num_blocks = bl, len(bl)
            elif len(bl) > sent.num_blocks:
                blocks.append(SeqBlocks(sid, sent.num_blocks, bl[sent.num_blocks:]))
                sent.num_blocks = len(bl)
        msg = StepMsg(items, new, tokens, blocks, drop, self._reset)
        self._reset = False
        return msg

    def sent(self, msg: StepMsg) -> None:
        """``msg`` went to the engine: each sampling item's token will be appended there (and here as
        a placeholder), so both sides' lengths advance by one."""
        known = self.known
        for it in msg.items:
            if it.sample:
                known[it.seq_id].num_tokens += 1
