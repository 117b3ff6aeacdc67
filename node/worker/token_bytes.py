"""A token's raw bytes and its name in logprob listings, for tokens that are not whole characters.

A byte-fallback token (sentencepiece ``<0xE2>``) or a byte-level BPE piece that holds part of a UTF-8
character decodes alone to U+FFFD, so several such tokens had the same text: their ``top_logprobs``
keys collided (a dict keeps one of them) and the chat ``bytes`` field was the UTF-8 of U+FFFD instead
of the token's own bytes. As OpenAI's API does, ``bytes`` is the token's raw bytes, and a token that
is not valid UTF-8 on its own is named ``bytes:\\xe2\\x80`` (its bytes, escaped) so that names stay
distinct.
"""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from node.worker.tokenizer import TextTokenizer

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: printable stand-in character → byte (the bytes that are
    printable Latin-1 stand for themselves, the others are shifted past 255)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def token_bytes(tok: "TextTokenizer", token_id: int) -> bytes:
    """The raw bytes token ``token_id`` stands for: a byte-fallback token's byte, a byte-level BPE
    piece's bytes, else the UTF-8 of its text (:meth:`TextTokenizer.token_text`)."""
    text = tok.token_text(token_id)
    if "\ufffd" not in text:
        return text.encode("utf-8")
    piece = tok.id_to_token(token_id)
    m = _BYTE_FALLBACK.fullmatch(piece)
    if m:
        return bytes([int(m.group(1), 16)])
    table = _byte_decoder()
    if piece and all(c in table for c in piece):
        return bytes(table[c] for c in piece)
    return text.encode("utf-8")  # a real U+FFFD, or a scheme not known here


def logprob_token(tok: "TextTokenizer", token_id: int) -> str:
    """The token's name in logprob listings: its text, or ``bytes:`` and its escaped bytes when those
    are not valid UTF-8 on their own (distinct names for the pieces of one character)."""
    raw = token_bytes(tok, token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
