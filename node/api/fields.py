"""Which request field is honoured and which is refused: nothing a client sends is silently dropped.

Every field of the request types (:mod:`node.protocol`, :mod:`node.protocol_extras`, and their nested
types: ``messages``, their content parts, ``stream_options``) is in exactly one of three tables:

* :data:`HANDLED`: the field works (the value says where), or by its definition changes nothing the
  node returns (``user``, ``metadata``: "no effect on the output");
* :data:`REFUSED` (and :data:`MESSAGE_REFUSED` for each message's fields): a value other than the
  harmless ones gets a 400 naming the field (:func:`reject_refused`), as vLLM refuses what it cannot do;
* :data:`STRUCTURED_PATH`: structured outputs and tool calling, handled by :mod:`node.api.structured`
  and :mod:`node.api.tool_calls` (the legacy ``functions``/``function_call`` refused there by
  :func:`node.api.validate.reject_unsupported`).

A field no type declares is a 400 naming it (``forbid_unknown_fields`` on every request type).
``tests/test_request_fields.py`` walks the types and fails on a field in no table, and sends each
refused one to a live node.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

from node.api.errors import bad_request


class Refusal(NamedTuple):
    """``accepts(value, request)`` is True for the values served as if the field were absent; any other
    value gets a 400 with ``reason``."""

    accepts: Callable[[Any, Any], bool]
    reason: str


def _absent(value: Any, _req: Any) -> bool:
    return value in (None, [], {})


HANDLED: dict[str, str] = {
    # sampling (node.api.validate.sampling_params -> SamplingParams -> node.worker.sampler)
    "model": "checked against the served name (404 otherwise)",
    "n": "choices per prompt", "temperature": "sampler", "top_p": "sampler", "top_k": "sampler", "min_p": "sampler",
    "repetition_penalty": "sampler (penalties.py)", "presence_penalty": "sampler (penalties.py)",
    "frequency_penalty": "sampler (penalties.py)", "seed": "sampler (per-sequence counter-based draws)",
    "logit_bias": "sampler (token_masks.py), after the raw logprobs",
    "bad_words": "sampler (token_masks.py): a word's last token is masked where its other tokens precede",
    "allowed_token_ids": "sampler (token_masks.py): every other id masked",
    "stop": "stop strings (runtime/output.py)", "stop_token_ids": "stop ids (runtime/output.py)",
    "ignore_eos": "runtime/output.py", "min_tokens": "runtime/output.py",
    "include_stop_str_in_output": "runtime/output.py keeps the matched stop string",
    "skip_special_tokens": "the detokenizer (worker/tokenizer.py)",
    "max_tokens": "output length", "max_completion_tokens": "output length (chat)",
    "truncate_prompt_tokens": "keeps the prompt's last k tokens (api/prompts.py)",
    "add_special_tokens": "the tokenizer's BOS/EOS around a text prompt (api/prompts.py)",
    # output shape
    "stream": "server-sent events", "stream_options": "nested: see stream_options.*",
    "stream_options.include_usage": "a last chunk with the usage",
    "stream_options.continuous_usage_stats": "every chunk carries the usage so far",
    "stream_options.include_obfuscation": "no effect on the output: the node adds no obfuscation padding",
    "logprobs": "sampler logprobs", "top_logprobs": "sampler logprobs (chat)",
    "prompt_logprobs": "the prompt's logprobs on each choice (prompt_logprobs)",
    "echo": "the prompt (completions) or the last assistant message (chat) before the output",
    "return_token_ids": "token_ids and prompt_token_ids on each choice",
    "return_tokens_as_token_ids": "logprob tokens named token_id:N",
    "request_id": "the response's id (X-Request-Id header otherwise)",
    # prompts
    "prompt": "completions prompt: text, texts, ids or id lists",
    "messages": "chat messages, rendered by the chat template", "messages[].role": "template",
    "messages[].content": "template (text parts joined)", "messages[].name": "template (the message's name key)",
    "messages[].content[].type": "only text parts (others: 400)", "messages[].content[].text": "template",
    "messages[].reasoning_content": "template (the message's reasoning_content key)",
    "add_generation_prompt": "template", "continue_final_message": "template: the last message left open",
    "chat_template_kwargs": "extra template variables", "reasoning_effort": "template variable reasoning_effort",
    "include_reasoning": "with --reasoning-parser: false drops reasoning_content",
    # scheduling and caching
    "priority": "with --scheduling-policy priority: admission and queue order (400 otherwise when not 0)",
    "cache_salt": "salts the prefix-cache block keys: hits only among requests with the same salt",
    # no effect on the output, by definition
    "user": "no effect on the output (OpenAI's end-user id)",
    "metadata": "no effect on the output (OpenAI stores it with a stored completion; the node stores none)",
    "safety_identifier": "no effect on the output (OpenAI's end-user id)",
    "prompt_cache_key": "no effect on the output (OpenAI's cache-routing hint; the node has one prefix cache)",
}

REFUSED: dict[str, Refusal] = {
    "suffix": Refusal(lambda v, r: not v, "suffix (insertion) is not supported"),
    "best_of": Refusal(lambda v, r: v is None or v == r.n, "best_of other than n is not supported"),
    "use_beam_search": Refusal(lambda v, r: not v, "beam search is not supported by this server"),
    "length_penalty": Refusal(lambda v, r: v is None or v == 1.0, "length_penalty applies to beam search, "
                              "which is not supported"),
    "spaces_between_special_tokens": Refusal(lambda v, r: v, "spaces_between_special_tokens=false is not "
                                             "supported (the detokenizer joins pieces as the tokenizer does)"),
    "logits_processors": Refusal(_absent, "logits_processors are not supported by this server"),
    "kv_transfer_params": Refusal(_absent, "kv_transfer_params (another server's disaggregation) is not supported"),
    "vllm_xargs": Refusal(_absent, "vllm_xargs is not supported by this server"),
    "prompt_embeds": Refusal(_absent, "prompt_embeds are not supported: send text or token ids"),
    "chat_template": Refusal(_absent, "a request's own chat_template is not accepted: start the node with "
                             "--chat-template PATH"),
    "documents": Refusal(_absent, "documents are not supported by this server"),
    "mm_processor_kwargs": Refusal(_absent, "this node serves text models (mm_processor_kwargs)"),
    "prediction": Refusal(_absent, "predicted outputs (prediction) are not supported"),
    "web_search_options": Refusal(lambda v, r: v is None, "web search is not supported by this server"),  # {} asks for it
    "verbosity": Refusal(_absent, "verbosity is not supported by this server"),
    "audio": Refusal(_absent, "audio output is not supported by this server"),
    "modalities": Refusal(lambda v, r: v in (None, ["text"]), "only the modality [\"text\"] is supported"),
    "store": Refusal(lambda v, r: v is not True, "store=true: this node stores no completions"),
    "service_tier": Refusal(lambda v, r: v in (None, "auto", "default"), "service_tier: only auto or default"),
}

MESSAGE_REFUSED: dict[str, Refusal] = {
    "refusal": Refusal(lambda v, r: v is None, "an assistant message's refusal cannot be rendered by the template"),
    "annotations": Refusal(lambda v, r: not v, "message annotations are not supported"),
    "audio": Refusal(lambda v, r: v is None, "audio messages are not supported"),
    "function_call": Refusal(lambda v, r: v is None, "a message's legacy function_call is not supported"),
}
"""Fields of each of ``messages``: any value but the empty ones is a 400 naming ``messages[i].field``."""

STRUCTURED_PATH: frozenset[str] = frozenset({
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call",
    "messages[].tool_calls", "messages[].tool_call_id",
})
"""Structured outputs and tool calling: handled on that path (node.api.structured, node.api.tool_calls);
the legacy ``functions`` and ``function_call`` other than "none"/"auto" refused by
:func:`node.api.validate.reject_unsupported`."""


def reject_refused(req: Any) -> None:
    """400 for the first field of ``req`` whose value :data:`REFUSED` does not accept.

    Raises:
        APIError: 400 with ``param`` the field.
    """
    for name, refusal in REFUSED.items():
        if hasattr(req, name) and not refusal.accepts(getattr(req, name), req):
            raise bad_request(f"{name}: {refusal.reason}", param=name)
    for i, message in enumerate(getattr(req, "messages", ())):
        for name, refusal in MESSAGE_REFUSED.items():
            if not refusal.accepts(getattr(message, name), req):
                raise bad_request(f"messages[{i}].{name}: {refusal.reason}", param=f"messages[{i}].{name}")
