"""The speculative-decoding configuration (``--speculative-config``, vLLM's JSON shape).

Example: ``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}``.
Only the n-gram (prompt lookup) method is built; a draft model (``"model"``) is refused with a clear
error rather than ignored. The prompt-lookup window defaults follow vLLM's: neither bound given, both
are 5; one given, the other takes its value.
"""

from __future__ import annotations

import msgspec

DEFAULT_DISABLE_BY_BATCH_SIZE = 4
"""Speculation runs on a device only while it holds at most this many sequences, running and waiting
(vLLM's ``disable_by_batch_size``). Above it a step already fills the machine: each draft token costs about
what a decode token of another sequence does while most drafts are rejected, and a verify step cannot
overlap the next step's planning (:mod:`node.runtime.spec_decode`), so tokens/s would fall. Measured on
stories260k on 2 CPU cores (docs/user-guide.md, "Speculative decoding")."""


class SpeculativeConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """How a node speculates (vLLM's ``--speculative-config`` keys).

    Attributes:
        method: ``"ngram"``: draft tokens are looked up in the sequence's own prompt and output.
        num_speculative_tokens: draft tokens proposed per sequence per step, ``k >= 1``.
        prompt_lookup_max, prompt_lookup_min: the longest and shortest suffix (in tokens) matched
            against earlier text; the longest that matches wins.
        disable_by_batch_size: speculate only while the device holds at most this many sequences
            (running and waiting) (:data:`DEFAULT_DISABLE_BY_BATCH_SIZE` when unset).
        model: a draft model's path (vLLM's key): refused, only ``"ngram"`` is implemented.
    """

    method: str = "ngram"
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    disable_by_batch_size: int | None = None
    model: str | None = None

    @property
    def lookup_max(self) -> int:
        """The longest suffix matched (tokens), defaults applied."""
        return self.prompt_lookup_max if self.prompt_lookup_max is not None else (self.prompt_lookup_min or 5)

    @property
    def lookup_min(self) -> int:
        """The shortest suffix matched (tokens), defaults applied."""
        return self.prompt_lookup_min if self.prompt_lookup_min is not None else (self.prompt_lookup_max or 5)

    @property
    def max_batch(self) -> int:
        """Most sequences (running and waiting) a device may hold for speculation to run (defaults applied)."""
        return DEFAULT_DISABLE_BY_BATCH_SIZE if self.disable_by_batch_size is None else self.disable_by_batch_size

    def error(self) -> str | None:
        """Why this configuration cannot run, naming the key, or None."""
        if self.model is not None or self.method != "ngram":
            return (f"--speculative-config: only method \"ngram\" (prompt lookup) is implemented, got method "
                    f"{self.method!r}" + (f" with model {self.model!r}" if self.model is not None else ""))
        if not 1 <= self.num_speculative_tokens <= 64:
            return f"--speculative-config: num_speculative_tokens must be in [1, 64], got {self.num_speculative_tokens}"
        if not 1 <= self.lookup_min <= self.lookup_max:
            return (f"--speculative-config: need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                    f"{self.lookup_min} and {self.lookup_max}")
        if self.max_batch < 1:
            return f"--speculative-config: disable_by_batch_size must be at least 1, got {self.max_batch}"
        return None


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """``--speculative-config``'s JSON object → :class:`SpeculativeConfig`.

    Raises:
        ValueError: not a JSON object, an unknown key, a wrong type, or a value :meth:`SpeculativeConfig.error` refuses.
    """
    try:
        cfg = msgspec.json.decode(text.encode(), type=SpeculativeConfig)
    except msgspec.ValidationError as e:
        raise ValueError(f"--speculative-config: {e}") from None
    except msgspec.DecodeError as e:
        raise ValueError(f"--speculative-config must be a JSON object: {e}") from None
    err = cfg.error()
    if err is not None:
        raise ValueError(err)
    return cfg
