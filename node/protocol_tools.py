"""Request types of tool calling (OpenAI's ``tools``, ``tool_choice`` and the tool-call history),
decoded strictly like the rest of :mod:`node.protocol`; :mod:`node.api.tool_calls` serves them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

FunctionName = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]


class FunctionDef(msgspec.Struct, kw_only=True):
    """A callable function: ``parameters`` is its arguments' JSON schema (absent: any object)."""

    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionDef


class ChosenFunction(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    """``tool_choice`` naming one function: the output is that function's arguments."""

    type: Literal["function"] = "function"
    function: ChosenFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(msgspec.Struct, kw_only=True):
    """A call in an assistant message of the history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction
