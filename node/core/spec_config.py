"""The speculative-decoding configuration (``--speculative-config``, vLLM's JSON shape).

Two methods:

* n-gram (prompt lookup): ``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
  "prompt_lookup_min": 2}``. The prompt-lookup window defaults follow vLLM's: neither bound given, both
  are 5; one given, the other takes its value.
* a draft model with the target's vocabulary: ``{"model": "PATH", "num_speculative_tokens": 3}`` (method
  ``"draft_model"``, inferred from ``"model"`` when ``"method"`` is left out, as vLLM does); it runs in each
  engine process beside the target (:mod:`node.worker.draft_model`).

Other methods (EAGLE, Medusa, MTP) are refused with a clear error rather than ignored.
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
        method: ``"ngram"``: draft tokens are looked up in the sequence's own prompt and output;
            ``"draft_model"``: a small model (``model``) proposes them; None (left out): ``"draft_model"``
            when ``model`` is given, else ``"ngram"`` (:attr:`kind`).
        num_speculative_tokens: draft tokens proposed per sequence per step, ``k >= 1``.
        prompt_lookup_max, prompt_lookup_min: the longest and shortest suffix (in tokens) matched
            against earlier text; the longest that matches wins (n-gram only).
        disable_by_batch_size: speculate only while the device holds at most this many sequences
            (running and waiting) (:data:`DEFAULT_DISABLE_BY_BATCH_SIZE` when unset).
        model: the draft model's Hugging Face folder (vLLM's key), for ``"draft_model"``. Its vocabulary
            size must be the target's (checked at start-up, :func:`node.worker.draft_model.check_draft_model`).
    """

    method: str | None = None
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    disable_by_batch_size: int | None = None
    model: str | None = None

    @property
    def kind(self) -> str:
        """The method, inferred where ``method`` is left out: ``"draft_model"`` with a ``model``, else ``"ngram"``."""
        if self.method is not None:
            return self.method
        return "draft_model" if self.model is not None else "ngram"

    @property
    def uses_draft_model(self) -> bool:
        """Drafts come from a draft model run in the engine processes (not from the node's n-gram lookup)."""
        return self.kind == "draft_model"

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
        kind = self.kind
        if kind not in ("ngram", "draft_model"):
            return (f"--speculative-config: method must be \"ngram\" (prompt lookup) or \"draft_model\", got "
                    f"{kind!r}")
        if kind == "ngram" and self.model is not None:
            return (f"--speculative-config: method \"ngram\" takes no model (got model {self.model!r}); leave "
                    "\"method\" out or set it to \"draft_model\" to draft with that model")
        if kind == "draft_model" and not self.model:
            return "--speculative-config: method \"draft_model\" needs \"model\" (the draft model's folder)"
        if kind == "draft_model" and (self.prompt_lookup_max is not None or self.prompt_lookup_min is not None):
            return "--speculative-config: prompt_lookup_max and prompt_lookup_min apply to method \"ngram\" only"
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
