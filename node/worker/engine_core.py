"""The engine side of a device: persistent per-sequence state, fed by diffs, running the model runner.

The node's :class:`~node.runtime.engine.DeviceEngine` decides what each step computes (the pure
``Batcher``); this module holds what the model needs to compute it, so a step message carries only
what changed since the last one (vLLM's "cached requests" scheduler output does the same):

* sequences new to this engine, with their token ids, prompt length and sampling parameters;
* token ids a known sequence gained other than by this engine's own sampling (a recompute that
  continues tokens a peer streamed), or a replaced token list;
* block ids appended to a sequence's block table, or a replaced table (preemption, migration);
* sequences that left the device;
* per scheduled sequence: position of its first new token, number of new tokens, whether the step
  samples, prompt logprobs wanted.

The engine appends every token it samples to its own copy of the sequence, so a decode step's input
costs the node nothing beyond the item itself: the message is O(changes), not O(context).

:class:`EngineCore` is the same object in both engine layouts (``--engine-layout``): called in the
engine's own thread of the node's process (``thread``, :class:`~node.worker.local_engine.LocalEngine`)
or inside the device's engine process (:mod:`node.worker.engine_process`).
"""

from __future__ import annotations

import itertools
import time

import msgspec

from node.core.sequence import SamplingParams
from node.core.spec_plan import PROPOSED_IN_ENGINE
from node.worker.background_compile import CompileState
from node.worker.draft_model import DraftModel, DraftRequest
from node.worker.grammar_masks import GrammarMasks
from node.worker.role_layouts import GroupLayouts
from node.worker.runner import ModelRunner, SeqInput, SeqOutput, StepInput
from node.worker.sampler import SampleRequest, TokenLogprobs
from node.worker.timed_step import step_work


class NewSeq(msgspec.Struct, array_like=True):
    """A sequence the engine does not know yet (or whose state the node resets)."""

    seq_id: str
    token_ids: list[int]
    prompt_len: int
    params: SamplingParams
    block_ids: list[int]


class SeqTokens(msgspec.Struct, array_like=True):
    """Keep the first ``keep`` token ids of a known sequence, then append ``add``."""

    seq_id: str
    keep: int
    add: list[int]


class SeqBlocks(msgspec.Struct, array_like=True):
    """Keep the first ``keep`` entries of a known sequence's block table, then append ``add``."""

    seq_id: str
    keep: int
    add: list[int]


class StepItem(msgspec.Struct, array_like=True):
    """One scheduled sequence: compute tokens ``start .. start + num_tokens - 1``; ``sample`` draws the
    next token; ``prompt_top >= 0`` asks for prompt logprobs with that many alternatives. ``draft``
    (a verify item): the last ``len(draft)`` of the ``num_tokens`` are these speculative tokens, not yet
    the sequence's; each is verified (:mod:`node.worker.spec_verify`) and the kept ones are appended. Slots
    of :data:`~node.core.spec_plan.PROPOSED_IN_ENGINE` are proposed by the engine's draft model first."""

    seq_id: str
    start: int
    num_tokens: int
    sample: bool
    prompt_top: int = -1
    draft: list[int] = []


class StepMsg(msgspec.Struct, tag="step"):
    """One step, as a diff against the engine's state. ``reset`` drops every sequence first.

    ``instances`` (a *composite* step of a time-shared group prefilling as several instances,
    :mod:`node.worker.role_layouts`): the instance each item runs on, in item order; each rank
    computes its own instance's items only. ``rng_seed``: the unseeded-sampling generator of every
    rank restarts from it after a composite step (instance ``s`` samples from ``rng_seed + 1 + s``
    during it), so the ranks' generators agree again for the group's next step."""

    items: list[StepItem]
    new: list[NewSeq] = []
    tokens: list[SeqTokens] = []
    blocks: list[SeqBlocks] = []
    drop: list[str] = []
    reset: bool = False
    instances: list[int] = []
    rng_seed: int = 0


