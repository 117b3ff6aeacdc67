"""The console log line (node.log.ConsoleLines) is structlog's ConsoleRenderer(colors=False) line, made cheaper;
the levels, the request lines behind --log-requests, and the periodic stats line (node.runtime.stats_log)."""

from __future__ import annotations

import json
import random
import time

import pytest
import structlog

from node.log import ConsoleLines, configure_logging, request_lines
from node.runtime.stats_log import StatsSample, stats_fields
from support import NodeProcess, post_concurrently, up

LEVELS = ["debug", "info", "warning", "error", "critical", "exception", "notset"]
VALUES = ["cpu:0", "chunks_fit", "two words", "a=b", 'say "hi"', "it's", "line\nbreak", "", 0, 3, -1.5, 1234567.456789,
          0.0, True, None, {"cpu:0": 1}, [1, 2], ("a", 3), float("inf")]


@pytest.mark.quick
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


@pytest.mark.quick
def test_tracebacks_and_logger_names_go_to_the_console_renderer():
    full, fast = structlog.dev.ConsoleRenderer(colors=False), ConsoleLines()
    for extra in ({"exception": "Traceback (most recent call last):\n  boom"}, {"stack": "Stack (most recent call last)"},
                  {"logger": "shiftnode.engine"}, {"logger_name": "x"}):
        ed = {"event": "engine_listener_failed", "level": "error", "device": "cpu:0", **extra}
        assert fast(None, "error", dict(ed)) == full(None, "error", dict(ed))


@pytest.mark.quick
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


def _sample(at_s, prompt, gen, switches, running=0, waiting=0, used=0):
    return StatsSample(at_s, prompt, gen, switches, running, waiting, used, 200, {"cpu:0": "decode", "cpu:1": "prefill"})


@pytest.mark.quick
def test_the_stats_line_is_vllms_and_an_idle_interval_writes_none():
    fields = stats_fields(_sample(100.0, 1000, 5000, 7), _sample(110.0, 1512, 7048, 10, running=3, waiting=2, used=9))
    assert fields["summary"] == ("Avg prompt throughput: 51.2 tokens/s, Avg generation throughput: 204.8 tokens/s, "
                                 "Running: 3 reqs, Waiting: 2 reqs, KV cache usage: 4.5%, "
                                 "roles: cpu:0=decode cpu:1=prefill, switches: 3")
    assert {k: v for k, v in fields.items() if k != "summary"} == {
        "prompt_tokens_per_s": 51.2, "generation_tokens_per_s": 204.8, "running": 3, "waiting": 2, "kv_usage_pct": 4.5,
        "roles": {"cpu:0": "decode", "cpu:1": "prefill"}, "switches": 3, "interval_s": 10.0}
    assert stats_fields(_sample(0.0, 10, 20, 1), _sample(10.0, 10, 20, 1)) is None  # idle: no line
    assert stats_fields(_sample(0.0, 10, 20, 1), _sample(10.0, 10, 20, 1, waiting=1)) is not None  # one waits
    tail = stats_fields(_sample(0.0, 10, 20, 1), _sample(10.0, 10, 30, 1))  # a burst's last tokens, nothing left
    assert tail["generation_tokens_per_s"] == 1.0 and tail["running"] == 0


@pytest.mark.quick
def test_the_console_shows_a_summary_alone_and_json_keeps_every_field():
    ed = {"event": "stats", "level": "info", "timestamp": "2026-12-07T10:00:00Z", "summary": "Avg prompt throughput: 1",
          "running": 3, "roles": {"cpu:0": "decode"}}
    assert ConsoleLines()(None, "info", dict(ed)) == f"2026-12-07T10:00:00Z [info     ] {'stats':<30} Avg prompt throughput: 1"
    assert json.loads(structlog.processors.JSONRenderer()(None, "info", dict(ed))) == ed


