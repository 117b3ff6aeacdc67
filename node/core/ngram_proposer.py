"""N-gram (prompt lookup) draft proposals: the tokens that followed the latest earlier occurrence of a
sequence's suffix in its own prompt and output (Saxena 2023, "Prompt Lookup Decoding"; vLLM's
``ngram`` method).

Outputs that copy spans of their prompt (summaries, code edits, extraction) repeat what came before;
the tokens after the last time the current suffix appeared are a free guess at what comes next. The
search is a byte search (``bytes.rfind``, in C) over the token ids packed as fixed-width 32-bit
integers: one pass per suffix length, no Python loop over positions.
"""

from __future__ import annotations

from array import array

_WIDTH = 4  # bytes per packed token id (array typecode "I": at least 32 bits, 4 on every platform we run)


def _packed(token_ids: list[int]) -> bytes:
    return array("I", token_ids).tobytes()


def propose_ngram(token_ids: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Draft tokens for the sequence ``token_ids`` (prompt then output, ids in ``[0, 2^32)``).

    For ``n`` from ``n_max`` down to ``n_min``: find the latest occurrence of the last ``n`` tokens
    that starts before the suffix itself and has at least one token after it; propose the up to ``k``
    tokens that followed it. The first ``n`` that matches wins (a longer match predicts better).

    Args:
        token_ids: the sequence so far.
        k: most tokens proposed (``k >= 0``).
        n_max, n_min: suffix lengths tried, ``1 <= n_min <= n_max``.

    Returns:
        between 0 and ``k`` token ids (empty: no suffix length matched, or ``k == 0``).
    """
    total = len(token_ids)
    if k <= 0 or total < n_min + 1:
        return []
    if _WIDTH != array("I").itemsize:  # pragma: no cover - a platform with 64-bit unsigned ints
        raise RuntimeError("array('I') is not 32-bit here")
    hay = _packed(token_ids)
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        needle = hay[(total - n) * _WIDTH:]
        # the match must end before the last token, so a token follows it: search in token_ids[:-1]
        end = (total - 1) * _WIDTH
        while True:
            at = hay.rfind(needle, 0, end)
            if at < 0:
                break
            if at % _WIDTH == 0:  # aligned: a real token match, not bytes straddling two ids
                start = at // _WIDTH + n
                return token_ids[start : start + k]
            end = at + len(needle) - 1  # an unaligned hit: look further left
    return []
