"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes.

``/tokenize`` takes a text ``prompt`` (with ``add_special_tokens``, default true) or chat ``messages``
rendered by the chat template as ``/v1/chat/completions`` renders them (``add_generation_prompt``,
``continue_final_message``, ``chat_template_kwargs``, ``tools``; ``add_special_tokens`` default false), and answers
``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs`` with ``return_token_strs``: each
token's vocabulary piece). ``/detokenize`` takes ``tokens`` and answers ``{"prompt": text}``. Unknown
fields are a 400 naming them, as everywhere.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from aiohttp import web

from node.api.errors import bad_request
from node.api.request_body import NODE_KEY, off_loop, read_json
from node.api.validate import _encode, chat_prompt, check_model
from node.api.tool_calls import template_tools
from node.protocol import ChatMessage, ReasoningEffort
from node.protocol_tools import Tool


class TokenizeCompletionRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A text to tokenize."""

    prompt: str
    model: str | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Chat messages to render with the chat template, then tokenize."""

    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    model: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: ReasoningEffort | None = None
    return_token_strs: bool = False
    tools: list[Tool] | None = None  # rendered into the template as chat renders them


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Token ids to turn back into text."""

    tokens: list[int]
    model: str | None = None


async def tokenize(request: web.Request) -> web.Response:
    """``POST /tokenize`` (module docstring)."""
    node = request.app[NODE_KEY]
    try:  # which form: by its required key, so each form's unknown fields are named against it
        top = msgspec.json.decode(await request.read())
    except msgspec.DecodeError:
        top = None  # read_json answers it
    kind = TokenizeChatRequest if isinstance(top, dict) and "messages" in top else TokenizeCompletionRequest
    req = await read_json(request, kind)
    check_model(req, node.config.model_name)
    tok = node.tokenizer
    if isinstance(req, TokenizeChatRequest):
        tools = template_tools(req.tools) if req.tools else None
        ids = await off_loop(chat_prompt, req, tok, node.max_model_len, tools)
    else:
        ids = await off_loop(_encode, tok, req.prompt, node.max_model_len, "prompt", req.add_special_tokens)
    strs = [tok.id_to_token(t) for t in ids] if req.return_token_strs else None
    return web.json_response({"count": len(ids), "max_model_len": node.max_model_len, "tokens": ids,
                              "token_strs": strs})


async def detokenize(request: web.Request) -> web.Response:
    """``POST /detokenize`` (module docstring). 400 for an id outside the vocabulary."""
    node = request.app[NODE_KEY]
    req: DetokenizeRequest = await read_json(request, DetokenizeRequest)  # type: ignore[assignment]
    check_model(req, node.config.model_name)
    vocab = node.info.cfg.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"token id {bad[0]} is out of range [0, {vocab})", param="tokens")
    return web.json_response({"prompt": node.tokenizer.decode(req.tokens)})
