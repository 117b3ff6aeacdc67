"""The console log line (node.log.ConsoleLines) is structlog's ConsoleRenderer(colors=False) line, made cheaper."""

from __future__ import annotations

import random
import time

import structlog

from node.log import ConsoleLines

LEVELS = ["debug", "info", "warning", "error", "critical", "exception", "notset"]
VALUES = ["cpu:0", "chunks_fit", "two words", "a=b", 'say "hi"', "it's", "line\nbreak", "", 0, 3, -1.5, 1234567.456789,
          0.0, True, None, {"cpu:0": 1}, [1, 2], ("a", 3), float("inf")]


def test_the_line_is_the_console_renderers_line():
    rng = random.Random(3)
    full, fast = structlog.dev.ConsoleRenderer(colors=False), ConsoleLines()
    for _ in range(500):
        ed = {f"k{rng.randrange(40)}": rng.choice(VALUES) for _ in range(rng.randrange(0, 12))}
        if rng.random() < 0.95:
            ed["event"] = rng.choice(["role_switch", "request", "a_rather_long_event_name_past_thirty_chars", "", 7])
        if rng.random() < 0.95:
            ed["level"] = rng.choice(LEVELS)
        if rng.random() < 0.95:
            ed["timestamp"] = "2026-12-04T21:30:00.724329Z"
        assert fast(None, "info", dict(ed)) == full(None, "info", dict(ed)), ed


def test_tracebacks_and_logger_names_go_to_the_console_renderer():
    full, fast = structlog.dev.ConsoleRenderer(colors=False), ConsoleLines()
    for extra in ({"exception": "Traceback (most recent call last):\n  boom"}, {"stack": "Stack (most recent call last)"},
                  {"logger": "shiftnode.engine"}, {"logger_name": "x"}):
        ed = {"event": "engine_listener_failed", "level": "error", "device": "cpu:0", **extra}
        assert fast(None, "error", dict(ed)) == full(None, "error", dict(ed))


def test_a_ten_key_line_costs_a_fraction_of_the_console_renderers():
    """Logging runs on the node's control loop (a request line each, two free role switches per request in
    adaptive mode); the renderer dominated it. Timed in one run, interleaved, best of five."""
    full, fast = structlog.dev.ConsoleRenderer(colors=False), ConsoleLines()
    ed = dict(event="role_switch", level="info", timestamp="2026-12-04T21:30:00.724329Z", device="cpu:0",
              from_role="decode", to_role="mixed", reason="chunks_fit", start_s=1234567.456789, end_s=1234567.456789,
              drain_ms=0.0, swap_ms=0.0, pause_ms=0.0, steps=3)

    def best(render):
        out = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(300):
                render(None, "info", dict(ed))
            out.append(time.perf_counter() - t)
        return min(out)

    assert best(fast) < 0.5 * best(full)
