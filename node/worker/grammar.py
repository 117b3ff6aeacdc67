"""Structured output on xgrammar: compiled grammars (cached), per-sequence matchers, token masks.

A :class:`~node.core.grammar_spec.GrammarSpec` is compiled against the model's vocabulary into an
``xgrammar.CompiledGrammar`` (a pushdown automaton with its token masks precomputed where they do not
depend on the stack). The node compiles a request's spec once to validate it (a 400 when it does not
compile or accepts nothing); each engine compiles it again from the same cache in its own process
(``--engine-layout thread`` shares the node's). :class:`GrammarCache` bounds the compiled grammars it
keeps, in entries and in bytes (``CompiledGrammar.memory_size_bytes``), least recently used first out.

:class:`SeqGrammar` is one sequence's matcher. It is built from the tokens the sequence has already
emitted, so a sequence that arrives on an engine part-way (a move, a hand-off, a resume) continues
exactly where the grammar stood. :class:`BitmaskFiller` (the engine's, one buffer kept across steps) and
:func:`fill_masks` (a fresh tensor) write the next-token bitmask of several matchers (``[rows,
ceil(V / 32)]`` int32, bit ``t`` of a row set when token ``t`` is allowed); the sampler
applies it with ``xgrammar.apply_token_bitmask_inplace`` (a masked logit becomes ``-inf``) on CPU
and CUDA alike. The stop tokens (EOS) are allowed only where the grammar accepts the text so far.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

import structlog
import torch
from shiftnode_kernels import cpu_bitmask_numba

from node.core.grammar_spec import GrammarSpec
from node.log_native import native_stderr_to_log
from node.worker.tokenizer import TextTokenizer

if TYPE_CHECKING:
    import xgrammar as xgr

log = structlog.get_logger("shiftnode.grammar")


def xgrammar():
    """The xgrammar module, imported on first use (it imports transformers: seconds a process, paid
    only by a process that sees a grammar)."""
    import xgrammar as module

    return module

MAX_ENTRIES = 512  # compiled grammars kept per process
MAX_BYTES = 256 << 20  # and their bytes (xgrammar's own accounting of a compiled grammar)


class GrammarError(ValueError):
    """A spec that does not compile, or that accepts no output at all. The message names the problem."""


def _clean(message: str) -> str:
    """xgrammar's C++ message without its ``[time] file.cc:line:`` prefix."""
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(message).strip()).strip()


