"""Bound the ``tokenizers`` word cache where its "words" are whole prompts.

The BPE and Unigram models of Hugging Face ``tokenizers`` keep a cache of encoded words: up to 10,000
entries, each word of up to 256 characters (longer ones are not cached), never evicted. After
pre-tokenization a word is normally short ("▁park"), so the cache is small and hits often. A tokenizer
with no pre-tokenizer (the Llama 2 / llama2.c conversions, stories260k among them: only a normalizer
that turns spaces into ``▁``) or one that does not split (``Metaspace(split=False)``) hands the model
the whole text as one word. Then every distinct prompt of up to 256 characters becomes an entry, and
rarely hits again.

Measured (tokenizers 0.23.3, stories260k, prompts of 8-40 random words, ~105 characters): ~4.9 KB of
native memory per cached prompt, so up to ~48 MB before the cache is full. This is outside
``tracemalloc`` and the Python heap. Encoding runs in the executor threads (``off_loop``), so it landed
in glibc's per-thread arenas. It was the steady growth of the soak's node process (bench/RESULTS.md,
issue 32 item 8). Encoding a distinct prompt costs the same with or without the cache (~0.2-0.4 ms,
noise on a loaded 2-core machine). A repeated prompt costs about half with it. So the cache is kept,
with :data:`WHOLE_TEXT_CACHE_ENTRIES` entries (at most ~3 MB even at 256 characters each).
"""

from __future__ import annotations

from typing import Any

WHOLE_TEXT_CACHE_ENTRIES = 256
"""Cache capacity (entries) for a tokenizer whose pre-tokenization leaves a text whole: recent
identical prompts still hit, and memory stays at most ~3 MB (256 entries of <= 256 characters,
~12 KB each at the measured ~46 B a character)."""

_PROBE = "a b c"  # three words: a pre-tokenizer that splits on spaces returns three pieces


def keeps_text_whole(tok: Any) -> bool:
    """True when ``tok`` (a ``tokenizers.Tokenizer``) gives its model a multi-word text as one word:
    no pre-tokenizer, or one that returns a single piece for ``"a b c"`` after normalization."""
    pre = tok.pre_tokenizer
    if pre is None:
        return True
    norm = tok.normalizer
    text = norm.normalize_str(_PROBE) if norm is not None else _PROBE
    return len(pre.pre_tokenize_str(text)) <= 1


def bound_word_cache(tok: Any, entries: int = WHOLE_TEXT_CACHE_ENTRIES) -> bool:
    """Resize the model's word cache of ``tok`` to ``entries`` when its words are whole texts
    (:func:`keeps_text_whole`) and the model has a cache (BPE, Unigram). Returns whether it did."""
    resize = getattr(tok.model, "_resize_cache", None)
    if resize is None or not keeps_text_whole(tok):
        return False
    resize(entries)
    return True
