"""Checks of request values and their translation into prompts and :class:`SamplingParams`.

Every rule here answers a client mistake with a 400 that names the field, before anything is
queued, so a bad request can never reach the engine.
"""

from __future__ import annotations

from node.api.errors import APIError, bad_request
from node.api.tool_calls import template_message
from node.core.sequence import SamplingParams
from node.protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields
from node.worker.tokenizer import TextTokenizer, TokenizerError

MAX_N = 64
MAX_LOGPROBS = 20
MIN_TEMPERATURE = 1e-5
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512
COUNT_IN_FULL_CHARS = 256 * 1024  # a prompt up to this long is tokenized to count it (~1 s at worst)


def check_model(req: _SamplingFields, served: str) -> None:
    if req.model is not None and req.model != served:
        raise APIError(404, f"The model `{req.model}` does not exist. This node serves `{served}`.",
                       param="model", code="model_not_found")


def _range(name: str, value: float | int | None, lo: float, hi: float, lo_open: bool = False) -> None:
    if value is None:
        return
    if value != value or value < lo or value > hi or (lo_open and value == lo):  # NaN fails too
        bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise bad_request(f"{name} must be in {bound}, got {value}", param=name)


# Names the renderer itself passes to the template (and the template itself): a chat_template_kwargs key
# among them would collide with the renderer's own argument (a TypeError) or silently replace it.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "continue_final_message",
                                      "bos_token", "eos_token", "self", "chat_template", "documents"})


def _encode(tok: TextTokenizer, text: str, max_model_len: int, param: str, add_special_tokens: bool = True) -> list[int]:
    """Tokenize; a text of more than ``max_model_len`` tokens is a 400 naming both lengths in tokens, as
    vLLM's does. Callers run this off the event loop.

    A text too long to fit whatever its tokens are and too long to count quickly (over
    :data:`COUNT_IN_FULL_CHARS`: tokenizing megabytes takes seconds) is refused without tokenizing it; its
    error says it is more than ``max_model_len`` tokens.
    """
    what = "prompt" if param == "prompt" else "prompt rendered from the messages"
    if len(text) > max(max_model_len * tok.max_chars_per_token, COUNT_IN_FULL_CHARS):
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, your {what} "
                          f"has {len(text)} characters, which is more than {max_model_len} tokens.", param=param)
    ids = tok.encode(text, add_special_tokens=add_special_tokens)
    if len(ids) > max_model_len:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, your {what} "
                          f"is {len(ids)} tokens.", param=param)
    return ids


def completion_prompts(req: CompletionRequest, tok: TextTokenizer, vocab_size: int, max_model_len: int) -> list[list[int]]:
    """Token ids of each prompt of a completion request (a string, strings, ids, or id lists).

    Tokenization can take seconds for a long text: callers run this off the event loop.
    """
    p = req.prompt
    # a prompt to be cut to its last tokens may be any length (the body limit bounds it)
    limit = max_model_len if req.truncate_prompt_tokens is None else 2**40
    special = req.add_special_tokens
    if isinstance(p, str):
        prompts = [_encode(tok, p, limit, "prompt", special)]
    elif not p:
        raise bad_request("prompt must not be an empty list", param="prompt")
    elif all(isinstance(x, str) for x in p):
        prompts = [_encode(tok, x, limit, "prompt", special) for x in p]
    elif all(isinstance(x, int) for x in p):
        prompts = [list(p)]
    elif all(isinstance(x, list) for x in p):
        prompts = [list(x) for x in p]
    else:
        raise bad_request("prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids", param="prompt")
    for ids in prompts:
        if not ids:
            raise bad_request("prompt is empty (it has no tokens)", param="prompt")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise bad_request(f"prompt token id {bad[0]} is out of range [0, {vocab_size})", param="prompt")
    return prompts


def chat_prompt(req: ChatCompletionRequest, tok: TextTokenizer, max_model_len: int, tools: list[dict] | None = None) -> list[int]:
    """Render the chat template (with ``tools`` when given, as ``apply_chat_template(tools=)`` does) and
    tokenize it (the template carries BOS itself; ``add_special_tokens`` adds the tokenizer's too).
    ``chat_template_kwargs`` and ``reasoning_effort`` become template variables;
    ``continue_final_message`` leaves the last message open. Run off the loop."""
    messages = []  # at least one, each with a known role: the decoder checked (node.protocol)
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.type != "text":
                    raise bad_request("only text content parts are supported", param=f"messages[{i}].content[{j}].type")
                if part.text is None:  # OpenAI: a text part's text is required
                    raise bad_request("a text content part needs its text", param=f"messages[{i}].content[{j}].text")
            content = "\n".join(part.text for part in content)
        if m.role == "tool" and m.tool_call_id is None:  # OpenAI: required (the template pairs it with its call)
            raise bad_request("a tool message needs the tool_call_id of the call it answers",
                              param=f"messages[{i}].tool_call_id")
        message = template_message(m, content or "")
        if m.reasoning_content is not None:
            message["reasoning_content"] = m.reasoning_content
        messages.append(message)
    if req.continue_final_message and req.add_generation_prompt:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true (a final message "
                          "is either continued or followed by a new one)", param="continue_final_message")
    variables = dict(req.chat_template_kwargs or {})
    for key in variables:
        if key in RESERVED_TEMPLATE_KWARGS:
            raise bad_request(f"chat_template_kwargs must not set {key!r}: the server passes it to the template "
                              f"itself (reserved: {', '.join(sorted(RESERVED_TEMPLATE_KWARGS))})",
                              param=f"chat_template_kwargs.{key}")
    if req.reasoning_effort is not None:
        variables.setdefault("reasoning_effort", req.reasoning_effort)
    try:
        text = tok.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt, tools=tools,
                                       continue_final_message=req.continue_final_message, **variables)
    except TokenizerError as e:
        raise bad_request(str(e), param="messages") from e
    limit = max_model_len if getattr(req, "truncate_prompt_tokens", None) is None else 2**40  # /tokenize has none
    ids = _encode(tok, text, limit, "messages", add_special_tokens=req.add_special_tokens)
    if not ids:
        raise bad_request("the rendered chat prompt is empty", param="messages")
    return ids


