"""The engine's side of structured output: each sequence's matcher, and the step's token mask.

The mask of a sequence's next token depends on every token before it, the one the previous step
sampled included, so the earliest it can be computed is once that step's sampling is done. The
engine runs one step at a time, and the node keeps at most two in flight (the next step's message
waits in the channel with a placeholder token, :data:`~node.core.sequence.PENDING`, which the engine
fills in itself): when step ``N + 1`` starts here, step ``N``'s token is already in the sequence.

The mask is filled in the step's own thread, at the runner's join point: after the forward pass and
the logits are launched, before the logits are read (:meth:`GrammarMasks.start` returns a
:class:`PendingMask` the runner resolves there). On a GPU the forward's kernels are still running
then, so the fill overlaps them; on the CPU the forward has finished, and the fill follows it. A
mask thread was measured slower (``bench.load.structured``, a 2-core CPU): a small model's forward
holds the GIL between its short kernels, so the thread waited for the GIL and the step then waited
for the thread, each hand-off a context switch. The whole batch is filled in one xgrammar call into
a bitmask kept across steps (:class:`~node.worker.grammar.BitmaskFiller`). Matchers take the tokens
sampled since their last fill there too (not when the step that sampled them ends), so a step's
reply goes back to the node without waiting for them. A sequence's first sampled step compiles its
grammar there (a cache hit when the node already compiled it in this process).
"""

from __future__ import annotations

import structlog

from node.worker.grammar import BitmaskFiller, GrammarCache, GrammarError, SeqGrammar, grammar_cache
from node.worker.tokenizer import TextTokenizer

log = structlog.get_logger("shiftnode.grammar")


class GrammarMasks:
    """Per-engine grammar state: the compiled-grammar cache and the reused bitmask.

    Args:
        tokenizer: the model's tokenizer (the cache is built from it on first use, not before: an
            engine that never sees a grammar pays nothing).
        vocab_size: the model's logits width.
        stop_ids: the ids that end generation (EOS), allowed only where the grammar accepts.
    """

    def __init__(self, tokenizer: TextTokenizer, vocab_size: int, stop_ids: list[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = list(stop_ids)
        self._cache: GrammarCache | None = None
        self._filler = BitmaskFiller(vocab_size)

    @classmethod
    def for_model(cls, info) -> "GrammarMasks":
        """From a loaded model's :class:`~node.worker.loader.ModelInfo`: its tokenizer, logits width,
        and the stop ids the node ends sequences on (the tokenizer's EOS, else the config's)."""
        tok = info.tokenizer
        return cls(tok, info.cfg.vocab_size, tok.eos_token_ids or list(info.cfg.eos_token_ids))

    @property
    def cache(self) -> GrammarCache:
        if self._cache is None:
            self._cache = grammar_cache(self.tokenizer, self.vocab_size, self.stop_ids)
        return self._cache

    def start(self, seqs: list, num_rows: int) -> "PendingMask":
        """The mask of a step's grammar rows, to be filled when the runner asks for it.

        Args:
            seqs: ``[(row, state)]``: the sampled row of each sequence with a grammar, and its
                engine state (``params.grammar``, ``token_ids``, ``prompt_len``, ``grammar``: the
                :class:`SeqGrammar`, None until built here).
            num_rows: rows of the step's logits (its sampled sequences).

        Returns:
            A :class:`PendingMask`; its ``result()`` is ``(mask [>= num_rows, W] int32, rows)`` (rows:
            those masked, the only rows of the mask to read) or ``None`` when no row needs a mask.
        """
        return PendingMask(self, seqs)

    def fill(self, seqs: list):
        """Bring each sequence's matcher up to its tokens (built from them when it has none), then fill
        the mask of those whose grammar is still active: ``(mask, rows)``, or None when none is."""
        grammars, rows = [], []
        for row, s in seqs:
            g = s.grammar
            if g is None:  # new here, or its tokens were replaced: rebuilt from what it emitted
                g = s.grammar = SeqGrammar(self._compiled(s.params.grammar), [])
            g.catch_up(s.token_ids, s.prompt_len)
            if g.active:
                grammars.append(g)
                rows.append(row)
        if not rows:
            return None
        return self._filler.fill(grammars, rows), rows

    def _compiled(self, spec):
        """The compiled grammar, or None (logged) when it fails here after the node accepted it (a
        different xgrammar build in the engine's process): the sequence then runs unmasked rather
        than failing every sequence of the step."""
        try:
            return self.cache.get(spec)
        except GrammarError as e:
            log.error("grammar_compile_failed_in_engine", kind=spec.kind, error=str(e))
            return None



class PendingMask:
    """A step's grammar mask, filled on the first :meth:`result` (in the calling thread) and kept.

    ``result()`` raises what building a matcher raised (a grammar that fails to compile here is
    logged and runs unmasked instead, :meth:`GrammarMasks._compiled`)."""

    __slots__ = ("_masks", "_seqs", "_done", "_value")

    def __init__(self, masks: GrammarMasks, seqs: list):
        self._masks, self._seqs = masks, seqs
        self._done = False
        self._value = None

    def result(self):
        if not self._done:
            self._value = self._masks.fill(self._seqs)
            self._done = True
        return self._value
