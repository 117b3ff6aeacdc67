"""The text fields of a chat reply: ``content``, ``reasoning_content`` (``--reasoning-parser``) and the
echoed last message (``echo``), for whole replies and for stream deltas alike."""

from __future__ import annotations

from node.api.reasoning import ReasoningSplitter, prompt_opens_thinking
from node.protocol import ChatCompletionRequest
from node.worker.tokenizer import TextTokenizer

_PROMPT_TAIL_TOKENS = 32  # enough of the prompt's end to see a template's opening <think>


def echo_text(req: ChatCompletionRequest) -> str | None:
    """What ``echo`` puts before the reply: the last message's text when the reply continues it (it is
    the assistant's, or no new turn is started: ``add_generation_prompt=false``), as vLLM does; else None."""
    if not req.echo:
        return None
    last = req.messages[-1]
    if req.add_generation_prompt and last.role != "assistant":
        return None
    content = last.content
    if isinstance(content, list):
        content = "\n".join(part.text or "" for part in content)
    return content or None


class ChatContent:
    """Shapes one chat request's text into message fields.

    Args:
        req: the request (``echo``, ``include_reasoning``).
        parser: the node's ``--reasoning-parser`` (None: the text is all ``content``).
        tok, prompt_ids: to see whether the rendered prompt left a ``<think>`` open.
    """

    def __init__(self, req: ChatCompletionRequest, parser: str | None, tok: TextTokenizer, prompt_ids: list[int]):
        self.echo = echo_text(req)
        self.parser = parser
        self.include_reasoning = req.include_reasoning
        self.open_at_start = parser is not None and prompt_opens_thinking(
            tok.decode(prompt_ids[-_PROMPT_TAIL_TOKENS:], skip_special_tokens=False))
        self._splitters: dict[int, ReasoningSplitter] = {}

    def _splitter(self, index: int) -> ReasoningSplitter:
        sp = self._splitters.get(index)
        if sp is None:
            sp = self._splitters[index] = ReasoningSplitter(self.parser, self.open_at_start)
        return sp

    def split(self, index: int, text: str, ending: bool) -> tuple[str, str]:
        """Choice ``index``'s new ``text`` (``ending``: its last) as ``(reasoning, content)`` text that
        became final (without a parser: all content). The content goes on to the tool-call parser."""
        if self.parser is None:
            return "", text
        sp = self._splitter(index)
        reasoning, content = sp.feed(text)
        if ending:
            r, c = sp.finish()
            reasoning, content = reasoning + r, content + c
        return reasoning, content

    def with_reasoning(self, delta: dict, reasoning: str) -> dict:
        """A stream delta with its ``reasoning_content`` (unless ``include_reasoning`` is false)."""
        return {"reasoning_content": reasoning, **delta} if reasoning and self.include_reasoning else delta

    def split_whole(self, text: str) -> tuple[str | None, str]:
        """A whole reply's ``(reasoning, content)`` (reasoning None when empty or without a parser)."""
        if self.parser is None:
            return None, text
        reasoning, content = ReasoningSplitter(self.parser, self.open_at_start).split(text)
        return reasoning, content or ""

    def finish_message(self, msg: dict, reasoning: str | None) -> dict:
        """The whole message with the echoed text before its content and, with a parser, its
        ``reasoning_content`` (content null when empty, as vLLM's)."""
        if self.echo:
            msg["content"] = self.echo + (msg.get("content") or "")
        if self.parser is not None:
            msg["content"] = msg.get("content") or None
            msg["reasoning_content"] = reasoning if self.include_reasoning else None
        return msg

    def first_deltas(self) -> list[dict]:
        """Deltas before any token: the role, then the echoed text if any."""
        first = [{"role": "assistant", "content": ""}]
        return first + ([{"content": self.echo}] if self.echo else [])
