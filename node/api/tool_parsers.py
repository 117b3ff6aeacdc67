"""Tool calls read out of generated text, whole or while it streams.

The formats (``--tool-call-parser``, vLLM's names):

* ``hermes`` (Qwen2.5, Qwen3, Hermes): each call is ``<tool_call>{"name": .., "arguments": {..}}</tool_call>``;
  text before the first tag is the message's content.
* ``llama3_json`` (Llama 3.x): the output is a call object ``{"name": .., "parameters": {..}}`` (optionally
  after ``<|python_tag|>``), or several separated by ``;``; an output that does not start with one is content.
* ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name": .., "arguments": {..}}``.

Without ``--tool-call-parser`` the parser is taken from the chat template where that is unambiguous
(:func:`detect_parser`).

``tool_choice`` ``required`` and named choices are constrained by a grammar instead
(:mod:`node.api.tool_calls`): the output is a JSON list of ``{"name", "parameters"}`` objects
(``list``), or just the named function's arguments object (``named``), whatever the model family.

Streaming follows OpenAI: a call's first delta carries its ``index``, ``id``, ``type`` and the function
``name`` (with empty ``arguments``), later deltas carry argument fragments, which concatenate to the
arguments exactly as the model wrote them. The name is read with ``partial-json-parser`` (a string
counts only once closed); the arguments' span is found by a bracket scan of the call object.

What the model wrote freely (``hermes``, ``llama3_json``, ``mistral``) is a call only when its object is
valid JSON naming a declared tool, with arguments that are a JSON object (absent: ``{}``), as vLLM's
parsers require; so that a stream never sends a call the whole reply would reject, such a call's deltas
are held until its object closes and passes (its name delta, then its arguments in one delta). A
rejected call's text stays content: after the text before the calls, each rejected call's object, in
order (one left open at the end included); when no call passes, the whole output is content. The grammar
kinds' (``list``, ``named``) output is valid by construction: their argument fragments are sent as they
come.
"""

from __future__ import annotations

import json
import uuid

import partial_json_parser
from partial_json_parser import Allow

PARSERS = ("hermes", "llama3_json", "mistral")
_ARG_KEYS = ("arguments", "parameters")


_TEMPLATE_MARKS = {"hermes": ("<tool_call>",), "mistral": ("[TOOL_CALLS]",),
                   "llama3_json": ("<|start_header_id|>", "ipython")}


def detect_parser(template: str | None) -> str | None:
    """The parser a chat template's own markers name, when exactly one family's are there (its
    ``<tool_call>`` tags, Mistral's ``[TOOL_CALLS]``, or Llama 3's headers with the ``ipython`` role);
    else None."""
    found = [name for name, marks in _TEMPLATE_MARKS.items() if template and all(m in template for m in marks)]
    return found[0] if len(found) == 1 else None


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def scan_object(text: str, start: int) -> tuple[int | None, dict[str, tuple[int, int | None]]]:
    """Scan the JSON object opening at ``text[start] == "{"``: ``(end, fields)`` where ``end`` is the
    index after its closing brace (None while incomplete) and ``fields`` maps each top-level key seen
    to its value's span ``(begin, end)`` (``end`` None while the value is incomplete)."""
    fields: dict[str, tuple[int, int | None]] = {}
    depth, i, n = 0, start, len(text)
    key_start = key = value_start = None
    in_str = esc = False
    while i < n:
        c = text[i]
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
                if depth == 1 and key is None and key_start is not None:
                    try:
                        key = json.loads(text[key_start : i + 1])
                    except ValueError:
                        key = ""
                elif depth == 1 and value_start is not None and key is not None:  # a string value closed
                    fields[key] = (value_start, i + 1)
        elif c == '"':
            in_str = True
            if depth == 1 and key is None:
                key_start = i
            elif depth == 1 and value_start is None and key is not None:
                value_start = i
                fields[key] = (i, None)
        elif c in "{[":
            if depth == 1 and value_start is None and key is not None:
                value_start = i
                fields[key] = (i, None)
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 1 and key is not None and value_start is not None:
                fields[key] = (value_start, i + 1)
            if depth == 0:
                _close_scalar(text, fields, key, value_start, i)
                return i + 1, fields
        elif c == "," and depth == 1:
            _close_scalar(text, fields, key, value_start, i)
            key_start = key = value_start = None
        elif c == ":" and depth == 1:
            pass
        elif depth == 1 and key is not None and value_start is None and not c.isspace():
            value_start = i  # a number, true, false or null
            fields[key] = (i, None)
        i += 1
    return None, fields


