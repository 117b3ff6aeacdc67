"""Tool calling on ``/v1/chat/completions``: what a request's ``tools`` and ``tool_choice`` ask for, the
history's calls and results in the shape chat templates read, and the reply's ``tool_calls``.

``tool_choice``:

* ``none``: the tools reach the template, the output is plain content.
* ``auto`` (the default with tools): the output is read by the node's ``--tool-call-parser``, or the
  parser the chat template's markers name (:mod:`node.api.tool_parsers`); without either it is a 400.
* ``required``: the output is constrained by a grammar (:mod:`node.worker.grammar`) to a JSON list of
  ``{"name": <one of the tools>, "parameters": <its schema>}`` (one item at most when
  ``parallel_tool_calls`` is false), whatever the model family, as vLLM does.
* a named function: the output is constrained to that function's arguments (its ``parameters`` schema).

Arguments in the history (``tool_calls[].function.arguments``, JSON text in OpenAI's API) are given to
the template as objects, which is what Hugging Face chat templates expect (they write them with
``tojson``); an argument text that is not JSON stays text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from node.api.errors import bad_request
from node.api.tool_parsers import PARSERS, ToolCallParser, detect_parser
from node.core.grammar_spec import GrammarSpec
from node.protocol import ChatCompletionRequest, ChatMessage
from node.protocol_tools import NamedToolChoice, Tool

# a function without ``parameters`` takes none (OpenAI: an empty parameter list), so its arguments are "{}"
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass
class ToolPlan:
    """What a chat request's tools mean for it.

    Attributes:
        tools: the tools as the template receives them (OpenAI's JSON shape), or None.
        grammar: the constraint of a ``required`` or named choice, else None.
        parser: the :class:`ToolCallParser` kind reading the output (None: plain content).
        named: the function of a named choice.
    """

    tools: list[dict] | None = None
    grammar: GrammarSpec | None = None
    parser: str | None = None
    named: str | None = None

    def new_parser(self) -> ToolCallParser | None:
        if self.parser is None:
            return None
        return ToolCallParser(self.parser, self.named, frozenset(t["function"]["name"] for t in self.tools or ()))


def _schema(params: dict | None) -> dict:
    return params if params else NO_PARAMETERS


def template_tools(tools: list[Tool]) -> list[dict]:
    """``tools`` as chat templates read them: OpenAI's JSON shape, absent keys left out."""
    return [{"type": "function", "function": {k: v for k, v in (("name", t.function.name),
                                                                ("description", t.function.description),
                                                                ("parameters", t.function.parameters)) if v is not None}}
            for t in tools]


def plan_tools(req: ChatCompletionRequest, parser: str | None, template: str | None = None) -> ToolPlan:
    """Check ``tools``/``tool_choice``/``parallel_tool_calls`` and say how the request is served.

    Args:
        req: the decoded chat request.
        parser: the node's ``--tool-call-parser`` (None: the one ``template``, the chat template, names, if any).

    Raises:
        APIError: 400 for a choice other than ``none`` or ``parallel_tool_calls`` without tools, a named function that is not among them, duplicate
            names, ``auto`` with tools on a node without a parser, or a grammar choice beside another
            structured-output form.
    """
    choice = req.tool_choice
    if not req.tools:  # as vLLM: "none" (which changes nothing here) is served, any other choice needs tools
        if choice is not None and choice != "none":
            raise bad_request("tool_choice is only allowed when tools are given", param="tool_choice")
        if req.parallel_tool_calls is not None:
            raise bad_request("parallel_tool_calls is only allowed when tools are given", param="parallel_tool_calls")
        return ToolPlan()
    tools = template_tools(req.tools)
    names = [t.function.name for t in req.tools]
    if len(set(names)) != len(names):
        raise bad_request("tools must have distinct function names", param="tools")
    if choice is None:
        choice = "auto"
    if choice == "none":
        return ToolPlan(tools)
    if choice == "auto":
        parser = parser or detect_parser(template)
        if parser is None:
            raise bad_request("tool_choice \"auto\" needs a node started with --tool-call-parser "
                              f"({', '.join(PARSERS)}); use \"required\", a named function or \"none\"", param="tool_choice")
        return ToolPlan(tools, parser=parser)
    if req.response_format is not None and req.response_format.type != "text" or req.structured_outputs is not None \
            or any(getattr(req, f) is not None for f in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")):
        raise bad_request("a required or named tool_choice cannot be combined with another structured output",
                          param="tool_choice")
    if req.stop:  # a stop string inside the calls' JSON would cut them off and hand the raw JSON back as content
        raise bad_request("a required or named tool_choice cannot be combined with stop strings", param="stop")
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        fn = next((t.function for t in req.tools if t.function.name == name), None)
        if fn is None:
            raise bad_request(f"tool_choice names the function {name!r}, which is not among the tools "
                              f"({', '.join(names)})", param="tool_choice")
        return ToolPlan(tools, GrammarSpec("json_schema", json.dumps(_schema(fn.parameters))), "named", name)
    items = [{"type": "object", "properties": {"name": {"const": t.function.name}, "parameters": _schema(t.function.parameters)},
              "required": ["name", "parameters"]} for t in req.tools]
    schema = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if req.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return ToolPlan(tools, GrammarSpec("json_schema", json.dumps(schema)), "list")


def template_message(m: ChatMessage, content: str) -> dict:
    """One history message as chat templates read it: ``role``, ``content``, and where present ``name``,
    ``tool_calls`` (arguments as objects) and ``tool_call_id``."""
    out: dict = {"role": m.role, "content": content}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                             for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def _arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def finish_reason(reason: str | None, tool_calls: list | bool) -> str | None:
    """``tool_calls`` when the output ended by itself (``stop``) having made calls; else ``reason``."""
    return "tool_calls" if reason == "stop" and tool_calls else reason


class ChatToolOutput:
    """A chat reply's choices: their tool calls read as their text arrives (one parser per choice), or,
    when the plan reads none, their plain content."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.parsers: dict[int, ToolCallParser] = {}

    def _parser(self, index: int) -> ToolCallParser:
        p = self.parsers.get(index)
        if p is None:
            p = self.parsers[index] = self.plan.new_parser()
        return p

    def delta(self, index: int, text: str, finish: str | None) -> tuple[dict, str | None]:
        """A stream chunk's ``delta`` fields (``content``, ``tool_calls``) for ``text``, and its
        finish reason (``tool_calls`` once calls were made)."""
        if self.plan.parser is None:
            return ({"content": text} if text or finish is None else {}), finish
        p = self._parser(index)
        content, calls = p.feed(text)
        if finish is not None:
            content += p.flush()
        delta: dict = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = calls
        return delta, finish_reason(finish, any(c.sent_name for c in p.calls))

    def message(self, index: int, text: str, finish: str | None) -> tuple[dict, str | None]:
        """The whole message (``role``, ``content``, ``tool_calls`` when any) of the choice whose text is
        ``text``, and its finish reason."""
        if self.plan.parser is None:
            return {"role": "assistant", "content": text}, finish
        content, calls = self._parser(index).result()
        msg: dict = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = calls
        return msg, finish_reason(finish, calls)