def tokenizer_info(tok: TextTokenizer, vocab_size: int, stop_ids: list[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of ``tok``: each id's bytes (the vocabulary's encoding, byte-level or byte-fallback,
    is detected from the tokenizer's own description, as ``TokenizerInfo.from_huggingface`` does),
    ``vocab_size`` the model's logits width (the mask's width), ``stop_ids`` the tokens that end
    generation (allowed where the grammar accepts)."""
    from transformers import PreTrainedTokenizerFast  # xgrammar reads a Hugging Face fast tokenizer

    hf = PreTrainedTokenizerFast(tokenizer_object=tok._tok)
    with native_stderr_to_log():
        return xgrammar().TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=list(stop_ids) or None)


def _choice_ebnf(spec: str) -> str:
    """EBNF accepting exactly one of the strings of the JSON list ``spec`` (each a quoted literal)."""
    choices = json.loads(spec)
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise GrammarError("choice must be a non-empty list of non-empty strings")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class Compiled:
    """A compiled grammar and its size: ``grammar`` (``xgrammar.CompiledGrammar``), ``nbytes``."""

    __slots__ = ("grammar", "nbytes")

    def __init__(self, grammar: xgr.CompiledGrammar):
        self.grammar = grammar
        self.nbytes = int(grammar.memory_size_bytes)


class GrammarCache:
    """Compiles specs against one vocabulary and keeps the results, bounded (LRU).

    Args:
        info: the vocabulary (:func:`tokenizer_info`).
        max_entries, max_bytes: bounds on the grammars kept; an entry larger than ``max_bytes`` alone
            is returned but not kept.

    Thread-safe: the node compiles in an executor while engines (``--engine-layout thread``) read it. Two threads
    compiling the same key at once both compile (the second result replaces the first; no lock is
    held while compiling, so a slow compile never blocks a cached hit).
    """

    def __init__(self, info: xgr.TokenizerInfo, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES):
        self.info = info
        self.vocab_size = info.vocab_size
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        # xgrammar's own cache is off: this one is bounded in entries as well as bytes.
        self._compiler = xgrammar().GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self._entries: OrderedDict[GrammarSpec, Compiled] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def cached(self, spec: GrammarSpec) -> xgr.CompiledGrammar | None:
        """The compiled grammar of ``spec`` if the cache holds it (marked recently used), else None; never
        compiles, so it is cheap enough to call on the event loop."""
        with self._lock:
            hit = self._entries.get(spec)
            if hit is not None:
                self._entries.move_to_end(spec)
                return hit.grammar
        return None

    def get(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """The compiled grammar of ``spec`` (from the cache, else compiled and kept).

        Raises:
            GrammarError: the spec does not compile (the message says why), or it accepts no output.
        """
        hit = self.cached(spec)
        if hit is not None:
            return hit
        entry = Compiled(self._compile(spec))
        if not _accepts_something(entry.grammar, self.vocab_size):
            raise GrammarError(f"the {spec.kind} accepts no output at all")
        with self._lock:
            old = self._entries.pop(spec, None)
            if old is not None:
                self._bytes -= old.nbytes
            if entry.nbytes <= self.max_bytes:
                self._entries[spec] = entry
                self._bytes += entry.nbytes
                while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
                    _, out = self._entries.popitem(last=False)
                    self._bytes -= out.nbytes
        return entry.grammar

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        with native_stderr_to_log():  # xgrammar's C++ warnings (a dropped keyword) as log lines
            return self._compile_spec(spec)

    def _compile_spec(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        c = self._compiler
        try:
            if spec.kind == "json_schema":
                return c.compile_grammar(json_schema_ebnf(spec.spec))
            if spec.kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if spec.kind == "regex":
                return c.compile_regex(spec.spec)
            if spec.kind == "choice":
                return c.compile_grammar(_choice_ebnf(spec.spec))
            if spec.kind == "ebnf":
                return c.compile_grammar(spec.spec)
            if spec.kind == "structural_tag":
                return c.compile_structural_tag(spec.spec)
        except GrammarError:
            raise
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's parse and conversion errors
            raise GrammarError(f"the {spec.kind} does not compile: {_clean(e)}") from e
        raise GrammarError(f"unknown grammar kind {spec.kind!r}")


# xgrammar 0.2.9 writes a string with minLength/maxLength as a repetition of this class, which lets raw
# control characters U+0000-U+001F (but CR, LF) through, and JSON forbids them (xgrammar issue #800): the
# class is replaced by one that does not. (Escapes stay out of such strings, as xgrammar has them.)
_LOOSE_CHARS = '[^\\"\\\\\\r\\n]'
_JSON_CHARS = '[^\\0-\\x1f\\"\\\\]'


def json_schema_ebnf(schema: str) -> str:
    """The EBNF of a JSON schema as xgrammar converts it (compact JSON: no free whitespace, so a model
    cannot pad its output with endless blanks; no properties beyond the schema's), with length-bounded
    strings kept free of raw control characters."""
    ebnf = str(xgrammar().Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True))
    return ebnf.replace(_LOOSE_CHARS, _JSON_CHARS)


def _accepts_something(grammar: xgr.CompiledGrammar, vocab_size: int) -> bool:
    """Whether any token (a stop token included) is allowed at the start: false for a grammar whose
    language is empty (a regex of an empty class, a schema no value satisfies)."""
    with native_stderr_to_log():  # a matcher's own console warnings, as log lines
        m = xgrammar().GrammarMatcher(grammar)
        mask = xgrammar().allocate_token_bitmask(1, vocab_size)
        m.fill_next_token_bitmask(mask)
    return bool(mask.any())


_caches: dict[tuple[int, int, tuple[int, ...]], GrammarCache] = {}
_caches_lock = threading.Lock()
_build_lock = threading.Lock()  # one cache build at a time (lookups never wait for it)


def grammar_cache(tok: TextTokenizer, vocab_size: int, stop_ids: list[int]) -> GrammarCache:
    """This process's cache for one tokenizer object (the node and the engines of ``--engine-layout
    thread`` share one); built on first use (a large vocabulary takes a second or so to scan)."""
    key = (id(tok), vocab_size, tuple(stop_ids))
    with _caches_lock:
        cache = _caches.get(key)
    if cache is not None:
        return cache
    # built outside _caches_lock: the event loop's lookups (existing_grammar_cache, grammar_cache_status)
    # take it, and a build (xgrammar's import, seconds) held inside it stalled the loop for as long
    with _build_lock:
        with _caches_lock:
            cache = _caches.get(key)
        if cache is None:
            built = GrammarCache(tokenizer_info(tok, vocab_size, stop_ids))
            cpu_bitmask_numba.available()  # the CPU mask kernel compiled (or loaded) here, not in a masked step
            with _caches_lock:
                cache = _caches.setdefault(key, built)
    return cache


def existing_grammar_cache(tok: TextTokenizer, vocab_size: int, stop_ids: list[int]) -> GrammarCache | None:
    """The cache :func:`grammar_cache` would return, if it is already built (else None; building it
    scans the vocabulary, which a caller on the event loop must not do)."""
    with _caches_lock:
        return _caches.get((id(tok), vocab_size, tuple(stop_ids)))


def grammar_cache_status() -> dict:
    """This process's compiled-grammar caches together: ``entries``, ``bytes`` and their bounds (for
    ``GET /v1/node``)."""
    with _caches_lock:
        caches = list(_caches.values())
    return {"entries": sum(c.num_entries for c in caches), "bytes": sum(c.num_bytes for c in caches),
            "max_entries": MAX_ENTRIES, "max_bytes": MAX_BYTES}


class SeqGrammar:
    """One sequence's grammar matcher, rebuilt from the tokens it has already emitted.

    Args:
        grammar: the compiled grammar of the sequence's spec.
        emitted: the sequence's output tokens so far (empty for a new sequence).

    ``broken`` is set when a token the grammar does not allow was emitted (a sequence generated
    elsewhere without the grammar, or a degenerate row's fallback): the sequence is then no longer
    masked, and this is logged, rather than failing a whole step. ``consumed``: how many output tokens
    the matcher has taken (:meth:`accept` or :meth:`catch_up`), accepted or skipped. ``ended``: the
    grammar has terminated, which a matcher does only on accepting one of its stop tokens, so the
    matcher is asked (``is_terminated``) only then, and :attr:`active`, read twice a token, costs no
    call into xgrammar (each about 0.3-0.5 µs on this project's CPU).
    """

    __slots__ = ("matcher", "broken", "consumed", "ended", "stops")

    def __init__(self, grammar: xgr.CompiledGrammar | None, emitted: list[int]):
        self.matcher = None if grammar is None else xgrammar().GrammarMatcher(grammar)
        self.broken = grammar is None  # None: the engine could not compile it (logged by the caller)
        self.consumed = 0
        self.ended = False
        self.stops = frozenset(self.matcher.stop_token_ids) if self.matcher is not None else frozenset()
        for t in emitted:
            self.accept(t)

    @property
    def active(self) -> bool:
        """Whether the next token is masked (not after the grammar ended with a stop token)."""
        return not self.broken and not self.ended

    def catch_up(self, token_ids: list[int], prompt_len: int) -> None:
        """Accept the output tokens of ``token_ids`` (a sequence's tokens, its prompt the first
        ``prompt_len``) that this matcher has not consumed yet."""
        for i in range(prompt_len + self.consumed, len(token_ids)):
            self.accept(token_ids[i])

    def accept(self, token_id: int) -> None:
        """Advance over a sampled token (nothing after the grammar has terminated: a step already in
        flight when the stop token was sampled draws a token the node then drops)."""
        self.consumed += 1
        if self.broken or self.ended:
            return
        if not self.matcher.accept_token(token_id):
            self.broken = True
            log.warning("grammar_token_rejected", token_id=token_id)
        elif token_id in self.stops:
            self.ended = self.matcher.is_terminated()


def fill_masks(grammars: list[SeqGrammar], rows: list[int], num_rows: int, vocab_size: int) -> torch.Tensor:
    """The bitmask ``[num_rows, ceil(vocab_size / 32)]`` int32 (CPU) with row ``rows[i]`` filled from
    ``grammars[i]`` (other rows all ones: nothing masked): a new tensor each call, for callers outside
    the step loop (tests, benchmarks); the engine fills a reused one (:class:`BitmaskFiller`)."""
    mask = xgrammar().allocate_token_bitmask(num_rows, vocab_size)
    for g, r in zip(grammars, rows):
        g.matcher.fill_next_token_bitmask(mask, r)
    return mask


class BitmaskFiller:
    """Fills the next-token bitmask of a step's matchers into one buffer kept across steps.

    Args:
        vocab_size: the logits width (the mask covers ``ceil(vocab_size / 32)`` int32 words a row).

    :meth:`fill` writes only the rows it is given, with one call into xgrammar
    (``BatchGrammarMatcher.batch_fill_next_token_bitmask`` on one thread: no Python per row, and the GIL
    is released once for the whole batch); the buffer's other rows keep stale bits, so the mask must be
    applied with those rows as indices (:func:`apply_mask` does). Not thread-safe: one step at a time,
    and a step's mask is consumed (applied) before the next step fills the buffer again.
    """

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self._buf: torch.Tensor | None = None
        self._batch = None  # xgrammar.BatchGrammarMatcher, made on first use

    def fill(self, grammars: list[SeqGrammar], rows: list[int]) -> torch.Tensor:
        """The buffer ``[>= max(rows) + 1, ceil(V / 32)]`` int32 (CPU) with row ``rows[i]`` filled from
        ``grammars[i]``; only those rows are meaningful."""
        need = max(rows) + 1
        buf = self._buf
        if buf is None or buf.shape[0] < need:
            # grown to a power of two, never shrunk: a tensor xgrammar has seen is cheaper to pass again
            # than a fresh one (about 15 µs a step at one row)
            buf = self._buf = xgrammar().allocate_token_bitmask(1 << (need - 1).bit_length(), self.vocab_size)
        if self._batch is None:
            self._batch = xgrammar().BatchGrammarMatcher(1)
        self._batch.batch_fill_next_token_bitmask([g.matcher for g in grammars], buf, rows)
        return buf


def apply_mask(logits: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> None:
    """Set the disallowed logits of ``rows`` of ``logits [N, V]`` float32 to ``-inf`` in place. ``mask``
    ``[M, ceil(V / 32)]`` int32 with ``M >= max(rows) + 1``: only its ``rows`` are read (it may be the
    larger, reused buffer of :class:`BitmaskFiller`). On the CPU, the compiled loop of
    :mod:`shiftnode_kernels.cpu_bitmask_numba` (a tenth of xgrammar's CPU kernel's time on cached logits); elsewhere,
    or without Numba, xgrammar's kernel, the mask moved to the logits' device first (only its first
    ``max(rows) + 1`` rows)."""
    if logits.device.type == "cpu" and mask.device.type == "cpu" and cpu_bitmask_numba.apply_bitmask(logits, mask, rows):
        return
    if mask.device != logits.device:
        mask = mask[: max(rows) + 1].to(logits.device, non_blocking=True)
    xgrammar().apply_token_bitmask_inplace(logits, mask, vocab_size=logits.shape[1], indices=rows)
