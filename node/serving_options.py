"""Options of the OpenAI front door, with vLLM's flag names: the chat template, the reasoning parser,
the scheduling policy and CORS. Kept apart from :class:`node.config.NodeConfig`'s engine and mode
settings, which holds them as ``config.serving``."""

from __future__ import annotations

import argparse
from pathlib import Path

import msgspec

REASONING_PARSERS = ("deepseek_r1", "qwen3")  # node.api.reasoning.PARSERS (checked equal by a test)
SCHEDULING_POLICIES = ("fcfs", "priority")


class ServingOptions(msgspec.Struct, kw_only=True):
    """The front door's options (units and defaults as vLLM's flags).

    ``chat_template``: a path to a Jinja template (or the template itself, when it is not a file) that
    replaces the checkpoint's. ``reasoning_parser``: a name of :data:`REASONING_PARSERS` or None.
    ``scheduling_policy``: ``fcfs`` (arrival order) or ``priority`` (a request's ``priority``, lower
    first, then arrival). CORS: ``allowed_origins`` empty means no CORS headers (browsers on other
    origins are refused by the browser); ``["*"]`` allows any.
    """

    chat_template: str | None = None
    reasoning_parser: str | None = None
    scheduling_policy: str = "fcfs"
    allowed_origins: list[str] = msgspec.field(default_factory=list)
    allowed_methods: list[str] = msgspec.field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = msgspec.field(default_factory=lambda: ["*"])
    allow_credentials: bool = False

    def template_text(self) -> str | None:
        """The override template's text: the file's, or the option itself when no such file exists
        and it reads as a template (has ``{``), as vLLM's ``--chat-template``.

        Raises:
            ValueError: neither a readable file nor a template.
        """
        if self.chat_template is None:
            return None
        path = Path(self.chat_template)
        try:
            if path.is_file():
                return path.read_text()
        except OSError as e:
            raise ValueError(f"--chat-template {self.chat_template}: {e}") from e
        if "{" in self.chat_template:
            return self.chat_template
        raise ValueError(f"--chat-template {self.chat_template}: no such file (and not a template)")


def _names(text: str) -> list[str]:
    """A JSON list (vLLM's form, ``'["https://a.example"]'``) or a comma-separated list."""
    text = text.strip()
    if text.startswith("["):
        try:
            value = msgspec.json.decode(text, type=list[str])
        except msgspec.MsgspecError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list of strings: {text!r} ({e})") from None
        return value
    return [t.strip() for t in text.split(",") if t.strip()]


def add_serving_arguments(p: argparse.ArgumentParser) -> None:
    """Add the front door's flags to ``shiftnode serve``'s parser."""
    g = p.add_argument_group("OpenAI front door (vLLM's flags)")
    g.add_argument("--chat-template", default=None, metavar="PATH",
                   help="a Jinja chat template file (or the template itself) replacing the checkpoint's")
    g.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="split <think>...</think> into the chat message's reasoning_content")
    g.add_argument("--scheduling-policy", default="fcfs", choices=SCHEDULING_POLICIES,
                   help="fcfs: arrival order; priority: a request's priority (lower first), then arrival")
    g.add_argument("--allowed-origins", type=_names, default=[], metavar="LIST",
                   help="CORS origins, e.g. '[\"https://app.example\"]' or '*' (default: no CORS headers)")
    g.add_argument("--allowed-methods", type=_names, default=["*"], metavar="LIST", help="CORS methods (default *)")
    g.add_argument("--allowed-headers", type=_names, default=["*"], metavar="LIST", help="CORS headers (default *)")
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow cookies and Authorization")


def serving_options_from_args(a: argparse.Namespace) -> ServingOptions:
    """The :class:`ServingOptions` of parsed ``serve`` flags."""
    return ServingOptions(chat_template=a.chat_template, reasoning_parser=a.reasoning_parser,
                          scheduling_policy=a.scheduling_policy, allowed_origins=a.allowed_origins,
                          allowed_methods=a.allowed_methods, allowed_headers=a.allowed_headers,
                          allow_credentials=a.allow_credentials)
