"""A request in flight: its sequences (one per choice), their output state and its event stream."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from node.core.sequence import SamplingParams, Sequence
from node.runtime.delta_stream import DeltaStream
from node.runtime.output import OutputState, SeqDelta
from node.runtime.token_output import TokenOutputState
from node.worker.sampler import TokenLogprobs
from node.worker.tokenizer import TextTokenizer


@dataclass
class RequestStats:
    """Arrival time (s, the node's monotonic clock) and token counts of one request."""

    arrival_s: float
    prompt_tokens: int = 0
    output_tokens: int = 0


class RequestState:
    """Everything the node tracks for one API request.

    ``n`` choices become ``n`` sequences ``{request_id}-{i}``; a seeded request gives choice ``i`` the
    seed ``seed + i`` so the choices differ but each is reproducible. Deltas for all choices arrive on
    ``stream`` (:class:`DeltaStream`, or anything with its ``push``) as :class:`SeqDelta` in production order; the consumer stops
    when every choice has a finish reason or an error. Several requests may share one stream (the
    prompts of one API request): each adds ``index0`` to its choices' indexes there.
    """

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, n: int,
                 tokenizer: TextTokenizer, eos_token_ids: list[int], max_model_len: int, now_s: float,
                 stream: DeltaStream | None = None, index0: int = 0, detokenize: bool = True):
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.stream = stream if stream is not None else DeltaStream()
        self.index0 = index0
        self.stats = RequestStats(arrival_s=now_s, prompt_tokens=len(prompt_ids))
        self.seqs: list[Sequence] = []
        self.outputs: list[OutputState | TokenOutputState] = []
        for i in range(n):
            p = params if params.seed is None or i == 0 else msgspec.structs.replace(params, seed=params.seed + i)
            if i > 0:
                p = msgspec.structs.replace(p, prompt_logprobs=None)  # computed once, for choice 0
            seq = Sequence(f"{request_id}-{i}", request_id, i, now_s, prompt_ids, p, max_model_len)
            self.seqs.append(seq)
            # without detokenize (API front ends do the text) only token ids decide the end here
            self.outputs.append(OutputState(seq, tokenizer, eos_token_ids) if detokenize
                                else TokenOutputState(seq, eos_token_ids))
        # Logprobs of prompt tokens 1..L-1 (token 0 has none), filled as prefill chunks run.
        self.prompt_logprobs: list[TokenLogprobs | None] = [None] * max(len(prompt_ids) - 1, 0)
        self.finished = [False] * n
        self.started = [False] * n  # a delta of the choice was emitted
        # The stream's columnar path for a plain token (no text, logprobs or end, not a choice's first):
        # ``plain(stream index, token id)`` (:class:`~node.api.frontend_link._Sink`); None: every token
        # is a delta through :meth:`emit`.
        self.plain = None if detokenize else getattr(self.stream, "plain", None)
        self.cancelled = False  # the client is gone: no device may adopt this request's sequences
        # Consumer side, per choice: the end reason once its last delta was taken, first and last
        # token times (s, monotonic) and tokens taken (the node's TTFT/ITL/TPOT metrics).
        self.reasons: list[str | None] = [None] * n
        self.first_s: list[float | None] = [None] * n
        self.last_s: list[float] = [0.0] * n
        self.tokens = [0] * n
        self.timer = None  # the --request-timeout-s handle
        self.log_line = True  # close_request logs the request (False: its API front end does)

    @property
    def done(self) -> bool:
        return all(self.finished)

    def emit(self, delta: SeqDelta) -> None:
        """Send a choice's delta (``delta.index`` is the choice's own, 0..n-1) to the stream, with the
        stream's index; a choice's first delta carries the prompt logprobs when ``echo`` asked."""
        i = delta.index
        if delta.finish_reason is not None or delta.error is not None:
            self.finished[i] = True
        if not self.started[i]:
            self.started[i] = True
            if self.params.prompt_logprobs is not None:
                delta.prompt_logprobs = list(self.prompt_logprobs)
        delta.index = i + self.index0
        self.stream.push(delta)

    def fail(self, message: str, *, status: int = 500, code: str | None = "internal_error",
             retry_after_s: float | None = None) -> None:
        """End every unfinished choice with an error (the node keeps serving).

        ``status`` and ``code`` are what the API answers (a non-streamed request gets that HTTP status;
        a stream's error event carries the code): the default is a server fault (500
        ``internal_error``); unavailability is 503 with ``retry_after_s`` (the ``Retry-After`` header).
        """
        for i, fin in enumerate(self.finished):
            if not fin:
                self.fail_choice(i, message, status=status, code=code, retry_after_s=retry_after_s)

    def fail_choice(self, index: int, message: str, *, status: int = 500, code: str | None = "internal_error",
                    retry_after_s: float | None = None) -> None:
        """End choice ``index`` with an error (see :meth:`fail`)."""
        self.emit(SeqDelta(index=index, error=message, error_status=status, error_code=code,
                           retry_after_s=retry_after_s))
