"""Per-sequence output processing: stop conditions, incremental text with stop-string hold-back.

Text that could still become the start of a stop string is held back until it cannot (so a stream
never shows text that the final answer omits); a stop string that spans several tokens, or ends
mid-token, is found in the decoded text and cut off together with everything after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from node.core.sequence import Sequence
from node.worker.sampler import TokenLogprobs
from node.worker.tokenizer import IncrementalDetokenizer, TextTokenizer


@dataclass(slots=True)
class SeqDelta:
    """What one step adds to one choice: text, tokens (with logprobs when asked), maybe the end."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # echo: logprobs of prompt tokens 1..L-1
    cached_tokens: int | None = None  # on a choice's first token: prompt tokens found in the prefix cache
    # With ``error``: how the API answers it (HTTP status, OpenAI error code, Retry-After seconds).
    error_status: int = 500
    error_code: str | None = "internal_error"
    retry_after_s: float | None = None

    def then(self, later: "SeqDelta") -> "SeqDelta":
        """This delta followed by ``later`` of the same choice, as one (``--stream-interval``): text,
        tokens and logprobs concatenated; the end, error and cache count of whichever has them."""
        return SeqDelta(
            self.index, self.text + later.text, self.token_ids + later.token_ids, self.logprobs + later.logprobs,
            later.finish_reason or self.finish_reason, later.error or self.error,
            self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs,
            self.cached_tokens if self.cached_tokens is not None else later.cached_tokens,
            later.error_status, later.error_code, later.retry_after_s)

    @staticmethod
    def joined(parts: list["SeqDelta"]) -> "SeqDelta":
        """``parts`` (consecutive deltas of one choice, at least one) as one, as :meth:`then` would
        join them pairwise, in one pass (a slow client's held deltas: thousands of them)."""
        if len(parts) == 1:
            return parts[0]
        first, last = parts[0], parts[-1]
        return SeqDelta(
            first.index, "".join(p.text for p in parts), [t for p in parts for t in p.token_ids],
            [lp for p in parts for lp in p.logprobs],
            next((p.finish_reason for p in reversed(parts) if p.finish_reason is not None), None),
            next((p.error for p in reversed(parts) if p.error), None),
            next((p.prompt_logprobs for p in parts if p.prompt_logprobs is not None), None),
            next((p.cached_tokens for p in parts if p.cached_tokens is not None), None),
            last.error_status, last.error_code, last.retry_after_s)


def _held_suffix(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class OutputState:
    """Tracks one sequence's text and decides when it finishes.

    Args:
        eos_token_ids: ids that end generation unless ``ignore_eos``.
    """

    def __init__(self, seq: Sequence, tokenizer: TextTokenizer, eos_token_ids: list[int]):
        self.seq = seq
        self.detok = IncrementalDetokenizer(tokenizer, seq.token_ids[: seq.prompt_len], seq.params.skip_special_tokens)
        self.eos = set(eos_token_ids)
        self.stops = seq.params.stop
        self.longest = max((len(s) for s in self.stops), default=0)
        # The end of the final text: what is held back plus up to ``longest`` characters before the
        # search start (only there can a stop string still begin), not the whole text, so a long
        # output costs O(1) per token. Empty without stop strings (nothing is ever held back).
        self.text = ""
        self.emitted = 0  # characters of ``text`` already sent
        self.finish_reason: str | None = None

    def replay(self, output_ids: list[int]) -> None:
        """Rebuild the text state from output tokens produced elsewhere (a sequence handed over by a
        peer), so stop strings spanning the hand-off are still found; nothing is emitted for them."""
        for t in output_ids:
            piece = self.detok.add(t)
            if self.stops:
                self.text = (self.text + piece)[-self.longest :]
        self.emitted = len(self.text)

    def on_token(self, token_id: int, logprobs: TokenLogprobs | None, position: int | None = None) -> SeqDelta:
        """Account for a token already in ``seq.token_ids`` at ``position`` (default: the last; a later
        step's placeholder may follow it); return the delta to send."""
        seq, p = self.seq, self.seq.params
        length_so_far = len(seq.token_ids) if position is None else position + 1
        num_output = length_so_far - seq.prompt_len
        delta = SeqDelta(index=seq.index, token_ids=[token_id], logprobs=[logprobs] if logprobs else [])
        stop_token = (token_id in self.eos and not p.ignore_eos) or token_id in p.stop_token_ids
        if stop_token and num_output > p.min_tokens - 1:
            self.finish_reason = "stop"
            delta.text = self._release(self.detok.flush(), final=True)
        else:
            new = self.detok.add(token_id)
            length = num_output >= p.max_tokens or length_so_far >= seq.max_len
            if length:
                new += self.detok.flush()
            delta.text = self._release(new, final=length, num_output=num_output)
            if length and self.finish_reason is None:
                self.finish_reason = "length"
        delta.finish_reason = self.finish_reason
        return delta

    def _release(self, new: str, final: bool, num_output: int | None = None) -> str:
        stops = self.stops
        if not stops:  # nothing to find or hold back
            return new
        start = max(0, len(self.text) - self.longest)
        self.text += new
        hits = [(i, len(s)) for i, s in ((self.text.find(s, start), s) for s in stops) if i >= 0]
        n = self.seq.num_output if num_output is None else num_output
        if hits and n >= self.seq.params.min_tokens:
            at, length = min(hits)  # the earliest match (the shorter one where two start together)
            self.text = self.text[: at + length if self.seq.params.include_stop_str_in_output else at]
            self.finish_reason = "stop"
            final = True
        end = len(self.text) if final else len(self.text) - _held_suffix(self.text, stops)
        out = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        cut = min(self.emitted, max(0, len(self.text) - self.longest))  # keep what a later search reads
        if cut:
            self.text = self.text[cut:]
            self.emitted -= cut
        return out
