"""structlog set-up, done once per process: JSON lines or human-readable console output."""

from __future__ import annotations

import logging
import sys

import structlog

# keys structlog's console renderer lays out specially (tracebacks, logger names): left to it
_SPECIAL = frozenset({"stack", "exception", "exc_info", "logger", "logger_name"})
_QUOTE = frozenset(" \t=\r\n\"'")  # a string value holding any of these is shown as its repr


class ConsoleLines:
    """structlog's ``ConsoleRenderer(colors=False)`` line, built in one pass: ``timestamp [level] event
    key=value ...`` (level padded to the longest level name, event to 30 characters, keys sorted, a
    string value bare unless it holds a space, quote, ``=`` or line break).

    Why not the renderer itself: it formats each key through a column formatter and a ``StringIO``,
    ~45 µs a line with ten keys on this sandbox's CPU (~180 µs on a loaded node), and the node logs on
    its control loop: every request, and in adaptive mode two free role switches per request. This is
    ~4x cheaper for the same text (tests/test_log.py compares the two). An event with a traceback, a
    stack or a logger name goes to ``ConsoleRenderer`` as before.
    """

    def __init__(self) -> None:
        self._full = structlog.dev.ConsoleRenderer(colors=False)
        self._level_width = max(len(k) for k in self._full.get_default_level_styles(colors=False))

    def __call__(self, logger: object, name: str, event_dict: dict) -> str:
        if not _SPECIAL.isdisjoint(event_dict):
            return self._full(logger, name, event_dict)
        parts = []
        ts = event_dict.pop("timestamp", None)
        if ts is not None:
            parts.append(str(ts))
        level = event_dict.pop("level", None)
        if level is not None:
            parts.append(f"[{level:<{self._level_width}}]")
        if "event" in event_dict:
            parts.append(f"{event_dict.pop('event')!s:<30}")
        for key in sorted(event_dict):
            value = event_dict[key]
            if isinstance(value, str) and _QUOTE.isdisjoint(value):
                parts.append(f"{key}={value}")
            else:
                parts.append(f"{key}={value!r}")
        return " ".join(p for p in parts if p).rstrip(" ")


def configure_logging(fmt: str = "console", level: int = logging.INFO) -> None:
    """Route structlog (and stdlib logging) to stderr; ``fmt`` is ``json`` or ``console``."""
    renderer = structlog.processors.JSONRenderer() if fmt == "json" else ConsoleLines()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
