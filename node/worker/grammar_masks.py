"""The engine's side of structured output: each sequence's matcher, and the step's token mask filled
in a thread while the step's forward pass runs.

The mask of a sequence's next token depends on every token before it, the one the previous step
sampled included, so the earliest it can be computed is once that step's sampling is done. The
engine runs one step at a time, and the node keeps at most two in flight (the next step's message
waits in the channel with a placeholder token, :data:`~node.core.sequence.PENDING`, which the engine
fills in itself): when step ``N + 1`` starts here, step ``N``'s token is already accepted by the
matcher, so the mask is filled on a worker thread *during* step ``N + 1``'s forward pass (torch
releases the GIL in its kernels) and joined just before sampling. A sequence's first sampled step
also compiles its grammar there (a cache hit when the node already compiled it in this process).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import structlog

from node.worker.grammar import GrammarCache, GrammarError, SeqGrammar, fill_masks, grammar_cache
from node.worker.tokenizer import TextTokenizer

log = structlog.get_logger("shiftnode.grammar")


class GrammarMasks:
    """Per-engine grammar state: the compiled-grammar cache and the mask thread.

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
        self._pool: ThreadPoolExecutor | None = None

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

    def start(self, seqs: list, num_rows: int) -> Future:
        """Begin filling the mask of a step's grammar rows on the mask thread.

        Args:
            seqs: ``[(row, state)]``: the sampled row of each sequence with a grammar, and its
                engine state (``params.grammar``, ``token_ids``, ``prompt_len``, ``grammar``: the
                :class:`SeqGrammar`, None until built here).
            num_rows: rows of the step's logits (its sampled sequences).

        Returns:
            A future of ``(mask [num_rows, W] int32, rows)`` (rows: those masked) or of ``None`` when
            no row needs a mask; it raises what compiling raised.
        """
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        return self._pool.submit(self._fill, seqs, num_rows)

    def _fill(self, seqs: list, num_rows: int):
        grammars, rows = [], []
        for row, s in seqs:
            g = s.grammar
            if g is None:  # new here, or its tokens were replaced: rebuild from what it emitted
                g = s.grammar = SeqGrammar(self._compiled(s.params.grammar), s.token_ids[s.prompt_len :])
            if g.active:
                grammars.append(g)
                rows.append(row)
        if not rows:
            return None
        return fill_masks(grammars, rows, num_rows, self.vocab_size), rows

    def _compiled(self, spec):
        """The compiled grammar, or None (logged) when it fails here after the node accepted it (a
        different xgrammar build in the engine's process): the sequence then runs unmasked rather
        than failing every sequence of the step."""
        try:
            return self.cache.get(spec)
        except GrammarError as e:
            log.error("grammar_compile_failed_in_engine", kind=spec.kind, error=str(e))
            return None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
