"""Builds OpenAI response bodies from accumulated choice state (completions and chat, whole or chunked)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from node.worker.sampler import TokenLogprobs
from node.worker.token_bytes import logprob_token, token_bytes
from node.worker.tokenizer import IncrementalDetokenizer, TextTokenizer


@dataclass
class RequestEcho:
    """A completions prompt as ``echo`` returns it: its token ids and its text."""

    prompt_ids: list[int]
    text: str


@dataclass
class ChoiceState:
    """Text, tokens and logprobs of one choice as they accumulate.

    The text is kept as a list of the deltas' pieces (:meth:`add_text`) and joined when read
    (:attr:`text`): ``text += piece`` on an attribute copies the whole text each time (the string has
    a second reference, so CPython cannot grow it in place), which is quadratic in the output length.
    """

    index: int
    parts: list[str] = field(default_factory=list)  # the text's pieces, in order (read it as ``text``)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    finish_reason: str | None = None
    text_offset: int = 0  # characters before the next token (completions logprobs)
    detok: IncrementalDetokenizer | None = None  # token strings for completions logprobs

    def add_text(self, piece: str) -> None:
        """Append ``piece`` to the choice's text (amortized O(len(piece)))."""
        if piece:
            self.parts.append(piece)

    @property
    def text(self) -> str:
        """The text so far: the pieces joined once, then kept as one piece (O(total length))."""
        if len(self.parts) > 1:
            self.parts[:] = ["".join(self.parts)]
        return self.parts[0] if self.parts else ""


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI ``usage``: token counts, with ``prompt_tokens_details.cached_tokens`` the prompt tokens
    taken from the prefix cache instead of computed (never more than ``prompt_tokens``)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": min(cached_tokens, prompt_tokens)}}


def token_name(tok: TextTokenizer, token_id: int, as_ids: bool = False) -> str:
    """A token's name in logprob listings: its text, ``bytes:\\xNN`` for a partial character
    (:func:`logprob_token`), or ``token_id:N`` with ``as_ids`` (vLLM's ``return_tokens_as_token_ids``)."""
    return f"token_id:{token_id}" if as_ids else logprob_token(tok, token_id)


def completion_logprobs(tok: TextTokenizer, entries: list[TokenLogprobs | None], token_ids: list[int],
                        detok: IncrementalDetokenizer, offset0: int, as_ids: bool = False) -> tuple[dict, int]:
    """Legacy completions logprobs ``{tokens, token_logprobs, top_logprobs, text_offset}``.

    Token strings come from ``detok`` (the choice's running detokenizer), so they concatenate to the
    returned text and ``text_offset`` indexes into it, except a token that is part of a character (a
    byte-fallback piece): it is named ``bytes:\\xNN`` as vLLM names it (in ``top_logprobs`` too), and
    its ``text_offset`` is where its character's text begins. ``entries[i] is None`` marks the first
    prompt token under echo (it has no logprob). ``as_ids``: tokens and ``top_logprobs`` keys are ``token_id:N`` (the text offsets
    still count the text). Returns the body and the text offset after the last token.
    """
    tokens, lps, tops, offsets = [], [], [], []
    off = offset0
    for tid, e in zip(token_ids, entries):
        text = detok.add(tid)
        name = token_name(tok, tid, as_ids)
        # a partial character's token is named by its bytes (vLLM's bytes:\xNN), as in top_logprobs;
        # any other by the text it adds, so such tokens join to the text
        tokens.append(name if as_ids or name.startswith("bytes:") else text)
        offsets.append(off)
        off += len(text)
        lps.append(None if e is None else e.logprob)
        # distinct keys; the chosen token's is its string above (one decoding for both)
        tops.append(None if e is None else {(tokens[-1] if t == tid else token_name(tok, t, as_ids)): lp for t, lp in e.top})
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}, off


def chat_logprobs(tok: TextTokenizer, entries: list[TokenLogprobs], as_ids: bool = False) -> dict:
    """Chat logprobs ``{"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}`` (``as_ids``:
    tokens named ``token_id:N``)."""
    def item(t: int, lp: float) -> dict:  # bytes: the token's own (part of a character's), not U+FFFD's
        return {"token": token_name(tok, t, as_ids), "logprob": lp, "bytes": list(token_bytes(tok, t))}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]}


def envelope(kind: str, request_id: str, model: str, created: int | None = None) -> dict:
    return {"id": request_id, "object": kind, "created": created or int(time.time()), "model": model}


def prompt_logprobs_body(tok: TextTokenizer, prompt_ids: list[int], entries: list[TokenLogprobs | None],
                         as_ids: bool = False) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: ``None`` for the first prompt token (nothing predicts it), then per
    token a dict keyed by **token id** (as a string; never by text, so partial characters stay apart) of
    ``{logprob, rank, decoded_token}`` for the prompt's own token and its top alternatives. ``rank``:
    1-based position among the alternatives, None for a prompt token outside them."""
    out: list[dict | None] = [None]
    for tid, e in zip(prompt_ids[1:], entries):
        if e is None:
            out.append(None)
            continue
        ranks = {t: r for r, (t, _) in enumerate(e.top, 1)}
        row = {str(tid): {"logprob": e.logprob, "rank": ranks.get(tid), "decoded_token": token_name(tok, tid, as_ids)}}
        for t, lp in e.top:
            row.setdefault(str(t), {"logprob": lp, "rank": ranks[t], "decoded_token": token_name(tok, t, as_ids)})
        out.append(row)
    return out
