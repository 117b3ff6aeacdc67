"""The rows the sampler takes and the logprobs it gives back (their own module: the sampler and the
penalties both read :class:`SampleRequest`, and neither imports the other for it)."""

from __future__ import annotations

from dataclasses import dataclass

from node.core.sequence import SamplingParams


@dataclass
class SampleRequest:
    """One row of logits to sample from.

    Attributes:
        params: the sequence's sampling parameters.
        token_ids: the sequence's whole history, prompt then outputs (read only when the row has a
            penalty; never copied otherwise).
        prompt_len: ``token_ids[:prompt_len]`` is the prompt.
        output_index: index of the token being drawn among the sequence's outputs (seeds use it).
    """

    params: SamplingParams
    token_ids: list[int]
    prompt_len: int
    output_index: int


@dataclass
class TokenLogprobs:
    """Logprob of a chosen token and the ``top`` most likely alternatives: ``[(token_id, logprob)]``."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