def _close_scalar(text: str, fields: dict, key: str | None, value_start: int | None, i: int) -> None:
    if key is not None and value_start is not None and fields.get(key, (0, 0))[1] is None:
        fields[key] = (value_start, len(text[:i].rstrip()))


class _Call:
    __slots__ = ("start", "end", "id", "name", "args", "sent_name", "sent_args", "valid")

    def __init__(self, start: int):
        self.start = start
        self.end: int | None = None
        self.id = call_id()
        self.name: str | None = None
        self.args = ""  # the arguments' text known so far
        self.sent_name = False
        self.sent_args = 0
        self.valid: bool | None = None  # a freely written call's verdict, once its object closed


class ToolCallParser:
    """Reads tool calls from one choice's text as it grows.

    Args:
        kind: one of :data:`PARSERS`, ``list`` or ``named``.
        name: the function of a ``named`` choice.
        declared: the names of the request's tools; a freely written call naming another is content.

    :meth:`feed` takes each text delta and returns the content delta and the ``delta.tool_calls``
    entries it makes due; :meth:`result` gives the whole message's ``(content, tool_calls)``.
    """

    def __init__(self, kind: str, name: str | None = None, declared: frozenset[str] | None = None):
        self.kind = kind
        self.named = name
        self.declared = declared  # the request's tool names (None: any name)
        self.checked = kind in PARSERS  # freely written calls: each validated before it is sent
        self.pending: list[str] = []  # rejected calls' texts, while no call has passed
        self.text = ""
        self.region: int | None = 0 if kind in ("list", "named") else None  # where the calls begin
        self.content_sent = 0
        self.calls: list[_Call] = []
        self.scan_from = 0  # where the next call object may begin

    # --- where the calls begin ----------------------------------------------------------------
    def _find_region(self) -> None:
        t = self.text
        if self.kind == "hermes":
            at = t.find("<tool_call>")
            if at >= 0:
                self.region = at
        elif self.kind == "mistral":
            at = t.find("[TOOL_CALLS]")
            if at >= 0:
                self.region = at
        elif self.kind == "llama3_json":
            s = t.lstrip()
            if s.startswith("<|python_tag|>") or s.startswith("{"):
                self.region = len(t) - len(s)
        if self.region is not None:
            self.scan_from = self.region

    def _held(self) -> int:
        """Characters at the end of the text to hold back: they may begin the calls' marker."""
        t = self.text
        if self.kind == "llama3_json":
            s = t.lstrip()  # blanks, or a beginning of the tag, so far: a call may still begin
            return len(t) if "<|python_tag|>".startswith(s) else 0
        marker = "<tool_call>" if self.kind == "hermes" else "[TOOL_CALLS]"
        for k in range(min(len(marker) - 1, len(t)), 0, -1):
            if t.endswith(marker[:k]):
                return k
        return 0

    # --- the calls --------------------------------------------------------------------------------
    def _scan(self) -> None:
        t = self.text
        if self.kind == "named":
            if not self.calls:
                self.calls.append(_Call(0))
                self.calls[0].name = self.named
            c = self.calls[0]
            c.args = t
            return
        while True:
            if self.calls and self.calls[-1].end is None:
                c = self.calls[-1]
            else:
                at = t.find("{", self.scan_from)
                if at < 0:
                    return
                c = _Call(at)
                self.calls.append(c)
            end, fields = scan_object(t, c.start)
            raw = t[c.start : end if end is not None else len(t)]
            if c.name is None:
                try:
                    head = partial_json_parser.loads(raw, Allow.ALL & ~Allow.STR) if raw else {}
                except Exception:  # noqa: BLE001 (the library raises several kinds): malformed, no name
                    head = {}
                name = head.get("name") if isinstance(head, dict) else None
                c.name = name if isinstance(name, str) else None
            span = next((fields[k] for k in _ARG_KEYS if k in fields), None)
            if span is not None:
                b, e = span
                value = t[b : e if e is not None else len(t)]
                if t[b] == '"':  # arguments written as a JSON string: known once the string closes
                    try:
                        c.args = json.loads(value) if e is not None else ""
                    except ValueError:  # not a JSON string: the call fails its check
                        c.args = ""
                else:
                    c.args = value
            c.end = end
            if end is None:
                return
            self.scan_from = end

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        """Add ``delta``; return ``(content delta, tool-call deltas)``."""
        self.text += delta
        if self.region is None:
            self._find_region()
        if self.region is None:
            upto = len(self.text) - self._held()
        else:
            upto = self.region
        content = self.text[self.content_sent : upto] if upto > self.content_sent else ""
        self.content_sent = max(self.content_sent, upto)
        if self.region is None:
            return content, []
        self._scan()
        out = []
        index = 0
        for c in self.calls:
            if self.checked:
                if c.end is None:
                    break  # held until its object closes: it may yet fail
                if c.valid is None:
                    c.valid = self._check(c)
                    if not c.valid:
                        self.pending.append(self.text[c.start : c.end])
                if not c.valid:
                    if any(x.valid for x in self.calls):
                        content += "".join(self.pending)  # a call passed: rejected texts are content now
                        self.pending.clear()
                    continue
                content += "".join(self.pending)  # those rejected before the first call that passed
                self.pending.clear()
            if c.name is None:
                break  # name first: later calls wait too, so indices go out in order
            if not c.sent_name:
                c.sent_name = True
                out.append({"index": index, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": ""}})
            if len(c.args) > c.sent_args:
                out.append({"index": index, "function": {"arguments": c.args[c.sent_args :]}})
                c.sent_args = len(c.args)
            index += 1
        return content, out

    def _check(self, c: _Call) -> bool:
        """Whether the closed call object ``c`` is a call (module docstring); fills in absent arguments."""
        try:
            obj = json.loads(self.text[c.start : c.end])
        except ValueError:
            return False
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return False
        if self.declared is not None and obj["name"] not in self.declared:
            return False
        if not any(k in obj for k in _ARG_KEYS):
            c.args = "{}"
        try:
            return isinstance(json.loads(c.args), dict)
        except ValueError:
            return False

    def flush(self) -> str:
        """At the end: text held back as a possible marker, and, when no call came, the whole region
        (for freely written calls: when none passed; else the object of one left open)."""
        if not self._made_calls():
            rest = self.text[self.content_sent :]
        elif self.checked and self.calls[-1].end is None:
            rest = self.text[self.calls[-1].start :]
        else:
            rest = ""
        self.content_sent = len(self.text)
        return rest

    def _made_calls(self) -> bool:
        return any(c.valid for c in self.calls) if self.checked else any(c.name for c in self.calls)

    def result(self) -> tuple[str | None, list[dict]]:
        """The whole message: ``(content, tool_calls)`` in OpenAI's shape (content None when empty)."""
        if self.region is None:
            self._find_region()
        if self.region is not None:
            self._scan()
        if self.checked:
            for c in self.calls:
                if c.valid is None and c.end is not None:
                    c.valid = self._check(c)
            calls = [c for c in self.calls if c.valid]
        else:
            calls = [c for c in self.calls if c.name is not None]
        if not calls:
            return self.text, []
        content = self.text[: self.region] if self.region else ""
        if self.checked:  # rejected calls' objects (one left open included) stay content, in order
            content += "".join(self.text[c.start : c.end if c.end is not None else len(self.text)]
                               for c in self.calls if not c.valid)
        return (content or None), [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.args}}
                                   for c in calls]
