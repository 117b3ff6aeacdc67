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

from node.core.sequence import Sequence
from node.runtime.output import SeqDelta
from node.worker.sample_request import TokenLogprobs


class TokenOutputState:
    """Token-level finish decisions of one sequence (same rules and order as ``OutputState.on_token``).

    Args:
        seq: the sequence (its ``token_ids`` hold the token at ``position`` already).
        eos_token_ids: ids that end generation unless ``ignore_eos``.
    """

    __slots__ = ("seq", "eos", "finish_reason")

    def __init__(self, seq: Sequence, eos_token_ids: list[int]):
        self.seq = seq
        self.eos = frozenset(eos_token_ids)
        self.finish_reason: str | None = None

    def replay(self, output_ids: list[int]) -> None:
        """Tokens produced elsewhere: nothing to rebuild (no text is kept here)."""

    def on_token(self, token_id: int, logprobs: TokenLogprobs | None, position: int | None = None) -> SeqDelta:
        """The delta of a token at ``position`` (default: the last of ``seq.token_ids``), text empty."""
        seq, p = self.seq, self.seq.params
        length_so_far = len(seq.token_ids) if position is None else position + 1
        num_output = length_so_far - seq.prompt_len
        delta = SeqDelta(seq.index, "", [token_id], [logprobs] if logprobs else [])
        if ((token_id in self.eos and not p.ignore_eos) or token_id in p.stop_token_ids) and num_output > p.min_tokens - 1:
            self.finish_reason = "stop"
        elif (num_output >= p.max_tokens or length_so_far >= seq.max_len) and self.finish_reason is None:
            self.finish_reason = "length"
        delta.finish_reason = self.finish_reason
        return delta
