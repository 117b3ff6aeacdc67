"""Request fields beyond the core sampling set: vLLM's extensions and OpenAI's bookkeeping fields.

They live in a base class that :mod:`node.protocol`'s request types inherit, so the core types stay short.
Every field here is either honoured or refused with a 400 naming it; which, and how, is listed in
:mod:`node.api.fields` (a test walks the types and fails on a field that is in neither list).
"""

from __future__ import annotations

from typing import Any

import msgspec


class StreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``stream_options``: ``include_usage`` (a last chunk with the usage) and vLLM's
    ``continuous_usage_stats`` (every chunk carries the usage so far). ``include_obfuscation``
    (OpenAI's padding of chunks against length side channels) is accepted and has no effect: the node
    adds no padding field, which that option allows to be absent."""

    include_usage: bool = False
    continuous_usage_stats: bool = False
    include_obfuscation: bool | None = None


class SamplingExtras(msgspec.Struct, kw_only=True):
    """vLLM's per-request sampling and output controls, and OpenAI's fields that do not change the tokens."""

    bad_words: list[str] | None = None  # words (each one or more tokens) never generated
    allowed_token_ids: list[int] | None = None  # only these ids may be sampled
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # refused when false (the detokenizer joins pieces as is)
    truncate_prompt_tokens: int | None = None  # keep only the last k prompt tokens (-1: the context length)
    prompt_logprobs: int | None = None  # logprobs of the prompt's tokens (choices' "prompt_logprobs")
    return_tokens_as_token_ids: bool = False  # logprob token names as "token_id:N"
    cache_salt: str | None = None  # prefix-cache hits only among requests with the same salt
    priority: int = 0  # lower runs first under --scheduling-policy priority
    request_id: str | None = None  # the response's id (as the X-Request-Id header)
    length_penalty: float | None = None  # beam search only: refused unless 1
    kv_transfer_params: Any = None  # refused: another server's disaggregation hand-off
    vllm_xargs: Any = None  # refused: arguments of vLLM plugins
    # OpenAI fields that do not change what is generated (accepted; see node.api.fields for the values refused)
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None


class MessageExtras(msgspec.Struct, kw_only=True):
    """Fields of a chat message beyond role, content and name that clients send back in a history (the
    openai SDK's message objects carry them): ``reasoning_content`` reaches the template as the
    message's key; the others are accepted only empty (node.api.fields.MESSAGE_REFUSED)."""

    reasoning_content: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: Any = None
    function_call: Any = None
