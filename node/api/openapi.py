"""The node's OpenAPI 3.1 document (``GET /openapi.json``), generated from the msgspec types that
validate the requests, so the document and the validation cannot drift apart.

Request bodies are the JSON Schemas msgspec derives from :mod:`node.protocol`
(``msgspec.json.schema_components``); responses name their status codes and the OpenAI error body
shared by every 4xx/5xx. Clients and fuzzers (``tests/test_fuzz_api.py`` drives it with
Schemathesis) read it as FastAPI-based servers' ``/openapi.json`` is read.
"""
from __future__ import annotations

import msgspec

from node.api.tokenize import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from node.protocol import ChatCompletionRequest, CompletionRequest, PeerChange

_REF = "#/components/schemas/{name}"

ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}


def _json(description: str, schema: dict | None = None) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema or {"type": "object"}}}}


def _errors(*codes: int) -> dict:
    words = {400: "invalid request (OpenAI error body)", 401: "missing or wrong API key (--api-key)",
             404: "unknown model", 408: "request body too slow", 409: "not possible in this node's mode",
             413: "body larger than the limit", 415: "not JSON", 503: "unavailable now (Retry-After)"}
    return {str(c): _json(words[c], {"$ref": _REF.format(name="Error")}) for c in codes}


def _generate(kind: type, summary: str) -> dict:
    return {"post": {
        "summary": summary, "security": [{"bearer": []}, {}],
        "requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": _REF.format(name=kind.__name__)}}}},
        "responses": {"200": {"description": "the completion (JSON), or its chunks as server-sent events with stream=true",
                              "content": {"application/json": {"schema": {"type": "object"}},
                                          "text/event-stream": {"schema": {"type": "string"}}}},
                      **_errors(400, 401, 404, 408, 413, 415, 503)}}}


def _tokenizer_route(summary: str, schema: dict) -> dict:
    return {"post": {"summary": summary, "security": [{"bearer": []}, {}],
                     "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
                     "responses": {"200": _json("the answer"), **_errors(400, 401, 404, 408, 413, 415)}}}


def openapi_document(model_name: str, version: str) -> dict:
    """The OpenAPI 3.1 document of this node's HTTP API (a JSON-able dict).

    Args:
        model_name: the served model's name (shown in the description).
        version: shiftnode's version (``info.version``).
    """
    _, components = msgspec.json.schema_components(
        [CompletionRequest, ChatCompletionRequest, PeerChange, TokenizeCompletionRequest, TokenizeChatRequest,
         DetokenizeRequest], ref_template=_REF)
    components["Error"] = ERROR
    node_get = {"get": {"summary": "the node's state: mode, devices and their roles, queue, KV, peers",
                        "security": [{"bearer": []}, {}],
                        "parameters": [{"name": "since", "in": "query", "required": False, "schema": {"type": "number"},
                                        "description": "a clock_s of an earlier answer: only the switch and transfer "
                                                       "records that ended after it"}],
                        "responses": {"200": _json("node status"), **_errors(400, 401)}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "shiftnode", "version": version,
                 "description": f"OpenAI-compatible completions and chat completions of {model_name}, and the node's "
                                "own routes. /v1/* need 'Authorization: Bearer KEY' when the node runs with --api-key."},
        "components": {"schemas": components,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "paths": {
            "/v1/completions": _generate(CompletionRequest, "text completion (OpenAI legacy completions)"),
            "/v1/chat/completions": _generate(ChatCompletionRequest, "chat completion"),
            "/tokenize": _tokenizer_route("token ids of a text prompt or of chat messages rendered by the chat "
                                          "template (vLLM's shape: count, max_model_len, tokens, token_strs)",
                                          {"oneOf": [{"$ref": _REF.format(name="TokenizeCompletionRequest")},
                                                     {"$ref": _REF.format(name="TokenizeChatRequest")}]}),
            "/detokenize": _tokenizer_route("the text of token ids (vLLM's shape: prompt)",
                                            {"$ref": _REF.format(name="DetokenizeRequest")}),
            "/v1/models": {"get": {"summary": "the served model", "security": [{"bearer": []}, {}],
                                   "responses": {"200": _json("model list"), **_errors(401)}}},
            "/v1/models/{model}": {"get": {"summary": "the served model's card", "security": [{"bearer": []}, {}],
                                           "parameters": [{"name": "model", "in": "path", "required": True,
                                                           "schema": {"type": "string"}}],
                                           "responses": {"200": _json("model"), **_errors(401, 404)}}},
            "/v1/node": node_get,
            "/v1/node/peers": {"post": {
                "summary": "add and remove KV peers (host:port) at run time", "security": [{"bearer": []}, {}],
                "requestBody": {"required": True, "content": {"application/json": {
                    "schema": {"$ref": _REF.format(name="PeerChange")}}}},
                "responses": {"200": _json("the peers after the change"), **_errors(400, 401, 409)}}},
            "/v1/node/drain": {"post": {
                "summary": "stop taking requests and move every decoding sequence to the peers (time-shared)",
                "security": [{"bearer": []}, {}],
                "responses": {"200": _json("draining"), **_errors(401, 409)}}},
            "/health": {"get": {"summary": "ok / degraded (200) or unavailable (503, Retry-After)",
                                "responses": {"200": _json("serving"), "503": _json("cannot serve now")}}},
            "/metrics": {"get": {"summary": "Prometheus metrics",
                                 "responses": {"200": {"description": "text exposition format",
                                                       "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
            "/dashboard": {"get": {"summary": "the live role dashboard (HTML; the key as ?key= once, or a form)",
                                   "parameters": [{"name": "key", "in": "query", "required": False,
                                                   "schema": {"type": "string"}}],
                                   "responses": {"200": {"description": "the page",
                                                         "content": {"text/html": {"schema": {"type": "string"}}}},
                                                 "401": {"description": "the key form (browsers) or the JSON error",
                                                         "content": {"text/html": {"schema": {"type": "string"}}}}}}},
            "/openapi.json": {"get": {"summary": "this document", "responses": {"200": _json("OpenAPI 3.1")}}},
        },
    }
