"""vLLM's per-request options, checked and turned into :class:`SamplingParams` fields or prompt edits.

``logit_bias``, ``allowed_token_ids`` and ``bad_words`` become token controls the sampler applies
(:mod:`node.worker.token_masks`); ``include_stop_str_in_output``, ``skip_special_tokens``,
``cache_salt`` and ``priority`` ride on the params; ``truncate_prompt_tokens`` cuts the prompt.
Every bad value is a 400 naming its field, before anything is queued.
"""

from __future__ import annotations

import msgspec

from node.api.errors import bad_request
from node.core.grammar_spec import GrammarSpec
from node.core.sequence import SamplingParams
from node.worker.tokenizer import TextTokenizer

MAX_BIAS = 100.0  # OpenAI: logit_bias values in [-100, 100]
MAX_BIASED_TOKENS = 300  # OpenAI's limit on logit_bias entries
MAX_BAD_WORDS = 128
MAX_CACHE_SALT_CHARS = 1024


def bad_word_ids(tok: TextTokenizer, words: list[str]) -> tuple[tuple[int, ...], ...]:
    """Token sequences of ``words``, each as it reads at the start of a text and after a space (as vLLM
    tokenizes them: ``word.lstrip()`` and ``" " + word.lstrip()``, no special tokens), duplicates dropped."""
    out: list[tuple[int, ...]] = []
    for w in words:
        for text in (w.lstrip(), " " + w.lstrip()):
            ids = tuple(tok.encode(text, add_special_tokens=False))
            if ids and ids not in out:
                out.append(ids)
    return tuple(out)


def _logit_bias(bias: dict[str, float] | None, vocab: int) -> tuple[tuple[int, float], ...]:
    if not bias:
        return ()
    if len(bias) > MAX_BIASED_TOKENS:
        raise bad_request(f"logit_bias has {len(bias)} entries; at most {MAX_BIASED_TOKENS}", param="logit_bias")
    out = []
    for key, value in bias.items():
        try:
            t = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
        if not 0 <= t < vocab:
            raise bad_request(f"logit_bias token id {t} is out of range [0, {vocab})", param="logit_bias")
        if not -MAX_BIAS <= value <= MAX_BIAS:  # NaN fails too
            raise bad_request(f"logit_bias values must be in [-100, 100], got {value}", param="logit_bias")
        out.append((t, float(value)))
    return tuple(out)


def with_request_options(params: SamplingParams, req, tok: TextTokenizer, vocab: int, *,
                         priority_policy: bool) -> SamplingParams:
    """``params`` with the request's token controls and output options.

    Args:
        priority_policy: the node runs ``--scheduling-policy priority`` (else a ``priority`` other
            than 0 is refused, as vLLM refuses it under first-come-first-served).

    Raises:
        APIError: 400 naming the field of a bad value.
    """
    allowed = list(req.allowed_token_ids or [])
    if req.allowed_token_ids is not None and not allowed:
        raise bad_request("allowed_token_ids must not be empty", param="allowed_token_ids")
    if any(not 0 <= t < vocab for t in allowed):
        raise bad_request(f"allowed_token_ids must be in [0, {vocab})", param="allowed_token_ids")
    words = list(req.bad_words or [])
    if len(words) > MAX_BAD_WORDS or any(not w.strip() for w in words):
        raise bad_request(f"bad_words: at most {MAX_BAD_WORDS} non-blank words", param="bad_words")
    if req.cache_salt is not None and not 0 < len(req.cache_salt) <= MAX_CACHE_SALT_CHARS:
        raise bad_request(f"cache_salt must have 1 to {MAX_CACHE_SALT_CHARS} characters", param="cache_salt")
    if req.priority and not priority_policy:
        raise bad_request("priority other than 0 needs a node started with --scheduling-policy priority",
                          param="priority")
    if not -(2**63) <= req.priority < 2**63:
        raise bad_request("priority must fit in 64 bits", param="priority")
    banned = bad_word_ids(tok, words) if words else ()
    if allowed and set(allowed) <= {w[0] for w in banned if len(w) == 1}:  # no token left to draw at any step
        raise bad_request("bad_words ban every one of allowed_token_ids", param="bad_words")
    return msgspec.structs.replace(
        params, logit_bias=_logit_bias(req.logit_bias, vocab), allowed_token_ids=tuple(allowed),
        bad_words=banned,
        include_stop_str_in_output=req.include_stop_str_in_output, skip_special_tokens=req.skip_special_tokens,
        cache_salt=req.cache_salt, priority=req.priority)


def reject_masks_beside_grammar(req, grammar: GrammarSpec | None) -> GrammarSpec | None:
    """400 for ``allowed_token_ids`` or ``bad_words`` beside a grammar (structured output, or a required or
    named ``tool_choice``): at a step where the grammar allows only tokens they forbid, the row would have no
    token left to draw, and the sampler's fallback would break the grammar's guarantee. vLLM takes both and
    can then emit tokens outside the grammar; the node refuses the combination up front instead.
    Returns ``grammar``.

    Raises:
        APIError: 400 naming ``allowed_token_ids`` or ``bad_words``.
    """
    for name in ("allowed_token_ids", "bad_words"):
        if grammar is not None and getattr(req, name):
            raise bad_request(f"{name} cannot be combined with structured output or a required or named "
                              f"tool_choice (a step could be left with no token both allow)", param=name)
    return grammar


def prompt_logprobs_count(req, param: str = "prompt_logprobs") -> int | None:
    """The request's ``prompt_logprobs`` (0-20 alternatives per prompt token), checked; None when absent."""
    k = req.prompt_logprobs
    if k is not None and not 0 <= k <= 20:
        raise bad_request(f"{param} must be in [0, 20], got {k}", param=param)
    if k is not None and req.stream:
        raise bad_request("prompt_logprobs are returned with the whole reply only (stream=false)", param=param)
    return k


def truncate_prompt(ids: list[int], k: int | None, max_model_len: int) -> list[int]:
    """The last ``k`` tokens of ``ids`` (``k=-1``: of the context length; None: all), as vLLM's
    ``truncate_prompt_tokens`` (left truncation).

    Raises:
        APIError: 400 for ``k`` below 1 (other than -1) or above the context length.
    """
    if k is None:
        return ids
    if k == -1:
        k = max_model_len
    if not 1 <= k <= max_model_len:
        raise bad_request(f"truncate_prompt_tokens must be -1 or in [1, {max_model_len}], got {k}",
                          param="truncate_prompt_tokens")
    return ids[-k:]
