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
reply goes back to the node without waiting for them.

No step builds the vocabulary's tables or compiles a grammar when the node asked first. The node asks
each engine to compile a request's grammar before queueing it (:meth:`GrammarMasks.prepare`, answered
at once while a thread works; :mod:`node.api.structured` polls). The first such ask also builds the
engine's :class:`~node.worker.grammar.GrammarCache` in a thread (:meth:`GrammarMasks.preload`:
importing xgrammar and scanning the vocabulary took 1.6-6 s on a 2-core CPU, a stall of every stream
on the device when the first structured request's step did it). It is not built at start-up: xgrammar
imports transformers, about 1.5 s of CPU per process, which a node that never serves structured
output should not pay at each start. A sequence placed on this engine any other way, or one that
arrives with output already emitted (moved, handed off, resumed here) is prepared the
same way, its matcher included: the node holds it out of the steps (``Sequence.grammar_wait``,
:mod:`node.runtime.grammar_gate`) while this engine's grammar thread compiles its grammar and replays
its emitted tokens into a new matcher (:meth:`GrammarMasks.prepare` with ``seq_id``); its first step
here takes that matcher (:meth:`GrammarMasks.arrived`). A step that still has to compile a grammar or
replay a matcher itself (a sequence nobody prepared) does it, and counts it (``in_step``).
"""

from __future__ import annotations

import concurrent.futures

import structlog

from node.core.grammar_spec import GrammarSpec
from node.log_native import native_stderr_to_log
from node.worker.grammar import (BitmaskFiller, GrammarCache, GrammarError, SeqGrammar, existing_grammar_cache,
                                 grammar_cache)
from node.worker.tokenizer import TextTokenizer

log = structlog.get_logger("shiftnode.grammar")


class GrammarMasks:
    """Per-engine grammar state: the compiled-grammar cache and the reused bitmask.

    Args:
        tokenizer: the model's tokenizer (the cache is built from it by :meth:`preload`, or on first use).
        vocab_size: the model's logits width.
        stop_ids: the ids that end generation (EOS), allowed only where the grammar accepts.

    ``in_step_compiles``: how many times a step had to build the cache or compile a grammar itself;
    ``in_step_rebuilds``: how many matchers a step had to rebuild from tokens emitted before it (a
    sequence that arrived unprepared); both zero when the node prepared every grammar and arrival first
    (:meth:`prepare`). ``in_step``: their sum.
    """

    MAX_ARRIVALS = 256  # matchers built for arriving sequences not taken yet (one moved on: dropped, oldest out)

    def __init__(self, tokenizer: TextTokenizer, vocab_size: int, stop_ids: list[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = list(stop_ids)
        self._cache: GrammarCache | None = None
        self._filler = BitmaskFiller(vocab_size)
        self._preload: concurrent.futures.Future | None = None
        self._compiles: dict[GrammarSpec, concurrent.futures.Future] = {}  # specs compiling (or failed)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._arrivals: dict[str, tuple] = {}  # seq id -> (spec, emitted, future of its SeqGrammar)
        self.in_step_compiles = 0
        self.in_step_rebuilds = 0

    @property
    def in_step(self) -> int:
        """Grammars compiled plus matchers rebuilt inside steps (see the class docstring)."""
        return self.in_step_compiles + self.in_step_rebuilds

    @classmethod
    def for_model(cls, info) -> "GrammarMasks":
        """From a loaded model's :class:`~node.worker.loader.ModelInfo`: its tokenizer, logits width,
        and the stop ids the node ends sequences on (the tokenizer's EOS, else the config's)."""
        tok = info.tokenizer
        return cls(tok, info.cfg.vocab_size, tok.eos_token_ids or list(info.cfg.eos_token_ids))

    @property
    def started(self) -> bool:
        """Whether the cache is built (or failed to build): :meth:`prepare` is then about the grammar itself."""
        return self._cache is not None or (self._preload is not None and self._preload.done())

    def _thread(self) -> concurrent.futures.ThreadPoolExecutor:
        """This engine's one grammar thread: the cache's build, then each grammar's compile, in that order."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        return self._pool

    def preload(self) -> concurrent.futures.Future:
        """Start building the cache in this engine's grammar thread (once); the future resolves to it
        (:func:`~node.worker.grammar.grammar_cache`: one cache per process and tokenizer)."""
        if self._preload is None:
            self._preload = self._thread().submit(grammar_cache, self.tokenizer, self.vocab_size, self.stop_ids)
        return self._preload

    @property
    def cache(self) -> GrammarCache:
        """The compiled-grammar cache; built here (in the caller's thread: counted in
        ``in_step_compiles`` when that is a step) if :meth:`preload` has not finished it."""
        if self._cache is None:
            key = (self.tokenizer, self.vocab_size, self.stop_ids)
            pending = self._preload is not None and not self._preload.done()
            if pending or (self._preload is None and existing_grammar_cache(*key) is None):
                self.in_step_compiles += 1
                log.warning("grammar_cache_built_in_step")
            self._cache = self._preload.result() if self._preload is not None else grammar_cache(*key)
        return self._cache

    def prepare(self, spec: GrammarSpec, seq_id: str = "", emitted: list[int] = ()) -> tuple[bool, str]:
        """Make ``spec``'s compiled grammar ready for a step, without waiting: ``(True, "")`` once it is in
        the cache, ``(False, "")`` while the cache is being built or the grammar compiles (in this
        engine's compile thread; ask again), ``(False, message)`` when it does not compile. Called
        between steps (the engine's message loop); never blocks on xgrammar.

        ``seq_id``: a sequence arriving here with ``emitted`` output token ids: ready only once its
        matcher has also been built from them in the compile thread (kept for :meth:`arrived`)."""
        ready, error = self._prepare_spec(spec)
        if not ready or not seq_id:
            return ready, error
        emitted = tuple(emitted)
        entry = self._arrivals.get(seq_id)
        if entry is None or entry[0] != spec or entry[1] != emitted:
            while len(self._arrivals) >= self.MAX_ARRIVALS:
                self._arrivals.pop(next(iter(self._arrivals)))
            entry = self._arrivals[seq_id] = (spec, emitted, self._thread().submit(self._replay, spec, emitted))
        fut = entry[2]
        if not fut.done():
            return False, ""
        return (True, "") if fut.exception() is None else (False, str(fut.exception()))

    def _replay(self, spec: GrammarSpec, emitted: tuple[int, ...]):
        """A new matcher of ``spec`` that has taken ``emitted`` (in the compile thread). The tokens were
        sampled elsewhere, not under this matcher's mask: xgrammar's matcher warns on the console about
        one it cannot take (a special token), so its lines become log lines here (:mod:`node.log_native`)."""
        grammar = self.cache.get(spec)
        with native_stderr_to_log():
            return SeqGrammar(grammar, list(emitted))

    def arrived(self, seq_id: str, spec: GrammarSpec, token_ids: list[int], prompt_len: int):
        """The matcher :meth:`prepare` built for ``seq_id``, if it is ready and was built from the start of
        this sequence's output (``token_ids``, its prompt the first ``prompt_len``); else None (the
        first step that samples it builds one: counted). The entry is dropped either way."""
        entry = self._arrivals.pop(seq_id, None)
        if entry is None:
            return None
        got, emitted, fut = entry
        if got != spec or not fut.done() or fut.exception() is not None:
            return None
        if tuple(token_ids[prompt_len : prompt_len + len(emitted)]) != emitted:
            return None
        return fut.result()

    def _prepare_spec(self, spec: GrammarSpec) -> tuple[bool, str]:
        """:meth:`prepare` for the compiled grammar alone."""
        pre = self.preload()
        if not pre.done():
            return False, ""
        if pre.exception() is not None:
            return False, f"the grammar engine did not start: {pre.exception()}"
        cache = self.cache
        if cache.cached(spec) is not None:
            self._compiles.pop(spec, None)
            return True, ""
        fut = self._compiles.get(spec)
        if fut is None:
            while len(self._compiles) >= 64:  # failed specs kept to answer again; bounded, oldest out
                self._compiles.pop(next(iter(self._compiles)))
            self._compiles[spec] = self._thread().submit(cache.get, spec)
            return False, ""
        if not fut.done():
            return False, ""
        error = fut.exception()
        if error is None:  # compiled, then evicted already (or too large to keep): a step compiles it again
            del self._compiles[spec]
            return True, ""
        return False, str(error)

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
            if g is None:  # new here and not prepared, or its tokens were replaced: rebuilt from what it emitted
                if len(s.token_ids) > s.prompt_len:
                    self.in_step_rebuilds += 1  # an arrival nobody prepared (GrammarMasks.prepare with seq_id)
                    log.debug("grammar_matcher_rebuilt_in_step", tokens=len(s.token_ids) - s.prompt_len)
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
            cache = self.cache
            hit = cache.cached(spec)
            if hit is not None:
                return hit
            self.in_step_compiles += 1  # not prepared here: moved, handed off or resumed onto this engine
            log.debug("grammar_compiled_in_step", kind=spec.kind)
            return cache.get(spec)
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
