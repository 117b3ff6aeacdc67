"""Structured-output request fields → a :class:`~node.core.grammar_spec.GrammarSpec`, checked before
anything is queued.

The forms (one per request at most):

* ``response_format``: ``{"type": "text"}`` (nothing), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` and
  ``{"type": "structural_tag", ...}`` (the whole object is xgrammar's structural tag), on chat and
  completions. The schema is always enforced, ``strict`` or not (OpenAI's non-strict mode only
  promises less).
* vLLM's ``structured_outputs``: ``{"json": schema}``, ``{"regex": pattern}``, ``{"choice": [..]}``,
  ``{"grammar": EBNF}``, ``{"structural_tag": ..}``, ``{"json_object": true}``.
* vLLM's older names ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``.

:func:`check_grammar` compiles the spec off the event loop (the node's copy is cached, and an engine
in this process reuses it), within :data:`COMPILE_TIMEOUT_S`; a spec that does not compile, accepts
no output, is larger than :data:`MAX_SPEC_BYTES` or takes too long to compile is a 400 naming the
field. JSON is generated compactly (no free whitespace between tokens), so a model cannot fill its
``max_tokens`` with blanks; a ``max_tokens`` cut-off still ends the output part-way (finish_reason
``length``), and the text is then not valid JSON.
"""

from __future__ import annotations

import asyncio
import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from node.api.errors import APIError, bad_request, retry_after
from node.core.grammar_spec import GrammarSpec
from node.protocol_structured import ResponseFormat, StructuredOutputs
from node.runtime.grammar_gate import (COMPILE_TIMEOUT_S, GRAMMAR_START_TIMEOUT_S, GrammarFailed,  # noqa: F401
                                       is_prepared, until_ready)
from node.worker.engine_messages import GrammarPrepare
from node.worker.local_engine import LocalEngine
from node.worker.grammar import GrammarCache, GrammarError, existing_grammar_cache, grammar_cache

MAX_SPEC_BYTES = 256 * 1024  # a schema, pattern or grammar larger than this is refused (compile time grows with it)

_compile_pool = ThreadPoolExecutor(2, thread_name_prefix="grammar-compile")  # off the loop and off the default pool