@pytest.mark.quick
def test_levels_and_request_lines(capsys):
    try:
        for level, requests, shown, lines in (("info", False, {"info", "warning"}, False),
                                              ("info", True, {"info", "warning"}, True),
                                              ("debug", False, {"debug", "info", "warning"}, True),
                                              ("warning", True, {"warning"}, True),
                                              ("error", False, set(), False)):
            configure_logging("json", level, requests)
            logger = structlog.get_logger("test")
            for name in ("debug", "info", "warning"):
                getattr(logger, name)(f"at_{name}")
            seen = {json.loads(line)["level"] for line in capsys.readouterr().err.splitlines()}
            assert seen == shown and request_lines() is lines, (level, requests)
    finally:  # the pytest process's own set-up again (structlog's defaults, no request lines)
        configure_logging("console", "info", False)
        structlog.reset_defaults()


@pytest.mark.quick
def test_bad_log_settings_are_refused():
    import pytest

    from node.config import ConfigError, NodeConfig

    with pytest.raises(ConfigError, match="--log-level must be debug, info, warning or error, got 'loud'"):
        NodeConfig(log_level="loud").validate()
    with pytest.raises(ConfigError, match="--stats-interval-s must be at least 0"):
        NodeConfig(stats_interval_s=-1.0).validate()
    NodeConfig(log_level="debug", stats_interval_s=0.0).validate()


def test_a_live_node_logs_stats_not_requests_by_default_and_requests_on_request():
    """Two nodes under the same few requests, the stats line every second: the default one writes its
    start-up lines and stats lines with every field, and no request or role-switch line; the one with
    --log-requests (JSON) writes a line per request and per switch, every field kept. Once idle, neither
    writes another stats line."""
    # adaptive: its free DECODE<->MIXED switches are what the default must keep off the console
    quiet, loud = up(NodeProcess("--mode", "adaptive", "--stats-interval-s", "1", wait=False),
                     NodeProcess("--mode", "adaptive", "--stats-interval-s", "1", "--log-requests", "--log-format",
                                 "json", wait=False))
    try:
        bodies = [{"prompt": f"Once upon a time {k}", "max_tokens": 120, "temperature": 0, "ignore_eos": True}
                  for k in range(4)]
        for node in (quiet, loud):
            assert all(r.status_code == 200 for r in post_concurrently(node, "/v1/completions", bodies, workers=4))
        deadline = time.monotonic() + 30
        while not all("stats" in n.logs() for n in (quiet, loud)) and time.monotonic() < deadline:
            time.sleep(0.2)
        for node in (quiet, loud):
            node.wait_idle()
        time.sleep(2.5)  # the interval that holds the last tokens writes its line; then the nodes are idle
        before = [n.logs().count("stats") for n in (quiet, loud)]
        time.sleep(3.0)
        assert [n.logs().count("stats") for n in (quiet, loud)] == before, "stats lines while idle"

        text = quiet.logs()
        assert "model_loaded" in text and "engines_ready" in text
        stats = [line for line in text.splitlines() if "] stats " in line]
        assert stats and all(f in stats[0] for f in ("Avg prompt throughput:", "tokens/s, Avg generation throughput:",
                                                     "Running:", "Waiting:", "KV cache usage:", "roles: cpu:0=",
                                                     "switches:")), stats
        assert not any(f"] {e} " in text for e in ("request", "role_switch")), text

        events = [json.loads(line) for line in loud.logs().splitlines() if line.startswith("{")]
        requests = [e for e in events if e["event"] == "request"]
        assert len(requests) == 4 and all(r["output_tokens"] == 120 and r["prompt_tokens"] > 0 and "ttft_ms" in r
                                          for r in requests)
        assert any(e["event"] == "role_switch" and "from_role" in e and "to_role" in e for e in events)
        stat = [e for e in events if e["event"] == "stats"]
        assert stat and set(stat[0]) >= {"prompt_tokens_per_s", "generation_tokens_per_s", "running", "waiting",
                                         "kv_usage_pct", "roles", "switches", "interval_s", "summary"}
        assert sum(e["generation_tokens_per_s"] * e["interval_s"] for e in stat) >= 0.9 * 480  # the 4 x 120 tokens
    finally:
        quiet.close()
        loud.close()
