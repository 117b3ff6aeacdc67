"""Reasoning parsers (``--reasoning-parser``, vLLM's names): a model's ``<think>…</think>`` text goes to
the chat message's ``reasoning_content``, the rest to ``content``, whole or as stream deltas.

* ``deepseek_r1``: the template opens the thinking itself (DeepSeek-R1's ends the prompt with
  ``<think>\\n``), so everything before ``</think>`` is reasoning; a leading ``<think>`` is dropped.
* ``qwen3``: thinking is open when the output begins with ``<think>`` (after white space), or when the
  rendered prompt ends inside an unclosed ``<think>`` (templates that open it); Qwen3's
  ``enable_thinking=false`` renders a closed, empty ``<think></think>``, and the whole output is content.

One state machine serves both forms, fed the choice's text deltas (which never split a character, and
are already cut at stop strings), so a stream's deltas join to exactly the whole reply's fields. A
tag split over deltas is held back until it is complete or cannot be one. An output that ends (or is
cut by ``max_tokens``) inside the thinking is all reasoning: its ``content`` is null.
"""

from __future__ import annotations

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def prompt_opens_thinking(prompt_text: str) -> bool:
    """Whether ``prompt_text`` (a rendered chat prompt) ends inside a ``<think>`` it opened."""
    return prompt_text.rfind(START) > prompt_text.rfind(END)


class ReasoningSplitter:
    """Splits one choice's text into reasoning and content.

    Args:
        parser: one of :data:`PARSERS`.
        open_at_start: the prompt left the thinking open (:func:`prompt_opens_thinking`); ``deepseek_r1``
            always behaves so.

    Raises:
        ValueError: an unknown parser name.
    """

    def __init__(self, parser: str, open_at_start: bool = False):
        if parser not in PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r} (known: {', '.join(PARSERS)})")
        self.open_at_start = open_at_start or parser == "deepseek_r1"
        self.state = "start"  # start (a leading <think> may come) | reasoning | content
        self.held = ""

    def feed(self, delta: str) -> tuple[str, str]:
        """Take the next text delta; return the ``(reasoning, content)`` text that became final."""
        buf, reasoning, content = self.held + delta, [], []
        self.held = ""
        while buf:
            if self.state == "start":
                body = buf.lstrip()
                if body.startswith(START):
                    buf, self.state = body[len(START):], "reasoning"
                elif not body or START.startswith(body):
                    self.held = buf  # white space or part of "<think>": undecided yet
                    buf = ""
                else:
                    self.state = "reasoning" if self.open_at_start else "content"
            elif self.state == "reasoning":
                at = buf.find(END)
                if at >= 0:
                    reasoning.append(buf[:at])
                    buf, self.state = buf[at + len(END):], "content"
                else:
                    keep = _partial_suffix(buf, END)
                    reasoning.append(buf[: len(buf) - keep])
                    self.held, buf = buf[len(buf) - keep:], ""
            else:
                content.append(buf)
                buf = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The text still held at the end of the output, as ``(reasoning, content)``."""
        held, self.held = self.held, ""
        if self.state == "start":
            self.state = "reasoning" if self.open_at_start else "content"
        return (held, "") if self.state == "reasoning" else ("", held)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole reply's ``(reasoning_content, content)``, each None when empty (as vLLM's message)."""
        r1, c1 = self.feed(text)
        r2, c2 = self.finish()
        reasoning, content = r1 + r2, c1 + c2
        return reasoning or None, content or None