class StepReply(msgspec.Struct, tag="step", omit_defaults=True):
    """Outputs of a step, one per item, in item order; ``busy_s``: the engine's own time for the
    step (applying the diff, building inputs, forward, sampling), in seconds; ``compile``: the compiled
    buckets when they changed since the last reply (a bucket compiled in the background; else None, left
    off the wire). A step with verify items (items with a ``draft``) also has, per item in item order,
    the tokens kept after its first (``kept``: 0 to ``len(draft)``, empty for other items) and their
    logprobs when asked (``kept_logprobs``); both are empty lists in every other step. ``grammar_in_step``:
    grammars this step compiled or matchers it rebuilt itself (arrivals the node did not prepare:
    :attr:`~node.worker.grammar_masks.GrammarMasks.in_step`; 0, left off the wire, when none)."""

    outputs: list[SeqOutput]
    busy_s: float = 0.0
    compile: CompileState | None = None
    kept: list[list[int]] = []
    kept_logprobs: list[list[TokenLogprobs]] = []
    grammar_in_step: int = 0


class _SeqState:
    __slots__ = ("token_ids", "prompt_len", "params", "block_ids", "grammar")

    def __init__(self, new: NewSeq):
        self.token_ids = new.token_ids
        self.prompt_len = new.prompt_len
        self.params = new.params
        self.block_ids = new.block_ids
        self.grammar = None  # SeqGrammar: prepared for an arrival (EngineCore.apply), else built when first sampled

    def append(self, token_id: int) -> None:
        """A token this engine sampled (the grammar matcher, if any, takes it when it next fills a mask:
        :meth:`~node.worker.grammar_masks.GrammarMasks.fill`)."""
        self.token_ids.append(token_id)