# JSON-schema keywords xgrammar compiles without enforcing them (it warns on the console and generates as if
# they were absent): a schema using one is refused rather than answered with output that may not validate.
UNENFORCED_KEYWORDS = ("not", "allOf", "if", "then", "else", "dependentSchemas", "dependentRequired",
                       "unevaluatedProperties", "unevaluatedItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema
_DATA = ("enum", "const", "default", "examples", "required")  # values, not schemas
LOOKAROUND = re.compile(r"(?<!\\)\(\?<?[=!]")  # (?= (?! (?<= (?<! : xgrammar's regex ignores them


def unenforced_keyword(schema: Any, path: str = "") -> str | None:
    """The path of the first keyword of :data:`UNENFORCED_KEYWORDS`, of a ``$ref`` outside the schema (a
    remote one is not fetched), of ``minLength``/``maxLength`` beside a ``pattern`` or ``format``, or of
    ``multipleOf`` on anything but an integer, in ``schema``; None where every keyword is enforced."""
    if isinstance(schema, list):
        return next((p for i, s in enumerate(schema) if (p := unenforced_keyword(s, f"{path}[{i}]"))), None)
    if not isinstance(schema, dict):
        return None
    # xgrammar 0.2.9 drops a string's length bounds beside a pattern or format (its warning: "pattern/format
    # combined with minLength/maxLength is not supported; ignoring minLength/maxLength")
    if "pattern" in schema or "format" in schema:
        bound = next((k for k in ("minLength", "maxLength") if k in schema), None)
        if bound is not None:
            return f"{path}.{bound}" if path else bound
    # and enforces multipleOf only on an integer ("multipleOf is not supported for type:number; ignoring"),
    # and a pattern's lookaround not at all ("Lookahead assertion is not supported and is ignored")
    if "multipleOf" in schema and schema.get("type") != "integer":
        return f"{path}.multipleOf" if path else "multipleOf"
    if isinstance(schema.get("pattern"), str) and LOOKAROUND.search(schema["pattern"]):
        return f"{path}.pattern" if path else "pattern"
    for key, sub in schema.items():
        here = f"{path}.{key}" if path else key
        if key in UNENFORCED_KEYWORDS:
            return here
        if key == "$ref" and not (isinstance(sub, str) and sub.startswith("#")):
            return here
        if key in _DATA:
            continue
        subs = sub.items() if key in _SCHEMA_MAPS and isinstance(sub, dict) else [(None, sub)]
        for name, s in subs:
            found = unenforced_keyword(s, here if name is None else f"{here}.{name}")
            if found:
                return found
    return None


def _text(value: Any, param: str) -> str:
    """A schema given as an object or as JSON text → JSON text (a string must parse as JSON).

    Raises:
        APIError: 400 for text that is not JSON, a value that is not a schema, or a schema using a keyword
            the grammar engine does not enforce (:func:`unenforced_keyword`).
    """
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError as e:
            raise bad_request(f"{param} is not valid JSON: {e}", param=param) from e
        text = value
    elif isinstance(value, (dict, bool)):
        parsed, text = value, json.dumps(value)
    else:
        raise bad_request(f"{param} must be a JSON schema (an object)", param=param)
    where = unenforced_keyword(parsed)
    if where:
        raise bad_request(f"{param}: the schema keyword at {where} is not supported by the grammar engine "
                          "(it would not be enforced); rewrite the schema without it", param=param)
    return text


def _string(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise bad_request(f"{param} must be a non-empty string", param=param)
    return value


def _regex(value: Any, param: str) -> str:
    """A regular expression the grammar engine enforces whole (a lookaround would be ignored: 400)."""
    value = _string(value, param)
    if LOOKAROUND.search(value):
        raise bad_request(f"{param}: lookahead and lookbehind assertions are not supported by the grammar engine "
                          "(they would not be enforced); rewrite the expression without them", param=param)
    return value


def _choice(value: Any, param: str) -> str:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise bad_request(f"{param} must be a non-empty list of non-empty strings", param=param)
    return json.dumps(value, ensure_ascii=False)


def _response_format(rf: ResponseFormat) -> GrammarSpec | None:
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        return GrammarSpec("json_object")
    if rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema is None:
            raise bad_request("response_format json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                              param="response_format")
        return GrammarSpec("json_schema", _text(rf.json_schema.schema, "response_format"))
    return GrammarSpec("structural_tag", json.dumps(_structural_tag(rf)))


def _structural_tag(rf: ResponseFormat) -> dict:
    """xgrammar's structural tag: the object itself when it has ``format``; the older form (vLLM's
    ``structures`` of ``{begin, schema, end}`` and ``triggers``) becomes a ``triggered_tags`` format."""
    if rf.format is not None or rf.structures is None:
        return msgspec.to_builtins(rf)
    tags = []
    for s in rf.structures:
        if not isinstance(s.get("begin"), str) or not isinstance(s.get("end"), str) or "schema" not in s:
            raise bad_request("each response_format structure needs begin, schema and end", param="response_format")
        tags.append({"type": "tag", "begin": s["begin"], "end": s["end"],
                     "content": {"type": "json_schema", "json_schema": s["schema"]}})
    return {"type": "structural_tag",
            "format": {"type": "triggered_tags", "triggers": list(rf.triggers or []), "tags": tags}}


_SO_KEYS = {"json": ("json_schema", _text), "regex": ("regex", _regex), "choice": ("choice", _choice),
            "grammar": ("ebnf", _string)}


def _structured_outputs(so: StructuredOutputs) -> GrammarSpec | None:
    given = [k for k in (*_SO_KEYS, "structural_tag", "json_object") if getattr(so, k) not in (None, False)]
    if len(given) > 1:
        raise bad_request(f"structured_outputs takes one of json, regex, choice, grammar, structural_tag, "
                          f"json_object; got {', '.join(given)}", param="structured_outputs")
    if not given:
        return None
    key = given[0]
    value = getattr(so, key)
    if key == "json_object":
        return GrammarSpec("json_object")
    if key == "structural_tag":
        return GrammarSpec("structural_tag", value if isinstance(value, str) else json.dumps(value))
    kind, convert = _SO_KEYS[key]
    return GrammarSpec(kind, convert(value, "structured_outputs"))


_GUIDED = {"guided_json": ("json_schema", _text), "guided_regex": ("regex", _regex),
           "guided_choice": ("choice", _choice), "guided_grammar": ("ebnf", _string)}


def grammar_spec(req) -> tuple[GrammarSpec, str] | None:
    """The request's structured-output constraint and the field it came from, or None.

    Raises:
        APIError: 400 for a malformed form, two forms at once, a spec over :data:`MAX_SPEC_BYTES`, or a
            grammar beside ``ignore_eos``/``min_tokens`` (the grammar decides where the output ends).
    """
    found: list[tuple[GrammarSpec, str]] = []
    rf = getattr(req, "response_format", None)
    if rf is not None:
        spec = _response_format(rf)
        if spec is not None:
            found.append((spec, "response_format"))
    if req.structured_outputs is not None:
        spec = _structured_outputs(req.structured_outputs)
        if spec is not None:
            found.append((spec, "structured_outputs"))
    for name, (kind, convert) in _GUIDED.items():
        value = getattr(req, name)
        if value is not None:
            found.append((GrammarSpec(kind, convert(value, name)), name))
    if not found:
        return None
    if len(found) > 1:
        raise bad_request(f"only one structured-output form per request; got {', '.join(p for _, p in found)}",
                          param=found[1][1])
    spec, param = found[0]
    size = len(spec.spec.encode())
    if size > MAX_SPEC_BYTES:
        raise bad_request(f"the {spec.kind} is {size} bytes, more than the limit of {MAX_SPEC_BYTES} bytes", param=param)
    if req.ignore_eos or req.min_tokens:
        bad = "ignore_eos" if req.ignore_eos else "min_tokens"
        raise bad_request(f"{bad} cannot be combined with {param}: the grammar decides where the output ends", param=bad)
    return spec, param


def _cache_key(node) -> tuple:
    tok = node.tokenizer
    cfg = node.info.cfg
    return tok, cfg.vocab_size, tok.eos_token_ids or list(cfg.eos_token_ids)


def node_grammars(node) -> GrammarCache:
    """The node's compiled-grammar cache (its tokenizer, logits width and stop ids)."""
    return grammar_cache(*_cache_key(node))


async def check_grammar(node, spec: GrammarSpec, param: str, timeout_s: float | None = None) -> None:
    """Compile ``spec`` (cached) in a compile thread while each engine process compiles it too
    (:func:`prepare_on_engines`), each within ``timeout_s`` (default :data:`COMPILE_TIMEOUT_S`) of its
    grammar engine being up, so no step compiles it; a spec already in the node's cache and ready on every
    engine is answered at once, on the loop.

    Raises:
        APIError: 400 naming ``param`` when it does not compile, accepts nothing or takes too long; 503 with
            ``Retry-After`` when an engine's grammar engine does not start (:func:`prepare_on_engines`).
    """
    timeout_s = COMPILE_TIMEOUT_S if timeout_s is None else timeout_s
    loop = asyncio.get_running_loop()

    async def on_node():
        cache = existing_grammar_cache(*_cache_key(node))
        if cache is None:  # the first structured request: xgrammar's import and the vocabulary's scan, off the loop
            cache = await loop.run_in_executor(_compile_pool, node_grammars, node)
        if cache.cached(spec) is not None:  # checked before: no trip through the compile threads
            return
        try:  # the compile's bound counts from when the grammar engine is up
            await asyncio.wait_for(asyncio.wrap_future(_compile_pool.submit(cache.get, spec)), timeout_s)
        except GrammarError as e:
            raise bad_request(f"{param}: {e}", param=param) from e
        except TimeoutError as e:
            raise bad_request(f"{param}: the {spec.kind} did not compile within {timeout_s:g} s", param=param) from e

    # the node and its engine processes at once: on the first structured request each builds its cache
    # (seconds), and one after the other would add them up
    node_side = asyncio.ensure_future(on_node())
    try:
        await prepare_on_engines(node, spec, param, timeout_s)
    except BaseException:
        if node_side.done() and not node_side.cancelled():
            node_side.exception()  # read: the engines' answer is the one raised
        node_side.cancel()
        raise
    await node_side


async def prepare_on_engines(node, spec: GrammarSpec, param: str, timeout_s: float) -> None:
    """Ask every engine process of ``node`` to compile ``spec`` (:class:`GrammarPrepare`, answered between
    steps while the engine's compile thread works) and wait, polling (:func:`~node.runtime.grammar_gate.until_ready`),
    until each has it, so the request is queued only once no step will compile it (an engine of the
    thread layout shares the node's cache; a tensor-parallel group answers for its first rank). An engine
    that is down, or dies meanwhile, is skipped (its successor is asked when a sequence lands on it:
    :mod:`node.runtime.grammar_gate`).

    Raises:
        APIError: 400 naming ``param`` when an engine cannot compile it or not within ``timeout_s`` of its
            grammar engine being up; 503 (Retry-After) when an engine's grammar cache is not built within
            :data:`GRAMMAR_START_TIMEOUT_S`.
    """
    waiting = [e.runner for e in getattr(node, "engines", ())
               if not isinstance(e.runner, LocalEngine) and e.failure is None and not is_prepared(e.runner, spec)]
    replies = await asyncio.gather(*(until_ready(h, GrammarPrepare(spec), timeout_s) for h in waiting),
                                   return_exceptions=True)
    failed = [r for r in replies if isinstance(r, GrammarFailed)]  # anything else: the engine died (its supervisor's)
    for r in sorted(failed, key=lambda r: r.status):  # a grammar's own error first
        if r.status == 503:
            raise APIError(503, f"{param}: {r}", code="service_unavailable", headers=retry_after(5))
        raise bad_request(f"{param}: {r}", param=param)


async def structured(node, req, tools: GrammarSpec | None = None) -> GrammarSpec | None:
    """:func:`grammar_spec` then :func:`check_grammar`: the checked spec, or None. ``tools``: the grammar of
    a required or named tool choice (:mod:`node.api.tool_calls`), checked instead (param ``tools``)."""
    found = grammar_spec(req) if tools is None else (tools, "tools")
    if found is None:
        return None
    await check_grammar(node, *found)
    return found[0]
