"""Per-sequence state shared by the policies and the shell (pure data)."""

from __future__ import annotations

import enum

import msgspec

from node.core.grammar_spec import GrammarSpec


class SamplingParams(msgspec.Struct, frozen=True):
    """How one sequence samples and when it stops (OpenAI/vLLM semantics).

    ``temperature == 0`` is greedy. ``top_k <= 0`` and ``top_p == 1`` and ``min_p == 0`` disable those
    filters. ``seed`` makes sampling reproducible per sequence regardless of batching (the sampler
    derives each token's randomness from ``(seed, output index)``). ``logprobs``: number of top
    alternatives to return per sampled token (``None``: no logprobs). ``prompt_logprobs``: the same
    for prompt tokens (``echo`` with ``logprobs``, or ``prompt_logprobs``). ``grammar``: the output must
    match it (structured output); every sampled token is masked to those the grammar allows
    (:mod:`node.worker.grammar`).

    Token controls (applied after the raw logprobs, before the penalties): ``logit_bias`` adds
    ``(token_id, bias)``; ``allowed_token_ids`` (non-empty) masks every other id; ``bad_words`` are
    token sequences never completed (a sequence's last token is masked where the output ends with the
    others). Output: ``include_stop_str_in_output`` keeps a matched stop string; ``skip_special_tokens``
    leaves special tokens out of the text. ``cache_salt``: prefix-cache keys are salted with it, so
    hits happen only among sequences of the same salt. ``priority``: lower is served first under the
    priority scheduling policy.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    grammar: GrammarSpec | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    priority: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


PENDING = -1  # a token id a step in flight will produce (see ``Sequence``)


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One generated continuation (a request with ``n`` choices has ``n`` sequences).

    ``token_ids`` holds prompt then output tokens; ``num_computed`` counts leading tokens whose K/V are
    in the cache; ``block_ids`` is the block table in logical order. After a preemption the sequence
    is recomputed from scratch: ``num_computed`` returns to 0 and its output so far is prefilled too
    (less whatever the device's prefix cache still holds).

    Prefix cache: ``block_keys`` memoizes the cache keys of the leading full blocks of ``token_ids``
    (they never change, since tokens are only appended); ``num_registered`` counts the leading blocks of
    ``block_ids`` already offered to the device's cache; ``num_cached_tokens`` is the number of prompt
    tokens found in the cache when the sequence was first admitted (``None`` before), which the API
    reports as ``usage.prompt_tokens_details.cached_tokens``.

    Overlapped steps: while a step that samples for this sequence is in flight, its token is already
    appended as :data:`PENDING` (``num_pending`` counts such tail entries, 0 or 1), so the next step
    can be planned before the token is known; the device's engine feeds the real token itself and the
    node writes it over the placeholder when the step's reply arrives.

    ``grammar_wait``: the device's engine is still compiling the sequence's grammar (or replaying its
    emitted tokens into a matcher) in its grammar thread; no step includes the sequence until the runtime
    clears it (:mod:`node.runtime.grammar_gate`), so no step waits for a compile.
    """

    __slots__ = (
        "seq_id", "request_id", "index", "arrival_s", "token_ids", "prompt_len", "params",
        "max_len", "num_computed", "block_ids", "status", "num_preemptions", "device_id",
        "last_token_s", "first_token_s", "block_keys", "num_registered", "num_cached_tokens", "num_pending",
        "grammar_wait",
    )

    def __init__(self, seq_id: str, request_id: str, index: int, arrival_s: float,
                 prompt_ids: list[int], params: SamplingParams, max_model_len: int):
        self.seq_id = seq_id
        self.request_id = request_id
        self.index = index
        self.arrival_s = arrival_s
        self.token_ids = list(prompt_ids)
        self.prompt_len = len(prompt_ids)
        self.params = params
        self.max_len = min(self.prompt_len + params.max_tokens, max_model_len)
        self.num_computed = 0
        self.block_ids: list[int] = []
        self.status = SeqStatus.WAITING
        self.num_preemptions = 0
        self.device_id: str | None = None
        self.last_token_s: float | None = None
        self.first_token_s: float | None = None
        self.block_keys: list[bytes] = []
        self.num_registered = 0
        self.num_cached_tokens: int | None = None
        self.num_pending = 0
        self.grammar_wait = False

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_uncomputed(self) -> int:
        """Tokens whose K/V must still be computed (1 for a decoding sequence)."""
        return len(self.token_ids) - self.num_computed

    @property
    def is_decoding(self) -> bool:
        """All but the last sampled token are cached: the next step is one decode token."""
        n = len(self.token_ids)  # num_uncomputed == 1 and num_output > 0, without two more property calls:
        return n - self.num_computed == 1 and n > self.prompt_len  # the batcher and snapshot ask per sequence

    def sort_key(self) -> tuple[int, float, str]:
        """Queue order: priority (lower first; all 0 under first-come-first-served), then arrival."""
        return (self.params.priority, self.arrival_s, self.seq_id)

    def __repr__(self) -> str:
        return f"Sequence({self.seq_id}, {self.status.value}, computed={self.num_computed}/{len(self.token_ids)})"
