"""OpenAI-compatible request types (msgspec Structs, decoded strictly: a wrong type is a 400).

Fields follow the OpenAI API, plus the vLLM extensions that users of open servers expect
(``top_k``, ``min_p``, ``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``, ``min_tokens``).
Responses are plain dicts built in ``node.api.responses``. A field no type declares is a 400 naming it
(``forbid_unknown_fields``): nothing a client sends is dropped without a word. More fields are in
:mod:`node.protocol_extras`; :mod:`node.api.fields` lists how each one is honoured or refused.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from node.protocol_extras import MessageExtras, SamplingExtras, StreamOptions
from node.protocol_structured import ResponseFormat, StructuredOutputs
from node.protocol_tools import Tool, ToolCall, ToolChoice

# OpenAI's values of reasoning_effort (any other is a 400 naming the field)
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]

__all__ = ["ChatCompletionRequest", "ChatMessage", "CompletionRequest", "PeerChange", "StreamOptions", "TextPart",
           "decode_request"]


class _SamplingFields(SamplingExtras, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    return_token_ids: bool = False  # vLLM extension: choices carry "token_ids" (and the prompt's ids)
    # Structured output (node.api.structured): OpenAI's response_format, vLLM's structured_outputs and
    # its older guided_* names.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Fields that change what is generated and that this server does not implement: accepted by the
    # decoder only so that a request naming one is refused (400 naming it) instead of silently served
    # without it (node.api.validate.reject_unsupported).
    use_beam_search: bool = False
    logits_processors: Any = None


class CompletionRequest(_SamplingFields, kw_only=True):
    """``POST /v1/completions``. ``prompt``: a string, a list of strings, a list of token ids, or a
    list of token-id lists. ``logprobs``: number of alternatives (0–20) per token."""

    prompt: str | list[str | int | list[int]]
    add_special_tokens: bool = True  # the tokenizer's BOS before a text prompt
    prompt_embeds: Any = None  # refused: the node takes text or token ids
    max_tokens: int | None = None  # None: 16, capped by the room left in the context
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


class TextPart(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: str
    text: str | None = None


class ChatMessage(MessageExtras, kw_only=True, forbid_unknown_fields=True):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message's answer to that call


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    """``POST /v1/chat/completions``. ``logprobs``: whether to return them; ``top_logprobs``: 0–20."""

    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    add_special_tokens: bool = False  # the template writes BOS itself
    continue_final_message: bool = False  # extend the last (assistant) message instead of starting a new one
    echo: bool = False  # the reply starts with the last message's content, when it is the assistant's
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables (Qwen3's enable_thinking)
    chat_template: str | None = None  # refused: the node renders its own template (--chat-template)
    include_reasoning: bool = True  # with --reasoning-parser: false leaves reasoning_content out
    reasoning_effort: ReasoningEffort | None = None  # passed to the chat template as `reasoning_effort`
    documents: Any = None  # refused: retrieval documents for templates that take them
    mm_processor_kwargs: Any = None  # refused: the node serves text models
    prediction: Any = None  # refused: predicted outputs
    web_search_options: Any = None  # refused
    verbosity: str | None = None  # refused: the model has no verbosity control
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None  # tool calling: node.api.tool_calls
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None  # None: true (OpenAI's default); only with tools
    functions: list[Any] | None = None  # the legacy form of tools
    function_call: Any = None
    modalities: list[str] | None = None  # only ["text"]
    audio: Any = None


class PeerChange(msgspec.Struct, forbid_unknown_fields=True):
    """Body of ``POST /v1/node/peers``: ``host:port`` KV addresses to start and to stop using."""

    add: list[str] = []
    remove: list[str] = []


def decode_request(body: bytes, kind: type[msgspec.Struct]) -> Any:
    """Decode ``body`` as JSON into ``kind``; a top-level ``null`` stands for the field's default, as in
    OpenAI's API (some clients send ``"n": null`` or ``"stream": null``).

    Raises:
        msgspec.DecodeError: not JSON. msgspec.ValidationError: a field of the wrong type or unknown.
    """
    decoder = _decoders.get(kind)
    if decoder is None:  # another route's type (/tokenize...): made once
        decoder = _decoders[kind] = msgspec.json.Decoder(kind)
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as e:
        if "got `null`" not in str(e):
            raise
        raw = msgspec.json.decode(body)  # the slow path, only for a body that has such a null
        if not isinstance(raw, dict):
            raise
        defaulted = {f.encode_name for f in msgspec.structs.fields(kind)
                     if f.default is not msgspec.NODEFAULT or f.default_factory is not msgspec.NODEFAULT}
        return msgspec.convert({k: v for k, v in raw.items() if not (v is None and k in defaulted)}, kind)


_decoders = {k: msgspec.json.Decoder(k) for k in (CompletionRequest, ChatCompletionRequest)}
