"""A sequence's output seen by tokens only: the control process's half when API front ends detokenize.

With ``--api-processes`` above 1 the control loop must not pay per-token text work: it decides by
token id what ends a sequence (EOS unless ``ignore_eos``, ``stop_token_ids``, ``max_tokens``, the
context) and sends the ids on; the front end that owns the request runs the full
:class:`~node.runtime.output.OutputState` (detokenization, stop strings with their hold-back) on the
same ids, so both halves agree on every token-decided end and the text is exactly the single-process
text. A stop string ends the choice in the front end, which then closes the request (its KV is freed
by the abort that follows), as vLLM's front end does.
"""

from __future__ import annotations

import msgspec

from node.core.sequence import Sequence
from node.runtime.output import SeqDelta
from node.worker.sample_request import TokenLogprobs


_SHORT = {"key": "k", "index": "i", "token_ids": "t", "finish_reason": "f", "cached_tokens": "c", "logprobs": "l",
          "prompt_logprobs": "p", "error": "e", "error_status": "s", "error_code": "o", "retry_after_s": "r",
          "device": "d"}


class TokenDelta(msgspec.Struct, omit_defaults=True, rename=_SHORT, gc=False):
    """A :class:`~node.runtime.output.SeqDelta` without text, as the control loop makes it and as it
    travels to the front end of engine request ``key`` (set by the request's sink): the same
    attribute names, so the engine, the hand-offs and ``RequestState.emit`` treat both alike. A
    struct is about half the cost of the dataclass to create, and it is encoded as is, defaults left
    off under one-letter names: a plain token is ``{"k": key, "i": index, "t": [id]}``. Not tracked by
    the cyclic collector (``gc=False``: it holds ids and logprobs, never itself), so a step's deltas
    do not bring the next young collection closer."""

    key: int
    index: int
    token_ids: list[int]
    finish_reason: str | None = None
    cached_tokens: int | None = None
    logprobs: list[TokenLogprobs] = []
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    error: str | None = None
    error_status: int = 500
    error_code: str | None = "internal_error"
    retry_after_s: float | None = None
    device: str | None = None  # on a choice's first token: the device it runs on (the front end's log line)

    @classmethod
    def of(cls, key: int, d: SeqDelta) -> "TokenDelta":
        """A :class:`SeqDelta` made elsewhere (an error: ``RequestState.fail``) as a token delta."""
        return cls(key, d.index, d.token_ids, d.finish_reason, d.cached_tokens, d.logprobs, d.prompt_logprobs,
                   d.error, d.error_status, d.error_code, d.retry_after_s)


class TokenOutputState:
    """Token-level finish decisions of one sequence (same rules and order as ``OutputState.on_token``).

    Args:
        seq: the sequence (its ``token_ids`` hold the token at ``position`` already).
        eos_token_ids: ids that end generation unless ``ignore_eos``.
    """

    __slots__ = ("seq", "eos", "enders", "finish_reason")

    def __init__(self, seq: Sequence, eos_token_ids: list[int]):
        self.seq = seq
        self.eos = frozenset(eos_token_ids)
        # ids that may end the sequence by themselves (EOS unless ignore_eos, stop_token_ids): a token not
        # in it, short of ``seq.max_len``, ends nothing (the control loop's test for a plain token)
        p = seq.params
        self.enders = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.eos)
        self.finish_reason: str | None = None

    def replay(self, output_ids: list[int]) -> None:
        """Tokens produced elsewhere: nothing to rebuild (no text is kept here)."""

    def on_token(self, token_id: int, logprobs: TokenLogprobs | None, position: int | None = None) -> TokenDelta:
        """The delta of a token at ``position`` (default: the last of ``seq.token_ids``), no text."""
        seq, p = self.seq, self.seq.params
        length_so_far = len(seq.token_ids) if position is None else position + 1
        num_output = length_so_far - seq.prompt_len
        if ((token_id in self.eos and not p.ignore_eos) or token_id in p.stop_token_ids) and num_output > p.min_tokens - 1:
            self.finish_reason = "stop"
        elif (num_output >= p.max_tokens or length_so_far >= seq.max_len) and self.finish_reason is None:
            self.finish_reason = "length"
        if logprobs or num_output == 1:
            return TokenDelta(0, seq.index, [token_id], self.finish_reason, None, [logprobs] if logprobs else [],
                              device=seq.device_id if num_output == 1 else None)
        return TokenDelta(0, seq.index, [token_id], self.finish_reason)