def sampling_params(req: _SamplingFields, *, prompt_len: int, max_model_len: int, max_tokens: int | None,
                    default_max_tokens: int | None, vocab_size: int, logprobs: int | None,
                    prompt_logprobs: int | None, max_n: int = MAX_N, logprobs_param: str = "logprobs",
                    prompt_param: str = "prompt") -> SamplingParams:
    """Validate sampling fields for one prompt of ``prompt_len`` tokens.

    ``max_tokens=None`` means "not given": ``default_max_tokens`` capped by the room left in the
    context (``None``: all of it). An explicit ``max_tokens`` that does not fit is a 400 naming both
    lengths, as OpenAI and vLLM answer.
    """
    max_n = min(max_n, MAX_N)  # a request's choices must fit one device's batch (--max-num-seqs)
    if req.n < 1 or req.n > max_n:
        raise bad_request(f"n must be in [1, {max_n}], got {req.n}", param="n")
    if prompt_len >= max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt is "
            f"{prompt_len} tokens, which leaves no room for output.", param=prompt_param)
    room = max_model_len - prompt_len
    if max_tokens is not None:
        if max_tokens < 1:
            raise bad_request(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
        if max_tokens > room:
            raise bad_request(
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the completion).",
                param="max_tokens")
    else:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    temperature = 1.0 if req.temperature is None else req.temperature
    _range("temperature", temperature, 0.0, 100.0)
    if temperature < MIN_TEMPERATURE:  # as vLLM: logits / 1e-45 overflow float32; such a request is greedy
        temperature = 0.0
    _range("top_p", req.top_p, 0.0, 1.0, lo_open=True)
    _range("min_p", req.min_p, 0.0, 1.0)
    _range("presence_penalty", req.presence_penalty, -2.0, 2.0)
    _range("frequency_penalty", req.frequency_penalty, -2.0, 2.0)
    _range("repetition_penalty", req.repetition_penalty, 0.0, 100.0, lo_open=True)
    if req.top_k is not None and req.top_k < -1:
        raise bad_request(f"top_k must be -1 (off) or positive, got {req.top_k}", param="top_k")
    _range(logprobs_param, logprobs, 0, MAX_LOGPROBS)
    if req.min_tokens < 0 or req.min_tokens > max_tokens:
        raise bad_request(f"min_tokens must be in [0, max_tokens={max_tokens}], got {req.min_tokens}", param="min_tokens")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(s == "" for s in stops):
        raise bad_request("stop strings must not be empty", param="stop")
    if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_CHARS} characters", param="stop")
    stop_ids = list(req.stop_token_ids or [])
    if any(not 0 <= t < vocab_size for t in stop_ids):
        raise bad_request(f"stop_token_ids must be in [0, {vocab_size})", param="stop_token_ids")
    if req.seed is not None and not -(2**63) <= req.seed < 2**63:
        raise bad_request("seed must fit in 64 bits", param="seed")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        # past the vocabulary a top-k keeps every token, as none does (and stays a 64-bit int for the engine)
        top_k=0 if req.top_k in (None, -1) or req.top_k >= vocab_size else req.top_k,
        min_p=req.min_p or 0.0,
        repetition_penalty=req.repetition_penalty or 1.0,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        seed=req.seed,
        stop=tuple(stops),
        stop_token_ids=tuple(stop_ids),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        min_tokens=req.min_tokens,
    )


_UNSUPPORTED = ("logits_processors", "functions", "audio")


def reject_unsupported(req) -> None:
    """Refuse a request naming a field that would change what is generated and that this server does
    not implement (beam search, legacy functions, audio), as vLLM refuses what
    it cannot do: 400 naming the field, rather than an answer that silently ignores it. Also
    ``stream_options`` without ``stream: true`` (it would have no effect).

    Raises:
        APIError: 400 with ``param`` the field.
    """
    for name in _UNSUPPORTED:
        if getattr(req, name, None) not in (None, [], {}):
            raise bad_request(f"{name} is not supported by this server", param=name)
    if req.use_beam_search:
        raise bad_request("beam search is not supported by this server", param="use_beam_search")
    if getattr(req, "function_call", None) not in (None, "none", "auto"):  # the legacy form: use tools
        raise bad_request("function_call is not supported by this server: use tools and tool_choice", param="function_call")
    if req.stream_options is not None and not req.stream:  # as OpenAI and vLLM
        raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
    if getattr(req, "modalities", None) not in (None, ["text"]):
        raise bad_request(f"modalities {req.modalities} are not supported: only [\"text\"]", param="modalities")
