"""Request types of structured output (OpenAI's ``response_format``, vLLM's ``structured_outputs``),
decoded strictly like the rest of :mod:`node.protocol` (a wrong type or an unknown key is a 400) and
turned into a grammar by :mod:`node.api.structured`."""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    """``response_format.json_schema``: the schema is enforced whether ``strict`` is set or not."""

    name: str = "response"
    schema: dict[str, Any] | bool | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct, kw_only=True, omit_defaults=True):
    """OpenAI's ``response_format``; ``structural_tag`` (with ``format``, or the older ``structures``
    and ``triggers``) is xgrammar's structural tag, as vLLM takes it."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    format: dict[str, Any] | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None


class StructuredOutputs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's ``structured_outputs``: exactly one of the constraints."""

    json: dict[str, Any] | bool | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict[str, Any] | str | None = None
    json_object: bool | None = None