class EngineCore:
    """Per-sequence state plus the model runner of one device.

    Args:
        runner: the device's :class:`ModelRunner` (weights, KV pool).
        layouts: a time-shared group rank's decode and prefill layouts (None otherwise).
        grammars: the structured-output state (:class:`GrammarMasks`); None: sequences are unmasked.
        draft: the draft model (``--speculative-config`` with ``"model"``, :mod:`node.worker.draft_model`),
            which fills verify items' :data:`~node.core.spec_plan.PROPOSED_IN_ENGINE` slots; None: no such slots.

    Errors: :meth:`step` raises ``KeyError`` for a diff that names a sequence the engine does not
    hold (the node then resets the engine's state with its next message), and whatever the runner
    raises; state changes of the message are kept (they describe the node's state, which is true
    whether the step ran or not), tokens are appended only by a step that completed.
    """

    def __init__(self, runner: ModelRunner, layouts: GroupLayouts | None = None, grammars: GrammarMasks | None = None,
                 draft: DraftModel | None = None):
        self.runner = runner
        self.draft = draft
        if draft is not None:  # a background compile parks while the draft's steps run too (background_compile)
            draft.runner.gate = runner.gate
        self.layouts = layouts  # a time-shared group's rank: its decode and prefill layouts
        self.grammars = grammars  # structured output (node.worker.grammar_masks); None: a spec is ignored
        self.seqs: dict[str, _SeqState] = {}
        self.pacer = getattr(runner, "pacer", None)  # ModelRunner.pacer (a timed device), else None

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    @property
    def kv_cache(self):
        return self.runner.kv_cache

    def apply(self, msg: StepMsg) -> None:
        """Bring the per-sequence state up to date with the node's (the diff part of ``msg``)."""
        seqs = self.seqs
        draft = self.draft
        if msg.reset:
            seqs.clear()
            if draft is not None:
                draft.clear()
        for sid in msg.drop:
            seqs.pop(sid, None)
            if draft is not None:
                draft.forget(sid)
        grammars = self.grammars
        for new in msg.new:
            s = seqs[new.seq_id] = _SeqState(new)
            if grammars is not None and new.params.grammar is not None:  # its matcher, if the node prepared it
                s.grammar = grammars.arrived(new.seq_id, new.params.grammar, new.token_ids, new.prompt_len)
            if draft is not None:  # an arrival (or a reset sequence): its draft KV is recomputed
                draft.forget(new.seq_id)
        for t in msg.tokens:
            s = seqs[t.seq_id]
            del s.token_ids[t.keep:]
            s.token_ids.extend(t.add)
            s.grammar = None  # tokens came from elsewhere: the matcher is rebuilt from them
            if draft is not None:
                draft.cut(t.seq_id, t.keep)
        for b in msg.blocks:
            s = seqs[b.seq_id]
            del s.block_ids[b.keep:]
            s.block_ids.extend(b.add)
            if draft is not None:  # blocks past ``keep`` may be another sequence's by now
                draft.cut(b.seq_id, b.keep * self.runner.block_size)

    def step(self, msg: StepMsg) -> StepReply:
        """Apply the diff, run the forward pass and sampling over the items, append sampled tokens. On a
        timed device (``runner.pacer``) the step then sleeps out the rest of its modelled time, counted
        from the start of this call, so applying the diff and sampling count toward it
        (:mod:`node.worker.timed_step`)."""
        t0 = time.perf_counter()
        grammars = self.grammars
        before = grammars.in_step if grammars is not None else 0
        reply = self._step(msg, t0)
        if grammars is not None and grammars.in_step != before:
            reply.grammar_in_step = grammars.in_step - before
        return reply

    def _step(self, msg: StepMsg, t0: float) -> StepReply:
        self.apply(msg)
        if msg.instances:
            return self._composite_step(msg, t0)
        seqs = self.seqs
        if any(it.draft and it.draft[0] == PROPOSED_IN_ENGINE for it in msg.items):
            self._propose(msg.items)
        step = self._step_input(msg.items)
        outs = self.runner.execute(step)
        pacer = self.pacer
        if pacer is not None:  # a timed benchmark device: the step lasts the cost model's time from t0
            pacer.finish(t0, step_work(msg.items, {it.seq_id: seqs[it.seq_id].prompt_len for it in msg.items}))
        ordered = [outs[it.seq_id] for it in msg.items]
        for it, out in zip(msg.items, ordered):
            if out.token_id is not None:
                seqs[it.seq_id].append(out.token_id)
        bg = getattr(self.runner, "background", None)  # buckets compiling while serving (background_compile)
        update = bg.take_update() if bg is not None else None
        if step.spec:  # verify items: the tokens kept after the first (node.worker.spec_verify)
            return self._verified(msg.items, ordered, t0, update)
        return StepReply(ordered, time.perf_counter() - t0, update)

    def _propose(self, items: list[StepItem]) -> None:
        """Fill the verify items' :data:`~node.core.spec_plan.PROPOSED_IN_ENGINE` slots with the draft
        model's tokens, in one batch (:meth:`DraftModel.propose`).

        Raises:
            RuntimeError: this engine has no draft model (the node and engine disagree on the method).
        """
        if self.draft is None:
            raise RuntimeError("a step asks for draft-model drafts but this engine loaded no draft model")
        asked = [it for it in items if it.draft and it.draft[0] == PROPOSED_IN_ENGINE]
        seqs = self.seqs
        got = self.draft.propose([DraftRequest(it.seq_id, seqs[it.seq_id].token_ids, seqs[it.seq_id].block_ids,
                                               len(it.draft)) for it in asked])
        for it, d in zip(asked, got):
            it.draft = d

    def _verified(self, items: list[StepItem], ordered: list[SeqOutput], t0: float, update: CompileState | None) -> StepReply:
        """The reply of a step with verify items: each one's further kept tokens appended to its sequence
        and listed in the reply, per item (:attr:`StepReply.kept`)."""
        kept, lps = [], []
        draft = self.draft
        for it in items:
            more, more_lps = self.runner.kept.get(it.seq_id, ([], []))
            s = self.seqs[it.seq_id]
            if draft is not None and it.draft:  # the kept drafts' draft KV is the draft model's own
                draft.verified(it.seq_id, it.start + 1, len(it.draft), len(more))
            for t in more:
                s.append(t)
            kept.append(more)
            lps.append(more_lps)
        return StepReply(ordered, time.perf_counter() - t0, update, kept, lps)

    def _step_input(self, items: list[StepItem]) -> StepInput:
        """The runner's input for ``items``, with the grammar rows' pending mask (filled when the runner
        joins it, after launching the forward pass: :mod:`node.worker.grammar_masks`)."""
        inputs = self._inputs(items)
        spec = any(it.draft for it in items)
        masks = None
        if self.grammars is not None:
            rows = [s for s in inputs if s.sample is not None]
            # a verify item samples 1 + len(draft) rows (node.worker.runner): number the mask rows over them all
            first = list(itertools.accumulate((1 + len(s.draft) for s in rows), initial=0)) if spec else range(len(rows))
            constrained = [(first[r], self.seqs[s.seq_id]) for r, s in enumerate(rows) if s.sample.params.grammar is not None]
            if constrained:
                masks = self.grammars.start(constrained, first[-1] if spec else len(rows))
        return StepInput(inputs, masks, spec)

    def _inputs(self, items: list[StepItem]) -> list[SeqInput]:
        seqs = self.seqs
        inputs = []
        for it in items:
            s = seqs[it.seq_id]
            toks = s.token_ids
            start, n = it.start, it.num_tokens
            sample = SampleRequest(s.params, toks, s.prompt_len, len(toks) - s.prompt_len) if it.sample else None
            targets: list[int] = []
            top = 0
            if it.prompt_top >= 0 and start < s.prompt_len and len(toks) == s.prompt_len:
                # Rows start..start+n-1 predict tokens start+1..start+n (within the prompt).
                targets = toks[start + 1 : min(start + n + 1, s.prompt_len)]
                top = it.prompt_top
            d = it.draft
            ids = toks[start : start + n] if not d else toks[start : start + n - len(d)] + d
            inputs.append(SeqInput(it.seq_id, ids, start, s.block_ids, sample, targets, top, d))
        return inputs

    def _composite_step(self, msg: StepMsg, t0: float) -> StepReply:
        """A step of several instances (``msg.instances``): compute this rank's instance's items, then
        learn every item's sampled token from the group (:meth:`GroupLayouts.merge_tokens`). Items of
        other instances get an output with their token only (their logprobs are in the reply of their
        instance's first rank).

        Raises:
            RuntimeError: this engine is not a group rank in its prefill layout of several instances.
        """
        lay = self.layouts
        if lay is None or not lay.composite:
            raise RuntimeError("a step of several instances reached an engine not in a prefill layout of several")
        mine = [it for it, s in zip(msg.items, msg.instances) if s == lay.instance]
        gen = self.runner.generator
        gen.manual_seed(msg.rng_seed + 1 + lay.instance)
        outs = self.runner.execute(self._step_input(mine)) if mine else {}
        gen.manual_seed(msg.rng_seed)
        own = [-1 if (o := outs.get(it.seq_id)) is None or o.token_id is None else o.token_id for it in msg.items]
        merged = lay.merge_tokens(own, self.runner.device)
        ordered = []
        for it, token in zip(msg.items, merged):
            out = outs.get(it.seq_id)
            if out is None:
                out = SeqOutput(token_id=None if token < 0 else token)
            ordered.append(out)
            if token >= 0:
                self.seqs[it.seq_id].append(token)
        return StepReply(ordered, time.perf_counter() - t0)

    def warm_up(self) -> None:
        """Run a 2-token prefill and a decode step on the first blocks once, before serving, so the
        first request does not pay kernel compilation (numba, triton) or first-call allocations. The
        blocks (as many as 3 tokens need: one, unless ``--block-size`` is below 3) hold nothing of
        anyone's: every sequence writes its positions before it reads them. With a draft model a verify
        step of one draft follows (its proposal and the target's check: 5 tokens' blocks)."""
        params = SamplingParams(max_tokens=2, temperature=0.0)
        blocks = list(range(-(-(3 if self.draft is None else 5) // self.runner.block_size)))
        seqs = {"warm-up": _SeqState(NewSeq("warm-up", [1, 2], 2, params, blocks))}
        saved, self.seqs = self.seqs, seqs
        try:
            self.step(StepMsg([StepItem("warm-up", 0, 2, True)]))
            self.step(StepMsg([StepItem("warm-up", 2, 1, True)]))
            if self.draft is not None:
                self.step(StepMsg([StepItem("warm-up", 3, 2, True, draft=[PROPOSED_IN_ENGINE])]))
        finally:
            self.seqs = saved
            if self.draft is not None:
                self.draft.forget("warm-up")

    def prepare_decode(self) -> float:
        """The decode role's reconfiguration (:meth:`ModelRunner.prepare_decode`); capture ms."""
        return self.runner.prepare_decode()
