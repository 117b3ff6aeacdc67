"""structlog set-up, done once per process: JSON lines or human-readable console output, at a level.

What INFO shows by default: start-up lines, the periodic stats line (:mod:`node.runtime.stats_log`),
warnings and errors. Lines written once per request, sequence hand-off or role switch are *request
lines*: their call sites write them only where :func:`request_lines` is true (``--log-requests``, or
``--log-level debug``), so a node under load keeps a readable console. The JSON format writes every
field of every line it writes.
"""

from __future__ import annotations

import logging
import sys
import warnings

import structlog

# keys structlog's console renderer lays out specially (tracebacks, logger names): left to it
_SPECIAL = frozenset({"stack", "exception", "exc_info", "logger", "logger_name"})
_QUOTE = frozenset(" \t=\r\n\"'")  # a string value holding any of these is shown as its repr
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
_request_lines = False  # set by configure_logging: --log-requests or --log-level debug


def request_lines() -> bool:
    """Whether this process writes request lines (per request, per hand-off, per role switch): with
    ``--log-requests`` or at ``--log-level debug``. Checked at the call site, so a line not written
    costs no event dict."""
    return _request_lines


class ConsoleLines:
    """structlog's ``ConsoleRenderer(colors=False)`` line, built in one pass: ``timestamp [level] event
    key=value ...`` (level padded to the longest level name, event to 30 characters, keys sorted, a
    string value bare unless it holds a space, quote, ``=`` or line break).

    Why not the renderer itself: it formats each key through a column formatter and a ``StringIO``,
    ~45 µs a line with ten keys on this sandbox's CPU (~180 µs on a loaded node), and the node logs on
    its control loop: every request, and in adaptive mode two free role switches per request. This is
    ~4x cheaper for the same text (tests/test_log.py compares the two). An event with a traceback, a
    stack or a logger name goes to ``ConsoleRenderer`` as before.

    An event carrying a ``summary`` (the stats line) is shown as its event and that text alone: the
    summary says what the other fields hold, which the JSON format writes as they are.
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
        if "summary" in event_dict:
            parts.append(str(event_dict["summary"]))
            return " ".join(p for p in parts if p).rstrip(" ")
        for key in sorted(event_dict):
            value = event_dict[key]
            if isinstance(value, str) and _QUOTE.isdisjoint(value):
                parts.append(f"{key}={value}")
            else:
                parts.append(f"{key}={value!r}")
        return " ".join(p for p in parts if p).rstrip(" ")


def configure_logging(fmt: str = "console", level: str = "info", log_requests: bool = False) -> None:
    """Route structlog (and stdlib logging) to stderr; ``fmt`` is ``json`` or ``console``; lines below
    ``level`` (a key of :data:`LEVELS`) are dropped; ``log_requests``: write request lines
    (:func:`request_lines`; at ``debug`` they are written anyway).

    Raises:
        KeyError: an unknown ``level``.
    """
    global _request_lines
    threshold = LEVELS[level]
    _request_lines = log_requests or threshold <= logging.DEBUG
    renderer = structlog.processors.JSONRenderer() if fmt == "json" else ConsoleLines()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(threshold),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(level=max(threshold, logging.WARNING), stream=sys.stderr)
    warnings.showwarning = _warning_to_log  # a library's Python warning (xgrammar's, torch's) as a log line


def _warning_to_log(message, category, filename, lineno, file=None, line=None) -> None:
    """``warnings.showwarning`` replaced: a warning the filters let through (once per place, by default)
    becomes a structlog ``python_warning`` line instead of raw text on stderr."""
    structlog.get_logger("shiftnode.warnings").warning(
        "python_warning", category=category.__name__, message=str(message), source=f"{filename}:{lineno}")
